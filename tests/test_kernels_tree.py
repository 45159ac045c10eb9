"""The tree-attention kernels against `ref_tree_attention`, and `transformer.forward(attention="pallas")`
against the reference forward on a tree pass (interpret mode on CPU).

Cache rows at or after ctx_len hold NaN: a kernel that reads them into the result fails. The TPU
kernel runs under `pltpu.InterpretParams()` (NaN-filled scratch, bounds-checked block reads).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jspec.decode.spec import ancestor_mask
from jspec.kernels import pack_bits, ref_tree_attention, tree_attention, unpack_bits
from jspec.models import transformer
from jspec.models.config import ModelConfig

TPU = ("tpu", pltpu.InterpretParams())
PORTABLE = ("portable", True)
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # rtol, and atol relative to the largest |reference|
CACHE, TILE = 37, 16  # the cache is not a multiple of the tile: the last tile overhangs
CTX_LEN = (20, 30)


def assert_close(out, ref, dtype):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=TOL[dtype], atol=TOL[dtype] * np.abs(ref).max())


def random_tree(key, batch: int, nodes: int):
    """parent [B, N] (-1 = the root's child, else an earlier node) and depth [B, N] >= 1."""
    parent = jax.vmap(lambda k: jax.random.randint(k, (nodes,), -1, jnp.arange(nodes)))(jax.random.split(key, batch))

    def deepen(i, depth):
        par = parent[:, i]
        return depth.at[:, i].set(jnp.where(par < 0, 1, jnp.take_along_axis(depth, par[:, None] % nodes, 1)[:, 0] + 1))

    return parent, jax.lax.fori_loop(0, nodes, deepen, jnp.zeros((batch, nodes), jnp.int32))


def tree_inputs(t, heads, kv_heads, dtype, head_dim=16, seed=0):
    """[root ; t - 1 nodes] of a random tree per row, over a [B, Hkv, S, Dh] cache with CTX_LEN committed
    rows."""
    keys = jax.random.split(jax.random.key(seed), 6)
    b = len(CTX_LEN)
    ctx_len = jnp.asarray(CTX_LEN, jnp.int32)
    parent, depth = random_tree(keys[0], b, t - 1)
    positions = ctx_len[:, None] + jnp.concatenate([jnp.zeros((b, 1), jnp.int32), depth], axis=1)
    bits = pack_bits(ancestor_mask(parent))
    junk = (jnp.arange(CACHE)[None, :] >= ctx_len[:, None])[:, None, :, None]
    cache = lambda k: jnp.where(junk, jnp.nan, jax.random.normal(k, (b, kv_heads, CACHE, head_dim))).astype(dtype)
    new = lambda k, h: jax.random.normal(k, (b, t, h, head_dim), dtype)
    return (new(keys[1], heads), cache(keys[2]), cache(keys[3]), new(keys[4], kv_heads), new(keys[5], kv_heads),
            positions, ctx_len, bits)


def test_bitmask_round_trip():
    mask = jax.random.bernoulli(jax.random.key(0), 0.5, (3, 40, 40))
    bits = pack_bits(mask)
    assert bits.shape == (3, 40, 2) and bits.dtype == jnp.int32
    assert (unpack_bits(bits, 40) == mask).all()
    assert int(pack_bits(jnp.array([[True, False, True]]))[0, 0]) == 5  # bit k % 32 of word k // 32


@pytest.mark.parametrize("nodes, heads, kv_heads, dtype, kernel", [
    (8, 2, 2, jnp.float32, TPU),
    (16, 4, 1, jnp.bfloat16, TPU),
    (16, 2, 2, jnp.float32, PORTABLE),
    (13, 4, 1, jnp.bfloat16, PORTABLE),
], ids=lambda v: getattr(v, "__name__", None) or (v[0] if isinstance(v, tuple) else None))
def test_tree_attention_matches_reference(nodes, heads, kv_heads, dtype, kernel):
    """Trees of 8 and 16 rows (and 13: padded inside), GQA 1 and 4; full attention (0), a window
    inside the committed context (5) and one beyond it (64), one compile for all three."""
    args = tree_inputs(nodes, heads, kv_heads, dtype)
    impl, interpret = kernel
    ref = jax.jit(lambda window, *a: ref_tree_attention(*a, window))
    fused = jax.jit(lambda window, *a: tree_attention(*a, window, impl=impl, interpret=interpret, block_k=TILE))
    for window in (0, 5, 64):
        want, got = ref(jnp.int32(window), *args), fused(jnp.int32(window), *args)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert_close(got, want, dtype)


def test_wide_trees_span_bitmask_words_and_head_groups():
    """40 rows (two bitmask words), one KV head per grid step, a window that also cuts new keys."""
    args = tree_inputs(40, 4, 2, jnp.float32, seed=1)
    want = jax.jit(lambda *a: ref_tree_attention(*a, jnp.int32(3)))(*args)
    got = jax.jit(lambda *a: tree_attention(*a, jnp.int32(3), impl="tpu", interpret=True, block_k=TILE,
                                            kv_heads=1))(*args)
    assert_close(got, want, jnp.float32)


def _prefilled(size: int):
    """A 2-layer target (sliding and full attention) and a cache of `size` rows holding a 36-token
    prompt per row; rows 36.. hold NaN."""
    cfg = ModelConfig(family="qwen3", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, sliding_window=4,
                      layer_types=("sliding_attention", "full_attention"))
    params = transformer.init_params(cfg, jax.random.key(0), std=0.2)
    prompt = jax.random.randint(jax.random.key(1), (2, 36), 0, 64)
    cache = transformer.KVCache.zeros(cfg, 2, size)
    nan_tail = lambda layers: tuple(x.at[:, :, 36:].set(jnp.nan) for x in layers)  # rows 36.. of [B, Hkv, S, Dh]
    cache = dataclasses.replace(cache, k=nan_tail(cache.k), v=nan_tail(cache.v))
    cache = transformer.forward(params, cfg, prompt, jnp.broadcast_to(jnp.arange(36), (2, 36)), cache).cache
    return cfg, params, cache


def test_forward_with_the_tree_kernel_equals_the_reference_forward():
    """A target tree pass (scratch cache rows from ctx_len on) with sliding and full layers. Cache rows
    past the prompt hold NaN; row 1's last four nodes fall outside the cache (their writes are dropped,
    so no query may see them)."""
    cfg, params, cache = _prefilled(40)
    parent, depth = random_tree(jax.random.key(2), 2, 9)
    ctx_len = jnp.array([11, 34])  # the root (anchor) sits at position ctx_len
    positions = ctx_len[:, None] + jnp.concatenate([jnp.zeros((2, 1), jnp.int32), depth], axis=1)
    tokens = jax.random.randint(jax.random.key(3), (2, 10), 0, 64)
    kw = dict(ctx_len=ctx_len, cache_rows=ctx_len[:, None] + jnp.arange(10)[None], tree_mask=ancestor_mask(parent))
    run = jax.jit(lambda attention: transformer.forward(params, cfg, tokens, positions, cache, attention=attention,
                                                        **kw), static_argnums=0)
    want, got = run("reference"), run("pallas")
    assert_close(got.hidden, want.hidden, jnp.float32)
    # The second layer's keys come from the first layer's output; the unwritten rows stay NaN in both.
    np.testing.assert_allclose(np.asarray(got.cache.k), np.asarray(want.cache.k), rtol=1e-5, atol=1e-5)


def test_chain_and_decode_passes_with_the_kernel_equal_the_reference_forward():
    """Without a tree mask, attention="pallas" runs passes of up to KERNEL_MAX_TOKENS tokens (decode and
    chain verification) through the kernel with the causal mask; rows at different lengths, a sliding
    layer, NaN past the prompt. A longer pass (prefill) takes the reference path."""
    cfg, params, cache = _prefilled(48)
    for width in (1, 5):
        tokens = jax.random.randint(jax.random.key(width), (2, width), 0, 64)
        positions = jnp.array([[9], [30]]) + jnp.arange(width)[None]  # rows at lengths 9 and 30
        run = jax.jit(lambda attention: transformer.forward(params, cfg, tokens, positions, cache,
                                                            attention=attention), static_argnums=0)
        want, got = run("reference"), run("pallas")
        assert_close(got.hidden, want.hidden, jnp.float32)
    long = jnp.zeros((1, transformer.KERNEL_MAX_TOKENS + 1), jnp.int32)
    prefill = lambda attention: jax.make_jaxpr(lambda t: transformer.forward(
        params, cfg, t, jnp.arange(t.shape[1])[None], transformer.KVCache.zeros(cfg, 1, 80),
        attention=attention).hidden)(long)
    assert "pallas_call" not in str(prefill("pallas"))
    assert "pallas_call" in str(jax.make_jaxpr(lambda: transformer.forward(params, cfg, tokens, positions, cache,
                                                                          attention="pallas").hidden)())


def test_a_tree_pass_without_cache_rows_is_refused():
    """Tree nodes' positions repeat across branches, and the cache takes consecutive rows per pass."""
    cfg = ModelConfig(family="qwen3", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    params = transformer.init_params(cfg, jax.random.key(0))
    positions = jnp.array([[4, 5, 5]])
    with pytest.raises(ValueError, match="a tree pass needs cache_rows"):
        transformer.forward(params, cfg, jnp.zeros((1, 3), jnp.int32), positions, transformer.KVCache.zeros(cfg, 1, 8),
                            tree_mask=jnp.ones((1, 3, 3), bool))
