"""Several processes: `jax.distributed` set-up, process 0's duties, barriers and host-local batches."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jspec.parallel.placement import place
from jspec.parallel.sharding import RULES, ShardingRules, axis_size, batch_sharding
from jspec.train.runfiles import atomic_text


def initialize() -> bool:
    """Start `jax.distributed` when the environment asks for several processes; call it first, before
    any JAX computation. Returns whether this is a multi-process run.

    - JAX_COORDINATOR_ADDRESS=host:port with JAX_NUM_PROCESSES and JAX_PROCESS_ID: explicit set-up
      (launch/multiprocess.py sets them; any cluster);
    - JSPEC_DISTRIBUTED=1 (launch/tpu_pod.py sets it on every TPU VM worker), or a SLURM job with more
      than one task, or Open MPI with more than one rank: JAX's own cluster auto-detection;
    - otherwise (one machine, Colab): nothing.
    CPU collectives (several CPU processes) use gloo, JAX's default.
    """
    if jax.distributed.is_initialized():
        return True
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        missing = [k for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if k not in env]
        if missing:
            raise ValueError(f"JAX_COORDINATOR_ADDRESS is set but {missing} are not: set all three")
        jax.distributed.initialize(env["JAX_COORDINATOR_ADDRESS"], int(env["JAX_NUM_PROCESSES"]),
                                   int(env["JAX_PROCESS_ID"]))
        return True
    cluster = (env.get("JSPEC_DISTRIBUTED") == "1" or int(env.get("SLURM_NTASKS", "1")) > 1
               or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1)
    if cluster:
        jax.distributed.initialize()
        return True
    return False


def is_primary() -> bool:
    """Process 0: the one that prints and writes single files (metrics, exported models)."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """A barrier across processes (no-op on one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def prepare_run_dir(run_dir: str, fingerprint: dict) -> None:
    """Write the run's fingerprint file once (process 0) before every process opens a Trainer on
    the shared run directory, so that no process reads it half-written (and a crash leaves none)."""
    path = os.path.join(run_dir, "run_config.json")
    if is_primary() and not os.path.exists(path):
        os.makedirs(run_dir, exist_ok=True)
        atomic_text(path, json.dumps(fingerprint, indent=2, sort_keys=True))
    sync(f"run-dir:{run_dir}")


def metrics_file(run_dir: str) -> str:
    """Process 0 logs to the run's metrics.jsonl; the others' (identical) metrics go nowhere."""
    return os.path.join(run_dir, "metrics.jsonl") if is_primary() else os.devnull


def process_rows(sharding: NamedSharding, global_batch: int) -> list[int]:
    """The rows of a global batch that this process's devices hold, in increasing order: the layout
    `jax.make_array_from_process_local_data` expects of the process's data (a mesh may interleave
    the hosts' devices, so the rows need not be contiguous)."""
    rows = set()
    for idx in sharding.addressable_devices_indices_map((global_batch,)).values():
        rows.update(range(global_batch)[idx[0]])
    return sorted(rows)


class HostLocalBatches:
    """Random-access training batches of which each process reads only its own rows.

    examples: a random-access source of single examples (e.g. a shuffled, repeated grain MapDataset:
    what `jspec.train.data.batches` builds before it batches); batch i of the run is examples
    [i * B, (i + 1) * B) with B the global batch, exactly as a one-process `.batch(B)` gives it.
    Element i here is this process's rows (`process_rows`) of global batch i, stacked (dicts per key).
    Feed it to the Trainer with `sharding=global_batch(mesh)`: the global array is then the same
    batch the single-process run sees.
    """

    def __init__(self, examples, global_batch: int, mesh: Mesh, rules: ShardingRules = RULES):
        self.examples, self.global_batch = examples, global_batch
        n = axis_size(mesh, rules.batch)
        if global_batch % n:
            raise ValueError(f"a global batch of {global_batch} does not split over the {n}-way batch axes")
        self.rows = process_rows(batch_sharding(mesh, 1, rules), global_batch)

    def __getitem__(self, i: int):
        examples = [self.examples[i * self.global_batch + r] for r in self.rows]
        return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *examples)


def global_batch(mesh: Mesh, rules: ShardingRules = RULES):
    """Trainer `sharding=` hook: this process's rows (host-local arrays) -> global arrays sharded over
    the batch axes. On one process the rows are the whole batch."""
    def assemble(local):
        def one(x):
            x = np.asarray(x)
            if x.ndim == 0:  # per-batch scalars (e.g. a step index) are the same on every process
                return place(x, NamedSharding(mesh, P()))
            return jax.make_array_from_process_local_data(batch_sharding(mesh, x.ndim, rules), x)

        return jax.tree_util.tree_map(one, local)

    return assemble
