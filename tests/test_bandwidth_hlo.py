"""Structural checks on the optimized CPU HLO of the decode passes: a round pays for the bytes it must.

- No instruction inside a loop of verify passes copies a weight matrix or a cache buffer: layers are
  unrolled over per-layer weights (a slice of a stacked weight is a copy on XLA:CPU and XLA:GPU) and
  each layer's cache buffer is updated in place.
- Attention work does not grow with the cache's size at a fixed context: the KV chunk loop runs up to
  the highest valid row, so the compiled pass is the same program whatever `cache_size` is.

The model's dimensions are chosen so that no activation has the shape of a weight or a cache buffer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jspec.aot.hlo_bytes import parse_module
from jspec.decode import profile
from jspec.models import attention, transformer
from jspec.models import target as tm
from jspec.models.config import ModelConfig

CFG = ModelConfig(family="qwen3", vocab_size=96, hidden_size=80, intermediate_size=144, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=20, qk_norm=True, sliding_window=24,
                  layer_types=("full_attention", "sliding_attention", "full_attention"))
BATCH, WIDTH, CONTEXT = 2, 5, 40
# Results allowed to have a weight's or a cache buffer's shape: they pass a buffer on or update it in place.
PASS_THROUGH = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
                "dynamic-update-slice", "scatter"}


def _compiled_passes(cache_size: int):
    params = transformer.init_params(CFG, jax.random.key(0))
    cache = tm.init_cache(CFG, BATCH, cache_size)
    pos = jnp.broadcast_to(CONTEXT + jnp.arange(WIDTH, dtype=jnp.int32), (BATCH, WIDTH))
    run = profile._timed_passes(CFG)  # the profiler's loop of verify passes, weights and cache as arguments
    return params, cache, run.lower(params, cache, jnp.zeros((BATCH, WIDTH), jnp.int32), pos).compile()


def _in_place(module, ins) -> bool:
    if ins.opcode in PASS_THROUGH:
        return True
    if ins.opcode == "fusion":
        fused = module.computations[ins.attr("calls")]
        return fused.instrs[fused.root].opcode in ("dynamic-update-slice", "scatter")
    return False


@pytest.fixture(scope="module")
def compiled_1024():
    return _compiled_passes(1024)


def test_verify_passes_copy_no_weight_and_no_cache_buffer(compiled_1024):
    params, cache, compiled = compiled_1024
    guarded = {tuple(sorted(x.shape)) for x in jax.tree_util.tree_leaves(params) if x.ndim == 2}
    guarded |= {tuple(sorted(x.shape)) for x in jax.tree_util.tree_leaves(cache)}
    module = parse_module(compiled.as_text())
    offenders, checked = [], 0
    # The entry computation copies the (not donated) arguments once per call, outside the loop.
    for comp in module.computations.values():
        if comp.name == module.entry:
            continue
        for name in comp.order:
            ins = comp.instrs[name]
            leaves = ins.shape if isinstance(ins.shape, list) else [ins.shape]
            if any(getattr(leaf, "dims", None) is not None and tuple(sorted(leaf.dims)) in guarded
                   for leaf in leaves):
                checked += 1
                if not _in_place(module, ins):
                    offenders.append(f"{comp.name}: {name} = {ins.opcode} {ins.shape}")
    assert checked >= 2 * CFG.num_layers, "the check saw none of the per-layer cache updates"
    assert not offenders, "weight- or cache-sized buffers materialised inside the loop:\n" + "\n".join(offenders)


def test_attention_work_does_not_grow_with_cache_size(compiled_1024):
    small = compiled_1024[2].cost_analysis()["flops"]
    large = _compiled_passes(4096)[2].cost_analysis()["flops"]
    assert large == small  # one chunk step's work, whatever the cache size
    # ... and the chunk loop's trip count follows the context, not the cache.
    ctx, rows = jnp.full((BATCH,), CONTEXT), CONTEXT + jnp.arange(WIDTH)[None].repeat(BATCH, 0)
    counts = [int(attention.num_chunks(ctx, rows, s, attention.KV_CHUNK)) for s in (1024, 4096, 32768)]
    assert counts == [1, 1, 1]
    assert int(attention.num_chunks(ctx + 600, rows + 600, 4096, attention.KV_CHUNK)) == 3


def test_one_block_attention_does_grow_with_cache_size():
    """The control: attending over every row (kv_chunk=None) is work proportional to the cache, and the
    cost analysis sees it, so the equality above is not a blind spot of the analysis."""
    def flops(size):
        params = transformer.init_params(CFG, jax.random.key(0))
        cache = tm.init_cache(CFG, BATCH, size)
        pos = jnp.broadcast_to(CONTEXT + jnp.arange(WIDTH, dtype=jnp.int32), (BATCH, WIDTH))
        fn = jax.jit(lambda p, c, t: transformer.forward(p, CFG, t, pos, c, kv_chunk=None).hidden)
        return fn.lower(params, cache, jnp.zeros((BATCH, WIDTH), jnp.int32)).compile().cost_analysis()["flops"]

    assert flops(4096) > 1.5 * flops(1024)


def test_the_flax_module_costs_nothing_in_the_compiled_pass():
    """`forward` applies the linen module; the optimized program equals the one of the layer functions
    called directly on the same parameter pytree (the module is only traced)."""
    import re

    from jspec.models.config import default_rope_inv_freq

    params = transformer.init_params(CFG, jax.random.key(0))
    cache = tm.init_cache(CFG, BATCH, 512)
    pos = jnp.broadcast_to(CONTEXT + jnp.arange(WIDTH, dtype=jnp.int32), (BATCH, WIDTH))

    def direct(p, c, t):
        h = p["embed"][t]
        inv_freq = jnp.asarray(default_rope_inv_freq(CFG))
        for lp, k, v, window in zip(p["layers"], c.k, c.v, CFG.windows):
            h, k, v = transformer._layer(CFG, inv_freq, h, lp, k, v, window, pos, pos, pos[:, 0], None, "reference",
                                         attention.KV_CHUNK)
        return transformer.rms_norm(h, p["final_norm"], CFG.rms_norm_eps)

    def through_module(p, c, t):
        return transformer.forward(p, CFG, t, pos, c).hidden

    def program(fn):
        text = jax.jit(fn).lower(params, cache, jnp.zeros((BATCH, WIDTH), jnp.int32)).compile().as_text()
        ops = re.findall(r"^\s*(?:ROOT )?%\S+ = (\S+) (\w[\w-]*)\(", text, flags=re.M)
        return sorted(ops)

    assert program(through_module) == program(direct)
