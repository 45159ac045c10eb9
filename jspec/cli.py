"""The `jspec` command (`jspec COMMAND --help` lists every option with its default).

    jspec generate [--target PATH|org/name|builtin:NAME] (--prompt TEXT | --prompt-ids 1,2,3 |
                   --input-file IN.jsonl [--output-file OUT.jsonl]) [--chat] [--max-new-tokens N]
                   [--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop TEXT] [--stop-id ID] [--json]
                   [--drafter none|lookup|PATH] [--verifier greedy|speculative|block|gumbel]
                   [--block-size G] [--tree-budget N] [--mesh data=D,fsdp=F,model=M]
    jspec train    target|FAMILY --config JSON|builtin:NAME --out RUN_DIR [--init MODEL_DIR]
                   [--mesh data=D,fsdp=F,model=M] [--distilled RUN_DIR]
    jspec convert  RUN_DIR OUT [--step N]   a training run's checkpoint, in its model's official format
    jspec convert  SRC OUT --q4 [--dtype bfloat16|float32]
    jspec demo     create a small random model in HF format, reload it and generate

    Any command: --quiet / --verbose (log levels), --compile-cache DIR / --no-compile-cache (JAX's
    persistent compilation cache, on by default), --debug (the traceback of an error instead of one
    `jspec: error:` line); jspec --version.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (the served distribution)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
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


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every option's default (when it has one worth showing)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS \
                or "%(default)" in (action.help or "") or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _common_options(suppress: bool) -> argparse.ArgumentParser:
    """Options every command takes, before or after its name (`jspec --quiet generate` = `jspec generate
    --quiet`); the subcommands' copies default to SUPPRESS so they never undo the top level's."""
    common = argparse.ArgumentParser(add_help=False)
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    g = common.add_argument_group("output and caching (any command)")
    g.add_argument("--debug", action="store_true", default=d(False),
                   help="on an error, show the full traceback instead of one `jspec: error:` message")
    loud = g.add_mutually_exclusive_group()
    loud.add_argument("-q", "--quiet", action="store_true", default=d(False),
                      help="only warnings and errors on stderr: no notes, no progress bars")
    loud.add_argument("-v", "--verbose", action="store_true", default=d(False),
                      help="also the libraries' logs (orbax, TFDS, grain, JAX compilation-cache hits)")
    g.add_argument("--compile-cache", metavar="DIR", default=d(None),
                   help="JAX's persistent compilation cache: a second run with the same shapes loads its programs "
                        "instead of compiling (default: $JSPEC_COMPILE_CACHE, else ~/.cache/jspec/jax; "
                        "JSPEC_COMPILE_CACHE=off turns it off)")
    g.add_argument("--no-compile-cache", action="store_true", default=d(False),
                   help="compile everything afresh and keep nothing")
    return common


def _version() -> str:
    from importlib import metadata

    from jspec import __version__

    def have(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    libs = ", ".join(f"{n} {have(n)}" for n in ("jax", "jaxlib", "flax", "numpy"))
    return f"jspec {__version__} ({libs}; Python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    from jspec.drafters import family
    from jspec.verify import rules

    parser = argparse.ArgumentParser(prog="jspec", description="Lossless speculative decoding in JAX",
                                     parents=[_common_options(suppress=False)], formatter_class=_Help)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _common_options(suppress=True)

    def add_parser(name, **kw):
        return sub.add_parser(name, parents=[common], formatter_class=_Help, **kw)

    gen = add_parser("generate", help="generate from a target checkpoint")
    gen.add_argument("--target", default=None,
                     help="Hugging Face model directory (Llama / Qwen3) or builtin:NAME "
                          "(default: builtin:code-target with the builtin:code-dflash drafter)")
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json beside the checkpoint)")
    src.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    src.add_argument("--input-file", metavar="JSONL",
                     help="batch generation: one request per line, {\"prompt\": TEXT} | {\"prompt_ids\": [...]} | "
                          "{\"messages\": [...]}, optional \"id\" (echoed) and \"seed\"; one result line each, in "
                          "order, to --output-file (default stdout)")
    gen.add_argument("--output-file", metavar="JSONL", default=None,
                     help="with --input-file: where the result lines go (written atomically at the end)")
    gen.add_argument("--batch-size", type=int, default=None,
                     help="with --input-file: requests per compiled call (default 8)")
    gen.add_argument("--chat", action="store_true",
                     help="render --prompt (or each JSONL prompt) as a user message through the model's chat "
                          "template, as transformers' apply_chat_template does")
    gen.add_argument("--system", default=None, help="with --chat: a system message before the prompt")
    gen.add_argument("--stop", action="append", default=None, metavar="TEXT",
                     help="end a row at the first generated text containing TEXT (repeatable; the printed text "
                          "ends before it)")
    gen.add_argument("--stop-id", action="append", type=int, default=None, metavar="ID",
                     help="end a row after token ID, like EOS (repeatable)")
    gen.add_argument("--max-new-tokens", type=int, default=64,
                     help="tokens to generate per prompt (prompt + this must fit the model's context)")
    gen.add_argument("--cache-size", type=int, default=None,
                     help="KV cache rows (default: prompt + new, rounded up); a smaller cache stops the row early, "
                          "with a warning")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                     help="the dtype the target's weights are loaded in")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    _sampling_args(gen)
    sp = gen.add_argument_group("speculative decoding")
    sp.add_argument("--drafter", default=None,
                    help="none (plain autoregressive, the default with --target), "
                         + ", ".join(f"{n} ({family.get_family(n).summary})" for n in family.named())
                         + ", builtin:NAME, or the folder of a drafter checkpoint: "
                         + "; ".join(f.summary for f in family.FAMILIES.values() if f.detect))
    sp.add_argument("--kernels", default="reference", choices=["reference", "pallas", "auto"],
                    help="draft-layer and target-attention kernels (auto: Pallas on TPU, reference on CPU and "
                         "GPU; Q4 matmuls: Pallas on TPU and GPU)")
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
    sp.add_argument("--loop-stages", type=int, default=1, metavar="S",
                    help="DLoop: up to S stages of a block drafter's chain per target check, while the drafter's "
                         "summed log-prob of the last stage exceeds --loop-threshold (1 = off)")
    sp.add_argument("--loop-threshold", type=float, default=None, metavar="T",
                    help="DLoop: draft another stage while the last stage's summed drafter log-prob exceeds T "
                         "(default -2.0)")
    sp.add_argument("--redraft-after", default=None, metavar="J[,J...]",
                    help="D-Loop: after the DFlash block, re-draft it with drafts 1..J revealed and keep the "
                         "regenerated suffix (one extra draft pass per boundary J)")
    sp.add_argument("--edit-passes", type=int, default=0, metavar="N",
                    help="DEdit: N passes after the DFlash block, each re-predicting every draft from the current "
                         "ones (0 = off)")
    gen.add_argument("--mesh", default=None, metavar="AXIS=SIZE,...",
                     help="run on a device mesh of axes data, fsdp, model, e.g. model=4 (tensor parallel; one "
                          "prompt needs data = fsdp = 1; data takes the devices left over); default: one device")

    tr = add_parser("train", help="train the target LM or a drafter from a config")
    tr.add_argument("what", choices=["target", *family.trainable()],
                    help="the target LM, or a drafter of a family with a training recipe")
    tr.add_argument("--target", help="the target model directory (drafters)")
    tr.add_argument("--config", required=True, help="training config JSON (see configs/)")
    tr.add_argument("--out", required=True, help="run directory (checkpoints, metrics.jsonl, model/)")
    tr.add_argument("--steps", type=int, default=None, help="stop at this step (default: the config's)")
    tr.add_argument("--init", default=None, metavar="MODEL_DIR",
                    help="start a new run from a checkpoint in the official format (target: a Hugging Face folder; "
                         "DFlash: z-lab; DSpark: DeepSpec; or builtin:NAME) instead of random parameters; its config "
                         "and tensors must be the run config's exactly (also \"init\" in the config's train section). "
                         "A run folder that has checkpoints resumes from them and ignores it")
    tr.add_argument("--distilled", default=None, metavar="RUN_DIR",
                    help="drafters: use the distilled sequences of another drafter run of the same target, data and "
                         "distill sections instead of distilling them again (checked, refused on any difference)")
    tr.add_argument("--no-progress", action="store_true", help="no progress bars (as --quiet, keeping the notes)")
    tr.add_argument("--mesh", default=None, metavar="AXIS=SIZE,...",
                    help="train the target on a device mesh of axes data, fsdp, model, e.g. data=2,fsdp=4 (data "
                         "takes the devices left over); default: one device")

    from jspec.bench.cli import add_arguments as add_bench_arguments

    bench = add_parser("bench", help="measure acceptance, speed and cost of speculative decoding side by side "
                                         "with plain AR and Hugging Face transformers; JSON report and PNG plots")
    add_bench_arguments(bench)

    demo = add_parser("demo", help="create a small random model in HF format, reload it and generate")
    demo.add_argument("--out", default="demo_out/model", help="where to write the demo checkpoint")
    demo.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate")

    conv = add_parser("convert", help="rewrite a checkpoint in another format: a training run's checkpoint in the "
                                      "official format of its model (Hugging Face target, z-lab DFlash, DeepSpec "
                                      "DSpark); --q4 quantizes a float target to affine Q4 group-64 weights (the MLX "
                                      "layout)")
    conv.add_argument("src", help="a training run folder (the --out of jspec train, finished or not), or with --q4 a "
                                  "float HF checkpoint folder (dense or hybrid target)")
    conv.add_argument("out", help="folder to write (config.json, model.safetensors, tokenizer files); a model folder "
                                  "there is replaced whole")
    conv.add_argument("--step", type=int, default=None,
                      help="the run's checkpoint of this step (default: the newest one that restores)")
    conv.add_argument("--q4", action="store_true", help="quantize every matrix whose input dimension is a multiple "
                                                        "of 64 (embeddings and LM head included); norms stay float")
    conv.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                      help="dtype of the written tensors; with --q4 of the scales, biases and float tensors "
                           "(default: the source's; a run's parameters are float32)")
    return parser


DEFAULT_PROMPT = "import os\n\n\ndef read_lines(path):\n    \"\"\"Return the lines of the file at path.\"\"\"\n    "


def _request_kwargs(args, mesh) -> dict:
    import jspec

    return dict(max_new_tokens=args.max_new_tokens,
                sampling=jspec.SamplingParams(args.temperature, args.top_k, args.top_p), cache_size=args.cache_size,
                kernels=args.kernels, mesh=mesh, stop=args.stop, stop_ids=args.stop_id)


def _chat_prompt(target, text: str, system: str | None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": text}]
    return target.apply_chat_template(messages, add_generation_prompt=True)


def _text(target, tokens, stops) -> str | None:
    """The continuation's text, cut before the first stop string (the tokens keep the completing token)."""
    from jspec.decode import stop

    text = target.decode(tokens)
    return text if text is None or not stops else stop.trim(text, stops)


def cmd_generate(args) -> int:
    import time

    import jax.numpy as jnp

    import jspec

    if args.prompt is not None:
        _check_utf8(args.prompt)
    if args.system is not None and not args.chat:
        raise ValueError("--system is a chat message: add --chat (the prompt becomes the user message)")
    for text in args.stop or ():
        _check_utf8(text, "--stop")
    if args.input_file is None and (args.output_file is not None or args.batch_size is not None):
        raise ValueError("--output-file and --batch-size go with --input-file (batch generation from JSONL)")
    if args.chat and args.prompt_ids is not None:
        raise ValueError("--chat renders text through the chat template, and --prompt-ids are token ids: pass the "
                         "user message with --prompt, or drop --chat")
    mesh = _mesh(args)
    showcase = args.target is None and args.input_file is None
    target_path = args.target or "builtin:code-target"
    drafter = args.drafter or ("builtin:code-dflash" if showcase else "none")
    compare = args.compare or showcase
    target = jspec.load_target(target_path, dtype=jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32)
    kw = _request_kwargs(args, mesh)
    spec_kw = dict(drafter=drafter, verifier=args.verifier, block_size=args.block_size, tree_budget=args.tree_budget,
                   verify_budget="profile" if args.verify_budget else None)
    wrapped = _wrapped(target, drafter, args)
    if wrapped is not None:
        spec_kw.update(drafter=wrapped, block_size=None, tree_budget=0)
    if args.input_file is not None:
        if compare:
            raise ValueError("--compare times one prompt against plain AR decoding: drop it with --input-file")
        return _generate_jsonl(args, target, {**kw, **spec_kw})
    if args.prompt_ids is not None:
        prompt = _parse_ids(args.prompt_ids)
    elif args.chat:
        if args.prompt is None:
            raise ValueError("--chat needs --prompt TEXT (the user message) or --input-file")
        prompt = _chat_prompt(target, args.prompt, args.system)
    else:
        prompt = target.encode(args.prompt if args.prompt is not None else DEFAULT_PROMPT)
    kw["seeds"] = [args.seed]

    def run(d):
        """The request as asked (drafter none included: jspec.generate refuses the speculative arguments it
        would ignore), or with d == "ar" the plain AR baseline of --compare."""
        if d == "ar":
            return jspec.generate(target, [prompt], **kw)
        return jspec.generate(target, [prompt], **kw, **spec_kw)

    res = run(drafter)
    if compare:  # compile plain AR too, then time both side by side
        run("ar")
        t0 = time.perf_counter()
        res = run(drafter)
        spec_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ar_res = run("ar")
        ar_s = time.perf_counter() - t0
        if ar_res.tokens != res.tokens and kw["sampling"].greedy:
            raise RuntimeError("speculative and plain greedy outputs differ: please report this bug")
        res.stats.update(spec_wall_s=spec_s, ar_wall_s=ar_s, speedup=ar_s / spec_s)
    _warn_if_cut_short(res, prompt, args, target.cfg)
    text = _text(target, res.tokens[0], args.stop)
    if args.json:
        out = {"tokens": res.tokens[0], "stats": res.stats}
        if text is not None:
            out["text"] = text
        print(json.dumps(out))
        return 0
    if showcase:
        print(f"target {target_path}, drafter {drafter}\n--- prompt ---\n{target.decode(prompt)}\n"
              "--- continuation ---")
    print(text if text is not None else " ".join(map(str, res.tokens[0])))
    st = res.stats
    line = f"[{st['new_tokens']} tokens, {st['rounds']} rounds, tau {st['tau']:.2f}"
    if compare:
        line += f", {speedup_words(st['speedup'])} than plain AR in this run ({st['ar_wall_s']:.3f} s -> " \
                f"{st['spec_wall_s']:.3f} s)"
    else:
        line += f", {st['wall_s']:.3f} s with compilation"
    print(line + "]", file=sys.stderr if not showcase else sys.stdout)
    return 0


def speedup_words(ratio: float) -> str:
    """'1.9x faster' / '0.8x (slower)': a ratio below 1 is never called faster."""
    return f"{ratio:.2f}x faster" if ratio >= 1 else f"{ratio:.2f}x (slower)"


JSONL_KEYS = ("prompt", "prompt_ids", "messages", "id", "seed")


def read_requests(path: str) -> list[dict]:
    """The requests of a JSONL file: one JSON object per non-blank line with exactly one of "prompt" (text),
    "prompt_ids" (token ids) or "messages" (a chat conversation), and optionally "id" and "seed". Every
    problem is one ValueError naming the file, the line and the fix."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}, line {n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where} is not JSON ({err.msg}): write one JSON object per line") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where} is a JSON {type(row).__name__}, not an object like {{\"prompt\": \"...\"}}")
            unknown = sorted(set(row) - set(JSONL_KEYS))
            if unknown:
                raise ValueError(f"{where}: unknown keys {unknown} (a request has {list(JSONL_KEYS)})")
            given = [k for k in ("prompt", "prompt_ids", "messages") if k in row]
            if len(given) != 1:
                raise ValueError(f"{where}: give exactly one of \"prompt\", \"prompt_ids\" or \"messages\" "
                                 f"(got {given or 'none'})")
            if "prompt" in row and not isinstance(row["prompt"], str):
                raise ValueError(f"{where}: \"prompt\" must be text; token ids go in \"prompt_ids\"")
            if "seed" in row and (isinstance(row["seed"], bool) or not isinstance(row["seed"], int)):
                raise ValueError(f"{where}: \"seed\" must be an integer, got {row['seed']!r}")
            out.append(dict(row, line=n))
    if not out:
        raise ValueError(f"{path} holds no request: write one JSON object per line, e.g. {{\"prompt\": \"def f(\"}}")
    return out


def _wrapped(target, drafter: str, args):
    """The drafter wrapped by one of --loop-stages (DLoop), --redraft-after (D-Loop) or --edit-passes (DEdit):
    (wrapper, params), or None when none is asked for."""
    import jspec
    from jspec.drafters.dloop import DLoop
    from jspec.drafters.refine import DEdit, PrefixLoop

    if args.loop_stages == 1 and args.loop_threshold is not None:
        raise ValueError("--loop-threshold gates DLoop stages: add --loop-stages S (S > 1), or drop it")
    asked = [flag for flag, on in (("--loop-stages", args.loop_stages != 1), ("--redraft-after", args.redraft_after),
                                   ("--edit-passes", args.edit_passes)) if on]
    if not asked:
        return None
    if len(asked) > 1:
        raise ValueError(f"{' and '.join(asked)} each re-draft the block their own way: give one of them")
    if drafter == "none":
        raise ValueError(f"{asked[0]} re-drafts a block drafter: give --drafter (a DFlash checkpoint), or drop it")
    loop = args.loop_stages != 1  # DLoop builds its tree over the stages: its backbone drafts chains
    inner, params = jspec.load_drafter(drafter, target, block_size=args.block_size,
                                       tree_budget=0 if loop else args.tree_budget)
    if args.redraft_after:
        try:
            boundaries = tuple(int(t) for t in args.redraft_after.replace(" ", "").split(","))
        except ValueError:
            raise ValueError(f"--redraft-after takes comma-separated ints (drafts kept before each re-draft), got "
                             f"{args.redraft_after!r}") from None
        return PrefixLoop(inner=inner, boundaries=boundaries), params
    if args.edit_passes:
        return DEdit(inner=inner, edit_passes=args.edit_passes), params
    threshold = -2.0 if args.loop_threshold is None else args.loop_threshold
    return DLoop(inner=inner, stages=args.loop_stages, threshold=threshold, tree_budget=args.tree_budget), params


def _generate_jsonl(args, target, kw) -> int:
    import logging

    import jspec
    from jspec.train import runfiles

    log = logging.getLogger("jspec.cli")
    batch_size = 8 if args.batch_size is None else args.batch_size
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    requests = read_requests(args.input_file)
    if args.system is not None and any("messages" in row for row in requests):
        line = next(row["line"] for row in requests if "messages" in row)
        raise ValueError(f"--system adds a system message to text prompts, and {args.input_file}, line {line} is a "
                         "whole conversation (\"messages\"): put the system message in its messages, or drop --system")
    prompts = []
    for i, row in enumerate(requests):
        try:
            if "prompt_ids" in row:
                prompts.append(row["prompt_ids"])
            elif "messages" in row:
                prompts.append(target.apply_chat_template(row["messages"], add_generation_prompt=True))
            elif args.chat:
                prompts.append(_chat_prompt(target, row["prompt"], args.system))
            else:
                prompts.append(target.encode(row["prompt"]))
        except ValueError as err:
            raise ValueError(f"{args.input_file}, line {row['line']}: {err}") from None
    seeds = [row.get("seed", args.seed + i) for i, row in enumerate(requests)]
    lines, new_tokens, rounds, wall = [], 0, 0, 0.0
    for lo in range(0, len(requests), batch_size):
        hi = min(lo + batch_size, len(requests))
        try:
            res = jspec.generate(target, prompts[lo:hi], seeds=seeds[lo:hi], **kw)
        except ValueError as err:
            raise ValueError(f"{args.input_file}, lines {requests[lo]['line']}-{requests[hi - 1]['line']}: {err}") \
                from None
        new_tokens, rounds, wall = new_tokens + res.stats["new_tokens"], rounds + res.stats["rounds"], \
            wall + res.stats["wall_s"]
        for j, tokens in enumerate(res.tokens):
            row = requests[lo + j]
            out = {"id": row["id"]} if "id" in row else {}
            out.update(index=lo + j, tokens=tokens, stopped_by=res.stats["stopped_by"][j], new_tokens=len(tokens))
            text = _text(target, tokens, args.stop)
            if text is not None:
                out["text"] = text
            lines.append(json.dumps(out))
    body = "\n".join(lines) + "\n"
    if args.output_file is None:
        sys.stdout.write(body)
    else:
        runfiles.atomic_text(args.output_file, body)
    log.info("%d requests, %d new tokens in %d rounds (%.2f per round), %.2f s with compilation%s", len(requests),
             new_tokens, rounds, new_tokens / max(rounds, 1), wall,
             f"; wrote {args.output_file}" if args.output_file else "")
    return 0


def _check_utf8(prompt: str, option: str = "--prompt") -> None:
    """--prompt (and --stop) arrive as the argv bytes decoded with surrogateescape: invalid UTF-8 shows up as lone
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
        fix = "or token ids with --prompt-ids" if option == "--prompt" else "or stop on token ids with --stop-id"
        raise ValueError(f"{option} is not valid UTF-8 text{where}: pass UTF-8 text (e.g. convert it with iconv), "
                         f"{fix}") from None


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


def _progress(args) -> bool:
    """Progress bars: on unless --no-progress or --quiet."""
    from jspec import logs

    return not args.no_progress and logs.progress_enabled()


def cmd_train(args) -> int:
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1 (the step to stop at), got {args.steps}")
    if args.mesh and args.what != "target":
        raise ValueError(f"--mesh trains the target only; a {args.what} drafter trains on one device: "
                         f"drop --mesh from `jspec train {args.what}`")
    if args.what == "target":
        from jspec.train import lm

        if args.distilled:
            raise ValueError("--distilled shares a drafter run's distilled sequences: drop it from `jspec train target`")

        model_dir = lm.pretrain_target(args.config, args.out, steps=args.steps, progress=_progress(args),
                                       mesh=_mesh(args), init=args.init)
    else:
        from jspec.train import distill

        if not args.target:
            raise ValueError(f"training a {args.what} drafter needs --target PATH (the trained target model)")
        model_dir = distill.train_drafter(args.what, args.config, args.target, args.out, steps=args.steps,
                                          progress=_progress(args), init=args.init, distilled=args.distilled)
    print(f"trained model written to {model_dir}")
    return 0


def cmd_demo(args) -> int:
    import time

    import jspec
    from jspec.demo import create_demo_model

    print("jspec demo: the checkpoint round trip. It creates a small Qwen3-shaped model with RANDOM weights and a")
    print(f"BPE tokenizer trained on local Python sources, saves it in Hugging Face format to {args.out}, reloads it")
    print("strictly and generates: random weights give meaningless text. The trained built-in models speak")
    print("Python: `jspec generate` (no arguments) runs them.\n")
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

    src = resolve_path(args.src)
    is_run = os.path.isfile(os.path.join(src, "run_config.json"))
    if not args.q4:  # a training run's checkpoint, in the official format of its model
        from jspec.train.export import export_run

        ckpt = export_run(src, args.out, step=args.step, dtype=args.dtype)
        print(f"wrote {args.out}: the {ckpt.kind} model of step {ckpt.step} of run {src} in {ckpt.format} "
              f"(the run's checkpoints: steps {', '.join(map(str, ckpt.steps))})")
        return 0
    if args.step is not None or is_run:
        why = f"{src!r} is a training run folder" if is_run else "--step picks a checkpoint of a training run"
        raise ValueError(f"{why}, and --q4 quantizes a float model folder: export the run's checkpoint first "
                         "(jspec convert RUN_DIR MODEL_DIR [--step N]), then quantize that (jspec convert MODEL_DIR "
                         "OUT --q4)")
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


def configure(args) -> None:
    """Logging (--quiet / --verbose) and the persistent compilation cache (--compile-cache DIR,
    --no-compile-cache, $JSPEC_COMPILE_CACHE), before anything compiles."""
    from jspec import logs, platform

    if args.quiet and args.verbose:
        raise ValueError("--quiet and --verbose contradict each other: pass one of them")
    if args.compile_cache and args.no_compile_cache:
        raise ValueError("--compile-cache DIR and --no-compile-cache contradict each other: pass one of them")
    logs.configure(logs.QUIET if args.quiet else logs.VERBOSE if args.verbose else logs.NORMAL)
    folder = None if args.no_compile_cache else (args.compile_cache or platform.default_compile_cache_dir())
    if folder is not None:
        try:
            platform.enable_compile_cache(folder)
        except OSError as err:  # an unwritable cache only costs compile time: say so and go on
            import logging

            logging.getLogger("jspec").warning("compilation cache %s is not usable (%s): compiling without it "
                                               "(pass --compile-cache DIR or --no-compile-cache)", folder,
                                               err.strerror or err)


def run_command(args) -> int:
    """Run parsed `jspec` arguments (the logging and compilation-cache settings it makes last for the
    command only). jspec's own errors (`jspec.errors.JspecError`: damaged checkpoints, a
    diverged training run, ...), bad values (ValueError) and file errors (OSError: a missing file, a full
    disk, ...) are reported as one `jspec: error: ...` message, exit code 2; `jspec --debug` re-raises
    them, showing the traceback."""
    import errno

    import jax

    from jspec import logs, platform
    from jspec.errors import JspecError

    saved_logs, saved_cache = logs.snapshot(), platform.compile_cache_settings()
    try:
        configure(args)
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
    finally:  # a program running the command line in-process keeps its own logging and cache settings
        logs.restore(saved_logs)
        for name, value in saved_cache.items():
            jax.config.update(name, value)


if __name__ == "__main__":
    sys.exit(main())
