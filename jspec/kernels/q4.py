"""Affine Q4 group-64 matmul: x @ W.T for a quantized W, each weight tile dequantized in on-chip memory.

Contract (`jspec.models.quant._reference_matmul` is the specification): x [..., in] (float; the
leading dimensions are flattened into M rows), q: one `quant.Q4` matrix [out, in] (codes uint32
[out, in / 8], eight 4-bit codes per word, the lowest bits first; scales / biases [out, in / 64] in
the weights' float dtype). Returns [..., out] in `preferred_element_type` if given, else in
result_type(x, weights) (x's dtype when it is the weights', the usual case). Each weight is
scale * code + bias in float32, rounded once to the scales' dtype (as `quant.dequantize`), cast to
the compute dtype result_type(x, weights); products are accumulated in float32 (float32 operands at
HIGHEST precision). Any M and any out; in is a multiple of 64 (the format's). `q4_matmul` raises
ValueError for what it does not support (see there). Importing this module registers it as the Q4
matmul "pallas" (`quant.with_kernel(tree, "pallas")`).

Both kernels walk the reduction in chunks of `chunk` inputs (chunk / 8 words, chunk / 64 groups) and
never interleave nibbles: nibble s of word j is input 8j + s, so the chunk's weights split into 8
planes W_s [tile, chunk / 8] (code s of every word, by shift and mask) and the chunk's product is
sum_s x[:, 8j + s] @ W_s.T, x's columns read with stride 8 in on-chip memory. The chunk's scales and
biases are spread over its words (8 words per group) once and shared by the 8 planes. The weights
are read as stored, never copied, padded or transposed in memory: each byte once per call when M fits
one row tile, as x (on GPU zero-padded first to the row tile unless M is 1 or a power of two >= 16).

Kernels:
"tpu" (Mosaic): grid (column tile, row tile), both "parallel" (megacore splits the column tiles);
    with several row tiles the order that re-reads less (x per column tile or the weights per row tile)
    is outermost. A step holds the whole reduction: x rows [tm, in] (tm = M up to 128, else 128-row
    tiles), a codes tile [tn, in / 8] and its scales / biases, streamed HBM -> VMEM by the double-
    buffered BlockSpec pipeline (a K grid axis would need scale blocks of a multiple of 128 groups,
    i.e. K tiles of 8192 inputs: none divides Qwen3's 12288). In the body an unrolled loop over
    chunks of 1024 inputs (128 words: whole lanes; fewer when in is not a multiple of 1024): the x
    chunk goes to VMEM transposed in float32 (Mosaic's strided loads are 32-bit, on sublanes), each
    plane's x columns are a stride-8 row read of it; scales / biases are spread by a 0/1 matmul on the
    MXU (exact); planes by shift / mask, scale * code + bias in float32; one MXU product per plane
    into a float32 VMEM accumulator [tm, tn]. A weight array whose TPU layout is column-major
    (`tpu_column_major`: Qwen3-8B's scales / biases [4096, 64]; codes whose in / 8 is not a multiple
    of 128) is read as the row-major transpose it already is ([in / 64, out] blocks [groups, tn];
    codes [in / 8, out] blocks [words, tn], planes [words, tn]), so XLA copies nothing. tn: a
    multiple of 128 (or all of out) whose codes tile is at most 2 MiB (in 4096: 1024 columns, in
    12288: 256), small enough for 4 column tiles where out allows; the last column / row tile may
    overhang (its extra rows read garbage that reaches only output rows / columns that are never
    written). At in 12288, bf16, M 128: x 3 MiB + codes 1.5 MiB + scales and biases 96 KiB each + out
    64 KiB per step, 9.5 MiB double-buffered, plus the accumulator [128, 256] f32, the transposed
    chunk (512 KiB) and a chunk's planes; tm, then tn, halve if a very wide `in` would overflow VMEM.
"portable" (GPU, lowered through Triton): grid (column tile, row tile); a program holds xp rows [bm,
    in] (bm = 1 for M = 1, else the power of two >= M in 16..128, M zero-padded to it), the codes /
    scales / biases of bn output rows, and walks the reduction by an in-kernel loop over chunks
    (Triton's pipeline stages each chunk's loads in shared memory): per chunk the codes [bn, chunk /
    8], the scales / biases [bn, chunk / 64] spread by broadcast + reshape, 8 planes, and per plane x's
    stride-8 columns [bm, chunk / 8] (a strided load) times the plane: a dot into a float32
    accumulator [bm, bn], or for M = 1 products and row sums on the CUDA cores (a dot needs 16 rows).
    bn: a power of two dividing out, 16..128, the largest that still gives about two programs per SM
    of an H200 (out 1024 / 4096: 16, 12288: 32, 151936: 128); chunk: a power of two in 128..1024
    dividing in with bn x chunk / 8 <= 4096 (register tiles) and <= 64 KiB of loads per step (3
    stages of shared memory). Compiled it needs out a multiple of 16 and in of 128 (Triton's
    power-of-two blocks and dot minimum).

On CPU both run interpreted (`pallas_setup`); see jspec.kernels for selection.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jspec.kernels._backend import (gpu_tiles, pallas_setup, pow2_at_least, pow2_at_most, pow2_divisor, round_up,
                                    tpu_tiles, vmem_limit)
from jspec.models import quant

_MIB = 1 << 20
GROUP = quant.GROUP_SIZE  # inputs per scale / bias
PER_WORD = quant.CODES_PER_WORD  # codes per uint32 word
WORDS_PER_GROUP = GROUP // PER_WORD

# TPU: codes bytes per column tile, the fewest column tiles wanted, rows per row tile, inputs per chunk.
TPU_CODES_TILE_BYTES = 2 * _MIB
TPU_MIN_COLUMN_TILES = 4
TPU_ROWS = 128
TPU_CHUNK = 1024
# GPU: largest row / column tile, chunk bounds, register and shared-memory budgets, programs wanted.
GPU_ROWS = 128
GPU_COLS = 128
GPU_CHUNK = (128, 1024)
GPU_TILE_ELEMENTS = 4096  # bn x chunk / 8: each [bn, words] temporary of a plane
GPU_STAGE_BYTES = 64 * 1024  # loads of one loop step (x rows + codes + scales / biases)
GPU_PROGRAMS = 264  # about two per SM of an H200 (132 SMs)


def q4_matmul(x: jax.Array, q: quant.Q4, preferred_element_type=None, layer=None, *, impl: str | None = None,
              interpret: Any = None) -> jax.Array:
    """x [..., in] @ W.T for a Q4 matrix W [out, in] by a Pallas kernel: [..., out]. Same contract and
    result as `quant._reference_matmul` (see the module docstring for it and for the tiling).

    impl / interpret: see `jspec.kernels.pallas_setup`. Raises ValueError for a stack of matrices, a
    width mismatch, an inconsistent Q4 (shapes, codes not uint32, scales / biases not one float dtype),
    non-float x or preferred_element_type, and for the compiled GPU kernel out not a multiple of 16 or
    in not a multiple of 128; for the TPU kernel an `in` so wide that 8 rows of x and 128 weight rows
    overflow VMEM. layer: q is a stack [L, out, in] and matrix `layer` (a traced index, prefetched as a
    scalar that picks the weight blocks) is read in place; TPU kernel only."""
    impl, interpret = pallas_setup(impl, interpret)
    if layer is not None:
        if impl != "tpu":
            raise ValueError("a stack of Q4 matrices (layer_loop='scan') is read by the TPU kernel only; on GPU keep "
                             "the unrolled layer loop (layer_loop='unroll')")
        if q.ndim != 3:
            raise ValueError(f"layer= indexes a stack of Q4 matrices [L, out, in], got {q.shape}")
    one = q if layer is None else quant.Q4(*(jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
                                             for a in (q.codes, q.scales, q.biases)))
    n, k = _check(x, one, preferred_element_type)
    if impl == "portable" and not interpret and (n % 16 or k % 128):
        raise ValueError(f"the GPU (Triton-lowered) Q4 kernel needs out a multiple of 16 and in a multiple of 128, "
                         f"got a {n} x {k} matrix: use the 'reference' Q4 matmul for it")
    cdt = jnp.result_type(x.dtype, q.dtype)
    out_dtype = jnp.dtype(preferred_element_type or cdt)
    lead = x.shape[:-1]
    m = math.prod(lead)
    if m == 0:
        return jnp.zeros((*lead, n), out_dtype)
    x2 = x.reshape(m, k).astype(cdt)
    if impl == "tpu":
        return _tpu_matmul(x2, q, out_dtype, interpret, layer)[:m].reshape(*lead, n)
    return _portable_matmul(x2, q, out_dtype, interpret)[:m].reshape(*lead, n)


def _check(x, q, preferred_element_type) -> tuple[int, int]:
    """(out, in) of a supported call, else ValueError."""
    if not quant.is_q4(q) or q.ndim != 2:
        raise ValueError(f"the Q4 kernel multiplies by one [out, in] Q4 matrix, got {getattr(q, 'shape', type(q))}: "
                         "index a stack first")
    n, words = q.codes.shape
    k = words * PER_WORD
    if q.codes.dtype != jnp.uint32:
        raise ValueError(f"Q4 codes must be uint32 words of 8 codes, got {q.codes.dtype}")
    if q.scales.shape != (n, k // GROUP) or q.biases.shape != (n, k // GROUP) or k % GROUP:
        raise ValueError(f"inconsistent Q4 matrix: codes {q.codes.shape}, scales {q.scales.shape}, biases "
                         f"{q.biases.shape} (want [out, in / 8], [out, in / 64] twice, in a multiple of 64)")
    if q.biases.dtype != q.scales.dtype or not jnp.issubdtype(q.scales.dtype, jnp.floating):
        raise ValueError(f"Q4 scales and biases must share one float dtype, got {q.scales.dtype} / {q.biases.dtype}")
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"input width {x.shape[-1] if x.ndim else None} does not match the Q4 matrix {(n, k)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"the Q4 kernel multiplies float inputs, got {x.dtype}")
    if preferred_element_type is not None and not jnp.issubdtype(preferred_element_type, jnp.floating):
        raise ValueError(f"preferred_element_type must be a float dtype, got {preferred_element_type}")
    return n, k


def _plane(codes: jax.Array, scale: jax.Array, bias: jax.Array, s: int, wdt, cdt) -> jax.Array:
    """Weights [rows, words] of nibble plane s (code s of each word, bits 4s .. 4s + 3): scale * code +
    bias in float32, rounded once to the weights' dtype wdt, then cast to the compute dtype cdt."""
    code = lax.shift_right_logical(codes, jnp.uint32(4 * s)) & jnp.uint32(quant.MAX_CODE)
    w = code.astype(jnp.int32).astype(jnp.float32) * scale + bias
    return w.astype(wdt).astype(cdt)


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _mm_nt(a: jax.Array, b: jax.Array, precision) -> jax.Array:
    """a [M, K] @ b [N, K].T accumulated in float32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)


# --- TPU (Mosaic) ---------------------------------------------------------------------------------


def tpu_chunk(k: int) -> int:
    """Inputs per in-kernel chunk on TPU: TPU_CHUNK (1024: 128 words, whole lanes) when it divides in,
    else the largest multiple of 64 below it that does."""
    c = min(TPU_CHUNK, k)
    while k % c:
        c -= GROUP
    return c


def tpu_column_tile(n: int, k: int) -> int:
    """Output columns per TPU grid step: all of out up to 128, else a multiple of 128 whose codes tile
    [tn, in / 8] fits TPU_CODES_TILE_BYTES, small enough for TPU_MIN_COLUMN_TILES tiles where out allows."""
    if n <= 128:
        return n
    by_bytes = max(128, (TPU_CODES_TILE_BYTES // (k // 2)) // 128 * 128)
    by_steps = round_up(-(-n // TPU_MIN_COLUMN_TILES), 128)
    return min(by_bytes, by_steps)


def tpu_column_major(rows: int, cols: int, dtype) -> bool:
    """Whether the TPU's default layout of a 2-D array [rows, cols] is column-major.

    TPU arrays are stored in (8, 128) tiles (16 rows for 16-bit types); of row- and column-major the
    runtime stores a 2-D array in the one with fewer padded elements (ties: row-major). So Qwen3-8B's
    scales / biases [4096, 64] or [4096, 192] are column-major, its codes [4096, 512] row-major, and
    codes [out, in / 8] with in / 8 not a multiple of 128 mostly column-major. The kernel reads such a
    matrix as the row-major transpose it already is (`.T` in the wrapper is a free bitcast; reading it
    the other way round would make XLA copy it into that layout first). A wrong guess costs that
    copy, never correctness."""
    sub = 8 * max(1, 4 // jnp.dtype(dtype).itemsize)
    return round_up(cols, sub) * round_up(rows, 128) < round_up(rows, sub) * round_up(cols, 128)


def _tpu_kernel(x_ref, c_ref, s_ref, b_ref, o_ref, acc_ref, xt_ref, *, chunk: int, codes_t: bool, scales_t: bool,
                wdt, cdt):
    """One (column tile, row tile) step. Weight planes are [tn, words] (codes [tn, in / 8]) or, with
    codes_t, [words, tn] (codes read transposed [in / 8, tn]); scales / biases [tn, in / 64] or, with
    scales_t, [in / 64, tn]."""
    k = x_ref.shape[1]
    words, groups = chunk // PER_WORD, chunk // GROUP
    precision, spread_precision = _precision(cdt), _precision(s_ref.dtype)
    # spread [g, j] = 1 where word j of a chunk is in group g (codes_t: its transpose [j, g]); a product
    # with it repeats each scale over its group's 8 words (one nonzero term per output: exact).
    shape = (words, groups) if codes_t else (groups, words)
    word_of, group_of = (lax.broadcasted_iota(jnp.int32, shape, int(not codes_t)),
                         lax.broadcasted_iota(jnp.int32, shape, int(codes_t)))
    spread = (word_of // WORDS_PER_GROUP == group_of).astype(s_ref.dtype)
    # Contract the groups: [tn, g] @ [g, w] or [g, tn]^T @ [g, w] -> [tn, w];
    # codes_t: [w, g] @ [g, tn] or [w, g] @ [tn, g]^T -> [w, tn].
    if codes_t:
        spread_dims = (((1,), (1,)) if not scales_t else ((1,), (0,)), ((), ()))
    else:
        spread_dims = (((0,), (0,)) if scales_t else ((1,), (0,)), ((), ()))

    def spread_over_words(ref, q):
        v = ref[q * groups:(q + 1) * groups, :] if scales_t else ref[:, q * groups:(q + 1) * groups]
        a, b = (spread, v) if codes_t else (v, spread)
        return lax.dot_general(a, b, spread_dims, precision=spread_precision, preferred_element_type=jnp.float32)

    plane_dims = (((1,), (0,)) if codes_t else ((1,), (1,)), ((), ()))  # xs [tm, w] @ [w, tn] / [tn, w]^T
    acc_ref[...] = jnp.zeros_like(acc_ref)
    for q in range(k // chunk):
        # Plane s needs x's columns 8j + s of the chunk: rows 8j + s of the chunk transposed, in float32
        # (Mosaic's strided loads are 32-bit and on sublanes), transposed back per plane.
        xt_ref[...] = x_ref[:, q * chunk:(q + 1) * chunk].astype(jnp.float32).T
        codes = c_ref[q * words:(q + 1) * words, :] if codes_t else c_ref[:, q * words:(q + 1) * words]
        scale, bias = spread_over_words(s_ref, q), spread_over_words(b_ref, q)
        part = None
        for s in range(PER_WORD):
            xs = xt_ref[pl.ds(s, words, stride=PER_WORD), :].T.astype(cdt)
            y = lax.dot_general(xs, _plane(codes, scale, bias, s, wdt, cdt), plane_dims, precision=precision,
                                preferred_element_type=jnp.float32)
            part = y if part is None else part + y
        acc_ref[...] += part
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _tpu_vmem_need(tm, tn, k, chunk, x_bytes, s_bytes, out_bytes, codes_t, scales_t) -> int:
    """VMEM bytes of one TPU call: double-buffered blocks (lane- and sublane-padded), the accumulator,
    the transposed chunk, and a chunk's temporaries (codes, spread scale / bias, planes: ~8 [tn, words]
    float32 arrays)."""
    lanes = lambda d: round_up(d, 128)
    tile = lambda r, c, transposed, sub: round_up(c, sub) * lanes(r) if transposed else round_up(r, sub) * lanes(c)
    blocks = (round_up(tm, 16) * lanes(k) * x_bytes + tile(tn, k // PER_WORD, codes_t, 8) * 4
              + 2 * tile(tn, k // GROUP, scales_t, 16) * s_bytes + round_up(tm, 16) * lanes(tn) * out_bytes)
    temps = 8 * (round_up(chunk // PER_WORD, 8) * lanes(tn) if codes_t else tn * lanes(chunk // PER_WORD)) * 4
    return 2 * blocks + 4 * round_up(tm, 8) * lanes(tn) + 4 * chunk * lanes(tm) + temps


def _tpu_matmul(x2, q: quant.Q4, out_dtype, interpret, layer=None):
    m, k = x2.shape
    n = q.codes.shape[-2]
    words, g = k // PER_WORD, k // GROUP
    chunk = tpu_chunk(k)
    tn = tpu_column_tile(n, k)
    tm = min(m, TPU_ROWS)
    codes_t, scales_t = tpu_column_major(n, words, q.codes.dtype), tpu_column_major(n, g, q.scales.dtype)
    tiles = tpu_tiles()
    sizes = (x2.dtype.itemsize, jnp.dtype(q.scales.dtype).itemsize, jnp.dtype(out_dtype).itemsize, codes_t, scales_t)
    while _tpu_vmem_need(tm, tn, k, chunk, *sizes) > tiles.vmem_cap and (tm > 8 or tn > 128):
        tm, tn = (max(8, round_up(tm // 2, 8)), tn) if tm > 8 else (tm, max(128, tn // 2 // 128 * 128))
    need = _tpu_vmem_need(tm, tn, k, chunk, *sizes)
    if need > tiles.vmem_cap:
        raise ValueError(f"a Q4 matrix with in = {k} is too wide for the TPU kernel: {tm} rows of x and {tn} weight "
                         f"rows need {need / _MIB:.0f} MiB of VMEM (cap {tiles.vmem_cap / _MIB:.0f} MiB)")
    cols, rows = pl.cdiv(n, tn), pl.cdiv(m, tm)
    # With several row tiles, the outer axis is the one whose operand re-reads cost less: x once per
    # column tile (columns outer), or the weights once per row tile (rows outer).
    matrix_bytes = q.nbytes // (q.codes.shape[0] if layer is not None else 1)
    rows_outer = (rows - 1) * matrix_bytes < (cols - 1) * x2.size * x2.dtype.itemsize
    if rows_outer:
        grid, at = (rows, cols), lambda f: (lambda i, j, *_: f(j, i))
    else:
        grid, at = (cols, rows), lambda f: (lambda j, i, *_: f(j, i))
    # A stack's blocks lead with its layer, the prefetched scalar (index maps get its ref last).
    stacked = (lambda f: (lambda *g: (g[-1][0], *at(f)(*g)))) if layer is not None else at

    def weight(a, width, transposed):  # the operand and its block: [tn, width] rows, or [width, tn] of a.T
        lead = (None,) * (a.ndim - 2)
        if transposed:
            return jnp.swapaxes(a, -1, -2), pl.BlockSpec((*lead, width, tn), stacked(lambda j, i: (0, j)))
        return a, pl.BlockSpec((*lead, tn, width), stacked(lambda j, i: (j, 0)))

    (codes, codes_spec), (scales, scale_spec), (biases, _) = (
        weight(q.codes, words, codes_t), weight(q.scales, g, scales_t), weight(q.biases, g, scales_t))
    kernel = functools.partial(_tpu_kernel, chunk=chunk, codes_t=codes_t, scales_t=scales_t, wdt=q.scales.dtype,
                               cdt=x2.dtype)
    scalars = ()
    if layer is not None:
        scalars = (jnp.asarray(layer, jnp.int32).reshape(1),)
        kernel = functools.partial(lambda body, _layer, *refs: body(*refs), kernel)
    # What a call moves (the byte accounting of compiled rounds reads it, jspec.aot.hlo_bytes): the
    # output, x and one matrix (of a stack), the operand of the inner grid axis again for every step
    # of the outer one when its block changes along the inner axis.
    x_reads = x2.size * x2.dtype.itemsize * (cols if not rows_outer and rows > 1 else 1)
    w_reads = matrix_bytes * (rows if rows_outer and cols > 1 else 1)
    cost = pl.CostEstimate(flops=2 * m * n * k, transcendentals=0,
                           bytes_accessed=x_reads + w_reads + m * n * jnp.dtype(out_dtype).itemsize)
    spec = dict(grid=grid,
                in_specs=[pl.BlockSpec((tm, k), at(lambda j, i: (i, 0))), codes_spec, scale_spec, scale_spec],
                out_specs=pl.BlockSpec((tm, tn), at(lambda j, i: (i, j))),
                scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32), pltpu.VMEM((chunk, tm), jnp.float32)])
    return pl.pallas_call(
        kernel,
        **({"grid_spec": pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, **spec)} if scalars else spec),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=vmem_limit(need, tiles)),
        cost_estimate=cost,
        interpret=interpret,
    )(*scalars, x2, codes, scales, biases)


# --- GPU (portable, Triton) -----------------------------------------------------------------------


def gpu_tiling(m: int, n: int, k: int, x_itemsize: int, s_itemsize: int) -> tuple[int, int, int]:
    """(bm, bn, chunk) of the portable kernel: see the module docstring."""
    bm = 1 if m == 1 else min(max(16, pow2_at_least(m)), GPU_ROWS)
    bn = pow2_divisor(n, min(GPU_COLS, max(16, pow2_at_most(max(1, n // GPU_PROGRAMS)))))
    chunk = pow2_divisor(k, GPU_CHUNK[1])
    stage = lambda c: bm * c * x_itemsize + bn * c // 2 + 2 * bn * (c // GROUP) * s_itemsize
    while chunk > GPU_CHUNK[0] and (bn * chunk // PER_WORD > GPU_TILE_ELEMENTS or stage(chunk) > GPU_STAGE_BYTES):
        chunk //= 2
    return bm, bn, chunk


def _portable_kernel(x_ref, c_ref, s_ref, b_ref, o_ref, *, chunk: int, wdt, cdt):
    bn, k_words = c_ref.shape
    words, groups = chunk // PER_WORD, chunk // GROUP
    precision = _precision(cdt)
    gemv = x_ref.shape[0] == 1

    def spread(v):  # [bn, groups] -> [bn, words]: each group's value over its 8 words
        v = v.astype(jnp.float32)
        return jnp.broadcast_to(v[:, :, None], (bn, groups, WORDS_PER_GROUP)).reshape(bn, words)

    def step(q, acc):
        codes = c_ref[:, pl.ds(q * words, words)]
        scale = spread(s_ref[:, pl.ds(q * groups, groups)])
        bias = spread(b_ref[:, pl.ds(q * groups, groups)])
        for s in range(PER_WORD):
            w = _plane(codes, scale, bias, s, wdt, cdt)
            xs = x_ref[:, pl.ds(q * chunk + s, words, stride=PER_WORD)]  # x's inputs 8j + s of the chunk
            if gemv:  # one row: products and row sums on the CUDA cores (a Triton dot needs 16 rows)
                acc = acc + jnp.sum(xs.astype(jnp.float32) * w.astype(jnp.float32), axis=1)[None, :]
            else:
                acc = acc + _mm_nt(xs, w, precision)
        return acc

    acc = lax.fori_loop(0, k_words // words, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _portable_matmul(x2, q: quant.Q4, out_dtype, interpret):
    m, k = x2.shape
    n = q.codes.shape[0]
    bm, bn, chunk = gpu_tiling(m, n, k, x2.dtype.itemsize, jnp.dtype(q.scales.dtype).itemsize)
    rows = round_up(m, bm)
    xp = jnp.pad(x2, [(0, rows - m), (0, 0)])  # Triton blocks may not overhang
    gt = gpu_tiles(x2.dtype.itemsize)
    weights = lambda width: pl.BlockSpec((bn, width), lambda j, i: (j, 0))
    return pl.pallas_call(
        functools.partial(_portable_kernel, chunk=chunk, wdt=q.scales.dtype, cdt=x2.dtype),
        grid=(n // bn, rows // bm),
        in_specs=[pl.BlockSpec((bm, k), lambda j, i: (i, 0)), weights(k // PER_WORD), weights(k // GROUP),
                  weights(k // GROUP)],
        out_specs=pl.BlockSpec((bm, bn), lambda j, i: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=gt.warps if bm < 128 else 2 * gt.warps,
                                                num_stages=gt.stages),
        interpret=interpret,
    )(xp, q.codes, q.scales, q.biases)


quant.register_matmul("pallas", q4_matmul)
