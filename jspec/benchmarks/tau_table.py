"""Acceptance of the built-in drafters on held-out standard-library files (greedy and T = 1).

    python -m jspec.benchmarks.tau_table [--prompts 32] [--new-tokens 128] [--drafters NAME[@BLOCK],...]
                                         [--folder DIR]

Prompts are cut from the standard library's validation split (files never used to train the target or
the drafters), or with --folder from every .py file of a folder outside the training corpus (e.g. jspec's
own sources: code no model has seen, in a style of its own).
tau = committed tokens per round, pooled over all prompts (sum of tokens / sum of rounds); the
verifier is greedy at T = 0 and speculative sampling at T = 1 (Gumbel coupling: tau_gumbel). A drafter
drafts its checkpoint's own block unless the name ends in @BLOCK (lookup: 7).
"""

from __future__ import annotations

import argparse
import tempfile

import jspec
from jspec.train import data, lm
from jspec.train.distill import corpus_prompts, cut_prompts
from jspec.verify.sampling import SamplingParams


def held_out_prompts(target, count: int, prompt_len: int, seed: int = 1) -> list[list[int]]:
    with tempfile.TemporaryDirectory() as tmp:
        ds_dir, _ = lm.prepare_text({"data": {"corpus": "stdlib", "pattern": "**/*.py"}}, tmp)
        return corpus_prompts(target, ds_dir, "validation", count, prompt_len, seed)


def folder_prompts(target, folder: str, count: int, prompt_len: int, seed: int = 1) -> list[list[int]]:
    """`count` prompts of prompt_len tokens cut at random places of the .py files under folder."""
    docs = []
    for path in data.corpus_files(folder):
        with open(path, encoding="utf-8") as f:
            ids = target.encode(f.read())
        if len(ids) > prompt_len:
            docs.append(ids)
    if not docs:
        raise ValueError(f"no .py file under {folder!r} is longer than {prompt_len} tokens: pass a folder of "
                         "Python sources")
    return cut_prompts(docs, count, prompt_len, seed)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="builtin:code-target")
    ap.add_argument("--drafters", default="builtin:code-dflash,builtin:code-dspark,lookup")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--folder", help="cut the prompts from this folder's .py files instead (out-of-corpus code)")
    args = ap.parse_args(argv)
    target = jspec.load_target(args.target)
    if args.folder:
        prompts = folder_prompts(target, args.folder, args.prompts, args.prompt_len)
        where = f"prompts from {args.folder}"
    else:
        prompts = held_out_prompts(target, args.prompts, args.prompt_len)
        where = "held-out prompts"
    rows = []
    for entry in args.drafters.split(","):
        name, _, block = entry.partition("@")
        block_size = int(block) if block else (7 if name == "lookup" else None)
        cells = []
        for sampling, verifier in [(SamplingParams(0.0), "greedy"), (SamplingParams(1.0), "speculative"),
                                   (SamplingParams(1.0), "gumbel")]:
            res = jspec.generate(target, prompts, max_new_tokens=args.new_tokens, sampling=sampling, seeds=0,
                                 eos_ids=[], drafter=name, verifier=verifier, block_size=block_size)
            cells.append(res.stats["tau"])
        rows.append((entry, cells))
    print(f"{len(prompts)} {where} x {args.new_tokens} new tokens, target {args.target}")
    print("| drafter | tau greedy | tau T=1 (speculative) | tau T=1 (Gumbel) |")
    print("| --- | --- | --- | --- |")
    for name, cells in rows:
        print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
