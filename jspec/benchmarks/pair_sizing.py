"""Sizing a target / DFlash pair for this machine: the tau a speedup needs, measured in the real decode loops.

    python -m jspec.benchmarks.pair_sizing [--target-layers 4,8,12,16] [--draft-layers 1,2,3] [--blocks 4,8]

Random-weight Qwen3-shaped targets of the built-in models' width (hidden 256, MLP 768, 4096-token
vocabulary, float32) at several depths, each with random-weight DFlash drafters of several depths (draft
layers of the target's width, reading up to 3 target layers). Both compiled loops run for real, batch 1,
greedy: plain AR gives the token step, the speculative loop the round (verify pass, drafter pass, commit,
rule, loop control). Shapes are static, so a round costs the same whatever it accepts, and random weights
time it as well as trained ones. Each cost is the difference of two calls of different lengths divided by
the difference of their loop iterations (prefill and call overhead cancel), median of interleaved repeats.

    tau needed for a speedup S = S * round_s / step_s

(tau counts the tokens a round commits: at most the block size.) `--gemm` adds the matrix product behind
the verify pass's cost on this CPU: XLA's [m, 256] x [256, 768] product (the weight stored [out, in], as
jspec stores it) against torch's `linear` on the same shapes, m = rows of the pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.api import Target
from jspec.demo import DEMO_CONFIG
from jspec.drafters import dflash as dfl
from jspec.models.transformer import init_params

WIDTH = dataclasses.replace(DEMO_CONFIG, vocab_size=4096)  # the built-in target's shape but its depth
PROMPT = list(range(5, 53))  # 48 token ids; random weights make any prompt as good as another
SHORT, LONG = 16, 80  # new tokens of the two calls whose difference is timed


def taps(layers: int) -> tuple[int, ...]:
    """Up to three target layers spread over the depth (1, the middle one, the second last), as DFlash's
    checkpoints read them."""
    return tuple(sorted({1, layers // 2, layers - 2})) if layers >= 4 else tuple(range(layers))


def per_iteration(call, repeats: int) -> float:
    """Seconds per loop iteration: (t(LONG) - t(SHORT)) / (iterations(LONG) - iterations(SHORT)), each call
    compiled before timing; the median over repeats of the two calls back to back."""
    runs = {n: call(n) for n in (SHORT, LONG)}  # compiles both lengths
    iters = {n: r.stats.get("loop_rounds", r.stats["rounds"]) for n, r in runs.items()}
    if iters[LONG] <= iters[SHORT]:
        raise RuntimeError(f"the long call ran {iters[LONG]} iterations, the short one {iters[SHORT]}")
    out = []
    for _ in range(repeats):
        t = {}
        for n in (SHORT, LONG):
            t0 = time.perf_counter()
            call(n)
            t[n] = time.perf_counter() - t0
        out.append((t[LONG] - t[SHORT]) / (iters[LONG] - iters[SHORT]))
    return statistics.median(out)


def measure(target_layers: int, draft_layers: tuple[int, ...], blocks: tuple[int, ...], repeats: int) -> list[dict]:
    cfg = dataclasses.replace(WIDTH, num_layers=target_layers)
    target = Target(cfg, init_params(cfg, jax.random.key(0), std=0.05), None, f"random:{target_layers}-layer")
    kw = dict(eos_ids=[], cache_size=len(PROMPT) + LONG + 32)
    step_s = per_iteration(lambda n: jspec.generate(target, [PROMPT], max_new_tokens=n, **kw), repeats)
    rows = []
    for dl in draft_layers:
        for block in blocks:
            dcfg = dfl.DFlashConfig(layers=dataclasses.replace(cfg, num_layers=dl),
                                    target_layer_ids=taps(target_layers), num_target_layers=target_layers,
                                    mask_token_id=0, block_size=block)
            drafter = (dfl.DFlash(cfg=dcfg), dfl.init_params(dcfg, jax.random.key(1)))
            round_s = per_iteration(lambda n: jspec.generate(target, [PROMPT], max_new_tokens=n, drafter=drafter,
                                                             verifier="greedy", **kw), repeats)
            rows.append({"target_layers": target_layers, "params_m": cfg.num_params / 1e6, "step_ms": 1e3 * step_s,
                         "draft_layers": dl, "block": block, "round_steps": round_s / step_s})
    return rows


def gemm_table(rows_m=(1, 2, 4, 8, 16), repeats: int = 7) -> list[tuple[int, float, float | None]]:
    """(m, XLA microseconds, torch microseconds or None) for [m, 256] x [768, 256]^T, 12 weight matrices in
    turn (9.4 MB, beyond the per-core L2) inside one compiled loop."""
    ws = [jnp.asarray(np.random.default_rng(i).standard_normal((768, 256)) * 0.03, jnp.float32) for i in range(12)]
    inner = 32
    out = []
    for m in rows_m:
        x = jnp.ones((m, 256), jnp.float32)

        @jax.jit
        def loop(x, ws):
            def body(_, x):
                for w in ws:
                    x = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))[:, :256] * 0.01
                return x
            return jax.lax.fori_loop(0, inner, body, x)

        jax.block_until_ready(loop(x, ws))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(loop(x, ws))
            times.append((time.perf_counter() - t0) / inner / len(ws))
        out.append((m, 1e6 * statistics.median(times), _torch_linear_us(m, [np.asarray(w) for w in ws], repeats)))
    return out


def _torch_linear_us(m: int, ws, repeats: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    tw = [torch.from_numpy(np.array(w)) for w in ws]
    x = torch.ones(m, 256)
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(32):
                for w in tw:
                    x = torch.nn.functional.linear(x, w)[:, :256] * 0.01
            times.append((time.perf_counter() - t0) / 32 / len(tw))
    return 1e6 * statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    ap.add_argument("--target-layers", type=ints, default=(4, 8, 12, 16))
    ap.add_argument("--draft-layers", type=ints, default=(1, 2, 3))
    ap.add_argument("--blocks", type=ints, default=(4, 8))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gemm", action="store_true", help="also time the verify pass's matrix product, XLA vs torch")
    args = ap.parse_args(argv)
    print(f"random Qwen3-shaped targets (hidden 256, vocabulary 4096, float32) and DFlash drafters, batch 1, greedy, "
          f"{jax.devices()[0].platform}; median of {args.repeats} repeats\n")
    print("| target layers | params | AR step ms | draft layers | block | round / AR step | tau for 1.5x | "
          "tau for 2x | tau for 2.5x |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for layers in args.target_layers:
        for r in measure(layers, args.draft_layers, args.blocks, args.repeats):
            need = [s * r["round_steps"] for s in (1.5, 2.0, 2.5)]
            cells = [f"{t:.2f}" + ("" if t <= r["block"] else " (> block)") for t in need]
            print(f"| {layers} | {r['params_m']:.1f}M | {r['step_ms']:.2f} | {r['draft_layers']} | {r['block']} | "
                  f"{r['round_steps']:.2f} | " + " | ".join(cells) + " |", flush=True)
    if args.gemm:
        print("\n| rows m | XLA us per [m,256]x[256,768] | torch linear us | XLA / torch | XLA m rows / XLA 1 row |")
        print("| --- | --- | --- | --- | --- |")
        table = gemm_table(repeats=args.repeats)
        for m, xla, tor in table:
            ratio = "-" if tor is None else f"{xla / tor:.2f}"
            print(f"| {m} | {xla:.1f} | {'-' if tor is None else f'{tor:.1f}'} | {ratio} | {xla / table[0][1]:.2f} |")


if __name__ == "__main__":
    main()
