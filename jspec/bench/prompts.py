"""Bench prompts: held-out code, the files of the standard-library corpus's validation split.

The split is the one the built-in models were trained without (`jspec.train.data.split_files`, by file
hash), read straight from the files (no TFDS build). Each prompt is `prompt_len` tokens cut at a random
place of a different file (seeded). A target without a tokenizer gets seeded random token ids instead.
"""

from __future__ import annotations

import numpy as np

from jspec.train import data


def held_out_prompts(target, count: int, prompt_len: int, seed: int) -> tuple[list[list[int]], str]:
    """(prompts, a description of their source)."""
    rng = np.random.default_rng(seed)
    if target.tokenizer is None:
        ids = rng.integers(1, target.cfg.vocab_size, size=(count, prompt_len))
        return ids.tolist(), (f"random token-id prompts of {prompt_len} tokens (seed {seed}): "
                              "the target has no tokenizer")
    root = data.stdlib_dir()
    files = data.split_files(root, data.corpus_files(root))["validation"]
    texts = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    docs = [e.ids for e in target.tokenizer.encode_batch(texts) if len(e.ids) > prompt_len]
    if not docs:
        raise ValueError(f"no held-out file is longer than {prompt_len} tokens: lower --prompt-len")
    order = rng.permutation(len(docs))
    prompts = []
    for i in range(count):
        doc = docs[order[i % len(docs)]]
        start = int(rng.integers(len(doc) - prompt_len))
        prompts.append(list(doc[start : start + prompt_len]))
    return prompts, (f"prompts of {prompt_len} tokens cut from the {len(files)} held-out (validation) "
                     f"standard-library files (seed {seed})")
