"""`jspec bench`: the options and the command (jspec.cli adds the subcommand and delegates here).

Every option defaults to None so that `--quick` can fill in its own settings and explicit options win.
"""

from __future__ import annotations

import argparse
import shlex
import sys


def _ints(text: str) -> tuple[int, ...]:
    """'4,8' -> (4, 8); '1-32' -> (1, ..., 32); both forms mix: '1-4,8'."""
    out = []
    try:
        for part in text.replace(" ", "").split(","):
            if "-" in part.strip("-"):
                lo, hi = part.split("-")
                out.extend(range(int(lo), int(hi) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers or ranges like 1-32, got {text!r}")
    if not out:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return tuple(out)


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")


def _names(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="a short run (under a minute on 2 idle CPU cores, under 2.5 minutes beside a test suite): 3 "
                        "prompts x 64 tokens, 8 repeats, block size 4, chains, T=0, verify widths 1,4,8, peer 1 "
                        "prompt x 32 tokens x 2 repeats")
    m = p.add_argument_group("what to measure (the product of the lists; impossible combinations are refused)")
    m.add_argument("--target", help="HF model directory or builtin:NAME (default builtin:code-target)")
    m.add_argument("--drafters", type=_names,
                   help="comma list: lookup, builtin:NAME, or checkpoint folders "
                        "(default builtin:code-dflash,builtin:code-dspark,lookup)")
    m.add_argument("--verifiers", type=_names,
                   help="comma list of auto, greedy, speculative, block, gumbel "
                        "(default auto: greedy at T=0, gumbel otherwise)")
    m.add_argument("--block-sizes", type=_ints,
                   help="draft tokens per round for lookup and small-LM drafters (default 2,4,8,16); "
                        "DFlash / DSpark draft their checkpoint's block")
    m.add_argument("--tree-budgets", type=_ints, help="0 = chain, N = a token tree of N nodes (default 0,16)")
    m.add_argument("--temperatures", type=_floats, help="comma list (default 0,1)")
    s = p.add_argument_group("workload")
    s.add_argument("--prompts", type=int, help="held-out prompts (default 8)")
    s.add_argument("--prompt-len", type=int, help="tokens per prompt (default 48)")
    s.add_argument("--max-new-tokens", type=int, help="tokens generated per prompt (default 128)")
    s.add_argument("--repeats", type=int, help="timed repeats (default 5)")
    s.add_argument("--verify-widths", type=_ints, help="n of the verify-cost curve T(n)/T(1) (default 1-32)")
    s.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="target weights (default float32; bfloat16 with --shape)")
    s.add_argument("--seed", type=int, help="prompt choice and sampling seeds (default 0)")
    q = p.add_argument_group("peer (Hugging Face transformers on the CPU, same target)")
    q.add_argument("--no-peer", action="store_true", help="skip the transformers comparison")
    q.add_argument("--peer-prompts", type=int, help="prompts for the peer (default 4)")
    q.add_argument("--peer-new-tokens", type=int, help="tokens per prompt for the peer (default 64)")
    q.add_argument("--peer-repeats", type=int, help="timed repeats of the peer (default: --repeats)")
    q.add_argument("--peer-block-size", type=int, help="draft tokens per round on both sides (default 4)")
    q.add_argument("--torch-threads", type=int, help="torch threads (default: the CPUs this process may use)")
    a = p.add_argument_group("accelerators")
    a.add_argument("--shape", choices=["qwen3-8b"],
                   help="time a random-weight model of this shape instead of --target (needs an accelerator; "
                        "acceptance is meaningless with random weights, timing is not); unless given, drafters "
                        "lookup and --quick's block sizes, tree budgets, temperatures and verify widths")
    a.add_argument("--allow-cpu", action="store_true", help="let --shape run on the CPU (very slow)")
    a.add_argument("--bandwidth-gbs", type=float,
                   help="memory bandwidth for the roofline (default: the spec sheet's for known accelerators, else "
                        "measured); on the CPU the roofline is reported only with this option")
    x = p.add_argument_group("deviceless compile (no accelerator needed: bytes per round from the compiled HLO)")
    x.add_argument("--aot", choices=["tpu-v5e", "tpu-v5p", "tpu-v6e", "h200"],
                   help="compile the speculative and AR loops of --shape (default qwen3-8b) for this chip without "
                        "one and report HBM bytes per decode round against the ideal (jspec.aot); needs libtpu / "
                        "jax-cuda12-plugin (pip install 'jspec[aot]', or the .venv-aot interpreter of `make test`)")
    x.add_argument("--aot-quick", action="store_true",
                   help="with --aot: batch 1, context 4k, greedy only (chain, tree, AR: 3 compiles)")
    x.add_argument("--aot-shape", help="with --aot: a shape of jspec.aot.bench.shapes() instead of --shape "
                                       "(e.g. tiny, a 4-layer model for tests)")
    x.add_argument("--aot-kernels", choices=["reference", "pallas"],
                   help="with --aot: the loops' attention and draft-layer implementation (default reference; "
                        "pallas: the Pallas kernels of jspec.kernels, compiled for the chip)")
    x.add_argument("--aot-layer-loop", choices=["unroll", "scan"],
                   help="with --aot: the target's layer loop (ModelConfig.layer_loop; default scan on TPU, unroll "
                        "on GPU): stacked weights and caches scanned over, or per-layer arrays and an unrolled loop")
    x.add_argument("--q4", action="store_true",
                   help="with --aot: the target's matrices in affine Q4 group-64 form (9/16 byte per weight), "
                        "multiplied by the XLA dequantizing matmul or, with --aot-kernels pallas, the Q4 kernel")
    x.add_argument("--json", help="with --aot: write the table's rows to this JSON file")
    o = p.add_argument_group("output")
    o.add_argument("--out", help="folder for bench.json and the PNG plots (default bench_out)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def aot_main(args) -> int:
    """`--aot CHIP`: run jspec.aot.bench here if this process can compile for CHIP, else re-execute
    the same command with the AOT interpreter and the chip's environment (jax reads it at start-up)."""
    import os
    import subprocess

    from jspec.aot import devices

    chip = args.aot
    shape = args.aot_shape or args.shape or "qwen3-8b"
    if os.environ.get("JSPEC_AOT_CHILD") != "1" and needs_reexec(chip):
        python = devices.aot_python()
        env = {**os.environ, **devices.aot_env(chip), "JSPEC_AOT_CHILD": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (devices.package_root(), env.get("PYTHONPATH")) if p)
        words = shlex.split(command_line(args))[1:]
        print(f"re-running with {python} and {' '.join(f'{k}={v}' for k, v in devices.aot_env(chip).items())}",
              file=sys.stderr)
        return subprocess.run([python, "-m", "jspec.cli", *words], env=env).returncode
    from jspec.aot import bench

    selected = bench.cases(**(bench.QUICK if args.aot_quick else {}))
    rows = bench.run(chip, shape, selected, json_path=args.json, kernels=args.aot_kernels or "reference", q4=args.q4,
                     layer_loop=args.aot_layer_loop)
    return 0 if rows else 1


def needs_reexec(chip: str) -> bool:
    """True when this process cannot compile for `chip`: the plugin is missing, or jax has started its
    back ends with a different environment."""
    import importlib.util

    from jspec.aot import devices

    if importlib.util.find_spec(devices.plugin_module(chip)) is None:
        return True
    if not devices.env_mismatch(chip):
        return False
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


SHAPE_AXES = ("block_sizes", "tree_budgets", "temperatures", "verify_widths")


def config_from_args(args):
    """BenchConfig from parsed options: defaults, then --quick's settings, then every explicit option."""
    import dataclasses

    from jspec.bench.run import QUICK, BenchConfig

    cfg = BenchConfig(quick=args.quick, command=command_line(args))
    if args.quick:
        cfg = dataclasses.replace(cfg, **QUICK)
    if args.shape:  # the built-in drafters do not fit a --shape target; each compile of a large model is slow
        cfg = dataclasses.replace(cfg, drafters=("lookup",), **{k: QUICK[k] for k in SHAPE_AXES})
    explicit = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchConfig)
                if f.name not in ("peer", "progress", "allow_cpu", "quick", "command")
                and getattr(args, f.name, None) is not None}
    return dataclasses.replace(cfg, **explicit, peer=not args.no_peer, progress=not args.no_progress,
                               allow_cpu=args.allow_cpu)


def command_line(args) -> str:
    """The command as given, rebuilt from the parsed options (recorded in the JSON report)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    words = ["jspec", "bench"]
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or value in (None, False):
            continue
        words.append(action.option_strings[0])
        if value is not True:
            words.append(",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
                         if isinstance(value, tuple) else str(value))
    return shlex.join(words)


def main(args) -> int:
    if getattr(args, "aot", None):
        return aot_main(args)
    if any(getattr(args, k, None) for k in ("aot_quick", "aot_shape", "aot_kernels", "aot_layer_loop", "q4", "json")):
        raise SystemExit("--aot-quick, --aot-shape, --aot-kernels, --aot-layer-loop, --q4 and --json go with --aot CHIP")
    from jspec.bench.run import run_bench

    cfg = config_from_args(args)
    rep = run_bench(cfg)
    print(f"\n{rep['target']['name']}: {rep['prompts']['count']} {rep['prompts']['source']}; "
          f"{cfg.max_new_tokens} new tokens, "
          f"{cfg.repeats} repeats, {rep['environment']['platform']} ({rep['environment']['device_kind']})\n")
    print(rep["tables"]["main"])
    if rep["tables"]["peer"]:
        print(f"\npeer: Hugging Face transformers {rep['peer']['transformers']} on the CPU "
              f"({rep['peer']['torch_threads']} torch threads), {rep['peer']['prompts']} prompts x "
              f"{rep['peer']['max_new_tokens']} tokens\n")
        print(rep["tables"]["peer"])
    else:
        print(f"\npeer skipped: {rep['peer']['skipped']}")
    if rep["tables"]["roofline"]:
        print(f"\nverify pass vs the memory-bandwidth roofline ({rep['roofline']['bandwidth_bytes_s'] / 1e9:.0f} GB/s, "
              f"{rep['roofline']['bandwidth_source']}; {rep['roofline']['weight_bytes'] / 1e9:.2f} GB of weights)\n")
        print(rep["tables"]["roofline"])
    print(f"\nwrote {cfg.out}/bench.json and {len(rep['plots'])} plots in {rep['wall_s']:.0f} s", file=sys.stderr)
    return 0
