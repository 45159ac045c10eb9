"""Install trained models as jspec's built-in models (bf16 safetensors under jspec/builtin/NAME).

    python -m jspec.train.builtin runs/code-target/model runs/code-dflash/model runs/code-dspark/model \
        runs/code-dflash2/model runs/code-eagle3/model runs/code-mtp/model

The models are reproducible from configs/ with `make builtin` (see the README).
"""

from __future__ import annotations

import os
import shutil
import sys

import jax.numpy as jnp

from jspec.api import BUILTIN_DIR
from jspec.drafters import family
from jspec.train.runfiles import replace_folder

NAMES = ("code-target", "code-dflash", "code-dspark", "code-dflash2", "code-eagle3", "code-mtp")


def install(src: str, name: str) -> str:
    """Re-save a trained model directory (the target LM or a drafter of any registered family) in
    bfloat16 under jspec/builtin/NAME, with its tokenizer.json when it has one."""
    dst = os.path.join(BUILTIN_DIR, name)
    fam = family.detect(src)
    drafter, params = fam.load(src, None, jnp.float32)

    def write(folder):  # a new folder that replaces the old one whole: never a half-installed model
        fam.save(folder, drafter, params, dtype=jnp.bfloat16)
        if os.path.exists(os.path.join(src, "tokenizer.json")):
            shutil.copy(os.path.join(src, "tokenizer.json"), os.path.join(folder, "tokenizer.json"))

    return replace_folder(dst, write)


def main(argv=None) -> None:
    paths = sys.argv[1:] if argv is None else argv
    if len(paths) != len(NAMES):
        raise SystemExit("usage: python -m jspec.train.builtin TARGET_DIR DFLASH_DIR DSPARK_DIR DFLASH2_DIR EAGLE3_DIR "
                         "MTP_DIR")
    for src, name in zip(paths, NAMES):
        dst = install(src, name)
        size = sum(os.path.getsize(os.path.join(dst, f)) for f in os.listdir(dst))
        print(f"{name}: {dst} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
