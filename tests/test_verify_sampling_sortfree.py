"""served_logprobs (sort-free thresholds) against the full-sort reference `_served_logprobs_sorted`.

The top-k stage is integer counting, so it must agree exactly. The top-p stage sums probabilities in
a different order than the reference's sorted cumsum, so a tie group at the boundary may flip only
when its strictly-greater mass lies within float32 summation rounding of top_p; everywhere else the
served log-probs must be equal bit for bit.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jspec.verify.sampling import (SamplingParams, _bisect_threshold, _log_softmax_one_pass, _served_logprobs_sorted,
                                   flush_subnormals, served_logprobs)

# Derandomized: the same 60 examples on every machine (a CI run does not depend on its draw).
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True,
                    database=None)
ROWS = 6
VOCABS = (2, 7, 64)
KINDS = ("normal", "ties", "masked", "extreme", "flat", "uniform")
_new_jit = jax.jit(served_logprobs, static_argnums=1)
_ref_jit = jax.jit(_served_logprobs_sorted, static_argnums=1)


def _logits(rng: np.random.Generator, rows: int, vocab: int, kind: str) -> np.ndarray:
    """float32 [rows, vocab] with at least one finite entry per row."""
    if kind == "normal":
        x = rng.normal(0, 3, (rows, vocab))
    elif kind == "ties":
        x = rng.choice([-2.0, -0.5, 0.0, 1.0, 1.0, 3.0], (rows, vocab))
    elif kind == "masked":
        x = np.where(rng.random((rows, vocab)) < 0.5, -np.inf, rng.normal(0, 3, (rows, vocab)))
    elif kind == "extreme":
        x = rng.choice([-1e4, -30.0, 0.0, 0.0, 30.0, 1e4, -np.inf], (rows, vocab))
    elif kind == "flat":
        x = rng.normal(0, 1e-6, (rows, vocab))
    else:
        x = np.zeros((rows, vocab))
    dead = ~np.isfinite(x).any(-1)
    x[dead, rng.integers(0, vocab, int(dead.sum()))] = 0.0
    return x.astype(np.float32)


@st.composite
def served_case(draw):
    vocab = draw(st.sampled_from(VOCABS))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31 - 1)))
    logits = _logits(rng, ROWS, vocab, draw(st.sampled_from(KINDS)))
    params = SamplingParams(temperature=draw(st.sampled_from([1e-3, 0.5, 1.0, 1e3, 1e6])),
                            top_k=draw(st.sampled_from([0, 1, 2, vocab - 1, vocab])),
                            top_p=draw(st.sampled_from([1e-6, 0.5, 0.9, 1.0])))
    return logits, params


def _greater_mass(logp: np.ndarray) -> np.ndarray:
    """float64 [rows, V]: exact mass of the tokens strictly more likely than each token, summing the
    float32 probabilities exp(logp) that both implementations sum."""
    probs = np.asarray(jnp.exp(jnp.asarray(logp))).astype(np.float64)
    out = np.empty_like(probs)
    for r in range(logp.shape[0]):
        order = np.argsort(logp[r], kind="stable")
        asc, p_asc = logp[r][order], probs[r][order]
        suffix = np.append(np.cumsum(p_asc[::-1])[::-1], 0.0)  # suffix[j] = mass of asc[j:]
        out[r] = suffix[np.searchsorted(asc, logp[r], side="right")]
    return out


def assert_same_as_sorted(logits: np.ndarray, params: SamplingParams, new: np.ndarray, ref: np.ndarray,
                          atol: float = 0.0) -> None:
    """new == ref on every row (bit for bit, or within atol where finite), except rows whose support
    differs only by tokens whose strictly-greater mass is within summation rounding of top_p."""
    keep_new, keep_ref = np.isfinite(new), np.isfinite(ref)
    rows = (keep_new == keep_ref).all(-1)
    if atol == 0.0:
        np.testing.assert_array_equal(new[rows], ref[rows])
    else:
        np.testing.assert_array_equal(keep_new[rows], keep_ref[rows])
        np.testing.assert_allclose(np.where(keep_new, new, 0)[rows], np.where(keep_ref, ref, 0)[rows], rtol=0, atol=atol)
    if rows.all():
        return
    assert params.top_p < 1.0, "the top-k stage must agree exactly"
    before_top_p = np.asarray(_served_logprobs_sorted(jnp.asarray(logits),
                                                      SamplingParams(params.temperature, params.top_k)))
    mass = _greater_mass(before_top_p)
    tol = (2 * logits.shape[-1] + 4) * 2.0 ** -24  # both sums' rounding bounds, plus the comparison
    flipped = keep_new != keep_ref
    gap = np.abs(mass[flipped] - np.float64(np.float32(params.top_p)))
    assert (gap <= tol).all(), f"kept sets differ away from the top-p boundary: gaps {gap}"


@SETTINGS
@given(served_case())
def test_eager_matches_the_sorted_reference_bit_for_bit(case):
    logits, params = case
    x = jnp.asarray(logits)
    new = np.asarray(served_logprobs(x, params))
    ref = np.asarray(_served_logprobs_sorted(x, params))
    assert_same_as_sorted(logits, params, new, ref)
    assert np.isfinite(new).any(-1).all() and not np.isnan(new).any()


def _fusion_atol(logits: np.ndarray, params: SamplingParams) -> float:
    """Rounding scale of log_softmax(logits / T): XLA fuses it differently under jit than op by op
    (the sort reference has the same jit-vs-eager difference), so values may move by a few ulps of
    the largest scaled logit."""
    scaled = np.abs(logits[np.isfinite(logits)] / params.temperature).max()
    return float(8 * np.spacing(np.float32(max(scaled, 1.0))))


@SETTINGS
@given(served_case())
def test_jit_matches_eager_and_the_jitted_reference(case):
    logits, params = case
    x = jnp.asarray(logits)
    jitted = np.asarray(_new_jit(x, params))
    atol = _fusion_atol(logits, params)
    assert_same_as_sorted(logits, params, jitted, np.asarray(served_logprobs(x, params)), atol=atol)
    assert_same_as_sorted(logits, params, jitted, np.asarray(_ref_jit(x, params)), atol=atol)
    assert np.isfinite(jitted).any(-1).all() and not np.isnan(jitted).any()


def test_a_point_mass_under_jit_keeps_its_token():
    # At temperature 1e-3 these rows put all their mass on one token (log-prob exactly 0.0). The search
    # used to settle on a subnormal threshold that one fused kernel flushed to zero and the final mask
    # compared exactly: under jit on XLA:CPU rows 0, 4 and 5 came back all NaN.
    logits = jnp.asarray(np.array([[1e4, 30], [0, -30], [0, -1e4], [-1e4, -1e4], [-30, 1e4], [30, -np.inf]],
                                  np.float32))
    params = SamplingParams(temperature=1e-3, top_p=0.9)
    jitted = np.asarray(_new_jit(logits, params))
    np.testing.assert_array_equal(jitted, np.asarray(_served_logprobs_sorted(logits, params)))
    np.testing.assert_array_equal(jitted[[0, 1, 2, 5]], [[0.0, -np.inf]] * 4)
    np.testing.assert_array_equal(jitted[4], [-np.inf, 0.0])


@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
def test_top_k_ties_follow_float_comparison(top_k):
    # -0.0 == +0.0, and the backend may compare subnormals as zero: the reference thresholds with
    # `logits >= kth`, so the sort-free search must use the same comparison, not raw bit patterns.
    logits = jnp.asarray(np.array([[1e-40, 0.0, -1e-40, 1.0, -1.0],
                                   [-0.0, 0.0, -1.0, -2.0, -np.inf],
                                   [-np.inf, -np.inf, 1.0, 2.0, -np.inf]], np.float32))
    params = SamplingParams(top_k=top_k)
    new = np.asarray(served_logprobs(logits, params))
    np.testing.assert_array_equal(new, np.asarray(_served_logprobs_sorted(logits, params)))
    np.testing.assert_array_equal(np.asarray(_new_jit(logits, params)), new)
    # Fewer finite logits than k: the k-th largest is -inf and every finite token stays.
    if top_k >= 3:
        assert set(np.flatnonzero(np.isfinite(new[2]))) == {2, 3}


def test_flush_subnormals_is_the_comparison_it_replaces():
    """The bit arithmetic gives where(|x| < tiny, 0, x) bit for bit, eager and under jit: the edge values
    and 200,000 random bit patterns (every class of float32: zeros, subnormals, normals, inf, NaN)."""
    f32 = np.finfo(np.float32)
    edges = np.array([0.0, -0.0, f32.tiny, -f32.tiny, f32.tiny / 2, -f32.tiny / 2, f32.smallest_subnormal,
                      -f32.smallest_subnormal, np.nextafter(f32.tiny, np.float32(0)), np.inf, -np.inf, np.nan,
                      1.0, -3.5, f32.max, -f32.max], np.float32)
    patterns = np.random.default_rng(0).integers(-2**31, 2**31, 200_000).astype(np.int32).view(np.float32)
    x = np.concatenate([edges, patterns])
    want = np.where(np.abs(x) < f32.tiny, np.float32(0.0), x).view(np.int32)
    for fn in (flush_subnormals, jax.jit(flush_subnormals)):
        np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(x))).view(np.int32), want)
    with pytest.raises(TypeError, match="takes float32"):
        flush_subnormals(jnp.zeros(3, jnp.bfloat16))


@SETTINGS
@given(st.sampled_from(KINDS), st.sampled_from(VOCABS + (4096,)), st.integers(0, 2 ** 31 - 1))
def test_one_pass_log_softmax_is_log_softmax_up_to_the_rounding_of_its_sum(kind, vocab, seed):
    """The GPU's log-softmax (max and sum in one reduction; CPU and TPU use jax.nn.log_softmax, so it
    runs here only in this test): -inf exactly where jax.nn.log_softmax has it, elsewhere equal up to
    the rounding of a V-term sum, its log and the final subtraction, eager and under jit."""
    logits = jnp.asarray(_logits(np.random.default_rng(seed), ROWS, vocab, kind))
    want = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for fn in (_log_softmax_one_pass, jax.jit(_log_softmax_one_pass)):
        got = np.asarray(fn(logits))
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
        assert np.isfinite(got[~np.isneginf(want)]).all()
        finite = np.isfinite(want)
        tol = (2 * vocab + 8) * 2.0 ** -24 + 2.0 ** -22 * np.abs(want[finite])
        assert (np.abs(got[finite] - want[finite]) <= tol).all()


@SETTINGS
@given(st.sampled_from(KINDS), st.sampled_from(VOCABS + (4096,)), st.integers(0, 2 ** 31 - 1),
       st.sampled_from([1e-6, 0.5, 0.9, 0.999999]))
def test_top_p_search_finds_the_same_threshold_at_every_digit_width(kind, vocab, seed, top_p):
    """top-p's search over [0, 1] settles 3 bits per pass on CPU and 5 on GPU and TPU (only the first
    runs in served_logprobs here): every width gives the same threshold, and so does the search over
    every float (which returns -inf where the others return 0: both keep every token)."""
    logits = jnp.asarray(_logits(np.random.default_rng(seed), ROWS, vocab, kind))
    probs = flush_subnormals(jnp.exp(jax.nn.log_softmax(logits, axis=-1)))
    top_p = jnp.float32(top_p)
    pred = lambda t: jnp.sum(jnp.where(probs[:, None, :] >= t, probs[:, None, :], 0.0), axis=-1, keepdims=True) >= top_p
    cuts = {bits: np.asarray(_bisect_threshold(pred, (ROWS, 1), nonnegative=True, digit_bits=bits))
            for bits in (1, 2, 3, 5, 6, 10)}
    for bits, cut in cuts.items():
        np.testing.assert_array_equal(cut, cuts[3], err_msg=f"{bits} bits per pass")
    any_float = np.asarray(_bisect_threshold(pred, (ROWS, 1)))
    np.testing.assert_array_equal(np.where(np.isneginf(any_float), 0.0, any_float), cuts[3])
    assert (cuts[3] >= 0).all() and (cuts[3] <= np.asarray(probs).max(-1, keepdims=True)).all()


def test_one_pass_log_softmax_of_a_lone_finite_entry_is_zero():
    logits = jnp.asarray([[-jnp.inf, 3.0, -jnp.inf], [1e4, -jnp.inf, -1e4]], jnp.float32)
    got = np.asarray(_log_softmax_one_pass(logits))
    np.testing.assert_array_equal(got[0], [-np.inf, 0.0, -np.inf])
    np.testing.assert_array_equal(got[1], [0.0, -np.inf, -2e4])


def test_top_p_boundary_cases():
    with np.errstate(divide="ignore"):
        logits = jnp.asarray(np.log(np.array([[0.4, 0.2, 0.2, 0.1, 0.1],  # tie group crosses 0.7
                                              [0.25, 0.25, 0.25, 0.25, 1e-30],
                                              [1.0, 1e-30, 1e-30, 0.0, 0.0]], np.float32)))
    for top_p in (1e-7, 0.5, 0.7, 0.9, float(np.nextafter(np.float32(1), np.float32(0)))):
        params = SamplingParams(top_p=top_p)
        new = np.asarray(served_logprobs(logits, params))
        np.testing.assert_array_equal(new, np.asarray(_served_logprobs_sorted(logits, params)))
        np.testing.assert_array_equal(np.asarray(_new_jit(logits, params)), new)
    new = np.asarray(served_logprobs(logits, SamplingParams(top_p=0.7)))
    assert [set(np.flatnonzero(np.isfinite(r))) for r in new] == [{0, 1, 2}, {0, 1, 2, 3}, {0}]


@pytest.mark.parametrize("vocab", [32768])
def test_large_vocabulary_decisions_follow_the_exact_rule(vocab):
    """At V = 32768 (17 rows = one verify pass of g = 16), every kept or removed token obeys the
    exact top-p rule (strictly-greater mass < top_p) unless that mass is within 2**-20 of top_p,
    and the served rows equal the sorted reference's."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(0, 2, (17, vocab)), jnp.float32)
    for params in (SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(top_k=200, top_p=0.5),
                   SamplingParams(temperature=1.5, top_k=vocab - 1, top_p=0.95)):
        new = np.asarray(_new_jit(logits, params))
        assert_same_as_sorted(np.asarray(logits), params, new, np.asarray(_ref_jit(logits, params)))
        before = np.asarray(_served_logprobs_sorted(logits, SamplingParams(params.temperature, params.top_k)))
        mass = _greater_mass(before) - np.float64(np.float32(params.top_p))
        decided = np.isfinite(before) & (np.abs(mass) > 2.0 ** -20)
        np.testing.assert_array_equal(np.isfinite(new)[decided], (mass < 0)[decided])


@pytest.mark.parametrize("params", [SamplingParams(top_k=2), SamplingParams(top_k=50), SamplingParams(top_k=999),
                                    SamplingParams(top_p=0.9), SamplingParams(temperature=0.7, top_k=50, top_p=0.9)])
def test_compiled_program_has_no_sort(params):
    text = _new_jit.lower(jax.ShapeDtypeStruct((17, 1000), jnp.float32), params).compile().as_text()
    assert not re.search(r"\ssort\(", text)
    assert 'custom_call_target="TopK"' not in text

