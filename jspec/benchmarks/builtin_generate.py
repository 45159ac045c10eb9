"""Whole `jspec.generate` calls with the built-in models: ms per generated token, AR and speculative.

    python -m jspec.benchmarks.builtin_generate [--new-tokens 128] [--repeats 7] [--json out.json]

Plain AR, DFlash and DSpark (greedy, block size --block-size, --batch of four short code prompts encoded
with the target's tokenizer), each call compiled once before timing; medians of interleaved repeats. Meant for before/after
comparisons of two checkouts: run it alternately in both (e.g. `for i in 1 2 3; do (cd old && python -m
jspec.benchmarks.builtin_generate --json old$i.json); python -m jspec.benchmarks.builtin_generate --json
new$i.json; done`) and compare the medians, so that both see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jspec

PROMPTS = [
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "class LRUCache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n",
    "import os\n\n\ndef walk_files(root, suffix):\n    for dirpath, _, names in os.walk(root):\n",
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n",
]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--block-size", type=int, default=None,
                    help="drafts per round (default: each checkpoint's trained block)")
    ap.add_argument("--batch", type=int, default=4, choices=range(1, len(PROMPTS) + 1), help="prompts per call")
    ap.add_argument("--json", help="write the medians here")
    args = ap.parse_args(argv)
    target = jspec.load_target("builtin:code-target")
    drafters = {"ar": None, "dflash": "builtin:code-dflash", "dspark": "builtin:code-dspark"}
    prompts = [target.encode(p) for p in PROMPTS[: args.batch]]
    kw = dict(max_new_tokens=args.new_tokens, eos_ids=[])
    spec = dict(block_size=args.block_size)
    calls = {name: (lambda d=d: jspec.generate(target, prompts, **kw, **({} if d is None else dict(drafter=d, **spec))))
             for name, d in drafters.items()}
    tokens = {name: sum(len(t) for t in call().tokens) for name, call in calls.items()}  # compiles each once
    times = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    out = {name: 1e3 * statistics.median(t) / tokens[name] for name, t in times.items()}
    for name, ms in out.items():
        print(f"{name:7s} {ms:7.3f} ms/token ({tokens[name]} tokens, median of {args.repeats})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
