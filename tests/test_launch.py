"""launch/: the printed commands are exactly what a user would type, and they are what gets run."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POD = os.path.join(ROOT, "launch", "tpu_pod.py")
MULTI = os.path.join(ROOT, "launch", "multiprocess.py")


def _run(script, *args, path=None):
    env = dict(os.environ)
    if path is not None:
        env["PATH"] = path
    out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=30, env=env)
    return out


def _dry(*args):
    # An empty PATH: a dry run that tried to start gcloud or tar would fail.
    out = _run(POD, "--name", "jspec-v6e", "--zone", "us-east5-b", "--dry-run", *args, path="")
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_create_picks_the_runtime_of_the_generation():
    assert _dry("create", "--accelerator", "v6e-16") == [
        "gcloud compute tpus tpu-vm create jspec-v6e --zone=us-east5-b --accelerator-type=v6e-16 "
        "--version=v2-alpha-tpuv6e"]
    out = _run(POD, "--name", "p", "--zone", "us-west4-a", "--project", "lab", "--dry-run", "create",
               "--accelerator", "v5litepod-16", "--spot")
    assert out.stdout.splitlines() == [
        "gcloud compute tpus tpu-vm create p --zone=us-west4-a --project=lab --accelerator-type=v5litepod-16 "
        "--version=v2-alpha-tpuv5-lite --spot"]
    bad = _run(POD, "--name", "p", "--zone", "z", "--dry-run", "create", "--accelerator", "v9-8")
    assert bad.returncode != 0 and "pass --version" in bad.stderr


def test_setup_copies_the_checkout_and_installs_on_every_worker():
    assert _dry("setup", "--source", "/src/jspec") == [
        "tar czf /tmp/jspec-src.tar.gz --exclude=.venv --exclude=.git --exclude=runs --exclude=demo_out "
        "--exclude=__pycache__ --exclude=.pytest_cache --exclude=.hypothesis --exclude='*.egg-info' -C /src/jspec .",
        "gcloud compute tpus tpu-vm scp /tmp/jspec-src.tar.gz jspec-v6e:jspec-src.tar.gz --zone=us-east5-b "
        "--worker=all",
        "gcloud compute tpus tpu-vm ssh jspec-v6e --zone=us-east5-b --worker=all --command=\"mkdir -p ~/jspec && "
        "tar xzf jspec-src.tar.gz -C ~/jspec && python3 -m pip install -q --user uv && cd ~/jspec && "
        "~/.local/bin/uv venv -q --python 3.11 .venv && ~/.local/bin/uv pip install -q --python .venv/bin/python "
        "-e '.[tpu]' && .venv/bin/python -c 'import jax; print(jax.process_index(), jax.local_devices())'\""]


def test_run_logs_and_delete():
    run = "python -m jspec.parallel --mesh model=4 generate --prompt 'def f(x):'"
    assert _dry("run", "--", *shlex.split(run)) == [
        "gcloud compute tpus tpu-vm ssh jspec-v6e --zone=us-east5-b --worker=all --command=\"cd ~/jspec && "
        "JSPEC_DISTRIBUTED=1 .venv/bin/python -m jspec.parallel --mesh model=4 generate --prompt 'def f(x):' "
        "2>&1 | tee ~/jspec-run.log\""]
    assert _dry("run", "--detach", "--", "jspec", "generate") == [
        "gcloud compute tpus tpu-vm ssh jspec-v6e --zone=us-east5-b --worker=all --command='cd ~/jspec && "
        "JSPEC_DISTRIBUTED=1 nohup .venv/bin/jspec generate > ~/jspec-run.log 2>&1 < /dev/null &'"]
    assert _dry("logs", "--worker", "all", "--follow") == [
        "gcloud compute tpus tpu-vm ssh jspec-v6e --zone=us-east5-b --worker=all "
        "--command='tail -n 100 -f ~/jspec-run.log'"]
    assert _dry("delete") == ["gcloud compute tpus tpu-vm delete jspec-v6e --zone=us-east5-b --quiet"]


def test_quoting_survives_the_shell_on_both_ends():
    """A prompt with quotes, $ and spaces reaches the worker's command line unchanged."""
    prompt = """say "hi" to $USER's `shell` !"""
    (line,) = _dry("run", "--", "python", "-m", "jspec.parallel", "generate", "--prompt", prompt)
    argv = shlex.split(line)  # what the local shell hands to gcloud
    remote = argv[-1].removeprefix("--command=")
    words = shlex.split(remote)  # what the worker's shell runs
    assert words[words.index("--prompt") + 1] == prompt


def test_without_dry_run_the_printed_commands_are_run(tmp_path):
    log = tmp_path / "calls"
    stub = tmp_path / "gcloud"
    stub.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {log}\nexit 3\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    out = _run(POD, "--name", "p", "--zone", "z", "delete", path=f"{tmp_path}:/usr/bin:/bin")
    assert out.returncode == 3  # gcloud's failure is the script's
    assert out.stdout.splitlines() == ["gcloud compute tpus tpu-vm delete p --zone=z --quiet"]
    assert log.read_text().splitlines() == ["compute", "tpus", "tpu-vm", "delete", "p", "--zone=z", "--quiet"]


def test_multiprocess_dry_run_prints_one_line_per_process():
    out = _run(MULTI, "--nproc", "2", "--num-processes", "4", "--first-process-id", "2", "--coordinator",
               "10.0.0.1:1234", "--gpus-per-process", "2", "--dry-run", "--", "python", "-m", "jspec.parallel",
               "--mesh", "model=8", "generate", "--prompt", "def f(x):")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"JAX_COORDINATOR_ADDRESS=10.0.0.1:1234 JAX_NUM_PROCESSES=4 JAX_PROCESS_ID={i} "
        f"CUDA_VISIBLE_DEVICES={2 * (i - 2)},{2 * (i - 2) + 1} "
        "python -m jspec.parallel --mesh model=8 generate --prompt 'def f(x):'" for i in (2, 3)]
    cpu = _run(MULTI, "--nproc", "1", "--coordinator", "127.0.0.1:5", "--cpu-devices", "4", "--dry-run", "--", "true")
    assert cpu.stdout.splitlines() == [
        "JAX_COORDINATOR_ADDRESS=127.0.0.1:5 JAX_NUM_PROCESSES=1 JAX_PROCESS_ID=0 JAX_PLATFORMS=cpu "
        "XLA_FLAGS=--xla_force_host_platform_device_count=4 true"]


def test_multiprocess_runs_every_process_and_stops_the_rest_on_failure(tmp_path):
    ok = _run(MULTI, "--nproc", "2", "--", sys.executable, "-c",
              "import os; print('id', os.environ['JAX_PROCESS_ID'], os.environ['JAX_NUM_PROCESSES'])")
    assert ok.returncode == 0, ok.stderr
    assert sorted(ok.stdout.splitlines()) == ["[p0] id 0 2", "[p1] id 1 2"]
    # Process 1 fails at once; process 0 would wait forever (as at a collective) and is stopped.
    code = "import os, sys, time; pid = os.environ['JAX_PROCESS_ID']; sys.exit(5) if pid == '1' else time.sleep(60)"
    failed = _run(MULTI, "--nproc", "2", "--timeout", "20", "--", sys.executable, "-c", code)
    assert failed.returncode == 5 and "a process failed" in failed.stderr
    hung = _run(MULTI, "--nproc", "1", "--timeout", "1", "--", sys.executable, "-c", "import time; time.sleep(60)")
    assert hung.returncode == 124 and "timeout" in hung.stderr


@pytest.mark.parametrize("bad", [["--nproc", "0", "--", "true"], ["--nproc", "2"],
                                 ["--nproc", "2", "--num-processes", "3", "--first-process-id", "2", "--", "true"]])
def test_multiprocess_rejects_bad_arguments(bad):
    out = _run(MULTI, *bad, "--dry-run")
    assert out.returncode != 0 and "multiprocess:" in out.stderr


def test_slurm_template_runs_the_command_under_srun(tmp_path):
    calls = tmp_path / "calls"
    stub = tmp_path / "srun"
    stub.write_text(f'#!/bin/sh\nprintf "%s\\n" "$PWD" "$@" > {calls}\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", SLURM_SUBMIT_DIR=str(tmp_path))
    cmd = ["bash", os.path.join(ROOT, "launch", "slurm.sbatch"), "python", "-m", "jspec.parallel", "--mesh", "model=8",
           "generate", "--prompt", "def f(x):"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert calls.read_text().splitlines() == [str(tmp_path), "python", "-m", "jspec.parallel", "--mesh", "model=8",
                                              "generate", "--prompt", "def f(x):"]
