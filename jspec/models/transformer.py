"""Llama / Qwen3 decoder as pure functions over a parameter pytree, with a static KV cache.

Parameters (a plain nested dict; per-layer tensors stacked on a leading layer axis so that the layer
stack is one `lax.scan`; matrices stored [in, out]):

    embed [V, D]; final_norm [D]; lm_head [D, V] (absent when embeddings are tied)
    layers: attn_norm [L, D], wq [L, D, Hq*Dh], wk/wv [L, D, Hkv*Dh], wo [L, Hq*Dh, D],
            (bq [L, Hq*Dh], bk/bv [L, Hkv*Dh] with attention_bias; q_norm/k_norm [L, Dh] for Qwen3),
            mlp_norm [L, D], w_gate/w_up [L, D, F], w_down [L, F, D]

One `forward` serves prefill, single-token decoding, chain verification and tree verification: it
takes T new tokens per row at per-row positions, writes their K/V into given cache rows, and attends
over the committed rows (< ctx_len) plus the new rows allowed by the mask.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models.config import ModelConfig, default_rope_inv_freq


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Static preallocated K/V: k, v [L, B, S, Hkv, Dh]. Which rows are valid is tracked by the caller."""

    k: jax.Array
    v: jax.Array

    @property
    def size(self) -> int:
        return self.k.shape[2]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, size: int, dtype=jnp.float32) -> "KVCache":
        shape = (cfg.num_layers, batch, size, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


class ForwardOut(NamedTuple):
    hidden: jax.Array  # [B, T, D] final-normed hidden states (feed to `logits`)
    cache: KVCache
    taps: jax.Array | None  # [n_taps, B, T, D] outputs of the requested layers (HF hidden_states[i+1])


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """HF RMSNorm: normalise in float32, cast back, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x [B, T, H, Dh], positions [B, T]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def attention_mask(
    positions: jax.Array,
    cache_rows: jax.Array,
    ctx_len: jax.Array,
    size: int,
    tree_mask: jax.Array | None,
    window: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Visibility of cache rows to the new tokens.

    positions, cache_rows [B, T]; ctx_len [B]: rows < ctx_len hold committed tokens whose position is
    their row index. tree_mask [B, T, T] (query i may see new token k) or None for causal order by
    position. window: 0 = full attention, else a key is visible iff key_pos > query_pos - window.
    Returns (mask [B, T, S], key_valid [B, S]): key_valid marks rows that any query may read.
    """
    rows = jnp.arange(size)
    committed = rows[None, :] < ctx_len[:, None]  # [B, S]
    new_onehot = cache_rows[:, :, None] == rows[None, None, :]  # [B, T(k), S]
    if tree_mask is None:
        new_vis = positions[:, None, :] <= positions[:, :, None]  # [B, T(i), T(k)]
    else:
        new_vis = tree_mask
    # Position of every key row: committed rows sit at their own index, new rows at their position.
    key_pos = jnp.where(
        jnp.any(new_onehot, axis=1), jnp.einsum("bks,bk->bs", new_onehot.astype(jnp.int32), positions), rows[None, :]
    )
    sees_new = jnp.einsum("bik,bks->bis", new_vis.astype(jnp.int32), new_onehot.astype(jnp.int32)) > 0
    mask = committed[:, None, :] | sees_new
    in_window = key_pos[:, None, :] > positions[:, :, None] - window
    mask = mask & ((window == 0) | in_window)
    key_valid = committed | jnp.any(new_onehot, axis=1)
    return mask, key_valid


def _layer(cfg: ModelConfig, inv_freq, h, lp, k_cache, v_cache, window, positions, cache_rows, ctx_len, tree_mask,
           attention: str = "reference"):
    """One decoder layer. h [B, T, D]; k_cache/v_cache [B, S, Hkv, Dh] for this layer."""
    b, t, _ = h.shape
    hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
    q = x @ lp["wq"]
    k = x @ lp["wk"]
    v = x @ lp["wv"]
    if cfg.attention_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(b, t, hq, dh)
    k = k.reshape(b, t, hkv, dh)
    v = v.reshape(b, t, hkv, dh)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q = rope(q, positions, inv_freq)
    k = rope(k, positions, inv_freq)

    batch_idx = jnp.arange(b)[:, None]
    k_cache = k_cache.at[batch_idx, cache_rows].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[batch_idx, cache_rows].set(v.astype(v_cache.dtype), mode="drop")

    if tree_mask is not None and attention == "pallas":
        from jspec.kernels import tree  # imported here: jspec.kernels imports this module

        attn = tree.layer_attention(q, k, v, k_cache, v_cache, positions, cache_rows, ctx_len, tree_mask, window)
    else:
        mask, key_valid = attention_mask(positions, cache_rows, ctx_len, k_cache.shape[1], tree_mask, window)
        # Rows nobody may read are zeroed so that stale or NaN-filled memory cannot leak through 0 * NaN.
        keys = jnp.where(key_valid[:, :, None, None], k_cache, 0).astype(q.dtype)
        vals = jnp.where(key_valid[:, :, None, None], v_cache, 0).astype(q.dtype)
        qg = q.reshape(b, t, hkv, hq // hkv, dh)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, preferred_element_type=jnp.float32)
        scores = scores * (dh**-0.5)
        scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        # A query with no visible key (only padding queries) gets zeros instead of NaN.
        probs = jnp.where(jnp.any(mask, axis=-1)[:, None, None, :, None], probs, 0.0)
        attn = jnp.einsum("bkgts,bskd->btkgd", probs.astype(vals.dtype), vals)
    h = h + attn.reshape(b, t, hq * dh) @ lp["wo"]

    x = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
    gate, up = x @ lp["w_gate"], x @ lp["w_up"]
    if cfg.mlp_bias:
        gate, up = gate + lp["b_gate"], up + lp["b_up"]
    down = (jax.nn.silu(gate) * up) @ lp["w_down"]
    if cfg.mlp_bias:
        down = down + lp["b_down"]
    return h + down, k_cache, v_cache


def forward(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    *,
    ctx_len: jax.Array | None = None,
    cache_rows: jax.Array | None = None,
    tree_mask: jax.Array | None = None,
    taps: tuple[int, ...] = (),
    attention: str = "reference",
) -> ForwardOut:
    """Run T new tokens per row against the cache.

    tokens, positions [B, T] int32 (RoPE and masking use positions).
    ctx_len [B]: committed cache rows visible to every new token (default: positions[:, 0]).
    cache_rows [B, T]: rows that receive the new K/V (default: positions; trees use scratch rows).
    tree_mask [B, T, T] bool: new token i may attend to new token k (ancestors and itself); None =
    causal by position. taps: layer indices whose outputs are returned.
    attention: "reference" | "pallas" | "auto" (jspec.kernels.resolve): with a tree_mask, "pallas" runs
    the tree-attention kernel (the mask packed into a per-row ancestor bitmask); otherwise jnp.
    """
    if attention != "reference":
        from jspec.kernels import resolve  # imported here: jspec.kernels imports this module

        attention = resolve(attention)
    if cache_rows is None:
        cache_rows = positions
    if ctx_len is None:
        ctx_len = positions[:, 0]
    inv_freq = jnp.asarray(default_rope_inv_freq(cfg))
    windows = jnp.asarray(cfg.windows, jnp.int32)
    h = params["embed"][tokens]

    def body(h, xs):
        lp, k_l, v_l, window = xs
        h, k_l, v_l = _layer(cfg, inv_freq, h, lp, k_l, v_l, window, positions, cache_rows, ctx_len, tree_mask,
                             attention)
        return h, (k_l, v_l, h if taps else None)

    h, (k, v, per_layer) = jax.lax.scan(body, h, (params["layers"], cache.k, cache.v, windows))
    tapped = per_layer[jnp.asarray(taps)] if taps else None
    h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    return ForwardOut(h, KVCache(k, v), tapped)


def logits(params: dict, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """LM head: hidden [..., D] -> float32 logits [..., V]."""
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.einsum("...d,dv->...v", hidden, head, preferred_element_type=jnp.float32)


def param_shapes(cfg: ModelConfig) -> dict:
    """Shape of every parameter, in the pytree layout above."""
    d, f, v, l = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    q, kv, dh = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    layers = {
        "attn_norm": (l, d), "wq": (l, d, q), "wk": (l, d, kv), "wv": (l, d, kv), "wo": (l, q, d),
        "mlp_norm": (l, d), "w_gate": (l, d, f), "w_up": (l, d, f), "w_down": (l, f, d),
    }
    if cfg.attention_bias:
        layers.update(bq=(l, q), bk=(l, kv), bv=(l, kv))
    if cfg.mlp_bias:
        layers.update(b_gate=(l, f), b_up=(l, f), b_down=(l, d))
    if cfg.qk_norm:
        layers.update(q_norm=(l, dh), k_norm=(l, dh))
    shapes = {"embed": (v, d), "final_norm": (d,), "layers": layers}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, v)
    return shapes


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random parameters (normal(std) matrices, unit norms) for tests and from-scratch training."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda s: isinstance(s, tuple))[0]]
    keys = jax.random.split(key, len(leaves))
    out = []
    for path, shape, k in zip(paths, leaves, keys):
        if "norm" in path:
            out.append(jnp.ones(shape, dtype))
        elif path.split("'")[-2].startswith("b"):
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((std * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def count_params(params: dict) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))
