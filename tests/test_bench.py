"""`jspec bench` on a tiny demo model: the report's internal consistency, its files, bad input refused early."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import jax
import pytest

import jspec
from jspec.bench import metrics
from jspec.bench.run import BenchConfig, run_bench
from jspec.cli import main
from jspec.demo import DEMO_CONFIG, create_demo_model

SMALL = dataclasses.replace(DEMO_CONFIG, hidden_size=64, intermediate_size=128, num_layers=2, head_dim=16,
                            layer_types=())


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return create_demo_model(str(tmp_path_factory.mktemp("bench_model")), cfg=SMALL)


@pytest.fixture(scope="module")
def target(demo_dir):
    return jspec.load_target(demo_dir)


@pytest.fixture(scope="module")
def bench(target, tmp_path_factory):
    """One small end-to-end run: plain AR, a lookup chain and a lookup tree, the peer, a CPU roofline."""
    out = str(tmp_path_factory.mktemp("bench_out"))
    # The peer's token budget and block size match the main run's, so its jspec AR and lookup reuse their compiles.
    cfg = BenchConfig(drafters=("lookup",), block_sizes=(2,), tree_budgets=(0, 2), temperatures=(0.0,), prompts=2,
                      prompt_len=16, max_new_tokens=10, repeats=2, verify_widths=(1, 2), peer_prompts=1,
                      peer_new_tokens=10, peer_block_size=2, torch_threads=1, bandwidth_gbs=10.0, out=out,
                      progress=False, command="test")
    return run_bench(cfg, target=target), out


def test_report_files_and_json(bench):
    rep, out = bench
    with open(os.path.join(out, "bench.json")) as f:
        assert json.load(f) == json.loads(json.dumps(rep))
    for name in rep["plots"].values():
        with open(os.path.join(out, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert [c["label"] for c in rep["combos"]] == ["lookup g=2 greedy T=0", "lookup tree N=2 greedy T=0"]
    assert rep["tables"]["main"].count("\n") == 1 + 1 + 2  # header, rule, AR and two combos
    assert rep["environment"]["accelerator"] is False


def test_acceptance_is_consistent(bench):
    rep, _ = bench
    for c in rep["combos"]:
        a = c["acceptance"]
        assert a["tau"] == pytest.approx(a["committed"] / a["rounds"])
        assert sum(a["accept_hist"]) == a["rounds"]
        pp = a["accepted_per_position"]
        assert len(pp) == c["max_depth"] and pp[0] == a["rounds"] - a["accept_hist"][0]
        # Survival is non-increasing and conditional acceptance chains back to it.
        s = a["survival"]
        assert all(x >= y for x, y in zip(s, s[1:])) and 0 <= s[-1] <= s[0] <= 1
        prev = 1.0
        for cond, surv in zip(a["conditional_acceptance"], s):
            if cond is not None:
                assert prev * cond == pytest.approx(surv)
            prev = surv
        # Every run generated max_new_tokens; the first comes from the prefill.
        assert a["committed"] == rep["settings"]["prompts"] * (rep["settings"]["max_new_tokens"] - 1)
        assert c["outputs_equal_ar"] is True  # greedy speculative decoding emits plain greedy decoding's tokens


def _repeat_decode(timing: dict) -> list[float]:
    return [sum(c) - sum(p) for c, p in zip(timing["call_s"], timing["prefill_s"])]


def test_rates_and_speedup_are_consistent(bench):
    rep, _ = bench
    ar = rep["ar"][0]["timing"]
    for c in rep["combos"]:
        t = c["timing"]
        decode = [[a - b for a, b in zip(cr, pr)] for cr, pr in zip(t["call_s"], t["prefill_s"])]
        assert t["decode_s_total"] == pytest.approx(sum(map(sum, decode)))
        assert t["tokens_per_s"] == pytest.approx(t["tokens_total"] / t["decode_s_total"])
        assert t["tokens_total"] == ar["tokens_total"]  # same prompts, same token budget
        sp = c["speedup"]
        assert sp["value"] == pytest.approx(ar["decode_s_total"] / t["decode_s_total"])
        assert sp["ar_decode_s"] == ar["decode_s_total"] and sp["decode_s"] == t["decode_s_total"]
        # Repeats whose decode time (call - separately timed prefill) is not positive are counted; with
        # none, the per-repeat ratios bound the pooled one (a ratio of sums of positive times is their mediant).
        pairs = list(zip(_repeat_decode(ar), _repeat_decode(t)))
        assert sp["noisy_repeats"] == sum(1 for a, s in pairs if a <= 0 or s <= 0)
        if sp["noisy_repeats"] == 0:
            assert sp["repeats"]["min"] * (1 - 1e-9) <= sp["value"] <= sp["repeats"]["max"] * (1 + 1e-9)
        # The round's cost split is timed in the same repeats as the round itself; its shares sum to 1.
        cost = c["cost"]
        assert cost["repeats"] == rep["settings"]["repeats"]
        assert cost["verify_share"] == pytest.approx(cost["verify_s"] / cost["round_s"])
        assert cost["draft_share"] == pytest.approx(cost["draft_s"] / cost["round_s"])
        assert cost["contention_share"] == pytest.approx((cost["pair_s"] - cost["verify_s"] - cost["draft_s"])
                                                         / cost["round_s"])
        assert cost["overhead_share"] == pytest.approx(1 - cost["pair_s"] / cost["round_s"])
        assert (cost["verify_share"] + cost["draft_share"] + cost["contention_share"] + cost["overhead_share"]
                == pytest.approx(1.0))
        assert cost["draft_s"] > 0 and cost["pair_s"] > 0 and cost["target_step_s"] > 0 and cost["c"] > 0
        # Per repeat the remainder can be anything on a tiny model (decode = call - prefill is noise-sized).
        assert cost["overhead_share_repeats"]["min"] <= cost["overhead_share_repeats"]["max"]
    assert rep["ar"][0]["cost"]["c"] is None and rep["ar"][0]["cost"]["draft_share"] == 0.0


def test_verify_curve_and_roofline(bench):
    rep, _ = bench
    curve = rep["verify_curve"]
    assert curve["n"] == [0, 1, 2]
    assert curve["ratio_to_t1"][1] == 1.0 and all(s > 0 for s in curve["seconds"])
    roof = rep["roofline"]
    assert roof["bandwidth_source"] == "--bandwidth-gbs" and roof["bandwidth_bytes_s"] == 10e9
    assert roof["roofline_s"] == pytest.approx((roof["weight_bytes"] + roof["kv_bytes"]) / 10e9)
    assert roof["weight_bytes"] == 4 * SMALL.num_params  # float32


def test_peer_side_by_side(bench):
    rep, _ = bench
    peer = rep["peer"]
    assert set(peer["hf"]) == {"ar", "assisted", "prompt_lookup"} and set(peer["jspec"]) == {"ar", "lookup", "small_lm"}
    for hf, js in (("ar", "ar"), ("assisted", "small_lm"), ("prompt_lookup", "lookup")):
        ratio = peer["jspec"][js]["tokens_per_s"] / peer["hf"][hf]["tokens_per_s"]
        assert peer["ratio"][f"jspec_{js}_over_hf_{hf}"] == pytest.approx(ratio)
        assert peer["hf"][hf]["tokens_total"] == peer["repeats"] * (peer["max_new_tokens"] - 1)
    # Same weights, greedy: transformers' plain decoding agrees with jspec's on the tiny model.
    assert peer["hf"]["ar"]["agreement_with_jspec_ar"] == 1.0
    assert peer["jspec"]["small_lm"]["agreement_with_jspec_ar"] == 1.0


def test_pooled_ratio_interval():
    # Every repeat at the same ratio: every resample's pooled ratio is that ratio.
    assert metrics.pooled_ratio_interval([(2.0, 1.0), (4.0, 2.0), (3.0, 1.5), (1.0, 0.5), (6.0, 3.0)]) == {
        "low": 2.0, "high": 2.0, "level": 0.95, "method": "percentile bootstrap over 5 repeats, 2000 resamples, seed 0"}
    pairs = [(1.0 + 0.1 * i, 1.0) for i in range(8)]  # ratios 1.0 .. 1.7, pooled 1.35
    ci = metrics.pooled_ratio_interval(pairs)
    assert 1.0 <= ci["low"] < 1.35 < ci["high"] <= 1.7
    assert metrics.pooled_ratio_interval(pairs) == ci  # fixed seed: the same interval every time
    assert metrics.pooled_ratio_interval(pairs[:4]) is None  # too few repeats for a bootstrap
    # speedup() leaves repeats with a non-positive decode time out of the interval as out of the spread.
    ar = metrics.decode_timing([[2.0]] * 5 + [[0.1]], [[1.0]] * 5 + [[0.2]], [[9]] * 6)
    sp_ = metrics.decode_timing([[1.5]] * 6, [[1.0]] * 6, [[9]] * 6)
    sp = metrics.speedup(ar, sp_)
    assert sp["noisy_repeats"] == 1 and sp["ci95"]["low"] == sp["ci95"]["high"] == 2.0


def test_round_costs_by_hand():
    cost = metrics.round_costs([1.0, 1.2, 0.9], [0.5, 0.6, 0.4], [0.2, 0.3, 0.2], [0.25, 0.3, 0.2])
    assert (cost["round_s"], cost["verify_s"], cost["draft_s"], cost["target_step_s"]) == (1.0, 0.5, 0.2, 0.25)
    assert cost["c"] == pytest.approx(1.0)  # per repeat 0.2/0.25, 0.3/0.3, 0.2/0.2: the median of 0.8, 1.0, 1.0
    assert cost["verify_share"] + cost["draft_share"] + cost["overhead_share"] == pytest.approx(1.0)
    assert cost["contention_share"] == pytest.approx(0.0, abs=1e-12)  # no pair timed: the pair is taken as verify + draft
    assert cost["overhead_share_repeats"]["min"] == pytest.approx(0.25)
    # Timed together, the pair costs 0.8, 0.95, 0.7: contention (0.8 - 0.5 - 0.2) / 1.0, overhead 1 - 0.8.
    cost = metrics.round_costs([1.0, 1.2, 0.9], [0.5, 0.6, 0.4], [0.2, 0.3, 0.2], [0.25, 0.3, 0.2], [0.8, 0.95, 0.7])
    assert cost["pair_s"] == 0.8
    assert cost["contention_share"] == pytest.approx(0.1) and cost["overhead_share"] == pytest.approx(0.2)
    assert cost["overhead_share_repeats"]["min"] == pytest.approx(0.2)  # (1.0 - 0.8) / 1.0, 0.25 / 1.2, 0.2 / 0.9


def test_acceptance_metrics_by_hand():
    # 4 rounds accepting 0, 2, 2, 3 of 3 drafts: per_position = rounds with n > i.
    a = metrics.acceptance(rounds=4, committed=11, hist=[1, 0, 2, 1], per_position=[3, 3, 1], verified=12)
    assert a["tau"] == 11 / 4
    assert a["conditional_acceptance"] == [3 / 4, 1.0, 1 / 3]
    assert a["survival"] == [3 / 4, 3 / 4, 1 / 4]
    assert metrics.acceptance(rounds=2, committed=2, hist=[2, 0], per_position=[0, 0],
                              verified=4)["conditional_acceptance"] == [0.0, None]
    # Pooled rate: sum of tokens / sum of time, not the mean of per-prompt rates (which would be 6).
    t = metrics.decode_timing([[1.5, 11.0]], [[0.5, 1.0]], [[10, 10]])
    assert t["tokens_per_s"] == 20 / 11


def test_shape_targets_are_validated_abstractly(monkeypatch):
    from jspec.bench import roofline, run

    monkeypatch.setitem(roofline.SHAPES, "tiny", SMALL)
    cfg = BenchConfig(shape="tiny", allow_cpu=True)
    abstract = run._shape_target(cfg, jax.numpy.bfloat16, accelerator=False)
    real = roofline.random_target("tiny", jax.numpy.bfloat16)
    shapes = lambda p: jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), p)
    assert shapes(abstract.params) == shapes(real.params)
    assert roofline.weight_bytes(real.params) == 2 * SMALL.num_params
    assert roofline.SHAPES["qwen3-8b"].num_params == pytest.approx(8.19e9, rel=0.01)  # Qwen3-8B's published size
    with pytest.raises(ValueError, match="needs an accelerator"):
        run._shape_target(dataclasses.replace(cfg, allow_cpu=False), jax.numpy.bfloat16, accelerator=False)


@pytest.mark.parametrize("extra, match", [
    (["--drafters", "nope"], "valid drafters are lookup"),
    (["--verifiers", "fast"], "valid verifiers are auto, greedy, speculative, block, gumbel"),
    (["--verifiers", "block", "--tree-budgets", "0,4"], "chain-only"),
    (["--verifiers", "greedy", "--temperatures", "1"], "greedy verifier is lossless only at temperature 0"),
    (["--shape", "qwen3-8b"], "needs an accelerator"),
    (["--max-new-tokens", "1"], "max-new-tokens must be >= 2"),
])
def test_cli_refuses_bad_input(demo_dir, capsys, extra, match):
    argv = ["bench", "--target", demo_dir, "--drafters", "lookup", "--no-peer", "--no-progress"] + extra
    assert main(argv) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("change, match", [
    (dict(drafters=("lookup", "builtin:no-such-model")), "valid drafters are lookup"),
    (dict(verifiers=("block",), tree_budgets=(0, 4, 8), temperatures=(0.0,)), "2 requested combination"),
])
def test_bad_combinations_refused_before_any_compilation(target, caplog, change, match):
    cfg = dataclasses.replace(BenchConfig(drafters=("lookup",), progress=False, peer=False), **change)
    with caplog.at_level(logging.WARNING), jax.log_compiles(True), pytest.raises(ValueError, match=match) as err:
        run_bench(cfg, target=target)
    assert not [r for r in caplog.records if "Compiling" in r.getMessage()]
    if "combination" in match:  # each bad combination is named with the reason
        assert "lookup tree N=4 block T=0" in str(err.value) and "lookup tree N=8 block T=0" in str(err.value)
