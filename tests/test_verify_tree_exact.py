"""Tree rules: exact enumeration for trees of <= 6 nodes (i.i.d. and deterministic children),
chains as trees, tree budget 1, and the greedy / Gumbel walks against references."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.verify import chain, exact, tree
from jspec.verify.tree import sampling_tree_from_coins

TOL = 1e-6
# parent arrays; nodes come after their parents.
SHAPES = {
    "budget1": [-1],
    "chain3": [-1, 0, 1],
    "siblings": [-1, -1, -1],
    "wide": [-1, -1, -1, 0, 0, 1],
    "mixed": [-1, -1, 0, 0, 2, 4],
}


def _vocab_for(parent):
    return {1: 5, 3: 4}.get(len(parent), 3)  # keeps V^N * 2^N small


def _depth(parent):
    return max(len(p) for p in exact.tree_paths(parent))


def _error(outputs, tables, parent):
    length = _depth(parent) + 1
    completed = exact.completed_distribution(outputs, tables, length)
    return np.abs(completed - exact.target_joint(tables, length)).max()


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("family", ["dirichlet", "sparse", "equal", "served", "greedy", "disjoint"])
def test_iid_sampling_tree_is_exact(shape, family):
    parent = SHAPES[shape]
    rng = np.random.default_rng([len(parent), exact.FAMILIES.index(family)])
    for _ in range(2):
        tables = exact.random_tables(rng, _vocab_for(parent), _depth(parent) + 1, family)
        outputs = exact.tree_outputs(sampling_tree_from_coins, tables, parent, children="iid")
        assert not any(np.isnan(o).any() for o in outputs)
        assert _error(outputs, tables, parent) < TOL


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("family", ["dirichlet", "sparse", "served", "greedy"])
def test_deterministic_sampling_tree_is_exact_for_any_fixed_tokens(shape, family):
    parent = SHAPES[shape]
    rng = np.random.default_rng([7, len(parent), exact.FAMILIES.index(family)])
    vocab = _vocab_for(parent)
    tables = exact.random_tables(rng, vocab, _depth(parent) + 1, family)
    for _ in range(3):
        tokens = rng.integers(0, vocab, len(parent))  # duplicates among siblings included
        outputs = exact.tree_outputs(sampling_tree_from_coins, tables, parent, tokens, children="deterministic")
        assert _error(outputs, tables, parent) < TOL


def _walk(row_in_place):
    """The deterministic walk with the current row read in place (GPU, CPU) or carried (TPU)."""
    def walk(target_logp, tokens, parent, draft_logp, coins, *, children):
        assert children == "deterministic" and draft_logp is None
        return tree._deterministic_walk(target_logp, tokens, parent, coins, row_in_place=row_in_place)
    return walk


@pytest.mark.parametrize("shape", ["mixed", "wide"])
def test_both_deterministic_walks_are_exact_and_agree_bit_for_bit(shape):
    """sampling_tree_from_coins picks one walk per backend (only one runs on this CPU): each is exact,
    and on the same coins both give the same outcome, bit for bit (64 random coin vectors for each of
    2 random token sets)."""
    parent = SHAPES[shape]
    rng = np.random.default_rng([11, len(parent)])
    vocab = _vocab_for(parent)
    tables = exact.random_tables(rng, vocab, _depth(parent) + 1, "dirichlet")
    for _ in range(2):
        tokens = rng.integers(0, vocab, len(parent))
        rows = exact.enumerate_tree_drafts(tables, parent, tokens)[2]
        coins = jnp.asarray(rng.uniform(size=(64, len(parent))), jnp.float32)
        run = {flag: jax.jit(jax.vmap(lambda c, flag=flag: _walk(flag)(
            jnp.asarray(rows[0]), jnp.asarray(tokens, jnp.int32), jnp.asarray(parent, jnp.int32), None, c,
            children="deterministic")))(coins) for flag in (False, True)}
        for a, b in zip(run[False], run[True]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for flag in (False, True):
            outputs = exact.tree_outputs(_walk(flag), tables, parent, tokens, children="deterministic")
            assert _error(outputs, tables, parent) < TOL


def test_deterministic_top_k_tree_accepts_more_than_a_single_child():
    """A DDTree-style top-2 root fan-out accepts at least as often as its best single child."""
    rng = np.random.default_rng(9)
    tables = exact.random_tables(rng, 5, 2, "dirichlet")
    top = np.argsort(-tables.logq[0][0])[:2]
    two = exact.expected_accepted(exact.tree_outputs(sampling_tree_from_coins, tables, [-1, -1], top,
                                                     children="deterministic"))
    one = exact.expected_accepted(exact.tree_outputs(sampling_tree_from_coins, tables, [-1], top[:1],
                                                     children="deterministic"))
    p = tables.p(0)[0]
    assert abs(one - p[top[0]]) < TOL and abs(two - p[top].sum()) < TOL


@pytest.mark.parametrize("family", ["dirichlet", "sparse", "equal"])
def test_a_chain_as_an_iid_tree_has_the_token_wise_output_law(family):
    rng = np.random.default_rng(exact.FAMILIES.index(family))
    tables = exact.random_tables(rng, 4, 4, family)
    as_tree = exact.tree_outputs(sampling_tree_from_coins, tables, [-1, 0, 1], children="iid")
    as_chain = exact.chain_outputs(chain.speculative_chain_from_coins, tables, 3)
    for a, b in zip(as_tree, as_chain):
        np.testing.assert_allclose(a, b, atol=TOL)


def _chain_rows(tables, draft):
    vocab = tables.vocab
    return np.stack([tables.logp[k][exact.code(draft[:k], vocab)] for k in range(len(draft) + 1)])


def test_chains_as_trees_agree_with_the_chain_rules_for_greedy_and_gumbel():
    rng = np.random.default_rng(4)
    vocab, g = 4, 3
    tables = exact.random_tables(rng, vocab, g + 1, "served")
    parent = jnp.asarray([-1, 0, 1], jnp.int32)
    depth = jnp.asarray([1, 2, 3], jnp.int32)
    for draft in itertools.islice(itertools.product(range(vocab), repeat=g), 0, None, 5):
        rows = jnp.asarray(_chain_rows(tables, draft))
        d = jnp.asarray(draft, jnp.int32)
        gc, gt = chain.greedy_chain(rows, d), tree.greedy_tree(rows, d, parent, depth)
        assert (int(gc.n), int(gc.token)) == (int(gt.n), int(gt.token))
        for seed in (0, 5):
            uc = chain.gumbel_chain(rows, d, jnp.int32(seed), jnp.int32(9))
            ut = tree.gumbel_tree(rows, d, parent, depth, jnp.int32(seed), jnp.int32(9))
            assert (int(uc.n), int(uc.token)) == (int(ut.n), int(ut.token))
            assert list(np.asarray(ut.path)) == list(range(int(ut.n))) + [-1] * (g - int(ut.n))


def _reference_greedy_walk(tables, tokens, parent):
    vocab, cur, seq, path = tables.vocab, -1, [], []
    while True:
        want = int(np.argmax(tables.logp[len(seq)][exact.code(seq, vocab)]))
        child = [i for i in range(len(parent)) if parent[i] == cur and tokens[i] == want]
        if not child:
            return path, want
        cur = child[0]
        path.append(cur)
        seq.append(want)


def test_greedy_tree_walks_the_target_argmax():
    rng = np.random.default_rng(6)
    vocab = 3
    parent = SHAPES["wide"]
    tables = exact.random_tables(rng, vocab, 4, "dirichlet")
    paths = exact.tree_paths(parent)
    for tokens in itertools.islice(itertools.product(range(vocab), repeat=len(parent)), 0, None, 7):
        rows = [tables.logp[0][0]] + [tables.logp[len(p)][exact.code([tokens[j] for j in p], vocab)] for p in paths]
        res = tree.greedy_tree(jnp.asarray(np.stack(rows)), jnp.asarray(tokens, jnp.int32),
                               jnp.asarray(parent, jnp.int32), jnp.asarray([len(p) for p in paths], jnp.int32))
        want_path, want_token = _reference_greedy_walk(tables, tokens, parent)
        n = int(res.n)
        assert list(np.asarray(res.path)[:n]) == want_path and int(res.token) == want_token
        assert (np.asarray(res.path)[n:] == -1).all()


def test_absent_nodes_are_never_accepted():
    logp = jnp.log(jnp.asarray([[0.0, 1.0, 0.0]] * 3, jnp.float32))
    tokens = jnp.asarray([-1, 1], jnp.int32)  # node 0 is padding
    parent = jnp.asarray([-1, -1], jnp.int32)
    depth = jnp.asarray([1, 1], jnp.int32)
    for res in (tree.greedy_tree(logp, tokens, parent, depth),
                tree.sampling_tree_deterministic(logp, tokens, parent, depth, jnp.int32(0), jnp.int32(0)),
                tree.gumbel_tree(logp, tokens, parent, depth, jnp.int32(1), jnp.int32(0))):
        assert int(res.n) == 1 and int(res.path[0]) == 1
