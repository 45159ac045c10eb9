#!/usr/bin/env python3
"""Run jspec on a Cloud TPU VM slice (v5e, v6e, v5p, v4; one host or a multi-host pod slice) with gcloud.

    python launch/tpu_pod.py --name NAME --zone ZONE create --accelerator v6e-16
    python launch/tpu_pod.py --name NAME --zone ZONE setup            # copy this checkout, install on every worker
    python launch/tpu_pod.py --name NAME --zone ZONE run -- python -m jspec.parallel --mesh model=4 generate ...
    python launch/tpu_pod.py --name NAME --zone ZONE logs [--worker all] [--follow]
    python launch/tpu_pod.py --name NAME --zone ZONE delete

`run` executes the same command on every worker (`--worker=all`), inside the checkout with the
environment's bin/ first on PATH and JSPEC_DISTRIBUTED=1, so `jspec.parallel.initialize()` starts
jax.distributed (JAX finds the other workers from the TPU metadata); output goes to the terminal and
to ~/jspec-run.log on each worker (`--detach` leaves it running in the background). Every
subcommand takes --dry-run (before the subcommand): print the commands, one per line, exactly as
you would type them, and run nothing.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REMOTE_DIR = "~/jspec"
LOG = "~/jspec-run.log"
ARCHIVE = "jspec-src.tar.gz"
# Runtime images for JAX per TPU generation (cloud.google.com/tpu/docs/runtimes).
RUNTIMES = {"v6e": "v2-alpha-tpuv6e", "v5litepod": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5",
            "v4": "tpu-ubuntu2204-base"}
# Not copied to the workers: environments, version control, local runs and caches.
EXCLUDES = (".venv", ".git", "runs", "demo_out", "__pycache__", ".pytest_cache", ".hypothesis", "*.egg-info")
VENV_TOOLS = ("python", "python3", "jspec", "pip")


def quote(arg: str) -> str:
    """Shell quoting that reads like what a person types: bare when safe, else '...', else "..."
    (a --flag=VALUE keeps the flag bare), and shlex's escapes only when nothing simpler is exact."""
    flag, eq, value = arg.partition("=")
    if eq and flag.startswith("--") and shlex.quote(flag) == flag:
        return flag + "=" + quote(value)
    if shlex.quote(arg) == arg:
        return arg
    if "'" not in arg:
        return f"'{arg}'"
    if not any(c in arg for c in '"\\$`!'):
        return f'"{arg}"'
    return shlex.quote(arg)


def join(cmd: list[str]) -> str:
    return " ".join(quote(a) for a in cmd)


def runtime_for(accelerator: str) -> str:
    for prefix, version in RUNTIMES.items():
        if accelerator.startswith(prefix + "-"):
            return version
    raise SystemExit(f"tpu_pod: no default runtime for accelerator {accelerator!r}: pass --version "
                     f"(known generations: {', '.join(RUNTIMES)})")


class Pod:
    """The gcloud command lines for one TPU VM."""

    def __init__(self, name: str, zone: str, project: str | None = None):
        self.name, self.zone, self.project = name, zone, project

    def _flags(self) -> list[str]:
        return [f"--zone={self.zone}"] + ([f"--project={self.project}"] if self.project else [])

    def create(self, accelerator: str, version: str | None = None, spot: bool = False) -> list[list[str]]:
        cmd = ["gcloud", "compute", "tpus", "tpu-vm", "create", self.name, *self._flags(),
               f"--accelerator-type={accelerator}", f"--version={version or runtime_for(accelerator)}"]
        return [cmd + (["--spot"] if spot else [])]

    def ssh(self, command: str, worker: str = "all") -> list[str]:
        return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", self.name, *self._flags(), f"--worker={worker}",
                f"--command={command}"]

    def setup(self, source: str = ROOT, extra: str = "tpu") -> list[list[str]]:
        """Pack the checkout, copy it to every worker, unpack it and install it into a Python 3.11
        virtual environment (uv fetches the interpreter: the TPU images ship Python 3.10)."""
        archive = os.path.join("/tmp", ARCHIVE)
        pack = ["tar", "czf", archive, *[f"--exclude={e}" for e in EXCLUDES], "-C", source, "."]
        copy = ["gcloud", "compute", "tpus", "tpu-vm", "scp", archive, f"{self.name}:{ARCHIVE}", *self._flags(),
                "--worker=all"]
        install = " && ".join([
            f"mkdir -p {REMOTE_DIR}",
            f"tar xzf {ARCHIVE} -C {REMOTE_DIR}",
            "python3 -m pip install -q --user uv",
            f"cd {REMOTE_DIR}",
            "~/.local/bin/uv venv -q --python 3.11 .venv",
            f"~/.local/bin/uv pip install -q --python .venv/bin/python -e '.[{extra}]'",
            ".venv/bin/python -c 'import jax; print(jax.process_index(), jax.local_devices())'",
        ])
        return [pack, copy, [*self.ssh(install)]]

    def run(self, command: list[str], detach: bool = False) -> list[list[str]]:
        if command[0] in VENV_TOOLS:  # the workers' environment, not the system's interpreter
            command = [f".venv/bin/{command[0]}", *command[1:]]
        run = shlex.join(command)
        if detach:  # nohup, no terminal, stdin closed: the job outlives the ssh session
            remote = f"cd {REMOTE_DIR} && JSPEC_DISTRIBUTED=1 nohup {run} > {LOG} 2>&1 < /dev/null &"
        else:
            remote = f"cd {REMOTE_DIR} && JSPEC_DISTRIBUTED=1 {run} 2>&1 | tee {LOG}"
        return [self.ssh(remote)]

    def logs(self, worker: str = "0", lines: int = 100, follow: bool = False) -> list[list[str]]:
        return [self.ssh(f"tail -n {lines}{' -f' if follow else ''} {LOG}", worker=worker)]

    def delete(self) -> list[list[str]]:
        return [["gcloud", "compute", "tpus", "tpu-vm", "delete", self.name, *self._flags(), "--quiet"]]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True, help="TPU VM name")
    p.add_argument("--zone", required=True, help="e.g. us-east5-b (v6e), us-west4-a (v5e)")
    p.add_argument("--project", default=None, help="Google Cloud project (default: gcloud's configured one)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and run nothing")
    sub = p.add_subparsers(dest="action", required=True)
    c = sub.add_parser("create", help="create the TPU VM slice")
    c.add_argument("--accelerator", required=True, help="accelerator type, e.g. v5litepod-16, v6e-8, v6e-16")
    c.add_argument("--version", default=None, help="runtime image (default: the JAX image of the generation)")
    c.add_argument("--spot", action="store_true", help="a preemptible Spot slice")
    s = sub.add_parser("setup", help="copy a jspec checkout to every worker and install it there")
    s.add_argument("--source", default=ROOT, help="the checkout to copy (default: this one)")
    s.add_argument("--extra", default="tpu", help="pip extra to install (default: tpu)")
    r = sub.add_parser("run", help="run a command on every worker")
    r.add_argument("--detach", action="store_true", help="leave it running in the background")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    lg = sub.add_parser("logs", help="show (or follow) the run's log")
    lg.add_argument("--worker", default="0", help="worker index, or all")
    lg.add_argument("--lines", type=int, default=100)
    lg.add_argument("--follow", action="store_true", help="keep streaming new lines")
    sub.add_parser("delete", help="delete the TPU VM slice")
    return p


def commands(args) -> list[list[str]]:
    pod = Pod(args.name, args.zone, args.project)
    if args.action == "create":
        return pod.create(args.accelerator, args.version, args.spot)
    if args.action == "setup":
        return pod.setup(os.path.abspath(args.source), args.extra)
    if args.action == "run":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            raise SystemExit("tpu_pod: give the command after --, e.g. run -- python -m jspec.parallel generate ...")
        return pod.run(command, args.detach)
    if args.action == "logs":
        return pod.logs(args.worker, args.lines, args.follow)
    return pod.delete()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for cmd in commands(args):
        print(join(cmd), flush=True)
        if not args.dry_run:
            code = subprocess.run(cmd).returncode
            if code:
                return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
