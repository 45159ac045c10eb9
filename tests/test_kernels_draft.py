"""The fused DFlash draft-layer kernels against `ref_draft_layer` (interpret mode on CPU).

Context rows at or after a row's last anchor hold NaN: a kernel that reads them into the result
(instead of masking and zeroing them) fails. The TPU kernel runs under `pltpu.InterpretParams()`,
which also fills VMEM scratch with NaN and checks every block read against the buffer bounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jspec.kernels import draft_layer, ref_draft_layer
from jspec.models import transformer
from jspec.models.config import ModelConfig

TPU = ("tpu", pltpu.InterpretParams())
PORTABLE = ("portable", True)
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # rtol, and atol relative to the largest |reference|
CONTEXT, TILE = 37, 16  # the context is not a multiple of the tile: the last tile overhangs


def assert_close(out, ref, dtype):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=TOL[dtype], atol=TOL[dtype] * np.abs(ref).max())


def layer_inputs(block, heads, kv_heads, dtype, anchors, hidden=64, mlp=128, head_dim=16, seed=0):
    cfg = ModelConfig(family="qwen3", vocab_size=128, hidden_size=hidden, intermediate_size=mlp, num_layers=1,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, qk_norm=True)
    keys = jax.random.split(jax.random.key(seed), 8)
    lp = transformer.init_params(cfg, keys[0], std=0.2)["layers"][0]
    for i, name in enumerate(("attn_norm", "mlp_norm", "q_norm", "k_norm")):  # random gains: a swapped norm shows
        lp[name] = 1.0 + 0.3 * jax.random.normal(keys[1 + i], lp[name].shape)
    lp = jax.tree_util.tree_map(lambda x: x.astype(dtype), lp)
    anchors = jnp.asarray(anchors, jnp.int32)  # [B, A]
    b, a = anchors.shape
    h = jax.random.normal(keys[5], (b, a, block, hidden), dtype)
    shape = (b, CONTEXT, kv_heads * head_dim)
    junk = (jnp.arange(CONTEXT)[None, :] >= anchors.max(axis=1)[:, None])[:, :, None]
    ctx_k = jnp.where(junk, jnp.nan, jax.random.normal(keys[6], shape)).astype(dtype)
    ctx_v = jnp.where(junk, jnp.nan, jax.random.normal(keys[7], shape)).astype(dtype)
    return cfg, (h, lp, ctx_k, ctx_v, anchors)


@pytest.mark.parametrize("block, heads, kv_heads, dtype, kernel", [
    (8, 2, 2, jnp.float32, TPU),
    (16, 4, 1, jnp.bfloat16, TPU),
    (16, 2, 2, jnp.float32, PORTABLE),
    (8, 4, 1, jnp.bfloat16, PORTABLE),
], ids=lambda v: getattr(v, "__name__", None) or (v[0] if isinstance(v, tuple) else None))
def test_draft_layer_matches_reference(block, heads, kv_heads, dtype, kernel):
    """Blocks of 8 and 16, GQA 1 and 4; full attention (0), a window inside the context (4) and one
    beyond it (64). The window is traced, so one compile serves all three."""
    cfg, args = layer_inputs(block, heads, kv_heads, dtype, anchors=[[20], [30]])
    impl, interpret = kernel
    ref = jax.jit(lambda window, *a: ref_draft_layer(*a, window, cfg))
    fused = jax.jit(lambda window, *a: draft_layer(*a, window, cfg, impl=impl, interpret=interpret, block_k=TILE))
    for window in (0, 4, 64):
        want, got = ref(jnp.int32(window), *args), fused(jnp.int32(window), *args)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert_close(got, want, dtype)


@pytest.mark.parametrize("kernel", [TPU, PORTABLE], ids=["tpu", "portable"])
def test_causal_layer_matches_reference(kernel):
    """A causal layer (block slot i sees slots <= i), with no window, a window inside the block (3 < 8:
    far slots masked) and one beyond it."""
    cfg, args = layer_inputs(8, 4, 2, jnp.float32, anchors=[[20], [30]])
    impl, interpret = kernel
    ref = jax.jit(lambda window, *a: ref_draft_layer(*a, window, cfg, causal=True))
    fused = jax.jit(lambda window, *a: draft_layer(*a, window, cfg, causal=True, impl=impl, interpret=interpret,
                                                   block_k=TILE))
    bidirectional = jax.jit(lambda window, *a: ref_draft_layer(*a, window, cfg))
    for window in (0, 3, 64):
        want = ref(jnp.int32(window), *args)
        assert_close(fused(jnp.int32(window), *args), want, jnp.float32)
        # the mask is not a no-op: the last slot sees every slot either way, the first slot does not
        other = bidirectional(jnp.int32(window), *args)
        assert np.abs(np.asarray(want - other)[:, :, 0]).max() > 1e-3
        np.testing.assert_allclose(np.asarray(want)[:, :, -1], np.asarray(other)[:, :, -1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", [TPU, PORTABLE], ids=["tpu", "portable"])
def test_many_blocks_per_row_padded_slots_and_tiled_heads(kernel):
    """Training's layout (3 blocks per row, one anchored at 0 with no context), a block of 5 slots
    (padded to 8 inside), one KV head per grid step and two MLP tiles."""
    cfg, args = layer_inputs(5, 4, 2, jnp.float32, anchors=[[20, 0, 9], [30, 3, 11]], mlp=256)
    impl, interpret = kernel
    want = jax.jit(lambda *a: ref_draft_layer(*a, jnp.int32(6), cfg))(*args)
    got = jax.jit(lambda *a: draft_layer(*a, jnp.int32(6), cfg, impl=impl, interpret=interpret, block_k=TILE,
                                         kv_heads=1, block_f=128))(*args)
    assert_close(got, want, jnp.float32)


def test_reference_in_static_steps_equals_one_block(monkeypatch):
    """The reference's unrolled context steps (GPU's default, forced here on CPU with 16-row steps: 16,
    16 and 5 rows) give the one-block layer; steps past every anchor are skipped, NaN rows never read."""
    from jspec.models import attention

    monkeypatch.setattr(attention, "STATIC_STEP_BACKENDS", ("cpu",))
    monkeypatch.setattr(attention, "KV_CHUNK_ROWS", {**attention.KV_CHUNK_ROWS, "cpu": 16})
    monkeypatch.setattr(attention, "STEP_ALIGN", 16)
    assert attention.static_steps(attention.KV_CHUNK, CONTEXT, queries=8) == ((0, 16), (16, 16), (32, 5))
    for anchors in ([[20], [30]], [[5], [9]], [[36], [2]]):
        cfg, args = layer_inputs(8, 4, 2, jnp.float32, anchors=anchors)
        for window in (0, 4):
            want = jax.jit(lambda *a: ref_draft_layer(*a, jnp.int32(window), cfg))(*args)
            got = jax.jit(lambda *a: ref_draft_layer(*a, jnp.int32(window), cfg, kv_chunk=attention.KV_CHUNK))(*args)
            assert_close(got, want, jnp.float32)


def test_gradients_flow_through_the_reference():
    """Under jax.grad the kernel's custom_vjp differentiates the reference (training support)."""
    cfg, (h, lp, ctx_k, ctx_v, anchors) = layer_inputs(8, 2, 2, jnp.float32, anchors=[[20], [30]])
    ctx_k, ctx_v = jnp.nan_to_num(ctx_k), jnp.nan_to_num(ctx_v)
    window = jnp.int32(4)

    def loss(fn, **kw):
        return lambda h, lp: jnp.sum(jnp.sin(fn(h, lp, ctx_k, ctx_v, anchors, window, cfg, **kw)))

    got = jax.jit(jax.grad(loss(draft_layer, impl="portable", interpret=True), argnums=(0, 1)))(h, lp)
    want = jax.jit(jax.grad(loss(ref_draft_layer), argnums=(0, 1)))(h, lp)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4 * np.abs(np.asarray(w)).max())
