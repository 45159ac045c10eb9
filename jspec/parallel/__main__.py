"""python -m jspec.parallel [--mesh data=D,fsdp=F,model=M] (generate ... | train target ...)

Every process of a run executes the same command: it starts jax.distributed when the environment
says so (`initialize`), then runs `jspec generate` or `jspec train target` with the mesh over all
devices of all processes. Default mesh: for `generate`, model = every device (one prompt has no
batch to split); for `train target`, data = every device. Only process 0 prints.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import jax

from jspec import cli, parallel


def main(argv: Sequence[str] | None = None) -> int:
    pre = argparse.ArgumentParser(prog="python -m jspec.parallel", add_help=False)
    pre.add_argument("--mesh", default=None, help="mesh axis sizes, e.g. data=2,model=4 (before or after the command)")
    known, rest = pre.parse_known_args(argv)
    parallel.initialize()
    args = cli.build_parser().parse_args(rest)
    if not (args.command == "generate" or (args.command == "train" and args.what == "target")):
        name = f"{args.command} {args.what}" if args.command == "train" else args.command
        print(f"jspec: error: python -m jspec.parallel runs `generate` and `train target`; run `jspec {name}` "
              "on one host instead", file=sys.stderr)
        return 2
    default = f"data=1,model={jax.device_count()}" if args.command == "generate" else f"data={jax.device_count()}"
    args.mesh = known.mesh or default
    if not parallel.is_primary():
        sys.stdout = open(os.devnull, "w")  # the other processes compute the same result
    return cli.run_command(args)


if __name__ == "__main__":
    sys.exit(main())
