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


# --- JAX's persistent compilation cache ---------------------------------------------------------------

COMPILE_CACHE_ENV = "JSPEC_COMPILE_CACHE"


def default_compile_cache_dir() -> str | None:
    """Where `jspec` keeps compiled programs between runs: $JSPEC_COMPILE_CACHE (a folder; "off" turns the
    cache off), else $XDG_CACHE_HOME/jspec/jax, else ~/.cache/jspec/jax."""
    import os

    value = os.environ.get(COMPILE_CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in ("", "0", "off", "false", "no", "none") else value
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jspec", "jax")


COMPILE_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                         "jax_persistent_cache_min_entry_size_bytes")


def compile_cache_settings() -> dict:
    """The JAX options `enable_compile_cache` sets, to put them back with `jax.config.update`."""
    return {name: getattr(jax.config, name) for name in COMPILE_CACHE_OPTIONS}


def enable_compile_cache(path: str) -> str:
    """Turn on JAX's persistent compilation cache in `path` for every later compilation of this process
    (before the first one: JAX reads the setting once). Every program is kept, however fast it compiled,
    so a second run with the same shapes, drafter and rule loads its programs instead of compiling."""
    import os

    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
