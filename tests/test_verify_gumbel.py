"""Gumbel coupling: closed-form coupling law, match probability and its bound, exactness, and the
identity with the plain autoregressive Gumbel-max sampler (chains and trees, over several rounds)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.verify import chain, exact, noise, tree
from jspec.verify.sampling import gumbel_argmax
from verify_helpers import MC_SAMPLES, ar_gumbel_sequence, gumbel_draw

TOL = 1e-6


def _random_pair(rng, vocab):
    p, q = rng.dirichlet(np.ones(vocab) * 0.7), rng.dirichlet(np.ones(vocab) * 0.7)
    if rng.random() < 0.4:
        p = p * (rng.random(vocab) < 0.6)
        p[rng.integers(vocab)] += 0.1
    if rng.random() < 0.4:
        q = q * (rng.random(vocab) < 0.6)
        q[rng.integers(vocab)] += 0.1
    return p / p.sum(), q / q.sum()


def test_coupling_law_has_the_right_marginals_and_diagonal():
    rng = np.random.default_rng(0)
    for _ in range(60):
        vocab = int(rng.integers(2, 6))
        p, q = _random_pair(rng, vocab)
        joint = exact.gumbel_coupling(p, q)
        np.testing.assert_allclose(joint.sum(0), p, atol=1e-12)  # target marginal
        np.testing.assert_allclose(joint.sum(1), q, atol=1e-12)  # drafter marginal
        both = (p > 0) & (q > 0)
        diag = np.where(both, 1.0 / np.array([np.maximum(p / max(p[j], 1e-300), q / max(q[j], 1e-300)).sum()
                                               for j in range(vocab)]), 0.0)
        np.testing.assert_allclose(np.diag(joint), diag, atol=1e-12)


def test_match_probability_is_at_least_the_communication_free_bound():
    rng = np.random.default_rng(1)
    for _ in range(300):
        p, q = _random_pair(rng, int(rng.integers(2, 9)))
        tv = 0.5 * np.abs(p - q).sum()
        match = exact.gumbel_match_probability(p, q)
        assert match >= (1 - tv) / (1 + tv) - 1e-12
        assert match <= 1 - tv + 1e-12  # no coupling beats the maximal one


def test_match_rate_of_gumbel_chain_equals_the_formula():
    """Monte Carlo: 200,000 one-token rounds with a coupled drafter; two-sided z-test with |z| < 5.3
    (false-failure probability 1.2e-7 under the normal approximation)."""
    p, q = np.array([0.5, 0.25, 0.15, 0.1, 0.0]), np.array([0.1, 0.3, 0.3, 0.0, 0.3])
    with np.errstate(divide="ignore"):
        logp = jnp.asarray(np.log(np.stack([p, p])), jnp.float32)
        logq = jnp.asarray(np.log(q), jnp.float32)

    def one(seed):
        x = gumbel_argmax(logq, noise.gumbel(seed, jnp.int32(3), noise.GUMBEL, 5))
        return chain.gumbel_chain(logp, x[None], seed, jnp.int32(3)).n

    n = np.asarray(jax.jit(jax.vmap(one))(jnp.arange(MC_SAMPLES, dtype=jnp.int32)))
    m = exact.gumbel_match_probability(p, q)
    z = (n.mean() - m) / np.sqrt(m * (1 - m) / MC_SAMPLES)
    assert abs(z) < 5.3, (n.mean(), m)


@pytest.mark.parametrize("family", exact.FAMILIES)
def test_coupled_chain_output_is_the_target_joint(family):
    rng = np.random.default_rng(exact.FAMILIES.index(family))
    for vocab, g in [(3, 2), (5, 3)]:
        tables = exact.random_tables(rng, vocab, g + 1, family)
        outputs = exact.gumbel_chain_outputs(tables, g)
        completed = exact.completed_distribution(outputs, tables, g + 1)
        assert np.abs(completed - exact.target_joint(tables, g + 1)).max() < TOL


def test_expected_accepted_is_the_geometric_sum_of_match_probabilities():
    rng = np.random.default_rng(4)
    p, q = _random_pair(rng, 4)
    m = exact.gumbel_match_probability(p, q)
    got = exact.expected_accepted(exact.gumbel_chain_outputs(exact.constant_tables(p, q, 4), 3))
    assert abs(got - (m + m ** 2 + m ** 3)) < TOL


def _proposals(kind, tables, prefix, g, seed, pos0, rng):
    vocab, out = tables.vocab, list(prefix)
    for k in range(g):
        row = tables.logq[len(out)][exact.code(out, vocab)]
        if kind == "coupled":
            x = int(gumbel_draw(jnp.asarray(row), jnp.int32(seed), jnp.int32(pos0 + k)))
        elif kind == "argmax":
            x = int(np.argmax(row))
        else:
            x = int(rng.integers(vocab))
        out.append(x)
    return out[len(prefix):]


def _rows(tables, prefix, tokens):
    vocab, rows, seq = tables.vocab, [], list(prefix)
    rows.append(tables.logp[len(seq)][exact.code(seq, vocab)])
    for t in tokens:
        seq.append(t)
        rows.append(tables.logp[len(seq)][exact.code(seq, vocab)])
    return np.stack(rows)


@pytest.mark.parametrize("drafter", ["coupled", "argmax", "random"])
@pytest.mark.parametrize("family", ["dirichlet", "served", "greedy"])
def test_multi_round_gumbel_chain_equals_the_plain_sampler(drafter, family):
    """Committed text == the AR Gumbel-max text token for token, for any drafter and block size."""
    rng = np.random.default_rng([3, exact.FAMILIES.index(family)])
    total, vocab, base = 7, 4, 20
    tables = exact.random_tables(rng, vocab, total, family)
    accepted = 0
    for seed in (0, 1, 2):
        want = ar_gumbel_sequence(tables, seed, base, total)
        for g in (1, 3):
            out = []
            while len(out) < total:
                gg = min(g, total - 1 - len(out))
                pos0 = base + len(out)
                draft = _proposals(drafter, tables, out, gg, seed, pos0, rng)
                res = chain.gumbel_chain(jnp.asarray(_rows(tables, out, draft)), jnp.asarray(draft, jnp.int32).reshape(gg),
                                         jnp.int32(seed), jnp.int32(pos0))
                n = int(res.n)
                accepted += n
                out += draft[:n] + [int(res.token)]
            assert out == want
    if drafter == "coupled":
        assert accepted > 0  # the rounds did exercise acceptance


def _random_tree(rng, n_nodes):
    parent = [-1] + [int(rng.integers(-1, i)) for i in range(1, n_nodes)]
    depth = []
    for pa in parent:
        depth.append(1 if pa < 0 else depth[pa] + 1)
    return parent, depth


@pytest.mark.parametrize("family", ["dirichlet", "served"])
def test_multi_round_gumbel_tree_equals_the_plain_sampler(family):
    rng = np.random.default_rng([8, exact.FAMILIES.index(family)])
    total, vocab, base, n_nodes = 7, 3, 4, 4
    tables = exact.random_tables(rng, vocab, total + n_nodes, family)
    accepted = 0
    for seed in range(4):
        want = ar_gumbel_sequence(tables, seed, base, total)
        out = []
        while len(out) < total:
            parent, depth = _random_tree(rng, n_nodes)
            tokens = [int(rng.integers(vocab)) for _ in range(n_nodes)]
            # Make the tree likely to contain the sampler's path: copy it onto one branch.
            for i, d in enumerate(depth):
                if rng.random() < 0.5 and len(out) + d - 1 < len(want):
                    tokens[i] = want[len(out) + d - 1]
            paths = exact.tree_paths(parent)
            rows = [tables.logp[len(out)][exact.code(out, vocab)]]
            for i in range(n_nodes):
                seq = out + [tokens[j] for j in paths[i]]
                rows.append(tables.logp[len(seq)][exact.code(seq, vocab)])
            res = tree.gumbel_tree(jnp.asarray(np.stack(rows)), jnp.asarray(tokens, jnp.int32),
                                   jnp.asarray(parent, jnp.int32), jnp.asarray(depth, jnp.int32),
                                   jnp.int32(seed), jnp.int32(base + len(out)))
            n = int(res.n)
            accepted += n
            out += [tokens[int(i)] for i in np.asarray(res.path)[:n]] + [int(res.token)]
        assert out[:total] == want
    assert accepted > 0
