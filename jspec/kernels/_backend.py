"""Which implementation a `kernels` / `attention` flag selects on the current backend."""

from __future__ import annotations

from typing import Any

import jax

KERNELS = ("reference", "pallas", "auto")
IMPLS = ("tpu", "portable")


def resolve(kernels: str, backend: str | None = None) -> str:
    """"reference" or "pallas" for a flag value; "auto" is the fastest correct choice for the backend:
    the Pallas kernels on TPU and GPU, the jnp reference on CPU (where kernels only run interpreted)."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels setting {kernels!r}; choose one of {', '.join(KERNELS)}")
    if kernels != "auto":
        return kernels
    return "pallas" if (backend or jax.default_backend()) in ("tpu", "gpu") else "reference"


def use_pallas(kernels: str) -> bool:
    return resolve(kernels) == "pallas"


def pallas_setup(impl: str | None, interpret: Any) -> tuple[str, Any]:
    """(impl, interpret) with defaults filled in for the current backend.

    impl "tpu": the Mosaic TPU kernel (grid-pipelined BlockSpecs, scalar prefetch, VMEM scratch);
    "portable": a plain `pallas_call` (one program per query block, the cache walked by an in-kernel
    loop, no TPU-only features), the GPU variant, lowered through Triton (Pallas' Mosaic GPU path
    wants `plgpu.kernel` with explicit SMEM staging and wgmma, a different kernel). On CPU both run
    interpreted: `interpret=pltpu.InterpretParams()` simulates TPU memory (NaN-filled scratch,
    bounds-checked block reads)."""
    backend = jax.default_backend()
    if impl is None:
        impl = "portable" if backend == "gpu" else "tpu"
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel implementation {impl!r}; choose one of {', '.join(IMPLS)}")
    if interpret is None:
        interpret = backend == "cpu"
    return impl, interpret


def kv_heads_per_step(num_kv_heads: int, head_dim: int) -> int:
    """KV heads handled per grid step on TPU: the fewest whose lanes (k * head_dim) fill whole
    128-lane vregs, so every block's last dimension is a multiple of 128 (or the full dimension)."""
    for k in range(1, num_kv_heads + 1):
        if num_kv_heads % k == 0 and (k * head_dim) % 128 == 0:
            return k
    return num_kv_heads


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pow2_at_most(x: int) -> int:
    """The largest power of two <= x (the GPU lowering wants power-of-two array shapes)."""
    return 1 << (x.bit_length() - 1)


def require_pow2(**sizes: int) -> None:
    """The Triton lowering needs every in-kernel array shape to be a power of two."""
    bad = {k: v for k, v in sizes.items() if v & (v - 1)}
    if bad:
        raise ValueError(f"the GPU (Triton-lowered) kernels need power-of-two sizes, got {bad}: "
                         "use kernels='reference' for this model")


def pow2_at_least(x: int) -> int:
    return 1 << (x - 1).bit_length()


def query_rows(n: int, impl: str) -> int:
    """Rows a block of n queries is padded to: whole 8-row sublane tiles on TPU; on GPU a power of two
    (Triton's array shapes) of at least 16 (its matmul minimum)."""
    return round_up(n, 8) if impl == "tpu" else max(16, pow2_at_least(n))
