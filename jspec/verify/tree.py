"""Tree verification rules: pure, jittable, vmappable over batch rows, static shapes.

A tree of N drafted nodes (one row): node i carries tokens[i]; parent[i] is -1 (child of the root,
i.e. of the anchor) or an earlier node (parent[i] < i); depth[i] >= 1 (1 = child of the root). A
negative token marks an absent (padding) node, which is never tested or accepted.
target_logp [N+1, V]: row 0 = served target distribution after the root, row i+1 = after node i.
The token chosen after a node at depth d (root: d = 0) is written at absolute index pos0 + d, so
pos0 is the index of the depth-1 tokens.

Result: `TreeResult(n, path, token)`: n = accepted depth, path [N] = accepted node indices from the
root down (padded with -1), token = correction or bonus written at pos0 + n.

Tree budget 1 (N = 1) and chains (parent[i] = i - 1) are ordinary trees here.

Rules:
- greedy_tree: walk the target's argmax down the tree (among siblings carrying the same token, the
  lowest index is taken).
- gumbel_tree: walk the target's Gumbel-max with the noise of the index being chosen
  (noise.gumbel(seed, pos0 + d, GUMBEL)); the committed text is exactly the plain sampler's text for
  that seed at any temperature, for any tree.
- sampling_tree: recursive rejection sampling over siblings (SpecInfer), chosen because its
  correctness reduces to the token-wise proof one sibling at a time and it needs no per-path
  bookkeeping; Traversal Verification's parent update after a rejected leaf is not published in a
  form we could check. Two static modes:
    children="iid": the children of a node were drawn i.i.d. (with replacement) from that node's
      proposal q = draft_logp[node + 1] given the path to it (the subtree below a child may depend
      on that child's path only). Child x is accepted w.p. min(1, p(x)/q(x)); on rejection
      p <- norm((p - q)+), q unchanged.
    children="deterministic": the children are fixed functions of the context (DDTree / EAGLE-2
      top-k trees), i.e. q is a point mass on each child; they must not depend on the verifier's
      coins. Child x is accepted w.p. p(x); on rejection p(x) <- 0 and p is renormalised.
      draft_logp is not used.
  Siblings are tested in node-index order; if none is accepted the token is drawn from the current p.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec.verify import noise
from jspec.verify.chain import NEG_INF, acceptance_probability, first_argmax, residual_logp
from jspec.verify.validate import check_concrete_tree, check_tree_inputs

CHILDREN_MODES = ("iid", "deterministic")


class TreeResult(NamedTuple):
    """Outcome of verifying one tree: n accepted nodes along `path`, then `token` at pos0 + n."""

    n: jax.Array  # int32[] accepted depth
    path: jax.Array  # int32[N] accepted node indices in order, -1 padded
    token: jax.Array  # int32[]


class TreeCoinOutcome(NamedTuple):
    """sampling_tree on explicit coins [N]: coin i passes iff coins[i] < threshold[i].

    threshold[i] is node i's acceptance probability given the earlier coins' outcomes (0 when the
    node is never tested); the emitted token is a draw from softmax(token_logp).
    """

    n: jax.Array
    path: jax.Array
    token_logp: jax.Array  # float32[V]
    threshold: jax.Array  # float32[N]


def _walk_choices(choice: jax.Array, tokens: jax.Array, parent: jax.Array) -> TreeResult:
    """Follow a fixed choice per node (choice[c + 1] after node c, choice[0] after the root)."""
    n_nodes = tokens.shape[0]

    def step(carry, i):
        cur, n, path = carry
        move = (parent[i] == cur) & (tokens[i] >= 0) & (tokens[i] == choice[cur + 1])
        path = jnp.where(move, path.at[n].set(i), path)
        return (jnp.where(move, i, cur), n + move.astype(jnp.int32), path), None

    init = (jnp.int32(-1), jnp.int32(0), jnp.full((n_nodes,), -1, jnp.int32))
    (cur, n, path), _ = jax.lax.scan(step, init, jnp.arange(n_nodes, dtype=jnp.int32))
    return TreeResult(n, path, choice[cur + 1].astype(jnp.int32))


@jax.jit
def _greedy_tree(target_logp, tokens, parent):
    return _walk_choices(first_argmax(target_logp), tokens, parent)


def greedy_tree(target_logp, tokens, parent, depth) -> TreeResult:
    """Greedy walk: move to the (first) child carrying the target's argmax; emit the argmax at the end."""
    check_tree_inputs(target_logp, tokens, parent, depth)
    check_concrete_tree(target_logp, tokens, parent, depth, None)
    return _greedy_tree(target_logp, tokens, parent)


@jax.jit
def _gumbel_tree(target_logp, tokens, parent, depth, seed, pos0):
    n_nodes, vocab = tokens.shape[0], target_logp.shape[-1]
    positions = jnp.asarray(pos0, jnp.int32) + jnp.arange(n_nodes + 1, dtype=jnp.int32)
    g = noise.gumbel(seed, positions, noise.GUMBEL, vocab)  # [N+1, V], row d = index pos0 + d
    node_depth = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.clip(depth, 0, n_nodes).astype(jnp.int32)])
    # Every node at one depth shares the noise of the index its successor is written at.
    choice = first_argmax(target_logp + g[node_depth])  # == gumbel_argmax (never NaN), vectorised
    return _walk_choices(choice, tokens, parent)


def gumbel_tree(target_logp, tokens, parent, depth, seed, pos0) -> TreeResult:
    """Gumbel walk: the choice after a node at depth d is gumbel_argmax(logp, noise.gumbel(seed, pos0 + d,
    GUMBEL)); the committed text equals the plain autoregressive sampler's for that seed."""
    check_tree_inputs(target_logp, tokens, parent, depth, seed=seed, pos0=pos0)
    check_concrete_tree(target_logp, tokens, parent, depth, None)
    return _gumbel_tree(target_logp, tokens, parent, depth, seed, pos0)


@functools.partial(jax.jit, static_argnames=("children",))
def sampling_tree_from_coins(target_logp, tokens, parent, draft_logp, coins, *, children: str = "iid"):
    """Recursive rejection sampling over siblings on explicit coins [N] (coin i tests node i).

    target_logp [N+1, V]; draft_logp [N+1, V] (row c+1 = proposal of node c's children, row 0 for the
    root's; ignored when children="deterministic", pass None). Returns a TreeCoinOutcome.
    Nodes are scanned in index order: a node is tested only if its parent is the current node, so the
    children of the current node are tried in index order, and a single pass suffices because every
    child comes after its parent.
    """
    if children == "deterministic":
        return jax.lax.platform_dependent(
            target_logp, tokens, parent, coins,
            tpu=functools.partial(_deterministic_walk, row_in_place=False),
            default=functools.partial(_deterministic_walk, row_in_place=True))
    n_nodes, vocab = tokens.shape[0], target_logp.shape[-1]

    def step(carry, i):
        cur, n, path, logp = carry
        x = jnp.clip(tokens[i], 0, vocab - 1)
        is_child = (parent[i] == cur) & (tokens[i] >= 0)
        logq = draft_logp[cur + 1]
        accept_p = acceptance_probability(logp[x], logq[x])
        after_reject = residual_logp(logp, logq)
        threshold = jnp.where(is_child, accept_p, 0.0)
        accept = is_child & (coins[i] < threshold)
        reject = is_child & ~accept
        logp = jnp.where(accept, target_logp[i + 1], jnp.where(reject, after_reject, logp))
        path = jnp.where(accept, path.at[n].set(i), path)
        cur = jnp.where(accept, i, cur)
        return (cur, n + accept.astype(jnp.int32), path, logp), threshold

    init = (jnp.int32(-1), jnp.int32(0), jnp.full((n_nodes,), -1, jnp.int32), target_logp[0])
    (_, n, path, logp), threshold = jax.lax.scan(step, init, jnp.arange(n_nodes, dtype=jnp.int32))
    return TreeCoinOutcome(n, path, logp, threshold)


def _deterministic_walk(target_logp, tokens, parent, coins, *, row_in_place: bool) -> TreeCoinOutcome:
    """sampling_tree_from_coins for deterministic children, without a vocabulary-sized carry.

    The current distribution is always the served row of the current node with the rejected children's
    tokens removed and the rest renormalised, so the walk carries that description instead of the
    distribution: `owner[v]` = the node whose child carrying token v was rejected (a token is removed
    at the current node iff its owner is the current node: the walk only moves down, to larger node
    indices, so an entry left by an earlier node never matches again and nothing is reset on accept),
    and `log_left` = log of the row's mass that is not removed (0 for a fresh row, which is served
    normalised). A child is accepted with probability p(x) / left, read from the row at x alone; each
    step makes one pass over the current row for the mass left if its child is rejected, which the
    final distribution reuses: row - log_left, -inf at the removed tokens.

    Where the current row comes from is the backend's choice, not the rule's (`row_in_place`):
    - True (GPU, CPU): each step reads target_logp[cur + 1] where it lies, a gather of each batch
      row's own current row that fuses into the step's one pass. Nothing vocabulary-sized is written
      per step (H200, Qwen3-8B tree of 32 nodes at batch 8 / 4k, top-p: 33.53 -> 33.05 GB a round).
    - False (TPU): the walk carries a copy of the row of the node last accepted, replaced by row i + 1
      of every batch row at once when node i is accepted: a write of the row per step. XLA:TPU
      lowers the gather above to a slice per batch row and keeps more of them live (v5p, same row:
      31.56 -> 32.19 GB, temp 0.46 -> 0.82 GB).

    The same rule as carrying the distribution and renormalising it after each rejection
    (`chain.normalize_or` of the row with x set to -inf), in one pass: the mass left is the float sum
    of exp(row) over the kept tokens, without subtracting the row's maximum first (row entries are
    log-probabilities, <= 0 up to rounding, so nothing overflows). Entries below float32's smallest
    normal (1.2e-38) may count as 0: an absolute error below V * 1.2e-38 in the mass left, which moves
    a probability at float32 resolution only if the mass left is below ~1e-25; the rejections that
    leave mass M are taken with probability M. A rejection that would leave no mass (possible only
    through that underflow) removes nothing, as `normalize_or` keeps p.
    """
    n_nodes, vocab = tokens.shape[0], target_logp.shape[-1]
    owner_dtype = jnp.int8 if n_nodes < 127 else jnp.int32  # holds -2 (no owner) .. n_nodes - 1
    vocab_index = jnp.arange(vocab, dtype=jnp.int32)

    def step(carry, i):
        cur, n, path, row, log_left, owner = carry
        if row_in_place:
            row = target_logp[cur + 1]
        x = jnp.clip(tokens[i], 0, vocab - 1)
        is_child = (parent[i] == cur) & (tokens[i] >= 0)
        removed_x = owner[x] == cur  # a sibling with the same token was rejected: p(x) is 0 here
        accept_p = jnp.where(removed_x, 0.0, jnp.exp(row[x] - log_left))
        threshold = jnp.where(is_child, accept_p, 0.0)
        accept = is_child & (coins[i] < threshold)
        gone = (owner == cur) | (vocab_index == x)
        left_without_x = jnp.log(jnp.sum(jnp.where(gone, 0.0, jnp.exp(row))))
        remove = is_child & ~accept & ~removed_x & (left_without_x > -jnp.inf)
        owner = owner.at[x].set(jnp.where(remove, cur, owner[x]).astype(owner_dtype))
        log_left = jnp.where(accept, 0.0, jnp.where(remove, left_without_x, log_left))
        row = None if row_in_place else jnp.where(accept, target_logp[i + 1], row)
        path = jnp.where(accept, path.at[n].set(i), path)
        cur = jnp.where(accept, i, cur)
        return (cur, n + accept.astype(jnp.int32), path, row, log_left, owner), threshold

    init = (jnp.int32(-1), jnp.int32(0), jnp.full((n_nodes,), -1, jnp.int32),
            None if row_in_place else target_logp[0], jnp.float32(0.0), jnp.full((vocab,), -2, owner_dtype))
    (cur, n, path, row, log_left, owner), threshold = jax.lax.scan(step, init, jnp.arange(n_nodes, dtype=jnp.int32))
    if row_in_place:
        row = target_logp[cur + 1]
    token_logp = jnp.where(owner == cur, NEG_INF, row - log_left)
    return TreeCoinOutcome(n, path, token_logp, threshold)


def sibling_rank(tokens, parent) -> jax.Array:
    """rank[i] = number of present siblings of node i with a smaller index; [N] int32."""
    n_nodes = tokens.shape[0]
    idx = jnp.arange(n_nodes)
    earlier = (parent[None, :] == parent[:, None]) & (idx[None, :] < idx[:, None]) & (tokens[None, :] >= 0)
    return jnp.sum(earlier, axis=1).astype(jnp.int32)


def tree_coins(seed, pos0, tokens, parent, depth) -> jax.Array:
    """Coins [N]: node i uses (seed, pos0 + depth[i] - 1, TREE_ACCEPT) folded by its sibling rank."""
    positions = jnp.asarray(pos0, jnp.int32) + depth.astype(jnp.int32) - 1
    return jax.vmap(lambda t, r: noise.indexed_uniform(seed, t, noise.TREE_ACCEPT, r))(
        positions, sibling_rank(tokens, parent))


@functools.partial(jax.jit, static_argnames=("children",))
def _sampling_tree(target_logp, tokens, parent, depth, draft_logp, seed, pos0, children):
    pos0 = jnp.asarray(pos0, jnp.int32)
    coins = tree_coins(seed, pos0, tokens, parent, depth)
    out = sampling_tree_from_coins(target_logp, tokens, parent, draft_logp, coins, children=children)
    vocab = target_logp.shape[-1]
    token = first_argmax(out.token_logp + noise.gumbel(seed, pos0 + out.n, noise.RESIDUAL, vocab))
    return TreeResult(out.n, out.path, token)


def sampling_tree(target_logp, tokens, parent, depth, draft_logp, seed, pos0, *, children: str = "iid") -> TreeResult:
    """Lossless sampling over a token tree (recursive rejection sampling over siblings).

    children="iid": draft_logp [N+1, V] is required and each node's children must be i.i.d. draws from
    its row. children="deterministic": children are fixed (not sampled); draft_logp may be None.
    Coins: node i uses noise.indexed_uniform(seed, pos0 + depth[i] - 1, TREE_ACCEPT, sibling rank);
    the emitted token at pos0 + n uses noise.gumbel(seed, pos0 + n, RESIDUAL).
    """
    if children not in CHILDREN_MODES:
        raise ValueError(f"children must be one of {CHILDREN_MODES}, got {children!r}")
    if children == "iid" and draft_logp is None:
        raise ValueError("sampling_tree with children='iid' needs draft_logp [N+1, V] (the proposal each node's "
                         "children were drawn from); for fixed top-k trees use children='deterministic'")
    if children == "deterministic":
        draft_logp = None
    check_tree_inputs(target_logp, tokens, parent, depth, draft_logp, seed, pos0)
    check_concrete_tree(target_logp, tokens, parent, depth, draft_logp)
    return _sampling_tree(target_logp, tokens, parent, depth, draft_logp, seed, pos0, children)


def sampling_tree_deterministic(target_logp, tokens, parent, depth, seed, pos0) -> TreeResult:
    """sampling_tree with children="deterministic" (DDTree / top-k trees), without draft_logp."""
    return sampling_tree(target_logp, tokens, parent, depth, None, seed, pos0, children="deterministic")
