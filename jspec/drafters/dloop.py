"""DLoop: more drafting stages before one target check, while the drafter stays confident.

A stage is one chain of g drafts of a block drafter (DFlash, DFlash2 or DSpark: their `stage`). After
each stage the drafter's summed log-probabilities of that stage's drafts (at temperature 1, the
drafter's own distribution: DSpark's corrected one, DFlash2's selector) are compared with a fixed
threshold; above it, another stage is drafted, with the previous stage's last draft as the anchor and,
for the positions the target has not seen, the drafter's own final-normed hidden states of the
previous stage (slots 0 .. g - 1, at their positions) standing in for the fused target features. One
target pass then verifies every stage drafted: at most S g tokens plus the anchor, where S separate
checks could commit S (g + 1).

Exactness. Every stage's drafts are submitted, and whether another stage follows reads only drafts
already made, so the number of drafts is a stopping time: token-wise verification is exact with the
q each stage reports (the law of its draws given everything drawn before), and so is block
verification (checked by exact enumeration, tests/test_verify_chain_exact.py). Greedy and Gumbel
verification need no q. A row's stage count travels as `Proposal.length`; the verify pass runs at
the smallest width bucket that holds the longest row.

Trees (`tree_budget` N > 0, `--tree-budget N`): every stage drafts its argmax chain (the gate reads its
log-probs as above), so the whole proposal is a function of the context, and one DDTree of N nodes
(jspec.drafters.ddtree) is built over the per-slot marginals of the stages drafted (depth up to S g:
stage s + 1's marginals were computed after stage s's argmax chain, the independence DDTree already
assumes within a block; a row whose gate closed gets no node past its last stage). The backbone's own
marginals are read (DFlash's logits, DSpark's unary head, DFlash2's backbone logits: DFlash2's own tree
follows its selector, which a stage-crossing tree does not). Children are fixed choices, verified by
the tree rules for deterministic children.

Provisional features never become context: they are written into the drafter's context cache at
rows the round's commit rewrites from the target's own taps before any later block may read them
(a block reads rows strictly before its anchor, and every row before the next anchor is committed).
Which hidden state stands in for a target feature is not published; the final-normed slot states are
this module's choice (they have the feature's width and norm). Without loop-aware training, a drafter
sees such features only here.

Loop-aware training (`jspec train dloop`: a DFlash run config whose drafter section adds `stages` and
`threshold`): every sampled anchor a drafts stage 1 as DFlash training does; stage s + 1 is then
unrolled at anchor a + s g on the true token there (teacher forcing), its context the target's features
before a plus the provisional features of the stages before it, exactly as at inference. The loss is
the run's loss on the first stage plus the same loss on the last (published: "supervise the first and
the last"); gradients flow through the provisional features into the earlier stages.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp

from jspec.drafters import ddtree, dflash
from jspec.drafters.base import DraftContext, Proposal, Wrapper
from jspec.drafters.dflash import DFlash, write_features
from jspec.drafters.family import Family, TrainRecipe, detect_config, family_of, register_family
from jspec.errors import CheckpointError
from jspec.io.drafters import read_config
from jspec.models.attention import write_block
from jspec.train import drafter as train_drafter
from jspec.train.runfiles import atomic_text
from jspec.verify.rules import GREEDY
from jspec.verify.sampling import served_logprobs


@dataclasses.dataclass(frozen=True)
class DLoop(Wrapper):
    # inner: a chain block drafter with `stage` (DFlash, DFlash2, DSpark)
    stages: int = 2  # S: at most this many stages per round
    threshold: float = -2.0  # another stage while the last stage's summed drafter log-prob exceeds this
    tree_budget: int = 0  # N > 0: one DDTree of N nodes over the drafted stages (module docstring)

    def __post_init__(self):
        if self.inner is None or not hasattr(self.inner, "stage"):
            raise ValueError(f"DLoop drafts in stages of a block drafter (DFlash, DFlash2, DSpark), not "
                             f"{type(self.inner).__name__}")
        if self.inner.kind != "chain":
            raise ValueError("DLoop drafts in chains of its backbone: give it a block drafter without a tree budget "
                             "and set DLoop's own tree_budget for a tree over the stages")
        if isinstance(self.tree_budget, bool) or not isinstance(self.tree_budget, int) or self.tree_budget < 0:
            raise ValueError(f"DLoop tree_budget must be an int >= 0, got {self.tree_budget!r}")
        if not isinstance(self.stages, int) or isinstance(self.stages, bool) or self.stages < 1:
            raise ValueError(f"DLoop stages must be an int >= 1, got {self.stages!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or math.isnan(self.threshold):
            raise ValueError(f"DLoop threshold must be a number (a summed log-probability), got {self.threshold!r}")

    @property
    def stage_drafts(self) -> int:
        return self.inner.num_drafts

    @property
    def kind(self) -> str:  # type: ignore[override]
        return "tree" if self.tree_budget else "chain"

    @property
    def num_drafts(self) -> int:
        return self.tree_budget or self.stages * self.stage_drafts

    @property
    def max_depth(self) -> int:
        depth = self.stages * self.stage_drafts
        return min(self.tree_budget, depth) if self.tree_budget else depth

    def propose(self, dparams, state, ctx: DraftContext):
        g, b = self.stage_drafts, ctx.length.shape[0]
        if self.tree_budget:  # argmax chains: the tree's children are fixed choices
            ctx = dataclasses.replace(ctx, policy=GREEDY)
        prop, own, hidden, marginals = self.inner.stage(dparams, state, ctx)
        tokens, rows, logits, drafted = [prop.tokens], [prop.q_logp], [marginals], [jnp.ones((b,), bool)]
        length = jnp.full((b,), g, jnp.int32)
        go = jnp.sum(own, axis=-1) > self.threshold
        text = ctx.tokens
        for s in range(1, self.stages):
            anchor_pos = ctx.length - 1 + s * g  # this stage's anchor: the previous stage's last draft
            start = anchor_pos - g  # the previous stage's positions, which the target has not seen
            keep = jnp.broadcast_to(go[:, None], (b, g))
            state = write_features(dparams, self.inner.cfg, state, hidden[:, :g], start, keep)
            text = write_block(text, tokens[-1], start + 1, axis=1)
            stage_ctx = dataclasses.replace(ctx, tokens=text, length=ctx.length + s * g, round_start=ctx.noise_start)

            def draft(stage_ctx=stage_ctx, state=state):
                p, o, h, m = self.inner.stage(dparams, state, stage_ctx)
                return p.tokens, p.q_logp, o, h, m

            def skip():  # no row goes on: padding, never verified
                return jax.tree_util.tree_map(jnp.zeros_like, jax.eval_shape(draft))

            new_tokens, new_rows, own, hidden, marginals = jax.lax.cond(jnp.any(go), draft, skip)
            tokens.append(new_tokens)
            rows.append(new_rows)
            logits.append(marginals)
            drafted.append(go)
            length = jnp.where(go, length + g, length)
            go = go & (jnp.sum(own, axis=-1) > self.threshold)
        if self.tree_budget:
            logq = jnp.concatenate([jnp.where(d[:, None, None], jax.nn.log_softmax(m.astype(jnp.float32), axis=-1),
                                              -jnp.inf) for m, d in zip(logits, drafted)], axis=1)
            tree, parent, depth = jax.vmap(lambda lq: ddtree.build_tree(lq, self.tree_budget))(logq)
            return Proposal(tree, None, parent, depth), state
        q = None if rows[0] is None else jnp.concatenate(rows, axis=1)
        return Proposal(jnp.concatenate(tokens, axis=1), q, length=length), state


# --- checkpoints: a block drafter's folder with a dloop_config section ------------------------------------
# config.json of the wrapped drafter (z-lab DFlash / DFlash2, DeepSpec DSpark) plus
# `"dloop_config": {"stages": S, "threshold": T}`; the tensors are the wrapped drafter's.

_KEYS = ("stages", "threshold")


def _detect(hf: dict) -> bool:
    return "dloop_config" in hf


def _load(path: str, target, dtype) -> tuple[DLoop, dict]:
    hf = read_config(path)
    where = os.path.join(path, "config.json")
    loop = hf["dloop_config"]
    if not isinstance(loop, dict) or set(loop) != set(_KEYS):
        raise CheckpointError(f"{where}: dloop_config must hold exactly {list(_KEYS)}, got {loop!r}")
    inner_family = detect_config({k: v for k, v in hf.items() if k != "dloop_config"}, path, wrapping=False)
    inner, params = inner_family.load(path, target, dtype)
    try:
        return DLoop(inner=inner, stages=loop["stages"], threshold=float(loop["threshold"])), params
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from e


def _save(path: str, drafter: DLoop, params: dict, dtype=None) -> None:
    family_of(drafter.inner).save(path, drafter.inner, params, dtype)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        hf = json.load(f)
    hf["dloop_config"] = {"stages": drafter.stages, "threshold": drafter.threshold}
    atomic_text(cfg_path, json.dumps(hf, indent=2))


def with_shape(drafter: DLoop, block_size: int, tree_budget: int) -> DLoop:
    """The backbone at `block_size` (a chain per stage); a tree budget builds one DDTree over the stages."""
    inner = family_of(drafter.inner).with_shape(drafter.inner, block_size, 0)
    return dataclasses.replace(drafter, inner=inner, tree_budget=tree_budget)


# --- loop-aware training ----------------------------------------------------------------------------------


def _build(run: dict, target, key) -> tuple[DLoop, dict]:
    """A DFlash backbone from the run's drafter section, looped with its `stages` (default 2) and
    `threshold` (default -2.0)."""
    inner, params = dflash._build(run, target, key)
    section = run["drafter"]
    stages, threshold = section.get("stages", 2), section.get("threshold", -2.0)
    return DLoop(inner=inner, stages=stages, threshold=threshold), params


def stage_logps(params, target_params, target_cfg, drafter: DLoop, tokens, taps, anchors) -> list:
    """Draft log-probs [B, A, g, V] of every stage unrolled from anchors [B, A] (stage s anchored at
    a + s g on the text's token), each block with its own context: the target's features before a, then
    the provisional features of its earlier stages (the slots' final-normed hidden states)."""
    cfg = drafter.inner.cfg
    g, (b, t), n = cfg.num_drafts, tokens.shape, anchors.shape[1]
    embed = target_params["embed"]
    ctx_k, ctx_v = dflash.context_kv(params, cfg, taps, jnp.broadcast_to(jnp.arange(t), (b, t)))
    at = lambda pos: jnp.take_along_axis(tokens, jnp.minimum(pos, t - 1), axis=1)
    hidden = dflash.draft_blocks(params, cfg, embed, ctx_k, ctx_v, anchors, dflash.block_inputs(cfg, at(anchors)))
    slots = lambda h: h if cfg.anchor_predicts else h[..., 1:, :]
    out = [jax.nn.log_softmax(dflash.draft_logits(target_params, target_cfg, cfg, slots(hidden)), axis=-1)]
    if drafter.stages == 1:
        return out
    flat = lambda x: jnp.repeat(x, n, axis=0)  # one context per block: [B * A, T, ...]
    ctx_k, ctx_v = tuple(map(flat, ctx_k)), tuple(map(flat, ctx_v))
    hidden = hidden.reshape(b * n, *hidden.shape[2:])
    anchor = anchors.reshape(-1)
    for _ in range(1, drafter.stages):
        k_new, v_new = dflash.feature_kv(params, cfg, hidden[:, :g], anchor[:, None] + jnp.arange(g)[None])
        ctx_k = tuple(write_block(c, new, anchor, axis=1) for c, new in zip(ctx_k, k_new))
        ctx_v = tuple(write_block(c, new, anchor, axis=1) for c, new in zip(ctx_v, v_new))
        anchor = anchor + g
        inputs = dflash.block_inputs(cfg, at(anchor.reshape(b, n)).reshape(-1))
        hidden = dflash.draft_blocks(params, cfg, embed, ctx_k, ctx_v, anchor[:, None], inputs[:, None])[:, 0]
        logits = dflash.draft_logits(target_params, target_cfg, cfg, slots(hidden))
        out.append(jax.nn.log_softmax(logits, axis=-1).reshape(b, n, g, -1))
    return out


def train_loss(params, target_params, target_cfg, drafter: DLoop, spec, batch: dict, key: jax.Array):
    """The run's loss on the first stage plus on the last, unrolled (module docstring)."""
    tokens, loss_mask = batch["tokens"], batch["loss_mask"]
    cfg = drafter.inner.cfg
    taps, target_logp = train_drafter.target_pass(target_params, target_cfg, tokens, cfg.target_layer_ids)
    anchors, valid = train_drafter.anchors_for(spec, key, loss_mask)
    logps = stage_logps(params, target_params, target_cfg, drafter, tokens, taps, anchors)
    total, metrics = 0.0, {}
    for s, draft_logp in sorted({0: logps[0], len(logps) - 1: logps[-1]}.items()):
        stage_anchors = anchors + s * cfg.num_drafts
        labels, mask, p_t = train_drafter.block_targets(cfg.num_drafts, tokens, loss_mask, target_logp,
                                                        stage_anchors, valid & (stage_anchors < tokens.shape[1]))
        total = total + train_drafter.distribution_loss(spec, draft_logp, p_t, labels, mask)
        name = "first" if s == 0 else "last"
        metrics.update({f"{k}_{name}" if s else k: v for k, v in
                        train_drafter.metrics(draft_logp, p_t, labels, mask).items()})
    return total, metrics


def offline_blocks(target_params, target_cfg, drafter: DLoop, dparams, taps, tokens, sampling):
    """The offline evaluator's rounds (`Family.offline`; a DFlash backbone): `stage_logps` unrolls the stages
    on the text (stage s + 1 anchored on the text's token at a + s g, the previous stage's last draft when
    its drafts were accepted). Stage s + 1 is drafted only while each earlier stage's summed log-probs of
    its drafts (the text's tokens) exceed the threshold; its slots have log q = -inf otherwise."""
    if type(drafter.inner) is not DFlash:
        raise TypeError(f"the offline evaluator unrolls DLoop's stages over a DFlash backbone, not "
                        f"{type(drafter.inner).__name__}")
    g, t = drafter.stage_drafts, tokens.shape[1]

    def blocks(anchors):
        logps = stage_logps(dparams, target_params, target_cfg, drafter, tokens, taps, anchors)
        rows = jnp.arange(tokens.shape[0])[:, None, None]
        drafted, go = [], jnp.ones(anchors.shape, bool)
        for s, logp in enumerate(logps):
            drafted.append(jnp.broadcast_to(go[..., None], go.shape + (g,)))
            labels = tokens[rows, jnp.minimum(anchors[..., None] + s * g + 1 + jnp.arange(g), t - 1)]
            own = jnp.sum(jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0], axis=-1)
            go = go & (own > drafter.threshold)
        logits = jnp.concatenate(logps, axis=2)
        logq = jnp.where(jnp.concatenate(drafted, axis=2)[..., None], served_logprobs(logits, sampling), -jnp.inf)
        return logits, logq
    return blocks


def _example(target) -> tuple[DLoop, dict]:
    inner, params = dflash._example(target)
    return DLoop(inner=inner, stages=2, threshold=-3.0), params


register_family(Family(name="dloop", drafter=DLoop, detect=_detect, load=_load, save=_save, with_shape=with_shape,
                       example=_example, wraps=True, recipe=TrainRecipe(build=_build, loss=train_loss),
                       offline=offline_blocks,
                       summary="DLoop: a DFlash / DFlash2 / DSpark folder with a dloop_config section"))
