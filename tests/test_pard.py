"""PARD drafter (jspec.drafters.pard): its k drafts and q are the last k rows of one evaluation of the LM
on [committed text, k - 1 placeholders], round after round (no placeholder K/V leaks into later rounds);
checkpoints detect as "pard" only with `pard_token`. Decoding equalities run in tests/test_conformance.py."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.drafters import family, lm, pard
from jspec.drafters.base import DraftContext, PrefillInfo
from jspec.models import target as tm
from jspec.models import transformer
from jspec.models.config import ModelConfig
from jspec.verify.rules import GREEDY, SAMPLE
from jspec.verify.sampling import SamplingParams, served_logprobs

CFG = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, qk_norm=True)
K, CACHE, S = 4, 64, 48
M = CFG.vocab_size - 1  # the placeholder id


@pytest.fixture(scope="module")
def params():
    return transformer.init_params(CFG, jax.random.key(1), std=0.3)


def _direct(params, text, sampling):
    """Served log-probs [K, V] of the last K rows of a fresh evaluation on text + [M] * (K - 1)."""
    toks = jnp.asarray([list(text) + [M] * (K - 1)], jnp.int32)
    pos = jnp.arange(toks.shape[1], dtype=jnp.int32)[None]
    hidden, _, _, _ = tm.forward(params, CFG, toks, pos, tm.init_cache(CFG, 1, CACHE))
    return served_logprobs(tm.logits(params, CFG, hidden[0, -K:]), sampling)


@pytest.mark.parametrize("policy", [GREEDY, SAMPLE])
def test_drafts_and_q_are_a_fresh_evaluation_every_round(params, policy):
    drafter = pard.PARD(cfg=CFG, block_size=K, pard_token=M)
    drafter.validate(CFG, params)
    sampling = SamplingParams(0.0) if policy == GREEDY else SamplingParams(1.0)
    rng = np.random.default_rng(0)
    prompt_len = np.array([5, 9])
    text = rng.integers(0, M, size=(2, S)).astype(np.int32)  # committed text, revealed up to `length`
    prompts = jnp.asarray(np.where(np.arange(9)[None] < prompt_len[:, None], text[:, :9], 0), jnp.int32)
    state = drafter.init(params, PrefillInfo(prompts, jnp.asarray(prompt_len, jnp.int32), None), CACHE)
    length = prompt_len.copy()
    propose = jax.jit(drafter.propose)
    for _ in range(5):
        ctx = DraftContext(jnp.asarray(text), jnp.asarray(length, jnp.int32), jnp.asarray([3, 4]), None,
                           target_cfg=CFG, policy=policy, sampling=sampling)
        proposal, state = propose(params, state, ctx)
        for b in range(2):
            want = _direct(params, text[b, :length[b]], ctx.sampling)
            if policy == GREEDY:
                np.testing.assert_array_equal(np.asarray(proposal.tokens[b]), np.argmax(np.asarray(want), -1))
            else:
                np.testing.assert_allclose(np.exp(np.asarray(proposal.q_logp[b])), np.exp(np.asarray(want)),
                                           atol=1e-5)
        # Commit the old anchor and 0 .. K accepted tokens per row (the drafter reads only the text).
        length = length + rng.integers(1, K + 2, size=2)


def test_detection_and_round_trip(params, tmp_path):
    drafter = pard.PARD(cfg=CFG, block_size=K, pard_token=M)
    path = str(tmp_path / "pard")
    pard.save(path, drafter, params)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    assert hf["pard_token"] == M and family.detect(path) is family.get_family("pard")
    loaded, loaded_params = pard.load(path, None, jnp.float32)
    assert loaded.pard_token == M and loaded.cfg == CFG
    flat, flat2 = jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(loaded_params)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(flat, flat2))

    plain = str(tmp_path / "plain")  # a plain causal LM stays the small-LM family
    lm.save(plain, lm.SmallLM(cfg=CFG), params)
    assert family.detect(plain) is family.get_family("lm")

    hf["pard_token"] = CFG.vocab_size  # outside the vocabulary: refused, naming the key
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    with pytest.raises(ValueError, match="pard_token"):
        pard.load(path, None, jnp.float32)


def test_refuses_trees_and_bad_placeholder(params):
    drafter = pard.PARD(cfg=CFG, block_size=K, pard_token=M)
    with pytest.raises(ValueError, match="chains"):
        pard.with_shape(drafter, 3, 5)
    with pytest.raises(ValueError, match="pard_token"):
        pard.PARD(cfg=CFG, pard_token=-1).validate(CFG, params)
    assert not pard.detect({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "pard_token": True})
