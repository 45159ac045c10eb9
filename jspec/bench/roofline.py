"""The verify pass against the memory-bandwidth roofline, and random-weight targets of published shapes.

At batch 1 a verify pass streams every weight once (plus the cached K/V it attends to), so its time is
bounded below by bytes / bandwidth: roofline(n) = (weight bytes + K/V bytes read) / bandwidth, nearly
flat in n until compute takes over. `--shape qwen3-8b` swaps the target for a random model shaped like
Qwen3-8B: acceptance is meaningless with random weights, timing is not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.api import Target
from jspec.models.config import ModelConfig
from jspec.models.transformer import init_params

SHAPES = {
    "qwen3-8b": ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        qk_norm=True, eos_token_ids=(151645,), max_position_embeddings=40960,
    ),
}

# Spec-sheet HBM bandwidth (GB/s) by a substring of jax's device_kind; the first match wins.
PEAK_BANDWIDTH_GBS = (
    ("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("A100-SXM4-80GB", 2039.0), ("A100", 1555.0),
    ("L4", 300.0), ("TPU v4", 1200.0), ("TPU v5 lite", 819.0), ("TPU v5e", 819.0), ("TPU v5", 2765.0),
    ("TPU v6 lite", 1640.0), ("TPU v6e", 1640.0),
)


def random_target(shape: str, dtype=jnp.bfloat16, seed: int = 0) -> Target:
    """A random-weight target of a named shape (no tokenizer: prompts are token ids)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: valid shapes are {', '.join(SHAPES)}")
    cfg = SHAPES[shape]
    return Target(cfg, init_params(cfg, jax.random.key(seed), dtype=dtype), None, f"random:{shape}")


def peak_bandwidth_gbs(device_kind: str) -> float | None:
    for key, gbs in PEAK_BANDWIDTH_GBS:
        if key.lower() in device_kind.lower():
            return gbs
    return None


def weight_bytes(params) -> int:
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)))


def kv_bytes(cfg: ModelConfig, rows: int, itemsize: int) -> int:
    """Bytes of cached K and V over `rows` positions, all layers, one row of the batch."""
    return 2 * cfg.num_layers * rows * cfg.num_kv_heads * cfg.head_dim * itemsize


def verify_roofline(target: Target, curve: dict, bandwidth_bytes_s: float) -> dict:
    """Each measured T(n) of `curve` (from the bench's verify curve: n, seconds, context) against
    (weight bytes + K/V bytes of the context) / bandwidth; `share` = roofline / measured (1 = at the bound)."""
    wb = weight_bytes(target.params)
    kvb = kv_bytes(target.cfg, curve["context"], target.params["embed"].dtype.itemsize)
    bound = (wb + kvb) / bandwidth_bytes_s
    return {
        "weight_bytes": wb,
        "kv_bytes": kvb,
        "bandwidth_bytes_s": bandwidth_bytes_s,
        "roofline_s": bound,
        "n": list(curve["n"]),
        "seconds": list(curve["seconds"]),
        "share_of_roofline": [bound / s for s in curve["seconds"]],
    }
