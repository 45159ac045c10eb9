"""The platform a program is being compiled for (no jspec imports: models and kernels both ask)."""

from __future__ import annotations

import jax


def compile_backend() -> str:
    """"cpu" | "gpu" | "tpu": the platform of the default device when one is set (a deviceless
    compile for a TPU or an H200 sets a compile-only device of that chip, while
    `jax.default_backend()` stays "cpu"), else `jax.default_backend()`."""
    device = jax.config.jax_default_device
    platform = getattr(device, "platform", None) if device is not None and not isinstance(device, str) else device
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    return platform or jax.default_backend()
