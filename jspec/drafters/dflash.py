"""DFlash: a parallel drafter conditioned on the target's hidden features.

One forward drafts a whole block: the block stream is [anchor, mask, ..., mask] (embedded with the
target's frozen embedding); every draft layer attends, bidirectionally inside the block, over the
block and over the K/V of the fused target features of committed positions strictly before the
anchor. The fused feature H_ctx = hidden_norm(fc(concat(taps))) is injected into every layer
through that layer's own k_proj / v_proj (with k_norm and RoPE at the feature's absolute position);
H_ctx does not pass through the layer's input norm. Logits come from the target's frozen LM head.

The optional knobs of the official format, applied as the official loader does (`config_from_hf`):
- causal layers (`is_causal`; absent: the sliding layers): block slot i sees slots j <= i only;
- a sliding window acts on absolute positions inside the block too: slots W or more apart are
  mutually masked when the window W is shorter than the block;
- `input_embedding_scale` s: the block input is the target's raw embedding row times s;
- `output_multiplier` m and `final_logit_softcapping` c: draft logits l = m head(h), then
  c tanh(l / c) when c > 0, before any temperature / top-k / top-p (`draft_logits`).

Draft context cache: per draft layer, K/V of H_ctx at committed positions (rows = positions). It is
written at `commit` from the target taps of exactly the committed rows (the old anchor and the
accepted drafts), so rejected rows never enter it; block K/V are computed per round and never
stored. Writing the projected context at commit is equivalent to "feed the uncached features with
the block, then crop back", since a context key/value depends only on its own feature and position.

Block conventions (both supported, named by `anchor_predicts`):
- False (z-lab DFlash / DFlash2): `block_size` B counts the anchor; slots 1..B-1 give B-1 drafts,
  slot k predicting the token at anchor_pos + k.
- True (DeepSpec DSpark and its DFlash baseline): the anchor slot predicts too; B slots give B drafts,
  slot k predicting the token at anchor_pos + k + 1.

With `tree_budget > 0` the per-slot distributions feed a DDTree best-first tree (jspec.drafters.ddtree).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jspec.drafters import ddtree
from jspec.drafters.base import CommitInfo, DraftContext, Drafter, PrefillInfo, Proposal
from jspec.drafters.family import Family, TrainRecipe, register_family
from jspec.io.drafters import load_declared, read_config, required, stack_config, stack_hf, write_checkpoint
from jspec.io.hf import CheckpointError, declared_tensors, export_tensors
from jspec.kernels import draft as fused_draft
from jspec.kernels import use_pallas
from jspec.models import layers, quant, transformer
from jspec.models.attention import KV_CHUNK, write_block
from jspec.models.config import ModelConfig, default_rope_inv_freq
from jspec.models.declare import abstract_tree, declare, init_tree, logical_axes, shapes, unbox
from jspec.train import drafter as train_drafter
from jspec.verify.sampling import log_softmax, log_softmax_at, served_logprobs


def default_target_layer_ids(num_taps: int, num_target_layers: int) -> tuple[int, ...]:
    """n == 1 -> [L // 2]; else round(1 + i (L - 4) / (n - 1)) for i < n (layers 1 .. L - 3)."""
    if num_taps == 1:
        return (num_target_layers // 2,)
    return tuple(int(round(1 + i * (num_target_layers - 4) / (num_taps - 1))) for i in range(num_taps))


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """Static description of a DFlash draft model. `layers` describes the draft decoder stack (Qwen3
    layout with the target's hidden size, heads and head_dim); its vocab_size is the target's."""

    layers: ModelConfig
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    mask_token_id: int
    block_size: int = 16
    anchor_predicts: bool = False
    causal: tuple[bool, ...] = ()  # per draft layer: block slot i sees slots j <= i only; () = no such layer
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0  # c > 0: logits c tanh(l / c); 0 = off

    def __post_init__(self):
        # Token-level settings of the layer stack's config do not apply to a drafter's layers.
        object.__setattr__(self, "layers", dataclasses.replace(self.layers, eos_token_ids=(), bos_token_id=None))
        causal = tuple(bool(c) for c in self.causal)
        if causal and len(causal) != self.layers.num_layers:
            raise ValueError(f"causal has {len(causal)} entries for {self.layers.num_layers} draft layers: "
                             "give one per layer (or () for none)")
        object.__setattr__(self, "causal", causal if any(causal) else ())
        for name, zero_ok in (("input_embedding_scale", False), ("output_multiplier", False),
                              ("final_logit_softcapping", True)):
            value = float(getattr(self, name))
            if not (math.isfinite(value) and (value > 0 or (zero_ok and value == 0))):
                raise ValueError(f"{name} {getattr(self, name)!r} must be a finite number {'>=' if zero_ok else '>'} 0")
            object.__setattr__(self, name, value)

    @property
    def num_drafts(self) -> int:
        return self.block_size if self.anchor_predicts else self.block_size - 1

    @property
    def hidden_size(self) -> int:
        return self.layers.hidden_size

    @property
    def layer_causal(self) -> tuple[bool, ...]:
        return self.causal or (False,) * self.layers.num_layers


class DFlashNet(nn.Module):
    """The DFlash network's parameters, declared once (`jspec.models.declare`): fc [H, n*H],
    hidden_norm [H], norm [H] and the Qwen3 layer stack `layers` (no embedding / head: the target's are
    shared). z-lab tensor names: `fc.weight`, `hidden_norm.weight`, `norm.weight`, `layers.{i}.*`.
    The computation is the pure functions below (`context_kv`, `draft_blocks`) over these parameters."""

    cfg: DFlashConfig
    init_std: float = 0.02
    param_dtype: Any = jnp.float32

    def setup(self):
        h, n = self.cfg.hidden_size, len(self.cfg.target_layer_ids)
        decl = functools.partial(declare, self, std=self.init_std, dtype=self.param_dtype)
        self.fc = decl("fc", (h, n * h), ("embed", "taps"), "normal", "fc.weight")
        self.hidden_norm = decl("hidden_norm", (h,), ("embed",), "ones", "hidden_norm.weight")
        self.norm = decl("norm", (h,), ("embed",), "ones", "norm.weight")
        self.layers = transformer.LayerStack(self.cfg.layers, "layers.", self.init_std, self.param_dtype, name="layers")

    def declare(self):
        return self.fc, self.hidden_norm, self.norm, self.layers.declare()


@functools.lru_cache(maxsize=64)  # tracing the declarations is cheap but not free
def declarations(cfg: DFlashConfig, dtype=jnp.float32) -> dict:
    """Every parameter's declaration (boxes of ShapeDtypeStructs), `layers` as a list."""
    return transformer.from_linen(abstract_tree(DFlashNet(cfg, param_dtype=dtype), DFlashNet.declare)["params"])


def param_shapes(cfg: DFlashConfig) -> dict:
    """fc [H, n*H] ([out, in], as every matrix of the layers), hidden_norm [H], norm [H], layers:
    per-layer transformer dicts (no embedding / head)."""
    return shapes(declarations(cfg))


def init_params(cfg: DFlashConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    tree = init_tree(DFlashNet(cfg, init_std=std, param_dtype=dtype), DFlashNet.declare, key)
    return transformer.from_linen(unbox(tree)["params"])


def fuse(params: dict, cfg: DFlashConfig, taps: jax.Array) -> jax.Array:
    """H_ctx [B, T, H] from taps [n, B, T, H]."""
    x = jnp.concatenate(list(taps), axis=-1)
    fused = layers.linear(x, params["fc"])
    return layers.rms_norm(fused, params["hidden_norm"], cfg.layers.rms_norm_eps)


def context_kv(params: dict, cfg: DFlashConfig, taps: jax.Array, positions: jax.Array):
    """Context K, V of the fused features at `positions` [B, T]: per layer [B, T, Hkv * Dh] (tuples;
    heads flattened, the layout the fused draft kernels read)."""
    return feature_kv(params, cfg, fuse(params, cfg, taps), positions)


def feature_kv(params: dict, cfg: DFlashConfig, h_ctx: jax.Array, positions: jax.Array):
    """Context K, V of context features h_ctx [B, T, H] (fused taps, or a stand-in for them) at positions."""
    lc = cfg.layers
    b, t, _ = h_ctx.shape
    inv_freq = jnp.asarray(default_rope_inv_freq(lc))

    def one(lp, x_k, x_v):
        k = layers.linear(x_k, lp["wk"]).reshape(b, t, lc.num_kv_heads, lc.head_dim)
        k = layers.rope(layers.rms_norm(k, lp["k_norm"], lc.rms_norm_eps), positions, inv_freq)
        return k.reshape(b, t, -1), layers.linear(x_v, lp["wv"])

    # Each matrix multiplies its own (aliased, copy-free) view of h_ctx: given one shared operand, XLA:GPU
    # merged the 2L products into one by concatenating the 2L weight matrices every round (Qwen3-8B-sized
    # DFlash: an 84 MB copy written and read per round, most of the round's temporary memory).
    views = jax.lax.optimization_barrier((h_ctx,) * (2 * len(params["layers"])))
    ks, vs = zip(*(one(lp, *views[2 * i:2 * i + 2]) for i, lp in enumerate(params["layers"])))
    return ks, vs


def draft_blocks(params: dict, cfg: DFlashConfig, embed: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array,
                 anchor_pos: jax.Array, block_tokens: jax.Array, kernels: str = "reference",
                 kv_chunk: int | str | None = None) -> jax.Array:
    """Final-normed hidden states [B, A, W, H] of A blocks per row in one pass (training uses many).

    block_tokens [B, A, W]: block a sits at positions anchor_pos[b, a] + (0..W-1).
    ctx_k, ctx_v: per layer [B, S, Hkv * Dh] context rows (positions = row index). Block a sees context rows
    strictly before its anchor (sliding layers: and j >= anchor + i - (W_s - 1) for slot i) and its
    own block (bidirectionally, or causally in causal layers; a window masks slots W_s or more
    apart: `jspec.kernels.draft.block_visible`); never another block. Rows no block may see are zeroed, so whatever
    they hold (rejected or unwritten memory) cannot leak.
    kernels: "reference" (the jnp layers below), "pallas" (the fused draft-layer kernels of
    jspec.kernels.draft, same result) or "auto" (jspec.kernels.resolve: pallas on TPU).
    kv_chunk: None reads every context row (training, differentiable); a number of rows, or KV_CHUNK
    (the backend's: `attention.step_rows`), reads only the rows up to the furthest anchor, in chunks
    (inference: cost follows the context, not the cache size).
    """
    lc = cfg.layers
    h = block_embeddings(cfg, embed, block_tokens)
    if use_pallas(kernels):
        return fused_draft.draft_stack(params, lc, h, ctx_k, ctx_v, anchor_pos, cfg.causal)
    for i, lp in enumerate(params["layers"]):  # the kernels' pure-jnp reference is the one draft layer
        h = fused_draft.ref_draft_layer(h, lp, ctx_k[i], ctx_v[i], anchor_pos, jnp.int32(lc.windows[i]), lc,
                                        kv_chunk, cfg.layer_causal[i])
    return layers.rms_norm(h, params["norm"], lc.rms_norm_eps)


def block_embeddings(cfg: DFlashConfig, embed, block_tokens: jax.Array) -> jax.Array:
    """The block inputs [..., W, D]: the target's raw embedding rows (as the official code reads them)
    times `input_embedding_scale`."""
    h = quant.embed_rows(embed, block_tokens)
    return h if cfg.input_embedding_scale == 1.0 else (h * cfg.input_embedding_scale).astype(h.dtype)


def block_inputs(cfg: DFlashConfig, anchor_tokens: jax.Array) -> jax.Array:
    """[..., W] block inputs: the anchor token, then mask tokens."""
    masks = jnp.full(anchor_tokens.shape + (cfg.block_size - 1,), cfg.mask_token_id, jnp.int32)
    return jnp.concatenate([anchor_tokens[..., None], masks], axis=-1)


def draft_block(params: dict, cfg: DFlashConfig, embed: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array,
                anchor: jax.Array, anchor_pos: jax.Array, block_tokens: jax.Array | None = None,
                kernels: str = "reference") -> jax.Array:
    """Hidden states [B, W, H] of one block per row (inference): anchor [B], anchor_pos [B];
    block_tokens [B, W] overrides the default [anchor, mask x (W - 1)]; kernels: as `draft_blocks`."""
    tokens = block_inputs(cfg, anchor) if block_tokens is None else block_tokens
    return draft_blocks(params, cfg, embed, ctx_k, ctx_v, anchor_pos[:, None], tokens[:, None], kernels,
                        KV_CHUNK)[:, 0]


def draft_slots(hidden: jax.Array, cfg: DFlashConfig) -> jax.Array:
    """The slots that carry drafts: [B, g, H]."""
    return hidden if cfg.anchor_predicts else hidden[:, 1:]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DFlashState:
    """The context cache: one buffer per draft layer (a slice of a stacked one is a copy per round)."""

    k: tuple[jax.Array, ...]  # per layer [B, S, Hkv * Dh] context keys at committed positions
    v: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, cfg: DFlashConfig, batch: int, size: int, dtype) -> "DFlashState":
        lc = cfg.layers
        shape = (batch, size, lc.num_kv_heads * lc.head_dim)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in range(lc.num_layers)),
                   tuple(jnp.zeros(shape, dtype) for _ in range(lc.num_layers)))


def write_context(params, cfg: DFlashConfig, state: DFlashState, taps, start, keep) -> DFlashState:
    """Project taps [n, B, T, H] at positions start[b] + 0..T-1 into the context cache where keep
    [B, T]: one block write per row and layer (`attention.write_block`), in place."""
    return write_features(params, cfg, state, fuse(params, cfg, taps), start, keep)


def write_features(params, cfg: DFlashConfig, state: DFlashState, h_ctx, start, keep) -> DFlashState:
    """`write_context` of context features h_ctx [B, T, H] themselves."""
    positions = start[:, None] + jnp.arange(h_ctx.shape[1])[None]
    k, v = feature_kv(params, cfg, h_ctx, positions)
    write = lambda cache, new: tuple(write_block(c, n, start, axis=1, keep=keep) for c, n in zip(cache, new))
    return DFlashState(write(state.k, k), write(state.v, v))


def target_head(target_params: dict, target_cfg, hidden: jax.Array) -> jax.Array:
    """The target's own LM head (dense or hybrid target)."""
    from jspec.models import target as tm

    return tm.logits(target_params, target_cfg, hidden)


def draft_logits(target_params: dict, target_cfg, cfg: DFlashConfig, hidden: jax.Array) -> jax.Array:
    """The drafter's logits [..., V] of final-normed draft hidden states: the target's head, times
    `output_multiplier`, soft-capped by `final_logit_softcapping` (the official `compute_logits`)."""
    logits = target_head(target_params, target_cfg, hidden)
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping:
        cap = cfg.final_logit_softcapping
        logits = cap * jnp.tanh(logits / cap)
    return logits


@dataclasses.dataclass(frozen=True)
class DFlash(Drafter):
    cfg: DFlashConfig | None = None
    tree_budget: int = 0
    kernels: str = "reference"  # the draft layers: "reference" | "pallas" | "auto" (see draft_blocks)

    @property
    def kind(self) -> str:  # type: ignore[override]
        return "tree" if self.tree_budget else "chain"

    @property
    def num_drafts(self) -> int:
        return self.tree_budget or self.cfg.num_drafts

    @property
    def max_depth(self) -> int:
        return min(self.tree_budget, self.cfg.num_drafts) if self.tree_budget else self.cfg.num_drafts

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(self.cfg.target_layer_ids)

    def with_kernels(self, kernels: str) -> "DFlash":
        return dataclasses.replace(self, kernels=kernels)

    def validate(self, target_cfg: ModelConfig, dparams) -> None:
        validate_against_target(self.cfg, target_cfg)

    def param_axes(self):
        return logical_axes(declarations(self.cfg))

    def init(self, dparams, prefill: PrefillInfo, cache_size: int) -> DFlashState:
        b, p = prefill.prompts.shape
        state = DFlashState.zeros(self.cfg, b, cache_size, dparams["fc"].dtype)
        # Committed after prefill: the prompt (the first new token is the pending anchor).
        keep = jnp.arange(p)[None] < prefill.prompt_len[:, None]
        return write_context(dparams, self.cfg, state, prefill.taps, jnp.zeros((b,), jnp.int32), keep)

    def block_hidden(self, dparams, state: DFlashState, ctx: DraftContext) -> jax.Array:
        """Final-normed hidden states [B, W, H] of the block at each row's anchor (every slot)."""
        anchor_pos = ctx.length - 1
        anchor = jnp.take_along_axis(ctx.tokens, anchor_pos[:, None], axis=1)[:, 0]
        return draft_block(dparams, self.cfg, ctx.target_params["embed"], state.k, state.v, anchor, anchor_pos,
                           kernels=self.kernels)

    def logits(self, dparams, state: DFlashState, ctx: DraftContext) -> jax.Array:
        """Per-draft logits [B, g, V] for the block after each row's anchor."""
        hidden = self.block_hidden(dparams, state, ctx)
        return draft_logits(ctx.target_params, ctx.target_cfg, self.cfg, draft_slots(hidden, self.cfg))

    def stage(self, dparams, state: DFlashState, ctx: DraftContext):
        """One chain of drafts after the anchor: (Proposal, log-probs [B, g] the drafter (at temperature 1)
        gives its own drafts, block hidden states [B, W, H], the per-slot logits [B, g, V] a DDTree reads).
        What DLoop repeats."""
        hidden = self.block_hidden(dparams, state, ctx)
        logits = draft_logits(ctx.target_params, ctx.target_cfg, self.cfg, draft_slots(hidden, self.cfg))
        index = ctx.length[:, None] + jnp.arange(logits.shape[1])[None]  # draft i is written at length + i
        drafts, logp = self.choose(ctx, logits, index)
        own = log_softmax_at(logits, drafts)
        return Proposal(drafts, logp if ctx.needs_q else None), own, hidden, logits

    def propose(self, dparams, state: DFlashState, ctx: DraftContext):
        if self.tree_budget:
            logits = self.logits(dparams, state, ctx)
            tokens, parent, depth = jax.vmap(
                lambda lg: ddtree.build_tree(log_softmax(lg), self.tree_budget))(logits)
            return Proposal(tokens, None, parent, depth), state
        return self.stage(dparams, state, ctx)[0], state

    def commit(self, dparams, state: DFlashState, info: CommitInfo) -> DFlashState:
        start = info.old_length - 1
        keep = start[:, None] + jnp.arange(info.taps.shape[2])[None] < info.new_length[:, None] - 1
        return write_context(dparams, self.cfg, state, info.taps, start, keep)


def validate_against_target(cfg: DFlashConfig, target_cfg: ModelConfig) -> None:
    """Host-side agreement checks between a DFlash-style drafter and its target."""
    lc = cfg.layers
    problems = []
    if lc.hidden_size != target_cfg.hidden_size:
        problems.append(f"drafter hidden size {lc.hidden_size} != target hidden size {target_cfg.hidden_size}")
    if lc.vocab_size != target_cfg.vocab_size:
        problems.append(f"drafter vocabulary {lc.vocab_size} != target vocabulary {target_cfg.vocab_size}")
    if not 0 <= cfg.mask_token_id < target_cfg.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} is outside the target vocabulary "
                        f"[0, {target_cfg.vocab_size})")
    if cfg.num_target_layers != target_cfg.num_layers:
        problems.append(f"num_target_layers {cfg.num_target_layers} != the target's {target_cfg.num_layers} layers")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target_cfg.num_layers - 1]
    if bad:
        problems.append(
            f"target_layer_ids {list(cfg.target_layer_ids)} include {bad}: tap ids must lie in [0, "
            f"{target_cfg.num_layers - 2}] (never the last layer, whose HF output is post-norm)")
    if cfg.block_size < 1 or (not cfg.anchor_predicts and cfg.block_size < 2):
        problems.append(f"block_size {cfg.block_size} gives no drafts under this block convention")
    if problems:
        raise ValueError("drafter does not fit the target: " + "; ".join(problems))


# --- checkpoints: the z-lab format -----------------------------------------------------------------
# config.json = Qwen3 fields of the draft stack (`num_hidden_layers` = draft depth) plus `block_size`,
# `num_target_layers`, `layer_types`, optional top-level `is_causal`, and `dflash_config: {mask_token_id,
# target_layer_ids, ...}`; tensors `fc.weight [H, n*H]`, `hidden_norm.weight`, `norm.weight`, `layers.i.*`
# (no `model.` prefix, no embedding or LM head). The older naming `encoder.fc.*` /
# `encoder.output_norm_enc.*` is read as `fc.*` / `hidden_norm.*`. `block_size` counts the anchor.
# Settings are read as the official loader reads them: `dflash_config[key]`, else the top-level key, else
# the default (`_draft_value`); `is_causal` only at the top level.

_OLD_NAMES = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
# dflash_config keys with their defaults in the official loader (None: required)
_DRAFT_KEYS = {"mask_token_id": None, "target_layer_ids": None, "block_size": 16, "input_embedding_scale": 1.0,
               "output_multiplier": 1.0, "final_logit_softcapping": None}
# dflash_config keys of drafters that share this layout but compute something else
_OTHER_SYSTEMS = {
    "DFlash2 (dynamic convolutions and a candidate-pair selector)": (
        "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"),
    "Domino (a GRU prefix correction)": ("projector_type", "emb_dim", "gru_hidden_dim", "pure_draft_prefix_len",
                                         "shift_label"),
}


def _draft_value(hf: dict, dc: dict, key: str, where: str):
    """dflash_config's value, else the top level's, else the default; two differing values are refused."""
    if key in dc and key in hf and dc[key] != hf[key]:
        raise CheckpointError(f"{where}: {key} is {hf[key]!r} at the top level but {dc[key]!r} in dflash_config; "
                              "the official loader uses dflash_config's: make the two agree (or drop one)")
    return dc.get(key, hf.get(key, _DRAFT_KEYS[key]))


def is_dflash2_config(hf: dict) -> bool:
    """A DFlash2 config.json: its architecture, or DFlash2 settings in dflash_config."""
    dc = hf.get("dflash_config")
    keys = _OTHER_SYSTEMS["DFlash2 (dynamic convolutions and a candidate-pair selector)"]
    return "DFlash2DraftModel" in (hf.get("architectures") or []) or (
        isinstance(dc, dict) and any(k in dc for k in keys))


def _refuse_other_systems(hf: dict, dc: dict, where: str, own_keys: tuple[str, ...]) -> None:
    archs = hf.get("architectures") or []
    for system, keys in _OTHER_SYSTEMS.items():
        found = [k for k in keys if k in dc and k not in own_keys]
        if found or (system.startswith("DFlash2") and "DFlash2DraftModel" in archs and not own_keys):
            fix = ("load the folder as a drafter (the dflash2 family reads it)" if system.startswith("DFlash2")
                   else "use a DFlash checkpoint")
            raise CheckpointError(f"{where}: this is a {system} checkpoint (architectures {archs}, dflash_config "
                                  f"keys {found}); reading it as plain DFlash would draft from another model: {fix}")
    unknown = sorted(set(dc) - set(_DRAFT_KEYS) - set(own_keys))
    if unknown:
        raise CheckpointError(f"{where}: dflash_config has settings jspec does not implement: {unknown} "
                              f"(known: {sorted(set(_DRAFT_KEYS) | set(own_keys))}); remove them only if they do "
                              "not change the model")


def config_from_hf(hf: dict, own_keys: tuple[str, ...] = (), where: str = "DFlash config") -> DFlashConfig:
    """The DFlash backbone of a z-lab config.json. own_keys: the dflash_config settings that a format
    built on this one (DFlash2) reads itself."""
    (dc,) = required(hf, "dflash_config", where=where)
    if not isinstance(dc, dict):
        raise CheckpointError(f"{where}: dflash_config must be an object, not {type(dc).__name__}")
    _refuse_other_systems(hf, dc, where, own_keys)
    value = lambda key: _draft_value(hf, dc, key, where)
    mask, ids = value("mask_token_id"), value("target_layer_ids")
    if mask is None or ids is None:
        missing = [k for k, v in (("mask_token_id", mask), ("target_layer_ids", ids)) if v is None]
        raise CheckpointError(f"{where}: config.json lacks required fields {missing} (in dflash_config)")
    (n_target,) = required(hf, "num_target_layers", where=where)
    layers_cfg = stack_config(hf)
    if "is_causal" in hf:
        if not isinstance(hf["is_causal"], bool):
            raise CheckpointError(f"{where}: is_causal must be true or false, not {hf['is_causal']!r}")
        causal = (hf["is_causal"],) * layers_cfg.num_layers
    else:  # the official rule without the key: sliding layers are causal inside the block
        causal = tuple(t == "sliding_attention" for t in layers_cfg.all_layer_types)
    try:
        return DFlashConfig(layers=layers_cfg, target_layer_ids=tuple(int(i) for i in ids),
                            num_target_layers=int(n_target), mask_token_id=int(mask), block_size=int(value("block_size")),
                            anchor_predicts=False, causal=causal,
                            input_embedding_scale=value("input_embedding_scale"),
                            output_multiplier=value("output_multiplier"),
                            final_logit_softcapping=value("final_logit_softcapping") or 0.0)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from e


def hf_settings(cfg: DFlashConfig) -> dict:
    """The config.json fields that describe cfg's block attention and logits, in the official form:
    top-level `is_causal` (left out where the official rule for its absence gives the same layers) and
    the non-default `dflash_config` knobs."""
    out: dict = {"dflash_config": {}}
    sliding = tuple(t == "sliding_attention" for t in cfg.layers.all_layer_types)
    causal = cfg.layer_causal
    if causal != sliding:
        if len(set(causal)) != 1:
            raise ValueError(f"causal layers {list(causal)} cannot be written in the DFlash format: is_causal "
                             "applies to every layer, and without it exactly the sliding layers are causal")
        out["is_causal"] = causal[0]
    for key in ("input_embedding_scale", "output_multiplier"):
        if getattr(cfg, key) != 1.0:
            out["dflash_config"][key] = getattr(cfg, key)
    if cfg.final_logit_softcapping:
        out["dflash_config"]["final_logit_softcapping"] = cfg.final_logit_softcapping
    return out


def load_checkpoint(path: str, dtype=jnp.float32) -> tuple[DFlashConfig, dict]:
    """(config, parameters) of a z-lab DFlash checkpoint folder; strict about every tensor."""
    cfg = config_from_hf(read_config(path))
    return cfg, load_declared(path, declarations(cfg), param_shapes(cfg), "DFlash", dtype, _renamed)


def _renamed(found: dict) -> dict:
    """The older release's tensor names read as today's."""
    for old, new in _OLD_NAMES.items():
        found = {(new + n[len(old):] if n.startswith(old) else n): t for n, t in found.items()}
    return found


def save_checkpoint(path: str, cfg: DFlashConfig, params: dict, dtype=None) -> None:
    if cfg.anchor_predicts:
        raise ValueError("the z-lab DFlash format stores block_size counting the anchor: save an "
                         "anchor_predicts drafter with jspec.drafters.dspark.save_checkpoint")
    config = stack_hf(cfg.layers)
    settings = hf_settings(cfg)
    config.update(architectures=["DFlashDraftModel"], model_type="qwen3", block_size=cfg.block_size,
                  num_target_layers=cfg.num_target_layers, **{k: v for k, v in settings.items() if k != "dflash_config"},
                  dflash_config={"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
                                 **settings["dflash_config"]})
    write_checkpoint(path, config, export_tensors(params, declared_tensors(declarations(cfg)), dtype))


# --- training ---------------------------------------------------------------------------------------


def draft_layers_config(target_cfg, num_layers: int) -> ModelConfig:
    """A Qwen3 draft stack of `num_layers` layers with the target's width, heads and vocabulary (dense or
    hybrid target)."""
    if isinstance(target_cfg, ModelConfig):
        return dataclasses.replace(target_cfg, num_layers=num_layers, layer_types=(), qk_norm=True, family="qwen3")
    return ModelConfig(family="qwen3", vocab_size=target_cfg.vocab_size, hidden_size=target_cfg.hidden_size,
                       intermediate_size=target_cfg.intermediate_size, num_layers=num_layers,
                       num_heads=target_cfg.num_heads, num_kv_heads=target_cfg.num_kv_heads,
                       head_dim=target_cfg.head_dim, rms_norm_eps=target_cfg.rms_norm_eps,
                       rope_theta=target_cfg.rope_theta, qk_norm=True,
                       max_position_embeddings=target_cfg.max_position_embeddings)


def config_from_run(section: dict, target_cfg, anchor_predicts: bool) -> DFlashConfig:
    """A DFlash-style backbone from a run config's "drafter" section: num_layers, mask_token_id,
    block_size, and target_layer_ids or num_taps (default 1)."""
    (num_layers, mask, block) = required(section, "num_layers", "mask_token_id", "block_size",
                                         where="the run config's drafter section")
    taps = tuple(section.get("target_layer_ids")
                 or default_target_layer_ids(section.get("num_taps", 1), target_cfg.num_layers))
    cfg = DFlashConfig(layers=draft_layers_config(target_cfg, int(num_layers)), target_layer_ids=taps,
                       num_target_layers=target_cfg.num_layers, mask_token_id=int(mask), block_size=int(block),
                       anchor_predicts=anchor_predicts)
    validate_against_target(cfg, target_cfg)
    return cfg


def train_context(params, cfg: DFlashConfig, taps, tokens):
    """The context K/V (per layer) of every position of tokens [B, T] from the target's taps of them."""
    b, t = tokens.shape
    return context_kv(params, cfg, taps, jnp.broadcast_to(jnp.arange(t), (b, t)))


def slot_hidden(params, cfg: DFlashConfig, embed, context, tokens, anchors, inputs=None):
    """Hidden states of the draft slots [B, A, g, H] for blocks at `anchors` [B, A] over `train_context`'s
    context; inputs: the blocks' input tokens [B, A, W] (default: the anchor, then masks)."""
    if inputs is None:
        inputs = block_inputs(cfg, jnp.take_along_axis(tokens, anchors, axis=1))
    hidden = draft_blocks(params, cfg, embed, *context, anchors, inputs)
    return hidden if cfg.anchor_predicts else hidden[:, :, 1:]


def train_hidden(params, cfg: DFlashConfig, embed, taps, tokens, anchors):
    """Hidden states of the draft slots [B, A, g, H] for blocks at `anchors` [B, A] (one pass)."""
    return slot_hidden(params, cfg, embed, train_context(params, cfg, taps, tokens), tokens, anchors)


def offline_blocks(target_params, target_cfg, drafter: DFlash, dparams, taps, tokens, sampling):
    """The offline evaluator's rounds (`Family.offline`): a block's slots do not read its own drafts."""
    context = train_context(dparams, drafter.cfg, taps, tokens)  # once for every anchor group

    def blocks(anchors):
        hid = slot_hidden(dparams, drafter.cfg, target_params["embed"], context, tokens, anchors)
        logits = draft_logits(target_params, target_cfg, drafter.cfg, hid)
        return logits, served_logprobs(logits, sampling)
    return blocks


def _build(run: dict, target, key) -> tuple[DFlash, dict]:
    cfg = config_from_run(run["drafter"], target.cfg, anchor_predicts=False)
    return DFlash(cfg=cfg), init_params(cfg, key, std=run.get("init_std", 0.02))


def train_loss(params, target_params, target_cfg, drafter: DFlash, spec, batch: dict, key: jax.Array):
    """Scalar loss and metrics of a DFlash drafter (the run's distribution loss over its block slots).
    batch: tokens [B, T], loss_mask [B, T]."""
    cfg = drafter.cfg
    tokens, loss_mask = batch["tokens"], batch["loss_mask"]
    taps, target_logp = train_drafter.target_pass(target_params, target_cfg, tokens, cfg.target_layer_ids)
    anchors, valid = train_drafter.anchors_for(spec, key, loss_mask)
    labels, mask, p_t = train_drafter.block_targets(cfg.num_drafts, tokens, loss_mask, target_logp, anchors, valid)
    hidden = train_hidden(params, cfg, target_params["embed"], taps, tokens, anchors)
    draft_logp = jax.nn.log_softmax(draft_logits(target_params, target_cfg, cfg, hidden), axis=-1)
    loss = train_drafter.distribution_loss(spec, draft_logp, p_t, labels, mask)
    return loss, train_drafter.metrics(draft_logp, p_t, labels, mask)


def _load(path: str, target, dtype) -> tuple[DFlash, dict]:
    cfg, params = load_checkpoint(path, dtype)
    return DFlash(cfg=cfg), params


def _save(path: str, drafter: DFlash, params: dict, dtype=None) -> None:
    save_checkpoint(path, drafter.cfg, params, dtype)


def with_shape(drafter: DFlash, block_size: int, tree_budget: int) -> DFlash:
    """The block size is the checkpoint's (the drafter was trained for it); a tree budget builds DDTree trees."""
    return dataclasses.replace(drafter, tree_budget=tree_budget)


EXAMPLE_RUN = {"drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 0, "num_taps": 1}, "init_std": 0.3}


def _example(target) -> tuple[DFlash, dict]:
    return _build(EXAMPLE_RUN, target, jax.random.key(0))


register_family(Family(name="dflash", drafter=DFlash,
                       detect=lambda hf: "dflash_config" in hf and not is_dflash2_config(hf), load=_load, save=_save,
                       with_shape=with_shape, recipe=TrainRecipe(build=_build, loss=train_loss), offline=offline_blocks,
                       example=_example,
                       summary="z-lab DFlash: config.json with a dflash_config section"))
