"""The compiled speculative loop: exactness against plain autoregressive decoding, state, extremes."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from conformance import nan_filled_caches
from jspec.cli import main as cli_main
from jspec.decode import ar, spec
from jspec.drafters.base import Proposal
from jspec.drafters.lm import SmallLM
from jspec.verify.sampling import SamplingParams

# Rows of different lengths, with repetitions so that prompt lookup finds matches.
PROMPTS = [[5, 9, 17, 3, 44, 5, 9, 17, 3], [7, 8, 7, 8, 7, 8], [11, 12, 13, 14, 15, 16, 11, 12, 13, 14, 15, 16, 11, 12, 13]]
NEW = 24


@pytest.fixture(scope="module")
def target(hf_checkpoints):
    return jspec.load_target(hf_checkpoints("qwen3")[0])


@pytest.fixture(scope="module")
def small_lm_dir(tmp_path_factory):
    """A different, smaller random LM with the same vocabulary: a real (imperfect) drafter."""
    from conftest import make_hf_model

    model = make_hf_model("qwen3", seed=7, layers=1)
    path = tmp_path_factory.mktemp("small_lm")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def baselines(target):
    cache = {}

    def get(sampling):
        if sampling not in cache:
            cache[sampling] = jspec.generate(target, PROMPTS, max_new_tokens=NEW, sampling=sampling, seeds=[3, 4, 5],
                                             eos_ids=[])
        return cache[sampling]

    return get


def _run(target, drafter, sampling, verifier=None, prompts=PROMPTS, seeds=(3, 4, 5), **kw):
    return jspec.generate(target, prompts, max_new_tokens=NEW, sampling=sampling, seeds=list(seeds), eos_ids=[],
                          drafter=drafter, verifier=verifier, **kw)


CASES = [("lookup", dict(block_size=g)) for g in (1, 2, 3, 5, 8, 16)] + [
    ("lookup", dict(tree_budget=n)) for n in (1, 4, 9)] + [("small_lm", dict(block_size=g)) for g in (1, 4, 7)]


@pytest.mark.parametrize("drafter, kw", CASES, ids=[f"{d}-{k}{v}" for d, kv in CASES for k, v in kv.items()])
def test_greedy_equals_plain_greedy(target, baselines, small_lm_dir, drafter, kw):
    res = _run(target, small_lm_dir if drafter == "small_lm" else drafter, SamplingParams(0.0), **kw)
    base = baselines(SamplingParams(0.0))
    assert res.tokens == base.tokens
    np.testing.assert_allclose(np.concatenate(res.logprobs), np.concatenate(base.logprobs), atol=1e-4)
    assert res.stats["rounds"] <= base.stats["rounds"] * len(PROMPTS)


@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.8, top_k=12, top_p=0.9)])
@pytest.mark.parametrize("drafter, kw", [("lookup", dict(block_size=4)), ("lookup", dict(block_size=16)),
                                         ("lookup", dict(tree_budget=6)), ("small_lm", dict(block_size=3))])
def test_gumbel_coupled_equals_plain_sampling(target, baselines, small_lm_dir, sampling, drafter, kw):
    res = _run(target, small_lm_dir if drafter == "small_lm" else drafter, sampling, "gumbel", **kw)
    base = baselines(sampling)
    assert res.tokens == base.tokens
    np.testing.assert_allclose(np.concatenate(res.logprobs), np.concatenate(base.logprobs), atol=1e-4)


def test_batch_composition_does_not_change_a_row(target, small_lm_dir):
    for sampling, verifier in [(SamplingParams(0.0), "greedy"), (SamplingParams(1.0), "speculative")]:
        alone = _run(target, small_lm_dir, sampling, verifier, prompts=[PROMPTS[1]], seeds=[4], block_size=3)
        batched = _run(target, small_lm_dir, sampling, verifier, prompts=[PROMPTS[2], PROMPTS[1]], seeds=[9, 4],
                       block_size=3)
        assert batched.tokens[1] == alone.tokens[0]


def test_compiles_once_per_shape(target):
    _run(target, "lookup", SamplingParams(1.0), "speculative", block_size=4)
    before = spec.generate_spec._cache_size()
    other = [[21, 22, 23, 21, 22], [30, 31], [40] * 12]
    _run(target, "lookup", SamplingParams(1.0), "speculative", prompts=other, seeds=(8, 9, 10), block_size=4)
    assert spec.generate_spec._cache_size() == before


# --- state: committed cache rows, never-read rows ----------------------------------------------------


def _arrays(target, prompts):
    packed, lens = jspec.api.pack_prompts(prompts, target.cfg.vocab_size)
    return jnp.asarray(packed), jnp.asarray(lens), jnp.arange(len(prompts), dtype=jnp.uint32)


@pytest.mark.parametrize("tree_budget", [0, 6])
def test_committed_cache_rows_equal_plain_decoding(target, tree_budget):
    dcfg = ar.DecodeConfig(max_new_tokens=NEW, cache_size=64, sampling=SamplingParams(0.0))
    args = _arrays(target, PROMPTS)
    plain = ar.generate_ar(target.params, target.cfg, dcfg, *args)
    drafter, _ = jspec.load_drafter("lookup", target, **(dict(tree_budget=tree_budget) if tree_budget else
                                                          dict(block_size=4)))
    st = spec.generate_spec(target.params, (), target.cfg, drafter, spec.SpecConfig(dcfg, "greedy"), *args)
    np.testing.assert_array_equal(np.asarray(st.core.tokens), np.asarray(plain.tokens))
    for row, length in enumerate(np.asarray(plain.length)):
        # Rows < length - 1 are committed history in both (the last token is a pending anchor).
        for name in ("k", "v"):
            a = np.asarray(getattr(st.core.cache, name))[:, row, :, : length - 1]  # [L, B, Hkv, S, Dh]
            b = np.asarray(getattr(plain.cache, name))[:, row, :, : length - 1]
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_drafter_caches_take_the_targets_aligned_row_count(target, small_lm_dir):
    """The drafter's context caches get the target's rows, cache_size + the verify width rounded up to
    ar.CACHE_ROW_ALIGN: an unaligned cache (64 + 5 rows here) gets another default layout on TPU than
    the one the loop keeps it in, and is relaid at the program's end (a second copy in memory)."""
    drafter, dparams = jspec.load_drafter(small_lm_dir, target, block_size=4)
    dcfg = ar.DecodeConfig(max_new_tokens=NEW, cache_size=64, sampling=SamplingParams(0.0))
    args = _arrays(target, PROMPTS)
    st = jax.eval_shape(lambda: spec.start(target.params, dparams, target.cfg, drafter, dcfg, *args))
    rows = {a.shape[2] for a in (*st.core.cache.k, *st.core.cache.v)}
    assert rows == {80}, rows  # 64 + 5 rows rounded up to a multiple of 16
    assert {a.shape[2] for a in (*st.draft.cache.k, *st.draft.cache.v)} == rows


def test_unwritten_rows_are_never_read(target, small_lm_dir, monkeypatch, baselines):
    """Every cache row starts as NaN: a single read of a row that was not written poisons the output."""
    with nan_filled_caches(monkeypatch):
        for drafter, kw in [("lookup", dict(block_size=5)), ("lookup", dict(tree_budget=7)),
                            (small_lm_dir, dict(block_size=3))]:
            res = _run(target, drafter, SamplingParams(1.0), "speculative", **kw)
            assert all(np.isfinite(lp).all() for lp in res.logprobs)
            res = _run(target, drafter, SamplingParams(0.0), **kw)
            assert res.tokens == baselines(SamplingParams(0.0)).tokens


# --- extremes: a perfect and a hopeless drafter ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OracleTree(SmallLM):
    """Test drafter: the target's own greedy chain (depth L) plus wrong siblings, or only wrong tokens."""

    wrong: bool = False

    @property
    def kind(self):
        return "tree" if self.tree else "chain"

    tree: bool = False

    @property
    def num_drafts(self):
        return 2 * self.block_size if self.tree else self.block_size

    @property
    def max_depth(self):
        return self.block_size

    def propose(self, dparams, cache, ctx):
        prop, cache = super().propose(dparams, cache, ctx)
        chain = prop.tokens
        if self.wrong:
            chain = (chain + 1) % self.cfg.vocab_size
        if not self.tree:
            return Proposal(chain), cache
        b, g = chain.shape
        junk = (chain + 1 + self.wrong) % self.cfg.vocab_size  # never the target's choice below each node
        tokens = jnp.concatenate([junk[:, :1], chain, junk[:, 1:]], axis=1)  # node 0: junk child of the anchor
        parent = jnp.concatenate([jnp.array([-1, -1]), jnp.arange(1, g), jnp.arange(1, g)])
        depth = jnp.concatenate([jnp.array([1, 1]), jnp.arange(2, g + 1), jnp.arange(2, g + 1)])
        return Proposal(tokens, None, jnp.broadcast_to(parent, (b, 2 * g)), jnp.broadcast_to(depth, (b, 2 * g))), cache


@pytest.mark.parametrize("tree", [False, True])
def test_perfect_drafter_reaches_tau_g_plus_1(target, baselines, tree):
    g, new = 4, 21  # 1 token from prefill, then 4 full rounds of 5
    drafter = OracleTree(cfg=target.cfg, block_size=g, tree=tree)
    res = jspec.generate(target, PROMPTS, max_new_tokens=new, eos_ids=[], drafter=(drafter, target.params))
    assert res.tokens == [t[:new] for t in baselines(SamplingParams(0.0)).tokens]
    assert res.stats["tau"] == g + 1
    assert res.stats["accept_hist"] == [0] * g + [4 * len(PROMPTS)]
    assert res.stats["accepted_per_position"] == [4 * len(PROMPTS)] * g


@pytest.mark.parametrize("tree", [False, True])
def test_hopeless_drafter_gives_tau_1_and_correct_output(target, baselines, tree):
    drafter = OracleTree(cfg=target.cfg, block_size=4, tree=tree, wrong=True)
    res = jspec.generate(target, PROMPTS, max_new_tokens=NEW, eos_ids=[], drafter=(drafter, target.params))
    assert res.tokens == baselines(SamplingParams(0.0)).tokens
    assert res.stats["tau"] == 1.0
    assert res.stats["accepted_per_position"] == [0, 0, 0, 0]


def test_eos_inside_an_accepted_block_ends_the_row(target, baselines):
    base = baselines(SamplingParams(0.0)).tokens
    eos = base[0][6]  # accepted mid-block by the perfect drafter
    drafter = OracleTree(cfg=target.cfg, block_size=4)
    res = jspec.generate(target, PROMPTS, max_new_tokens=NEW, eos_ids=[eos], drafter=(drafter, target.params))
    for row in range(len(PROMPTS)):
        cut = base[row].index(eos) + 1 if eos in base[row] else NEW
        assert res.tokens[row] == base[row][:cut]


# --- bad input ------------------------------------------------------------------------------------------


def test_bad_speculative_input_fails_before_compiling(target, small_lm_dir, tmp_path, hf_checkpoints):
    from conftest import make_hf_model

    other_vocab = make_hf_model("qwen3", seed=3, layers=1, vocab=96)
    other_vocab.save_pretrained(tmp_path / "v96")
    before = spec.generate_spec._cache_size()
    cases = [
        (dict(drafter=str(tmp_path / "v96")), "drafter vocabulary \\(96\\) differs from the target's \\(128\\)"),
        (dict(drafter="lookup", block_size=0), "block size must be >= 1"),
        (dict(drafter="lookup", block_size=64, cache_size=64), "do not fit a cache of 64 rows"),
        (dict(drafter="lookup", tree_budget=4, verifier="block", sampling=SamplingParams(1.0)), "chain-only"),
        (dict(drafter="lookup", verifier="nucleus"), "unknown verifier 'nucleus'"),
        (dict(drafter="lookup", verifier="greedy", sampling=SamplingParams(1.0)), "lossless only at temperature 0"),
        (dict(drafter="ngram-magic"), "unknown drafter 'ngram-magic'"),
        (dict(drafter=small_lm_dir, tree_budget=3), "drafts chains"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            jspec.generate(target, PROMPTS, max_new_tokens=8, **kw)
    assert spec.generate_spec._cache_size() == before


def test_tokenizer_mismatch_is_refused(tmp_path):
    from jspec.demo import DEMO_CONFIG, create_demo_model, train_tokenizer, stdlib_files

    small = dataclasses.replace(DEMO_CONFIG, hidden_size=32, intermediate_size=64, num_layers=1, head_dim=16,
                                layer_types=())
    a = create_demo_model(str(tmp_path / "a"), cfg=small)
    b = create_demo_model(str(tmp_path / "b"), cfg=small, seed=1)
    train_tokenizer(small.vocab_size, stdlib_files()[-40:]).save(str(tmp_path / "b" / "tokenizer.json"))
    with pytest.raises(ValueError, match="different tokenizer"):
        jspec.generate(jspec.load_target(a), [[1, 2, 3]], drafter=b)


# --- the CLI: drafter invariance under Gumbel coupling ---------------------------------------------------


def test_cli_gumbel_output_is_drafter_invariant(hf_checkpoints, small_lm_dir, capsys):
    path = hf_checkpoints("qwen3")[0]
    base = ["generate", "--target", path, "--prompt-ids", "7,8,7,8,7,8", "--max-new-tokens", "16", "--temperature",
            "1", "--top-k", "20", "--seed", "11", "--json"]
    outs = {}
    for extra in ([], ["--drafter", "lookup", "--block-size", "3"], ["--drafter", "lookup", "--tree-budget", "5"],
                  ["--drafter", small_lm_dir, "--block-size", "2", "--verifier", "gumbel"]):
        assert cli_main(base + extra) == 0
        outs[" ".join(extra)] = json.loads(capsys.readouterr().out)
    tokens = {k: tuple(v["tokens"]) for k, v in outs.items()}
    assert len(set(tokens.values())) == 1, tokens
    for k, v in outs.items():
        st = v["stats"]
        assert {"new_tokens", "wall_s", "rounds", "tau", "accepted_per_position"} <= set(st)
        if k:
            assert st["tau"] == pytest.approx((st["new_tokens"] - 1) / st["rounds"])
