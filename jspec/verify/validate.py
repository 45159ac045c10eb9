"""Input checks for the verification rules: static shapes at trace time, values on the host.

Shape checks run whenever a rule is traced (they read only static shapes, so they also run under
jit and vmap). Value checks (`check_distribution`, `check_tree`) need concrete arrays: the rules call
them automatically when their inputs are concrete, and the decode loop should call them on the host
before it enters jit. Every error says what is wrong and how to fix it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# A served distribution sums to 1 up to float32 rounding over a large vocabulary.
DISTRIBUTION_ATOL = 1e-3


def is_concrete(*xs) -> bool:
    """True when no argument is a tracer (values can be read on the host)."""
    return not any(isinstance(x, jax.core.Tracer) for x in xs if x is not None)


def check_distribution(logp, name: str = "q", *, log: bool = True, atol: float = DISTRIBUTION_ATOL) -> None:
    """Host-side check that every row of `logp` [..., V] is a distribution; raises ValueError.

    log=True (the rules' convention): entries are log-probabilities, -inf marks removed tokens.
    log=False: entries are probabilities.
    """
    arr = np.asarray(logp, dtype=np.float64)
    if arr.ndim == 0:
        raise ValueError(f"{name} must have a vocabulary axis [..., V], got a scalar")
    if arr.shape[-1] == 0:
        raise ValueError(f"{name} has an empty vocabulary axis (shape {arr.shape})")
    rows = arr.reshape(-1, arr.shape[-1])
    fix = ("pass log-probabilities of the distribution actually served, e.g. "
           "jspec.verify.served_logprobs(logits, params), not raw logits or probabilities")
    if np.isnan(rows).any():
        r = int(np.argwhere(np.isnan(rows).any(-1))[0, 0])
        raise ValueError(f"{name} row {r} contains NaN; {fix}")
    if log:
        if np.isposinf(rows).any():
            r = int(np.argwhere(np.isposinf(rows).any(-1))[0, 0])
            raise ValueError(f"{name} row {r} contains +inf, which is not a log-probability; {fix}")
        probs = np.exp(rows)
    else:
        if (rows < 0).any() or np.isinf(rows).any():
            r = int(np.argwhere(((rows < 0) | np.isinf(rows)).any(-1))[0, 0])
            raise ValueError(f"{name} row {r} has a negative or infinite probability; pass probabilities in [0, 1]")
        probs = rows
    totals = probs.sum(-1)
    if (totals == 0).any():
        r = int(np.argwhere(totals == 0)[0, 0])
        raise ValueError(f"{name} row {r} gives every token probability 0; a distribution needs at least one "
                         f"token with positive probability ({fix})")
    bad = np.abs(totals - 1.0) > atol
    if bad.any():
        r = int(np.argwhere(bad)[0, 0])
        raise ValueError(f"{name} row {r} sums to {totals[r]:.6g} in probability space, not 1; {fix}")


def check_tree(tokens, parent, depth, vocab: int | None = None) -> None:
    """Host-side check of a flattened tree (tokens [N], parent [N], depth [N]); raises ValueError.

    parent[i] is -1 (child of the root) or an earlier node; depth[i] = depth of the parent + 1 with the
    root at depth 0; a negative token marks an absent (padding) node, whose children must be absent too.
    """
    tokens, parent, depth = (np.asarray(a) for a in (tokens, parent, depth))
    if not (tokens.shape == parent.shape == depth.shape) or tokens.ndim != 1:
        raise ValueError(f"tokens, parent and depth must all be [N]; got {tokens.shape}, {parent.shape}, {depth.shape}")
    for i in range(tokens.shape[0]):
        pa = int(parent[i])
        if not -1 <= pa < i:
            raise ValueError(f"parent[{i}] = {pa}: parents must come before their children (-1 <= parent[i] < i); "
                             "order the nodes so that every parent precedes its children (e.g. breadth-first)")
        want = 1 if pa < 0 else int(depth[pa]) + 1
        if int(depth[i]) != want:
            raise ValueError(f"depth[{i}] = {int(depth[i])} but its parent {pa} implies depth {want}; "
                             "depth must be the parent's depth + 1 (children of the root have depth 1)")
        if vocab is not None and int(tokens[i]) >= vocab:
            raise ValueError(f"tokens[{i}] = {int(tokens[i])} is outside the vocabulary of size {vocab}")
        if pa >= 0 and tokens[pa] < 0 and tokens[i] >= 0:
            raise ValueError(f"node {i} has a token but its parent {pa} is absent (negative token); "
                             "mark every descendant of an absent node absent too")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_logp_array(x, name: str, shape: tuple[int, ...]) -> None:
    """Static check: `x` is a float array of exactly `shape`."""
    x_shape = tuple(jnp.shape(x))
    _require(x_shape == shape, f"{name} must have shape {shape} for one row (vmap the rule over batch rows), "
                               f"got {x_shape}")
    _require(jnp.issubdtype(jnp.result_type(x), jnp.floating),
             f"{name} must be floating point log-probabilities, got dtype {jnp.result_type(x)}")


def check_int_array(x, name: str, shape: tuple[int, ...]) -> None:
    """Static check: `x` is an integer array of exactly `shape`."""
    x_shape = tuple(jnp.shape(x))
    _require(x_shape == shape, f"{name} must have shape {shape} for one row (vmap the rule over batch rows), "
                               f"got {x_shape}")
    _require(jnp.issubdtype(jnp.result_type(x), jnp.integer), f"{name} must be integers, got {jnp.result_type(x)}")


def check_chain_inputs(target_logp, draft, draft_logp=None, seed=None, pos0=None, length=None) -> tuple[int, int]:
    """Static checks for a chain rule; returns (g, V)."""
    _require(jnp.ndim(target_logp) == 2, f"target_logp must be [g+1, V] for one row (vmap over batch rows), "
                                         f"got shape {tuple(jnp.shape(target_logp))}")
    _require(jnp.ndim(draft) == 1, f"draft must be [g] for one row (vmap the rule over batch rows), "
                                   f"got shape {tuple(jnp.shape(draft))}")
    g, vocab = int(jnp.shape(draft)[0]), int(jnp.shape(target_logp)[1])
    _require(jnp.shape(target_logp)[0] == g + 1,
             f"target_logp has {jnp.shape(target_logp)[0]} rows but draft has {g} tokens: the target must score "
             f"g+1 = {g + 1} positions (after the anchor and after each draft token)")
    check_logp_array(target_logp, "target_logp", (g + 1, vocab))
    check_int_array(draft, "draft", (g,))
    if draft_logp is not None:
        check_logp_array(draft_logp, "draft_logp", (g, vocab))
    for name, v in (("seed", seed), ("pos0", pos0), ("length", length)):
        if v is not None:
            check_int_array(v, name, ())
    return g, vocab


def check_tree_inputs(target_logp, tokens, parent, depth, draft_logp=None, seed=None, pos0=None) -> tuple[int, int]:
    """Static checks for a tree rule; returns (N, V)."""
    _require(jnp.ndim(tokens) == 1, f"tokens must be [N] for one row (vmap the rule over batch rows), "
                                    f"got shape {tuple(jnp.shape(tokens))}")
    n_nodes = int(jnp.shape(tokens)[0])
    _require(n_nodes >= 1, "a tree needs at least one drafted node (tree budget >= 1)")
    _require(jnp.ndim(target_logp) == 2, f"target_logp must be [N+1, V] for one row, got {tuple(jnp.shape(target_logp))}")
    vocab = int(jnp.shape(target_logp)[1])
    _require(jnp.shape(target_logp)[0] == n_nodes + 1,
             f"target_logp has {jnp.shape(target_logp)[0]} rows but the tree has {n_nodes} nodes: row 0 is the root "
             f"(anchor) and row i+1 follows node i, so it needs N+1 = {n_nodes + 1} rows")
    check_logp_array(target_logp, "target_logp", (n_nodes + 1, vocab))
    for name, v in (("tokens", tokens), ("parent", parent), ("depth", depth)):
        check_int_array(v, name, (n_nodes,))
    if draft_logp is not None:
        check_logp_array(draft_logp, "draft_logp", (n_nodes + 1, vocab))
    for name, v in (("seed", seed), ("pos0", pos0)):
        if v is not None:
            check_int_array(v, name, ())
    return n_nodes, vocab


def check_concrete_chain(target_logp, draft, draft_logp) -> None:
    """Value checks that run only when the inputs are concrete (outside jit/vmap)."""
    if is_concrete(target_logp):
        check_distribution(target_logp, "target_logp")
    if draft_logp is not None and is_concrete(draft_logp):
        check_distribution(draft_logp, "draft_logp")
    if is_concrete(draft, target_logp):
        d = np.asarray(draft)
        vocab = jnp.shape(target_logp)[-1]
        if d.size and (d.min() < 0 or d.max() >= vocab):
            raise ValueError(f"draft tokens must lie in [0, {vocab}); got min {d.min()}, max {d.max()}")


def check_concrete_tree(target_logp, tokens, parent, depth, draft_logp) -> None:
    """Value checks for a tree rule that run only when the inputs are concrete."""
    if is_concrete(tokens, parent, depth):
        check_tree(tokens, parent, depth, vocab=int(jnp.shape(target_logp)[-1]))
    if is_concrete(target_logp):
        check_distribution(target_logp, "target_logp")
    if draft_logp is not None and is_concrete(draft_logp):
        check_distribution(draft_logp, "draft_logp")
