"""Data-parallel + FSDP sharding of a training step over a (data, fsdp) mesh.

Parameters (and so the optimizer state built from them) are split over the `fsdp` axis along their
largest dimension that divides evenly (small vectors stay replicated); batches are split over both
axes along the batch dimension. jit then partitions the step (GSPMD); the math is the single-device
step's.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P


def make_mesh(data: int, fsdp: int) -> Mesh:
    if data * fsdp > jax.device_count():
        raise ValueError(f"a {data} x {fsdp} mesh needs {data * fsdp} devices, {jax.device_count()} are visible")
    return jax.make_mesh((data, fsdp), ("data", "fsdp"), axis_types=(AxisType.Auto, AxisType.Auto))


def param_sharding(mesh: Mesh, leaf) -> NamedSharding:
    n = mesh.shape["fsdp"]
    dims = sorted(range(leaf.ndim), key=lambda d: -leaf.shape[d])
    for d in dims:
        if leaf.shape[d] % n == 0 and leaf.shape[d] >= n:
            spec = [None] * leaf.ndim
            spec[d] = "fsdp"
            return NamedSharding(mesh, P(*spec))
    return NamedSharding(mesh, P())


def shard_params(params, mesh: Mesh):
    return jax.tree_util.tree_map(lambda x: jax.device_put(x, param_sharding(mesh, x)), params)


def batch_sharder(mesh: Mesh):
    """A function placing every batch array's leading (batch) axis over both mesh axes."""
    def place(batch):
        def one(x):
            if x.ndim == 0 or x.shape[0] % (mesh.shape["data"] * mesh.shape["fsdp"]):
                return jax.device_put(x, NamedSharding(mesh, P()))
            return jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"))))
        return jax.tree_util.tree_map(one, batch)

    return place


def is_sharded(params) -> bool:
    return any(len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated
               for x in jax.tree_util.tree_leaves(params) if hasattr(x, "sharding"))


__all__ = ["batch_sharder", "is_sharded", "make_mesh", "param_sharding", "shard_params"]
