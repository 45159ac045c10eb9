"""The kernels lower for the real backends at production-like shapes, checked on CPU without a device.

Lowering runs Pallas' own backend passes: for TPU the Mosaic lowering (block shapes against the
(8, 128) tiling, every op in the body), for CUDA the Triton lowering of the portable kernels
(power-of-two shapes, supported ops). The device compilers that follow (Mosaic's layout passes in
libtpu, Triton's PTX) need the hardware and do not run here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jspec.kernels import draft_layer, tree_attention
from jspec.models import transformer
from jspec.models.config import ModelConfig

S = jax.ShapeDtypeStruct
TPU = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
    device_kind="TPU v6 lite", num_cores=1, platform="tpu"))


@pytest.mark.parametrize("platform, impl", [("tpu", "tpu"), ("cuda", "portable")])
@pytest.mark.parametrize("block, dtype, head_dim, heads, kv_heads, hidden, mlp", [
    (16, jnp.bfloat16, 128, 32, 8, 4096, 12288),  # Qwen3-8B-like draft layer, block 16
    (5, jnp.float32, 64, 8, 2, 512, 1536),  # odd block (padded), Dh 64, float32
])
def test_kernels_lower_for_the_device_backends(platform, impl, block, dtype, head_dim, heads, kv_heads, hidden, mlp):
    cfg = ModelConfig(family="qwen3", vocab_size=128, hidden_size=hidden, intermediate_size=mlp, num_layers=1,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, qk_norm=True)
    lp = jax.tree_util.tree_map(lambda shape: S(shape, dtype), transformer.param_shapes(cfg)["layers"][0],
                                is_leaf=lambda x: isinstance(x, tuple))
    # 4000 rows: not a multiple of the 512-row tile. The draft layer's context cache is rows-major, the
    # target's KV cache (read by tree attention) heads-major.
    ctx_cache = S((2, 4000, kv_heads * head_dim), dtype)  # the drafter's context cache rows
    kv_cache = S((2, kv_heads, 4000, head_dim), dtype)
    i32 = lambda *shape: S(shape, jnp.int32)
    nodes = 40  # two bitmask words
    draft = jax.jit(lambda *a: draft_layer(*a, cfg, impl=impl, interpret=False))
    tree = jax.jit(lambda *a: tree_attention(*a, impl=impl, interpret=False))
    draft_args = (S((2, 1, block, hidden), dtype), lp, ctx_cache, ctx_cache, i32(2, 1), i32())
    tree_args = (S((2, nodes, heads, head_dim), dtype), kv_cache, kv_cache, S((2, nodes, kv_heads, head_dim), dtype),
                 S((2, nodes, kv_heads, head_dim), dtype), i32(2, nodes), i32(2), i32(2, nodes, 2), i32())
    mesh = TPU if platform == "tpu" else jax.sharding.AbstractMesh((), ())
    with jax.sharding.use_abstract_mesh(mesh):
        for fn, args in ((draft, draft_args), (tree, tree_args)):
            text = fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
            assert ("tpu_custom_call" if platform == "tpu" else "triton") in text
