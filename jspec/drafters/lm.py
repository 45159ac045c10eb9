"""A separate small autoregressive LM with the target's tokenizer, drafting a chain of g tokens.

It keeps its own KV cache. Rollback needs no copy: each round re-feeds the two newest committed
tokens (the token before the anchor, and the anchor) at their positions, which rewrites the only
rows a previous round may have left stale or missing; rows of rejected drafts lie beyond the
committed length and are never read.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafters.base import SAMPLE, DraftContext, Drafter, PrefillInfo, Proposal
from jspec.drafters.family import Family, register_family
from jspec.io.hf import save_params
from jspec.io.models import is_causal_lm, load_model
from jspec.models import target as tm
from jspec.models import transformer
from jspec.models.config import ModelConfig
from jspec.models.declare import logical_axes


@dataclasses.dataclass(frozen=True)
class SmallLM(Drafter):
    cfg: ModelConfig | None = None
    block_size: int = 4

    @property
    def num_drafts(self) -> int:
        return self.block_size

    def validate(self, target_cfg: ModelConfig, dparams) -> None:
        if self.cfg is None:
            raise ValueError("the LM drafter needs its model config: SmallLM(cfg=ModelConfig, ...)")
        if self.cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(
                f"drafter vocabulary ({self.cfg.vocab_size}) differs from the target's ({target_cfg.vocab_size}): "
                "a drafter must share the target's tokenizer"
            )

    def param_axes(self):
        return logical_axes(transformer.declarations(self.cfg))

    def init(self, dparams, prefill: PrefillInfo, cache_size: int):
        b, p = prefill.prompts.shape
        cache = transformer.KVCache.zeros(self.cfg, b, cache_size, dparams["embed"].dtype)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        return transformer.forward(dparams, self.cfg, prefill.prompts, positions, cache).cache

    def propose(self, dparams, cache, ctx: DraftContext):
        length = ctx.length
        pos = jnp.stack([length - 2, length - 1], axis=1)
        toks = jnp.take_along_axis(ctx.tokens, pos, axis=1)
        out = transformer.forward(dparams, self.cfg, toks, pos, cache)
        first, first_logp = self.choose(ctx, transformer.logits(dparams, self.cfg, out.hidden[:, 1]), length)

        def step(carry, i):
            cache, token = carry
            p = (length + i)[:, None]
            o = transformer.forward(dparams, self.cfg, token[:, None], p - 1, cache)
            nxt, logp = self.choose(ctx, transformer.logits(dparams, self.cfg, o.hidden[:, 0]), length + i)
            return (o.cache, nxt), (nxt, logp if ctx.needs_q else None)

        (cache, _), (rest, rest_logp) = jax.lax.scan(step, (out.cache, first), jnp.arange(1, self.block_size))
        drafts = jnp.concatenate([first[:, None], rest.T], axis=1)
        q = None
        if ctx.needs_q:
            q = jnp.concatenate([first_logp[:, None], jnp.moveaxis(rest_logp, 0, 1)], axis=1)
        return Proposal(drafts, q), cache


def load(path: str, target, dtype) -> tuple[SmallLM, dict]:
    """An HF causal LM as a drafter; with a target, it must share the target's tokenizer."""
    cfg, params, tok = load_model(path, dtype)
    if tm.is_hybrid(cfg):
        raise ValueError(f"{path!r} is a hybrid recurrent model: the small-LM drafter runs dense Llama / Qwen3 "
                         "models (a recurrent drafter cannot roll back its state by re-feeding tokens)")
    ttok = getattr(target, "tokenizer", None)
    if tok is not None and ttok is not None and tok.get_vocab() != ttok.get_vocab():
        raise ValueError(f"drafter {path!r} has a different tokenizer from the target {target.path!r}: "
                         "drafter and target must share one tokenizer")
    return SmallLM(cfg=cfg), params


def save(path: str, drafter: SmallLM, params: dict, dtype=None) -> None:
    save_params(path, drafter.cfg, params, dtype=dtype)


def with_shape(drafter: SmallLM, block_size: int, tree_budget: int) -> SmallLM:
    if tree_budget:
        raise ValueError("the small-LM drafter drafts chains: drop the tree budget for it")
    return dataclasses.replace(drafter, block_size=block_size)


register_family(Family(name="lm", drafter=SmallLM, detect=is_causal_lm, load=load, save=save, with_shape=with_shape,
                       summary="a small Hugging Face causal LM sharing the target's tokenizer"))
