"""Array math shared by the kernels' bodies (pure functions of in-register tiles, no refs).

Every function here runs inside a Pallas kernel (Mosaic TPU, the portable `pallas_call`, or the
interpreters) and uses only 2-D element-wise ops, row reductions and matmuls, so that one body lowers
on every backend. Attention uses the usual online softmax: a running row maximum m [R, 1], a running
normaliser l [R, 1] and an unnormalised accumulator acc [R, Dh], all float32. A tile's RMSNorm is
`jspec.models.layers.rms_norm` itself, which is such a function.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

# Finite start for the running maximum: exp(m_old - m_new) stays finite (1) for a row that has seen
# no visible key yet, where -inf would give exp(-inf + inf) = NaN.
NEG = -1e30
# Lanes of the m / l scratch rows on TPU (one vreg wide; the value is replicated across them).
STAT_LANES = 128


def rotation(head_dim: int, dtype) -> np.ndarray:
    """R [Dh, Dh] with x @ R = rotate_half(x) = [-x2, x1]: a signed permutation, so the product is exact."""
    half = head_dim // 2
    r = np.zeros((head_dim, head_dim), np.float32)
    r[np.arange(half) + half, np.arange(half)] = -1.0
    r[np.arange(half), np.arange(half) + half] = 1.0
    return r.astype(dtype)


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array, rot: jax.Array) -> jax.Array:
    """Rotate-half RoPE of x [R, Dh] with cos/sin [R, Dh] in x's dtype (as `layers.rope`).

    rotate_half is a matmul with the signed permutation R: it avoids lane slicing / concatenation,
    which not every backend lowers for Dh < 128. float32 takes HIGHEST precision (exact: one nonzero
    per column); bf16 takes the default (bf16 x bf16 products accumulated in float32 are exact too,
    and Mosaic rejects a HIGHEST-precision dot on bf16 operands)."""
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    rotated = jnp.dot(x, rot, precision=precision, preferred_element_type=jnp.float32)
    return x * cos + rotated.astype(x.dtype) * sin


def mm(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b [K, N] accumulated in float32."""
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def mm_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b [N, K].T accumulated in float32, without materialising a transpose: scores against
    keys [N, Dh], and projections by a weight tile stored [out, in] (as `layers.linear`)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def init_stats(rows: int, head_dim: int):
    """Empty online-softmax state (m, l, acc) for `rows` query rows."""
    return (jnp.full((rows, 1), NEG, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))


def stats_in_scratch(m_s, l_s, acc_s, rows: int):
    """(store, load) of the online-softmax state of head chunk c in VMEM scratch across grid steps:
    m and l are kept broadcast over STAT_LANES lanes (a lane-dense [rows, 128] tile), acc as it is."""

    def store(c, state):
        m, l, acc = state
        m_s[c] = jnp.broadcast_to(m, (rows, STAT_LANES))
        l_s[c] = jnp.broadcast_to(l, (rows, STAT_LANES))
        acc_s[c] = acc

    def load(c):
        return m_s[c][:, :1], l_s[c][:, :1], acc_s[c]

    return store, load


def attend(state, q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float):
    """Fold keys k [N, Dh] / values v [N, Dh] into the state of queries q [R, Dh].

    visible [R, N] (or broadcastable): which keys each query may see. Invisible scores become -inf
    before the maximum, so NaN or garbage in an invisible key never reaches the output; values of rows
    no query may see must be zeroed by the caller (0 * NaN would still be NaN)."""
    m, l, acc = state
    s = jnp.where(visible, mm_nt(q, k) * scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    p = jnp.exp(s - m_new)
    alpha = jnp.exp(m - m_new)
    l = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
    acc = alpha * acc + mm(p.astype(v.dtype), v)
    return m_new, l, acc


def finish(l: jax.Array, acc: jax.Array) -> jax.Array:
    """Normalised attention output [R, Dh] float32; a query that saw no key gets zeros."""
    return jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)


def unpack_bits(words, n: int) -> jax.Array:
    """bool [R, n] from a bitmask words [R, >= ceil(n / 32)] int32 (bit k % 32 of word k // 32).

    words may be a ref: each word column is then loaded on its own (GPU lowerings cannot slice values)."""
    rows = words.shape[0]
    cols = lax.broadcasted_iota(jnp.int32, (rows, n), 1)
    word_of, bit_of = cols >> 5, cols & 31
    out = jnp.zeros((rows, n), jnp.bool_)
    for w in range(words.shape[1]):
        bit = lax.shift_right_logical(words[:, w:w + 1], bit_of) & 1
        out = out | ((word_of == w) & (bit == 1))
    return out


def context_tiles(lo, hi, block_k: int, num_tiles: int):
    """First and last cache tile holding rows of [lo, hi) (clamped into range when it is empty).

    Used by index maps (a step outside [first, last] re-addresses an edge tile, so no DMA is issued)
    and by kernel bodies (which skip those steps)."""
    first = jnp.minimum(lo // block_k, num_tiles - 1)
    last = jnp.maximum(jnp.minimum((hi - 1) // block_k, num_tiles - 1), first)
    return first, last
