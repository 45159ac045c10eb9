"""Layer primitives shared by the models (`transformer`, `hybrid`, the drafters) and the kernels'
pure-jnp references (`jspec.kernels`): norms, projections, RoPE, the SwiGLU MLP and the LM head.

Plain functions of arrays, with no parameter declarations and no imports from the rest of jspec but
the leaf module `quant`, so that every module computing a layer can import them. Weight matrices are
stored [out, in], as HF stores them (`linear` says why); any of them may be an affine Q4 matrix
(`jspec.models.quant.Q4`), which `linear` and `lm_logits` multiply through its matmul.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.models import quant


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """HF RMSNorm: normalise in float32, cast back, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def zc_rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm (Qwen3-Next / Qwen3.5): normalise in float32, scale by (1 + w), then cast back."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] times a matrix stored [out, in] (HF's orientation): y = x @ w.T.

    Stored this way because a decode step is a matrix-vector product per weight matrix, and reading
    each output's weights as one contiguous row is the fast one on XLA:CPU (this CPU, float32, matrices
    far beyond the caches: 31-32 GB/s for [out, in] against 21-27 GB/s for [in, out], on par with
    torch's `linear`); XLA:TPU and XLA:GPU contract either orientation without a copy (checked by the
    deviceless `--aot` compiles). It also makes HF loading a plain read, no transpose.
    """
    if quant.is_q4(w) or isinstance(w, quant.Q4Layer):
        return quant.matmul(x, w)
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def rope_angles(positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """RoPE angles [..., 2 * len(inv_freq)] of positions [...]: each frequency twice, as rotate-half pairs
    dimension i with dimension i + half."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.concatenate([freqs, freqs], axis=-1)


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x [B, T, H, Dh], positions [B, T], inv_freq [R / 2].

    The first R = 2 * len(inv_freq) dimensions of each head rotate; with R < Dh (partial rotary,
    Qwen3-Next / Qwen3.5) the others pass through unchanged."""
    rotary = 2 * inv_freq.shape[0]
    if rotary < x.shape[-1]:
        return jnp.concatenate([rope(x[..., :rotary], positions, inv_freq), x[..., rotary:]], axis=-1)
    emb = rope_angles(positions, inv_freq)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, b_gate: jax.Array | None = None,
           b_up: jax.Array | None = None, b_down: jax.Array | None = None) -> jax.Array:
    """SwiGLU MLP: down(silu(gate(x)) * up(x)); the biases (Llama's mlp_bias) are optional."""
    gate, up = linear(x, w_gate), linear(x, w_up)
    if b_gate is not None:
        gate = gate + b_gate
    if b_up is not None:
        up = up + b_up
    down = linear(jax.nn.silu(gate) * up, w_down)
    return down if b_down is None else down + b_down


def lm_logits(hidden: jax.Array, head: jax.Array) -> jax.Array:
    """LM head: final-normed hidden [..., D] times head [V, D] (the LM head matrix, or the embedding
    when tied) -> float32 logits [..., V]."""
    if quant.is_q4(head):
        return quant.matmul(hidden, head, preferred_element_type=jnp.float32)
    return jnp.einsum("...d,vd->...v", hidden, head, preferred_element_type=jnp.float32)
