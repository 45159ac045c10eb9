"""Parameters declared once: shape, dtype, initializer, logical sharding axes and checkpoint name.

Models are `flax.linen` modules. linen rather than nnx because a linen module is a pure description:
`module.apply({"params": tree}, ...)` is a function of a plain parameter pytree, which is exactly what
the compiled decode loop carries, and the module is only traced (no per-call framework cost inside
jit, no graph to split or merge). Every parameter is created by `declare`, which boxes its initial
value with its logical axes (`nn.LogicallyPartitioned`, so flax's own partitioning utilities apply)
and its Hugging Face tensor name and orientation. From that one declaration follow:

- initial values: `module.init` (`init_tree`);
- checkpoint names: `hf_names` (strict loading and export in `jspec.io`);
- shardings: `logical_axes` -> `jspec.parallel.param_shardings`;
- shapes: `abstract_tree` (`jax.eval_shape`, nothing allocated).

Each declaration fixes its matrix's orientation. Decoder layers (dense and hybrid targets, small-LM
drafters, DFlash / DSpark layers), LM heads and DFlash's fc are stored [out, in] as HF stores them
(`jspec.models.layers.linear` says why); the DSpark Markov / confidence heads are stored
[in, out], and `transpose` marks each tensor that HF stores the other way (those heads' matrices and
the hybrid targets' Gated DeltaNet conv taps).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from flax.core import meta

from jspec.models import quant


class Declared(nn.LogicallyPartitioned):
    """A parameter's value with its logical axes (`names`), HF tensor name and orientation."""

    hf: str = struct.field(pytree_node=False, default="")
    transpose: bool = struct.field(pytree_node=False, default=False)


# normal(std), constants, log(uniform(0.01, 16)): the log decay rates of Gated DeltaNet layers (A_log),
# as transformers initialises them, and "first_tap": convolution kernels [..., K, C] that pass their
# input through (tap 0 = 1, later taps 0; DFlash2's base kernels).
INITIALIZERS = {"normal", "ones", "zeros", "log_uniform", "first_tap"}


def declare(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str | None, ...], init: str, hf: str, *,
            transpose: bool = False, std: float = 0.02, dtype: Any = jnp.float32) -> jax.Array:
    """Declare parameter `name` of `module` (call in `setup`); returns its value when applied."""
    if init not in INITIALIZERS or len(axes) != len(shape):
        raise ValueError(f"bad declaration of {name!r}: init {init!r} (one of {sorted(INITIALIZERS)}), "
                         f"{len(axes)} axes for a {len(shape)}-d shape")

    def make(key):
        if init == "ones":
            value = jnp.ones(shape, dtype)
        elif init == "zeros":
            value = jnp.zeros(shape, dtype)
        elif init == "first_tap":
            value = jnp.zeros(shape, dtype).at[..., 0, :].set(1)
        elif init == "log_uniform":
            value = jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.01, 16.0)).astype(dtype)
        else:
            value = (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
        return Declared(value, tuple(axes), hf=hf, transpose=transpose)

    if module.has_variable("params", name):
        given = module.get_variable("params", name)
        if quant.is_q4(given):  # a quantized matrix stands for the declared float one (its three arrays differ)
            if given.shape != tuple(shape):
                raise ValueError(f"quantized parameter {name!r} stands for a {given.shape} matrix, declared {tuple(shape)}")
            return given
    return module.param(name, make)


def _is_declared(x) -> bool:
    return isinstance(x, Declared)


def init_tree(module: nn.Module, method: Callable, key: jax.Array):
    """The boxed parameter tree ({"params": ...}) of `module`, initialised by running `method`."""
    return jax.jit(lambda k: module.init(k, method=method))(key)


def abstract_tree(module: nn.Module, method: Callable):
    """The boxed tree with ShapeDtypeStruct values: declarations without allocating anything."""
    return jax.eval_shape(lambda: module.init(jax.random.key(0), method=method))


def unbox(tree):
    """Plain arrays (or ShapeDtypeStructs) in place of the boxes."""
    return meta.unbox(tree)


def _flat(tree) -> list[tuple[tuple, Declared]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_declared)[0]
    return [(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path), leaf) for path, leaf in leaves]


def hf_names(tree) -> dict[str, tuple[tuple[int, ...], tuple, bool]]:
    """HF tensor name -> (HF shape, jspec key path, transpose) for every declared parameter of `tree`
    (boxed, any layout, e.g. after `jspec.models.transformer.from_linen`)."""
    out = {}
    for path, leaf in _flat(tree):
        shape = tuple(leaf.value.shape)
        out[leaf.hf] = (tuple(reversed(shape)) if leaf.transpose else shape, path, leaf.transpose)
    return out


def logical_axes(tree):
    """The same tree with each box replaced by its tuple of logical axis names."""
    return jax.tree_util.tree_map(lambda b: tuple(b.names), tree, is_leaf=_is_declared)


def shapes(tree):
    """The same tree with each box replaced by its shape tuple."""
    return jax.tree_util.tree_map(lambda b: tuple(b.value.shape), tree, is_leaf=_is_declared)
