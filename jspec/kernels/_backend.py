"""Which implementation a `kernels` / `attention` flag selects on the current backend."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.experimental.pallas import tpu as pltpu

from jspec.platform import compile_backend

KERNELS = ("reference", "pallas", "auto")
IMPLS = ("tpu", "portable")


def resolve(kernels: str, backend: str | None = None, *, q4: bool = False) -> str:
    """"reference" or "pallas" for a flag value; "auto" is the fastest correct choice for the backend:
    the Pallas kernels on TPU; the jnp reference on CPU (where kernels only run interpreted) and, for the
    draft layers and attention, on GPU, where XLA's fusions beat the portable kernels (an H200 at
    Qwen3-8B / 4k, `python -m jspec.benchmarks.kernels --shape qwen3-8b --dtype bfloat16 --context
    4096`: draft layer 0.321 vs 0.236 ms, tree attention 0.711 vs 0.150 ms). q4: the Q4 matmul, whose
    kernel "auto" keeps on GPU too (the XLA reference materialises the float matrix there: 4x its bytes;
    not timed on a GPU)."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels setting {kernels!r}; choose one of {', '.join(KERNELS)}")
    if kernels != "auto":
        return kernels
    return "pallas" if (backend or compile_backend()) in (("tpu", "gpu") if q4 else ("tpu",)) else "reference"


def use_pallas(kernels: str) -> bool:
    return resolve(kernels) == "pallas"


def pallas_setup(impl: str | None, interpret: Any) -> tuple[str, Any]:
    """(impl, interpret) with defaults filled in for the current backend.

    impl "tpu": the Mosaic TPU kernels (grid-pipelined BlockSpecs that stream weights and cache tiles
    through double-buffered VMEM, scalar prefetch, VMEM scratch; tiles sized per TPU generation by
    `tpu_tiles`); "portable": plain `pallas_call`s without TPU-only features, the GPU variant, lowered
    through Triton: a grid over heads / row tiles / output-column tiles, every block a power of two and
    small enough for shared memory, the reduction dimension walked by an in-kernel loop (Triton rather
    than Mosaic GPU: the same BlockSpec-and-loop kernels compile here at real shapes, where a Mosaic GPU
    kernel would need `plgpu.kernel` with explicit SMEM staging and wgmma, a different program per
    kernel). On CPU both run interpreted: `interpret=pltpu.InterpretParams()` simulates TPU memory
    (NaN-filled scratch, bounds-checked block reads)."""
    backend = compile_backend()
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


_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class TpuTiles:
    """Tile budgets of one TPU generation (per TensorCore; all within its scoped VMEM).

    vmem_cap: the most scoped VMEM a kernel asks for (`vmem_limit_bytes`), below the core's VMEM.
    mlp_step_bytes: weight bytes of one MLP grid step (gate + up + down tiles, D x block_f each);
        double-buffered, the MLP kernel holds twice this.
    ctx_rows: context rows per tile of the draft layer's attention.
    cache_tile_bytes / cache_rows: one K (or V) tile of tree attention: at most cache_rows rows, and as
        many KV heads per step as keep the tile within cache_tile_bytes (K and V, double-buffered:
        4x this in VMEM)."""

    name: str
    vmem_cap: int
    mlp_step_bytes: int
    ctx_rows: int
    cache_tile_bytes: int
    cache_rows: int


# At Qwen3-8B shape (D 4096, F 12288, 8 KV heads x 128, bf16):
# - v5e (128 MiB VMEM, 0.82 TB/s): MLP block_f 512: gate/up/down tiles 3 x 4 MiB = 12 MiB per step (15 us
#   of HBM time, so the ~0.35 us step overhead is 2%), 24 MiB double-buffered; draft context tiles of 1024
#   rows (K 256 KiB); tree tiles 512 rows x 8 heads (K 1 MiB, K+V double-buffered 4 MiB).
# - v5p (64 MiB VMEM per core, 2.76 TB/s): MLP block_f 512 (12 MiB per step, 24 MiB double-buffered, plus
#   the attention kernel's 2 x 10 MiB weight blocks in its own call); context tiles of 2048 rows (K 512
#   KiB); tree tiles 1024 rows x 8 heads (K 2 MiB, K+V double-buffered 8 MiB).
# - v6e (128 MiB VMEM, 1.64 TB/s): MLP block_f 1024 (24 MiB per step, 48 MiB double-buffered); context
#   tiles of 2048 rows; tree tiles 1024 rows x 8 heads (K 2 MiB).
# float32 weights halve block_f (the budgets are bytes). Unknown devices (and interpret mode) get the
# smallest budgets, which also fit a 64 MiB-VMEM core.
TPU_TILES = {
    "v5e": TpuTiles("v5e", 96 * _MIB, 12 * _MIB, 1024, 1 * _MIB, 512),
    "v5p": TpuTiles("v5p", 56 * _MIB, 12 * _MIB, 2048, 2 * _MIB, 1024),
    "v6e": TpuTiles("v6e", 100 * _MIB, 24 * _MIB, 2048, 2 * _MIB, 1024),
    "default": TpuTiles("default", 48 * _MIB, 12 * _MIB, 1024, 1 * _MIB, 512),
}


def tpu_generation() -> str:
    """"v5e" | "v5p" | "v6e" for the TPU that Pallas lowers for (the default device, or an abstract
    mesh's device), else "default" (CPU interpret mode, other generations)."""
    try:
        version = pltpu.get_tpu_info().chip_version
    except (ValueError, RuntimeError):
        return "default"
    return {pltpu.ChipVersion.TPU_V5E: "v5e", pltpu.ChipVersion.TPU_V5P: "v5p",
            pltpu.ChipVersion.TPU_V6E: "v6e"}.get(version, "default")


def tpu_tiles() -> TpuTiles:
    return TPU_TILES[tpu_generation()]


def vmem_limit(need: int, tiles: TpuTiles) -> int:
    """Scoped VMEM to ask for: what the blocks and scratch need plus 8 MiB for Mosaic's own temporaries,
    at least 32 MiB, at most the generation's cap."""
    return int(min(max(need + 8 * _MIB, 32 * _MIB), tiles.vmem_cap))


def largest_divisor_tile(n: int, cap: int, multiple: int) -> int:
    """The largest t <= cap with t % multiple == 0 and n % t == 0, else n (one whole tile)."""
    t = (min(cap, n) // multiple) * multiple
    while t >= multiple:
        if n % t == 0:
            return t
        t -= multiple
    return n


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n (1 when n is odd)."""
    t = pow2_at_most(max(1, min(cap, n)))
    while n % t:
        t //= 2
    return t


@dataclasses.dataclass(frozen=True)
class GpuTiles:
    """Block sizes of the GPU (Triton) kernels; power-of-two dims, every program's dot operands within
    shared memory (H200: 227 KiB per block, opt-in) at the pipeline depth `stages`.

    rows: matmul row tile (query rows of a block / tree are padded to a power of two >= 16);
    k_chunk: reduction chunk per loop step; cols: output columns per program; kv_rows: cache rows per
    attention loop step."""

    rows: int = 64
    k_chunk: int = 128
    cols: int = 64
    kv_rows: int = 64
    stages: int = 3
    warps: int = 4


def gpu_tiles(itemsize: int) -> GpuTiles:
    """bf16 / f16: K chunks of 128, cache steps of 64 rows; float32: half of both (the same bytes).

    Shared memory per program at these sizes (Triton stages both dot operands, `stages` deep):
    projection / down-projection: rows x k_chunk + cols x k_chunk (the weight tile, stored [out, in]) =
    (64x128 + 64x128) x 2 B = 32 KiB per stage, 96 KiB at 3 stages; gate+up (two weight tiles): 48 KiB
    per stage, 144 KiB; attention: q [<=64, 128] + K, V tiles [64, 128] = 48 KiB per stage, 144 KiB.
    float32 halves k_chunk and kv_rows, so the bytes stay the same: all within H200's 227 KiB."""
    if itemsize >= 4:
        return GpuTiles(k_chunk=64, kv_rows=32)
    return GpuTiles()
