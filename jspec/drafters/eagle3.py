"""EAGLE-3: one decoder layer over fused target features, drafting a chain or an EAGLE-2 dynamic tree.

The drafter (Li et al. 2025, "EAGLE-3"; architecture as SpecForge's `LlamaForCausalLMEagle3`,
sgl-project/SpecForge `specforge/modeling/draft/llama3_eagle.py`) reads three target layers' outputs
at each committed position t (the taps u^1_t, u^2_t, u^3_t, low to high) and fuses them:

    g_t = fc(cat[u^1_t, u^2_t, u^3_t])                        fc [H, 3 H_t]

Row t of its one layer, at position t, reads a hidden state g and the embedding of the next token:

    x = cat[input_layernorm(emb(x_{t+1})), hidden_norm(g)]    width 2H (embedding first)
    h = g + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))   Llama attention, RoPE at position t
    a = h + mlp(post_attention_layernorm(h))                 SwiGLU
    q(x_{t+2}) = the served softmax of lm_head(norm(a))        over the draft vocabulary

(`LlamaDecoderLayer.forward`: the residual is g itself, not its norm; `compute_logits` applies `norm`
with the default `norm_output` true.) Rows on committed text take g = g_t; a drafted step takes the
pre-norm output a of the step before it as g (`backbone` returns the layer output, which the
training-time test feeds to the next step). The layer's K/V at row t attend causally over rows
0 .. t. The training-time test keeps row t at position t + i in step i (SpecForge's attention rotates
step i by `position_ids + lck`), so a draft at depth k sits at the position of the token before it, as
here.

Draft vocabulary: `lm_head` has draft_vocab_size rows; draft id d stands for target id d + d2t[d], and
t2d [V] marks the target ids that have one. q is defined on the target vocabulary with q = 0 (log q =
-inf) for the target ids outside the draft vocabulary, so every rule sees one distribution over the
target's ids (Gumbel coupling uses the target's own noise over them).

Taps: jspec's tap i is the output of target layer i (0-based; HF hidden_states[i + 1]). SpecForge's
default capture layers [1, N/2 - 1, N - 4] (`resolve_eagle_capture_layers`) are layer outputs in the
same numbering (SGLang captures the input of layer id + 1), and so are the ids of a SpecForge config's
`eagle_config.eagle_aux_hidden_state_layer_ids`. vLLM counts layer *inputs*: its default (2, N/2,
N - 3) names the same layers, and a draft config's top-level `eagle_aux_hidden_state_layer_ids`
(`get_eagle3_aux_layers_from_config`) is read as inputs, i.e. jspec tap id - 1. Without either field
the taps are SpecForge's default for the target's depth N.

Inference (like jspec.drafters.mtp): the state holds the layer's K/V rows 0 .. fed - 1 (exact, from
committed inputs) and the fused features g of the committed rows not fed yet. Each round feeds those
rows (at most max_depth + 1; the tokens after them are the committed text), the last one (row L - 2,
the anchor's input) giving the first drafts. A chain then runs g - 1 single rows on its own outputs at
rows L - 1, L, ...; the next round's catch-up starts at row L - 1 and overwrites them, so rejected
drafts need no rollback.

EAGLE-2 dynamic tree (Li et al. 2024, "EAGLE-2"; `tree_budget` > 0): with top_k K and depth D =
`block_size`, the K best draft tokens below the anchor form the first frontier, scored by log q. At
each further depth the K frontier nodes run the layer as K rows (at the same position, each seeing the
context, its own expanded ancestors and itself), each proposes its K best children scored by the
cumulative sum of log q along the path, and the K best of those K^2 children become the next frontier.
Of all the candidates, the `tree_budget` with the highest cumulative score are kept: a child's score is
at most its parent's (log q <= 0) and parents come first in the candidate order, which breaks ties, so
the kept set holds every kept node's parent. Children are fixed choices that ignore the verifier's
coins: they are verified as point masses (`tree_children` "deterministic", q rule (2)). Scores use the
drafter's own log-softmax (temperature 1), whatever the serving temperature. `with_shape` sets D and the
budget; K is the drafter's `top_k` field (default 8; EAGLE-2 uses 8-10 with about 60 nodes).

Checkpoints (`load_checkpoint`, `save_checkpoint`) use the official tensor names and config fields (section
below); training (`jspec train eagle3`) is SpecForge's training-time test (section "training").
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafters import ddtree
from jspec.drafters.base import CommitInfo, DraftContext, Drafter, PrefillInfo, Proposal
from jspec.drafters.family import Family, TrainRecipe, register_family
from jspec.errors import CheckpointError
from jspec.io.drafters import read_config, required, write_checkpoint
from jspec.io.hf import assemble, check_tensors, declared_tensors, export_tensors, read_safetensors
from jspec.models import quant
from jspec.models.attention import KV_CHUNK, empty_softmax_stats, online_softmax_step, step_rows, write_block
from jspec.models.config import ModelConfig, default_rope_inv_freq
from jspec.models.declare import abstract_tree, declare, init_tree, logical_axes, shapes, unbox
from jspec.models.layers import linear, lm_logits, rms_norm, rope, swiglu
from jspec.verify.sampling import served_logprobs

# The architectures of an EAGLE-3 draft model's config.json: SpecForge / SGLang's and vLLM's names.
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
MIDLAYER, VLLM_MIDLAYER = "midlayer.", "layers.0."  # the decoder layer's tensor prefix: official, vLLM's
MAPS = ("d2t", "t2d")  # the vocabulary maps: int64 [draft_V] offsets, bool [V] membership
# config.json switches of variants whose computation differs from the layer above, with the value that
# means "as above" (SpecForge `fc_norm`, `norm_output`; vLLM `norm_before_residual`)
_VARIANTS = {"fc_norm": False, "norm_output": True, "norm_before_residual": False, "attention_bias": False,
             "mlp_bias": False}


def default_taps(num_target_layers: int) -> tuple[int, int, int]:
    """SpecForge's capture layers [1, N/2 - 1, N - 4] (layer outputs, jspec's numbering)."""
    n = num_target_layers
    return (1, n // 2 - 1, n - 4)


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Static description of an EAGLE-3 draft model.

    layer: the decoder layer's sizes as a one-layer Llama config (hidden size H, heads, head_dim, MLP,
        RoPE, eps); its vocab_size is the target's V (the embedding's rows).
    draft_vocab_size: rows of lm_head; target_hidden_size: H_t, the width of each tap (fc reads 3 H_t).
    taps: the three target layers whose outputs are fused (jspec numbering: output of layer i).
    own_embedding: the checkpoint carries `embed_tokens.weight` [V, H]; else the target's embedding.
    """

    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    taps: tuple[int, ...]
    own_embedding: bool = False

    def __post_init__(self):
        object.__setattr__(self, "layer", dataclasses.replace(self.layer, eos_token_ids=(), bos_token_id=None))
        object.__setattr__(self, "taps", tuple(int(i) for i in self.taps))
        if self.layer.num_layers != 1:
            raise ValueError(f"an EAGLE-3 drafter has one decoder layer, got num_hidden_layers {self.layer.num_layers}")
        if len(self.taps) != 3:
            raise ValueError(f"EAGLE-3 fuses three target layers, got taps {list(self.taps)}")
        if not 1 <= self.draft_vocab_size <= self.layer.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must lie in [1, vocab_size "
                             f"{self.layer.vocab_size}]")

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


class Eagle3Net(nn.Module):
    """The EAGLE-3 parameters, declared once (`jspec.models.declare`), under their official names: fc
    [H, 3 H_t], the layer (`midlayer.*`: norms [H], q/k/v_proj [*, 2H], o_proj [H, Hq Dh], SwiGLU MLP),
    norm [H], lm_head [draft_V, H] and, when the checkpoint has one, embed_tokens [V, H]. The vocabulary
    map d2t is an integer array beside these (`params["d2t"]`, int32 [draft_V])."""

    cfg: Eagle3Config
    init_std: float = 0.02
    param_dtype: Any = jnp.float32

    def setup(self):
        c = self.cfg.layer
        h, ht, f = c.hidden_size, self.cfg.target_hidden_size, c.intermediate_size
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        decl = functools.partial(declare, self, std=self.init_std, dtype=self.param_dtype)
        m = MIDLAYER
        self.fc = decl("fc", (h, 3 * ht), ("embed", "taps"), "normal", "fc.weight")
        self.hidden_norm = decl("hidden_norm", (h,), ("embed",), "ones", m + "hidden_norm.weight")
        self.input_norm = decl("input_norm", (h,), ("embed",), "ones", m + "input_layernorm.weight")
        self.wq = decl("wq", (q, 2 * h), ("heads", "embed"), "normal", m + "self_attn.q_proj.weight")
        self.wk = decl("wk", (kv, 2 * h), ("kv_heads", "embed"), "normal", m + "self_attn.k_proj.weight")
        self.wv = decl("wv", (kv, 2 * h), ("kv_heads", "embed"), "normal", m + "self_attn.v_proj.weight")
        self.wo = decl("wo", (h, q), ("embed", "heads"), "normal", m + "self_attn.o_proj.weight")
        self.post_norm = decl("post_norm", (h,), ("embed",), "ones", m + "post_attention_layernorm.weight")
        self.w_gate = decl("w_gate", (f, h), ("mlp", "embed"), "normal", m + "mlp.gate_proj.weight")
        self.w_up = decl("w_up", (f, h), ("mlp", "embed"), "normal", m + "mlp.up_proj.weight")
        self.w_down = decl("w_down", (h, f), ("embed", "mlp"), "normal", m + "mlp.down_proj.weight")
        self.norm = decl("norm", (h,), ("embed",), "ones", "norm.weight")
        self.lm_head = decl("lm_head", (self.cfg.draft_vocab_size, h), ("vocab", "embed"), "normal", "lm_head.weight")
        if self.cfg.own_embedding:
            self.embed = decl("embed", (c.vocab_size, h), ("vocab", "embed"), "normal", "embed_tokens.weight")

    def declare(self):
        out = (self.fc, self.hidden_norm, self.input_norm, self.wq, self.wk, self.wv, self.wo, self.post_norm,
               self.w_gate, self.w_up, self.w_down, self.norm, self.lm_head)
        return out + ((self.embed,) if self.cfg.own_embedding else ())


@functools.lru_cache(maxsize=64)  # tracing the declarations is cheap but not free
def declarations(cfg: Eagle3Config, dtype=jnp.float32) -> dict:
    """Every float parameter's declaration (boxes of ShapeDtypeStructs), a flat dict."""
    return abstract_tree(Eagle3Net(cfg, param_dtype=dtype), Eagle3Net.declare)["params"]


def identity_map(cfg: Eagle3Config) -> np.ndarray:
    """d2t of a draft vocabulary that is the target's first draft_vocab_size ids (all offsets 0)."""
    return np.zeros((cfg.draft_vocab_size,), np.int32)


def init_params(cfg: Eagle3Config, key: jax.Array, dtype=jnp.float32, std: float = 0.02, d2t=None) -> dict:
    """Random parameters (norms 1, matrices normal(std)) and the vocabulary map d2t (default: the target's
    first draft_vocab_size ids)."""
    params = dict(unbox(init_tree(Eagle3Net(cfg, init_std=std, param_dtype=dtype), Eagle3Net.declare, key))["params"])
    d2t = identity_map(cfg) if d2t is None else np.asarray(d2t)
    check_vocab_map(np.asarray(d2t), None, cfg, "d2t")
    params["d2t"] = jnp.asarray(d2t, jnp.int32)
    return params


def check_vocab_map(d2t: np.ndarray, t2d: np.ndarray | None, cfg: Eagle3Config, where: str) -> None:
    """d2t must map the draft ids one-to-one into the target vocabulary (target = d + d2t[d]); t2d, when
    given, must mark exactly those target ids. CheckpointError naming the problem."""
    vd, v = cfg.draft_vocab_size, cfg.layer.vocab_size
    ids = np.arange(vd) + d2t.astype(np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= v))
    if bad.size:
        raise CheckpointError(f"{where}: d2t maps draft ids {bad[:8].tolist()} outside the target vocabulary "
                              f"[0, {v}) (target id = d + d2t[d]): the vocabulary map belongs to another target")
    if np.unique(ids).size != vd:
        raise CheckpointError(f"{where}: d2t maps two draft ids to one target id; a draft vocabulary is a set of "
                              "distinct target ids: the map is damaged")
    if t2d is not None:
        marked = np.zeros((v,), bool)
        marked[ids] = True
        if not np.array_equal(marked, t2d.astype(bool)):
            raise CheckpointError(f"{where}: t2d marks {int(t2d.sum())} target ids but d2t maps draft ids to {vd} "
                                  f"(they differ at {int((marked != t2d.astype(bool)).sum())} ids): the two maps "
                                  "must describe one draft vocabulary")


# --- the layer ------------------------------------------------------------------------------------------------


def fuse(params: dict, taps: jax.Array) -> jax.Array:
    """g [B, T, H] = fc(cat of taps [3, B, T, H_t]) (low layer first)."""
    return linear(jnp.concatenate(list(taps), axis=-1).astype(params["fc"].dtype), params["fc"])


def project(params: dict, cfg: Eagle3Config, embedded, hidden, positions):
    """q [B, T, Hq, Dh], k, v [B, T, Hkv, Dh] of rows with token embeddings [B, T, H] and hidden states
    g [B, T, H] at positions [B, T] (RoPE applied to q and k)."""
    c = cfg.layer
    b, t, _ = hidden.shape
    eps = c.rms_norm_eps
    x = jnp.concatenate([rms_norm(embedded.astype(hidden.dtype), params["input_norm"], eps),
                         rms_norm(hidden, params["hidden_norm"], eps)], axis=-1)
    inv_freq = jnp.asarray(default_rope_inv_freq(c))
    q = rope(linear(x, params["wq"]).reshape(b, t, c.num_heads, c.head_dim), positions, inv_freq)
    k = rope(linear(x, params["wk"]).reshape(b, t, c.num_kv_heads, c.head_dim), positions, inv_freq)
    return q, k, linear(x, params["wv"]).reshape(b, t, c.num_kv_heads, c.head_dim)


def finish(params: dict, cfg: Eagle3Config, hidden, attn):
    """The layer's pre-norm output a [B, T, H] from its hidden input g (the residual) and the attention
    output [B, T, Hq, Dh]."""
    b, t = hidden.shape[:2]
    h = hidden + linear(attn.reshape(b, t, -1), params["wo"])
    x = rms_norm(h, params["post_norm"], cfg.layer.rms_norm_eps)
    return h + swiglu(x, params["w_gate"], params["w_up"], params["w_down"])


def draft_logits(params: dict, cfg: Eagle3Config, a: jax.Array) -> jax.Array:
    """Logits [..., draft_V] (float32) of pre-norm outputs a: lm_head(norm(a))."""
    return lm_logits(rms_norm(a, params["norm"], cfg.layer.rms_norm_eps), params["lm_head"])


def target_index(d2t: jax.Array, vocab: int) -> jax.Array:
    """[V] int32: the draft id of each target id, draft_V where the target id has none."""
    vd = d2t.shape[0]
    ids = jnp.arange(vd, dtype=jnp.int32) + d2t.astype(jnp.int32)
    return jnp.full((vocab,), vd, jnp.int32).at[ids].set(jnp.arange(vd, dtype=jnp.int32), mode="drop")


def to_target(logits: jax.Array, index: jax.Array) -> jax.Array:
    """Draft-vocabulary logits [..., draft_V] placed on the target ids [..., V]; -inf (q = 0) elsewhere."""
    pad = jnp.full(logits.shape[:-1] + (1,), -jnp.inf, logits.dtype)
    return jnp.take(jnp.concatenate([logits, pad], axis=-1), index, axis=-1)


def attend(q, k_cache, v_cache, limit, extra=None):
    """Attention output [B, T, Hq, Dh] of q [B, T, Hq, Dh] over cache rows r < limit [B, T] of
    k/v_cache [B, Hkv, S, Dh] and, optionally, extra = (k, v [B, E, Hkv, Dh], visible [B, T, E]) keys
    outside the cache (a tree's expanded nodes). The cache is read in chunks of `step_rows(KV_CHUNK, S)`
    rows up to the highest limit (an online softmax in float32); value rows no query may see are zeroed,
    so whatever they hold cannot leak. A query that sees nothing gets zeros."""
    b, t, hq, dh = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, dh)
    scale = dh**-0.5

    def fold(stats, keys, vals, mask):  # keys, vals [B, Hkv, C, Dh]; mask [B, T, C]
        vals = jnp.where(jnp.any(mask, axis=1)[:, None, :, None], vals, 0).astype(q.dtype)
        scores = jnp.einsum("btkgd,bkcd->bkgtc", qg, keys.astype(q.dtype), preferred_element_type=jnp.float32)
        scores = jnp.where(mask[:, None, None], scores * scale, -jnp.inf)
        return online_softmax_step(stats, scores, vals, "bkgtc,bkcd->bkgtd")

    def chunk(stats, start, size, first):
        rows = start + jnp.arange(size)
        mask = (rows[None, None, :] < limit[:, :, None]) & (rows >= first)[None, None, :]  # a clamped chunk
        keys = jax.lax.dynamic_slice_in_dim(k_cache, start, size, axis=2)  # overlaps rows already folded
        vals = jax.lax.dynamic_slice_in_dim(v_cache, start, size, axis=2)
        return fold(stats, keys, vals, mask)

    stats = empty_softmax_stats((b, hkv, hq // hkv, t), dh)
    c = step_rows(KV_CHUNK, s, queries=t)
    if s <= c:
        stats = chunk(stats, 0, s, 0)
    else:
        n = jnp.clip(-(-jnp.max(limit) // c), 1, -(-s // c))
        stats = jax.lax.fori_loop(0, n, lambda i, st: chunk(st, jnp.minimum(i * c, s - c), c, i * c), stats)
    if extra is not None:
        ek, ev, visible = extra
        stats = fold(stats, jnp.swapaxes(ek, 1, 2), jnp.swapaxes(ev, 1, 2), visible)
    m, l, acc = stats
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)  # [B, Hkv, G, T, Dh]
    return jnp.moveaxis(out, 3, 1).reshape(b, t, hq, dh).astype(q.dtype)


def rows(params: dict, cfg: Eagle3Config, embed, tokens, hidden, positions, k_cache, v_cache):
    """The layer over T consecutive rows per batch row: tokens [B, T] (x_{t+1}), hidden [B, T, H] (g),
    at positions [B, T] (also their cache rows). Their K/V are written first; row t then attends over
    cache rows 0 .. t. Returns (a [B, T, H] pre-norm outputs, k_cache, v_cache)."""
    q, k, v = project(params, cfg, quant.embed_rows(embed, tokens), hidden, positions)
    start = positions[:, 0]
    k_cache = write_block(k_cache, jnp.swapaxes(k, 1, 2), start, axis=2)
    v_cache = write_block(v_cache, jnp.swapaxes(v, 1, 2), start, axis=2)
    return finish(params, cfg, hidden, attend(q, k_cache, v_cache, positions + 1)), k_cache, v_cache


# --- the drafter ----------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Eagle3State:
    k: jax.Array  # [B, Hkv, S, Dh] the layer's K/V; rows < fed are exact
    v: jax.Array
    pending: jax.Array  # [B, max_depth + 1, H] fused features g of the rows fed, fed + 1, ... (not fed yet)
    fed: jax.Array  # [B] rows computed from committed inputs (0 .. fed - 1)


@dataclasses.dataclass(frozen=True)
class Eagle3(Drafter):
    """cfg: the draft model; block_size: drafts per round of a chain, or the depth D of a tree;
    tree_budget: the tree's node count (EAGLE-2 `total_tokens`; 0 = chain); top_k: the tree's K (children
    per expanded node and frontier width), at most the budget and the draft vocabulary."""

    cfg: Eagle3Config | None = None
    block_size: int = 4
    tree_budget: int = 0
    top_k: int = 8

    @property
    def kind(self) -> str:  # type: ignore[override]
        return "tree" if self.tree_budget else "chain"

    @property
    def num_drafts(self) -> int:
        return self.tree_budget or self.block_size

    @property
    def max_depth(self) -> int:
        return min(self.block_size, self.tree_budget) if self.tree_budget else self.block_size

    @property
    def branching(self) -> int:
        """The tree's K as drafted: top_k, at most the budget and the draft vocabulary."""
        return max(1, min(self.top_k, self.tree_budget, self.cfg.draft_vocab_size))

    @property
    def taps(self) -> tuple[int, ...]:
        return self.cfg.taps

    def validate(self, target_cfg, dparams) -> None:
        if self.cfg is None:
            raise ValueError("the EAGLE-3 drafter needs its config: Eagle3(cfg=Eagle3Config(...))")
        validate_against_target(self.cfg, target_cfg)
        if self.block_size < 1 or self.tree_budget < 0 or self.top_k < 1:
            raise ValueError(f"EAGLE-3 draft shape block_size {self.block_size}, tree_budget {self.tree_budget}, "
                             f"top_k {self.top_k}: block_size and top_k must be >= 1, tree_budget >= 0")

    def param_axes(self):
        return {**logical_axes(declarations(self.cfg)), "d2t": ("vocab",)}

    def _embed(self, dparams, target_params):
        return dparams["embed"] if self.cfg.own_embedding else target_params["embed"]

    def init(self, dparams, prefill: PrefillInfo, cache_size: int) -> Eagle3State:
        b, p = prefill.prompts.shape
        c = self.cfg.layer
        dtype = dparams["fc"].dtype
        k = v = jnp.zeros((b, c.num_kv_heads, cache_size, c.head_dim), dtype)
        g = fuse(dparams, prefill.taps)  # [B, P, H]
        if p > 1:  # rows 0 .. P-2: (g_t, x_{t+1}); a shorter prompt's rows past its own are overwritten later
            pos = jnp.broadcast_to(jnp.arange(p - 1, dtype=jnp.int32), (b, p - 1))
            _, k, v = rows(dparams, self.cfg, self._embed(dparams, prefill.target_params), prefill.prompts[:, 1:],
                           g[:, : p - 1], pos, k, v)
        last = jnp.take_along_axis(g, (prefill.prompt_len - 1)[:, None, None], axis=1)  # g at the prompt's end
        pending = jnp.zeros((b, self.max_depth + 1, c.hidden_size), g.dtype).at[:, :1].set(last)
        return Eagle3State(k, v, pending, prefill.prompt_len - 1)

    def catch_up(self, dparams, state: Eagle3State, ctx: DraftContext):
        """Feed the committed rows fed .. length - 2: (a at row length - 2 [B, H], k, v, new fed)."""
        width = state.pending.shape[1]
        start = state.fed
        pos = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
        toks = jnp.take_along_axis(ctx.tokens, jnp.minimum(pos + 1, ctx.tokens.shape[1] - 1), axis=1)
        new = jnp.clip(ctx.length - 1 - start, 0, width)  # none for a row that is done
        a, k, v = rows(dparams, self.cfg, self._embed(dparams, ctx.target_params), toks, state.pending, pos,
                       state.k, state.v)
        last = jnp.take_along_axis(a, jnp.maximum(new - 1, 0)[:, None, None], axis=1)[:, 0]
        return last, k, v, start + new

    def propose(self, dparams, state: Eagle3State, ctx: DraftContext):
        last, k, v, fed = self.catch_up(dparams, state, ctx)
        if self.tree_budget:
            tokens, parent, depth = self._tree(dparams, k, v, last, ctx)
            return Proposal(tokens, None, parent, depth), Eagle3State(k, v, state.pending, fed)
        length, g = ctx.length, self.block_size
        embed = self._embed(dparams, ctx.target_params)
        index = target_index(dparams["d2t"], ctx.target_cfg.vocab_size)
        logits = lambda a: to_target(draft_logits(dparams, self.cfg, a), index)
        first, first_logp = self.choose(ctx, logits(last), length)

        # Depth > 1: the previous draft and, as its hidden state, the previous step's pre-norm output.
        def step(carry, i):
            k, v, a, token = carry
            row = (length - 2 + i)[:, None]  # draft i + 1's input row
            out, k, v = rows(dparams, self.cfg, embed, token[:, None], a[:, None], row, k, v)
            nxt, logp = self.choose(ctx, logits(out[:, 0]), length + i)
            return (k, v, out[:, 0], nxt), (nxt, logp if ctx.needs_q else None)

        (k, v, _, _), (rest, rest_logp) = jax.lax.scan(step, (k, v, last, first), jnp.arange(1, g))
        drafts = jnp.concatenate([first[:, None], rest.T], axis=1)
        q = None
        if ctx.needs_q:
            q = jnp.concatenate([first_logp[:, None], jnp.moveaxis(rest_logp, 0, 1)], axis=1)
        return Proposal(drafts, q), Eagle3State(k, v, state.pending, fed)

    def _tree(self, dparams, k_cache, v_cache, root, ctx: DraftContext):
        """The EAGLE-2 tree below each row's anchor (module docstring): tokens, parent, depth [B, N]."""
        kk, depth_max, budget = self.branching, self.block_size, self.tree_budget
        b, h = root.shape
        d2t = dparams["d2t"].astype(jnp.int32)
        embed = self._embed(dparams, ctx.target_params)
        logq = lambda a: jax.nn.log_softmax(draft_logits(dparams, self.cfg, a), axis=-1)
        # depth 1: the root's K best children
        score, tok = ddtree.top_k(logq(root), kk)  # [B, K]
        scores, draft_ids = [score], [tok]
        parents, depths = [jnp.full((b, kk), -1, jnp.int32)], [jnp.ones((b, kk), jnp.int32)]
        front = jnp.arange(kk, dtype=jnp.int32)[None].repeat(b, 0)  # candidate index of each frontier node
        front_tok, front_score, front_hidden = tok, score, jnp.broadcast_to(root[:, None], (b, kk, h))
        n_slots = kk * (depth_max - 1)
        c = self.cfg.layer
        sk = jnp.zeros((b, n_slots, c.num_kv_heads, c.head_dim), k_cache.dtype)
        sv = jnp.zeros_like(sk)
        anc = jax.nn.one_hot(jnp.arange(kk), n_slots, dtype=jnp.bool_)[None].repeat(b, 0)  # [B, K, slots]
        limit = jnp.broadcast_to((ctx.length - 1)[:, None], (b, kk))  # context rows 0 .. L - 2 (the root's row)
        offset = kk
        for d in range(1, depth_max):  # expand the depth-d frontier into depth-d + 1 candidates
            pos = jnp.broadcast_to((ctx.length - 2 + d)[:, None], (b, kk))
            q, kn, vn = project(dparams, self.cfg, quant.embed_rows(embed, front_tok + d2t[front_tok]), front_hidden,
                                pos)
            sk = jax.lax.dynamic_update_slice_in_dim(sk, kn.astype(sk.dtype), (d - 1) * kk, axis=1)
            sv = jax.lax.dynamic_update_slice_in_dim(sv, vn.astype(sv.dtype), (d - 1) * kk, axis=1)
            a = finish(dparams, self.cfg, front_hidden, attend(q, k_cache, v_cache, limit, (sk, sv, anc)))
            child_score, child_tok = ddtree.top_k(logq(a), kk)  # [B, K, K]
            child_score = (front_score[:, :, None] + child_score).reshape(b, kk * kk)
            child_tok = child_tok.reshape(b, kk * kk)
            scores.append(child_score)
            draft_ids.append(child_tok)
            parents.append(jnp.repeat(front, kk, axis=1))
            depths.append(jnp.full((b, kk * kk), d + 1, jnp.int32))
            if d + 1 < depth_max:  # the next frontier: the K best children
                front_score, pick = jax.lax.top_k(child_score, kk)
                src = pick // kk  # the frontier node each one is a child of
                front = offset + pick
                front_tok = jnp.take_along_axis(child_tok, pick, axis=1)
                front_hidden = jnp.take_along_axis(a, src[:, :, None], axis=1)
                slots = jax.nn.one_hot(d * kk + jnp.arange(kk), n_slots, dtype=jnp.bool_)
                anc = jnp.take_along_axis(anc, src[:, :, None], axis=1) | slots[None]
            offset += kk * kk
        scores, draft_ids = jnp.concatenate(scores, 1), jnp.concatenate(draft_ids, 1)
        parents, depths = jnp.concatenate(parents, 1), jnp.concatenate(depths, 1)
        if offset < budget:  # fewer candidates than the budget: pad with repeats of the best first child
            pad = budget - offset
            scores = jnp.concatenate([scores, jnp.full((b, pad), -jnp.inf, scores.dtype)], 1)
            draft_ids = jnp.concatenate([draft_ids, draft_ids[:, :1].repeat(pad, 1)], 1)
            parents = jnp.concatenate([parents, jnp.full((b, pad), -1, jnp.int32)], 1)
            depths = jnp.concatenate([depths, jnp.ones((b, pad), jnp.int32)], 1)
        keep = jnp.sort(jax.lax.top_k(scores, budget)[1], axis=1)  # the best N, in candidate (topological) order
        node_of = jax.vmap(lambda kept: jnp.full((scores.shape[1],), -1, jnp.int32).at[kept].set(
            jnp.arange(budget, dtype=jnp.int32)))(keep)
        parent = jnp.take_along_axis(parents, keep, axis=1)
        parent = jnp.where(parent >= 0, jnp.take_along_axis(node_of, jnp.maximum(parent, 0), axis=1), -1)
        tok = jnp.take_along_axis(draft_ids, keep, axis=1)
        return tok + d2t[tok], parent, jnp.take_along_axis(depths, keep, axis=1)

    def commit(self, dparams, state: Eagle3State, info: CommitInfo) -> Eagle3State:
        # The committed rows old_length - 1 .. new_length - 2 are the next round's catch-up: their taps are
        # info.taps' first rows, at rows fed (= old_length - 1 after propose) on.
        width = state.pending.shape[1]
        taps = info.taps[:, :, :width]
        if taps.shape[2] < width:
            taps = jnp.pad(taps, ((0, 0), (0, 0), (0, width - taps.shape[2]), (0, 0)))
        return dataclasses.replace(state, pending=fuse(dparams, taps).astype(state.pending.dtype))


def validate_against_target(cfg: Eagle3Config, target_cfg) -> None:
    """Host-side agreement checks between an EAGLE-3 drafter and its target (ValueError naming each)."""
    problems = []
    if cfg.layer.vocab_size != target_cfg.vocab_size:
        problems.append(f"drafter vocab_size {cfg.layer.vocab_size} != target vocabulary {target_cfg.vocab_size} "
                        "(t2d and the embedding cover the target's ids)")
    if cfg.target_hidden_size != target_cfg.hidden_size:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} != the target's hidden size "
                        f"{target_cfg.hidden_size} (fc reads three of its layer outputs)")
    if not cfg.own_embedding and cfg.hidden_size != target_cfg.hidden_size:
        problems.append(f"the drafter has no embed_tokens and its hidden size {cfg.hidden_size} differs from the "
                        f"target's {target_cfg.hidden_size}, so it cannot embed with the target's embedding")
    bad = [i for i in cfg.taps if not 0 <= i < target_cfg.num_layers - 1]
    if bad:
        problems.append(f"taps {list(cfg.taps)} include {bad}: tap ids (layer outputs) must lie in [0, "
                        f"{target_cfg.num_layers - 2}] for this {target_cfg.num_layers}-layer target")
    if problems:
        raise ValueError("EAGLE-3 drafter does not fit the target: " + "; ".join(problems) + ": load the drafter "
                         "trained for this target")


# --- checkpoints ----------------------------------------------------------------------------------------------
# config.json: a Llama config of the one layer (num_hidden_layers 1) with architectures
# [LlamaForCausalLMEagle3] (or vLLM's [Eagle3LlamaForCausalLM]), `draft_vocab_size`, optional
# `target_hidden_size` (default hidden_size) and the tap layers as `eagle_config.eagle_aux_hidden_state_layer_ids`
# (layer outputs) and / or top-level `eagle_aux_hidden_state_layer_ids` (vLLM: layer inputs). Tensors:
# `fc.weight`, `midlayer.*` (or vLLM's `layers.0.*`), `norm.weight`, `lm_head.weight`, `d2t` (int64),
# `t2d` (bool), optional `embed_tokens.weight`. Saving writes the official names, both tap fields and
# num_target_layers (jspec's own record of the target's depth).


def _detect(hf: dict) -> bool:
    return any(a in ARCHITECTURES for a in hf.get("architectures") or ())


def _read_taps(hf: dict, target_cfg, where: str) -> tuple[int, ...]:
    nested = hf.get("eagle_config")
    if nested is not None and not isinstance(nested, dict):
        raise CheckpointError(f"{where}: eagle_config must be an object, not {type(nested).__name__}")
    outputs = (nested or {}).get("eagle_aux_hidden_state_layer_ids")
    inputs = hf.get("eagle_aux_hidden_state_layer_ids")
    for name, ids in (("eagle_config.eagle_aux_hidden_state_layer_ids", outputs),
                      ("eagle_aux_hidden_state_layer_ids", inputs)):
        if ids is not None and (not isinstance(ids, list) or len(ids) != 3
                                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise CheckpointError(f"{where}: {name} must be a list of three layer ids, got {ids!r}")
    if outputs is not None and inputs is not None and [i - 1 for i in inputs] != outputs:
        raise CheckpointError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids {outputs} (layer outputs, "
                              f"SpecForge) and eagle_aux_hidden_state_layer_ids {inputs} (layer inputs, vLLM) name "
                              "different layers: keep the one the drafter was trained with")
    if outputs is not None:
        return tuple(outputs)
    if inputs is not None:
        return tuple(i - 1 for i in inputs)
    n = hf.get("num_target_layers") or (target_cfg.num_layers if target_cfg is not None else None)
    if n is None:
        raise CheckpointError(f"{where}: the config names no tap layers "
                              "(eagle_config.eagle_aux_hidden_state_layer_ids) "
                              "and no num_target_layers, so the default taps [1, N/2 - 1, N - 4] need the target: "
                              "load the drafter with its target")
    return default_taps(int(n))


def config_from_hf(hf: dict, target_cfg=None, own_embedding: bool = False,
                   where: str = "EAGLE-3 config") -> Eagle3Config:
    """The Eagle3Config of a config.json (target_cfg: for the default taps when the file names none)."""
    archs = hf.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        raise CheckpointError(f"{where}: architectures {archs} names no EAGLE-3 draft model (one of "
                              f"{list(ARCHITECTURES)})")
    (draft_vocab,) = required(hf, "draft_vocab_size", where=where)
    changed = [f"{k}: {hf[k]!r}" for k, default in _VARIANTS.items() if k in hf and hf[k] != default]
    if changed:
        raise CheckpointError(f"{where}: {', '.join(changed)} select an EAGLE-3 variant whose layer computes "
                              "something else, which jspec does not implement; use a checkpoint of the standard "
                              f"layer ({', '.join(f'{k} {v!r}' for k, v in _VARIANTS.items())})")
    layers = hf.get("num_hidden_layers", 1)
    if layers != 1:
        raise CheckpointError(f"{where}: num_hidden_layers is {layers!r}; an EAGLE-3 draft model has one decoder layer")
    try:
        layer = ModelConfig.from_hf_dict({**hf, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
        return Eagle3Config(layer=layer, draft_vocab_size=int(draft_vocab),
                            target_hidden_size=int(hf.get("target_hidden_size") or layer.hidden_size),
                            taps=_read_taps(hf, target_cfg, where), own_embedding=own_embedding)
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{where}: {e}") from e


def config_to_hf(cfg: Eagle3Config, num_target_layers: int | None = None) -> dict:
    """The config.json of an EAGLE-3 draft model (SpecForge's fields; tap ids in both conventions)."""
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
            "rope_parameters", "max_position_embeddings", "tie_word_embeddings")
    layer = cfg.layer.to_hf_dict()
    hf = {"architectures": [ARCHITECTURES[0]], "model_type": "llama", **{k: layer[k] for k in keep if k in layer},
          "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
          "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.taps)},
          "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.taps]}
    if num_target_layers is not None:
        hf["num_target_layers"] = int(num_target_layers)
    return hf


def renamed_tensors(found: dict, where: str) -> dict:
    """vLLM's `layers.0.*` read as `midlayer.*`; a folder holding both namings is refused."""
    ours = sorted(n for n in found if n.startswith(MIDLAYER))
    theirs = sorted(n for n in found if n.startswith(VLLM_MIDLAYER))
    if ours and theirs:
        raise CheckpointError(f"{where}: the layer's tensors appear under both {MIDLAYER!r} ({len(ours)}) and "
                              f"{VLLM_MIDLAYER!r} ({len(theirs)}); a checkpoint uses one naming: remove the stale copy")
    return {(MIDLAYER + n[len(VLLM_MIDLAYER):] if n.startswith(VLLM_MIDLAYER) else n): t for n, t in found.items()}


def load_checkpoint(path: str, target_cfg=None, dtype=jnp.float32) -> tuple[Eagle3Config, dict]:
    """(config, parameters) of an EAGLE-3 checkpoint folder; strict about every tensor and both maps."""
    where = f"EAGLE-3 checkpoint {path!r}"
    hf = read_config(path)
    found = renamed_tensors(read_safetensors(path), where)
    cfg = config_from_hf(hf, target_cfg, own_embedding="embed_tokens.weight" in found,
                         where=os.path.join(path, "config.json"))
    expected = declared_tensors(declarations(cfg))
    want = {n: e[0] for n, e in expected.items()}
    want.update(d2t=(cfg.draft_vocab_size,), t2d=(cfg.layer.vocab_size,))
    check_tensors(found, want, where, "point the drafter at an EAGLE-3 checkpoint whose config.json describes it "
                  "(hidden_size, heads, intermediate_size, draft_vocab_size, vocab_size, target_hidden_size)",
                  dtypes={"d2t": ("int64", "int32"), "t2d": ("bool",)})
    check_vocab_map(np.asarray(found["d2t"]), np.asarray(found["t2d"]), cfg, where)
    params = assemble(found, expected, shapes(declarations(cfg)), dtype)
    params["d2t"] = jnp.asarray(np.asarray(found["d2t"]), jnp.int32)
    return cfg, params


def save_checkpoint(path: str, cfg: Eagle3Config, params: dict, dtype=None,
                    num_target_layers: int | None = None) -> None:
    """Write the official format: config.json and model.safetensors with SpecForge's tensor names."""
    tensors = export_tensors(params, declared_tensors(declarations(cfg)), dtype)
    d2t = np.asarray(jax.device_get(params["d2t"])).astype(np.int64)
    t2d = np.zeros((cfg.layer.vocab_size,), bool)
    t2d[np.arange(cfg.draft_vocab_size) + d2t] = True
    tensors.update(d2t=d2t, t2d=t2d)
    write_checkpoint(path, config_to_hf(cfg, num_target_layers), tensors)


def _load(path: str, target, dtype) -> tuple[Eagle3, dict]:
    cfg, params = load_checkpoint(path, None if target is None else target.cfg, dtype)
    drafter = Eagle3(cfg=cfg)
    if target is not None:
        drafter.validate(target.cfg, params)
    return drafter, params


def _save(path: str, drafter: Eagle3, params: dict, dtype=None) -> None:
    save_checkpoint(path, drafter.cfg, params, dtype)


def with_shape(drafter: Eagle3, block_size: int, tree_budget: int) -> Eagle3:
    """A chain of block_size drafts, or (tree_budget > 0) an EAGLE-2 tree of tree_budget nodes and depth
    at most block_size."""
    if block_size < 1:
        raise ValueError(f"block_size {block_size}: an EAGLE-3 drafter drafts at least one token (or one tree level)")
    return dataclasses.replace(drafter, block_size=block_size, tree_budget=tree_budget)


# --- training: the training-time test -------------------------------------------------------------------------
# SpecForge's OnlineEagle3Model (specforge/algorithms/eagle3/model.py, after SafeAILab/EAGLE
# `eagle/traineagle3/cnets.py`): TTT_STEPS unrolled steps over every row at once. Step 0 is row t as in
# inference (g_t, x_{t+1}, position t); step i reads the data token x_{t+1+i} and, as its hidden state,
# step i - 1's output at the same row, at position t + i. A query of step i at row t attends to the causal
# step-0 keys (rows <= t) and the keys of steps 1..i at row t (the attention's `cache_hidden` diagonal).
# Step i is scored against the target's distribution of x_{t+2+i} restricted to the draft vocabulary and
# renormalised (`_compute_target_p`: softmax of the target logits at t2d), cross-entropy -sum p log q,
# over positions whose token is a response token and whose target argmax lies in the draft vocabulary;
# the steps' losses are summed with weights TTT_DECAY ** i.

TTT_STEPS, TTT_DECAY = 7, 0.8
OWN_LOSS = "ttt"


def shift_rows(x: jax.Array, n: int) -> jax.Array:
    """x [B, T, ...] moved n rows earlier along T (row t holds x[t + n]), zeros past the end."""
    pad = jnp.zeros((x.shape[0], n) + x.shape[2:], x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)[:, : x.shape[1]]


def ttt_attention(q: jax.Array, k0: jax.Array, v0: jax.Array, diagonal: list) -> jax.Array:
    """Attention [B, T, Hq, Dh] of step-i queries q over the step-0 keys k0, v0 [B, T, Hkv, Dh] (causal) and
    the same row's keys of steps 1..i (`diagonal`: (k, v) per step, each [B, T, Hkv, Dh])."""
    b, t, hq, dh = q.shape
    hkv = k0.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, dh)
    scale = dh**-0.5
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [T (query), T (key)]
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k0, preferred_element_type=jnp.float32) * scale
    scores = [jnp.where(causal, scores, -jnp.inf)]
    scores += [jnp.einsum("btkgd,btkd->bkgt", qg, k, preferred_element_type=jnp.float32)[..., None] * scale
               for k, _ in diagonal]
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs[..., :t], v0)
    for j, (_, v) in enumerate(diagonal):
        out = out + jnp.einsum("bkgt,btkd->btkgd", probs[..., t + j], v)
    return out.reshape(b, t, hq, dh)


def ttt_logq(params: dict, cfg: Eagle3Config, embed, taps: jax.Array, tokens: jax.Array, steps: int = TTT_STEPS):
    """Draft log q [steps, B, T, draft_V] of the training-time test over sequences tokens [B, T] with the target's
    taps [3, B, T, H_t]: step i's row t drafts x_{t+2+i}."""
    b, t = tokens.shape
    hidden = fuse(params, taps)
    k0 = v0 = None
    diagonal, out = [], []
    for i in range(steps):
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + i, (b, t))
        q, k, v = project(params, cfg, quant.embed_rows(embed, shift_rows(tokens, 1 + i)), hidden, positions)
        if i == 0:
            k0, v0 = k, v
        else:
            diagonal.append((k, v))
        hidden = finish(params, cfg, hidden, ttt_attention(q, k0, v0, diagonal))
        out.append(jax.nn.log_softmax(draft_logits(params, cfg, hidden), axis=-1))
    return jnp.stack(out)


def train_loss(params, target_params, target_cfg, drafter: Eagle3, spec, batch: dict, key: jax.Array):
    """Scalar loss and metrics. batch: tokens [B, T], loss_mask [B, T]. Loss "ttt" (the default): the
    training-time test (module section above). Any loss of jspec.train.losses instead scores the same
    unrolled steps as blocks: step i at row a - 1 is slot i of the round anchored at a (it drafts
    x_{a+1+i} given the text up to a), at the anchors the loss trains on (`drafter.anchors_for`: a window
    of consecutive ones for EDR / Draft-OPD), over the draft vocabulary with the target's distribution
    restricted to it and renormalised (TTT's convention); slots whose token lies outside it end the block."""
    from jspec.train import drafter as train_drafter

    cfg = drafter.cfg
    tokens, loss_mask = batch["tokens"], batch["loss_mask"]
    taps, target_logp = train_drafter.target_pass(target_params, target_cfg, tokens, cfg.taps)
    embed = params["embed"] if cfg.own_embedding else target_params["embed"]
    logq = ttt_logq(params, cfg, embed, taps, tokens)
    ids = jnp.arange(cfg.draft_vocab_size) + params["d2t"]  # the draft vocabulary's target ids
    in_draft = jnp.zeros((target_cfg.vocab_size,), bool).at[ids].set(True)
    if spec.name != OWN_LOSS:
        return _block_loss(logq, ids, in_draft, spec, tokens, loss_mask, target_logp, key)
    total, metrics = 0.0, {}
    for i in range(logq.shape[0]):
        p_logp = shift_rows(target_logp, 1 + i)  # row t: the target's distribution of x_{t+2+i}
        p = jax.nn.softmax(p_logp[..., ids], axis=-1)
        best = jnp.argmax(p_logp, axis=-1)
        mask = (shift_rows(loss_mask, 2 + i) > 0) & in_draft[best]  # zeros past the end: nothing left to draft
        n = jnp.maximum(jnp.sum(mask), 1)
        ce = -jnp.sum(p * logq[i], axis=-1)
        total = total + TTT_DECAY**i * jnp.sum(jnp.where(mask, ce, 0.0)) / n
        hit = (ids[jnp.argmax(logq[i], axis=-1)] == best) & mask
        metrics[f"acc_{i}"] = jnp.sum(hit) / n
    metrics["acc"] = metrics["acc_0"]
    return total, metrics


def steps_as_blocks(logq: jax.Array, anchors: jax.Array) -> jax.Array:
    """Training-time-test steps [g, B, T, V] as blocks [B, A, g, V] at anchors [B, A] (each >= 1): step i at
    row a - 1 is slot i of the round anchored at a (it drafts x_{a+1+i} given the text up to a)."""
    rows = jnp.arange(logq.shape[1])[:, None]
    return jnp.moveaxis(logq[:, rows, jnp.maximum(anchors - 1, 0)], 0, 2)


def offline_blocks(target_params, target_cfg, drafter: Eagle3, dparams, taps, tokens, sampling):
    """The offline evaluator's rounds (`Family.offline`): the training-time test's steps read as blocks
    (`steps_as_blocks`; tests/test_eagle3.py checks the steps against the chained drafter), computed once
    for every row."""
    embed = dparams["embed"] if drafter.cfg.own_embedding else target_params["embed"]
    logq = ttt_logq(dparams, drafter.cfg, embed, taps, tokens, drafter.num_drafts)  # [g, B, T, draft_V]
    logq = to_target(logq, target_index(dparams["d2t"], target_cfg.vocab_size))

    def blocks(anchors):
        rows = steps_as_blocks(logq, anchors)
        return rows, served_logprobs(rows, sampling)
    return blocks


def _block_loss(logq, ids, in_draft, spec, tokens, loss_mask, target_logp, key):
    """The run's distribution loss over the TTT steps read as blocks (see `train_loss`)."""
    from jspec.train import drafter as train_drafter

    g = logq.shape[0]
    anchors, valid = train_drafter.anchors_for(spec, key, loss_mask)
    valid = valid & (anchors >= 1)  # row a - 1 holds the anchor's round
    labels, mask, p_t = train_drafter.block_targets(g, tokens, loss_mask, target_logp, anchors, valid)
    draft_logp = steps_as_blocks(logq, anchors)  # [B, A, g, draft_V]
    p_d = jax.nn.log_softmax(p_t[..., ids], axis=-1)
    to_draft = jnp.zeros(in_draft.shape, jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))
    mask = jnp.cumprod(mask * in_draft[labels], axis=-1)
    labels = to_draft[labels]
    loss = train_drafter.distribution_loss(spec, draft_logp, p_d, labels, mask)
    return loss, train_drafter.metrics(draft_logp, p_d, labels, mask)


def build_drafter(run: dict, target, key) -> tuple[Eagle3, dict]:
    """An EAGLE-3 drafter from a run config's drafter section: intermediate_size (default the target's),
    target_layer_ids (default [1, N/2 - 1, N - 4]) and block_size (drafts per round, default 4). It embeds with
    the target's embedding, so its width is the target's, and drafts over the whole target vocabulary (a
    reduced draft vocabulary is chosen from token counts of the data, which this recipe does not gather)."""
    section, tc = run["drafter"], target.cfg
    vocab = section.get("draft_vocab_size", tc.vocab_size)
    if vocab != tc.vocab_size:
        raise ValueError(f"drafter.draft_vocab_size {vocab!r}: the eagle3 recipe trains over the target's whole "
                         f"vocabulary ({tc.vocab_size}); drop the key")
    taps = tuple(section.get("target_layer_ids") or default_taps(tc.num_layers))
    cfg = Eagle3Config(layer=layer_config(tc, intermediate_size=section.get("intermediate_size")),
                       draft_vocab_size=tc.vocab_size, target_hidden_size=tc.hidden_size, taps=taps)
    validate_against_target(cfg, tc)
    return Eagle3(cfg=cfg, block_size=int(section.get("block_size", 4))), init_params(
        cfg, key, std=run.get("init_std", 0.02))


# --- a small example ------------------------------------------------------------------------------------------


def layer_config(target_cfg, hidden_size: int | None = None, intermediate_size: int | None = None) -> ModelConfig:
    """A one-layer Llama config with the target's heads, head_dim, RoPE and vocabulary (width hidden_size,
    default the target's)."""
    h = hidden_size or target_cfg.hidden_size
    return ModelConfig(family="llama", vocab_size=target_cfg.vocab_size, hidden_size=h,
                       intermediate_size=intermediate_size or target_cfg.intermediate_size, num_layers=1,
                       num_heads=target_cfg.num_heads, num_kv_heads=target_cfg.num_kv_heads,
                       head_dim=target_cfg.head_dim, rms_norm_eps=target_cfg.rms_norm_eps,
                       rope_theta=target_cfg.rope_theta, max_position_embeddings=target_cfg.max_position_embeddings)


def draft_vocabulary(vocab: int, draft_vocab: int, seed: int = 0) -> np.ndarray:
    """d2t [draft_vocab] of a random draft vocabulary (sorted target ids, as SpecForge orders them)."""
    ids = np.sort(np.random.RandomState(seed).choice(vocab, draft_vocab, replace=False))
    return (ids - np.arange(draft_vocab)).astype(np.int32)


def _example(target) -> tuple[Eagle3, dict]:
    """A random EAGLE-3 drafter for the target, over a draft vocabulary of two thirds of its ids."""
    tc = target.cfg
    cfg = Eagle3Config(layer=layer_config(tc), draft_vocab_size=max(1, 2 * tc.vocab_size // 3),
                       target_hidden_size=tc.hidden_size, taps=default_taps(max(tc.num_layers, 4)))
    d2t = draft_vocabulary(tc.vocab_size, cfg.draft_vocab_size)
    params = init_params(cfg, jax.random.key(0), target.params["embed"].dtype, std=0.3, d2t=d2t)
    return Eagle3(cfg=cfg, block_size=3), params


register_family(Family(name="eagle3", drafter=Eagle3, detect=_detect, load=_load, save=_save, with_shape=with_shape,
                       recipe=TrainRecipe(build=build_drafter, loss=train_loss, frozen=("d2t",), own_loss=OWN_LOSS),
                       example=_example, offline=offline_blocks,
                       summary="EAGLE-3 (SpecForge / vLLM): config.json with architectures [LlamaForCausalLMEagle3]"))
