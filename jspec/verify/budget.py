"""Non-anticipating verification budget (DSpark): how many drafts of each row the target verifies.

Inputs:
- confidence [B, g]: pi[b, k] = estimated probability that draft k of row b is accepted given that
  drafts 0..k-1 were (DSpark's confidence head). It may depend on the drafts *before* k, never on
  draft k or later (non-anticipation). Values are clipped to [0, 1].
- sps [M], M >= B*g + 1: sps[m] = verification rounds per second (steps per second, profiled for
  the engine at this batch size B) when m draft tokens in total are verified across the batch, in
  addition to the B anchor rows; i.e. DSpark's SPS(sum_b (len_b + 1)) = sps[sum_b len_b].

Objective (expected committed tokens per second):
  F(lengths) = (B + sum_b sum_{k < len_b} s[b, k]) * sps[sum_b len_b],  s[b, k] = prod_{i <= k} pi[b, i]
(each row always commits one correction or bonus token, hence B).

Greedy rule: sort all B*g candidates (b, k) by survival s[b, k], highest first (ties: smaller k
first, then smaller b); admit them in that order while each extension strictly increases F; stop at
the first extension that does not. Since s is non-increasing along k, the admitted set of each row
is a prefix. Admitting (b, k) depends only on candidates ranked before it, none of which are later
drafts of row b, so the decision never looks at draft k's value or its continuation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def survival(confidence: jax.Array) -> jax.Array:
    """s[b, k] = prod_{i <= k} clip(confidence[b, i], 0, 1); [B, g] float32."""
    return jnp.cumprod(jnp.clip(jnp.asarray(confidence, jnp.float32), 0.0, 1.0), axis=-1)


def expected_rate(confidence: jax.Array, lengths: jax.Array, sps: jax.Array) -> jax.Array:
    """The objective F(lengths) above: expected committed tokens per second; float32 scalar."""
    s = survival(confidence)
    rows, g = s.shape
    admitted = jnp.arange(g)[None, :] < lengths[:, None]
    tokens = rows + jnp.sum(jnp.where(admitted, s, 0.0))
    return tokens * jnp.asarray(sps, jnp.float32)[jnp.sum(lengths)]


@jax.jit
def _choose(confidence, sps):
    s = survival(confidence)
    rows, g = s.shape
    # k-major flattening + stable sort: among equal survivals the shorter prefix comes first.
    flat = s.T.reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    gain = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(flat[order])])
    value = (rows + gain) * jnp.asarray(sps, jnp.float32)[: rows * g + 1]
    improves = value[1:] > value[:-1]
    m = jnp.argmin(jnp.concatenate([improves, jnp.zeros((1,), bool)]))
    admitted = jnp.zeros((rows * g,), bool).at[order].set(jnp.arange(rows * g) < m)
    return jnp.sum(admitted.reshape(g, rows), axis=0).astype(jnp.int32)


def choose_verify_lengths(confidence: jax.Array, sps: jax.Array) -> jax.Array:
    """Per-row verify lengths [B] int32 in [0, g] by the sorted greedy rule (module docstring)."""
    if jnp.ndim(confidence) != 2:
        raise ValueError(f"confidence must be [B, g], got shape {tuple(jnp.shape(confidence))}")
    rows, g = (int(d) for d in jnp.shape(confidence))
    if jnp.ndim(sps) != 1 or jnp.shape(sps)[0] < rows * g + 1:
        raise ValueError(f"sps must be a 1-D table with at least B*g + 1 = {rows * g + 1} entries "
                         f"(sps[m] = rounds per second with m draft tokens verified in total), "
                         f"got shape {tuple(jnp.shape(sps))}")
    return _choose(confidence, sps)
