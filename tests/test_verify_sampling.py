"""served_logprobs (temperature / top-k / top-p edge cases) and keyed noise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.verify import noise
from jspec.verify.sampling import SamplingParams, first_argmax, gumbel_argmax, served_logprobs


def _served(logits, **kw):
    return np.asarray(served_logprobs(jnp.asarray(logits, jnp.float32), SamplingParams(**kw)))


def _assert_distribution(logp):
    assert logp.dtype == np.float32
    assert not np.isnan(logp).any() and not np.isposinf(logp).any()
    np.testing.assert_allclose(np.exp(logp.astype(np.float64)).sum(-1), 1.0, atol=1e-6)


def test_temperature_zero_is_a_point_mass_on_the_first_argmax():
    logits = np.array([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 0.0, 3.0]])
    out = _served(logits, temperature=0.0, top_k=2, top_p=0.3)
    np.testing.assert_array_equal(out, [[-np.inf, 0.0, -np.inf, -np.inf], [0.0, -np.inf, -np.inf, -np.inf]])


def test_first_argmax_is_jnp_argmax():
    """Ties (first index), -0.0 vs 0.0, all -inf rows, +inf, NaN (the first NaN) and random rows, compiled."""
    rows = np.array([[0.5, 2.0, 2.0, -1.0], [-0.0, 0.0, -1.0, 0.0], [-np.inf] * 4, [1.0, np.inf, 3.0, np.inf],
                     [1.0, np.nan, 5.0, np.nan], [np.nan, -np.inf, 2.0, 0.0]], np.float32)
    rand = np.random.default_rng(1).integers(-3, 3, size=(64, 33)).astype(np.float32)  # many ties
    for x in (rows, rand, rand.reshape(4, 16, 33)):
        got = jax.jit(first_argmax)(jnp.asarray(x))
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, jnp.argmax(jnp.asarray(x), axis=-1))


def test_first_argmax_is_one_reduction_on_gpu():
    """On GPU first_argmax lowers to jnp.argmax's single (value, index) reduction, which reads x once; on
    CPU and TPU to the two reductions (whose result the test above checks)."""
    x = jnp.zeros((3, 50))
    reductions = {platform: jax.jit(first_argmax).trace(x).lower(lowering_platforms=(platform,)).as_text().count(
        "stablehlo.reduce") for platform in ("cpu", "tpu", "cuda")}
    assert reductions == {"cpu": 2, "tpu": 2, "cuda": 1}


def test_temperature_scales_the_logits():
    logits = np.random.default_rng(0).normal(size=(3, 7))
    for t in (0.25, 1.0, 3.0):
        expect = jax.nn.log_softmax(jnp.asarray(logits / t, jnp.float32))
        np.testing.assert_allclose(_served(logits, temperature=t), expect, atol=1e-6)


def test_top_k_keeps_exactly_k_distinct_tokens():
    logits = np.array([0.1, 2.0, -1.0, 1.5, 0.7])
    out = _served(logits, top_k=2)
    assert set(np.flatnonzero(np.isfinite(out))) == {1, 3}
    _assert_distribution(out)
    np.testing.assert_allclose(np.exp(out[[1, 3]]), np.exp([2.0, 1.5]) / np.exp([2.0, 1.5]).sum(), rtol=1e-6)


def test_top_k_at_least_vocab_is_off_and_top_k_one_is_greedy():
    logits = np.random.default_rng(1).normal(size=(4, 6))
    np.testing.assert_allclose(_served(logits, top_k=6), _served(logits), atol=0)
    np.testing.assert_allclose(_served(logits, top_k=60), _served(logits), atol=0)
    np.testing.assert_array_equal(_served(logits, top_k=1), _served(logits, temperature=0.0))


def test_top_k_keeps_ties_at_the_boundary():
    out = _served([1.0, 3.0, 1.0, 0.0], top_k=2)
    assert set(np.flatnonzero(np.isfinite(out))) == {0, 1, 2}
    _assert_distribution(out)


@pytest.mark.parametrize("top_p, kept", [(0.3, {0}), (0.49, {0}), (0.51, {0, 1}), (0.79, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2})])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, kept):
    logits = np.log([0.5, 0.3, 0.2])
    out = _served(logits, top_p=top_p)
    assert set(np.flatnonzero(np.isfinite(out))) == kept
    _assert_distribution(out)


def test_top_p_applies_after_top_k_on_the_renormalised_distribution():
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    # After top-3 the masses are (4/9, 3/9, 2/9): 0.7 needs the first two only.
    out = _served(logits, top_k=3, top_p=0.7)
    assert set(np.flatnonzero(np.isfinite(out))) == {0, 1}
    np.testing.assert_allclose(np.exp(out[:2]), [4 / 7, 3 / 7], rtol=1e-6)


def test_extreme_and_masked_logits_stay_finite_where_kept():
    logits = np.array([[1e4, -1e4, 0.0, -np.inf], [-np.inf, 5.0, 5.0, 5.0]])
    for kw in ({}, {"top_k": 2}, {"top_p": 0.9}, {"temperature": 0.1}):
        out = _served(logits, **kw)
        _assert_distribution(out)
        assert np.isneginf(out[0, 3]) and np.isneginf(out[1, 0])


def test_sampling_params_reject_bad_values():
    for kw in ({"temperature": -1.0}, {"top_k": -2}, {"top_k": 1.5}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


def test_gumbel_argmax_ignores_noise_for_a_point_mass():
    logp = _served(np.random.default_rng(2).normal(size=(5, 9)), temperature=0.0)
    big_noise = jax.random.gumbel(jax.random.key(0), (5, 9)) * 50
    np.testing.assert_array_equal(gumbel_argmax(jnp.asarray(logp), big_noise), np.argmax(logp, -1))


def test_noise_is_a_pure_function_of_seed_position_purpose():
    a = noise.uniform(jnp.int32(7), jnp.int32(30), noise.ACCEPT)
    assert float(a) == float(noise.uniform(jnp.int32(7), jnp.int32(30), noise.ACCEPT))
    others = [noise.uniform(jnp.int32(8), jnp.int32(30), noise.ACCEPT),
              noise.uniform(jnp.int32(7), jnp.int32(31), noise.ACCEPT),
              noise.uniform(jnp.int32(7), jnp.int32(30), noise.BLOCK_ACCEPT)]
    assert all(float(o) != float(a) for o in others)
    i0 = noise.indexed_uniform(jnp.int32(7), jnp.int32(30), noise.TREE_ACCEPT, jnp.int32(0))
    i1 = noise.indexed_uniform(jnp.int32(7), jnp.int32(30), noise.TREE_ACCEPT, jnp.int32(1))
    assert float(i0) != float(i1)


def test_noise_does_not_depend_on_batch_composition():
    draw = jax.jit(noise.gumbel, static_argnums=(2, 3))
    seeds = jnp.array([3, 9, 3], jnp.int32)
    positions = jnp.array([[4, 5], [4, 5], [6, 7]], jnp.int32)
    batch = np.asarray(draw(seeds, positions, noise.GUMBEL, 11))
    single = np.asarray(draw(jnp.int32(3), jnp.array([4, 5, 6, 7], jnp.int32), noise.GUMBEL, 11))
    np.testing.assert_array_equal(batch[0], single[:2])
    np.testing.assert_array_equal(batch[2], single[2:])
    assert not np.array_equal(batch[0], batch[1])


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_p=0.6), SamplingParams(temperature=0.9, top_k=5, top_p=0.8)])
@pytest.mark.parametrize("vocab", [2, 1000])
def test_jit_and_eager_serve_the_same_support_without_nan(params, vocab):
    """Regression: under jit, top-p once compared a log_softmax recomputed in another XLA fusion with
    a threshold from its sorted copy, dropped every token of ~40% of rows at V = 2 and returned NaN."""
    logits = jnp.asarray(np.random.default_rng(vocab).normal(0, 3, (500, vocab)), jnp.float32)
    eager = np.asarray(served_logprobs(logits, params))
    jitted = np.asarray(jax.jit(served_logprobs, static_argnums=1)(logits, params))
    _assert_distribution(jitted)
    np.testing.assert_array_equal(np.isfinite(jitted), np.isfinite(eager))
    np.testing.assert_allclose(np.where(np.isfinite(jitted), jitted, 0), np.where(np.isfinite(eager), eager, 0), atol=1e-5)
