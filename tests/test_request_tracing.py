"""Request settings are traced inputs of the compiled loops: changing max_new_tokens, the temperature, top-k
or top-p between calls reuses the compiled program, and each value still takes effect exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.decode import ar, spec
from jspec.models import transformer
from jspec.models.config import ModelConfig
from jspec.verify.sampling import SamplingParams, served_logprobs

CFG = ModelConfig(family="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, qk_norm=True)
PROMPTS = [[5, 9, 17, 3, 44, 5, 9], [7, 8, 7, 8, 7, 8]]


@pytest.fixture(scope="module")
def target():
    return jspec.Target(CFG, transformer.init_params(CFG, jax.random.key(0), std=0.3))


def _both(target, n, sampling):
    kw = dict(max_new_tokens=n, sampling=sampling, seeds=[1, 2], cache_size=64, eos_ids=[])
    return jspec.generate(target, PROMPTS, **kw), jspec.generate(target, PROMPTS, drafter="lookup", block_size=3, **kw)


def test_changing_request_settings_does_not_recompile(target):
    _both(target, 8, SamplingParams(0.7, top_p=0.9))  # compiles the sampled AR and speculative loops once
    compiled = ar.generate_ar._cache_size(), spec.generate_spec._cache_size()
    greedy, _ = _both(target, 20, SamplingParams(0.0))  # greedy is a different program: compiled here
    compiled = compiled[0] + 1, compiled[1] + 1
    for n, sampling in [(12, SamplingParams(1.3)), (3, SamplingParams(0.5, top_k=5, top_p=0.8)),
                        (20, SamplingParams(1.0, top_k=1)), (20, SamplingParams(2.0, top_p=1e-4)),
                        (17, SamplingParams(0.9, top_k=40, top_p=0.95))]:
        plain, fast = _both(target, n, sampling)
        assert fast.tokens == plain.tokens  # Gumbel coupling: plain decoding's tokens, whatever the values
        assert [len(t) for t in plain.tokens] == [n, n]
        if sampling.top_k == 1 or sampling.top_p < 1e-3:  # a point mass on the argmax: greedy's text
            assert plain.tokens == [t[:n] for t in greedy.tokens]
    assert (ar.generate_ar._cache_size(), spec.generate_spec._cache_size()) == compiled


@pytest.mark.parametrize("sampling", [SamplingParams(0.8), SamplingParams(1.0, top_k=7), SamplingParams(0.6, top_p=0.7),
                                      SamplingParams(1.4, top_k=20, top_p=0.5), SamplingParams(1.0, top_k=1)])
def test_traced_values_serve_the_same_distribution(sampling):
    """One jitted function with the values as arguments gives, bit for bit, what the eager call gives."""
    logits = 3.0 * jax.random.normal(jax.random.key(3), (4, 5, CFG.vocab_size))
    traced = jax.jit(served_logprobs)(logits, sampling.traced())
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(served_logprobs(logits, sampling)))
    kept = np.isfinite(np.asarray(traced)).sum(-1)
    if sampling.top_k and sampling.top_p == 1.0:  # top-k alone keeps k tokens (no ties in random logits)
        assert (kept == sampling.top_k).all()
    np.testing.assert_allclose(np.exp(np.asarray(traced)).sum(-1), 1.0, rtol=1e-5)


def test_one_compilation_serves_every_value():
    fn = jax.jit(lambda x, s: served_logprobs(x, s))  # a function of its own: a cache of its own
    logits = jnp.zeros((2, CFG.vocab_size)).at[:, 3].set(1.0)
    for s in (SamplingParams(0.5), SamplingParams(1.0, top_k=3), SamplingParams(2.0, top_p=0.3)):
        fn(logits, s.traced())
    assert fn._cache_size() == 1
