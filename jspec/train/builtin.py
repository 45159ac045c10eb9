"""Install trained models as jspec's built-in models (bf16 safetensors under jspec/builtin/NAME).

    python -m jspec.train.builtin runs/code-target/model runs/code-dflash/model runs/code-dspark/model

The models are reproducible from configs/ with `make builtin` (see the README).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import jax.numpy as jnp

from jspec.api import BUILTIN_DIR
from jspec.io import drafters as drafter_io
from jspec.io.hf import load_params, save_params

NAMES = ("code-target", "code-dflash", "code-dspark")


def install(src: str, name: str) -> str:
    """Re-save a trained model directory in bfloat16 under jspec/builtin/NAME."""
    dst = os.path.join(BUILTIN_DIR, name)
    if os.path.exists(dst):
        shutil.rmtree(dst)
    with open(os.path.join(src, "config.json")) as f:
        fmt = drafter_io.drafter_format(json.load(f))
    if fmt == "dflash":
        cfg, params = drafter_io.load_dflash(src)
        drafter_io.save_dflash(dst, cfg, params, dtype=jnp.bfloat16)
    elif fmt == "dspark":
        cfg, params = drafter_io.load_dspark(src)
        drafter_io.save_dspark(dst, cfg, params, dtype=jnp.bfloat16)
    else:
        cfg, params = load_params(src)
        save_params(dst, cfg, params, dtype=jnp.bfloat16)
        shutil.copy(os.path.join(src, "tokenizer.json"), os.path.join(dst, "tokenizer.json"))
    return dst


def main(argv=None) -> None:
    paths = sys.argv[1:] if argv is None else argv
    if len(paths) != len(NAMES):
        raise SystemExit("usage: python -m jspec.train.builtin TARGET_DIR DFLASH_DIR DSPARK_DIR")
    for src, name in zip(paths, NAMES):
        dst = install(src, name)
        size = sum(os.path.getsize(os.path.join(dst, f)) for f in os.listdir(dst))
        print(f"{name}: {dst} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
