"""A DFlash2 checkpoint that starts as a trained DFlash one, to fine-tune from:

    python -m jspec.train.upgrade DFLASH_DIR OUT_DIR [--rank R] [--top-k K]
    jspec train dflash2 --init OUT_DIR --config configs/code-dflash2.json --target ... --out RUN_DIR

The DFlash tensors are kept; the convolutions and the selector take the official initialisation, under
which DFlash2 drafts exactly as its backbone (`jspec.drafters.dflash2.from_dflash`).
"""

from __future__ import annotations

import argparse

import jax

from jspec.api import resolve_path
from jspec.drafters import dflash, dflash2


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dflash_dir", help="a z-lab DFlash checkpoint folder (or builtin:NAME)")
    ap.add_argument("out_dir")
    ap.add_argument("--rank", type=int, default=64, help="selector_rank (default %(default)s)")
    ap.add_argument("--top-k", type=int, default=16, help="selector_top_k (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the predecessor codebook and hidden projection")
    args = ap.parse_args(argv)
    backbone, params = dflash.load_checkpoint(resolve_path(args.dflash_dir))
    cfg, params = dflash2.from_dflash(backbone, params, jax.random.key(args.seed), selector_rank=args.rank,
                                      selector_top_k=args.top_k)
    dflash2.save_checkpoint(args.out_dir, cfg, params)
    print(f"{args.out_dir}: DFlash2 (rank {args.rank}, top {args.top_k}) starting as {args.dflash_dir}")


if __name__ == "__main__":
    main()
