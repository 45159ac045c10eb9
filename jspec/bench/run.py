"""`run_bench`: plain AR and every requested speculative combination on the same prompts and weights, in one
process, then the cost profile, the peer and (on an accelerator) the roofline; one JSON report and PNG plots.

Order of work: validate everything (nothing compiled yet), warm up every method (compiles; the warm-up
outputs give the acceptance counters, which are deterministic for fixed seeds), time `repeats` rounds
interleaved across methods (every method sees the same machine load), then the compiled-loop cost
profiles, the peer, the roofline.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

import jspec
from jspec.api import Target, default_cache_size, pack_prompts
from jspec.bench import combos, metrics, peer, plots, report, roofline, timing
from jspec.bench.prompts import held_out_prompts
from jspec.models.config import ModelConfig
from jspec.models.transformer import init_params
from jspec.verify import rules
from jspec.verify.sampling import SamplingParams

SCHEMA = "jspec.bench/1"
GIB = 1 << 30


@dataclasses.dataclass
class BenchConfig:
    """What to measure. Axes (drafters x verifiers x block_sizes x tree_budgets x temperatures) form the
    combinations; verifier "auto" = greedy at T = 0, Gumbel otherwise. verify_widths: the n of the
    verify-cost curve T(n) (T(0), the 1-token step, is always measured). shape: a random-weight target
    shape (roofline.SHAPES) instead of `target`; it needs an accelerator unless allow_cpu."""

    target: str = "builtin:code-target"
    drafters: tuple[str, ...] = ("builtin:code-dflash", "builtin:code-dspark", "lookup")
    verifiers: tuple[str, ...] = (combos.AUTO,)
    block_sizes: tuple[int, ...] = (2, 4, 8, 16)
    tree_budgets: tuple[int, ...] = (0, 16)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    prompts: int = 8
    prompt_len: int = 48
    max_new_tokens: int = 128
    repeats: int = 5
    verify_widths: tuple[int, ...] = tuple(range(1, 33))
    peer: bool = True
    peer_prompts: int = 4
    peer_new_tokens: int = 64
    peer_block_size: int = 4
    peer_repeats: int | None = None  # None: repeats
    torch_threads: int | None = None  # None: the CPUs this process may use
    shape: str | None = None
    allow_cpu: bool = False
    bandwidth_gbs: float | None = None  # None: the spec sheet's for known accelerators, else measured
    dtype: str | None = None  # None: float32, or bfloat16 for a --shape model
    seed: int = 0
    out: str = "bench_out"
    progress: bool = True
    quick: bool = False
    command: str | None = None


QUICK = dict(block_sizes=(4,), tree_budgets=(0,), temperatures=(0.0,), prompts=3, max_new_tokens=64, repeats=8,
             verify_widths=(1, 4, 8), peer_prompts=1, peer_new_tokens=32, peer_repeats=2)
"""--quick: a short run (explicit options win). 8 repeats give the speedup a 95% interval; the peer, whose
torch threads suffer most from a shared machine and whose ratios are far from 1, times one prompt twice."""


def _check_settings(cfg: BenchConfig) -> None:
    for name in ("prompts", "prompt_len", "repeats", "peer_prompts", "peer_block_size", "peer_repeats"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    for name in ("max_new_tokens", "peer_new_tokens"):
        if getattr(cfg, name) < 2:
            raise ValueError(f"{name.replace('_', '-')} must be >= 2 (the decode interval starts after the first "
                             f"token), got {getattr(cfg, name)}")
    if not cfg.drafters:
        raise ValueError("no drafter given: pass --drafters (plain AR always runs as the baseline)")
    bad = [n for n in cfg.verify_widths if not 1 <= n <= 256]
    if bad:
        raise ValueError(f"verify widths must lie in 1..256 drafts, got {bad}")
    if cfg.dtype not in (None, "float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {cfg.dtype!r}")
    if cfg.bandwidth_gbs is not None and cfg.bandwidth_gbs <= 0:
        raise ValueError(f"bandwidth must be > 0 GB/s, got {cfg.bandwidth_gbs}")


def _shape_target(cfg: BenchConfig, dtype, accelerator: bool) -> Target:
    """The random target of --shape, abstract (shapes only, nothing computed) until `_materialize`."""
    if cfg.shape not in roofline.SHAPES:
        raise ValueError(f"unknown shape {cfg.shape!r}: valid shapes are {', '.join(roofline.SHAPES)}")
    if not accelerator and not cfg.allow_cpu:
        raise ValueError(f"--shape {cfg.shape} times a {roofline.SHAPES[cfg.shape].num_params / 1e9:.1f}B-parameter "
                         "random model and needs an accelerator (jax found only the CPU); pass --allow-cpu to run "
                         "it on the CPU anyway (tens of GB of memory, hours)")
    mcfg = roofline.SHAPES[cfg.shape]
    params = jax.eval_shape(lambda: init_params(mcfg, jax.random.key(cfg.seed), dtype=dtype))
    return Target(mcfg, params, None, f"random:{cfg.shape}")


def _environment() -> dict:
    dev = jax.devices()[0]
    return {
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "devices": jax.device_count(),
        "accelerator": dev.platform != "cpu",
        "cpus": len(os.sched_getaffinity(0)),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "absolute_times": "meaningful" if dev.platform != "cpu" else
                          "shared CPU: compare ratios (tau, speedup, c, shares), not absolute times",
    }


INTERVALS = {
    "call_s": "jspec.generate's wall_s on one prompt: the compiled generation (prefill, drafter set-up, decode "
              "loop) and the copy of its results to the host; input packing and validation excluded",
    "prefill_s": "what the call runs before its first round (target prefill choosing the first token, drafter "
                 "init), jitted apart with the same shapes and cache rows, until its result is ready",
    "decode_s": "call_s - prefill_s: the rounds that commit the remaining max_new_tokens - 1 tokens",
    "tokens_per_s": "pooled: sum of tokens committed in the decode interval / sum of decode_s, all prompts and repeats",
    "speedup": "plain-AR decode_s / speculative decode_s, same prompts, seeds, cache size, temperature and repeats; "
               "ci95: percentile bootstrap of that pooled ratio over repeats (from 5 repeats)",
    "round_s": "median over repeats of the repeat's decode_s / its loop iterations (batch 1: one round, or one AR "
               "step)",
    "verify_s": "one target pass over the anchor + n drafts (chains; trees timed as a chain of the same width), "
                f"inside a compiled loop of {timing.INNER} (jspec.decode.profile), one row, at the cost context; timed "
                "once per repeat right after that repeat's calls of the same method, median over repeats",
    "draft_s": "the drafter's round for one row: one Drafter.propose and one Drafter.commit (its update from the "
               f"verify pass), inside a compiled loop of {timing.INNER}, at the cost context, timed like verify_s",
    "c": "median over repeats of draft_s / T(0), T(0) = one target token step timed in the same repeat",
    "pair_s": "the drafter's round and the verify pass together (propose, the pass, the drafter's commit of its "
              "output), in one compiled loop, timed like verify_s",
    "shares": "verify_share + draft_share + contention_share + overhead_share = 1, of the median round_s: the "
              "medians of verify_s and draft_s; contention = pair_s - verify_s - draft_s (the two evicting each "
              "other's weights from the CPU's caches); overhead = round_s - pair_s: the rule, sampling, the target's "
              "commit (tokens, cache rows), statistics and loop control",
}


def run_bench(cfg: BenchConfig, target: Target | None = None) -> dict:
    """Measure, write `bench.json` and the PNG plots into cfg.out, and return the report (the JSON object).

    `target` overrides cfg.target / cfg.shape (a loaded jspec Target). Raises ValueError for bad input
    (unknown drafter or verifier names list the valid ones; impossible combinations are named) before
    anything is compiled, FileNotFoundError for a missing built-in model.
    """
    start = time.perf_counter()
    _check_settings(cfg)
    accelerator = jax.default_backend() != "cpu"
    dtype = jnp.bfloat16 if (cfg.dtype or ("bfloat16" if cfg.shape else "float32")) == "bfloat16" else jnp.float32
    given = target is not None
    shaped = _shape_target(cfg, dtype, accelerator) if cfg.shape and not given else None
    for name in cfg.drafters:
        combos.check_drafter_name(name)
    for v in cfg.verifiers:
        combos.resolve_verifier(v, 0.0)
    if not given:
        target = shaped or jspec.load_target(cfg.target, dtype=dtype)
    if not isinstance(target.cfg, ModelConfig):
        raise ValueError("jspec bench measures dense Llama / Qwen3 targets: the verify-pass profile "
                         "(jspec.decode.profile) does not cover hybrid Gated DeltaNet targets")
    count = max(cfg.prompts, cfg.peer_prompts)
    all_prompts, source = held_out_prompts(target, count, cfg.prompt_len, cfg.seed)
    prompts = all_prompts[: cfg.prompts]
    packed, _ = pack_prompts(prompts, target.cfg.vocab_size)
    cache_size = default_cache_size(packed.shape[1], cfg.max_new_tokens)
    plan = combos.expand(target, cfg.drafters, cfg.verifiers, cfg.block_sizes, cfg.tree_budgets, cfg.temperatures,
                         cache_size)
    if cfg.shape and not given:
        target = roofline.random_target(cfg.shape, dtype, cfg.seed)  # everything validated: now build the weights

    temps = sorted({p.combo.temperature for p in plan})
    ar_runs = {t: timing.Runner(f"plain AR T={t:g}", target, t, cache_size) for t in temps}
    spec_runs = [timing.Runner(p.combo.label, target, p.combo.temperature, cache_size, (p.drafter, p.params),
                               p.combo.verifier) for p in plan]
    runs = list(ar_runs.values()) + spec_runs
    widths = sorted({0, 1, *cfg.verify_widths})  # T(0): the token step of c; T(1): the curve's unit
    probe_widths = {0} | {p.drafter.num_drafts for p in plan}
    peer_skip = _peer_skip(cfg)
    do_roofline = accelerator or cfg.bandwidth_gbs is not None
    total = (len(runs) * (len(prompts) + 1) + len(probe_widths) + len(plan) + len(runs) * cfg.repeats * len(prompts) * 2
             + len(widths) + int(do_roofline)
             + (0 if peer_skip else peer.planned_calls(cfg.peer_prompts, cfg.peer_repeats or cfg.repeats)))
    os.makedirs(cfg.out, exist_ok=True)  # fail on an unusable folder before measuring, not after
    bar = tqdm(total=total, desc="jspec bench", unit="step", disable=not cfg.progress, dynamic_ncols=True)

    def tick(label: str) -> None:
        bar.set_postfix_str(label[:48], refresh=False)
        bar.update(1)

    try:
        outputs, warm = _warm_up(runs, prompts, cfg, tick)
        ar_first = outputs[ar_runs[temps[0]]]
        context_tokens = _cost_context(prompts[0], ar_first[0], cfg.max_new_tokens // 2, cache_size)
        probes = _cost_probes(target, ar_runs, zip(plan, spec_runs), context_tokens, cache_size, tick)
        timed, costs = _timed(runs, prompts, cfg, tick, probes)
        curve_repeats = min(5, max(3, cfg.repeats))  # compiled loops of timing.INNER passes: steady from 3
        verify = {}
        for n in widths:
            verify[n] = timing.verify_seconds(target, n, len(context_tokens), cache_size, curve_repeats)
            tick(f"verify pass n={n}")
        curve = {"context": len(context_tokens), "cache_rows": f"{cache_size} + n + 1", "n": widths,
                 "seconds": [verify[n] for n in widths], "ratio_to_t1": [verify[n] / verify[1] for n in widths]}
        ar_records = {}
        for t, run in ar_runs.items():
            ar_records[t] = _ar_record(run, t, timed[run], costs[run])
        combo_records = []
        for p, run in zip(plan, spec_runs):
            combo_records.append(_combo_record(p, run, warm[run], outputs[run], outputs[ar_runs[p.combo.temperature]],
                                               timed[run], ar_records[p.combo.temperature], costs[run]))
        roof = _roofline(target, curve, cfg, accelerator, tick) if do_roofline else {
            "skipped": "no accelerator: pass --bandwidth-gbs to compare the CPU verify pass with a bandwidth"}
        if peer_skip:
            peer_report = {"skipped": peer_skip}
        else:
            peer_report = peer.run_peer(target, all_prompts[: cfg.peer_prompts], cfg.peer_new_tokens,
                                        cfg.peer_block_size, cfg.peer_repeats or cfg.repeats, _torch_threads(cfg),
                                        cfg.seed, tick)
    finally:
        bar.close()

    out = {
        "schema": SCHEMA,
        "command": cfg.command,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": _environment(),
        "settings": {**{k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("command", "progress")},
                     "cache_size": cache_size, "eos": "off: every call generates max_new_tokens tokens",
                     "batch": 1, "seeds": f"{cfg.seed} + prompt index", "curve_repeats": curve_repeats},
        "target": {"name": _target_name(cfg, target, given), "path": target.path,
                   "params": target.cfg.num_params, "layers": target.cfg.num_layers,
                   "hidden_size": target.cfg.hidden_size, "vocab_size": target.cfg.vocab_size,
                   "dtype": str(target.params["embed"].dtype), "random_weights": bool(cfg.shape) and not given},
        "prompts": {"source": source, "count": len(prompts), "lengths": [len(p) for p in prompts]},
        "intervals": INTERVALS,
        "ar": list(ar_records.values()),
        "combos": combo_records,
        "verify_curve": curve,
        "roofline": roof,
        "peer": peer_report,
    }
    out["plots"] = plots.write_plots(out, cfg.out)
    out["tables"] = {"main": report.main_table(out), "peer": report.peer_table(out),
                     "roofline": report.roofline_table(out)}
    out["wall_s"] = time.perf_counter() - start
    with open(os.path.join(cfg.out, "bench.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def _cost_context(prompt, continuation, take: int, cache_size: int) -> list[int]:
    """The text the cost profiles run at: the prompt and the first `take` generated tokens (the middle of a
    decode), fewer when the padded prefill (16-token buckets) would not fit the decode's cache."""
    while take and -(-(len(prompt) + take) // 16) * 16 >= cache_size:
        take -= 1
    return list(prompt) + list(continuation[:take])


def _target_name(cfg: BenchConfig, target: Target, given: bool) -> str:
    if given:
        return os.path.basename(os.path.normpath(target.path)) if target.path else "target"
    if cfg.shape or cfg.target.startswith("builtin:"):
        return target.path if cfg.shape else cfg.target
    return os.path.basename(os.path.normpath(cfg.target))


def _peer_skip(cfg: BenchConfig) -> str | None:
    if not cfg.peer:
        return "--no-peer"
    if cfg.shape:
        return f"the peer runs transformers on the CPU: a {cfg.shape} model does not fit its time budget"
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        return "the peer needs torch and transformers: pip install -e '.[test]'"
    return None


def _torch_threads(cfg: BenchConfig) -> int:
    return cfg.torch_threads or len(os.sched_getaffinity(0))


def _warm_up(runs, prompts, cfg: BenchConfig, tick):
    """Compile every method (both call lengths) and keep each prompt's full-length result."""
    outputs, results = {}, {}
    for run in runs:
        run.prefill_seconds(prompts[0], cfg.max_new_tokens, cfg.seed)
        tick(f"compile {run.label}")
        results[run] = []
        for i, p in enumerate(prompts):
            results[run].append(run.call(p, cfg.max_new_tokens, cfg.seed + i))
            tick(f"compile {run.label}")
        outputs[run] = [r.tokens[0] for r in results[run]]
    return outputs, results


def _cost_probes(target, ar_runs: dict, planned, context_tokens, cache_size: int, tick) -> dict:
    """Per run, the cost probes timed beside its calls (compiled here): {"verify": T(n) of its round's width,
    "draft": its drafter pass or None}; plain AR's verify probe is T(0), the target token step."""
    verify = {}

    def verify_probe(n):
        if n not in verify:
            verify[n] = timing.verify_probe(target, n, len(context_tokens), cache_size)
            tick(f"verify pass n={n}")
        return verify[n]

    probes = {run: {"verify": verify_probe(0), "draft": None, "pair": None} for run in ar_runs.values()}
    for p, run in planned:
        how = (SamplingParams(p.combo.temperature), rules.get_rule(p.combo.verifier).draft_policy)
        draft = timing.drafter_probe(target, p.drafter, p.params, context_tokens, cache_size, *how)
        pair = timing.pair_probe(target, p.drafter, p.params, context_tokens, cache_size, *how)
        tick(f"drafter pass {run.label}")
        probes[run] = {"verify": verify_probe(p.drafter.num_drafts), "draft": draft, "pair": pair}
    probes["step"] = verify_probe(0)
    return probes


def _timed(runs, prompts, cfg: BenchConfig, tick, probes: dict) -> tuple[dict, dict]:
    """Per run: (call_s, prefill_s, tokens, loop iterations), each [repeat][prompt], and its cost
    measurements {"verify_s", "draft_s", "step_s"}, each [repeat]. Methods are interleaved within a
    repeat, and each method's cost probes run right after its calls, so a repeat's round time and the
    costs it is split into see the same machine load."""
    rows = {run: ([], [], [], []) for run in runs}
    costs = {run: {"verify_s": [], "draft_s": [], "pair_s": [], "step_s": []} for run in runs}
    for _ in range(cfg.repeats):
        for run in runs:
            call_s, prefill_s, tokens, loops = [], [], [], []
            for i, p in enumerate(prompts):
                prefill_s.append(run.prefill_seconds(p, cfg.max_new_tokens, cfg.seed + i))
                tick(f"time {run.label}")
                res = run.call(p, cfg.max_new_tokens, cfg.seed + i)
                call_s.append(res.stats["wall_s"])
                tokens.append(res.stats["new_tokens"] - 1)
                loops.append(res.stats.get("loop_rounds", res.stats["rounds"]))
                tick(f"time {run.label}")
            for row, values in zip(rows[run], (call_s, prefill_s, tokens, loops)):
                row.append(values)
            probe = probes[run]
            verify_s = probe["verify"].seconds()
            costs[run]["verify_s"].append(verify_s)
            draft_s = probe["draft"].seconds() if probe["draft"] else 0.0
            costs[run]["draft_s"].append(draft_s)
            costs[run]["pair_s"].append(probe["pair"].seconds() if probe["pair"] else verify_s + draft_s)
            costs[run]["step_s"].append(verify_s if probe["verify"] is probes["step"] else probes["step"].seconds())
    return rows, costs


def _cost(rows, cost: dict) -> dict:
    call_s, prefill_s, _, loops = rows
    round_s = [(sum(c) - sum(p)) / sum(n) for c, p, n in zip(call_s, prefill_s, loops)]
    return metrics.round_costs(round_s, cost["verify_s"], cost["draft_s"], cost["step_s"], cost["pair_s"])


def _ar_record(run, temperature: float, rows, cost: dict) -> dict:
    call_s, prefill_s, tokens, _ = rows
    return {"label": run.label, "temperature": temperature, "timing": metrics.decode_timing(call_s, prefill_s, tokens),
            "cost": _cost(rows, cost)}


def _combo_record(p: combos.Planned, run, warm, outputs, ar_outputs, rows, ar_record, cost: dict) -> dict:
    stats = [r.stats for r in warm]
    depth = len(stats[0]["accepted_per_position"])
    acc = metrics.acceptance(
        rounds=sum(s["rounds"] for s in stats),
        committed=sum(s["new_tokens"] - 1 for s in stats),
        hist=[sum(s["accept_hist"][i] for s in stats) for i in range(depth + 1)],
        per_position=[sum(s["accepted_per_position"][i] for s in stats) for i in range(depth)],
        verified=sum(s["verified"] for s in stats),
    )
    call_s, prefill_s, tokens, _ = rows
    rec = metrics.decode_timing(call_s, prefill_s, tokens)
    c = p.combo
    exact = rules.get_rule(c.verifier).plain_tokens  # plain decoding's tokens; the others match in law only
    return {
        "label": run.label, "drafter": c.drafter, "drafter_short": combos.short_name(c.drafter),
        "drafter_class": type(p.drafter).__name__, "verifier": c.verifier, "kind": c.kind, "drafts": c.drafts,
        "max_depth": p.drafter.max_depth, "temperature": c.temperature,
        "acceptance": acc,
        "timing": rec,
        "speedup": metrics.speedup(ar_record["timing"], rec),
        "cost": _cost(rows, cost),
        "outputs_equal_ar": (outputs == ar_outputs) if exact else None,
    }


def _roofline(target: Target, curve: dict, cfg: BenchConfig, accelerator: bool, tick) -> dict:
    kind = jax.devices()[0].device_kind
    measured = timing.stream_bandwidth(2 * GIB if accelerator else 64 << 20)
    tick("memory bandwidth")
    peak = roofline.peak_bandwidth_gbs(kind)
    if cfg.bandwidth_gbs is not None:
        used, source = cfg.bandwidth_gbs * 1e9, "--bandwidth-gbs"
    elif peak is not None:
        used, source = peak * 1e9, f"spec sheet of {kind}"
    else:
        used, source = measured, "measured (streaming pass)"
    return {**roofline.verify_roofline(target, curve, used), "bandwidth_source": source, "device_kind": kind,
            "peak_gbs": peak, "measured_gbs": measured / 1e9}
