"""Deviceless (ahead-of-time) compiles for TPU and H200 and the HBM bytes of the compiled decode loop.

`devices` builds compile-only chips; `hlo_bytes` reads optimized HLO; `bench` drives
`jspec bench --aot CHIP`. Nothing here imports jax at package import time, so `aot_env` can be read
before jax is.
"""

from jspec.aot.devices import CHIPS, abstract, aot_device, aot_env

__all__ = ["CHIPS", "abstract", "aot_device", "aot_env"]
