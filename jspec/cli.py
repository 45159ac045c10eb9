"""The `jspec` command.

    jspec generate --target PATH (--prompt TEXT | --prompt-ids 1,2,3) [--max-new-tokens N]
                   [--temperature T] [--top-k K] [--top-p P] [--seed S] [--json]
                   [--drafter none|lookup|PATH] [--verifier greedy|speculative|block|gumbel]
                   [--block-size G] [--tree-budget N] [--mesh data=D,fsdp=F,model=M]
    jspec train    target|FAMILY --config JSON --out RUN_DIR [--mesh data=D,fsdp=F,model=M]
    jspec convert  SRC OUT --q4 [--dtype bfloat16|float32]
    jspec demo     create a small random model in HF format, reload it and generate

    jspec --debug COMMAND ...   show the traceback of an error instead of one `jspec: error:` line
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (the served distribution)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=0, help="request seed; noise is keyed by (seed, position)")


def _mesh(args):
    """The mesh named by --mesh, or None (one device)."""
    if not args.mesh:
        return None
    from jspec import parallel

    return parallel.make_mesh(**parallel.parse_mesh(args.mesh))


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise SystemExit(f"jspec: --prompt-ids must be comma-separated integers, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    from jspec.drafters import family
    from jspec.verify import rules

    parser = argparse.ArgumentParser(prog="jspec", description="Lossless speculative decoding in JAX")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, show the full traceback instead of one `jspec: error:` message")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from a target checkpoint")
    gen.add_argument("--target", default=None,
                     help="Hugging Face model directory (Llama / Qwen3) or builtin:NAME "
                          "(default: builtin:code-target with the builtin:code-dflash drafter)")
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json beside the checkpoint)")
    src.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--cache-size", type=int, default=None,
                     help="KV cache rows (default: prompt + new, rounded up); a smaller cache stops the row early, "
                          "with a warning")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    _sampling_args(gen)
    sp = gen.add_argument_group("speculative decoding")
    sp.add_argument("--drafter", default=None,
                    help="none (plain autoregressive, the default with --target), "
                         + ", ".join(f"{n} ({family.get_family(n).summary})" for n in family.named())
                         + ", builtin:NAME, or the folder of a drafter checkpoint: "
                         + "; ".join(f.summary for f in family.FAMILIES.values() if f.detect))
    sp.add_argument("--kernels", default="reference", choices=["reference", "pallas", "auto"],
                    help="draft-layer and target-attention kernels (auto: Pallas on TPU/GPU, reference on CPU)")
    sp.add_argument("--verify-budget", action="store_true",
                    help="DSpark: profile the verify pass and verify only the drafts worth it (non-anticipating)")
    sp.add_argument("--compare", action="store_true",
                    help="also run plain AR decoding on the same prompt and report the speedup (on by default "
                         "without --target)")
    sp.add_argument("--verifier", default=None, choices=list(rules.RULES),
                    help="default: greedy at temperature 0, gumbel otherwise")
    sp.add_argument("--block-size", type=int, default=None,
                    help="draft tokens per round of a chain (default 4; a DFlash / DSpark checkpoint drafts the block "
                         "it was trained for, and refuses another)")
    sp.add_argument("--tree-budget", type=int, default=0, help="draft a token tree of N nodes (0 = chain)")
    gen.add_argument("--mesh", default=None, metavar="AXIS=SIZE,...",
                     help="run on a device mesh of axes data, fsdp, model, e.g. model=4 (tensor parallel; one "
                          "prompt needs data = fsdp = 1; data takes the devices left over); default: one device")

    tr = sub.add_parser("train", help="train the target LM or a drafter from a config")
    tr.add_argument("what", choices=["target", *family.trainable()],
                    help="the target LM, or a drafter of a family with a training recipe")
    tr.add_argument("--target", help="the target model directory (drafters)")
    tr.add_argument("--config", required=True, help="training config JSON (see configs/)")
    tr.add_argument("--out", required=True, help="run directory (checkpoints, metrics.jsonl, model/)")
    tr.add_argument("--steps", type=int, default=None, help="stop at this step (default: the config's)")
    tr.add_argument("--no-progress", action="store_true")
    tr.add_argument("--mesh", default=None, metavar="AXIS=SIZE,...",
                    help="train the target on a device mesh of axes data, fsdp, model, e.g. data=2,fsdp=4 (data "
                         "takes the devices left over); default: one device")

    from jspec.bench.cli import add_arguments as add_bench_arguments

    bench = sub.add_parser("bench", help="measure acceptance, speed and cost of speculative decoding side by side "
                                         "with plain AR and Hugging Face transformers; JSON report and PNG plots")
    add_bench_arguments(bench)

    demo = sub.add_parser("demo", help="create a small random model in HF format, reload it and generate")
    demo.add_argument("--out", default="demo_out/model", help="where to write the demo checkpoint")
    demo.add_argument("--max-new-tokens", type=int, default=48)

    conv = sub.add_parser("convert", help="rewrite a checkpoint in another format: --q4 quantizes a float target "
                                          "to affine Q4 group-64 weights (the MLX layout)")
    conv.add_argument("src", help="float HF checkpoint folder (dense or hybrid target)")
    conv.add_argument("out", help="folder to write (config.json, model.safetensors, tokenizer files)")
    conv.add_argument("--q4", action="store_true", help="quantize every matrix whose input dimension is a multiple "
                                                        "of 64 (embeddings and LM head included); norms stay float")
    conv.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                      help="dtype of the scales, biases and float tensors (default: the source's)")
    return parser


DEFAULT_PROMPT = "import os\n\n\ndef read_lines(path):\n    "


def cmd_generate(args) -> int:
    import time

    import jax.numpy as jnp

    import jspec

    if args.prompt is not None:
        _check_utf8(args.prompt)
    mesh = _mesh(args)
    showcase = args.target is None
    target_path = args.target or "builtin:code-target"
    drafter = args.drafter or ("builtin:code-dflash" if showcase else "none")
    compare = args.compare or showcase
    sampling = jspec.SamplingParams(args.temperature, args.top_k, args.top_p)
    target = jspec.load_target(target_path, dtype=jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32)
    if args.prompt_ids is not None:
        prompt = _parse_ids(args.prompt_ids)
    else:
        prompt = target.encode(args.prompt if args.prompt is not None else DEFAULT_PROMPT)
    kw = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, seeds=[args.seed], cache_size=args.cache_size,
              kernels=args.kernels, mesh=mesh)

    def run(d):
        """The request as asked (drafter none included: jspec.generate refuses the speculative arguments it
        would ignore), or with d == "ar" the plain AR baseline of --compare."""
        if d == "ar":
            return jspec.generate(target, [prompt], **kw)
        return jspec.generate(target, [prompt], drafter=d, verifier=args.verifier, block_size=args.block_size,
                              tree_budget=args.tree_budget, verify_budget="profile" if args.verify_budget else None,
                              **kw)

    res = run(drafter)
    if compare:  # compile plain AR too, then time both side by side
        run("ar")
        t0 = time.perf_counter()
        res = run(drafter)
        spec_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ar_res = run("ar")
        ar_s = time.perf_counter() - t0
        if ar_res.tokens != res.tokens and sampling.greedy:
            raise RuntimeError("speculative and plain greedy outputs differ: please report this bug")
        res.stats.update(spec_wall_s=spec_s, ar_wall_s=ar_s, speedup=ar_s / spec_s)
    _warn_if_cut_short(res, prompt, args, target.cfg)
    text = target.decode(res.tokens[0])
    if args.json:
        out = {"tokens": res.tokens[0], "stats": res.stats}
        if text is not None:
            out["text"] = text
        print(json.dumps(out))
        return 0
    if showcase:
        print(f"target {target_path}, drafter {drafter}, prompt:\n{target.decode(prompt)}", end="")
    print(text if text is not None else " ".join(map(str, res.tokens[0])))
    st = res.stats
    line = f"[{st['new_tokens']} tokens, {st['rounds']} rounds, tau {st['tau']:.2f}"
    if compare:
        line += f", {st['speedup']:.2f}x faster than plain AR in this run ({st['ar_wall_s']:.3f} s -> {st['spec_wall_s']:.3f} s)"
    else:
        line += f", {st['wall_s']:.3f} s with compilation"
    print(line + "]", file=sys.stderr if not showcase else sys.stdout)
    return 0


def _check_utf8(prompt: str) -> None:
    """--prompt arrives as the argv bytes decoded with surrogateescape: invalid UTF-8 shows up as lone
    surrogates, which no tokenizer takes. Name the byte instead."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raw = prompt.encode("utf-8", "surrogateescape")
        try:
            raw.decode("utf-8")
            where = ""
        except UnicodeDecodeError as err:
            where = f" (byte {raw[err.start]:#04x} at offset {err.start}: {err.reason})"
        raise ValueError(f"--prompt is not valid UTF-8 text{where}: pass UTF-8 text (e.g. convert it with iconv), "
                         "or token ids with --prompt-ids") from None


def _warn_if_cut_short(res, prompt, args, cfg) -> None:
    """One stderr line when the row stopped before EOS and --max-new-tokens (a full cache or context)."""
    why = res.stats["stopped_by"][0]
    if why not in ("cache_full", "context_limit"):
        return
    n, need = len(res.tokens[0]), len(prompt) + args.max_new_tokens
    if why == "cache_full":
        cause = (f"the cache of {args.cache_size} rows is full (a prompt of {len(prompt)} tokens + --max-new-tokens "
                 f"{args.max_new_tokens} needs {need}): raise --cache-size to at least {need}, or leave it unset")
    else:
        cause = (f"the model's context of {cfg.max_position_embeddings} positions is full: lower --max-new-tokens "
                 "or shorten the prompt")
    print(f"jspec: warning: generation stopped after {n} of {args.max_new_tokens} new tokens: {cause}",
          file=sys.stderr)


def cmd_train(args) -> int:
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1 (the step to stop at), got {args.steps}")
    if args.mesh and args.what != "target":
        raise ValueError(f"--mesh trains the target only; a {args.what} drafter trains on one device: "
                         f"drop --mesh from `jspec train {args.what}`")
    if args.what == "target":
        from jspec.train import lm

        model_dir = lm.pretrain_target(args.config, args.out, steps=args.steps, progress=not args.no_progress,
                                       mesh=_mesh(args))
    else:
        from jspec.train import distill

        if not args.target:
            raise ValueError(f"training a {args.what} drafter needs --target PATH (the trained target model)")
        model_dir = distill.train_drafter(args.what, args.config, args.target, args.out, steps=args.steps,
                                          progress=not args.no_progress)
    print(f"trained model written to {model_dir}")
    return 0


def cmd_demo(args) -> int:
    import time

    import jspec
    from jspec.demo import create_demo_model

    print("jspec demo: no trained built-in model exists yet, so this demo creates a small Qwen3-shaped model")
    print("with RANDOM weights and a BPE tokenizer trained on local Python sources, saves it in Hugging Face")
    print(f"format to {args.out}, reloads it strictly and generates. Random weights give meaningless text.\n")
    create_demo_model(args.out)
    target = jspec.load_target(args.out)
    print(f"reloaded {args.out}: {target.cfg.family}, {target.cfg.num_layers} layers, "
          f"{target.cfg.num_params / 1e6:.2f}M parameters, vocabulary {target.cfg.vocab_size}")
    prompt = "def fibonacci(n):\n    "
    ids = target.encode(prompt)
    for label, sampling in [("greedy", jspec.SamplingParams(0.0)), ("T=1, seed 0", jspec.SamplingParams(1.0))]:
        jspec.generate(target, [ids], max_new_tokens=args.max_new_tokens, sampling=sampling, eos_ids=[])  # compile
        t0 = time.perf_counter()
        res = jspec.generate(target, [ids], max_new_tokens=args.max_new_tokens, sampling=sampling, eos_ids=[])
        dt = time.perf_counter() - t0
        print(f"--- {label}: {len(res.tokens[0])} tokens, {1e3 * dt / len(res.tokens[0]):.2f} ms/token "
              f"(one compiled while_loop, after compile)")
        print(repr(prompt + target.decode(res.tokens[0])))
    return 0


def cmd_convert(args) -> int:
    from jspec.api import resolve_path
    from jspec.io.q4 import convert_q4

    if not args.q4:
        raise ValueError("jspec convert needs a target format: --q4 (affine Q4 group-64 weights)")
    src = resolve_path(args.src)
    if os.path.abspath(src) == os.path.abspath(args.out):
        raise ValueError(f"convert {src!r} into a different folder (OUT is the source)")
    info = convert_q4(src, args.out, args.dtype)
    print(f"wrote {args.out}: {info['quantized']} matrices in Q4, {info['float']} float tensors, "
          f"{info['bytes'] / 1e6:.2f} MB (float source {info['source_bytes'] / 1e6:.2f} MB)")
    return 0


def cmd_bench(args) -> int:
    from jspec.bench.cli import main as bench_main

    return bench_main(args)


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


def run_command(args) -> int:
    """Run parsed `jspec` arguments. jspec's own errors (`jspec.errors.JspecError`: damaged checkpoints, a
    diverged training run, ...), bad values (ValueError) and file errors (OSError: a missing file, a full
    disk, ...) are reported as one `jspec: error: ...` message, exit code 2; `jspec --debug` re-raises
    them, showing the traceback."""
    import errno

    from jspec.errors import JspecError

    try:
        return {"generate": cmd_generate, "train": cmd_train, "bench": cmd_bench, "demo": cmd_demo,
                "convert": cmd_convert}[args.command](args)
    except (JspecError, ValueError, FileNotFoundError, OSError) as err:  # bad input, damaged or missing files
        if getattr(args, "debug", False):
            raise
        message = str(err)
        if isinstance(err, OSError) and err.strerror and err.filename:  # e.g. "[Errno 28] ...: 'path'"
            message = f"{err.strerror}: {err.filename}"
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                message += " (the disk is full: free some space, or write somewhere else)"
        print(f"jspec: error: {message or type(err).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
