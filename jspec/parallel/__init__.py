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

Modules: `sharding` (the mesh, the rules, PartitionSpecs), `placement` (values onto a mesh and back),
`multihost` (`jax.distributed`, barriers, host-local batches). A mesh is always passed explicitly:
`jspec.generate(..., mesh=)`, `jspec.train.lm.pretrain_target(..., mesh=)`, or `--mesh` on the
command line:

    jspec generate --mesh data=1,model=4 [jspec generate flags]
    jspec train target --mesh data=4,fsdp=2 --config ... --out RUN_DIR

Multi-host: call `initialize()` first thing in every process; it starts `jax.distributed` when the
environment says so (see its docstring) and does nothing on one machine. `place` builds global
arrays from values every process holds; `HostLocalBatches` makes each process read only the rows
its devices hold; orbax writes checkpoints from all processes (jspec.train.trainer). Every process
of a multi-host run executes the same command (jspec/parallel/__main__.py):

    python -m jspec.parallel --mesh model=4 generate [jspec generate flags]
    python -m jspec.parallel --mesh data=4,fsdp=2 train target --config ... --out SHARED_DIR
"""

from jspec.parallel.multihost import (HostLocalBatches, global_batch, initialize, is_primary, metrics_file,
                                      prepare_run_dir, process_rows, sync)
from jspec.parallel.placement import (on_mesh, place, place_drafter, place_target, shard_batch, shard_params,
                                      to_host)
from jspec.parallel.sharding import (CACHE_AXES, MESH_AXES, RULES, Axis, ShardingRules, axis_size, batch_sharding,
                                     cache_sharding, make_mesh, param_shardings, parse_mesh, spec_for, target_axes)

__all__ = [
    "Axis", "CACHE_AXES", "HostLocalBatches", "MESH_AXES", "RULES", "ShardingRules", "axis_size", "batch_sharding",
    "cache_sharding", "global_batch", "initialize", "is_primary", "make_mesh", "metrics_file", "on_mesh",
    "param_shardings", "parse_mesh", "place", "place_drafter", "place_target", "prepare_run_dir", "process_rows",
    "shard_batch", "shard_params", "spec_for", "sync", "target_axes", "to_host",
]
