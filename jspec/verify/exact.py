"""Exact output distributions of the verification rules on small vocabularies (analysis and tests).

A toy language model is a pair of conditional tables over prefixes (`Tables`). For a rule, we
enumerate every draft (with its probability under q) and every pass/fail pattern of the rule's coins,
run the rule's `*_from_coins` form once per pattern with a coin inside that branch, weight the pattern
by the product of the thresholds the rule reports (pass) or one minus them (fail), and spread the
emitted token over softmax(token_logp). That integrates the coins analytically.

A round emits a sequence o of length n + 1. The rule is exact iff o, completed by sampling the
target for the remaining positions, has the target's joint distribution (`completed_distribution`
vs `target_joint`). Gumbel coupling is integrated in closed form (`gumbel_coupling`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jspec.verify.sampling import SamplingParams, served_logprobs

# The largest float32 below 1: a coin with this value fails every threshold < 1.
COIN_FAIL = float(np.nextafter(np.float32(1.0), np.float32(0.0)))
COIN_PASS = 0.0


@dataclasses.dataclass(frozen=True)
class Tables:
    """Conditional tables of a toy target p and proposal q.

    logp[k], logq[k]: [V**k, V] float32 log-probs of the token after a prefix of length k, the prefix
    encoded base V with the first token most significant. k = 0..depth-1.
    """

    logp: tuple
    logq: tuple

    @property
    def vocab(self) -> int:
        return int(self.logp[0].shape[-1])

    @property
    def depth(self) -> int:
        return len(self.logp)

    def p(self, k: int) -> np.ndarray:
        """Float64 target probabilities [V**k, V] represented by the float32 log-probs."""
        return _probs(self.logp[k])

    def q(self, k: int) -> np.ndarray:
        return _probs(self.logq[k])


def _probs(logp: np.ndarray) -> np.ndarray:
    p = np.exp(np.asarray(logp, np.float64))
    return p / p.sum(-1, keepdims=True)


def code(prefix, vocab: int) -> int:
    """Base-V code of a token prefix (first token most significant)."""
    c = 0
    for t in prefix:
        c = c * vocab + int(t)
    return c


def _log32(p: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(p).astype(np.float32)


def constant_tables(p, q, depth: int) -> Tables:
    """Context-free tables: p and q at every position (probabilities [V])."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    vocab = p.shape[0]
    lp = tuple(np.broadcast_to(_log32(p / p.sum()), (vocab ** k, vocab)).copy() for k in range(depth))
    lq = tuple(np.broadcast_to(_log32(q / q.sum()), (vocab ** k, vocab)).copy() for k in range(depth))
    return Tables(lp, lq)


FAMILIES = ("dirichlet", "sparse", "equal", "served", "greedy", "disjoint", "near")


def random_tables(rng: np.random.Generator, vocab: int, depth: int, family: str) -> Tables:
    """Random context-dependent tables of one family.

    dirichlet: independent flat-Dirichlet p and q. sparse: each entry of p and q zeroed w.p. 0.4
    (at least one kept), so q = 0 for tokens p wants and vice versa. equal: q == p. served: random
    logits through served_logprobs with temperature / top-k / top-p (different for p and q).
    greedy: temperature 0 on both sides (one-hot). disjoint: p and q with disjoint supports.
    near: q = p perturbed slightly.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    if family in ("served", "greedy"):
        return _served_tables(rng, vocab, depth, family == "greedy")
    lp, lq = [], []
    for k in range(depth):
        shape = (vocab ** k, vocab)
        p = rng.dirichlet(np.ones(vocab), size=shape[0])
        q = rng.dirichlet(np.ones(vocab), size=shape[0])
        if family == "sparse":
            p, q = (_sparsify(rng, a) for a in (p, q))
        elif family == "equal":
            q = p
        elif family == "disjoint":
            half = max(1, vocab // 2)
            p[:, half:] = 0.0
            q[:, :half] = 0.0
        elif family == "near":
            q = p * np.exp(rng.normal(0, 0.05, shape))
        lp.append(_log32(p / p.sum(-1, keepdims=True)))
        lq.append(lp[-1] if family == "equal" else _log32(q / q.sum(-1, keepdims=True)))
    return Tables(tuple(lp), tuple(lq))


_served_jit = jax.jit(served_logprobs, static_argnums=1)


def _served_tables(rng: np.random.Generator, vocab: int, depth: int, greedy: bool) -> Tables:
    """Random logits through served_logprobs (all levels in one call per side)."""
    hot = SamplingParams(temperature=0.0)
    params_p = hot if greedy else SamplingParams(temperature=0.8, top_k=max(2, vocab - 1), top_p=0.9)
    params_q = hot if greedy else SamplingParams(temperature=1.3, top_k=max(2, vocab - 2), top_p=0.95)
    splits = np.cumsum([vocab ** k for k in range(depth)])[:-1]
    rows = int(sum(vocab ** k for k in range(depth)))
    sides = []
    for params in (params_p, params_q):
        logits = jnp.asarray(rng.normal(0, 1.5, (rows, vocab)), jnp.float32)
        sides.append(tuple(np.split(np.asarray(_served_jit(logits, params)), splits)))
    return Tables(*sides)


def _sparsify(rng: np.random.Generator, probs: np.ndarray) -> np.ndarray:
    mask = rng.random(probs.shape) < 0.6
    mask[np.arange(probs.shape[0]), rng.integers(0, probs.shape[1], probs.shape[0])] = True
    return probs * mask


# ---------------------------------------------------------------------------------------------
# Output distributions and the exactness criterion.


def target_joint(tables: Tables, length: int) -> np.ndarray:
    """p(z) for every z in V^length, flattened by `code`; float64."""
    joint = np.ones(1)
    for k in range(length):
        joint = (joint[:, None] * tables.p(k)).reshape(-1)
    return joint


def completed_distribution(outputs: list, tables: Tables, length: int) -> np.ndarray:
    """Distribution over V^length of a round's output completed by target sampling.

    outputs[m] [V^m]: probability that the round emits exactly the sequence with that code (m >= 1).
    """
    vocab = tables.vocab
    exact = [np.zeros(vocab ** m) for m in range(length + 1)]
    for m, arr in enumerate(outputs):
        if m > length and np.any(arr > 0):
            raise ValueError(f"outputs of length {m} exceed the completion length {length}")
        if m <= length:
            exact[m] = exact[m] + arr
    # at_least[m][s]: probability that the output starts with s (|s| = m).
    at_least = [None] * (length + 1)
    at_least[length] = exact[length]
    for m in range(length - 1, -1, -1):
        at_least[m] = exact[m] + at_least[m + 1].reshape(-1, vocab).sum(-1)
    completed = np.ones(1)
    for m in range(1, length + 1):
        carried = completed - at_least[m - 1] + exact[m - 1]
        completed = at_least[m] + (carried[:, None] * tables.p(m - 1)).reshape(-1)
    return completed


def expected_accepted(outputs: list) -> float:
    """E[n] = sum over output lengths m of (m - 1) P(|o| = m)."""
    return float(sum((m - 1) * arr.sum() for m, arr in enumerate(outputs) if m >= 1))


def _empty_outputs(vocab: int, max_len: int) -> list:
    return [np.zeros(vocab ** m) for m in range(max_len + 1)]


def _patterns(k: int) -> np.ndarray:
    return np.array(list(itertools.product([True, False], repeat=k)), bool).reshape(2 ** k, k)


def _pattern_weights(patterns: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    thr = np.clip(np.asarray(thresholds, np.float64), 0.0, 1.0)
    return np.prod(np.where(patterns, thr, 1.0 - thr), axis=-1)


def _accumulate(outputs, weight, emitted_prefix, n, token_probs):
    """Add weight * token_probs[y] to the output (emitted_prefix[:n], y) for each case."""
    vocab = token_probs.shape[-1]
    for m in np.unique(n):
        sel = n == m
        prefix_code = np.zeros(int(sel.sum()), np.int64)
        for t in range(int(m)):
            prefix_code = prefix_code * vocab + emitted_prefix[sel, t]
        codes = prefix_code[:, None] * vocab + np.arange(vocab)[None, :]
        np.add.at(outputs[int(m) + 1], codes.reshape(-1), (weight[sel, None] * token_probs[sel]).reshape(-1))


def _softmax64(logp) -> np.ndarray:
    return _probs(np.asarray(logp))


def enumerate_drafts(tables: Tables, g: int):
    """All drafts [D, g] with their probability under q, target rows [D, g+1, V], draft rows [D, g, V]."""
    vocab = tables.vocab
    drafts = np.array(list(itertools.product(range(vocab), repeat=g)), np.int64).reshape(vocab ** g, g)
    prob = np.ones(drafts.shape[0])
    target_rows, draft_rows = [], []
    for k in range(g + 1):
        codes = np.array([code(d[:k], vocab) for d in drafts], np.int64)
        target_rows.append(tables.logp[k][codes])
        if k < g:
            draft_rows.append(tables.logq[k][codes])
            prob = prob * tables.q(k)[codes, drafts[:, k]]
    draft_rows = np.stack(draft_rows, 1) if g else np.zeros((drafts.shape[0], 0, vocab), np.float32)
    return drafts, prob, np.stack(target_rows, 1), draft_rows


@functools.lru_cache(maxsize=None)
def _chain_runner(rule_from_coins):
    """rule vmapped over drafts (outer) and coin patterns (inner); compiled once per shape."""
    inner = jax.vmap(rule_from_coins, in_axes=(None, None, None, 0, None))
    return jax.jit(jax.vmap(inner, in_axes=(0, 0, 0, None, None)))


@functools.lru_cache(maxsize=None)
def _tree_runner(tree_from_coins, children: str):
    def one(t, tok, parent, q, c):
        return tree_from_coins(t, tok, parent, q if children == "iid" else None, c, children=children)

    inner = jax.vmap(one, in_axes=(None, None, None, None, 0))
    return jax.jit(jax.vmap(inner, in_axes=(0, 0, None, 0, None)))


def chain_outputs(rule_from_coins, tables: Tables, g: int, length=None) -> list:
    """Exact output distribution of a coin-form chain rule (speculative or block) for drafts ~ q.

    rule_from_coins(target_logp, draft, draft_logp, coins, length) -> CoinOutcome.
    length: None (all g drafts verified), an int, or a function of the draft (a tuple of g tokens) giving
    how many of its drafts are verified: a draft length decided while drafting (a stopping time when it
    reads only earlier drafts).
    Returns outputs[m] [V^m] for m = 0..g+1.
    """
    drafts, prob, _, draft_rows = enumerate_drafts(tables, g)
    per_draft = (np.full(len(drafts), g if length is None else length, np.int64) if not callable(length)
                 else np.array([length(tuple(int(t) for t in d)) for d in drafts], np.int64))
    return proposal_outputs(rule_from_coins, tables, drafts, prob, draft_rows, per_draft)


def proposal_outputs(rule_from_coins, tables: Tables, drafts, prob, draft_rows, lengths=None) -> list:
    """`chain_outputs` of explicitly listed proposals: drafts [D, g] with probabilities prob [D] (summing to
    1), each verified with the rows draft_rows [D, g, V] the drafter reports for it, and lengths [D] (None:
    g). A draft may be listed several times with different rows: a drafter whose rows depend on hidden
    draws (an earlier pass's discarded drafts) lists one entry per hidden outcome."""
    drafts = np.asarray(drafts, np.int64)
    d, g = drafts.shape
    vocab = tables.vocab
    target_rows = np.stack([tables.logp[k][np.array([code(x[:k], vocab) for x in drafts], np.int64)]
                            for k in range(g + 1)], 1)
    lengths = np.full(d, g, np.int64) if lengths is None else np.asarray(lengths, np.int64)
    patterns = _patterns(g)
    coins = np.where(patterns, COIN_PASS, COIN_FAIL).astype(np.float32)
    outputs = _empty_outputs(vocab, g + 1)
    for lim in np.unique(lengths):
        sel = lengths == lim
        out = _chain_runner(rule_from_coins)(jnp.asarray(target_rows[sel]), jnp.asarray(drafts[sel], jnp.int32),
                                             jnp.asarray(draft_rows[sel], jnp.float32), jnp.asarray(coins),
                                             jnp.int32(lim))
        n = np.asarray(out.n).reshape(-1)
        weight = (np.asarray(prob, np.float64)[sel, None]
                  * _pattern_weights(patterns[None], np.asarray(out.threshold))).reshape(-1)
        token_probs = _softmax64(np.asarray(out.token_logp)).reshape(-1, vocab)
        emitted = np.repeat(drafts[sel], patterns.shape[0], axis=0)
        _accumulate(outputs, weight, emitted, n, token_probs)
    return outputs


def tree_paths(parent) -> list:
    """For each node, the list of node indices from the root's child down to the node."""
    paths = []
    for i, pa in enumerate(parent):
        paths.append(([] if pa < 0 else paths[pa]) + [i])
    return paths


def enumerate_tree_drafts(tables: Tables, parent, tokens=None):
    """Token assignments [D, N] with their probability, target rows [D, N+1, V], draft rows [D, N+1, V].

    tokens=None: every node's token is drawn from q given its path (children i.i.d. from their parent's
    row); otherwise the given fixed tokens with probability 1.
    """
    vocab, n_nodes = tables.vocab, len(parent)
    paths = tree_paths(parent)
    if tables.depth < max(len(p) for p in paths) + 1:
        raise ValueError(f"tables of depth {tables.depth} are too shallow for a tree of depth "
                         f"{max(len(p) for p in paths)}: they need depth + 1 levels")
    if tokens is None:
        assign = np.array(list(itertools.product(range(vocab), repeat=n_nodes)), np.int64).reshape(-1, n_nodes)
    else:
        assign = np.asarray(tokens, np.int64)[None, :]
    prob = np.ones(assign.shape[0])
    target_rows = [np.broadcast_to(tables.logp[0][0], (assign.shape[0], vocab))]
    draft_rows = [np.broadcast_to(tables.logq[0][0], (assign.shape[0], vocab))]
    for i in range(n_nodes):
        ctx = paths[i]
        full = np.array([code(a[ctx], vocab) for a in assign], np.int64)
        parent_ctx = np.array([code(a[ctx[:-1]], vocab) for a in assign], np.int64)
        if tokens is None:
            prob = prob * tables.q(len(ctx) - 1)[parent_ctx, assign[:, i]]
        target_rows.append(tables.logp[len(ctx)][full])
        draft_rows.append(tables.logq[len(ctx)][full])
    return assign, prob, np.stack(target_rows, 1), np.stack(draft_rows, 1)


def tree_outputs(tree_from_coins, tables: Tables, parent, tokens=None, *, children: str = "iid") -> list:
    """Exact output distribution of `sampling_tree_from_coins` on one tree shape.

    tokens=None enumerates i.i.d. children drawn from q; fixed tokens give a deterministic tree.
    Returns outputs[m] for m = 0..max depth + 1.
    """
    parent = [int(p) for p in parent]
    n_nodes = len(parent)
    max_depth = max(len(p) for p in tree_paths(parent))
    assign, prob, target_rows, draft_rows = enumerate_tree_drafts(tables, parent, tokens)
    patterns = _patterns(n_nodes)
    coins = np.where(patterns, COIN_PASS, COIN_FAIL).astype(np.float32)
    out = _tree_runner(tree_from_coins, children)(jnp.asarray(target_rows), jnp.asarray(assign, jnp.int32),
                                                  jnp.asarray(parent, jnp.int32), jnp.asarray(draft_rows),
                                                  jnp.asarray(coins))
    n = np.asarray(out.n).reshape(-1)
    path = np.asarray(out.path).reshape(-1, n_nodes)
    weight = (prob[:, None] * _pattern_weights(patterns[None], np.asarray(out.threshold))).reshape(-1)
    token_probs = _softmax64(np.asarray(out.token_logp)).reshape(-1, tables.vocab)
    tokens_rep = np.repeat(assign, patterns.shape[0], axis=0)
    emitted = np.take_along_axis(tokens_rep, np.maximum(path, 0), axis=1)
    outputs = _empty_outputs(tables.vocab, max_depth + 1)
    _accumulate(outputs, weight, emitted, n, token_probs)
    return outputs


# ---------------------------------------------------------------------------------------------
# Gumbel coupling in closed form.


def gumbel_coupling(p, q) -> np.ndarray:
    """J[a, b] = P(argmax(log q + G) = a, argmax(log p + G) = b) for shared standard Gumbel G; float64.

    With exponential clocks xi_i = exp(-G_i): the drafter picks argmin xi/q, the target argmin xi/p.
    For a != b, substituting xi_a = r xi_b and integrating xi_b and every other clock out gives
    J[a, b] = integral over r in [p_a/p_b, q_a/q_b] of dr / D(r)^2 with
    D(r) = 1 + r + sum_{i != a, b} max(p_i/p_b, r q_i/q_a), piecewise linear in r. The diagonal is
    J[j, j] = 1 / sum_i max(p_i/p_j, q_i/q_j).
    """
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    vocab = p.shape[0]
    joint = np.zeros((vocab, vocab))
    for j in range(vocab):
        if p[j] > 0 and q[j] > 0:
            joint[j, j] = 1.0 / np.sum(np.maximum(p / p[j], q / q[j]))
    for a in range(vocab):
        for b in range(vocab):
            if a == b or q[a] == 0 or p[b] == 0:
                continue
            joint[a, b] = _offdiag(p, q, a, b)
    return joint


def _offdiag(p, q, a, b) -> float:
    others = [i for i in range(len(p)) if i not in (a, b)]
    alpha = np.array([p[i] / p[b] for i in others])
    beta = np.array([q[i] / q[a] for i in others])
    lo = p[a] / p[b]
    hi = np.inf if q[b] == 0 else q[a] / q[b]
    if lo >= hi:
        return 0.0
    cuts = sorted({lo, hi} | {float(al / be) for al, be in zip(alpha, beta) if be > 0 and lo < al / be < hi})
    total = 0.0
    for r0, r1 in zip(cuts[:-1], cuts[1:]):
        mid = r0 + 1.0 if np.isinf(r1) else 0.5 * (r0 + r1)
        slope_in = beta * mid >= alpha  # which side of each max is active on this piece
        A = 1.0 + float(np.sum(np.where(slope_in, beta, 0.0)))
        B = 1.0 + float(np.sum(np.where(slope_in, 0.0, alpha)))
        upper = 0.0 if np.isinf(r1) else 1.0 / (A * r1 + B)
        total += (1.0 / (A * r0 + B) - upper) / A
    return total


def gumbel_match_probability(p, q) -> float:
    """P(shared-noise Gumbel-max draws agree) = sum_j 1 / sum_i max(p_i/p_j, q_i/q_j)."""
    return float(np.trace(gumbel_coupling(p, q)))


def gumbel_chain_outputs(tables: Tables, g: int) -> list:
    """Exact output distribution of Gumbel coupling with a coupled drafter over g drafts.

    At each position the (draft, target) pair has law gumbel_coupling(p, q) given the accepted prefix
    (noise is independent across positions); a disagreement emits the target's token and stops.
    """
    vocab = tables.vocab
    outputs = _empty_outputs(vocab, g + 1)

    def walk(prefix, weight):
        k = len(prefix)
        c = code(prefix, vocab)
        base = c * vocab
        if k == g:
            outputs[k + 1][base:base + vocab] += weight * tables.p(k)[c]
            return
        joint = gumbel_coupling(tables.p(k)[c], tables.q(k)[c])
        outputs[k + 1][base:base + vocab] += weight * (joint.sum(0) - np.diag(joint))
        for a in range(vocab):
            if joint[a, a] > 0:
                walk(prefix + [a], weight * joint[a, a])

    walk([], 1.0)
    return outputs
