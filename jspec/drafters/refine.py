"""D-Loop and DEdit: a DFlash drafter run more than once per round, each pass reading the drafts of the last.

A DFlash block pass drafts every slot at once from [anchor, mask, ..., mask]. Both systems here feed the
block again with some slots holding drafts instead of masks, so a later pass sees what an earlier one
chose; neither adds parameters, both cost one extra draft pass per refinement, and the target still
verifies the final g drafts in one pass.

- **D-Loop** (`PrefixLoop`, family "d-loop"; Chen et al. 2026): boundaries j_1 < j_2 < ... < j_M. After
  pass 1, pass m + 1 reveals the drafts y_1 .. y_{j_m} (block inputs [anchor, y_1 .. y_{j_m}, mask ..])
  and regenerates the suffix y_{j_m + 1} .. y_g. The published method leaves how a boundary is chosen
  open; here the boundaries are fixed settings (a static tuple), so no boundary reads a draft.
- **DEdit** (`DEdit`, family "dedit"; Yu et al. 2026): after pass 1, each of `edit_passes` passes feeds
  the current drafts in every slot ([anchor, y_1 .. y_{W-1}], bidirectional) and re-predicts every slot.

The q a sampling rule reads. Every pass drafts its slots independently given its inputs, and each
pass draws from its own noise stream (`DraftContext.noise_stream`). Condition on the draws a later pass
discards or overwrites (D-Loop: pass m's suffix; DEdit: all earlier passes' tokens). Given them, the
final drafts are independent across slots, slot k drawn from the row of the pass that produced it:
D-Loop slot k from pass m + 1 where j_m < k <= j_{m+1} (j_0 = 0, j_{M+1} = g), DEdit every slot from the
last pass. That row is the law of draft k given the earlier drafts and the hidden draws, and none of
the target's coins enter the hidden draws, so token-wise and block verification with these rows are
exact conditionally on them, hence exact (the rows are what `Proposal.q_logp` carries; the enumeration
in tests/test_refine.py checks both rules, and that the pass-1 rows would not do). The argument needs a
boundary that does not read the draft it keeps (here: fixed) and a fresh stream per pass (a redraw with
the first pass's noise would be coupled to the draw it replaces). Greedy and Gumbel verification read no
q. Both accept a plain DFlash backbone only: DFlash2's selector walk and DSpark's Markov head draw the
slots of one pass in sequence, and a revealed slot would have to enter that walk too.

Training (`jspec train d-loop` / `dedit`, a DFlash run config plus the family's section): D-Loop's
prefix-suffix objective reveals a uniformly drawn prefix of the true block (0 .. g - 1 tokens) and
scores only the slots after it. DEdit scores pass 1 as DFlash does and adds an edit pass over
ProposalMix inputs: each slot shows pass 1's (stop-gradient) argmax with probability equal to pass 1's
confidence in it, else the true token, and the edit pass is scored on every slot. The published mixing
rule is "by confidence"; this form of it is this module's choice.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from jspec.drafters import dflash
from jspec.drafters.base import DraftContext, Proposal, Wrapper
from jspec.drafters.dflash import DFlash, draft_block, draft_logits, draft_slots
from jspec.drafters.family import Family, TrainRecipe, detect_config, family_of, register_family
from jspec.errors import CheckpointError
from jspec.io.drafters import read_config
from jspec.train import drafter as train_drafter
from jspec.train.runfiles import atomic_text
from jspec.verify.sampling import first_argmax, served_logprobs


@dataclasses.dataclass(frozen=True)
class _Refiner(Wrapper):
    """A DFlash backbone drafted in several passes; subclasses say which slots each pass reveals."""

    def __post_init__(self):
        name = type(self).__name__
        if type(self.inner) is not DFlash:
            raise ValueError(f"{name} re-drafts a plain DFlash block drafter, not {type(self.inner).__name__}: "
                             "DFlash2 and DSpark draw a pass's slots in sequence")
        if self.inner.kind != "chain":
            raise ValueError(f"{name} drafts chains: give it a DFlash drafter without a tree budget")

    @property
    def num_drafts(self) -> int:
        return self.inner.num_drafts

    def pass_logits(self, dparams, state, ctx: DraftContext, drafts, revealed: int) -> jax.Array:
        """Per-slot logits [B, g, V] of one pass whose block shows drafts [B, g] in slots 1 .. revealed."""
        cfg = self.inner.cfg
        anchor_pos = ctx.length - 1
        anchor = jnp.take_along_axis(ctx.tokens, anchor_pos[:, None], axis=1)[:, 0]
        inputs = reveal(cfg, anchor, drafts, revealed)
        hidden = draft_block(dparams, cfg, ctx.target_params["embed"], state.k, state.v, anchor, anchor_pos,
                             block_tokens=inputs, kernels=self.inner.kernels)
        return draft_logits(ctx.target_params, ctx.target_cfg, cfg, draft_slots(hidden, cfg))

    def draw(self, ctx: DraftContext, logits, stream: int):
        """Drafts and served log-probs of one pass, from the pass's own noise stream."""
        index = ctx.length[:, None] + jnp.arange(logits.shape[1])[None]
        return self.choose(dataclasses.replace(ctx, noise_stream=stream), logits, index)


def reveal(cfg, anchor, drafts, revealed) -> jax.Array:
    """Block inputs [..., W]: the anchor, then draft i in slot i for i <= revealed and the mask token after
    (slot i sits at anchor position + i, the position of draft i, in both block conventions).
    revealed: an int or an array broadcasting against [..., W - 1]."""
    w = cfg.block_size
    slot = jnp.arange(1, w)
    limit = jnp.asarray(revealed)
    shown = slot <= (limit[..., None] if limit.ndim else limit)
    body = jnp.where(shown, drafts[..., :w - 1], cfg.mask_token_id)
    return jnp.concatenate([anchor[..., None], body.astype(jnp.int32)], axis=-1)


@dataclasses.dataclass(frozen=True)
class PrefixLoop(_Refiner):
    boundaries: tuple[int, ...] = (2,)  # pass m + 1 keeps drafts 1 .. boundaries[m] and regenerates the rest

    def __post_init__(self):
        super().__post_init__()
        b, g = self.boundaries, self.inner.num_drafts
        if (not isinstance(b, tuple) or not b or any(isinstance(j, bool) or not isinstance(j, int) for j in b)
                or list(b) != sorted(set(b)) or b[0] < 1 or b[-1] >= g):
            raise ValueError(f"D-Loop boundaries must be increasing ints in 1 .. {g - 1} (drafts kept before a "
                             f"pass regenerates the rest, g = {g}), got {b!r}")

    def propose(self, dparams, state, ctx: DraftContext):
        g = self.num_drafts
        drafts = jnp.zeros((ctx.length.shape[0], g), jnp.int32)
        drafts, q = self.draw(ctx, self.pass_logits(dparams, state, ctx, drafts, 0), 0)
        for m, j in enumerate(self.boundaries, start=1):
            new, new_q = self.draw(ctx, self.pass_logits(dparams, state, ctx, drafts, j), m)
            suffix = jnp.arange(g) >= j  # 0-based draft index k holds draft k + 1
            drafts = jnp.where(suffix, new, drafts)
            q = jnp.where(suffix[:, None], new_q, q)
        return Proposal(drafts, q if ctx.needs_q else None), state


@dataclasses.dataclass(frozen=True)
class DEdit(_Refiner):
    edit_passes: int = 1  # passes after the first, each re-predicting every slot from the current drafts

    def __post_init__(self):
        super().__post_init__()
        e = self.edit_passes
        if isinstance(e, bool) or not isinstance(e, int) or e < 1:
            raise ValueError(f"DEdit edit_passes must be an int >= 1, got {e!r}")

    def propose(self, dparams, state, ctx: DraftContext):
        g = self.num_drafts
        drafts = jnp.zeros((ctx.length.shape[0], g), jnp.int32)
        drafts, q = self.draw(ctx, self.pass_logits(dparams, state, ctx, drafts, 0), 0)
        for e in range(1, self.edit_passes + 1):
            drafts, q = self.draw(ctx, self.pass_logits(dparams, state, ctx, drafts, g), e)
        return Proposal(drafts, q if ctx.needs_q else None), state


# --- training --------------------------------------------------------------------------------------------

_SLOTWISE = ("ce", "kl", "tv")  # losses that score each slot on its own (a mask may drop any slot)


def _truth(tokens, anchors, w):
    """The true tokens [B, A, W - 1] after each anchor (clamped at the sequence end; the mask drops those)."""
    pos = jnp.minimum(anchors[..., None] + jnp.arange(1, w), tokens.shape[1] - 1)
    return tokens[jnp.arange(tokens.shape[0])[:, None, None], pos]


def _setup(target_params, target_cfg, drafter, spec, batch, key):
    cfg = drafter.inner.cfg
    tokens, loss_mask = batch["tokens"], batch["loss_mask"]
    taps, target_logp = train_drafter.target_pass(target_params, target_cfg, tokens, cfg.target_layer_ids)
    anchors, valid = train_drafter.anchors_for(spec, key, loss_mask)
    labels, mask, p_t = train_drafter.block_targets(cfg.num_drafts, tokens, loss_mask, target_logp, anchors, valid)
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)
    return cfg, tokens, taps, anchors, labels, mask, p_t, anchor_tok


def _logp(params, target_params, target_cfg, cfg, context, tokens, anchors, inputs):
    """Slot log-probs [B, A, g, V] of blocks with the given inputs over `dflash.train_context`'s context."""
    slots = dflash.slot_hidden(params, cfg, target_params["embed"], context, tokens, anchors, inputs)
    return jax.nn.log_softmax(draft_logits(target_params, target_cfg, cfg, slots), axis=-1)


def _check_loss(spec, family: str):
    if spec.name not in _SLOTWISE:
        raise ValueError(f"{family} training scores a subset of the block's slots, which only slot-wise losses "
                         f"allow: set the run's loss to one of {', '.join(_SLOTWISE)} (got {spec.name!r})")


def prefix_loss(params, target_params, target_cfg, drafter: PrefixLoop, spec, batch: dict, key: jax.Array):
    """D-Loop's prefix-suffix objective: a true prefix of 0 .. g - 1 tokens revealed, its suffix scored."""
    _check_loss(spec, "D-Loop")
    k_anchor, k_prefix = jax.random.split(key)
    cfg, tokens, taps, anchors, labels, mask, p_t, anchor_tok = _setup(target_params, target_cfg, drafter, spec,
                                                                      batch, k_anchor)
    context = dflash.train_context(params, cfg, taps, tokens)
    g = cfg.num_drafts
    revealed = jax.random.randint(k_prefix, anchors.shape, 0, g)
    inputs = reveal(cfg, anchor_tok, _truth(tokens, anchors, cfg.block_size), revealed)
    draft_logp = _logp(params, target_params, target_cfg, cfg, context, tokens, anchors, inputs)
    mask = mask * (jnp.arange(g) >= revealed[..., None])
    loss = train_drafter.distribution_loss(spec, draft_logp, p_t, labels, mask)
    return loss, train_drafter.metrics(draft_logp, p_t, labels, mask)


def edit_loss(params, target_params, target_cfg, drafter: DEdit, spec, batch: dict, key: jax.Array):
    """DEdit's objective: pass 1 scored as DFlash's, plus an edit pass over ProposalMix inputs (module
    docstring), every slot scored."""
    _check_loss(spec, "DEdit")
    k_anchor, k_mix = jax.random.split(key)
    cfg, tokens, taps, anchors, labels, mask, p_t, anchor_tok = _setup(target_params, target_cfg, drafter, spec,
                                                                      batch, k_anchor)
    context = dflash.train_context(params, cfg, taps, tokens)
    w = cfg.block_size
    first = _logp(params, target_params, target_cfg, cfg, context, tokens, anchors, reveal(cfg, anchor_tok, labels, 0))
    guess = jax.lax.stop_gradient(jnp.argmax(first, axis=-1)).astype(jnp.int32)
    confidence = jax.lax.stop_gradient(jnp.exp(jnp.max(first, axis=-1)))
    shown = jnp.where(jax.random.uniform(k_mix, guess.shape) < confidence, guess, labels)
    edited = _logp(params, target_params, target_cfg, cfg, context, tokens, anchors, reveal(cfg, anchor_tok, shown, w))
    loss = (train_drafter.distribution_loss(spec, first, p_t, labels, mask)
            + train_drafter.distribution_loss(spec, edited, p_t, labels, mask))
    return loss, train_drafter.metrics(edited, p_t, labels, mask)


def prefix_offline(target_params, target_cfg, drafter: PrefixLoop, dparams, taps, tokens, sampling):
    """The offline evaluator's rounds (`Family.offline`): slot k's row is that of the pass that drafts it,
    with the text's tokens revealed in its prefix (the final drafts there when they were accepted)."""
    cfg, g = drafter.inner.cfg, drafter.num_drafts
    context = dflash.train_context(dparams, cfg, taps, tokens)  # once for every anchor group

    def blocks(anchors):
        anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)
        truth = _truth(tokens, anchors, cfg.block_size)
        logits = None
        for j in (0,) + drafter.boundaries:
            inputs = reveal(cfg, anchor_tok, truth, j)
            row = _logp(dparams, target_params, target_cfg, cfg, context, tokens, anchors, inputs)
            logits = row if logits is None else jnp.where((jnp.arange(g) >= j)[:, None], row, logits)
        return logits, served_logprobs(logits, sampling)
    return blocks


def edit_offline(target_params, target_cfg, drafter: DEdit, dparams, taps, tokens, sampling):
    """The offline evaluator's rounds (`Family.offline`), greedy only: the last pass's rows read every slot of
    the pass before it, whose discarded draws the text does not determine; greedy drafts are a function of
    the context, so their rows are computed pass by pass as `DEdit.propose` does."""
    if not sampling.greedy:
        raise ValueError("the offline evaluator scores DEdit greedy only: at T > 0 its final drafts' law depends "
                         "on the earlier passes' discarded draws, which the text does not fix; use "
                         "SamplingParams(0.0) (or measure T > 0 with the decode loop)")
    cfg = drafter.inner.cfg
    context = dflash.train_context(dparams, cfg, taps, tokens)  # once for every anchor group

    def blocks(anchors):
        anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)
        drafts = jnp.zeros(anchors.shape + (drafter.num_drafts,), jnp.int32)
        shown = 0  # pass 1 sees masks only; each edit pass every slot's current draft
        for _ in range(drafter.edit_passes + 1):
            inputs = reveal(cfg, anchor_tok, drafts, shown)
            logits = _logp(dparams, target_params, target_cfg, cfg, context, tokens, anchors, inputs)
            drafts, shown = first_argmax(logits), drafter.num_drafts
        return logits, served_logprobs(logits, sampling)
    return blocks


def _build_with(cls):
    """A recipe's build: a DFlash from the run's drafter section, wrapped with the family's settings read from
    the same section (D-Loop: boundaries; DEdit: edit_passes; the defaults where absent)."""
    def build(run: dict, target, key):
        inner, params = dflash._build(run, target, key)
        section = run["drafter"]
        settings = {k: section.get(k) for k in _SECTIONS[cls][1]}
        return _make(cls, inner, {k: v for k, v in settings.items() if v is not None},
                     "the run config's drafter section"), params
    return build


# --- checkpoints: a DFlash folder plus the family's section -------------------------------------------------
# config.json of a z-lab DFlash drafter plus `"d_loop_config": {"boundaries": [j, ...]}` (D-Loop) or
# `"dedit_config": {"edit_passes": n}` (DEdit); the tensors are the DFlash drafter's.

_SECTIONS = {PrefixLoop: ("d_loop_config", ("boundaries",)), DEdit: ("dedit_config", ("edit_passes",))}


def _make(cls, inner: DFlash, settings: dict, where: str):
    section, keys = _SECTIONS[cls]
    if set(settings) - set(keys):
        raise ValueError(f"{where}: unknown keys {sorted(set(settings) - set(keys))}; {section} holds {list(keys)}")
    kw = dict(settings)
    if "boundaries" in kw:
        if not isinstance(kw["boundaries"], list | tuple):
            raise ValueError(f"{where}: boundaries must be a list of ints, got {kw['boundaries']!r}")
        kw["boundaries"] = tuple(kw["boundaries"])
    try:
        return cls(inner=inner, **kw)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def _loader(cls):
    section, keys = _SECTIONS[cls]

    def load(path: str, target, dtype):
        hf = read_config(path)
        where = os.path.join(path, "config.json")
        settings = hf[section]
        if not isinstance(settings, dict) or set(settings) != set(keys):
            raise CheckpointError(f"{where}: {section} must hold exactly {list(keys)}, got {settings!r}")
        inner_family = detect_config({k: v for k, v in hf.items() if k != section}, path, wrapping=False)
        if inner_family.name != "dflash":
            raise CheckpointError(f"{where}: {section} wraps a DFlash drafter, but the folder is a "
                                  f"{inner_family.name} checkpoint")
        inner, params = inner_family.load(path, target, dtype)
        try:
            return _make(cls, inner, settings, where), params
        except ValueError as e:
            raise CheckpointError(str(e)) from e
    return load


def _saver(cls):
    section, keys = _SECTIONS[cls]

    def save(path: str, drafter, params: dict, dtype=None) -> None:
        family_of(drafter.inner).save(path, drafter.inner, params, dtype)
        cfg_path = os.path.join(path, "config.json")
        with open(cfg_path) as f:
            hf = json.load(f)
        hf[section] = {k: list(v) if isinstance(v, tuple) else v for k, v in
                       ((k, getattr(drafter, k)) for k in keys)}
        atomic_text(cfg_path, json.dumps(hf, indent=2))
    return save


def with_shape(drafter: _Refiner, block_size: int, tree_budget: int):
    if tree_budget:
        raise ValueError(f"{type(drafter).__name__} drafts chains: leave the tree budget at 0")
    return drafter


def _example(cls, **kw):
    def example(target):
        inner, params = dflash._example(target)
        return cls(inner=inner, **kw), params
    return example


register_family(Family(
    name="d-loop", drafter=PrefixLoop, detect=lambda hf: "d_loop_config" in hf, load=_loader(PrefixLoop),
    save=_saver(PrefixLoop), with_shape=with_shape, example=_example(PrefixLoop, boundaries=(1,)), wraps=True,
    recipe=TrainRecipe(build=_build_with(PrefixLoop), loss=prefix_loss), offline=prefix_offline,
    summary="D-Loop: a DFlash folder with a d_loop_config section (prefix boundaries re-drafted)"))
register_family(Family(
    name="dedit", drafter=DEdit, detect=lambda hf: "dedit_config" in hf, load=_loader(DEdit), save=_saver(DEdit),
    with_shape=with_shape, example=_example(DEdit, edit_passes=1), wraps=True,
    recipe=TrainRecipe(build=_build_with(DEdit), loss=edit_loss), offline=edit_offline,
    summary="DEdit: a DFlash folder with a dedit_config section (edit passes over the whole block)"))
