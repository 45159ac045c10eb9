"""The DFlash drafter with `kernels="pallas"` (fused draft layers, interpreted on CPU): the same greedy
drafts as the reference drafter, and a speculative loop that stays exact (Gumbel, T = 1)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.api import Target
from jspec.drafters.base import DraftContext, PrefillInfo
from jspec.drafters.dflash import DFlash, DFlashConfig, draft_block
from jspec.drafters.dflash import init_params as dflash_init
from jspec.kernels import resolve
from jspec.models import transformer
from jspec.models.config import ModelConfig
from jspec.verify.sampling import SamplingParams

PROMPTS = [[5, 9, 17, 3, 44, 5, 9, 17, 3], [7, 8, 7, 8, 7, 8], [11, 12, 13, 14, 15, 16, 11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def setup():
    """A random 4-layer Qwen3 target and a 2-layer DFlash drafter (one sliding layer, W = 6), block 8."""
    cfg = ModelConfig(family="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, tie_word_embeddings=True)
    target = Target(cfg=cfg, params=transformer.init_params(cfg, jax.random.key(0), std=0.3))
    layers = dataclasses.replace(cfg, num_layers=2, layer_types=("sliding_attention", "full_attention"),
                                 sliding_window=6)
    dcfg = DFlashConfig(layers=layers, target_layer_ids=(0, 2), num_target_layers=4, mask_token_id=127, block_size=8)
    return target, dcfg, dflash_init(dcfg, jax.random.key(1), std=0.3)


def test_pallas_drafter_proposes_the_reference_drafts(setup):
    target, dcfg, dparams = setup
    packed, lens = jspec.api.pack_prompts(PROMPTS, 128)
    prompts, lens = jnp.asarray(packed), jnp.asarray(lens)
    b, p = prompts.shape
    reference = DFlash(cfg=dcfg)
    out = transformer.forward(target.params, target.cfg, prompts, jnp.broadcast_to(jnp.arange(p), (b, p)),
                              transformer.KVCache.zeros(target.cfg, b, 40), taps=reference.taps)
    state = reference.init(dparams, PrefillInfo(prompts, lens, out.taps), 40)
    tokens = jnp.zeros((b, 40), jnp.int32).at[:, :p].set(prompts).at[jnp.arange(b), lens].set(jnp.array([4, 50, 99]))
    ctx = DraftContext(tokens, lens + 1, jnp.zeros((b,), jnp.uint32), target.params, target_cfg=target.cfg)

    def draft(dr):
        return jax.jit(lambda: (dr.logits(dparams, state, ctx), dr.propose(dparams, state, ctx)[0].tokens))()

    want_logits, want = draft(reference)
    got_logits, got = draft(dataclasses.replace(reference, kernels="pallas"))
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_loop_with_pallas_drafter_equals_plain_decoding(setup):
    target, dcfg, dparams = setup
    kw = dict(max_new_tokens=16, sampling=SamplingParams(1.0), seeds=[1, 2, 3], eos_ids=[])
    base = jspec.generate(target, PROMPTS, **kw)
    drafter = DFlash(cfg=dcfg, kernels="pallas")
    res = jspec.generate(target, PROMPTS, drafter=(drafter, dparams), verifier="gumbel", **kw)
    assert res.tokens == base.tokens
    assert res.stats["rounds"] < sum(len(t) for t in base.tokens)  # drafts were accepted: the drafter ran


def test_kernel_flag_resolution(setup):
    assert [resolve("auto", backend) for backend in ("cpu", "gpu", "tpu")] == ["reference", "reference", "pallas"]
    assert [resolve("auto", backend, q4=True) for backend in ("cpu", "gpu", "tpu")] == ["reference", "pallas", "pallas"]
    assert resolve("pallas", "cpu") == "pallas" and resolve("reference", "tpu") == "reference"
    _, dcfg, dparams = setup
    ctx = jnp.zeros((2, 1, 16, 32))
    with pytest.raises(ValueError, match="unknown kernels setting 'fast'"):
        draft_block(dparams, dcfg, jnp.zeros((128, 64)), ctx, ctx, jnp.array([1]), jnp.array([3]), kernels="fast")


def test_tree_verify_with_the_attention_kernel_equals_plain_decoding(setup):
    target = setup[0]
    kw = dict(max_new_tokens=12, sampling=SamplingParams(1.0), seeds=[1, 2, 3], eos_ids=[])
    base = jspec.generate(target, PROMPTS, **kw)
    res = jspec.generate(target, PROMPTS, drafter="lookup", tree_budget=6, verifier="gumbel", kernels="pallas", **kw)
    assert res.tokens == base.tokens


def test_chain_verify_with_the_attention_kernel_equals_plain_decoding(setup):
    target = setup[0]
    kw = dict(max_new_tokens=12, sampling=SamplingParams(1.0), seeds=[1, 2, 3], eos_ids=[])
    base = jspec.generate(target, PROMPTS, **kw)
    res = jspec.generate(target, PROMPTS, drafter="lookup", verifier="gumbel", kernels="pallas", **kw)
    assert res.tokens == base.tokens
    assert res.stats["rounds"] < sum(len(t) for t in base.tokens)  # drafts were accepted


def test_plain_decoding_with_the_attention_kernel_equals_the_reference(setup):
    target = setup[0]
    kw = dict(max_new_tokens=12, sampling=SamplingParams(1.0), seeds=[1, 2, 3], eos_ids=[])
    assert jspec.generate(target, PROMPTS, kernels="pallas", **kw).tokens == jspec.generate(target, PROMPTS, **kw).tokens
