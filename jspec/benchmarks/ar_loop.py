"""ms per generated token at batch 1: one compiled while_loop vs a Python loop over a jitted step.

    python -m jspec.benchmarks.ar_loop [--new-tokens 128] [--cache-size 512] [--repeats 5]

Both paths run the same step function (jspec.decode.ar.decode_step) on the same ~3.3M-parameter
random-weight model and prompt, side by side in one process; the figures are medians of repeats,
compile excluded, prefill included in both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from jspec.decode import ar
from jspec.demo import DEMO_CONFIG
from jspec.models.transformer import count_params, init_params
from jspec.verify.sampling import SamplingParams


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--cache-size", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)

    cfg = DEMO_CONFIG
    params = init_params(cfg, jax.random.key(0), std=0.05)
    dcfg = ar.DecodeConfig(max_new_tokens=args.new_tokens, cache_size=args.cache_size,
                           sampling=SamplingParams(args.temperature), eos_ids=())
    prompt = jnp.arange(16, dtype=jnp.int32)[None] % cfg.vocab_size
    plen, seeds = jnp.array([16], jnp.int32), jnp.array([0], jnp.uint32)

    def while_loop():
        return ar.generate_ar(params, cfg, dcfg, prompt, plen, seeds).tokens.block_until_ready()

    def python_loop():
        state = ar.prefill_jit(params, cfg, dcfg, prompt, plen, seeds)
        for _ in range(args.new_tokens - 1):
            state = ar.decode_step_jit(params, cfg, dcfg, state)
        return state.tokens.block_until_ready()

    a, b = while_loop(), python_loop()  # compile both
    assert bool(jnp.all(a == b)), "the two loops disagree"
    times = {"while_loop": [], "python_loop": []}
    for _ in range(args.repeats):  # interleaved so that machine noise hits both alike
        for name, fn in [("while_loop", while_loop), ("python_loop", python_loop)]:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    print(f"model: {count_params(params) / 1e6:.2f}M parameters, {cfg.num_layers} layers, d={cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}; batch 1, cache {args.cache_size} rows, {args.new_tokens} new tokens, "
          f"{jax.devices()[0].platform}")
    med = {k: 1e3 * statistics.median(v) / args.new_tokens for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:12s} {med[k]:7.3f} ms/token (median of {len(v)}; min {1e3 * min(v) / args.new_tokens:.3f}, "
              f"max {1e3 * max(v) / args.new_tokens:.3f})")
    print(f"python_loop / while_loop = {med['python_loop'] / med['while_loop']:.2f}x")


if __name__ == "__main__":
    main()
