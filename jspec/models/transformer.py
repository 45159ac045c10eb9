"""Llama / Qwen3 decoder as pure functions over a parameter pytree, with a static KV cache.

Parameters (a plain nested dict; `layers` is a list with one dict per layer, so that no pass slices a
weight out of a stacked array; matrices stored [in, out]):

    embed [V, D]; final_norm [D]; lm_head [D, V] (absent when embeddings are tied)
    layers[i]: attn_norm [D], wq [D, Hq*Dh], wk/wv [D, Hkv*Dh], wo [Hq*Dh, D],
               (bq [Hq*Dh], bk/bv [Hkv*Dh] with attention_bias; q_norm/k_norm [Dh] for Qwen3),
               mlp_norm [D], w_gate/w_up [D, F], w_down [F, D]

The KV cache holds one [B, Hkv, S, Dh] buffer per layer for K and for V: each layer writes its rows in
place and attention reads only the valid rows (`jspec.models.attention`).

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

from jspec.models.attention import KV_CHUNK, attend, write_rows
from jspec.models.config import ModelConfig, default_rope_inv_freq


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Static preallocated K/V, one buffer per layer: k[i], v[i] [B, Hkv, S, Dh]. Which rows are valid
    is tracked by the caller. Separate buffers let every layer update its own rows in place (a slice
    of one stacked buffer is a copy), and heads before rows make a chunk of rows a contiguous block
    of each head, which attention reads without a transpose."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def size(self) -> int:
        return self.k[0].shape[2]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, size: int, dtype=jnp.float32) -> "KVCache":
        shape = (batch, cfg.num_kv_heads, size, cfg.head_dim)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                   tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)))


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


def _layer(cfg: ModelConfig, inv_freq, h, lp, k_cache, v_cache, window: int, positions, cache_rows, ctx_len,
           tree_mask, attention: str, kv_chunk: int | None):
    """One decoder layer. h [B, T, D]; k_cache/v_cache [B, Hkv, S, Dh] for this layer."""
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

    k_cache, v_cache = write_rows(k_cache, k, cache_rows), write_rows(v_cache, v, cache_rows)
    if tree_mask is not None and attention == "pallas":
        from jspec.kernels import tree  # imported here: jspec.kernels imports this module

        rows_major = lambda c: jnp.swapaxes(c, 1, 2)  # the kernel reads [B, S, Hkv, Dh]
        attn = tree.layer_attention(q, k, v, rows_major(k_cache), rows_major(v_cache), positions, cache_rows,
                                    ctx_len, tree_mask, jnp.int32(window))
    else:
        attn = attend(q, k_cache, v_cache, positions, cache_rows, ctx_len, tree_mask, window, kv_chunk)
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
    kv_chunk: int | None = KV_CHUNK,
) -> ForwardOut:
    """Run T new tokens per row against the cache.

    tokens, positions [B, T] int32 (RoPE and masking use positions).
    ctx_len [B]: committed cache rows visible to every new token (default: positions[:, 0]).
    cache_rows [B, T]: rows that receive the new K/V (default: positions; trees use scratch rows).
    tree_mask [B, T, T] bool: new token i may attend to new token k (ancestors and itself); None =
    causal by position. taps: layer indices whose outputs are returned.
    attention: "reference" | "pallas" | "auto" (jspec.kernels.resolve): with a tree_mask, "pallas" runs
    the tree-attention kernel (the mask packed into a per-row ancestor bitmask); otherwise jnp.
    kv_chunk: cache rows per attention step (`jspec.models.attention.attend`); None = one block over
    the whole cache (training passes, which differentiate through it).

    The layers run as an unrolled Python loop over per-layer weights: a `lax.scan` over stacked weights
    copies every sliced weight matrix before its matmul on XLA:CPU and XLA:GPU, and one over the cache
    copies the cache in and out of the scan every pass. Each layer writes its K/V rows into the cache
    in place.
    """
    if attention != "reference":
        from jspec.kernels import resolve  # imported here: jspec.kernels imports this module

        attention = resolve(attention)
    if cache_rows is None:
        cache_rows = positions
    if ctx_len is None:
        ctx_len = positions[:, 0]
    inv_freq = jnp.asarray(default_rope_inv_freq(cfg))
    h = params["embed"][tokens]
    ks, vs, outputs = [], [], []
    for lp, k, v, window in zip(params["layers"], cache.k, cache.v, cfg.windows, strict=True):
        h, k, v = _layer(cfg, inv_freq, h, lp, k, v, window, positions, cache_rows, ctx_len, tree_mask, attention,
                         kv_chunk)
        ks.append(k)
        vs.append(v)
        outputs.append(h)
    tapped = jnp.stack([outputs[i] for i in taps]) if taps else None
    h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    return ForwardOut(h, KVCache(tuple(ks), tuple(vs)), tapped)


def logits(params: dict, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """LM head: hidden [..., D] -> float32 logits [..., V]."""
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.einsum("...d,dv->...v", hidden, head, preferred_element_type=jnp.float32)


def layer_shapes(cfg: ModelConfig) -> dict:
    """Shape of every parameter of one decoder layer."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv, dh = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    shapes = {
        "attn_norm": (d,), "wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
        "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d),
    }
    if cfg.attention_bias:
        shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
    if cfg.mlp_bias:
        shapes.update(b_gate=(f,), b_up=(f,), b_down=(d,))
    if cfg.qk_norm:
        shapes.update(q_norm=(dh,), k_norm=(dh,))
    return shapes


def param_shapes(cfg: ModelConfig) -> dict:
    """Shape of every parameter, in the pytree layout above (`layers`: a list of per-layer dicts)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    shapes = {"embed": (v, d), "final_norm": (d,), "layers": [layer_shapes(cfg) for _ in range(cfg.num_layers)]}
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
