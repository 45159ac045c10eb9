"""Hybrid (Gated DeltaNet) targets in the compiled loops: exact output and exact recurrent-state commit."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from hybrid_helpers import checkpoint
from jspec.decode import ar, spec
from jspec.drafters.base import Drafter, Proposal
from jspec.verify.sampling import SamplingParams

PROMPTS = [[5, 9, 17, 3, 44, 5, 9, 17, 3], [7, 8, 7, 8, 7, 8], [11, 12, 13, 14, 15, 16, 11, 12, 13, 14, 15]]
NEW = 16


_TARGETS: dict = {}


def _target(family):
    if family not in _TARGETS:
        _TARGETS[family] = jspec.load_target(checkpoint(family)[0])
    return _TARGETS[family]


@pytest.fixture(scope="module")
def small_lm_dir(tmp_path_factory):
    from conftest import make_hf_model

    path = tmp_path_factory.mktemp("small_lm")
    make_hf_model("qwen3", seed=7, layers=1).save_pretrained(path)
    return str(path)


def _args(target, prompts=PROMPTS):
    packed, lens = jspec.api.pack_prompts(prompts, target.cfg.vocab_size)
    return jnp.asarray(packed), jnp.asarray(lens), jnp.arange(3, 3 + len(prompts), dtype=jnp.uint32)


@dataclasses.dataclass(frozen=True)
class Replay(Drafter):
    """Test drafter: proposes a known continuation (dparams = the reference text [B, S]); draft i is
    corrupted when (its index + i) % `wrong_every` == 0, so rounds accept 0 .. g drafts."""

    block_size: int = 4
    wrong_every: int = 0
    vocab: int = 128

    @property
    def num_drafts(self):
        return self.block_size

    def propose(self, ref, state, ctx):
        idx = ctx.length[:, None] + jnp.arange(self.block_size)[None]
        drafts = jnp.take_along_axis(ref, jnp.minimum(idx, ref.shape[1] - 1), axis=1)
        if self.wrong_every:
            drafts = jnp.where((idx + jnp.arange(self.block_size)) % self.wrong_every == 0, (drafts + 1) % self.vocab,
                               drafts)
        return Proposal(drafts), state


def _plain(target, sampling, eos=()):
    dcfg = ar.DecodeConfig(max_new_tokens=NEW, cache_size=48, sampling=sampling, eos_ids=eos)
    return dcfg, ar.generate_ar(target.params, target.cfg, dcfg, *_args(target))


def _assert_same_state(a, b, length):
    """Recurrent state and committed K/V rows of two loop results, per row."""
    np.testing.assert_allclose(np.asarray(a.cache.ssm), np.asarray(b.cache.ssm), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(a.cache.conv), np.asarray(b.cache.conv), atol=2e-5, rtol=1e-4)
    for row, n in enumerate(np.asarray(length)):
        np.testing.assert_allclose(np.asarray(a.cache.k)[:, row, :, : n - 1], np.asarray(b.cache.k)[:, row, :, : n - 1],
                                   atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family, sampling, verifier, drafter_kind, kw", [
    ("qwen3_next", SamplingParams(0.0), "greedy", "lookup", dict(block_size=3)),
    ("qwen3_next", SamplingParams(1.0), "gumbel", "small_lm", dict(block_size=2)),
    ("qwen3_5", SamplingParams(1.0), "gumbel", "lookup", dict(tree_budget=5)),
    ("qwen3_5", SamplingParams(0.0), "greedy", "small_lm", dict(block_size=2)),
])
def test_equals_plain_decoding(small_lm_dir, family, sampling, verifier, drafter_kind, kw):
    target = _target(family)
    kwargs = dict(max_new_tokens=NEW, sampling=sampling, seeds=[1, 2, 3], eos_ids=[])
    base = jspec.generate(target, PROMPTS, **kwargs)
    drafter = small_lm_dir if drafter_kind == "small_lm" else drafter_kind
    res = jspec.generate(target, PROMPTS, drafter=drafter, verifier=verifier, **kw, **kwargs)
    assert res.tokens == base.tokens


@pytest.mark.parametrize("family, block_size, wrong_every", [
    ("qwen3_next", 4, 3), ("qwen3_next", 1, 2), ("qwen3_5", 8, 5), ("qwen3_5", 4, 0)])
def test_partial_accepts_commit_the_exact_state(family, block_size, wrong_every):
    """Rounds accepting 0 .. g drafts (and all + bonus when wrong_every = 0) leave exactly the state of
    plain decoding of the same text."""
    target = _target(family)
    sampling = SamplingParams(0.0)
    dcfg, plain = _plain(target, sampling)
    drafter = Replay(block_size=block_size, wrong_every=wrong_every, vocab=target.cfg.vocab_size)
    st = spec.generate_spec(target.params, plain.tokens, target.cfg, drafter, spec.SpecConfig(dcfg, "greedy"),
                            *_args(target))
    np.testing.assert_array_equal(np.asarray(st.core.tokens), np.asarray(plain.tokens))
    hist = np.asarray(st.stats.hist).sum(0)
    if wrong_every:
        assert hist[0] > 0 and hist[1:].sum() > 0, hist  # rejections and partial accepts both happened
    else:  # every round accepts all g drafts plus the bonus, except where max_new_tokens cuts the last
        assert hist[block_size] == hist.sum(), hist
    _assert_same_state(st.core, plain, plain.length)


def test_tree_commit_continues_from_the_accepted_node():
    target = _target("qwen3_next")
    sampling = SamplingParams(1.0)
    dcfg, plain = _plain(target, sampling)
    drafter, _ = jspec.load_drafter("lookup", target, tree_budget=6)
    st = spec.generate_spec(target.params, (), target.cfg, drafter, spec.SpecConfig(dcfg, "gumbel"), *_args(target))
    np.testing.assert_array_equal(np.asarray(st.core.tokens), np.asarray(plain.tokens))
    _assert_same_state(st.core, plain, plain.length)


def test_eos_mid_block_and_rows_finishing_early():
    target = _target("qwen3_5")
    sampling = SamplingParams(0.0)
    _, free = _plain(target, sampling)
    lens = np.asarray(_args(target)[1])
    eos = int(np.asarray(free.tokens)[0, lens[0] + 5])  # row 0's 6th new token
    dcfg, plain = _plain(target, sampling, eos=(eos,))
    st = spec.generate_spec(target.params, free.tokens, target.cfg, Replay(block_size=4, vocab=target.cfg.vocab_size),
                            spec.SpecConfig(dcfg, "greedy"), *_args(target))
    np.testing.assert_array_equal(np.asarray(st.core.length), np.asarray(plain.length))
    assert int(plain.length[0]) - lens[0] <= 6  # row 0 stopped at the EOS, inside a block of 4
    np.testing.assert_array_equal(np.asarray(st.core.tokens), np.asarray(plain.tokens))
    _assert_same_state(st.core, plain, plain.length)


@pytest.mark.parametrize("family, tree_budget", [("qwen3_next", 0), ("qwen3_5", 5)])
def test_dflash_drafter_on_a_hybrid_target(family, tree_budget):
    """DFlash reads the hybrid target's taps and LM head; greedy and Gumbel output stay exact."""
    import jax

    from jspec.drafters.dflash import DFlash, DFlashConfig, init_params
    from jspec.models.config import ModelConfig

    target = _target(family)
    c = target.cfg
    layers = ModelConfig(family="qwen3", vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=64,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)
    cfg = DFlashConfig(layers=layers, target_layer_ids=(0, 2), num_target_layers=c.num_layers, mask_token_id=0,
                       block_size=4)
    drafter = (DFlash(cfg=cfg, tree_budget=tree_budget), init_params(cfg, jax.random.key(0), std=0.3))
    for sampling, verifier in [(SamplingParams(0.0), "greedy"), (SamplingParams(1.0), "gumbel")]:
        kwargs = dict(max_new_tokens=NEW, sampling=sampling, seeds=[1, 2, 3], eos_ids=[])
        base = jspec.generate(target, PROMPTS, **kwargs)
        assert jspec.generate(target, PROMPTS, drafter=drafter, verifier=verifier, **kwargs).tokens == base.tokens


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_a_hybrid_checkpoint_drafts_for_itself(family):
    """The target's own checkpoint as a small-LM drafter (its recurrent state caught up on the committed
    tokens each round): exact output, and every round accepts all g drafts (tau = g + 1, less only where
    max_new_tokens cuts the last round)."""
    target = _target(family)
    g = 3
    for sampling, verifier in [(SamplingParams(0.0), "greedy"), (SamplingParams(1.0), "gumbel")]:
        kwargs = dict(max_new_tokens=NEW, sampling=sampling, seeds=[1, 2, 3], eos_ids=[])
        base = jspec.generate(target, PROMPTS, **kwargs)
        res = jspec.generate(target, PROMPTS, drafter=checkpoint(family)[0], verifier=verifier, block_size=g, **kwargs)
        assert res.tokens == base.tokens
        hist = np.asarray(res.stats["accept_hist"])
        assert hist[g] >= res.stats["rounds"] - len(PROMPTS), hist  # at most one short round per row
        assert res.stats["tau"] > g


def test_drafters_train_and_budget_on_a_hybrid_target(tmp_path):
    """Drafter training (two optimizer steps of the DSpark recipe: the target pass runs on the hybrid
    target) and the profiled verify budget, on a Qwen3-Next target."""
    import jax

    from jspec.drafters import family
    from jspec.train import distill
    from jspec.train.drafter import DrafterLoss
    from jspec.train.trainer import TrainConfig, Trainer

    target = _target("qwen3_next")
    run = {"drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 0, "num_taps": 2, "markov_rank": 8},
           "train": {"seed": 0}}
    dr, params = distill.build_drafter("dspark", run, target)
    recipe = family.get_family("dspark").recipe
    frozen = {k: params[k] for k in recipe.frozen}
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 1, target.cfg.vocab_size)
    batches = [{"tokens": tokens, "loss_mask": jnp.ones_like(tokens)}] * 2

    def loss(p, batch):
        return recipe.loss({**p, **frozen}, target.params, target.cfg, dr, DrafterLoss(num_anchors=4), batch,
                           jax.random.key(2))

    trainable = {k: v for k, v in params.items() if k not in frozen}
    start = jax.tree_util.tree_map(np.array, trainable)  # the trainer donates its parameters
    trainer = Trainer(loss, trainable,
                      TrainConfig(steps=2, lr=1e-2, warmup_frac=0.0, ckpt_every=2, keep=1, log_every=1),
                      str(tmp_path), fingerprint={"test": "hybrid"})
    state = trainer.run(batches, steps=2, progress=False)
    moved = jax.tree_util.tree_map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.params, start)
    assert max(jax.tree_util.tree_leaves(moved)) > 0  # the optimizer changed the drafter
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(state.params))
    kwargs = dict(max_new_tokens=NEW, sampling=SamplingParams(1.0), seeds=[1, 2, 3], eos_ids=[])
    base = jspec.generate(target, PROMPTS, **kwargs)
    res = jspec.generate(target, PROMPTS, drafter=(dr, {**state.params, **frozen}), verify_budget="profile",
                         **kwargs)
    assert res.tokens == base.tokens
