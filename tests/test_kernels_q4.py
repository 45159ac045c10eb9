"""The Q4 matmul kernels (jspec.kernels.q4) against `quant._reference_matmul` and a float64 numpy
x @ (s * c + b).T, interpreted on CPU: impl "tpu" under `pltpu.InterpretParams()` (NaN-filled scratch,
bounds-checked block reads) and impl "portable" (the GPU kernel's program, interpreted).

Tolerances (|out - want| <= tol * |want| + tol * max|want|):
- float32: 1e-5 against both (the kernel's weights are s * c + b rounded once to float32, products
  summed in float32 in another order: a few ulps of the largest partial sums);
- bfloat16: 1e-2 against the reference (the same bf16 weights; the results differ by the order of the
  float32 sums before the one rounding to bf16: at most about an ulp, 2^-8 relative) and 2e-2 against
  float64 of the unrounded s * c + b (the weights' rounding to bf16, 2^-9 relative each, plus the
  output's);
- bf16 operands with a float32 result (the LM head): 1e-5 against the reference and against float64
  of the bf16-rounded weights (identical, exactly representable products; only the sums' order differs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jspec.kernels import q4 as q4k
from jspec.kernels import q4_matmul
from jspec.models import quant

IMPLS = [pytest.param(("tpu", pltpu.InterpretParams()), id="tpu"), pytest.param(("portable", True), id="portable")]
TOL_REF = {"float32": 1e-5, "bfloat16": 1e-2}
TOL_F64 = {"float32": 1e-5, "bfloat16": 2e-2}


def random_q4(out: int, inp: int, dtype, seed: int = 0) -> quant.Q4:
    """A random [out, in] matrix quantized on the host (weights of varying scale and offset per row)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out, inp)) * rng.uniform(0.1, 2.0, (out, 1)) + rng.uniform(-1, 1, (out, 1))
    return jax.tree_util.tree_map(jnp.asarray, quant.quantize(np.asarray(w, np.float32).astype(dtype)))


def random_x(shape, dtype, seed: int = 1) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32).astype(dtype)


def float64_matmul(x, q: quant.Q4, rounded: bool = False) -> np.ndarray:
    """x @ W.T in float64, W = s * c + b from the codes in float64 (or, rounded=True, the weights
    `quant.dequantize` gives, rounded to the scales' dtype)."""
    x64 = np.asarray(x.astype(jnp.float32), np.float64).reshape(-1, x.shape[-1])
    if rounded:
        w = np.asarray(quant.dequantize(q).astype(jnp.float32), np.float64)
    else:
        codes = np.asarray(quant.unpack(q.codes), np.float64)
        s, b = (np.repeat(np.asarray(a.astype(jnp.float32), np.float64), quant.GROUP_SIZE, axis=1)
                for a in (q.scales, q.biases))
        w = s * codes + b
    return (x64 @ w.T).reshape(*x.shape[:-1], -1)


def assert_close(out, want, tol: float):
    out, want = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64), np.asarray(want, np.float64)
    assert out.shape == want.shape
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol * np.abs(want).max())


# (x shape, out, in): M = 1, 5, 16 (the last as [2, 8] leading dims); out not a multiple of 16 or 128.
SHAPES = [((1, 64), 8, 64), ((5, 192), 40, 192), ((2, 8, 256), 96, 256)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("x_shape, out, inp", SHAPES, ids=["M1", "M5", "M16"])
def test_matches_reference_and_float64(impl, dtype, x_shape, out, inp):
    q = random_q4(out, inp, dtype)
    x = random_x(x_shape, dtype)
    got = q4_matmul(x, q, impl=impl[0], interpret=impl[1])
    ref = quant._reference_matmul(x, q)
    assert got.shape == (*x_shape[:-1], out) and got.dtype == ref.dtype == jnp.dtype(dtype)
    assert_close(got, ref, TOL_REF[dtype])
    assert_close(got, float64_matmul(x, q), TOL_F64[dtype])


@pytest.mark.parametrize("impl", IMPLS)
def test_lm_head_float32_result(impl):
    """bf16 hidden states and head, float32 logits (as `layers.lm_logits`); out 200 > 128: on TPU two
    column tiles, the second overhanging the matrix."""
    q = random_q4(200, 128, "bfloat16", seed=2)
    x = random_x((3, 128), "bfloat16", seed=3)
    got = q4_matmul(x, q, jnp.float32, impl=impl[0], interpret=impl[1])
    ref = quant._reference_matmul(x, q, jnp.float32)
    assert got.dtype == ref.dtype == jnp.float32
    assert_close(got, ref, 1e-5)
    assert_close(got, float64_matmul(x, q, rounded=True), 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rows, m", [(8, 20), (32, 70)], ids=["columns-outer", "rows-outer"])
def test_many_tiles(monkeypatch, impl, rows, m):
    """Small tiles, so that one call has several row tiles (the last overhanging M on TPU, M padded on
    GPU), column tiles (the last overhanging out on TPU) and K chunks. On TPU (8, 20) puts the columns
    outermost (x re-read per column tile is cheaper), (32, 70) the rows (weights re-read per row tile)."""
    monkeypatch.setattr(q4k, "TPU_ROWS", rows)
    monkeypatch.setattr(q4k, "TPU_CHUNK", 128)
    monkeypatch.setattr(q4k, "TPU_CODES_TILE_BYTES", 128 * 256 // 2)  # 128 columns per tile
    monkeypatch.setattr(q4k, "GPU_ROWS", 16)
    monkeypatch.setattr(q4k, "GPU_CHUNK", (64, 64))
    q = random_q4(300, 256, "float32", seed=4)
    x = random_x((m, 256), "float32", seed=5)
    got = q4_matmul(x, q, impl=impl[0], interpret=impl[1])
    assert_close(got, quant._reference_matmul(x, q), 1e-5)
    assert_close(got, float64_matmul(x, q), 1e-5)


def test_float32_inputs_with_bf16_weights():
    """x float32 against bf16 weights: the weights rounded to bf16, then products in float32 (as the
    reference's promotion); a float32 result."""
    q = random_q4(24, 128, "bfloat16", seed=6)
    x = random_x((4, 128), "float32", seed=7)
    got = q4_matmul(x, q, impl="tpu", interpret=pltpu.InterpretParams())
    ref = quant._reference_matmul(x, q)
    assert got.dtype == ref.dtype == jnp.float32
    assert_close(got, ref, 1e-5)
    assert_close(got, float64_matmul(x, q, rounded=True), 1e-5)


def test_registry_dispatch_runs_the_kernel():
    q = random_q4(40, 192, "float32", seed=8)
    x = random_x((5, 192), "float32", seed=9)
    params = quant.with_kernel({"w": q}, "pallas")
    assert params["w"].kernel == "pallas"
    assert "pallas_call" in str(jax.make_jaxpr(lambda x: quant.matmul(x, params["w"]))(x))
    assert "pallas_call" not in str(jax.make_jaxpr(lambda x: quant.matmul(x, q))(x))  # "reference"
    got = jax.jit(lambda x, w: quant.matmul(x, w))(x, params["w"])  # pallas_setup's defaults: interpreted here
    assert_close(got, quant._reference_matmul(x, q), 1e-5)


def test_empty_rows():
    q = random_q4(8, 64, "float32")
    got = q4_matmul(jnp.zeros((0, 3, 64), jnp.float32), q)
    assert got.shape == (0, 3, 8) and got.dtype == jnp.float32


def test_unsupported_inputs_raise():
    q = random_q4(40, 192, "float32")
    x = random_x((2, 192), "float32")
    stack = jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), q)
    with pytest.raises(ValueError, match="one \\[out, in\\] Q4 matrix"):
        q4_matmul(x, stack)
    with pytest.raises(ValueError, match="does not match"):
        q4_matmul(x[:, :128], q)
    with pytest.raises(ValueError, match="float inputs"):
        q4_matmul(x.astype(jnp.int32), q)
    with pytest.raises(ValueError, match="preferred_element_type"):
        q4_matmul(x, q, jnp.int32)
    with pytest.raises(ValueError, match="inconsistent Q4"):
        q4_matmul(x, quant.Q4(q.codes, q.scales[:, :2], q.biases))
    with pytest.raises(ValueError, match="uint32"):
        q4_matmul(x, quant.Q4(q.codes.astype(jnp.int32), q.scales, q.biases))
    # The compiled GPU kernel: out a multiple of 16 (40 is not), in a multiple of 128 (192 is not).
    with pytest.raises(ValueError, match="multiple of 16"):
        q4_matmul(x, q, impl="portable", interpret=False)
    with pytest.raises(ValueError, match="unknown kernel implementation"):
        q4_matmul(x, q, impl="cuda")


@pytest.mark.parametrize("codes_t, scales_t", [(False, False), (False, True), (True, False), (True, True)])
def test_tpu_weight_orientations(monkeypatch, codes_t, scales_t):
    """The TPU kernel reads codes and scales / biases either as [out, ...] or as their transposes
    (whichever layout the TPU stores them in): all four combinations, whatever the shape would pick."""
    monkeypatch.setattr(q4k, "tpu_column_major", lambda rows, cols, dtype: codes_t if dtype == jnp.uint32 else scales_t)
    monkeypatch.setattr(q4k, "TPU_CHUNK", 128)  # two chunks
    q = random_q4(40, 256, "bfloat16", seed=10)
    x = random_x((5, 256), "bfloat16", seed=11)
    got = q4_matmul(x, q, impl="tpu", interpret=pltpu.InterpretParams())
    assert_close(got, quant._reference_matmul(x, q), TOL_REF["bfloat16"])


def test_tpu_layout_rule():
    """The layouts of libtpu's deviceless v5p compile for 2-D arrays (column-major where that pads
    less): Qwen3-8B's scales [out, in / 64] are column-major, its codes [out, in / 8] row-major."""
    for shape in [(4096, 64), (1024, 64), (12288, 64), (4096, 192), (151936, 64), (100, 64), (4096, 320)]:
        assert q4k.tpu_column_major(*shape, jnp.bfloat16), shape
    for shape in [(4096, 128), (4096, 256), (4096, 384), (64, 64), (8, 64), (3, 64)]:
        assert not q4k.tpu_column_major(*shape, jnp.bfloat16), shape
    for shape in [(4096, 512), (1024, 512), (12288, 512), (4096, 1536), (151936, 512)]:
        assert not q4k.tpu_column_major(*shape, jnp.uint32), shape
    assert q4k.tpu_column_major(2048, 320, jnp.uint32)  # in 2560: in / 8 not a multiple of 128
