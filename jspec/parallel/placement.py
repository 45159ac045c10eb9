"""Putting values on a mesh (one process or many) and bringing them back to the host."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jspec.parallel.sharding import (RULES, ShardingRules, axis_size, batch_sharding, param_shardings,
                                     target_axes)


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


def shard_batch(tree, mesh: Mesh, rules: ShardingRules = RULES):
    """Every array's leading axis over the batch mesh axes; it must divide (a clear error otherwise)."""
    n = axis_size(mesh, rules.batch)

    def sharding(x):
        if np.ndim(x) == 0:
            return NamedSharding(mesh, P())
        if np.shape(x)[0] % n:
            raise ValueError(f"a batch of {np.shape(x)[0]} rows does not split over the mesh's {n}-way batch axes "
                             f"{rules.batch}: use a multiple of {n} rows or a mesh with a smaller data axis")
        return batch_sharding(mesh, np.ndim(x), rules)

    return place(tree, jax.tree_util.tree_map(sharding, tree))


def on_mesh(tree, mesh: Mesh):
    """Leaves not yet on the mesh (e.g. an optimizer's step counters, created on one local device)
    replicated over it; leaves already on it unchanged. A jitted step needs every input on one mesh,
    and a checkpoint restores each leaf to the sharding of the state it is restored into."""
    def sharding(x):
        on = isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
        return x.sharding if on else NamedSharding(mesh, P())

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
