"""Beyond one device: sharding rules, multi-host set-up and host-local data, all on JAX's own SPMD.

Everything here is `jax.sharding` (a `Mesh`, `NamedSharding`s placed with `jax.device_put` /
`jax.make_array_from_callback`) and `jax.distributed`; jit then partitions the unchanged compiled
loops and training steps (GSPMD), so a sharded run computes the single-device program.

The mesh has three named axes (sizes may be 1):
    data   batch rows (data parallel)
    fsdp   training: parameters split along their embedding dimension, batch rows split too (FSDP)
    model  tensor parallel: attention heads, MLP hidden units, the KV cache's head axis

`ShardingRules` is the one table from logical axes to mesh axes. The logical axes of a parameter come
from its declaration in its model's module (`jspec.models.declare`: dense and hybrid targets, DFlash /
DSpark networks, small-LM drafters), and `CACHE_AXES` names those of the caches:

    logical axis   mesh axis         used by
    batch          (data, fsdp)      token buffers, per-row state, cache batch axis, training batches
    heads          model             wq / bq output, wo input (whole heads when num_heads % model == 0)
    kv_heads       model             wk / wv output, KV cache head axis
    mlp            model             w_gate / w_up output, w_down input
    embed          fsdp              the hidden dimension of every matrix (training; fsdp = 1 for inference)
    vocab          replicated        embedding / LM head / Markov head rows: small vocabularies of
                                     drafting models are cheaper replicated than all-gathered per token;
                                     set vocab="model" for a large vocabulary

A dimension that the mesh axis does not divide stays replicated (e.g. 2 KV heads on model = 4: the
K/V projections and cache are replicated, the query heads are split). Any placement is exact under
GSPMD; the rules only choose which collectives run.

Multi-host: call `initialize()` first thing in every process; it starts `jax.distributed` when the
environment says so (see its docstring) and does nothing on one machine. `place` builds global
arrays from values every process holds; `HostLocalBatches` makes each process read only the rows
its devices hold; orbax writes checkpoints from all processes (jspec.train.trainer).

    python -m jspec.parallel --mesh model=4 generate [jspec generate flags]
    python -m jspec.parallel --mesh data=4,fsdp=2 train target --config ... --out SHARED_DIR
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import json
import os
import sys
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "model")

Axis = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (or tuple of mesh axes; None = replicated). Logical axes not named
    here (layers, seq, head_dim, taps, rank) are replicated."""

    batch: Axis = ("data", "fsdp")
    heads: Axis = "model"
    kv_heads: Axis = "model"
    mlp: Axis = "model"
    embed: Axis = "fsdp"
    vocab: Axis = None

    def mesh_axes(self, logical: str | None) -> Axis:
        return getattr(self, logical, None) if logical else None


RULES = ShardingRules()

_LAYER = "layers"  # the leading axis of stacked per-layer arrays
# Caches: one [B, Hkv, S, Dh] buffer per attention layer (the dense targets' KVCache, the hybrid
# targets' HybridCache K/V, a small-LM drafter's cache), or a stacked [L, B, Hkv, S, Dh] one.
CACHE_AXES = ("batch", "kv_heads", "seq", "head_dim")
# Head-sharded leaves: the dimension holds (heads x head_dim), split only at whole heads.
_HEAD_DIMS = {"heads", "kv_heads"}


def make_mesh(data: int | None = None, model: int = 1, fsdp: int = 1, devices: Sequence | None = None) -> Mesh:
    """A (data, fsdp, model) mesh with GSPMD (Auto) axes over `devices` (default: every device of
    every process). data=None takes the devices left over by model x fsdp."""
    devices = list(jax.devices() if devices is None else devices)
    if data is None:
        if len(devices) % (model * fsdp):
            raise ValueError(f"model x fsdp = {model * fsdp} does not divide the {len(devices)} devices")
        data = len(devices) // (model * fsdp)
    sizes = (data, fsdp, model)
    if min(sizes) < 1:
        raise ValueError(f"mesh axis sizes must be >= 1, got data={data}, fsdp={fsdp}, model={model}")
    n = data * fsdp * model
    if n > len(devices):
        raise ValueError(f"a data={data} x fsdp={fsdp} x model={model} mesh needs {n} devices, "
                         f"{len(devices)} are visible")
    if n < len(devices) and jax.process_count() > 1:
        raise ValueError(f"a multi-process mesh must use all {len(devices)} devices, got {n}")
    return jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices[:n])


def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,model=4' -> {'data': 2, 'model': 4} (keyword arguments of make_mesh)."""
    out = {}
    for part in filter(None, text.replace(" ", "").split(",")):
        name, _, value = part.partition("=")
        if name not in MESH_AXES or not value.isdigit():
            raise ValueError(f"bad mesh {text!r}: expected comma-separated AXIS=SIZE with AXIS in {MESH_AXES}")
        out[name] = int(value)
    return out


def _axis_size(mesh: Mesh, axes: Axis) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh.shape[a] for a in names]))


def spec_for(shape: Sequence[int], logical: Sequence[str | None], mesh: Mesh, rules: ShardingRules = RULES,
             head_dim: int | None = None) -> P:
    """PartitionSpec of an array with these logical axes; a dimension the mesh axes do not divide
    (in whole heads for head axes when head_dim is given) stays replicated."""
    if len(logical) != len(shape):
        return P()
    spec = []
    for size, name in zip(shape, logical):
        axes = rules.mesh_axes(name)
        n = _axis_size(mesh, axes)
        units = size // head_dim if head_dim and name in _HEAD_DIMS and size % head_dim == 0 else size
        spec.append(axes if n > 1 and units % n == 0 else None)
    return P(*spec)


def _path_key(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def param_shardings(params, mesh: Mesh, rules: ShardingRules = RULES, head_dim: int | None = None, axes=None):
    """NamedSharding for every leaf of a target / drafter parameter pytree.

    axes: the logical axes of the parameters, a tree like `params` with tuples at its leaves, taken
    from the models' declarations (`jspec.models.declare.logical_axes`); leaves it does not cover (or
    axes=None) are replicated."""
    declared = {}
    if axes is not None:
        flat = jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))[0]
        declared = {_path_key(path): tuple(ax) for path, ax in flat}

    def one(path, leaf):
        logical = declared.get(_path_key(path), ())
        return NamedSharding(mesh, spec_for(np.shape(leaf), logical, mesh, rules, head_dim))

    return jax.tree_util.tree_map_with_path(one, params)


def place(tree, shardings):
    """Put every leaf on its sharding. Works on one process (device_put) and on many: there every
    process must hold the same full value, and each device receives only its slice."""
    def one(x, sharding):
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return jax.device_put(x, sharding)  # one process, or a global array to reshard
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree_util.tree_map(one, tree, shardings)


def shard_params(params, mesh: Mesh, rules: ShardingRules = RULES, head_dim: int | None = None, axes=None):
    """Parameters placed by the rules (tensor parallel over `model`, FSDP over `fsdp`); axes: as in
    `param_shardings`."""
    return place(params, param_shardings(params, mesh, rules, head_dim, axes))


def batch_sharding(mesh: Mesh, ndim: int, rules: ShardingRules = RULES) -> NamedSharding:
    """Leading (batch) axis over the batch mesh axes, the rest replicated."""
    return NamedSharding(mesh, P(rules.batch, *([None] * (ndim - 1))))


def shard_batch(tree, mesh: Mesh, rules: ShardingRules = RULES):
    """Every array's leading axis over the batch mesh axes; it must divide (a clear error otherwise)."""
    n = _axis_size(mesh, rules.batch)

    def sharding(x):
        if np.ndim(x) == 0:
            return NamedSharding(mesh, P())
        if np.shape(x)[0] % n:
            raise ValueError(f"a batch of {np.shape(x)[0]} rows does not split over the mesh's {n}-way batch axes "
                             f"{rules.batch}: use a multiple of {n} rows or a mesh with a smaller data axis")
        return batch_sharding(mesh, np.ndim(x), rules)

    return place(tree, jax.tree_util.tree_map(sharding, tree))


def to_host(tree):
    """numpy copies of (possibly multi-process, sharded) arrays: every process gets the full value.
    Collective when an array spans other processes: every process must call it."""
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree_util.tree_map(one, tree)


_ACTIVE_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("jspec_mesh", default=None)


@contextlib.contextmanager
def use_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """Inside the block, `jspec.generate` calls without a mesh= argument run on this mesh (this is how
    `python -m jspec.parallel generate` runs the unchanged `jspec generate` command sharded)."""
    token = _ACTIVE_MESH.set(mesh)
    try:
        yield mesh
    finally:
        _ACTIVE_MESH.reset(token)


def active_mesh() -> Mesh | None:
    """The mesh of the innermost `use_mesh` block, or None."""
    return _ACTIVE_MESH.get()


def target_axes(cfg):
    """Logical axes of a target's parameters (dense or hybrid) from its module declarations."""
    from jspec.models import hybrid, transformer
    from jspec.models.declare import logical_axes

    model = hybrid if isinstance(cfg, hybrid.HybridConfig) else transformer
    return logical_axes(model.declarations(cfg))


def place_target(target, mesh: Mesh, rules: ShardingRules = RULES):
    """The target with its parameters on the mesh (a no-op for parameters already placed)."""
    return dataclasses.replace(target, params=shard_params(target.params, mesh, rules, target.cfg.head_dim,
                                                           target_axes(target.cfg)))


def _drafter_head_dim(drafter) -> int | None:
    cfg = getattr(drafter, "cfg", None)
    cfg = getattr(cfg, "layers", cfg)
    return getattr(cfg, "head_dim", None)


def place_drafter(drafter, dparams, mesh: Mesh, rules: ShardingRules = RULES):
    """A drafter's parameters on the mesh (DFlash / DSpark layer stacks shard like the target's)."""
    return shard_params(dparams, mesh, rules, _drafter_head_dim(drafter), drafter.param_axes())


def cache_sharding(mesh: Mesh, shape: Sequence[int], rules: ShardingRules = RULES) -> NamedSharding:
    """A layer's [B, Hkv, S, Dh] cache or a stacked [L, B, Hkv, S, Dh] one: batch over data, KV heads
    over model."""
    axes = CACHE_AXES if len(shape) == len(CACHE_AXES) else (_LAYER,) + CACHE_AXES
    return NamedSharding(mesh, spec_for(shape, axes, mesh, rules))


# ---------------------------------------------------------------------------------------------------
# Multi-host set-up


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


# ---------------------------------------------------------------------------------------------------
# Host-local training data


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
        n = _axis_size(mesh, rules.batch)
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


# ---------------------------------------------------------------------------------------------------
# Runs on a mesh: multi-host training and the `python -m jspec.parallel` command


def on_mesh(tree, mesh: Mesh):
    """Leaves not yet on the mesh (e.g. an optimizer's step counters, created on one local device)
    replicated over it; leaves already on it unchanged. A jitted step needs every input on one mesh,
    and a checkpoint restores each leaf to the sharding of the state it is restored into."""
    def sharding(x):
        on = isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
        return x.sharding if on else NamedSharding(mesh, P())

    return place(tree, jax.tree_util.tree_map(sharding, tree))


def prepare_run_dir(run_dir: str, fingerprint: dict) -> None:
    """Write the run's fingerprint file once (process 0) before every process opens a Trainer on
    the shared run directory, so that no process reads it half-written."""
    path = os.path.join(run_dir, "run_config.json")
    if is_primary() and not os.path.exists(path):
        os.makedirs(run_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(fingerprint, f, indent=2, sort_keys=True)
    sync(f"run-dir:{run_dir}")


def metrics_file(run_dir: str) -> str:
    """Process 0 logs to the run's metrics.jsonl; the others' (identical) metrics go nowhere."""
    return os.path.join(run_dir, "metrics.jsonl") if is_primary() else os.devnull


def train_target(config_path: str, out_dir: str, mesh: Mesh, *, steps: int | None = None, progress: bool = True,
                 rules: ShardingRules = RULES) -> str:
    """`jspec train target` (jspec.train.lm.pretrain_target) over a mesh, by every process of a run.

    Same configuration, fingerprint, batches and outputs as the one-device run, so a run directory
    can be resumed by either. out_dir must be one folder that every host sees (checkpoints are
    written by all processes through orbax); each host builds the text corpus in its own subfolder
    and loads only the batch rows its devices hold. Returns the model directory (written by process 0).
    """
    import grain
    from tokenizers import Tokenizer

    from jspec.io.hf import save_params
    from jspec.models import transformer
    from jspec.models.config import ModelConfig
    from jspec.train import lm
    from jspec.train.trainer import TrainConfig, Trainer

    cfg = lm.load_run_config(config_path)
    work = out_dir if jax.process_count() == 1 else os.path.join(out_dir, f"host{jax.process_index()}")
    os.makedirs(work, exist_ok=True)
    ds_dir, train_files = lm.prepare_text(cfg, work)
    tok_path = os.path.join(out_dir, "tokenizer.json")
    if is_primary() and not os.path.exists(tok_path):
        lm.train_tokenizer(cfg["model"]["vocab_size"], train_files).save(tok_path)
    sync("tokenizer")
    tok = Tokenizer.from_file(tok_path)
    mcfg = ModelConfig(**{**cfg["model"], "eos_token_ids": (tok.token_to_id(lm.EOT),)})
    windows = lm.tokenized_windows(tok, ds_dir, "train", cfg["data"]["seq_len"])
    tc = TrainConfig(**cfg["train"])
    params = shard_params(transformer.init_params(mcfg, jax.random.key(tc.seed), std=cfg.get("init_std", 0.02)),
                          mesh, rules, mcfg.head_dim, target_axes(mcfg))
    fingerprint = {"kind": "target", "config": cfg}
    prepare_run_dir(out_dir, fingerprint)
    trainer = Trainer(lambda p, b: lm.lm_loss(p, mcfg, b), params, tc, out_dir, fingerprint=fingerprint,
                      sharding=global_batch(mesh, rules))
    trainer.state = on_mesh(trainer.state, mesh)
    start = trainer.restore_latest()
    if progress and is_primary():
        print(f"target {mcfg.num_params / 1e6:.2f}M parameters on a {dict(mesh.shape)} mesh of "
              f"{jax.process_count()} process(es); resuming at step {start}")
    # Element i of the shuffled stream is window i of the run: the same order as data.batches.
    examples = grain.MapDataset.source(windows).shuffle(seed=tc.seed).repeat()
    batches = HostLocalBatches(examples, cfg["data"]["batch_size"], mesh, rules)
    state = trainer.run(batches, steps=steps, progress=progress and is_primary(), metrics_file=metrics_file(out_dir))
    host_params = to_host(state.params)  # collective: every process takes part
    model_dir = os.path.join(out_dir, "model")
    if is_primary():
        save_params(model_dir, mcfg, host_params)
        tok.save(os.path.join(model_dir, "tokenizer.json"))
    sync("model-saved")
    return model_dir


def main(argv: Sequence[str] | None = None) -> int:
    """python -m jspec.parallel [--mesh data=D,fsdp=F,model=M] (generate ... | train target ...)

    Every process of a run executes the same command: it starts jax.distributed when the environment
    says so (`initialize`), builds the mesh over all devices of all processes, and runs `jspec
    generate` sharded over it (default mesh: model = every device, since one prompt has no batch to
    split), or trains the target with `train_target` (default mesh: data = every device). Only
    process 0 prints.
    """
    from jspec import cli

    pre = argparse.ArgumentParser(prog="python -m jspec.parallel", add_help=False)
    pre.add_argument("--mesh", default="", help="mesh axis sizes, e.g. data=2,model=4")
    known, rest = pre.parse_known_args(argv)
    initialize()
    args = cli.build_parser().parse_args(rest)
    try:
        sizes = parse_mesh(known.mesh)
        if not sizes and args.command == "generate":  # `jspec generate` has one prompt: no batch to split
            sizes = {"data": 1, "model": jax.device_count()}
        mesh = make_mesh(**sizes)
        if not is_primary():
            sys.stdout = open(os.devnull, "w")  # the other processes compute the same result
        if args.command == "generate":
            with use_mesh(mesh):
                return cli.cmd_generate(args)
        if args.command == "train" and args.what == "target":
            model_dir = train_target(args.config, args.out, mesh, steps=args.steps, progress=not args.no_progress)
            print(f"trained model written to {model_dir}")
            return 0
        raise ValueError(f"python -m jspec.parallel runs `generate` and `train target`; run `jspec {args.command}"
                         f"{' ' + args.what if args.command == 'train' else ''}` on one host instead")
    except (ValueError, FileNotFoundError) as err:
        print(f"jspec: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # Run the imported module's main: jspec.api reads the mesh context of `jspec.parallel`, not of `__main__`.
    from jspec.parallel import main as _main

    sys.exit(_main())
