"""Affine Q4 group-64 weights: the quantized matrix type, its exact dequantization, and the matmul
that the models' projections, embeddings and LM heads use when a weight is quantized.

Format (the MLX layout): a matrix W [..., out, in] is stored as
    codes  uint32 [..., out, in / 8]   eight 4-bit codes per word, the lowest bits first
    scales        [..., out, in / 64]  one scale and one bias per group of 64 consecutive inputs
    biases        [..., out, in / 64]
with w[o, i] = scales[o, g] * code[o, i] + biases[o, g], g = i // 64, code in [0, 15]. Scales and biases
are in the model's weight dtype: 32 bytes of codes + 4 bytes of scale and bias per 64 bf16 weights,
9/16 byte per parameter.

Dequantization is defined once (`dequantize`): the product and sum in float32 (one rounding where the
compiler fuses them into a multiply-add, two where it does not: at most one unit in the last place
apart), then rounded to the weights' dtype. Every path (the XLA matmul here, the Pallas kernel in `jspec.kernels.q4`, the float
references of the tests) computes the same weight values, so a quantized model is a float model with
those weights; exactness of speculative decoding is relative to it.

Which matmul runs is a static field of each `Q4` (`kernel`): "reference" dequantizes inside the XLA
program (on XLA:CPU a one-row product fuses the dequantization into the product; wider passes
materialise the dequantized matrix), "pallas" calls the kernel registered by `jspec.kernels.q4`
(dequantization in on-chip memory). `with_kernel` sets it over a parameter tree.

A leaf module: it imports nothing from jspec, so `jspec.models.layers` and the kernels can use it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

GROUP_SIZE = 64
BITS = 4
CODES_PER_WORD = 32 // BITS
MAX_CODE = (1 << BITS) - 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q4:
    """A quantized matrix (or stack of matrices): see the module docstring for the layout."""

    codes: jax.Array
    scales: jax.Array
    biases: jax.Array
    kernel: str = dataclasses.field(default="reference", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The float matrix's shape [..., out, in]."""
        return tuple(self.codes.shape[:-1]) + (self.codes.shape[-1] * CODES_PER_WORD,)

    @property
    def dtype(self):
        """The dtype of the weights it stands for (that of its scales and biases)."""
        return self.scales.dtype

    @property
    def ndim(self) -> int:
        return self.codes.ndim

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in (self.codes, self.scales, self.biases))

    def __getitem__(self, index) -> "Q4":
        """Index the leading (stack) dimensions, e.g. the experts of an MoE layer or rows of an embedding:
        the last dimension (the packed inputs) is never indexed."""
        return Q4(self.codes[index], self.scales[index], self.biases[index], self.kernel)


def is_q4(x) -> bool:
    return isinstance(x, Q4)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q4Layer:
    """Matrix `index` (a traced layer index) of a stacked Q4 [L, out, in]: what a scanned layer loop
    (`transformer`, layer_loop "scan") hands each layer for a quantized matrix, so that its matmul
    reads that one matrix of the stack in place. A slice of the stack handed on instead would be
    copied wherever it meets a kernel or an optimization barrier."""

    stack: Q4
    index: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stack.shape[1:]

    @property
    def dtype(self):
        return self.stack.dtype


def unpack(codes: jax.Array) -> jax.Array:
    """uint32 [..., n / 8] -> uint32 codes [..., n] in [0, 15], the lowest 4 bits first."""
    shifts = jnp.arange(CODES_PER_WORD, dtype=jnp.uint32) * BITS
    nibbles = (codes[..., None] >> shifts) & jnp.uint32(MAX_CODE)
    return nibbles.reshape(codes.shape[:-1] + (codes.shape[-1] * CODES_PER_WORD,))


def dequantize(q: Q4, dtype=None) -> jax.Array:
    """The float matrix [..., out, in]: scale * code + bias in float32, rounded once to `dtype` (default:
    the scales' dtype)."""
    codes = unpack(q.codes).astype(jnp.float32)
    groups = codes.reshape(codes.shape[:-1] + (-1, GROUP_SIZE))
    w = groups * q.scales.astype(jnp.float32)[..., None] + q.biases.astype(jnp.float32)[..., None]
    return w.reshape(codes.shape).astype(dtype or q.dtype)


def dense(w, dtype=None):
    """A float matrix for either kind of weight: Q4 dequantized, float arrays unchanged."""
    return dequantize(w, dtype) if is_q4(w) else w


def embed_rows(table, tokens: jax.Array) -> jax.Array:
    """Rows `tokens` of an embedding table [V, D], float or Q4 (only the gathered rows are dequantized)."""
    return dequantize(table[tokens]) if is_q4(table) else table[tokens]


# --- matmuls --------------------------------------------------------------------------------------

# kernel name -> fn(x [..., in], q: Q4 [out, in], preferred_element_type, layer=None) -> [..., out]
_MATMULS: dict[str, Callable] = {}


def register_matmul(name: str, fn: Callable) -> None:
    """Make `Q4(kernel=name)` weights multiply through `fn(x, q, preferred_element_type, layer=None)`
    (layer: q is a stack [L, out, in] and matrix `layer`, a traced index, is the one to multiply by)."""
    _MATMULS[name] = fn


def matmul(x: jax.Array, q: Q4 | Q4Layer, preferred_element_type=None) -> jax.Array:
    """x [..., in] @ W.T for a quantized W [out, in]: the matmul its `kernel` names. A `Q4Layer` is
    multiplied by its matrix of the stack (the matmul gets the stack and `layer=` its index)."""
    stack, layer = (q.stack, q.index) if isinstance(q, Q4Layer) else (q, None)
    if layer is not None and stack.ndim != 3:
        raise ValueError(f"a Q4Layer indexes a stack of matrices [L, out, in], got {stack.shape}")
    if layer is None and stack.ndim != 2:
        raise ValueError(f"a quantized projection must be one [out, in] matrix, got the stack {q.shape}: "
                         "index the stack first (e.g. the selected experts)")
    if q.shape[-1] != x.shape[-1]:
        raise ValueError(f"input width {x.shape[-1]} does not match the quantized matrix {q.shape}")
    return _matmul_fn(stack.kernel)(x, stack, preferred_element_type, layer=layer)


def _matmul_fn(kernel: str) -> Callable:
    try:
        return _MATMULS[kernel]
    except KeyError:
        raise ValueError(f"no Q4 matmul named {kernel!r}: known {sorted(_MATMULS)} (the Pallas kernel registers "
                         "itself when jspec.kernels is imported)") from None


def _reference_matmul(x: jax.Array, q: Q4, preferred_element_type=None, layer=None) -> jax.Array:
    # As one [rows, in] x [in, out] product of the transposed matrix: in this form XLA:CPU fuses the
    # dequantization into a one-row product (a reduction reading only the codes: 2.0 MB and 0.45 ms
    # for a [3072, 1024] matrix here), where a batched [B, T, in] operand, or contracting the [out, in]
    # matrix's last axis directly, materialises the float matrix first (27 MB, 1.6-2.2 ms).
    rows = x.reshape(-1, x.shape[-1])
    # Tied to the activations, the weights are not loop-invariant inside a decode loop: XLA would
    # otherwise hoist the dequantization out of the loop, keep a float copy of every matrix and read
    # that each step (3.6x slower here, and the float model's memory).
    rows, codes, scales, biases = jax.lax.optimization_barrier((rows, q.codes, q.scales, q.biases))
    q = Q4(codes, scales, biases, q.kernel)
    if layer is not None:  # the matrix of a stack, sliced inside the dequantizing fusion
        q = q[layer]
    y = jax.lax.dot_general(rows, dequantize(q).T, (((1,), (0,)), ((), ())),
                            preferred_element_type=preferred_element_type)
    return y.reshape(x.shape[:-1] + (q.shape[0],))


register_matmul("reference", _reference_matmul)


def with_kernel(tree, kernel: str):
    """`tree` with every Q4 leaf set to multiply through `kernel` ("reference" or "pallas")."""
    return jax.tree_util.tree_map(lambda x: dataclasses.replace(x, kernel=kernel) if is_q4(x) else x, tree,
                                  is_leaf=is_q4)


def has_q4(tree) -> bool:
    return any(is_q4(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_q4))


# --- quantization (host side) ---------------------------------------------------------------------


def quantize(w, dtype=None) -> Q4:
    """Quantize a float matrix [..., out, in] (in a multiple of 64) group-wise: per group of 64 inputs the
    bias is the minimum and the scale (max - min) / 15, both rounded to `dtype` (default: w's dtype),
    and each code the nearest integer in [0, 15] to (w - bias) / scale under those rounded values (code 0
    where a group is constant). Runs on the host in numpy; returns numpy-backed arrays."""
    w = np.asarray(w)
    dtype = np.dtype(dtype or w.dtype)
    if w.ndim < 2 or w.shape[-1] % GROUP_SIZE:
        raise ValueError(f"Q4 quantizes matrices whose input dimension is a multiple of {GROUP_SIZE}; got {w.shape}")
    wf = w.astype(np.float32)
    groups = wf.reshape(wf.shape[:-1] + (-1, GROUP_SIZE))
    lo, hi = groups.min(-1), groups.max(-1)
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        raise ValueError("cannot quantize a matrix holding NaN or inf values")
    scales = ((hi - lo) / MAX_CODE).astype(dtype)
    biases = lo.astype(dtype)
    s, b = scales.astype(np.float32)[..., None], biases.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(s > 0, np.rint((groups - b) / np.where(s > 0, s, 1)), 0)
    codes = np.clip(codes, 0, MAX_CODE).astype(np.uint32).reshape(wf.shape)
    return Q4(pack(codes), scales, biases)


def quantizable(shape: tuple[int, ...], transpose: bool = False) -> bool:
    """Is a declared parameter of this shape a matrix (or stack of matrices) [..., out, in] stored in HF's
    orientation whose inputs divide into groups: what a Q4 checkpoint may quantize."""
    return len(shape) >= 2 and not transpose and shape[-1] % GROUP_SIZE == 0


def quantize_tree(params, declarations, dtype=None):
    """`params` with every quantizable matrix (`quantizable`, from the models' `declarations`: a tree
    with `params` as a prefix, its leaves boxes with `.value` and `.transpose`) quantized, as jax arrays;
    the in-memory form of `jspec convert --q4`. Other leaves are unchanged. ShapeDtypeStruct leaves
    (abstract parameters, e.g. for deviceless compiles) give Q4s of ShapeDtypeStructs."""
    def one(x, decl):
        if not quantizable(tuple(decl.value.shape), getattr(decl, "transpose", False)):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            *lead, n_in = x.shape
            dt = dtype or x.dtype
            return Q4(jax.ShapeDtypeStruct((*lead, n_in // CODES_PER_WORD), jnp.uint32),
                      jax.ShapeDtypeStruct((*lead, n_in // GROUP_SIZE), dt),
                      jax.ShapeDtypeStruct((*lead, n_in // GROUP_SIZE), dt))
        return jax.tree_util.tree_map(jnp.asarray, quantize(np.asarray(x), dtype))

    return jax.tree_util.tree_map(one, params, declarations)


def pack(codes: np.ndarray) -> np.ndarray:
    """uint codes [..., n] in [0, 15] -> uint32 [..., n / 8], the lowest 4 bits first (inverse of `unpack`)."""
    codes = np.asarray(codes, np.uint32)
    words = codes.reshape(codes.shape[:-1] + (-1, CODES_PER_WORD))
    shifts = np.arange(CODES_PER_WORD, dtype=np.uint32) * BITS
    return np.bitwise_or.reduce(words << shifts, axis=-1).astype(np.uint32)
