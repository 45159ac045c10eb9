"""DSpark verification budget: the sorted greedy rule, non-anticipation, and the retrospective
counterexample (target (0.7, 0.3), proposal (0.5, 0.5): P(A) = 0.85 instead of 0.7)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from jspec.verify import choose_verify_lengths, expected_rate, speculative_chain, speculative_chain_from_coins
from jspec.verify.exact import COIN_FAIL, COIN_PASS
from verify_helpers import MC_SAMPLES


def _reference(conf, sps):
    """The documented rule, written out with Python loops; also returns the decisive margin."""
    s = np.cumprod(np.clip(conf, 0, 1), axis=1).astype(np.float32)
    rows, g = s.shape
    cands = sorted(((s[b, k], k, b) for b in range(rows) for k in range(g)), key=lambda c: (-c[0], c[1], c[2]))
    gains = np.concatenate([[0.0], np.cumsum([c[0] for c in cands], dtype=np.float64)])
    value = (rows + gains) * sps[: rows * g + 1]
    m, margin = 0, np.inf
    while m < len(cands):
        margin = min(margin, abs(value[m + 1] - value[m]))
        if not value[m + 1] > value[m]:
            break
        m += 1
    lengths = np.zeros(rows, np.int32)
    for _, k, b in cands[:m]:
        lengths[b] += 1
    return lengths, margin


@st.composite
def budget_case(draw):
    rows, g = draw(st.sampled_from([1, 3])), draw(st.sampled_from([1, 4]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31 - 1)))
    conf = rng.random((rows, g)).astype(np.float32)
    conf[rng.random((rows, g)) < 0.2] = 1.0  # ties in survival
    decay = draw(st.sampled_from([0.0, 0.02, 0.1, 0.5]))
    sps = (100.0 / (1.0 + decay * np.arange(rows * g + 1))).astype(np.float32)
    return conf, sps


@settings(max_examples=40, deadline=None)
@given(budget_case())
def test_matches_the_documented_greedy_rule(case):
    conf, sps = case
    want, margin = _reference(conf, sps)
    assume(margin > 1e-3)  # float32 summation order may decide exact ties differently
    got = np.asarray(choose_verify_lengths(jnp.asarray(conf), jnp.asarray(sps)))
    np.testing.assert_array_equal(got, want)


@settings(max_examples=40, deadline=None)
@given(budget_case(), st.data())
def test_admission_never_looks_at_later_positions_of_the_row(case, data):
    """Whether draft k of row b is verified depends on confidences up to k only."""
    conf, sps = case
    rows, g = conf.shape
    b, k = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, g - 1))
    other = conf.copy()
    other[b, k + 1:] = np.random.default_rng(k).random(g - k - 1)
    before = int(choose_verify_lengths(jnp.asarray(conf), jnp.asarray(sps))[b])
    after = int(choose_verify_lengths(jnp.asarray(other), jnp.asarray(sps))[b])
    assert min(before, k + 1) == min(after, k + 1)


def test_constant_and_steep_costs():
    conf = jnp.asarray([[0.9, 0.0, 0.5], [0.3, 0.3, 0.3]])
    flat = jnp.ones(7)
    np.testing.assert_array_equal(choose_verify_lengths(conf, flat), [1, 3])  # every positive survival pays
    steep = jnp.asarray([10.0] + [1.0] * 6)
    np.testing.assert_array_equal(choose_verify_lengths(conf, steep), [0, 0])


def test_a_late_token_of_a_confident_row_beats_an_early_token_of_a_doubtful_row():
    conf = jnp.asarray([[0.9, 0.9, 0.9], [0.1, 0.9, 0.9]])
    sps = 1.0 / (1.0 + 0.1 * jnp.arange(7))
    lengths = choose_verify_lengths(conf, sps)
    np.testing.assert_array_equal(lengths, [3, 0])
    assert abs(float(expected_rate(conf, lengths, sps)) - (2 + 0.9 + 0.81 + 0.729) / 1.3) < 1e-5


def test_sps_table_too_short_is_rejected():
    with pytest.raises(ValueError, match="B\\*g \\+ 1"):
        choose_verify_lengths(jnp.ones((2, 3)), jnp.ones(6))


# ---------------------------------------------------------------------------------------------
# Retrospective admission (DSpark appendix A).

P_TARGET = np.array([0.7, 0.3])
Q_DRAFT = np.array([0.5, 0.5])
LOGP = jnp.asarray(np.log([P_TARGET, P_TARGET]), jnp.float32)
LOGQ = jnp.asarray(np.log([Q_DRAFT]), jnp.float32)


def _exact_prob_a(length_of):
    """P(first emitted token = A) with one draft x ~ q verified for length_of(x) tokens."""
    total = 0.0
    for x in range(2):
        length = jnp.int32(length_of(x))
        for coin, branch in ((COIN_PASS, True), (COIN_FAIL, False)):
            out = speculative_chain_from_coins(LOGP, jnp.asarray([x], jnp.int32), LOGQ, jnp.asarray([coin]), length)
            thr = float(out.threshold[0])
            weight = Q_DRAFT[x] * (thr if branch else 1.0 - thr)
            if int(out.n) == 1:
                total += weight * (x == 0)
            else:
                total += weight * float(np.exp(out.token_logp[0]))
    return total


def test_retrospective_admission_biases_the_output_and_the_budget_rule_does_not():
    retrospective = _exact_prob_a(lambda x: 1 if x == 0 else 0)  # admit A only: its continuation "looks good"
    assert abs(retrospective - 0.85) < 1e-6
    # The budget rule sees the confidence, never the drafted token: either decision is exact.
    for sps in (jnp.ones(2), jnp.asarray([10.0, 1.0])):
        length = int(choose_verify_lengths(jnp.asarray([[0.7]]), sps)[0])
        assert abs(_exact_prob_a(lambda x: length) - 0.7) < 1e-6


def test_retrospective_bias_shows_in_sampling():
    """Monte Carlo with the keyed rule: 200,000 rounds each; |z| < 5.3 against 0.7 for the budget
    rule (false-failure probability 1.2e-7), while the retrospective policy sits ~100 sigma away."""

    def first_token(seed, retrospective):
        x = jax.random.bernoulli(jax.random.fold_in(jax.random.key(1), seed)).astype(jnp.int32)
        length = jnp.where(retrospective, (x == 0).astype(jnp.int32), jnp.int32(1))
        res = speculative_chain(LOGP, x[None], LOGQ, seed, jnp.int32(0), length=length)
        return jnp.where(res.n == 1, x, res.token)

    run = jax.jit(jax.vmap(first_token, in_axes=(0, None)))
    seeds = jnp.arange(MC_SAMPLES, dtype=jnp.int32)
    sd = np.sqrt(0.7 * 0.3 / MC_SAMPLES)
    fair = float(np.mean(np.asarray(run(seeds, False)) == 0))
    biased = float(np.mean(np.asarray(run(seeds, True)) == 0))
    assert abs(fair - 0.7) / sd < 5.3
    assert abs(biased - 0.85) / sd < 5.3 and (biased - 0.7) / sd > 50
