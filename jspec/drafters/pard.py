"""PARD: a small causal LM that drafts k tokens in one pass by appending k - 1 placeholder tokens.

PARD (An et al. 2025, "PARD: Accelerating LLM Inference with Low-Cost PARallel Draft Model Adaptation";
code AMD-AGI/PARD, `pard/pard_infer.py`) keeps the small-LM drafter of jspec.drafters.lm (no target
features, the target's tokenizer) but replaces its k sequential draft steps by one pass. With committed
text x_1 .. x_L (x_L the anchor, the pending token) and a placeholder id m (config.json's top-level
`pard_token`, the attribute vLLM reads as the parallel-drafting token), the pass runs

    [x_1 .. x_L, m, m, ..., m]      (k - 1 copies of m)

and its last k rows give k independent distributions: row L (the anchor's) predicts draft 1, the row of
placeholder j predicts draft j + 1. So q_i = softmax(logits of row L - 1 + i) depends on the committed
text only, never on drafts 1 .. i - 1 (independent per-slot q, as P-EAGLE and DFlash). Draft i is chosen
by `Drafter.choose` at absolute index L + i - 1 (its place in the text), so greedy drafts are the argmax
(the official setting), Gumbel-coupled drafts read the target's noise at that index, and sampled drafts
their own keyed noise.

The cache holds committed text only. The placeholders' K/V rows are written by the pass at rows L ..
L + k - 2, at or beyond the committed length; a later pass attends to cache rows below its first
position only (`ctx_len`), and every round's pass begins at the first committed token the cache does
not hold yet, overwriting those rows with committed tokens. Since the rows beyond an accepted prefix
held placeholders, not the accepted drafts, each round re-feeds every committed token since the last
round (the old anchor and the accepted drafts: at most k + 1) in the same pass, ahead of the new anchor's
placeholders; the pass is 2k rows wide, its positions consecutive.

Dense models only: a recurrent (Gated DeltaNet) drafter's state after the placeholders would be a
state of text that is not committed. The official PARD drafters are dense Llama / Qwen models.

Checkpoints: an HF causal-LM folder whose config.json carries an integer `pard_token` inside the
vocabulary; a plain causal LM (no `pard_token`) stays the "lm" family.

Training (`jspec train pard`; the official `pard/pard_train.py`). One pass holds k copies of the sequence:
depth 0 the text itself, depths d = 1 .. k - 1 the placeholder m, all at the positions of the round they
stand for. Row (a, d) is slot d + 1 of the round anchored at x_a: depth 0 is x_a at position a, depth d the
d-th placeholder at position a + d; it sees the text up to x_a and its own round's placeholders of depth
<= d (`peagle.depth_visible`, the layout P-EAGLE took from PARD) and predicts x_{a+d+1}, so every anchor's
round is trained at once. Conditional drop-token (COD): depth d keeps a random subset of the anchors whose
depth d - 1 row was kept, a fraction max(0.7^d, 0.2) (`peagle.sample_keep`; the official collator draws
exact counts, here each anchor independently with that probability); dropped rows are neither computed as
context nor scored, so a block's kept slots are a prefix. The loss is the run's (default "ce", PARD's
cross-entropy on the training text, here the target's distilled continuations) over every kept slot; the
rollout losses (EDR, Draft-OPD), which read every slot of consecutive rounds, are refused. The run's
drafter section: `pard_token` (required: an id the tokenizer never produces), `block_size` (k, the depths
trained and the drafts per round; default 4) and the model's shape (`num_layers`, `hidden_size`,
`intermediate_size`, `num_heads`, `num_kv_heads`, `head_dim`; the target's where absent); `--init` starts
from a PARD checkpoint of that shape instead (an AR causal LM becomes one by adding `pard_token` to its
config.json, which is how PARD adapts AR drafters).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from jspec.drafters import lm
from jspec.drafters.base import DraftContext, Proposal
from jspec.drafters.family import Family, TrainRecipe, register_family
from jspec.drafters.peagle import depth_visible, sample_keep
from jspec.io.drafters import read_config
from jspec.io.models import is_causal_lm
from jspec.models import target as tm
from jspec.models import transformer
from jspec.verify.sampling import served_logprobs

PARD_KEY = "pard_token"  # config.json, top level (AMD-AGI/PARD checkpoints; vLLM's `hf_config.pard_token`)


def detect(hf: dict) -> bool:
    """A supported causal LM whose config.json names its placeholder token (an int, not a bool)."""
    token = hf.get(PARD_KEY)
    return isinstance(token, int) and not isinstance(token, bool) and is_causal_lm(hf)


@dataclasses.dataclass(frozen=True)
class PARD(lm.SmallLM):
    pard_token: int = -1  # the placeholder id m

    def validate(self, target_cfg, dparams) -> None:
        super().validate(target_cfg, dparams)
        if tm.is_hybrid(self.cfg):
            raise ValueError("PARD drafts with a dense causal LM: a recurrent drafter's state after the "
                             "placeholders is not a committed state; use the 'lm' family for a hybrid drafter")
        if not 0 <= self.pard_token < self.cfg.vocab_size:
            raise ValueError(f"PARD placeholder token {self.pard_token} lies outside the drafter's vocabulary "
                             f"(0 .. {self.cfg.vocab_size - 1}): set `{PARD_KEY}` in config.json to its id")

    def propose(self, dparams, state: lm.SmallLMState, ctx: DraftContext):
        length, k = ctx.length, self.block_size
        # The pass: committed tokens start .. length - 1 (n of them, the anchor last), then k - 1
        # placeholders, then padding; every slot j sits at position start + j.
        start = jnp.maximum(jnp.minimum(state.fed, length - 1), length - (k + 1))
        start = jnp.maximum(start, 0)
        n = length - start  # 1 .. k + 1 for a live row
        width = 2 * k
        j = jnp.arange(width)[None]
        pos = start[:, None] + j
        committed = jnp.take_along_axis(ctx.tokens, jnp.clip(pos, 0, ctx.tokens.shape[1] - 1), axis=1)
        toks = jnp.where(j < n[:, None], committed, jnp.int32(self.pard_token))
        hidden, cache, _, _ = tm.forward(dparams, self.cfg, toks, pos, state.cache)
        rows = jnp.clip(n[:, None] - 1 + jnp.arange(k)[None], 0, width - 1)  # the anchor's row, then m's
        h = jnp.take_along_axis(hidden, rows[:, :, None], axis=1)
        index = length[:, None] + jnp.arange(k)[None]
        drafts, logp = self.choose(ctx, tm.logits(dparams, self.cfg, h), index)
        q = logp if ctx.needs_q else None
        # Rows >= length (placeholders, padding) are never read: the next pass starts at `length`.
        return Proposal(drafts, q), lm.SmallLMState(cache, length)


def load(path: str, target, dtype) -> tuple[PARD, dict]:
    """A PARD checkpoint: the causal LM as `lm.load` reads it (the tokenizer check included) and its
    placeholder id."""
    hf = read_config(path)
    if not detect(hf):
        raise ValueError(f"{path!r} is no PARD checkpoint: its config.json needs an integer `{PARD_KEY}` "
                         "(the placeholder id) on a supported causal LM")
    small, params = lm.load(path, target, dtype)
    token = hf[PARD_KEY]
    if not 0 <= token < small.cfg.vocab_size:
        raise ValueError(f"{path!r}: `{PARD_KEY}` {token} lies outside the model's vocabulary "
                         f"(0 .. {small.cfg.vocab_size - 1}): fix the id in config.json")
    return PARD(cfg=small.cfg, pard_token=token), params


def save(path: str, drafter: PARD, params: dict, dtype=None) -> None:
    """The causal-LM folder of `lm.save` with `pard_token` added to config.json."""
    lm.save(path, drafter, params, dtype)
    cfg_path = os.path.join(path, "config.json")
    hf = read_config(path)
    hf[PARD_KEY] = int(drafter.pard_token)
    with open(cfg_path, "w") as f:
        json.dump(hf, f, indent=2)


def with_shape(drafter: PARD, block_size: int, tree_budget: int) -> PARD:
    if tree_budget:
        raise ValueError("the PARD drafter drafts chains: drop the tree budget for it")
    return dataclasses.replace(drafter, block_size=block_size)


def example(target) -> tuple[PARD, Any]:
    """The target as its own PARD drafter (untrained for placeholders), the last vocabulary id as m."""
    return PARD(cfg=target.cfg, block_size=3, pard_token=target.cfg.vocab_size - 1), target.params


# --- training ----------------------------------------------------------------------------------------------

SHAPE_KEYS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")


def _build(run: dict, target, key) -> tuple[PARD, dict]:
    """A random PARD drafter from the run config's drafter section (module docstring)."""
    section = run["drafter"]
    token = section["pard_token"]
    block = section.get("block_size", 4)
    shape = {k: section.get(k) for k in SHAPE_KEYS}
    if tm.is_hybrid(target.cfg):
        raise ValueError("a PARD drafter is a dense causal LM with the target's tokenizer: train it next to a "
                         "dense target of that tokenizer (its shape comes from the run config)")
    for name, value in (("block_size", block), *shape.items()):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"the PARD drafter's {name} must be an int >= 1, got {value!r}")
    if block < 2:
        raise ValueError(f"the PARD drafter's block_size must be >= 2 (one pass drafts block_size tokens over "
                         f"block_size - 1 placeholders), got {block}")
    cfg = dataclasses.replace(target.cfg, **{k: v for k, v in shape.items() if v is not None},
                              layer_types=(), sliding_window=None)
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < cfg.vocab_size:
        raise ValueError(f"pard_token {token!r} must be a token id in [0, {cfg.vocab_size}): one the tokenizer never "
                         "produces")
    params = transformer.init_params(cfg, key, std=run.get("init_std", 0.02))
    return PARD(cfg=cfg, block_size=block, pard_token=token), params


def train_logp(params, drafter: PARD, tokens: jax.Array, keep: jax.Array) -> jax.Array:
    """Draft log-probs [B, T, k, V]: row (a, d) of the one training pass (module docstring) over tokens [B, T],
    keep [k, B, T] (depth 0 all kept; rows not kept hold garbage)."""
    k, (b, t) = drafter.block_size, tokens.shape
    cfg = drafter.cfg
    depth = jnp.repeat(jnp.arange(k, dtype=jnp.int32), t)
    toks = jnp.concatenate([tokens, jnp.full((b, (k - 1) * t), drafter.pard_token, tokens.dtype)], axis=1)
    pos = jnp.broadcast_to(jnp.tile(jnp.arange(t, dtype=jnp.int32), k) + depth, (b, k * t))
    rows = jnp.broadcast_to(jnp.arange(k * t, dtype=jnp.int32), (b, k * t))
    hidden, _, _, _ = tm.forward(params, cfg, toks, pos, tm.init_cache(cfg, b, k * t, params["embed"].dtype),
                                 ctx_len=jnp.zeros((b,), jnp.int32), cache_rows=rows, tree_mask=depth_visible(keep),
                                 kv_chunk=None)
    logp = jax.nn.log_softmax(tm.logits(params, cfg, hidden).astype(jnp.float32), axis=-1)
    return jnp.moveaxis(logp.reshape(b, k, t, -1), 1, 2)


def train_loss(params, target_params, target_cfg, drafter: PARD, spec, batch: dict, key: jax.Array):
    """The run's loss over every kept slot of every anchor's round (module docstring)."""
    from jspec.train import drafter as train_drafter
    from jspec.train import losses

    if spec.name in losses.WINDOW_LOSSES:
        raise ValueError(f"PARD training drops slots at random (conditional drop-token), which the rollout loss "
                         f"{spec.name!r} cannot read: use a block loss such as 'ce' (PARD's), 'kl' or 'bv'")
    tokens, loss_mask = batch["tokens"], batch["loss_mask"]
    b, t = tokens.shape
    k = drafter.block_size
    _, target_logp = train_drafter.target_pass(target_params, target_cfg, tokens, ())
    anchors = jnp.broadcast_to(jnp.arange(t), (b, t))
    labels, mask, p_t = train_drafter.block_targets(k, tokens, loss_mask, target_logp, anchors,
                                                    jnp.ones((b, t), bool))
    keep = sample_keep(key, b, t, depths=k)
    mask = mask * jnp.moveaxis(keep, 0, -1)  # nested keeps: a kept prefix of each block
    draft_logp = train_logp(params, drafter, tokens, keep)
    loss = train_drafter.distribution_loss(spec, draft_logp, p_t, labels, mask)
    return loss, train_drafter.metrics(draft_logp, p_t, labels, mask)


def offline_blocks(target_params, target_cfg, drafter: PARD, dparams, taps, tokens, sampling):
    """The offline evaluator's rounds (`Family.offline`): the training pass with every row kept; no slot reads
    a draft."""
    keep = jnp.ones((drafter.block_size,) + tokens.shape, bool)
    logp = train_logp(dparams, drafter, tokens, keep)

    def blocks(anchors):
        rows = logp[jnp.arange(tokens.shape[0])[:, None], anchors]
        return rows, served_logprobs(rows, sampling)
    return blocks


register_family(Family(name="pard", drafter=PARD, detect=detect, load=load, save=save, with_shape=with_shape,
                       example=example, recipe=TrainRecipe(build=_build, loss=train_loss), offline=offline_blocks,
                       summary="a small causal LM drafting k tokens in one pass over k - 1 `pard_token` placeholders"))
