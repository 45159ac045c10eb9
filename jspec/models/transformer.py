"""Llama / Qwen3 decoder: a `flax.linen` module applied to a plain parameter pytree, with a static KV cache.

Every parameter is declared once in the modules below (`jspec.models.declare`: shape, dtype,
initializer, logical axes, HF name); `init_params`, `param_shapes`, the HF loader and the shardings
all read those declarations. `forward` applies the module to the pytree: inside jit the module is
only traced, so the compiled loop carries plain arrays and pays nothing per call for the framework.

Parameters (a plain nested dict; `layers` is a list with one dict per layer, so that no pass slices a
weight out of a stacked array; matrices stored [out, in] as HF stores them, applied by `layers.linear`):

    embed [V, D]; final_norm [D]; lm_head [V, D] (absent when embeddings are tied)
    layers[i]: attn_norm [D], wq [Hq*Dh, D], wk/wv [Hkv*Dh, D], wo [D, Hq*Dh],
               (bq [Hq*Dh], bk/bv [Hkv*Dh] with attention_bias; q_norm/k_norm [Dh] for Qwen3),
               mlp_norm [D], w_gate/w_up [F, D], w_down [D, F]

The KV cache holds one [B, Hkv, S, Dh] buffer per layer for K and for V: each layer writes its rows in
place and attention reads only the valid rows (`jspec.models.attention`).

`cfg.layer_loop == "scan"` (TPU; `with_layer_loop`) stacks both instead: `layers` is one dict of
[L, ...] arrays, the cache one [L, B, Hkv, S, Dh] buffer for K and one for V, and the layers run as a
`lax.scan` whose carry holds the caches; each layer slices its weights inside the matmuls and writes
and reads its cache rows in place through its layer index.

One `forward` serves prefill, single-token decoding, chain verification and tree verification: it
takes T new tokens per row at per-row positions, writes their K/V into given cache rows, and attends
over the committed rows (< ctx_len) plus the new rows allowed by the mask.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jspec import kernels
from jspec.kernels.tree import layer_attention
from jspec.models import quant
from jspec.models.attention import KV_CHUNK, attend, write_rows
from jspec.models.config import ModelConfig, default_rope_inv_freq
from jspec.models.declare import abstract_tree, declare, init_tree, shapes, unbox
from jspec.models.layers import linear, lm_logits, rms_norm, rope, swiglu


# The longest pass without a tree mask that attention="pallas" sends through the kernel: decode and
# chain-verify passes (a query block of T rows per KV head group stays in on-chip memory); prefill
# passes are longer and use the reference.
KERNEL_MAX_TOKENS = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Static preallocated K/V, one buffer per layer: k[i], v[i] [B, Hkv, S, Dh]. Which rows are valid
    is tracked by the caller. Separate buffers let every layer of an unrolled loop update its own rows
    in place (a slice of one stacked buffer handed to a layer is a copy); a scanned layer loop
    (layer_loop "scan") keeps one stacked [L, B, Hkv, S, Dh] buffer each for K and V instead, written
    and read in place at each layer's index. Heads before rows make a chunk of rows a contiguous block
    of each head, which attention reads without a transpose."""

    k: tuple[jax.Array, ...] | jax.Array  # or, for layer_loop "scan", one stacked [L, B, Hkv, S, Dh] array
    v: tuple[jax.Array, ...] | jax.Array

    @property
    def size(self) -> int:
        return (self.k if self.stacked else self.k[0]).shape[-2]

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, tuple)

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, size: int, dtype=jnp.float32) -> "KVCache":
        shape = (batch, cfg.num_kv_heads, size, cfg.head_dim)
        if cfg.layer_loop == "scan":
            return cls(jnp.zeros((cfg.num_layers, *shape), dtype), jnp.zeros((cfg.num_layers, *shape), dtype))
        return cls(tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                   tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)))


class ForwardOut(NamedTuple):
    hidden: jax.Array  # [B, T, D] final-normed hidden states (feed to `logits`)
    cache: KVCache
    taps: jax.Array | None  # [n_taps, B, T, D] outputs of the requested layers (HF hidden_states[i+1])


def _materialise_on_gpu(h: jax.Array) -> jax.Array:
    """h, written out once on GPU: the residual stream after attention, which XLA:GPU otherwise
    recomputes in each consumer from the output projection's float32 split-K partial sums, reading
    them twice (H200, Qwen3-8B tree of 32 nodes at batch 8 / 4k, top-p: 32.78 -> 32.63 GB a round).
    XLA:CPU and XLA:TPU keep their own fusion: XLA:TPU moved 0.01-0.02 GB more a round at batch 1
    with the barrier, and the CPU's forward stays the program it was."""
    return jax.lax.platform_dependent(h, cpu=lambda x: x, tpu=lambda x: x, default=jax.lax.optimization_barrier)


def _layer(cfg: ModelConfig, inv_freq, h, lp, k_cache, v_cache, window: int, positions, cache_rows, ctx_len,
           tree_mask, attention: str, kv_chunk: int | str | None, layer=None):
    """One decoder layer. h [B, T, D]; k_cache/v_cache [B, Hkv, S, Dh] for this layer, or with `layer`
    (a traced index) the stacked [L, B, Hkv, S, Dh] caches of a scanned layer loop."""
    b, t, _ = h.shape
    hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
    q = linear(x, lp["wq"])
    k = linear(x, lp["wk"])
    v = linear(x, lp["wv"])
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

    k_cache, v_cache = write_rows(k_cache, k, cache_rows, layer), write_rows(v_cache, v, cache_rows, layer)
    if attention == "pallas" and (tree_mask is not None or t <= KERNEL_MAX_TOKENS):
        # A chain (or single-token) pass is the tree whose ancestors are the earlier positions.
        visible = tree_mask if tree_mask is not None else positions[:, None, :] <= positions[:, :, None]
        attn = layer_attention(q, k, v, k_cache, v_cache, positions, cache_rows, ctx_len, visible,
                               jnp.asarray(window, jnp.int32), layer)
    else:
        attn = attend(q, k_cache, v_cache, positions, cache_rows, ctx_len, tree_mask, window, kv_chunk, layer)
    h = _materialise_on_gpu(h + linear(attn.reshape(b, t, hq * dh), lp["wo"]))

    x = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
    biases = (lp["b_gate"], lp["b_up"], lp["b_down"]) if cfg.mlp_bias else ()
    return h + swiglu(x, lp["w_gate"], lp["w_up"], lp["w_down"], *biases), k_cache, v_cache


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
    kv_chunk: int | str | None = KV_CHUNK,
) -> ForwardOut:
    """Run T new tokens per row against the cache.

    tokens, positions [B, T] int32 (RoPE and masking use positions).
    ctx_len [B]: committed cache rows visible to every new token (default: positions[:, 0]).
    cache_rows [B, T]: rows that receive the new K/V, consecutive per row (`attention.write_rows`;
    default: positions, which must then be consecutive; trees pass their scratch rows).
    tree_mask [B, T, T] bool: new token i may attend to new token k (ancestors and itself); None =
    causal by position. taps: layer indices whose outputs are returned.
    attention: "reference" | "pallas" | "auto" (jspec.kernels.resolve): "pallas" runs the tree-attention
    kernel for tree passes (the mask packed into a per-row ancestor bitmask) and for passes of at most
    KERNEL_MAX_TOKENS tokens (decode and chain verification: the causal mask as the bitmask), so the
    cache is streamed once per KV head inside one kernel; longer passes (prefill) and "reference" use
    `jspec.models.attention.attend`.
    kv_chunk: cache rows per attention step (`jspec.models.attention.attend`; KV_CHUNK: the compile
    backend's, `chunk_rows`); None = one block over the whole cache (training passes, which
    differentiate through it).

    With cfg.layer_loop "unroll" the layers run as an unrolled Python loop over per-layer weights: a
    `lax.scan` over stacked weights copies every sliced weight matrix before its matmul on XLA:CPU and
    XLA:GPU. With "scan" (TPU, whose matmul fusions slice the stacked weights in place) they run as one
    `lax.scan` that carries the stacked caches, so the program holds one layer's code instead of L copies
    of it, and XLA:TPU keeps a fraction of the temp memory (`jspec bench --aot tpu-v5p`). Either way each
    layer writes its K/V rows into the cache in place.
    """
    if attention != "reference":
        attention = kernels.resolve(attention)
    if cache_rows is None:
        if tree_mask is not None:
            raise ValueError("a tree pass needs cache_rows: its nodes' positions repeat across branches, and "
                             "the cache takes consecutive rows per pass (e.g. ctx_len[:, None] + arange(T))")
        cache_rows = positions
    if ctx_len is None:
        ctx_len = positions[:, 0]
    stacked = _check_layout(params, cfg, cache)
    return Transformer(cfg).apply({"params": to_linen(params)}, tokens, positions, cache, ctx_len, cache_rows,
                                  tree_mask, tuple(taps), attention, kv_chunk, stacked)


def _check_layout(params: dict, cfg: ModelConfig, cache: KVCache) -> dict | None:
    """The stacked layers of a layer_loop "scan" model (None for "unroll"), after checking that the
    parameters and the cache are in the layout cfg.layer_loop names."""
    scan = cfg.layer_loop == "scan"
    fix = "convert the parameters with transformer.with_layer_loop and make the cache with KVCache.zeros(cfg, ...)"
    if isinstance(params["layers"], dict) != scan:
        have = "stacked [L, ...] arrays" if isinstance(params["layers"], dict) else "a list of per-layer dicts"
        raise ValueError(f"layer_loop={cfg.layer_loop!r} but the parameters' layers are {have}: {fix}")
    if cache.stacked != scan:
        have = "stacked [L, B, Hkv, S, Dh]" if cache.stacked else "per-layer"
        raise ValueError(f"layer_loop={cfg.layer_loop!r} but the KV cache is {have}: {fix}")
    return params["layers"] if scan else None


def logits(params: dict, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """LM head: final-normed hidden [..., D] -> float32 logits [..., V]."""
    return lm_logits(hidden, params["embed"] if cfg.tie_word_embeddings else params["lm_head"])


class DecoderLayer(nn.Module):
    """One decoder layer's parameters (declared once, `jspec.models.declare`) and its computation."""

    cfg: ModelConfig
    hf_prefix: str  # e.g. "model.layers.3."
    init_std: float = 0.02
    param_dtype: Any = jnp.float32

    def setup(self):
        c, pre = self.cfg, self.hf_prefix
        d, f = c.hidden_size, c.intermediate_size
        q, kv, dh = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim
        decl = functools.partial(declare, self, std=self.init_std, dtype=self.param_dtype)
        p = {
            "attn_norm": decl("attn_norm", (d,), ("embed",), "ones", pre + "input_layernorm.weight"),
            "wq": decl("wq", (q, d), ("heads", "embed"), "normal", pre + "self_attn.q_proj.weight"),
            "wk": decl("wk", (kv, d), ("kv_heads", "embed"), "normal", pre + "self_attn.k_proj.weight"),
            "wv": decl("wv", (kv, d), ("kv_heads", "embed"), "normal", pre + "self_attn.v_proj.weight"),
            "wo": decl("wo", (d, q), ("embed", "heads"), "normal", pre + "self_attn.o_proj.weight"),
            "mlp_norm": decl("mlp_norm", (d,), ("embed",), "ones", pre + "post_attention_layernorm.weight"),
            "w_gate": decl("w_gate", (f, d), ("mlp", "embed"), "normal", pre + "mlp.gate_proj.weight"),
            "w_up": decl("w_up", (f, d), ("mlp", "embed"), "normal", pre + "mlp.up_proj.weight"),
            "w_down": decl("w_down", (d, f), ("embed", "mlp"), "normal", pre + "mlp.down_proj.weight"),
        }
        if c.attention_bias:
            p["bq"] = decl("bq", (q,), ("heads",), "zeros", pre + "self_attn.q_proj.bias")
            p["bk"] = decl("bk", (kv,), ("kv_heads",), "zeros", pre + "self_attn.k_proj.bias")
            p["bv"] = decl("bv", (kv,), ("kv_heads",), "zeros", pre + "self_attn.v_proj.bias")
        if c.mlp_bias:
            p["b_gate"] = decl("b_gate", (f,), ("mlp",), "zeros", pre + "mlp.gate_proj.bias")
            p["b_up"] = decl("b_up", (f,), ("mlp",), "zeros", pre + "mlp.up_proj.bias")
            p["b_down"] = decl("b_down", (d,), ("embed",), "zeros", pre + "mlp.down_proj.bias")
        if c.qk_norm:
            p["q_norm"] = decl("q_norm", (dh,), ("head_dim",), "ones", pre + "self_attn.q_norm.weight")
            p["k_norm"] = decl("k_norm", (dh,), ("head_dim",), "ones", pre + "self_attn.k_norm.weight")
        self.p = p

    def declare(self):
        return self.p

    def __call__(self, h, k_cache, v_cache, window: int, positions, cache_rows, ctx_len, tree_mask, attention: str,
                 kv_chunk: int | str | None, inv_freq):
        return _layer(self.cfg, inv_freq, h, self.p, k_cache, v_cache, window, positions, cache_rows, ctx_len,
                      tree_mask, attention, kv_chunk)


class LayerStack(nn.Module):
    """Decoder layers "0" .. "L-1" under one name (HF: `{hf_prefix}{i}.`)."""

    cfg: ModelConfig
    hf_prefix: str
    init_std: float = 0.02
    param_dtype: Any = jnp.float32

    def setup(self):
        self.layers = [DecoderLayer(self.cfg, f"{self.hf_prefix}{i}.", self.init_std, self.param_dtype, name=str(i))
                       for i in range(self.cfg.num_layers)]

    def declare(self):
        return [layer.declare() for layer in self.layers]


class Transformer(nn.Module):
    """The Llama / Qwen3 decoder: embedding, layers, final norm, LM head (absent when tied)."""

    cfg: ModelConfig
    init_std: float = 0.02
    param_dtype: Any = jnp.float32

    def setup(self):
        c = self.cfg
        d, v = c.hidden_size, c.vocab_size
        decl = functools.partial(declare, self, std=self.init_std, dtype=self.param_dtype)
        self.embed = decl("embed", (v, d), ("vocab", "embed"), "normal", "model.embed_tokens.weight")
        self.final_norm = decl("final_norm", (d,), ("embed",), "ones", "model.norm.weight")
        if not c.tie_word_embeddings:
            self.lm_head = decl("lm_head", (v, d), ("vocab", "embed"), "normal", "lm_head.weight")
        self.layers = LayerStack(c, "model.layers.", self.init_std, self.param_dtype, name="layers")

    def declare(self):
        return self.embed, self.final_norm, self.layers.declare()

    def __call__(self, tokens, positions, cache: KVCache, ctx_len, cache_rows, tree_mask, taps: tuple[int, ...],
                 attention: str, kv_chunk: int | str | None, stacked: dict | None = None) -> ForwardOut:
        cfg = self.cfg
        inv_freq = jnp.asarray(default_rope_inv_freq(cfg))
        h = quant.embed_rows(self.embed, tokens)
        if stacked is not None:  # layer_loop "scan": the layers' weights are not this module's variables
            h, cache, tapped = _scan_layers(cfg, inv_freq, h, stacked, cache, positions, cache_rows, ctx_len,
                                            tree_mask, taps, attention, kv_chunk)
            return ForwardOut(rms_norm(h, self.final_norm, cfg.rms_norm_eps), cache, tapped)
        ks, vs, outputs = [], [], []
        for layer, k, v, window in zip(self.layers.layers, cache.k, cache.v, cfg.windows, strict=True):
            h, k, v = layer(h, k, v, window, positions, cache_rows, ctx_len, tree_mask, attention, kv_chunk, inv_freq)
            # The residual stream is materialised per layer, in its dtype: without the barrier XLA:TPU
            # (excess precision allowed) re-sums it from every layer's two updates in float32 for the
            # last layer's consumers, which keeps all 2L updates [B, T, D] live to the end of the pass
            # (at B1 a 64-token prefill: 36 MB of temp for Qwen3-8B, growing with the prompt).
            h = jax.lax.optimization_barrier(h)
            ks.append(k)
            vs.append(v)
            outputs.append(h)
        tapped = jnp.stack([outputs[i] for i in taps]) if taps else None
        h = rms_norm(h, self.final_norm, cfg.rms_norm_eps)
        return ForwardOut(h, KVCache(tuple(ks), tuple(vs)), tapped)


def _scan_layers(cfg: ModelConfig, inv_freq, h, stacked: dict, cache: KVCache, positions, cache_rows, ctx_len,
                 tree_mask, taps: tuple[int, ...], attention: str, kv_chunk):
    """The layers of a layer_loop "scan" model: (h, cache, taps or None). One lax.scan over the layer
    index carries h, the stacked caches (each layer writes its rows in place at its index) and, when
    taps are asked for, a buffer that each tapped layer's output is written into (the other layers
    write a spare slot)."""
    n = cfg.num_layers
    if any(not -n <= i < n for i in taps):
        raise ValueError(f"taps {taps} name layers outside the model's {n}")
    wanted = sorted({i % n for i in taps})
    slot = np.full((n,), len(wanted), np.int32)  # the spare slot
    slot[wanted] = np.arange(len(wanted), dtype=np.int32)
    varying = any(cfg.windows)  # full attention everywhere keeps the window a static 0 (no scanned input)

    # Quantized matrices stay stacked and go to their matmul with the layer index (quant.Q4Layer);
    # float ones are sliced by the scan, inside XLA:TPU's matmul fusions.
    q4 = {name: w for name, w in stacked.items() if quant.is_q4(w)}
    floats = {name: w for name, w in stacked.items() if name not in q4}

    def body(carry, xs):
        h, k, v, tapped = carry
        i, lp, window = xs
        lp = {**lp, **{name: quant.Q4Layer(w, i) for name, w in q4.items()}}
        h, k, v = _layer(cfg, inv_freq, h, lp, k, v, 0 if window is None else window, positions, cache_rows, ctx_len,
                         tree_mask, attention, kv_chunk, layer=i)
        if tapped is not None:
            tapped = jax.lax.dynamic_update_slice(tapped, h[None], (jnp.asarray(slot)[i], 0, 0, 0))
        return (h, k, v, tapped), None

    tapped = jnp.zeros((len(wanted) + 1, *h.shape), h.dtype) if taps else None
    xs = (jnp.arange(n, dtype=jnp.int32), floats, jnp.asarray(cfg.windows, jnp.int32) if varying else None)
    (h, k, v, tapped), _ = jax.lax.scan(body, (h, cache.k, cache.v, tapped), xs)
    if taps:
        tapped = jnp.stack([tapped[wanted.index(i % n)] for i in taps])
    return h, KVCache(k, v), tapped


def stack_layers(params: dict) -> dict:
    """Per-layer parameters (`layers`: a list of dicts) -> the layer_loop "scan" layout (`layers`: one
    dict of [L, ...] arrays; a Q4 matrix's parts are stacked alike)."""
    if isinstance(params["layers"], dict):
        return params
    return dict(params, layers=jax.tree.map(lambda *xs: jnp.stack(xs), *params["layers"]))


def unstack_layers(params: dict) -> dict:
    """The layer_loop "scan" layout -> per-layer parameters (inverse of `stack_layers`)."""
    if not isinstance(params["layers"], dict):
        return params
    n = len(jax.tree.leaves(params["layers"])[0])
    return dict(params, layers=[jax.tree.map(lambda x, i=i: x[i], params["layers"]) for i in range(n)])


def with_layer_loop(cfg: ModelConfig, params: dict, layer_loop: str) -> tuple[ModelConfig, dict]:
    """(cfg, params) for `layer_loop` ("unroll" | "scan", ModelConfig.layer_loop): the parameters
    restacked to match. Checkpoints, declarations and shardings keep the per-layer layout; convert
    once after loading (stacking copies the layer weights once)."""
    cfg = dataclasses.replace(cfg, layer_loop=layer_loop)
    return cfg, (stack_layers if layer_loop == "scan" else unstack_layers)(params)


def to_linen(params: dict) -> dict:
    """jspec's layout (`layers`: a list) -> the module's tree (`layers`: {"0": ..., "1": ...}). The
    stacked layers of layer_loop "scan" are not module variables (the forward scans over them)."""
    if "layers" not in params:
        return params
    if isinstance(params["layers"], dict):
        return {k: x for k, x in params.items() if k != "layers"}
    return dict(params, layers={str(i): lp for i, lp in enumerate(params["layers"])})


def from_linen(tree: dict) -> dict:
    """The module's tree -> jspec's layout (inverse of `to_linen`); works on boxed trees too."""
    if "layers" not in tree:
        return dict(tree)
    layers = tree["layers"]
    return dict(tree, layers=[layers[str(i)] for i in range(len(layers))])


@functools.lru_cache(maxsize=64)  # tracing the declarations is cheap but not free
def declarations(cfg: ModelConfig, dtype=jnp.float32) -> dict:
    """Every parameter's declaration (boxes of ShapeDtypeStructs), in jspec's layout."""
    return from_linen(abstract_tree(Transformer(cfg, param_dtype=dtype), Transformer.declare)["params"])


def layer_shapes(cfg: ModelConfig) -> dict:
    """Shape of every parameter of one decoder layer."""
    return param_shapes(cfg)["layers"][0]


def param_shapes(cfg: ModelConfig) -> dict:
    """Shape of every parameter, in the pytree layout above (`layers`: a list of per-layer dicts)."""
    return shapes(declarations(cfg))


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random parameters (normal(std) matrices, unit norms, zero biases) for tests and training, in the
    layout of cfg.layer_loop."""
    tree = init_tree(Transformer(cfg, init_std=std, param_dtype=dtype), Transformer.declare, key)
    params = from_linen(unbox(tree)["params"])
    return stack_layers(params) if cfg.layer_loop == "scan" else params


def count_params(params: dict) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))
