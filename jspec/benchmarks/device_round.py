"""Decode rounds timed on a real accelerator against the bytes they move: the `--aot` table, measured.

    python -m jspec.benchmarks.device_round [--shape qwen3-8b] [--cases ...] [--json OUT]

`jspec bench --aot CHIP` reads bytes per round from the optimized HLO of a compile for a chip that is not
there. This runs the same loops (`jspec.aot.bench.case_program`: bf16 random weights at `--shape`, the
DFlash-b16 drafter of z-lab's shape, chain or DDTree) on the default device and prints per case, all
measured in this one process:
- the device's copy bandwidth (`jspec.bench.timing.stream_bandwidth`: an in-place elementwise pass
  over a large array, bytes read + written);
- seconds per round: the loop run for two generation lengths from one long prompt (the context
  stays within a few hundred rows of the case's), the difference of the wall times over the
  difference of the loop iterations, so prefill and set-up cancel; median of `--repeats`;
- bytes per round from the optimized HLO of the same program (`jspec.aot.hlo_bytes`), the ideal bytes
  (`jspec.aot.bench.ideal_bytes`: one weight read plus the valid K/V) and their ratio;
- achieved = ideal bytes / (seconds per round x measured bandwidth): the fraction of the roofline the
  round reaches in time (1.0 = the round costs exactly its ideal bytes at the copy bandwidth), and
  hlo-time = HLO bytes / bandwidth against the measured round (how much of the round's time its
  bytes explain; the rest is launch gaps, compute and synchronisation).
Random weights accept almost no drafts, which does not change what a round costs. EOS is disabled so
every call runs its full length. Cases over `--budget` seconds of wall time are skipped, not run.
On CPU use `--shape tiny` (the tests do); an accelerator's figures are what the README reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax

from jspec.aot import bench as aot_bench
from jspec.aot import hlo_bytes
from jspec.bench.timing import stream_bandwidth

DEFAULT_CASES = ("chain-1-4k-greedy", "ar-1-4k-greedy", "chain-8-4k-top-p", "tree-1-4k-greedy", "chain-1-4k-top-p")


def parse_case(text: str) -> aot_bench.Case:
    """"chain-1-4k-greedy" -> Case: kind (ar | chain | tree), batch, context (k = 1024 rows), verifier."""
    try:
        kind, batch, context, verifier = text.split("-", 3)
        if kind not in ("ar", "chain", "tree") or not context.endswith("k"):
            raise ValueError
        return aot_bench.Case("ar" if kind == "ar" else "spec", int(batch), int(context[:-1]) * 1024, verifier,
                              aot_bench.TREE_BUDGET if kind == "tree" else 0)
    except ValueError:
        raise SystemExit(f"bad case {text!r}: write KIND-BATCH-CONTEXTk-VERIFIER, e.g. chain-1-4k-greedy "
                         f"(KIND ar, chain or tree; VERIFIER greedy or top-p)") from None


def _with_length(args: tuple, new_tokens: int) -> tuple:
    """The loop's arguments with its DecodeConfig (or SpecConfig.decode) asking for `new_tokens` and no EOS."""
    out = []
    for a in args:
        if hasattr(a, "max_new_tokens"):
            a = dataclasses.replace(a, max_new_tokens=new_tokens, eos_ids=())
        elif hasattr(a, "decode") and hasattr(a.decode, "max_new_tokens"):
            a = dataclasses.replace(a, decode=dataclasses.replace(a.decode, max_new_tokens=new_tokens, eos_ids=()))
        out.append(a)
    return tuple(out)


def _iterations(state) -> int:
    """Loop iterations a finished state records (speculative rounds, or AR steps)."""
    if hasattr(state, "stats"):
        return int(jax.device_get(state.stats.loop_rounds).max())
    return int(jax.device_get(state.steps).max())


def run_case(shape: str, case: aot_bench.Case, lengths: tuple[int, int], repeats: int, bandwidth: float,
             kernels: str = "reference") -> dict:
    """Measured seconds per round of one case, and its HLO and ideal bytes."""
    short, long = lengths
    prompt_len = case.context - long - 64  # room for the longer generation and the verify rows
    program = aot_bench.case_program(shape, case, kernels, seed=0, prompt_len=prompt_len)
    start = time.perf_counter()
    compiled = program.loop.lower(*program.args).compile()
    compile_s = time.perf_counter() - start
    text = compiled.as_text()
    row = aot_bench.score("h200", shape, case, text, hlo_bytes.memory_stats(compiled),
                          {**program.info, "compile_s": compile_s})
    calls = {n: _with_length(program.args, n) for n in lengths}
    iters = {n: _iterations(jax.block_until_ready(program.loop(*calls[n]))) for n in lengths}  # compiles, warms
    times = {n: [] for n in lengths}
    for _ in range(repeats):
        for n in lengths:  # interleaved
            t0 = time.perf_counter()
            jax.block_until_ready(program.loop(*calls[n]))
            times[n].append(time.perf_counter() - t0)
    round_s = (statistics.median(times[long]) - statistics.median(times[short])) / (iters[long] - iters[short])
    ideal, hlo = row["ideal"], row["bytes"]["total"]
    return {"case": case.label, "shape": shape, "round_s": round_s, "iterations": iters, "hlo_bytes": hlo,
            "ideal_bytes": ideal, "hlo_ratio": row["ratio"], "achieved": ideal / (round_s * bandwidth),
            "hlo_time_share": hlo / bandwidth / round_s, "kernels": row["kernels"], "compile_s": compile_s,
            "bandwidth": bandwidth, "memory": row["memory"], "device": jax.devices()[0].device_kind}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(aot_bench.shapes()))
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES),
                    help="comma-separated KIND-BATCH-CONTEXTk-VERIFIER, e.g. chain-1-4k-greedy")
    ap.add_argument("--lengths", default="32,160", help="the two generation lengths whose difference is timed")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bandwidth-gb", type=float, default=4.0, help="array size of the bandwidth pass (GB)")
    ap.add_argument("--budget", type=float, default=420.0, help="skip the cases left after this many seconds")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    if len(lengths) != 2 or not 0 < lengths[0] < lengths[1]:
        raise SystemExit(f"--lengths takes two increasing generation lengths, e.g. 32,160; got {args.lengths!r}")
    selected = [parse_case(c) for c in args.cases.split(",")]
    start = time.perf_counter()
    bandwidth = stream_bandwidth(int(args.bandwidth_gb * 1e9))
    print(f"{jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}; shape {args.shape}, "
          f"bf16; copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write)", flush=True)
    print(f"{'case':26s} {'ms/round':>9s} {'HLO GB':>7s} {'ideal GB':>8s} {'ideal/HLO':>9s} {'achieved':>8s} "
          f"{'HLO time':>8s} {'kernels':>7s} {'compile s':>9s}", flush=True)
    rows = []
    for case in selected:
        if time.perf_counter() - start > args.budget:
            print(f"{case.label:26s} skipped: past the {args.budget:.0f} s budget", flush=True)
            continue
        try:
            r = run_case(args.shape, case, lengths, args.repeats, bandwidth)
        except Exception as e:  # noqa: BLE001 - one failed case is reported in its row and the others still run
            print(f"{case.label:26s} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
            rows.append({"case": case.label, "error": f"{type(e).__name__}: {e}"[:2000]})
            continue
        rows.append(r)
        print(f"{r['case']:26s} {r['round_s'] * 1e3:9.3f} {r['hlo_bytes'] / 1e9:7.2f} {r['ideal_bytes'] / 1e9:8.2f} "
              f"{r['hlo_ratio']:9.3f} {r['achieved']:8.3f} {r['hlo_time_share']:8.2f} {r['kernels']:7.0f} "
              f"{r['compile_s']:9.1f}", flush=True)
    print("achieved = ideal bytes / (ms per round x copy bandwidth); HLO time = HLO bytes / bandwidth / round time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
