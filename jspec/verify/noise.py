"""Keyed randomness: every draw is a pure function of (request seed, absolute position, purpose).

Never key by round number, batch slot or row order: a row's random stream must not depend on how
its tokens were grouped into rounds or on which other requests share its batch. This is what makes
Gumbel-coupled speculative decoding drafter-invariant and the output batch-invariant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Purposes: a draw for one purpose never reuses the bits of another at the same position.
GUMBEL = 0  # Gumbel-max noise of the token emitted at a position (target and coupled drafter)
ACCEPT = 1  # uniform coin of an accept/reject test for the token at a position
RESIDUAL = 2  # noise for sampling a correction token from a residual at a position
DRAFT = 3  # a drafter's own sampling noise at a position (independent of the target's)
TREE_ACCEPT = 4  # per-child coins in tree verification (further folded by sibling index)


def position_key(seed: jax.Array, position: jax.Array, purpose: int) -> jax.Array:
    """Key for one (seed, position, purpose); seed and position are int32 scalars."""
    key = jax.random.key(jnp.asarray(seed, jnp.uint32))
    key = jax.random.fold_in(key, jnp.asarray(position, jnp.uint32))
    return jax.random.fold_in(key, purpose)


def _keys(seed: jax.Array, positions: jax.Array, purpose: int) -> jax.Array:
    """Keys of shape positions.shape; seed: [B], positions: [B, ...]."""
    seed = jnp.asarray(seed)
    positions = jnp.asarray(positions)
    seeds = jnp.broadcast_to(seed.reshape(seed.shape + (1,) * (positions.ndim - seed.ndim)), positions.shape)
    fn = lambda s, p: position_key(s, p, purpose)
    for _ in range(positions.ndim):
        fn = jax.vmap(fn)
    return fn(seeds, positions)


def gumbel(seed: jax.Array, positions: jax.Array, purpose: int, vocab: int) -> jax.Array:
    """Standard Gumbel noise [*positions.shape, vocab] in float32 keyed per (seed, position)."""
    keys = _keys(seed, positions, purpose)
    draw = lambda k: jax.random.gumbel(k, (vocab,), jnp.float32)
    for _ in range(positions.ndim):
        draw = jax.vmap(draw)
    return draw(keys)


def uniform(seed: jax.Array, positions: jax.Array, purpose: int, shape: tuple[int, ...] = ()) -> jax.Array:
    """Uniform [0, 1) noise [*positions.shape, *shape] in float32 keyed per (seed, position)."""
    keys = _keys(seed, positions, purpose)
    draw = lambda k: jax.random.uniform(k, shape, jnp.float32)
    for _ in range(positions.ndim):
        draw = jax.vmap(draw)
    return draw(keys)
