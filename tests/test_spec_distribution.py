"""Speculative sampling and block verification inside the loop are exact in distribution.

The joint law of the first three generated tokens, estimated over 20,000 seeds (one batch of 20,000
rows), is G-tested against the exact joint law computed from the target by enumeration. Each test
uses a fixed seed range and alpha = 1e-3: the false-failure probability is 1e-3 per configuration.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jspec
from jspec.drafters.lm import SmallLM
from jspec.models import transformer
from jspec.models.config import ModelConfig
from jspec.verify.sampling import SamplingParams, served_logprobs

V, N_SEEDS, ALPHA = 8, 20_000, 1e-3
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
CFG = ModelConfig(family="qwen3", vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=16, qk_norm=True)
DRAFT_CFG = ModelConfig(family="llama", vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=2, num_kv_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def target():
    return jspec.Target(CFG, transformer.init_params(CFG, jax.random.key(0), std=0.4))


def exact_joint(target, sampling) -> np.ndarray:
    """P(x1, x2, x3) [V, V, V] of plain sampling from the served distribution, by enumeration."""
    seqs = np.array([PROMPT + [a, b] for a, b in itertools.product(range(V), repeat=2)])
    n, t = seqs.shape
    out = transformer.forward(target.params, CFG, jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(t), (n, t)),
                              transformer.KVCache.zeros(CFG, n, 16))
    logp = np.asarray(served_logprobs(transformer.logits(target.params, CFG, out.hidden), sampling), np.float64)
    p = np.exp(logp[:, len(PROMPT) - 1 :])  # [V*V, 3, V]: rows after the prompt, after x1, after x2
    p1 = p[0, 0]
    p2 = p[::V, 1]  # rows (a, 0): distribution after x1 = a
    p3 = p[:, 2].reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def _g_test(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = N_SEEDS * probs.ravel() / probs.sum()
    counts = counts.ravel()
    assert counts[expected == 0].sum() == 0, "sampled a sequence of probability zero"
    big = expected >= 5  # pool rare cells so the chi-square approximation holds
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return stats.power_divergence(obs[keep], exp[keep], lambda_="log-likelihood")[1]


@pytest.mark.parametrize("verifier, drafter, kw", [
    ("speculative", "small_lm", dict(block_size=2)),
    ("block", "small_lm", dict(block_size=2)),
    ("block", "small_lm", dict(block_size=3)),
    ("speculative", "lookup", dict(block_size=2)),
    ("speculative", "lookup", dict(tree_budget=4)),
])
@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.9, top_k=5)], ids=["T1", "T0.9-k5"])
def test_first_three_tokens_follow_the_target(target, verifier, drafter, kw, sampling):
    if drafter == "small_lm":
        drafter = (SmallLM(cfg=DRAFT_CFG, block_size=kw["block_size"]),
                   transformer.init_params(DRAFT_CFG, jax.random.key(1), std=0.4))
    res = jspec.generate(target, [PROMPT] * N_SEEDS, max_new_tokens=3, sampling=sampling, seeds=0, eos_ids=[],
                         cache_size=32, drafter=drafter, verifier=verifier, **kw)
    seqs = np.array(res.tokens)
    assert seqs.shape == (N_SEEDS, 3)
    counts = np.zeros((V, V, V), np.int64)
    np.add.at(counts, (seqs[:, 0], seqs[:, 1], seqs[:, 2]), 1)
    probs = exact_joint(target, sampling)
    assert _g_test(counts, probs) > ALPHA
    # The drafts were really used (some accepted, some rejected): the test exercises both branches.
    acc = res.stats["accepted_per_position"][0]
    assert 0 < acc < res.stats["rounds"]
