"""Deviceless compile targets: a TPU or H200 `jax.Device` that exists only for `lower().compile()`.

On a machine without the accelerator, XLA still produces the chip's real optimized HLO and
`memory_analysis()` (no timings) from a compile-only topology. Usage::

    env = aot_env("tpu-v5p")      # set these in the process environment BEFORE `import jax`
    dev = aot_device("tpu-v5p")   # a compile-only jax.Device
    args = abstract(params, dev)  # ShapeDtypeStructs committed to that device
    jax.jit(f).lower(args).compile()

The environment matters because jax reads it once, at import / backend start: JAX_PLATFORMS=cpu keeps
jax from probing for a real accelerator, and the TPU / CUDA plugins need the other variables to make a
topology without one. `jspec bench --aot CHIP` re-executes itself with `aot_env(CHIP)` when needed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from importlib import resources

CHIPS = ("tpu-v5e", "tpu-v5p", "tpu-v6e", "h200")

# Topology names understood by libtpu's compile-only client, one chip each.
_TPU_TOPOLOGY = {
    "tpu-v5e": ("v5e:1x1", [1, 1, 1]),
    "tpu-v5p": ("v5p:1x1x1", [1, 1, 1]),
    "tpu-v6e": ("v6e:1x1", [1, 1, 1]),
}

GIB = 1 << 30

# HBM per chip in bytes (vendor figures; H200's is the usable size from the target config).
HBM_BYTES = {
    "tpu-v5e": 16 * GIB,
    "tpu-v5p": 95 * GIB,
    "tpu-v6e": 32 * GIB,
    "h200": 149_250_000_000,
}

# Peak HBM bandwidth in bytes/s (vendor figures), for turning bytes per round into a time bound.
HBM_BANDWIDTH = {
    "tpu-v5e": 819e9,
    "tpu-v5p": 2765e9,
    "tpu-v6e": 1640e9,
    "h200": 4.8e12,
}

_TPU_ENV = {
    "JAX_PLATFORMS": "cpu",
    "TPU_ACCELERATOR_TYPE": "v5litepod-1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}
_H200_ENV = {
    "JAX_PLATFORMS": "cpu",
    "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
    "CUDA_VISIBLE_DEVICES": "-1",
    # Autotuning runs candidate kernels on a device; without one it must be off.
    "XLA_FLAGS": "--xla_gpu_autotune_level=0",
}

_PLUGIN = {
    "tpu": ("libtpu", "pip install 'libtpu==0.0.42.1'  (or: pip install 'jspec[aot]')"),
    "h200": (
        "jax_cuda12_plugin",
        "pip install 'jax-cuda12-plugin==0.10.2' 'jax-cuda12-pjrt==0.10.2'  (or: pip install 'jspec[aot]')",
    ),
}


def check_chip(chip: str) -> str:
    """Return `chip` if it is one of CHIPS, else raise ValueError naming the valid choices."""
    if chip not in CHIPS:
        raise ValueError(f"unknown AOT chip {chip!r}: choose one of {', '.join(CHIPS)}")
    return chip


def is_tpu(chip: str) -> bool:
    return check_chip(chip).startswith("tpu-")


def aot_env(chip: str) -> dict[str, str]:
    """Environment variables a process needs, set BEFORE importing jax, to compile for `chip`.

    Returns a fresh dict {name: value}; merge it over os.environ for a subprocess.
    """
    return dict(_TPU_ENV if is_tpu(chip) else _H200_ENV)


def env_mismatch(chip: str, environ=None) -> dict[str, str]:
    """The subset of aot_env(chip) that `environ` (default os.environ) does not already satisfy."""
    environ = os.environ if environ is None else environ
    out = {}
    for k, v in aot_env(chip).items():
        have = environ.get(k)
        if k == "XLA_FLAGS":
            # Other XLA flags may be present too; only ours must be among them.
            if have is None or v not in have.split():
                out[k] = v
        elif have != v:
            out[k] = v
    return out


def plugin_module(chip: str) -> str:
    """Name of the Python module that provides `chip`'s compiler."""
    return _PLUGIN["tpu" if is_tpu(chip) else "h200"][0]


def check_plugin(chip: str) -> None:
    """Raise RuntimeError saying what to install when `chip`'s compiler plugin is not importable."""
    mod, how = _PLUGIN["tpu" if is_tpu(chip) else "h200"]
    if importlib.util.find_spec(mod) is None:
        raise RuntimeError(
            f"a deviceless compile for {chip} needs the {mod!r} package, which this Python "
            f"({sys.executable}) cannot import. Install it: {how}. In a jspec checkout, "
            f"`make .venv-aot/.done` builds a separate interpreter with it (.venv-aot/bin/python)."
        )


def package_root() -> str:
    """The directory holding the `jspec` package (put it on PYTHONPATH of an AOT subprocess: the AOT
    interpreter sees the base environment's packages but not its editable install)."""
    import jspec

    return os.path.dirname(os.path.dirname(os.path.abspath(jspec.__file__)))


def aot_python() -> str:
    """The interpreter that has the compiler plugins: $JSPEC_AOT_PYTHON, else <repo>/.venv-aot/bin/python,
    else this one if it can import them. Raises RuntimeError saying how to get one."""
    env = os.environ.get("JSPEC_AOT_PYTHON")
    if env:
        if not os.path.exists(env):
            raise RuntimeError(f"JSPEC_AOT_PYTHON={env} does not exist: point it at a Python with libtpu and "
                               f"jax-cuda12-plugin installed, or unset it")
        return env
    local = os.path.join(package_root(), ".venv-aot", "bin", "python")
    if os.path.exists(local):
        return local
    if all(importlib.util.find_spec(m) for m in ("libtpu", "jax_cuda12_plugin")):
        return sys.executable
    raise RuntimeError(
        "no Python with the deviceless compilers: run `make .venv-aot/.done` in the jspec checkout (it builds "
        ".venv-aot), or `pip install 'jspec[aot]'` into some environment and set JSPEC_AOT_PYTHON to its python")


def h200_target_config() -> str:
    """The GpuTargetConfigProto text shipped with the package (public H200 device facts)."""
    return resources.files("jspec.aot").joinpath("h200_target_config.txtpb").read_text()


def _prepare_env(chip: str) -> None:
    bad = env_mismatch(chip)
    if not bad:
        return
    backends_started = False
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        backends_started = xla_bridge.backends_are_initialized()
    if backends_started and os.environ.get("JSPEC_AOT_LENIENT") != "1":
        settings = " ".join(f"{k}={v}" for k, v in bad.items())
        raise RuntimeError(
            f"jax started its back ends before the environment for a deviceless {chip} compile was "
            f"set (missing or different: {settings}). Set jspec.aot.devices.aot_env({chip!r}) in the "
            f"environment before `import jax`, e.g. run `env {settings} python ...`, or use "
            f"`jspec bench --aot {chip}`, which re-executes itself with it."
        )
    # Nothing has read these yet (jax reads them when its back ends start; the plugins when they
    # load), so setting them now is as good as the caller having done it.
    for k, v in bad.items():
        if k == "XLA_FLAGS" and os.environ.get(k):
            os.environ[k] = os.environ[k] + " " + v
        else:
            os.environ[k] = v
    if "jax" in sys.modules and "JAX_PLATFORMS" in bad:
        import jax

        # jax copied JAX_PLATFORMS into its config at import time.
        jax.config.update("jax_platforms", bad["JAX_PLATFORMS"])


@functools.cache
def aot_device(chip: str):
    """A compile-only `jax.Device` of one `chip` (see CHIPS); raises if its plugin is missing.

    The device has no memory: use it only in shardings of abstract inputs and `lower().compile()`.
    """
    check_chip(chip)
    check_plugin(chip)
    _prepare_env(chip)
    from jax.experimental import topologies

    try:
        if is_tpu(chip):
            name, bounds = _TPU_TOPOLOGY[chip]
            topo = topologies.get_topology_desc(name, "tpu", chips_per_host_bounds=bounds)
        else:
            topo = topologies.get_topology_desc(
                platform="cuda", target_config=h200_target_config(), topology="1x1x1"
            )
    except Exception as e:  # the plugins raise bare runtime errors; name the likely cause
        raise RuntimeError(
            f"could not build a compile-only {chip} topology ({type(e).__name__}: {e}). Check that "
            f"the environment holds {aot_env(chip)} before jax is imported and that the plugin "
            f"version matches jax (libtpu==0.0.42.1 / jax-cuda12-plugin==0.10.2 for jax 0.10.2)."
        ) from e
    return topo.devices[0]


def abstract(x, dev):
    """Map a pytree of arrays / ShapeDtypeStructs (anything with .shape and .dtype) to
    `jax.ShapeDtypeStruct`s of the same shape and dtype committed to `dev` (SingleDeviceSharding).
    Leaves without a shape (Python scalars, None) are returned unchanged."""
    import jax

    sharding = jax.sharding.SingleDeviceSharding(dev)

    def one(a):
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            return a
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    return jax.tree_util.tree_map(one, x)


@contextlib.contextmanager
def default_device(dev):
    """Make `dev` jax's default device within the block, so Pallas lowering sees the target chip."""
    import jax

    with jax.default_device(dev):
        yield dev
