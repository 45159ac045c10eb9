"""Keyed randomness: every draw is a pure function of (request seed, absolute position, purpose).

Never key by round number, batch slot or row order: a row's random stream must not depend on how
its tokens were grouped into rounds or on which other requests share its batch. This is what makes
Gumbel-coupled speculative decoding drafter-invariant and the output batch-invariant.

`indexed_uniform` and `round_gumbel` fold one more index into the key (a sibling rank, or the offset
from the round start) for draws that a rule reads past the committed prefix: such a draw must never
be met again by a later round.
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
BLOCK_ACCEPT = 5  # block-verification coin of a draft token (further folded by its offset in the round)


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


def indexed_uniform(seed: jax.Array, position: jax.Array, purpose: int, index: jax.Array) -> jax.Array:
    """One uniform [0, 1) float32 keyed by (seed, position, purpose) and further folded by `index`.

    `index` separates several coins that belong to one position (siblings of a tree node) or keeps a
    rule that reads coins past its accepted prefix (block verification) from reusing them in the next
    round. seed, position, index: int32 scalars (vmap for more).
    """
    key = jax.random.fold_in(position_key(seed, position, purpose), jnp.asarray(index, jnp.uint32))
    return jax.random.uniform(key, (), jnp.float32)


def round_gumbel(seed: jax.Array, pos0: jax.Array, count: int, purpose: int, vocab: int) -> jax.Array:
    """Gumbel noise [*pos0.shape, count, vocab] for indices pos0 .. pos0 + count - 1, fresh every round.

    Row i is keyed by (seed, pos0 + i, purpose) folded by the offset i, so two rounds that start at
    different indices never share a draw. seed broadcasts against pos0 (e.g. both [B]). A sampling
    drafter whose drafts are checked by block verification must draw with this (or anything else
    keyed by the round start): block verification decides the accepted length from the whole draft,
    so the discarded drafts are correlated with the committed text, and redrawing those indices with
    the same noise next round would bias the output. Token-wise and tree sampling read no draft past
    the emitted index, so position-keyed noise is fine for them. (Gumbel coupling must instead use
    `gumbel(seed, t, GUMBEL, V)`, the plain sampler's noise.)
    """
    offsets = jnp.arange(count, dtype=jnp.int32)

    def one_row(s, p):
        def draw(t, i):
            key = jax.random.fold_in(position_key(s, t, purpose), jnp.asarray(i, jnp.uint32))
            return jax.random.gumbel(key, (vocab,), jnp.float32)

        return jax.vmap(draw)(jnp.asarray(p, jnp.int32) + offsets, offsets)

    pos0 = jnp.asarray(pos0)
    seed = jnp.broadcast_to(jnp.asarray(seed), pos0.shape)
    fn = one_row
    for _ in range(pos0.ndim):
        fn = jax.vmap(fn)
    return fn(seed, pos0)
