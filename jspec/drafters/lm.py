"""A separate small autoregressive LM with the target's tokenizer, drafting a chain of g tokens.

Any target architecture serves as a drafter: a dense Llama / Qwen3 model or a hybrid Gated DeltaNet one
(Qwen3-Next / Qwen3.5; a checkpoint of the target's own family, or the target itself as a self-drafter).
It keeps its own cache, holding every committed token before `fed` (for recurrent layers: the state
after exactly those tokens). Each round first feeds, in one pass, the committed tokens whose rows may
be stale: for a recurrent model every one it has not seen (fed .. the anchor, at most g + 1), whose
state after the anchor is the state kept; for a dense model the two newest (the K/V rows of accepted
drafts already hold those tokens). The g drafts then run on top. Draft K/V rows lie beyond the
committed length, are never read, and a later catch-up pass overwrites them, so rejected drafts need no
rollback.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jspec.drafters.base import DraftContext, Drafter, PrefillInfo, Proposal
from jspec.drafters.family import Family, register_family
from jspec.io.models import is_causal_lm, load_model, save_model
from jspec.models import target as tm
from jspec.models.declare import logical_axes


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SmallLMState:
    cache: Any  # the drafter's cache (jspec.models.target.init_cache)
    fed: jax.Array  # [B] committed tokens the cache holds (positions 0 .. fed - 1)


@dataclasses.dataclass(frozen=True)
class SmallLM(Drafter):
    cfg: Any = None  # the drafter model's config: ModelConfig (dense) or HybridConfig
    block_size: int = 4

    @property
    def num_drafts(self) -> int:
        return self.block_size

    def validate(self, target_cfg, dparams) -> None:
        if self.cfg is None:
            raise ValueError("the LM drafter needs its model config: SmallLM(cfg=ModelConfig, ...)")
        if self.cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(
                f"drafter vocabulary ({self.cfg.vocab_size}) differs from the target's ({target_cfg.vocab_size}): "
                "a drafter must share the target's tokenizer"
            )

    def param_axes(self):
        return logical_axes(tm.declarations(self.cfg))

    def init(self, dparams, prefill: PrefillInfo, cache_size: int) -> SmallLMState:
        b, p = prefill.prompts.shape
        cache = tm.init_cache(self.cfg, b, cache_size, dparams["embed"].dtype)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        _, cache, _, _ = tm.forward(dparams, self.cfg, prefill.prompts, positions, cache, lengths=prefill.prompt_len)
        return SmallLMState(cache, prefill.prompt_len)

    def propose(self, dparams, state: SmallLMState, ctx: DraftContext):
        length, g = ctx.length, self.block_size
        # Catch up on the committed tokens start .. length - 1 (the anchor last; rows that are done feed
        # none). A recurrent model must start where its state stopped (fed: at most g + 1 tokens); a dense
        # one only re-feeds the two newest, since accepted drafts left K/V rows of the right tokens.
        if tm.is_hybrid(self.cfg):
            start, width = state.fed, g + 1
        else:
            start, width = jnp.maximum(length - 2, 0), 2
        pos = start[:, None] + jnp.arange(width)[None]
        toks = jnp.take_along_axis(ctx.tokens, jnp.minimum(pos, ctx.tokens.shape[1] - 1), axis=1)
        new = jnp.clip(length - start, 0, width)
        hidden, caught_up, _, _ = tm.forward(dparams, self.cfg, toks, pos, state.cache, lengths=new)
        last = jnp.take_along_axis(hidden, jnp.maximum(new - 1, 0)[:, None, None], axis=1)[:, 0]
        first, first_logp = self.choose(ctx, tm.logits(dparams, self.cfg, last), length)

        def step(carry, i):
            cache, token = carry
            p = (length + i - 1)[:, None]  # the previous draft sits at index length + i - 1
            h, cache, _, _ = tm.forward(dparams, self.cfg, token[:, None], p, cache)
            nxt, logp = self.choose(ctx, tm.logits(dparams, self.cfg, h[:, 0]), length + i)
            return (cache, nxt), (nxt, logp if ctx.needs_q else None)

        (cache, _), (rest, rest_logp) = jax.lax.scan(step, (caught_up, first), jnp.arange(1, g))
        drafts = jnp.concatenate([first[:, None], rest.T], axis=1)
        q = None
        if ctx.needs_q:
            q = jnp.concatenate([first_logp[:, None], jnp.moveaxis(rest_logp, 0, 1)], axis=1)
        # The drafts' K/V rows may stay (never read); the recurrent state is the committed one.
        return Proposal(drafts, q), SmallLMState(tm.keep_recurrent_state(cache, caught_up), start + new)


def load(path: str, target, dtype) -> tuple[SmallLM, dict]:
    """An HF causal LM as a drafter; with a target, it must share the target's tokenizer."""
    cfg, params, tok = load_model(path, dtype)
    ttok = getattr(target, "tokenizer", None)
    if tok is not None and ttok is not None and tok.get_vocab() != ttok.get_vocab():
        raise ValueError(f"drafter {path!r} has a different tokenizer from the target {target.path!r}: "
                         "drafter and target must share one tokenizer")
    return SmallLM(cfg=cfg), params


def save(path: str, drafter: SmallLM, params: dict, dtype=None) -> None:
    save_model(path, drafter.cfg, params, dtype)


def with_shape(drafter: SmallLM, block_size: int, tree_budget: int) -> SmallLM:
    if tree_budget:
        raise ValueError("the small-LM drafter drafts chains: drop the tree budget for it")
    return dataclasses.replace(drafter, block_size=block_size)


register_family(Family(name="lm", drafter=SmallLM, detect=is_causal_lm, load=load, save=save, with_shape=with_shape,
                       example=lambda target: (SmallLM(cfg=target.cfg, block_size=3), target.params),  # self-drafter
                       fallback=True,
                       summary="a small Hugging Face causal LM sharing the target's tokenizer"))
