"""Request settings are traced inputs of the compiled loops: changing max_new_tokens, the temperature, top-k
or top-p between calls reuses the compiled program, and each value still takes effect exactly. What is
static: greedy decoding, and whether the top-k and top-p stages are on at all (a stage that is off is
not in the program)."""

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


def _compiled():
    return ar.generate_ar._cache_size(), spec.generate_spec._cache_size()


def test_changing_request_settings_does_not_recompile(target):
    greedy, _ = _both(target, 20, SamplingParams(0.0))
    stages = [SamplingParams(0.7), SamplingParams(0.7, top_k=3), SamplingParams(0.7, top_p=0.9),
              SamplingParams(0.7, top_k=3, top_p=0.9)]  # every combination of the static stage flags
    for sampling in stages:
        before = _compiled()
        _both(target, 8, sampling)
        assert _compiled() == (before[0] + 1, before[1] + 1)  # one program per loop and stage combination
    compiled = _compiled()
    for n, sampling in [(12, SamplingParams(1.3)), (3, SamplingParams(0.5, top_k=5, top_p=0.8)),
                        (20, SamplingParams(1.0, top_k=1)), (20, SamplingParams(2.0, top_p=1e-4)),
                        (17, SamplingParams(0.9, top_k=40, top_p=0.95)), (9, SamplingParams(1.0, top_k=500))]:
        plain, fast = _both(target, n, sampling)
        assert fast.tokens == plain.tokens  # Gumbel coupling: plain decoding's tokens, whatever the values
        assert [len(t) for t in plain.tokens] == [n, n]
        if sampling.top_k == 1 or sampling.top_p < 1e-3:  # a point mass on the argmax: greedy's text
            assert plain.tokens == [t[:n] for t in greedy.tokens]
    assert _compiled() == compiled
    # top-k >= the vocabulary keeps every token: the same text as the request without top-k
    assert _both(target, 9, SamplingParams(1.0, top_k=500))[0].tokens == _both(target, 9, SamplingParams(1.0))[0].tokens


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
    for s in (SamplingParams(0.5, top_k=3, top_p=0.3), SamplingParams(1.0, top_k=90, top_p=0.99),
              SamplingParams(2.0, top_k=CFG.vocab_size + 1, top_p=0.5)):
        fn(logits, s.traced())
    assert fn._cache_size() == 1
    for s in (SamplingParams(0.5), SamplingParams(1.0, top_k=3), SamplingParams(2.0, top_p=0.3)):
        fn(logits, s.traced())  # each combination of stages is a program of its own
    assert fn._cache_size() == 4


def test_stages_that_are_off_are_not_in_the_program():
    logits = jnp.zeros((2, CFG.vocab_size))
    # The optimized program, not the lowered one: a platform choice (`lax.platform_dependent`) lowers to a case on
    # a constant index, which the compiler resolves; what must not survive is a conditional decided at run time.
    text = {name: jax.jit(served_logprobs).lower(logits, s.traced()).compile().as_text() for name, s in
            {"none": SamplingParams(1.0), "top-k": SamplingParams(1.0, top_k=3), "top-p": SamplingParams(1.0, top_p=0.5),
             "both": SamplingParams(1.0, top_k=3, top_p=0.5)}.items()}
    searches = {name: t.count(" while(") for name, t in text.items()}  # one threshold search per stage
    assert searches == {"none": 0, "top-k": 1, "top-p": 1, "both": 2}
    assert not any("conditional(" in t for t in text.values())  # no conditional around a stage


def test_flags_on_with_values_off_serve_the_plain_distribution():
    """A program with both stages compiled in, run with top_k 0 and top_p 1, serves log_softmax(logits / T)."""
    from jspec.verify.sampling import Served

    logits = 3.0 * jax.random.normal(jax.random.key(5), (3, CFG.vocab_size))
    served = Served(np.float32(0.7), np.int32(0), np.float32(1.0), False, top_k_on=True, top_p_on=True)
    np.testing.assert_array_equal(np.asarray(jax.jit(served_logprobs)(logits, served)),
                                  np.asarray(served_logprobs(logits, SamplingParams(0.7))))
