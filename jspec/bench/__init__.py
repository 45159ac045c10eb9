"""`jspec bench`: the measurement instrument (DESIGN.md, "Measuring").

In one process, on the same prompts and weights: plain AR decoding and every requested (drafter,
verifier, block size, tree budget, temperature) combination; acceptance (tau, accepted-length
histogram, per-position conditional acceptance, survival), pooled decode rates with prefill timed
apart, speedup over AR from the same run, the drafter cost c, the verify-pass curve T(n)/T(1), loop
overhead, Hugging Face transformers' speculative decoding on the same target as a peer, and on an
accelerator the verify pass against the memory-bandwidth roofline. One JSON report and PNG plots.

    from jspec.bench import BenchConfig, run_bench
    report = run_bench(BenchConfig(target="path/to/model", drafters=("lookup",)))

Modules: run (the orchestration and BenchConfig), combos (the combinations, validated before any
compilation), timing (the timed intervals), metrics (pure summaries), peer, roofline, prompts, plots,
report (tables), cli (the subcommand's options).
"""

from __future__ import annotations

__all__ = ["BenchConfig", "run_bench"]


def __getattr__(name: str):
    # Lazy: `jspec --help` builds the bench parser without importing the measuring code.
    if name in __all__:
        from jspec.bench import run

        return getattr(run, name)
    raise AttributeError(f"module 'jspec.bench' has no attribute {name!r}")
