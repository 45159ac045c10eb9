"""DFlash / DSpark drafters and DDTree trees: semantics, checkpoints, exactness in the loop, errors."""

from __future__ import annotations

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from scipy import stats

import jspec
from jspec.cli import main as cli_main
from jspec.decode import ar, profile, spec
from jspec.drafters import ddtree
from jspec.drafters.base import SAMPLE, DraftContext, PrefillInfo
from jspec.drafters.dflash import (
    DFlash,
    DFlashConfig,
    DFlashState,
    context_kv,
    default_target_layer_ids,
    draft_block,
    write_context,
)
from jspec.drafters.dflash import init_params as dflash_init
from jspec.drafters.dspark import DSpark, DSparkConfig
from jspec.drafters.dspark import init_params as dspark_init
from jspec.drafters.dflash import load_checkpoint as load_dflash
from jspec.drafters.dflash import save_checkpoint as save_dflash
from jspec.drafters.dspark import load_checkpoint as load_dspark
from jspec.drafters.dspark import save_checkpoint as save_dspark
from jspec.io.hf import CheckpointError
from jspec.models import transformer
from jspec.verify.sampling import SamplingParams

PROMPTS = [[5, 9, 17, 3, 44, 5, 9, 17, 3], [7, 8, 7, 8, 7, 8], [11, 12, 13, 14, 15, 16, 11, 12, 13, 14, 15]]
NEW = 20


@pytest.fixture(scope="module")
def target(hf_checkpoints, tmp_path_factory):
    from conftest import make_hf_model

    path = tmp_path_factory.mktemp("target4")
    make_hf_model("qwen3", layers=4, seed=11).save_pretrained(path)
    return jspec.load_target(str(path))


def _dflash_cfg(target, block=5, anchor_predicts=False, layers=2, sliding=None):
    lc = dataclasses.replace(target.cfg, num_layers=layers)
    if sliding:
        lc = dataclasses.replace(lc, layer_types=("sliding_attention",) * layers, sliding_window=sliding)
    return DFlashConfig(layers=lc, target_layer_ids=(0, 2), num_target_layers=4, mask_token_id=127,
                        block_size=block, anchor_predicts=anchor_predicts)


def _spark_cfg(target, head="vanilla"):
    return DSparkConfig(backbone=_dflash_cfg(target, anchor_predicts=True), markov_rank=8, markov_head_type=head)


def test_default_tap_ids():
    assert default_target_layer_ids(5, 36) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(1, 36) == (18,)


# --- semantics on random weights -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def block_setup(target):
    """A context of 12 committed positions for one row, projected into a DFlash context cache."""
    cfg = _dflash_cfg(target, block=5, layers=1, sliding=4)
    params = dflash_init(cfg, jax.random.key(3), std=0.3)
    taps = jax.random.normal(jax.random.key(4), (2, 1, 16, target.cfg.hidden_size))
    state = DFlashState.zeros(cfg, 1, 24, jnp.float32)
    state = write_context(params, cfg, state, taps, jnp.zeros((1,), jnp.int32), jnp.ones((1, 16), bool))
    return cfg, params, taps, state


def _hidden(target, block_setup, state, anchor_pos=12, block_tokens=None):
    cfg, params, _, _ = block_setup
    return np.asarray(draft_block(params, cfg, target.params["embed"], state.k, state.v, jnp.array([5]),
                                  jnp.array([anchor_pos]), block_tokens))


def _with_feature(block_setup, position, value):
    cfg, params, taps, state = block_setup
    taps = taps.at[:, :, position].set(value)
    return write_context(params, cfg, state, taps, jnp.zeros((1,), jnp.int32), jnp.ones((1, 16), bool))


def test_draft_depends_only_on_context_before_the_anchor(target, block_setup):
    base = _hidden(target, block_setup, block_setup[3])
    # A committed feature before the anchor (inside every slot's window) changes the draft.
    assert np.abs(_hidden(target, block_setup, _with_feature(block_setup, 11, 3.0)) - base).max() > 1e-3
    # Features at or after the anchor (rejected rows, the anchor's own row, later junk) change nothing,
    # even NaN: they are masked and zeroed.
    for p in (12, 13, 15):
        np.testing.assert_array_equal(_hidden(target, block_setup, _with_feature(block_setup, p, jnp.nan)), base)


def test_block_attention_is_bidirectional(target, block_setup):
    cfg = block_setup[0]
    toks = jnp.array([[5] + [cfg.mask_token_id] * 4])
    base = _hidden(target, block_setup, block_setup[3], block_tokens=toks)
    changed = _hidden(target, block_setup, block_setup[3], block_tokens=toks.at[0, 3].set(40))
    assert np.abs(changed[0, 1] - base[0, 1]).max() > 1e-4  # slot 1 sees slot 3


def test_sliding_window_boundary_is_exact(target, block_setup):
    """One sliding layer, W = 4, anchor 12: context key j is visible to slot i iff j >= 12 + i - 3."""
    base = _hidden(target, block_setup, block_setup[3])
    for i in range(3):  # slots whose window edge lies before the anchor
        outside = _hidden(target, block_setup, _with_feature(block_setup, 12 + i - 4, 5.0))
        inside = _hidden(target, block_setup, _with_feature(block_setup, 12 + i - 3, 5.0))
        np.testing.assert_array_equal(outside[0, i], base[0, i])
        assert np.abs(inside[0, i] - base[0, i]).max() > 1e-4
        if i:
            assert np.abs(outside[0, i - 1] - base[0, i - 1]).max() > 1e-4  # the earlier slot still sees it


@pytest.mark.parametrize("anchor_predicts, drafts", [(False, 4), (True, 5)])
def test_block_conventions_give_their_number_of_drafts(target, anchor_predicts, drafts):
    cfg = _dflash_cfg(target, block=5, anchor_predicts=anchor_predicts)
    assert cfg.num_drafts == drafts
    params = dflash_init(cfg, jax.random.key(0))
    dr = DFlash(cfg=cfg)
    packed, lens = jspec.api.pack_prompts(PROMPTS, 128)
    prompts = jnp.asarray(packed)
    out = transformer.forward(target.params, target.cfg, prompts, jnp.broadcast_to(jnp.arange(16), (3, 16)),
                              transformer.KVCache.zeros(target.cfg, 3, 32), taps=dr.taps)
    state = dr.init(params, PrefillInfo(prompts, jnp.asarray(lens), out.taps), 40)
    tokens = jnp.zeros((3, 32), jnp.int32).at[:, :16].set(prompts)
    ctx = DraftContext(tokens, jnp.asarray(lens) + 1, jnp.zeros((3,), jnp.uint32), target.params, target_cfg=target.cfg)
    prop, _ = dr.propose(params, state, ctx)
    assert prop.tokens.shape == (3, drafts)


def test_draft_cache_holds_exactly_the_committed_positions(target):
    cfg = _dflash_cfg(target, block=5)
    params = dflash_init(cfg, jax.random.key(1), std=0.2)
    dr = DFlash(cfg=cfg)
    packed, lens = jspec.api.pack_prompts(PROMPTS, 128)
    dcfg = ar.DecodeConfig(max_new_tokens=NEW, cache_size=48, sampling=SamplingParams(0.0))
    st = spec.generate_spec(target.params, params, target.cfg, dr, spec.SpecConfig(dcfg, "greedy"),
                            jnp.asarray(packed), jnp.asarray(lens), jnp.zeros((3,), jnp.uint32))
    length = np.asarray(st.core.length)
    tokens = st.core.tokens
    # Reference: taps of the final committed text from one plain target forward.
    out = transformer.forward(target.params, target.cfg, tokens, jnp.broadcast_to(jnp.arange(48), (3, 48)),
                              transformer.KVCache.zeros(target.cfg, 3, 48), taps=dr.taps)
    ref_k, ref_v = context_kv(params, cfg, out.taps, jnp.broadcast_to(jnp.arange(48), (3, 48)))
    k, v = np.asarray(st.draft.k), np.asarray(st.draft.v)
    for row in range(3):
        committed = length[row] - 1
        np.testing.assert_allclose(k[:, row, :committed], np.asarray(ref_k)[:, row, :committed], atol=1e-4)
        np.testing.assert_allclose(v[:, row, :committed], np.asarray(ref_v)[:, row, :committed], atol=1e-4)
        assert not k[:, row, committed:].any() and not v[:, row, committed:].any()  # nothing else was written


# --- DDTree ------------------------------------------------------------------------------------------------


def test_ddtree_takes_the_best_prefixes(rng=np.random.default_rng(0)):
    g, v, budget = 3, 4, 9
    logq = np.log(rng.dirichlet(np.ones(v), size=g))
    tokens, parent, depth = map(np.asarray, ddtree.build_tree(jnp.asarray(logq), budget))
    # Brute force: all prefixes, scored by their summed log q, best `budget` of them.
    prefixes = [p for d in range(1, g + 1) for p in itertools.product(range(v), repeat=d)]
    best = sorted(prefixes, key=lambda p: -sum(logq[i, t] for i, t in enumerate(p)))[:budget]
    paths = []
    for i in range(budget):
        path, j = [], i
        while j >= 0:
            path.append(int(tokens[j]))
            j = parent[j]
        paths.append(tuple(reversed(path)))
        assert parent[i] < i and depth[i] == len(paths[-1])
    assert sorted(paths) == sorted(best)


@pytest.mark.parametrize("chunk", [4, 16, 128])
def test_chunked_top_k_equals_lax_top_k(chunk, rng=np.random.default_rng(1)):
    """`ddtree.top_k` (chunk maxima, then a top_k of the best chunks) returns lax.top_k's values and
    indices, ties to the lower index included: per chunk size 12 random (length, k), most lengths not a
    multiple of the chunk, 64 rows each: small-integer values (many ties) with a third of the entries
    -inf, or Gaussian values."""
    for trial in range(12):
        n = int(rng.integers(1, 2000))
        k = int(rng.integers(1, min(n, 40) + 1))
        x = rng.integers(-4, 4, size=(2, 32, n)).astype(np.float32)
        x[rng.random(x.shape) < 0.3] = -np.inf
        if trial % 3 == 0:
            x = rng.normal(size=(2, 32, n)).astype(np.float32)
        want = jax.lax.top_k(jnp.asarray(x), k)
        got = ddtree.top_k(jnp.asarray(x), k, chunk)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]), err_msg=f"{n=} {k=}")
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]), err_msg=f"{n=} {k=}")


# --- checkpoints -------------------------------------------------------------------------------------------


def _assert_same_tree(a, b):
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (_, x), (_, y) in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_dflash_checkpoint_round_trip(target, tmp_path):
    cfg = _dflash_cfg(target, block=6, sliding=8)
    params = dflash_init(cfg, jax.random.key(2))
    save_dflash(str(tmp_path / "a"), cfg, params)
    hf = json.loads((tmp_path / "a" / "config.json").read_text())
    assert hf["dflash_config"] == {"mask_token_id": 127, "target_layer_ids": [0, 2]} and hf["block_size"] == 6
    names = set(load_file(str(tmp_path / "a" / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight"} <= names
    assert not any(n.startswith("model.") or "embed" in n or "lm_head" in n for n in names)
    cfg2, params2 = load_dflash(str(tmp_path / "a"))
    assert cfg2 == cfg
    _assert_same_tree(params, params2)
    save_dflash(str(tmp_path / "b"), cfg2, params2)
    ta, tb = (load_file(str(tmp_path / d / "model.safetensors")) for d in "ab")
    assert ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta)
    # The older naming loads to the same parameters.
    old = {("encoder.fc." + k[3:] if k.startswith("fc.") else
            "encoder.output_norm_enc." + k[12:] if k.startswith("hidden_norm.") else k): t for k, t in ta.items()}
    save_file(old, str(tmp_path / "a" / "model.safetensors"))
    _assert_same_tree(params, load_dflash(str(tmp_path / "a"))[1])


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_dspark_checkpoint_round_trip(target, tmp_path, head):
    cfg = _spark_cfg(target, head)
    params = dspark_init(cfg, jax.random.key(5), target.params)
    save_dspark(str(tmp_path / "a"), cfg, params)
    hf = json.loads((tmp_path / "a" / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3DSparkModel"] and hf["markov_head_type"] == head
    t = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert t["markov_head.markov_w1.weight"].shape == (128, 8) and t["markov_head.markov_w2.weight"].shape == (128, 8)
    assert t["confidence_head.proj.weight"].shape == (1, 64 + 8)
    cfg2, params2 = load_dspark(str(tmp_path / "a"))
    assert cfg2 == cfg
    _assert_same_tree(params, params2)
    save_dspark(str(tmp_path / "b"), cfg2, params2)
    t2 = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert t.keys() == t2.keys() and all(np.array_equal(t[k], t2[k]) for k in t)
    assert json.loads((tmp_path / "b" / "config.json").read_text()) == hf


def test_checkpoint_with_a_bad_tensor_names_it(target, tmp_path):
    cfg = _spark_cfg(target)
    save_dspark(str(tmp_path), cfg, dspark_init(cfg, jax.random.key(6), target.params))
    t = load_file(str(tmp_path / "model.safetensors"))
    del t["layers.1.mlp.up_proj.weight"]
    t["markov_head.markov_w1.weight"] = np.zeros((128, 4), np.float32)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_dspark(str(tmp_path))
    assert "layers.1.mlp.up_proj.weight" in str(err.value)
    assert "markov_head.markov_w1.weight: checkpoint (128, 4) vs config (128, 8)" in str(err.value)


# --- end to end --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafter_dirs(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    cfg = _dflash_cfg(target, block=5)
    save_dflash(str(root / "dflash"), cfg, dflash_init(cfg, jax.random.key(7), std=0.2))
    scfg = _spark_cfg(target, "rnn")
    save_dspark(str(root / "dspark"), scfg, dspark_init(scfg, jax.random.key(8), target.params, std=0.2))
    return {"dflash": str(root / "dflash"), "dspark": str(root / "dspark")}


@pytest.mark.parametrize("sampling, verifier", [(SamplingParams(0.0), "greedy"), (SamplingParams(1.0), "gumbel"),
                                                (SamplingParams(0.8, top_k=10), "gumbel")])
@pytest.mark.parametrize("kind, tree_budget", [("dflash", 0), ("dflash", 7), ("dspark", 0), ("dspark", 5)])
def test_equals_plain_decoding(target, drafter_dirs, sampling, verifier, kind, tree_budget):
    kw = dict(max_new_tokens=NEW, sampling=sampling, seeds=[1, 2, 3], eos_ids=[])
    base = jspec.generate(target, PROMPTS, **kw)
    res = jspec.generate(target, PROMPTS, drafter=drafter_dirs[kind], verifier=verifier, tree_budget=tree_budget, **kw)
    assert res.tokens == base.tokens


def test_cli_accepts_drafter_checkpoints(target, drafter_dirs, capsys):
    base = ["generate", "--target", target.path, "--prompt-ids", "7,8,7,8", "--max-new-tokens", "12",
            "--temperature", "1", "--seed", "5", "--json"]
    outs = []
    for extra in ([], ["--drafter", drafter_dirs["dflash"]], ["--drafter", drafter_dirs["dspark"], "--tree-budget", "4"]):
        assert cli_main(base + extra) == 0
        outs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert outs[0] == outs[1] == outs[2]


def test_budgeted_dspark_loop_is_exact(target, drafter_dirs):
    cfg, params = load_dspark(drafter_dirs["dspark"])
    g = cfg.backbone.num_drafts
    secs = {w: 1e-3 * (1 + 0.3 * w) for w in spec.width_buckets(g)}  # a steeply rising cost curve
    sps = profile.sps_table(secs, len(PROMPTS), g)
    packed, lens = jspec.api.pack_prompts(PROMPTS, 128)
    args = (jnp.asarray(packed), jnp.asarray(lens), jnp.array([1, 2, 3], jnp.uint32))
    sampling = SamplingParams(1.0)
    dcfg = ar.DecodeConfig(max_new_tokens=NEW, cache_size=48, sampling=sampling)
    base = ar.generate_ar(target.params, target.cfg, dcfg, *args)
    dr = DSpark(spark=cfg)
    st = spec.generate_spec(target.params, params, target.cfg, dr, spec.SpecConfig(dcfg, "gumbel", sps), *args)
    np.testing.assert_array_equal(np.asarray(st.core.tokens), np.asarray(base.tokens))
    # The budget really cut verification short: fewer drafts verified than rounds x g.
    rounds, verified = np.asarray(st.stats.rounds), np.asarray(st.stats.verified)
    assert (verified < rounds * g).all(), (verified, rounds)


def test_dspark_reports_the_q_it_samples(target):
    """Slot 0 and slot 1 (given slot 0's token) against the reported q: 40,000 rows, G-test at 1e-4
    (false-failure probability 1e-4 per slot)."""
    cfg = DSparkConfig(backbone=_dflash_cfg(target, anchor_predicts=True), markov_rank=8, markov_head_type="rnn")
    params = dspark_init(cfg, jax.random.key(9), target.params, std=0.3)
    sampling = SamplingParams(1.5, top_k=20)
    dr = DSpark(spark=cfg)
    n = 40_000
    prompt = jnp.asarray([PROMPTS[0] + [0] * 7])
    out = transformer.forward(target.params, target.cfg, prompt, jnp.arange(16)[None],
                              transformer.KVCache.zeros(target.cfg, 1, 32), taps=dr.taps)
    state = dr.init(params, PrefillInfo(prompt, jnp.array([9]), out.taps), 32)
    state = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n,) + x.shape[1:]), state)  # [B, S, Hkv, Dh]
    tokens = jnp.broadcast_to(jnp.zeros((1, 32), jnp.int32).at[:, :16].set(prompt), (n, 32))
    ctx = DraftContext(tokens, jnp.full((n,), 10), jnp.arange(n, dtype=jnp.uint32), target.params,
                       target_cfg=target.cfg, policy=SAMPLE, sampling=sampling)
    prop, _ = jax.jit(dr.propose)(params, state, ctx)
    drafts, q = np.asarray(prop.tokens), np.exp(np.asarray(prop.q_logp, np.float64))
    np.testing.assert_allclose(q[:, 0], q[:1, 0].repeat(n, 0), atol=1e-6)  # slot 0: one q for all rows
    first = np.bincount(drafts[:, 0]).argmax()
    rows = drafts[:, 0] == first
    np.testing.assert_allclose(q[rows, 1], q[rows][:1, 1].repeat(rows.sum(), 0), atol=1e-6)
    for counts, probs in [(np.bincount(drafts[:, 0], minlength=128), q[0, 0]),
                          (np.bincount(drafts[rows, 1], minlength=128), q[rows][0, 1])]:
        assert counts[probs == 0].sum() == 0
        expected = counts.sum() * probs / probs.sum()
        big = expected >= 5
        obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
        assert stats.power_divergence(obs[exp > 0], exp[exp > 0], lambda_="log-likelihood")[1] > 1e-4


# --- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, match", [
    (dict(target_layer_ids=(0, 3)), "never the last layer"),
    (dict(target_layer_ids=(0, 7)), r"include \[7\]"),
    (dict(mask_token_id=128), "mask_token_id 128 is outside the target vocabulary"),
    (dict(layers="hidden"), "hidden size 32 != target hidden size 64"),
    (dict(layers="vocab"), "vocabulary 96 != target vocabulary 128"),
])
def test_bad_drafter_config_fails_before_compiling(target, change, match):
    cfg = _dflash_cfg(target)
    if change.get("layers") == "hidden":
        change = dict(layers=dataclasses.replace(cfg.layers, hidden_size=32))
    elif change.get("layers") == "vocab":
        change = dict(layers=dataclasses.replace(cfg.layers, vocab_size=96))
    cfg = dataclasses.replace(cfg, **change)
    before = spec.generate_spec._cache_size()
    with pytest.raises(ValueError, match=match):
        jspec.generate(target, PROMPTS, drafter=(DFlash(cfg=cfg), {}))
    assert spec.generate_spec._cache_size() == before
