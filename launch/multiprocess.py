#!/usr/bin/env python3
"""Start the processes of one multi-process JAX run on this machine (GPU hosts, or CPUs for testing).

Every process gets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, which
`jspec.parallel.initialize()` turns into `jax.distributed.initialize(...)`; its output is streamed
with a `[pN]` prefix. When one process fails the others are stopped (a collective would otherwise
wait for it forever), and --timeout stops them all.

One machine, one process per GPU (4 GPUs):
    python launch/multiprocess.py --nproc 4 --gpus-per-process 1 -- \\
        python -m jspec.parallel --mesh model=4 generate --target MODEL_DIR --prompt "def f(x):"
Several machines: run it on each with the same --coordinator (machine 0's address) and
--num-processes, and --first-process-id = the number of processes on the machines before it.
CPU only (tests): --cpu-devices N gives every process N fake CPU devices.
--dry-run prints, for each process, the command line it would start, and starts nothing.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(args, index: int) -> dict[str, str]:
    """The variables process `index` (0-based on this machine) is started with."""
    env = {
        "JAX_COORDINATOR_ADDRESS": args.coordinator,
        "JAX_NUM_PROCESSES": str(args.num_processes),
        "JAX_PROCESS_ID": str(args.first_process_id + index),
    }
    if args.gpus_per_process:
        first = index * args.gpus_per_process
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(args.gpus_per_process))
    if args.cpu_devices:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.cpu_devices}"
    return env


def command_line(env: dict[str, str], command: list[str]) -> str:
    """What a user would type to start one process by hand."""
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.join(command)])


def _stream(prefix: str, pipe, out) -> None:
    for line in pipe:
        out.write(f"{prefix}{line}")
        out.flush()


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def run(args, command: list[str]) -> int:
    """Start every process, stream their output, stop the rest on the first failure or at the timeout."""
    procs, threads = [], []
    for i in range(args.nproc):
        env = dict(os.environ)
        extra = process_env(args, i)
        if "XLA_FLAGS" in extra and os.environ.get("XLA_FLAGS"):
            extra["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {extra['XLA_FLAGS']}"
        env.update(extra)
        # Its own process group, so that stopping it also stops whatever it started.
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        procs.append(proc)
        t = threading.Thread(target=_stream, args=(f"[p{args.first_process_id + i}] ", proc.stdout, sys.stdout))
        t.start()
        threads.append(t)
    deadline = time.monotonic() + args.timeout if args.timeout else None
    code = 0
    try:
        while True:
            codes = [p.poll() for p in procs]  # poll every process: a failure may come from any of them
            if None not in codes:
                break
            failed = [c for c in codes if c not in (None, 0)]
            late = deadline is not None and time.monotonic() > deadline
            if failed or late:
                code = failed[0] if failed else 124
                print(f"multiprocess: {'a process failed' if failed else 'timeout'}; stopping the others",
                      file=sys.stderr)
                _stop(procs)
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        code = 130
    for p in procs:
        p.wait()
    for t in threads:
        t.join()
    return code or next((p.returncode for p in procs if p.returncode), 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, required=True, help="processes to start on this machine")
    p.add_argument("--num-processes", type=int, default=None, help="processes of the whole run (default: --nproc)")
    p.add_argument("--first-process-id", type=int, default=0, help="JAX_PROCESS_ID of this machine's first process")
    p.add_argument("--coordinator", default=None,
                   help="HOST:PORT of process 0's coordinator (default: 127.0.0.1 and a free port)")
    p.add_argument("--gpus-per-process", type=int, default=0, help="give each process its own CUDA devices")
    p.add_argument("--cpu-devices", type=int, default=0, help="fake CPU devices per process (testing without GPUs)")
    p.add_argument("--timeout", type=float, default=0, help="stop every process after this many seconds (0: never)")
    p.add_argument("--dry-run", action="store_true", help="print each process's command line; start nothing")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command every process runs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("multiprocess: give the command after --, e.g. -- python -m jspec.parallel generate ...")
    if args.nproc < 1:
        raise SystemExit("multiprocess: --nproc must be >= 1")
    args.num_processes = args.num_processes or args.nproc
    if args.first_process_id + args.nproc > args.num_processes:
        raise SystemExit(f"multiprocess: processes {args.first_process_id}..{args.first_process_id + args.nproc - 1} "
                         f"do not fit --num-processes {args.num_processes}")
    args.coordinator = args.coordinator or f"127.0.0.1:{free_port()}"
    if args.dry_run:
        for i in range(args.nproc):
            print(command_line(process_env(args, i), command))
        return 0
    return run(args, command)


if __name__ == "__main__":
    sys.exit(main())
