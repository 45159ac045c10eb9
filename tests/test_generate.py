"""Plain autoregressive generation: parity with transformers, batch invariance, stops, one compile."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

import jspec
from jspec.decode import ar
from jspec.verify.sampling import SamplingParams, served_logprobs

PROMPTS = [[5, 9, 17, 3, 44], [7, 8], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]


@pytest.fixture(scope="module")
def targets(hf_checkpoints):
    return {name: (jspec.load_target(hf_checkpoints(name)[0]), hf_checkpoints(name)[1])
            for name in ["qwen3", "llama-tied"]}


@pytest.mark.parametrize("name", ["qwen3", "llama-tied"])
def test_greedy_equals_transformers_generate(targets, name):
    target, model = targets[name]
    res = jspec.generate(target, PROMPTS, max_new_tokens=32, eos_ids=[])
    for prompt, ours in zip(PROMPTS, res.tokens):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        assert ours == ref[0, len(prompt):].tolist()
    assert res.stats["new_tokens"] == 32 * len(PROMPTS)


def test_greedy_logprobs_are_model_logprobs(targets):
    target, model = targets["qwen3"]
    prompt = PROMPTS[0]
    res = jspec.generate(target, [prompt], max_new_tokens=8, eos_ids=[])
    seq = torch.tensor([prompt + res.tokens[0]])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits, -1)[0].numpy()
    expect = [logp[len(prompt) - 1 + i, t] for i, t in enumerate(res.tokens[0])]
    np.testing.assert_allclose(res.logprobs[0], expect, atol=1e-4)


@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.7, top_k=20, top_p=0.9)])
def test_batch_invariance(targets, sampling):
    target, _ = targets["qwen3"]
    alone = jspec.generate(target, [PROMPTS[0]], max_new_tokens=24, sampling=sampling, seeds=[1234], eos_ids=[])
    batched = jspec.generate(target, [PROMPTS[2], PROMPTS[0], PROMPTS[1]], max_new_tokens=24, sampling=sampling,
                             seeds=[7, 1234, 99], eos_ids=[])
    assert batched.tokens[1] == alone.tokens[0]
    np.testing.assert_allclose(batched.logprobs[1], alone.logprobs[0], atol=1e-5)
    # And the seed matters: another seed gives another continuation.
    other = jspec.generate(target, [PROMPTS[0]], max_new_tokens=24, sampling=sampling, seeds=[1235], eos_ids=[])
    assert other.tokens[0] != alone.tokens[0]


def test_stops_at_eos_max_new_tokens_and_full_cache(targets):
    target, _ = targets["qwen3"]
    free = jspec.generate(target, PROMPTS, max_new_tokens=20, eos_ids=[])
    # Use the 6th greedy token of row 0 as EOS: row 0 stops right after emitting it.
    eos = free.tokens[0][5]
    first = free.tokens[0].index(eos)
    stopped = jspec.generate(target, PROMPTS, max_new_tokens=20, eos_ids=[eos])
    assert stopped.tokens[0] == free.tokens[0][: first + 1]
    for row in range(3):
        toks = free.tokens[row]
        cut = toks.index(eos) + 1 if eos in toks else len(toks)
        assert stopped.tokens[row] == toks[:cut]
    # max_new_tokens exactly.
    assert [len(t) for t in free.tokens] == [20, 20, 20]
    # A full cache stops a row: 32 rows with a 19-token prompt leave room for 13 new tokens.
    full = jspec.generate(target, PROMPTS, max_new_tokens=20, eos_ids=[], cache_size=32)
    assert [len(t) for t in full.tokens] == [20, 20, 13]
    assert full.tokens[2] == free.tokens[2][:13]


def test_compiles_once_per_shape(targets):
    target, _ = targets["llama-tied"]
    sampling = SamplingParams(1.0, top_k=10)
    jspec.generate(target, [[1, 2, 3], [4, 5]], max_new_tokens=8, sampling=sampling)
    before = ar.generate_ar._cache_size()
    jspec.generate(target, [[9, 9, 9, 9, 9, 9, 9], [6]], max_new_tokens=8, sampling=sampling, seeds=5)
    assert ar.generate_ar._cache_size() == before


def test_sampled_first_token_follows_served_distribution(targets):
    """Gumbel-max with keyed noise samples the served distribution (temperature, top-k, top-p).

    20,000 seeds, G-test at alpha = 1e-4 (false-failure probability 1e-4 per configuration).
    """
    target, model = targets["qwen3"]
    prompt = PROMPTS[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].numpy()
    import jax
    import jax.numpy as jnp

    for sampling in [SamplingParams(1.3), SamplingParams(0.8, top_k=5), SamplingParams(1.0, top_p=0.6)]:
        p = np.exp(np.asarray(served_logprobs(jnp.asarray(logits), sampling)), dtype=np.float64)
        n = 20_000
        seeds = jnp.arange(n, dtype=jnp.uint32)
        toks, _ = jax.jit(ar.choose_tokens, static_argnums=(3, 4))(
            jnp.broadcast_to(jnp.asarray(logits), (n, logits.size)), seeds, jnp.full((n,), len(prompt)),
            sampling, logits.size)
        counts = np.bincount(np.asarray(toks), minlength=logits.size)
        assert counts[p == 0].sum() == 0, "sampled a token the served distribution removed"
        expected = n * p / p.sum()
        big = expected >= 5  # pool rare tokens into one bin so the chi-square approximation holds
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        g, pval = stats.power_divergence(obs[exp > 0], exp[exp > 0], lambda_="log-likelihood")
        assert pval > 1e-4, (sampling, g, pval)
