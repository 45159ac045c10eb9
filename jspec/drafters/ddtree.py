"""DDTree: a best-first token tree from a parallel drafter's per-position marginals (training-free).

The drafter gives independent marginals q_d over the token at depth d = 1..g below the anchor. A
tree node is a ranked prefix (r_1, ..., r_d) (r_i indexes the top-k tokens of q_i) scored by
sum_i log q_i(top_k(q_i)[r_i]). Best-first search pops the highest-scoring prefix, makes it a node
and pushes its next sibling (same depth, rank + 1) and its first child (depth + 1, rank 0), until the
node budget N is reached. Every push uses two fresh slots, so a heap of 2N + 1 slots never
overflows; parents are popped before their children, so node indices are topologically ordered.
Siblings are distinct tokens chosen without randomness (deterministic children for verification).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


TOP_K_CHUNK = 128  # vocabulary entries per chunk of `top_k`'s first stage


def top_k(x: jax.Array, k: int, chunk: int = TOP_K_CHUNK) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the last axis of a float array, equal to it (values best first, ties to the
    lower index), without sorting the whole axis: XLA:TPU lowers a vocabulary-wide top_k to a sort of
    every entry with its index (two [..., V] buffers and several passes over them per round).

    The axis is cut into chunks of `chunk` entries (the last padded with -inf). The k best entries lie in
    the k chunks whose maxima rank best (max descending, ties to the lower chunk): a chunk c holding one
    of them, x, has its own maximum ranked at or above x, and every chunk ranked above c has a maximum
    ranked above that one, so at most k - 1 chunks rank above c. Those k chunks, gathered in index order
    (so the candidates' positions keep the entries' order, and ties still go to the lower index), hold
    k * chunk candidates: one small top_k over them finishes. Reads x once (the chunk maxima) plus the
    gathered chunks."""
    n = x.shape[-1]
    chunks = -(-n // chunk)
    if chunks <= 2 * k:  # too few chunks for the first stage to narrow anything
        return jax.lax.top_k(x, k)
    if chunks * chunk != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, chunks * chunk - n)], constant_values=-jnp.inf)
    blocks = x.reshape(*x.shape[:-1], chunks, chunk)
    pick = jnp.sort(jax.lax.top_k(jnp.max(blocks, axis=-1), k)[1], axis=-1)  # [..., k] chunk ids, ascending
    cand = jnp.take_along_axis(blocks, pick[..., None], axis=-2).reshape(*x.shape[:-1], k * chunk)
    values, pos = jax.lax.top_k(cand, k)
    return values, jnp.take_along_axis(pick, pos // chunk, axis=-1) * chunk + pos % chunk


def build_tree(logq: jax.Array, budget: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logq [g, V] per-depth log-marginals -> (tokens [N], parent [N] (-1 = anchor), depth [N] >= 1)."""
    g, vocab = logq.shape
    k = min(budget, vocab)
    top_v, top_i = top_k(logq.astype(jnp.float32), k)  # [g, k], best first
    cap = 2 * budget + 1
    score = jnp.full((cap,), -jnp.inf).at[0].set(top_v[0, 0])
    depth = jnp.zeros((cap,), jnp.int32).at[0].set(1)
    rank = jnp.zeros((cap,), jnp.int32)
    parent = jnp.full((cap,), -1, jnp.int32)

    def pop(i, carry):
        score, depth, rank, parent, out_tok, out_par, out_dep = carry
        j = jnp.argmax(score)
        empty = jnp.isneginf(score[j])  # fewer prefixes than the budget: pad with a harmless leaf
        d, r, par, sc = depth[j], rank[j], parent[j], score[j]
        d = jnp.where(empty, 1, d)
        r = jnp.where(empty, 0, r)
        par = jnp.where(empty, -1, par)
        out_tok = out_tok.at[i].set(top_i[d - 1, r])
        out_par = out_par.at[i].set(par)
        out_dep = out_dep.at[i].set(d)
        score = score.at[j].set(-jnp.inf)
        sib_ok = ~empty & (r + 1 < k)
        sib_score = sc - top_v[d - 1, r] + top_v[d - 1, jnp.minimum(r + 1, k - 1)]
        score = score.at[2 * i + 1].set(jnp.where(sib_ok, sib_score, -jnp.inf))
        depth = depth.at[2 * i + 1].set(d)
        rank = rank.at[2 * i + 1].set(r + 1)
        parent = parent.at[2 * i + 1].set(par)
        child_ok = ~empty & (d < g)
        score = score.at[2 * i + 2].set(jnp.where(child_ok, sc + top_v[jnp.minimum(d, g - 1), 0], -jnp.inf))
        depth = depth.at[2 * i + 2].set(d + 1)
        rank = rank.at[2 * i + 2].set(0)
        parent = parent.at[2 * i + 2].set(i)
        return score, depth, rank, parent, out_tok, out_par, out_dep

    init = (score, depth, rank, parent, jnp.zeros((budget,), jnp.int32), jnp.zeros((budget,), jnp.int32),
            jnp.zeros((budget,), jnp.int32))
    *_, tokens, parents, depths = jax.lax.fori_loop(0, budget, pop, init)
    return tokens, parents, depths


def build_conditional_tree(first: tuple[jax.Array, jax.Array], children, depth: int, budget: int):
    """A best-first tree when a node's children depend on its token (a drafter whose slot d is drawn given
    the token at slot d - 1, e.g. DFlash2's selector): the same search as `build_tree` over ranked
    children lists computed per node.

    first: (log q [k], token ids [k]) of depth 1, best first. children(d, token) -> (log q [k], ids [k]),
    best first: the candidates at depth d + 1 below a node at depth d holding `token` (d = 1 .. depth - 1;
    called with a clipped d at the last depth, its result unused). A node's score is the sum of log q
    along its path; popping a node pushes its next sibling (same parent, rank + 1) and its first child.
    Returns (tokens [N], parent [N] (-1 = anchor), depth [N] >= 1), parents before children.
    """
    lq0, ids0 = first
    k = lq0.shape[0]
    cap = 2 * budget + 1
    lists_lq = jnp.zeros((budget + 1, k), jnp.float32).at[0].set(lq0.astype(jnp.float32))
    lists_id = jnp.zeros((budget + 1, k), jnp.int32).at[0].set(ids0.astype(jnp.int32))  # row i + 1: node i's
    score = jnp.full((cap,), -jnp.inf).at[0].set(lq0[0].astype(jnp.float32))
    dep = jnp.zeros((cap,), jnp.int32).at[0].set(1)
    rank = jnp.zeros((cap,), jnp.int32)
    parent = jnp.full((cap,), -1, jnp.int32)

    def pop(i, carry):
        score, dep, rank, parent, lists_lq, lists_id, out_tok, out_par, out_dep = carry
        j = jnp.argmax(score)
        empty = jnp.isneginf(score[j])  # fewer paths than the budget: pad with a harmless leaf
        d = jnp.where(empty, 1, dep[j])
        r = jnp.where(empty, 0, rank[j])
        par = jnp.where(empty, -1, parent[j])
        sc = score[j]
        row_lq, row_id = lists_lq[par + 1], lists_id[par + 1]
        token = row_id[r]
        out_tok, out_par, out_dep = out_tok.at[i].set(token), out_par.at[i].set(par), out_dep.at[i].set(d)
        child_lq, child_id = children(jnp.minimum(d, depth - 1), token)
        lists_lq = lists_lq.at[i + 1].set(child_lq.astype(jnp.float32))
        lists_id = lists_id.at[i + 1].set(child_id.astype(jnp.int32))
        score = score.at[j].set(-jnp.inf)
        sib_ok = ~empty & (r + 1 < k)
        score = score.at[2 * i + 1].set(jnp.where(sib_ok, sc - row_lq[r] + row_lq[jnp.minimum(r + 1, k - 1)], -jnp.inf))
        dep, rank, parent = dep.at[2 * i + 1].set(d), rank.at[2 * i + 1].set(r + 1), parent.at[2 * i + 1].set(par)
        child_ok = ~empty & (d < depth)
        score = score.at[2 * i + 2].set(jnp.where(child_ok, sc + child_lq[0], -jnp.inf))
        dep, rank, parent = dep.at[2 * i + 2].set(d + 1), rank.at[2 * i + 2].set(0), parent.at[2 * i + 2].set(i)
        return score, dep, rank, parent, lists_lq, lists_id, out_tok, out_par, out_dep

    zeros = jnp.zeros((budget,), jnp.int32)
    init = (score, dep, rank, parent, lists_lq, lists_id, zeros, zeros, zeros)
    *_, tokens, parents, depths = jax.lax.fori_loop(0, budget, pop, init)
    return tokens, parents, depths
