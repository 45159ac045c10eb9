"""PARD drafter (jspec.drafters.pard): its k drafts and q are the last k rows of one evaluation of the LM
on [committed text, k - 1 placeholders], round after round (no placeholder K/V leaks into later rounds);
checkpoints detect as "pard" only with `pard_token`; the training pass (every anchor's round at once, with
conditional drop-token) gives each kept row that same evaluation. Decoding equalities run in
tests/test_conformance.py."""

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


# --- training ------------------------------------------------------------------------------------------------


def test_training_rows_are_each_rounds_evaluation(params):
    """Every kept row (a, d) of the training pass, under a random conditional drop-token keep, equals row d of a
    fresh evaluation on x_0 .. x_a + [M] * (K - 1): what the drafter serves in the round anchored at x_a."""
    drafter = pard.PARD(cfg=CFG, block_size=K, pard_token=M)
    t = 12
    tokens = jax.random.randint(jax.random.key(2), (2, t), 0, M)
    keep = pard.sample_keep(jax.random.key(3), 2, t, depths=K)
    got = np.asarray(jax.jit(pard.train_logp, static_argnums=1)(params, drafter, tokens, keep))  # [B, T, K, V]
    keep = np.asarray(keep)
    assert 0 < keep[K - 1].sum() < keep[1].sum() < 2 * t  # some rows dropped at each depth
    checked = 0
    for b in range(2):
        for a in range(t):
            want = np.asarray(_direct(params, np.asarray(tokens[b, :a + 1]), SamplingParams(1.0)))
            for d in range(K):
                if keep[d, b, a]:
                    np.testing.assert_allclose(got[b, a, d], want[d], atol=2e-5, err_msg=f"row {b} anchor {a} depth {d}")
                    checked += 1
    assert checked == keep.sum()


def test_the_training_recipe(params):
    """`jspec train pard`'s build reads the run config's drafter section; its loss (default CE) has a finite value
    and a gradient for every parameter; a rollout loss and a missing or bad placeholder are refused by name."""
    import jspec
    from jspec.train.distill import drafter_loss

    target = jspec.Target(CFG, params)
    fam = family.get_family("pard")
    run = {"drafter": {"pard_token": M, "block_size": 3, "num_layers": 1, "hidden_size": 16, "intermediate_size": 32,
                       "head_dim": 4}, "init_std": 0.2}
    drafter, dparams = fam.recipe.build(run, target, jax.random.key(0))
    drafter.validate(CFG, dparams)
    assert (drafter.block_size, drafter.cfg.num_layers, drafter.cfg.hidden_size) == (3, 1, 16)
    tokens = jax.random.randint(jax.random.key(4), (2, 16), 0, M)
    batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens).at[:, :4].set(0)}
    spec = drafter_loss({}, own=None)
    (value, metrics), grads = jax.jit(jax.value_and_grad(
        lambda p: fam.recipe.loss(p, params, CFG, drafter, spec, batch, jax.random.key(5)), has_aux=True))(dparams)
    assert np.isfinite(float(value)) and 0 <= float(metrics["acc"]) <= 1
    assert set(grads) == set(dparams)
    for g in jax.tree_util.tree_leaves(grads):
        assert np.isfinite(np.asarray(g)).all()
    with pytest.raises(ValueError, match="rollout loss 'edr'"):
        fam.recipe.loss(dparams, params, CFG, drafter, drafter_loss({"loss": "edr"}, own=None), batch, jax.random.key(5))
    with pytest.raises(ValueError, match="pard_token 64 must be a token id"):
        fam.recipe.build({"drafter": {"pard_token": 64}}, target, jax.random.key(0))
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        fam.recipe.build({"drafter": {"pard_token": M, "block_size": 1}}, target, jax.random.key(0))
