"""Cost of served_logprobs: sort-free thresholds vs the full-vocabulary sort reference, on CPU.

    python -m jspec.benchmarks.sampling_cost [--repeats 5] [--rows 17 136] [--vocab 32768 151936]

For each (rows, V) and each sampling setting, both functions are jitted and compiled, their served
supports are compared (a row may differ only by a boundary token whose mass sits within float32
summation rounding of top_p), and both are timed in interleaved repeats (old, new, old, new, ...) on
the same normal(0, 3) float32 logits; a timed call starts with the logits on the device and ends at
block_until_ready. Rows 17 = one verify pass of g = 16; 136 = a batch of 8 of them. The table gives
median old / median new (higher = the new one is faster) and, for scale only, the new median in ms
(on shared CPUs compare the ratios). Last, the number of `sort` ops and `TopK` custom calls in the
optimised HLO of both functions for every setting (the new one must have none).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.verify.sampling import SamplingParams, _served_logprobs_sorted, served_logprobs

_NEW = jax.jit(served_logprobs, static_argnums=1)
_OLD = jax.jit(_served_logprobs_sorted, static_argnums=1)


def _settings(vocab: int) -> dict[str, SamplingParams]:
    return {
        "top-k 50": SamplingParams(temperature=0.8, top_k=50),
        "top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
        "top-k 50 + top-p 0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
        "top-k V-1 + top-p 0.95": SamplingParams(temperature=1.0, top_k=vocab - 1, top_p=0.95),
    }


def _time(fn, logits, params) -> float:
    start = time.perf_counter()
    fn(logits, params).block_until_ready()
    return time.perf_counter() - start


def hlo_counts(fn, params: SamplingParams, rows: int, vocab: int) -> tuple[int, int]:
    """(sort ops, TopK custom calls) in the optimised HLO of jitted fn on this backend."""
    text = fn.lower(jax.ShapeDtypeStruct((rows, vocab), jnp.float32), params).compile().as_text()
    sorts = len(re.findall(r"\ssort\(", text))
    topk = len(re.findall(r'custom_call_target="TopK"', text))
    return sorts, topk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[17, 136])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    args = ap.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {args.repeats} interleaved repeats per cell")
    print(f"{'rows':>5} {'V':>7}  {'setting':<24} {'old/new':>8} {'new ms':>8}  support")
    rng = np.random.default_rng(0)
    for vocab in args.vocab:
        for rows in args.rows:
            logits = jnp.asarray(rng.normal(0.0, 3.0, (rows, vocab)), jnp.float32)
            for name, params in _settings(vocab).items():
                new = np.asarray(_NEW(logits, params))
                old = np.asarray(_OLD(logits, params))
                differ = int((np.isfinite(new) != np.isfinite(old)).any(-1).sum())
                t_old, t_new = [], []
                for _ in range(args.repeats):
                    t_old.append(_time(_OLD, logits, params))
                    t_new.append(_time(_NEW, logits, params))
                m_old, m_new = statistics.median(t_old), statistics.median(t_new)
                print(f"{rows:>5} {vocab:>7}  {name:<24} {m_old / m_new:>8.1f} {m_new * 1e3:>8.2f}  "
                      f"{'same' if not differ else f'differs in {differ} rows'}", flush=True)
    rows, vocab = args.rows[0], args.vocab[0]
    print(f"\noptimised {jax.default_backend()} HLO at rows {rows}, V {vocab}:")
    for name, params in _settings(vocab).items():
        for label, fn in (("new", _NEW), ("sort reference", _OLD)):
            sorts, topk = hlo_counts(fn, params, rows, vocab)
            print(f"  {label:<15} {name:<24} sort ops: {sorts}  TopK custom calls: {topk}")


if __name__ == "__main__":
    main()
