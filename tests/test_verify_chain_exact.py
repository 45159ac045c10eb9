"""Chain rules are exact: their output distribution, with every coin integrated analytically, equals
the target's joint distribution (V <= 5, g <= 3), and expected accepted lengths match theory."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.verify import chain, exact
from jspec.verify.chain import CoinOutcome, block_chain_from_coins, residual_logp, speculative_chain_from_coins

TOL = 1e-6
COIN_RULES = {"speculative": speculative_chain_from_coins, "block": block_chain_from_coins}
SHAPES = [(2, 1), (5, 1), (3, 2), (5, 3)]  # (V, g)


def _exactness_error(outputs, tables, g):
    completed = exact.completed_distribution(outputs, tables, g + 1)
    return np.abs(completed - exact.target_joint(tables, g + 1)).max()


@pytest.mark.parametrize("rule", sorted(COIN_RULES))
@pytest.mark.parametrize("family", exact.FAMILIES)
@pytest.mark.parametrize("vocab, g", SHAPES)
def test_coin_rules_reproduce_the_target_joint(rule, family, vocab, g):
    rng = np.random.default_rng([vocab, g, exact.FAMILIES.index(family)])
    for _ in range(3):
        tables = exact.random_tables(rng, vocab, g + 1, family)
        outputs = exact.chain_outputs(COIN_RULES[rule], tables, g)
        assert not any(np.isnan(o).any() for o in outputs)
        assert _exactness_error(outputs, tables, g) < TOL


@pytest.mark.parametrize("rule", sorted(COIN_RULES))
@pytest.mark.parametrize("length", [0, 1, 2])
def test_a_shorter_verify_length_is_still_exact(rule, length):
    rng = np.random.default_rng(length)
    tables = exact.random_tables(rng, 4, 4, "sparse")
    outputs = exact.chain_outputs(COIN_RULES[rule], tables, 3, length=length)
    assert sum(o.sum() for o in outputs[length + 2:]) == 0  # never more than `length` accepted
    assert _exactness_error(outputs, tables, 3) < TOL


@pytest.mark.parametrize("rule", sorted(COIN_RULES))
def test_equal_distributions_accept_everything(rule):
    tables = exact.random_tables(np.random.default_rng(3), 5, 4, "equal")
    outputs = exact.chain_outputs(COIN_RULES[rule], tables, 3)
    assert abs(outputs[4].sum() - 1.0) < TOL  # n = g with probability 1, bonus drawn from p


def test_sun_et_al_toy_expected_accepted_tokens():
    tables = exact.constant_tables([1 / 3, 2 / 3], [2 / 3, 1 / 3], depth=3)
    token = exact.expected_accepted(exact.chain_outputs(speculative_chain_from_coins, tables, 2))
    block = exact.expected_accepted(exact.chain_outputs(block_chain_from_coins, tables, 2))
    assert abs(token - 10 / 9) < TOL and abs(block - 11 / 9) < TOL


def test_seed_three_token_example():
    """p = (0.5, 0.3, 0.2), q = (0.2, 0.2, 0.6): rejection 0.40, residual (0.75, 0.25, 0), output p."""
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.2, 0.6])
    logp = jnp.asarray(np.log([p, p]), jnp.float32)
    logq = jnp.asarray(np.log([q]), jnp.float32)
    out = np.zeros(3)
    reject = 0.0
    for x in range(3):
        r = speculative_chain_from_coins(logp, jnp.array([x], jnp.int32), logq, jnp.array([exact.COIN_FAIL]))
        accept = float(r.threshold[0])
        reject += q[x] * (1 - accept)
        if x == 2:
            np.testing.assert_allclose(np.exp(np.asarray(r.token_logp, np.float64)), [0.75, 0.25, 0.0], atol=1e-6)
        out[x] += q[x] * accept
        out += q[x] * (1 - accept) * np.exp(np.asarray(r.token_logp, np.float64))
    assert abs(reject - 0.40) < TOL
    np.testing.assert_allclose(out, p, atol=TOL)
    assert abs(out[0] - (0.2 + 0.4 * 0.75)) < TOL and abs(out[1] - (0.2 + 0.4 * 0.25)) < TOL


@pytest.mark.parametrize("family", ["dirichlet", "sparse", "served", "near"])
def test_block_never_accepts_fewer_than_token_wise(family):
    rng = np.random.default_rng(11)
    for vocab, g in [(3, 2), (5, 3)]:
        for _ in range(4):
            tables = exact.random_tables(rng, vocab, g + 1, family)
            token = exact.expected_accepted(exact.chain_outputs(speculative_chain_from_coins, tables, g))
            block = exact.expected_accepted(exact.chain_outputs(block_chain_from_coins, tables, g))
            assert block >= token - 1e-7


def test_token_wise_expected_length_is_the_geometric_sum_of_overlaps():
    rng = np.random.default_rng(5)
    p, q = rng.dirichlet(np.ones(4)), rng.dirichlet(np.ones(4))
    alpha = np.minimum(p, q).sum()
    tables = exact.constant_tables(p, q, depth=4)
    got = exact.expected_accepted(exact.chain_outputs(speculative_chain_from_coins, tables, 3))
    assert abs(got - (alpha + alpha ** 2 + alpha ** 3)) < TOL


def test_mixing_block_acceptance_with_the_token_wise_residual_is_detected():
    """Negative control: the enumeration has the power to reject a wrong rule."""

    def mixed(target_logp, draft, draft_logp, coins, length):
        out = block_chain_from_coins(target_logp, draft, draft_logp, coins, length)
        row_q = draft_logp[jnp.minimum(out.n, draft.shape[0] - 1)]
        wrong = jnp.where(out.n >= length, out.token_logp, residual_logp(target_logp[out.n], row_q))
        return CoinOutcome(out.n, wrong, out.threshold)

    # Needs a residual (w p - q)+ with two live tokens whose ratio differs from (p - q)+.
    tables = exact.constant_tables([0.4, 0.4, 0.2], [0.1, 0.2, 0.7], depth=3)
    assert _exactness_error(exact.chain_outputs(mixed, tables, 2), tables, 2) > 1e-3


def test_greedy_chain_follows_the_target_argmax_at_temperature_zero():
    rng = np.random.default_rng(2)
    vocab, g = 4, 3
    for _ in range(5):
        tables = exact.random_tables(rng, vocab, g + 1, "greedy")
        path = []
        for k in range(g + 1):
            path.append(int(np.argmax(tables.logp[k][exact.code(path, vocab)])))
        for draft in itertools.product(range(vocab), repeat=g):
            rows = [tables.logp[k][exact.code(draft[:k], vocab)] for k in range(g + 1)]
            res = chain.greedy_chain(jnp.asarray(np.stack(rows)), jnp.asarray(draft, jnp.int32))
            n = int(res.n)
            assert list(draft[:n]) + [int(res.token)] == path[:n + 1]
            assert n == g or draft[n] != path[n]


def _stage_gate(vocab, stage, threshold_token):
    """A DLoop-like draft length: stages of `stage` drafts; another stage follows while the previous
    stage's drafts all lie below `threshold_token` (a gate that reads only drafts already made)."""
    def length(draft):
        n = stage
        while n < len(draft) and all(t < threshold_token for t in draft[n - stage:n]):
            n += stage
        return n
    return length


@pytest.mark.parametrize("rule", sorted(COIN_RULES))
@pytest.mark.parametrize("vocab, stage, stages, gate", [(3, 1, 3, 2), (4, 1, 3, 1), (3, 2, 2, 2), (2, 1, 4, 1)])
def test_a_draft_length_decided_while_drafting_is_exact(rule, vocab, stage, stages, gate):
    """Drafting stops at a stopping time (the gate reads only earlier drafts; the stage that stops it is
    submitted whole): the verified output, completed by the target, still has the target's joint
    distribution, for token-wise and block verification, with context-dependent random tables."""
    g = stage * stages
    rng = np.random.default_rng([vocab, stage, stages, gate])
    length = _stage_gate(vocab, stage, gate)
    for family in ("dirichlet", "sparse", "near"):
        tables = exact.random_tables(rng, vocab, g + 1, family)
        outputs = exact.chain_outputs(COIN_RULES[rule], tables, g, length=length)
        lengths = {length(d) for d in itertools.product(range(vocab), repeat=g)}
        assert len(lengths) > 1  # the gate really varies the length
        assert _exactness_error(outputs, tables, g) < TOL


@pytest.mark.parametrize("rule", sorted(COIN_RULES))
def test_a_length_that_reads_the_admitted_draft_is_not_exact(rule):
    """The control: admitting draft 2 only when it is token 0 (reading its own value) biases the output,
    and the criterion above sees it."""
    tables = exact.random_tables(np.random.default_rng(7), 3, 3, "dirichlet")
    outputs = exact.chain_outputs(COIN_RULES[rule], tables, 2, length=lambda d: 2 if d[1] == 0 else 1)
    assert _exactness_error(outputs, tables, 2) > 1e-3
