"""Property-based tests over random shapes and distributions, batching, verify lengths, and bad input."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jspec.verify import (
    RULES,
    SamplingParams,
    block_chain_from_coins,
    check_distribution,
    check_tree,
    served_logprobs,
    speculative_chain_from_coins,
    verify_chain,
    verify_tree,
)
from jspec.verify.tree import sampling_tree_from_coins

CHAIN_RULES = list(RULES)
TREE_CASES = [(name, children) for name, r in RULES.items() if r.tree is not None
              for children in (("iid", "deterministic") if r.needs_q else ("iid",))]
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KINDS = ("softmax", "greedy", "truncated", "peaked")


def served_like(rng, rows, vocab, kind):
    """Log-probs [rows, V] shaped like served distributions (numpy, so no compile per shape):
    a plain softmax, a temperature-0 point mass, top-k/top-p-style truncation (-inf entries), or a
    very peaked softmax."""
    logits = rng.normal(0, 30.0 if kind == "peaked" else 2.0, (rows, vocab))
    if kind == "greedy":
        logits = np.where(np.arange(vocab) == np.argmax(logits, -1)[:, None], 0.0, -np.inf)
    elif kind == "truncated":
        keep = rng.random((rows, vocab)) < 0.5
        keep[np.arange(rows), np.argmax(logits, -1)] = True
        logits = np.where(keep, logits, -np.inf)
    top = logits.max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        return (logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))).astype(np.float32)


@st.composite
def chain_case(draw):
    vocab, g = draw(st.sampled_from([(3, 4), (17, 1)]))  # few shapes: each one compiles every rule
    seed = draw(st.integers(0, 2 ** 31 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(KINDS))
    target = served_like(rng, g + 1, vocab, kind)
    draft_logp = served_like(rng, g, vocab, draw(st.sampled_from(KINDS)))
    if draw(st.booleans()):
        draft_logp = target[:g].copy()  # p == q
    draft = rng.integers(0, vocab, g).astype(np.int32)  # may include tokens with q = 0 or p = 0
    return target, draft, draft_logp, seed % 1000, int(rng.integers(0, 500))


def _check_chain_result(res, target, g, vocab, draft):
    n, token = int(res.n), int(res.token)
    assert 0 <= n <= g and 0 <= token < vocab
    assert np.isfinite(target[n, token])  # the emitted token is possible under the target
    for i in range(n):
        assert np.isfinite(target[i, draft[i]])  # accepted drafts are possible under the target


@SETTINGS
@given(chain_case())
def test_chain_rules_return_valid_results(case):
    target, draft, draft_logp, seed, pos0 = case
    g, vocab = draft.shape[0], target.shape[-1]
    for rule in CHAIN_RULES:
        res = verify_chain(rule, jnp.asarray(target), jnp.asarray(draft), jnp.asarray(draft_logp),
                           seed=jnp.int32(seed), pos0=jnp.int32(pos0))
        _check_chain_result(res, target, g, vocab, draft)


@SETTINGS
@given(chain_case(), st.floats(0.0, 1.0, exclude_max=True))
def test_coin_forms_give_distributions_and_probabilities(case, u):
    target, draft, draft_logp, _, _ = case
    coins = jnp.full(draft.shape, u, jnp.float32)
    for rule in (speculative_chain_from_coins, block_chain_from_coins):
        out = rule(jnp.asarray(target), jnp.asarray(draft), jnp.asarray(draft_logp), coins)
        logp = np.asarray(out.token_logp, np.float64)
        thr = np.asarray(out.threshold)
        assert not np.isnan(logp).any() and not np.isnan(thr).any()
        assert abs(np.exp(logp).sum() - 1) < 1e-5
        assert ((thr >= 0) & (thr <= 1)).all()
        # The emitted token's law is supported where the target is.
        assert (np.isneginf(logp) | np.isfinite(target[int(out.n)])).all()


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2 ** 31 - 1))
def test_a_verify_length_is_the_same_as_truncating_the_draft(seed):
    rng = np.random.default_rng(seed)
    vocab, g = 3, 4
    target = served_like(rng, g + 1, vocab, "softmax")
    draft_logp = served_like(rng, g, vocab, "truncated")
    # Mostly the target's argmax, so that long accepted prefixes occur.
    draft = np.where(rng.random(g) < 0.8, np.argmax(target[:g], -1), rng.integers(0, vocab, g)).astype(np.int32)
    pos0 = int(rng.integers(0, 100))
    # Length 4 reuses the shape compiled above; 0 is the "verify nothing" edge.
    for rule, length in itertools.product(CHAIN_RULES, (0, 4)):
        full = verify_chain(rule, jnp.asarray(target), jnp.asarray(draft), jnp.asarray(draft_logp),
                            seed=jnp.int32(seed), pos0=jnp.int32(pos0), length=jnp.int32(length))
        cut = verify_chain(rule, jnp.asarray(target[:length + 1]), jnp.asarray(draft[:length]),
                           jnp.asarray(draft_logp[:length]), seed=jnp.int32(seed), pos0=jnp.int32(pos0))
        assert (int(full.n), int(full.token)) == (int(cut.n), int(cut.token)), rule


@st.composite
def tree_case(draw):
    n_nodes = draw(st.sampled_from([1, 6]))
    vocab = 5
    seed = draw(st.integers(0, 2 ** 31 - 1))
    rng = np.random.default_rng(seed)
    parent = [-1] + [int(rng.integers(-1, i)) for i in range(1, n_nodes)]
    depth = []
    for pa in parent:
        depth.append(1 if pa < 0 else depth[pa] + 1)
    target = served_like(rng, n_nodes + 1, vocab, draw(st.sampled_from(KINDS)))
    draft_logp = served_like(rng, n_nodes + 1, vocab, draw(st.sampled_from(KINDS)))
    tokens = rng.integers(0, vocab, n_nodes).astype(np.int32)
    return target, tokens, np.array(parent, np.int32), np.array(depth, np.int32), draft_logp, seed % 1000


@SETTINGS
@given(tree_case())
def test_tree_rules_return_a_valid_path(case):
    target, tokens, parent, depth, draft_logp, seed = case
    vocab = target.shape[-1]
    for rule, children in TREE_CASES:
        res = verify_tree(rule, jnp.asarray(target), jnp.asarray(tokens), jnp.asarray(parent), jnp.asarray(depth),
                          jnp.asarray(draft_logp), seed=jnp.int32(seed), pos0=jnp.int32(7), children=children)
        n, path, token = int(res.n), np.asarray(res.path), int(res.token)
        assert 0 <= n <= depth.max() and 0 <= token < vocab
        assert (path[n:] == -1).all() and (path[:n] >= 0).all()
        for k in range(n):
            node = path[k]
            assert parent[node] == (path[k - 1] if k else -1) and depth[node] == k + 1
            assert np.isfinite(target[(path[k - 1] + 1) if k else 0, tokens[node]])
        last = path[n - 1] + 1 if n else 0
        assert np.isfinite(target[last, token])


@SETTINGS
@given(tree_case(), st.floats(0.0, 1.0, exclude_max=True))
def test_tree_coin_form_gives_a_distribution(case, u):
    target, tokens, parent, _, draft_logp, _ = case
    for children in ("iid", "deterministic"):
        out = sampling_tree_from_coins(jnp.asarray(target), jnp.asarray(tokens), jnp.asarray(parent),
                                       jnp.asarray(draft_logp), jnp.full(tokens.shape, u, jnp.float32),
                                       children=children)
        logp = np.asarray(out.token_logp, np.float64)
        assert not np.isnan(logp).any() and abs(np.exp(logp).sum() - 1) < 1e-5
        thr = np.asarray(out.threshold)
        assert ((thr >= 0) & (thr <= 1)).all()


def test_batched_rules_do_not_depend_on_batch_composition():
    rng = np.random.default_rng(0)
    b, g, vocab = 6, 4, 3
    target = jnp.asarray(served_like(rng, b * (g + 1), vocab, "softmax").reshape(b, g + 1, vocab))
    draft_logp = jnp.asarray(served_like(rng, b * g, vocab, "softmax").reshape(b, g, vocab))
    draft = jnp.asarray(rng.integers(0, vocab, (b, g)), jnp.int32)
    seeds = jnp.asarray([5, 5, 6, 7, 8, 9], jnp.int32)
    pos0 = jnp.asarray([10, 10, 3, 4, 50, 0], jnp.int32)
    for rule in CHAIN_RULES:
        batched = jax.jit(jax.vmap(lambda t, d, q, s, p: verify_chain(rule, t, d, q, seed=s, pos0=p)))
        full = batched(target, draft, draft_logp, seeds, pos0)
        # Reorder the rows: each row's result is unchanged.
        perm = jnp.asarray([4, 0, 2, 5, 1, 3])
        sub = batched(target[perm], draft[perm], draft_logp[perm], seeds[perm], pos0[perm])
        np.testing.assert_array_equal(np.asarray(sub.n), np.asarray(full.n)[perm])
        np.testing.assert_array_equal(np.asarray(sub.token), np.asarray(full.token)[perm])
        single = verify_chain(rule, target[2], draft[2], draft_logp[2], seed=seeds[2], pos0=pos0[2])
        assert (int(single.n), int(single.token)) == (int(full.n[2]), int(full.token[2]))


# ---------------------------------------------------------------------------------------------
# Bad input: clear errors at trace time or on the host.

V = 5
GOOD_T = jax.nn.log_softmax(jnp.zeros((4, V)))
GOOD_Q = jax.nn.log_softmax(jnp.zeros((3, V)))
GOOD_D = jnp.zeros((3,), jnp.int32)


@pytest.mark.parametrize("rule", sorted(CHAIN_RULES))
@pytest.mark.parametrize("target, draft, q, match", [
    (GOOD_T[:3], GOOD_D, GOOD_Q, "g\\+1"),
    (GOOD_T, GOOD_D[None], GOOD_Q, "vmap"),
    (GOOD_T, GOOD_D, GOOD_Q[:, :4], "draft_logp must have shape"),
    (GOOD_T, GOOD_D, GOOD_Q[:2], "draft_logp must have shape"),
    (GOOD_T, GOOD_D.astype(jnp.float32), GOOD_Q, "integers"),
])
def test_shape_mismatches_raise_at_trace_time(rule, target, draft, q, match):
    traced = jax.jit(lambda t, d, qq: verify_chain(rule, t, d, qq, seed=0, pos0=0))
    if "draft_logp" in match and rule in ("greedy", "gumbel"):
        return  # these rules never read q
    with pytest.raises(ValueError, match=match):
        traced(target, draft, q)


@pytest.mark.parametrize("bad, match", [
    (jnp.zeros((3, V)), "sums to"),  # raw logits
    (jnp.full((3, V), 0.2), "sums to"),  # probabilities instead of log-probabilities
    (GOOD_Q.at[1, 2].set(jnp.nan), "NaN"),
    (GOOD_Q.at[0, 0].set(jnp.inf), "\\+inf"),
    (jnp.full((3, V), -jnp.inf), "probability 0"),
])
def test_q_rows_that_are_not_distributions_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        check_distribution(bad)
    for rule in ("speculative", "block"):
        with pytest.raises(ValueError, match=match):
            verify_chain(rule, GOOD_T, GOOD_D, bad)


def test_a_concrete_bad_q_closed_over_inside_jit_fails_at_trace_time():
    raw_logits = jnp.zeros((3, V))
    traced = jax.jit(lambda t, d: verify_chain("speculative", t, d, raw_logits, seed=0, pos0=0))
    with pytest.raises(ValueError, match="draft_logp row 0 sums to"):
        traced(GOOD_T, GOOD_D)


def test_check_distribution_accepts_served_rows_and_probabilities():
    check_distribution(served_logprobs(jnp.asarray(np.random.default_rng(0).normal(size=(4, 50))),
                                       SamplingParams(top_k=3, top_p=0.5)))
    check_distribution(np.full((2, 4), 0.25), log=False)
    with pytest.raises(ValueError, match="negative"):
        check_distribution(np.array([[0.5, 0.6, -0.1]]), log=False)


def test_draft_tokens_outside_the_vocabulary_are_rejected():
    with pytest.raises(ValueError, match="draft tokens"):
        verify_chain("speculative", GOOD_T, jnp.asarray([0, V, 1], jnp.int32), GOOD_Q)


def test_registry_dispatch_errors():
    with pytest.raises(ValueError, match="unknown verifier"):
        verify_chain("typo", GOOD_T, GOOD_D, GOOD_Q)
    with pytest.raises(ValueError, match="needs draft_logp"):
        verify_chain("block", GOOD_T, GOOD_D)
    with pytest.raises(ValueError, match="unknown verifier"):
        verify_tree("typo", GOOD_T, GOOD_D, jnp.asarray([-1, 0, 1]), jnp.asarray([1, 2, 3]))
    with pytest.raises(ValueError, match="needs draft_logp"):
        verify_tree("speculative", GOOD_T, GOOD_D, jnp.asarray([-1, 0, 1]), jnp.asarray([1, 2, 3]))
    with pytest.raises(ValueError, match="chain-only"):
        verify_tree("block", GOOD_T, GOOD_D, jnp.asarray([-1, 0, 1]), jnp.asarray([1, 2, 3]), GOOD_T)


@pytest.mark.parametrize("parent, depth, tokens, match", [
    ([-1, 1, 0], [1, 2, 2], [0, 0, 0], "parents must come before"),
    ([-1, 0, 0], [1, 3, 2], [0, 0, 0], "depth"),
    ([-1, 0, 1], [1, 2, 3], [0, V, 0], "outside the vocabulary"),
    ([-1, 0, 1], [1, 2, 3], [-1, 2, 0], "absent"),
])
def test_malformed_trees_are_rejected(parent, depth, tokens, match):
    with pytest.raises(ValueError, match=match):
        check_tree(np.array(tokens), np.array(parent), np.array(depth), vocab=V)
    with pytest.raises(ValueError, match=match):
        verify_tree("greedy", GOOD_T, jnp.asarray(tokens), jnp.asarray(parent), jnp.asarray(depth))


def test_tree_shape_mismatch_raises_at_trace_time():
    traced = jax.jit(lambda t, tok, pa, de: verify_tree("gumbel", t, tok, pa, de, seed=1, pos0=0))
    with pytest.raises(ValueError, match="N\\+1"):
        traced(GOOD_T[:3], GOOD_D, jnp.asarray([-1, 0, 1]), jnp.asarray([1, 2, 3]))
