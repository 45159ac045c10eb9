"""The mesh and the rule table: logical axes -> mesh axes -> PartitionSpecs and NamedShardings."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

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


def axis_size(mesh: Mesh, axes: Axis) -> int:
    """The number of devices along one mesh axis or a tuple of them (1 for None)."""
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
        n = axis_size(mesh, axes)
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
        key = _path_key(path)
        if path and isinstance(path[-1], jax.tree_util.GetAttrKey):  # codes / scales / biases of a Q4 matrix
            key = key[:-1]  # take the matrix's axes (each part is [out, in / 8 or in / 64])
        logical = declared.get(key, ())
        return NamedSharding(mesh, spec_for(np.shape(leaf), logical, mesh, rules, head_dim))

    return jax.tree_util.tree_map_with_path(one, params)


def target_axes(cfg):
    """Logical axes of a target's parameters (dense or hybrid) from its module declarations."""
    from jspec.models import hybrid, transformer
    from jspec.models.declare import logical_axes

    model = hybrid if isinstance(cfg, hybrid.HybridConfig) else transformer
    axes = logical_axes(model.declarations(cfg))
    if getattr(cfg, "layer_loop", "unroll") == "scan":  # stacked layers: [L, ...] of one layer's axes
        axes = dict(axes, layers=jax.tree.map(lambda a: (_LAYER, *a), axes["layers"][0],
                                              is_leaf=lambda x: isinstance(x, tuple)))
    return axes


def batch_sharding(mesh: Mesh, ndim: int, rules: ShardingRules = RULES) -> NamedSharding:
    """Leading (batch) axis over the batch mesh axes, the rest replicated."""
    return NamedSharding(mesh, P(rules.batch, *([None] * (ndim - 1))))


def cache_sharding(mesh: Mesh, shape: Sequence[int], rules: ShardingRules = RULES) -> NamedSharding:
    """A layer's [B, Hkv, S, Dh] cache or a stacked [L, B, Hkv, S, Dh] one: batch over data, KV heads
    over model."""
    axes = CACHE_AXES if len(shape) == len(CACHE_AXES) else (_LAYER,) + CACHE_AXES
    return NamedSharding(mesh, spec_for(shape, axes, mesh, rules))
