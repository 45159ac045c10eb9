"""Structural checks on the optimized CPU HLO of the decode passes: a round pays for the bytes it must.

- No instruction inside a loop of verify passes copies a weight matrix or a cache buffer: layers are
  unrolled over per-layer weights (a slice of a stacked weight is a copy on XLA:CPU and XLA:GPU) and
  each layer's cache buffer is updated in place. The same for hybrid (Gated DeltaNet) targets, chain
  and tree verify passes, with their MoE expert stacks.
- Attention work does not grow with the cache's size at a fixed context: the KV chunk loop runs up to
  the highest valid row, so the compiled pass is the same program whatever `cache_size` is.
- The tree-attention kernel reads each layer's [B, Hkv, S, Dh] cache buffers as they are: a tree pass
  with attention="pallas" rearranges no cache buffer into another layout.

The model's dimensions are chosen so that no activation has the shape of a weight or a cache buffer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jspec.aot.hlo_bytes import parse_module
from jspec.decode import profile
from jspec.decode.spec import ancestor_mask
from jspec.models import attention, hybrid, layers, transformer
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
    run = profile.timed_passes(CFG)  # the profiler's loop of verify passes, weights and cache as arguments
    return params, cache, run.lower(params, cache, jnp.zeros((BATCH, WIDTH), jnp.int32), pos).compile()


def _sized_like(module, shapes, *, skip_entry: bool = False):
    """(computation, instruction, dims) for every array result of the module whose dimensions are those of
    one of `shapes` in some order (dims: that result's dimensions)."""
    keys = {tuple(sorted(shape)) for shape in shapes}
    for comp in module.computations.values():
        if skip_entry and comp.name == module.entry:
            continue
        for name in comp.order:
            ins = comp.instrs[name]
            for leaf in ins.shape if isinstance(ins.shape, list) else [ins.shape]:
                if getattr(leaf, "dims", None) is not None and tuple(sorted(leaf.dims)) in keys:
                    yield comp, ins, leaf.dims


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
    guarded = [x.shape for x in jax.tree_util.tree_leaves(params) if x.ndim == 2]
    guarded += [x.shape for x in jax.tree_util.tree_leaves(cache)]
    module = parse_module(compiled.as_text())
    offenders, checked = set(), set()
    # The entry computation copies the (not donated) arguments once per call, outside the loop.
    for comp, ins, _ in _sized_like(module, guarded, skip_entry=True):
        checked.add((comp.name, ins.name))
        if not _in_place(module, ins):
            offenders.add(f"{comp.name}: {ins.name} = {ins.opcode} {ins.shape}")
    assert len(checked) >= 2 * CFG.num_layers, "the check saw none of the per-layer cache updates"
    listing = "\n".join(sorted(offenders))
    assert not offenders, "weight- or cache-sized buffers materialised inside the loop:\n" + listing


def _relayouts(module, cache_shape) -> list[str]:
    """Instructions that hold a cache-sized array in another dimension order than the cache's, or
    transpose one: a rearranged copy of a cache buffer."""
    return sorted({f"{comp.name}: {ins.name} = {ins.opcode} {ins.shape}"
                   for comp, ins, dims in _sized_like(module, [cache_shape])
                   if dims != tuple(cache_shape) or ins.opcode == "transpose"})


def test_tree_kernel_reads_the_cache_in_its_layout():
    """A tree verify pass through `transformer.forward(..., attention="pallas")` (the TPU kernel,
    interpreted on CPU) hands the kernel each layer's [B, Hkv, S, Dh] buffers as they are: nowhere in the
    optimized HLO is a cache-sized array transposed or held in another dimension order (a rows-major
    [B, S, Hkv, Dh] view of the cache would be a transpose and a copy per layer per pass).

    This HLO does hold copies of the cache in its own shape: the interpreter's, which carries every
    kernel operand through its loop over the grid and writes each block back, so XLA copies the
    loop-carried buffers. Compiled for TPU / GPU the kernel is one custom call reading them in place.
    The control at the end: the same check flags a swapaxes of the cache into the rows-major view."""
    size = 1024  # two of the kernel's 512-row tiles
    params = transformer.init_params(CFG, jax.random.key(0))
    cache = tm.init_cache(CFG, BATCH, size)
    parent = jnp.broadcast_to(jnp.array([-1, 0, 0, 1]), (BATCH, WIDTH - 1))  # of nodes 1.. (-1: the root)
    depth = jnp.array([0, 1, 2, 2, 3])
    ctx_len = jnp.full((BATCH,), CONTEXT, jnp.int32)
    kw = dict(ctx_len=ctx_len, cache_rows=CONTEXT + jnp.arange(WIDTH)[None].repeat(BATCH, 0),
              tree_mask=ancestor_mask(parent), attention="pallas")
    pos = CONTEXT + depth[None].repeat(BATCH, 0)
    run = jax.jit(lambda p, c, t: transformer.forward(p, CFG, t, pos, c, **kw))
    module = parse_module(run.lower(params, cache, jnp.zeros((BATCH, WIDTH), jnp.int32)).compile().as_text())
    cache_shape = cache.k[0].shape
    relayouts = _relayouts(module, cache_shape)
    assert not relayouts, "cache buffers rearranged in the tree pass:\n" + "\n".join(relayouts)

    rows_major = jax.jit(lambda k: jnp.swapaxes(k, 1, 2).reshape(BATCH, size, -1) * 2)
    assert _relayouts(parse_module(rows_major.lower(cache.k[0]).compile().as_text()), cache_shape)


def test_attention_work_does_not_grow_with_cache_size(compiled_1024):
    small = compiled_1024[2].cost_analysis()["flops"]
    large = _compiled_passes(4096)[2].cost_analysis()["flops"]
    assert large == small  # one chunk step's work, whatever the cache size
    # ... and the chunk loop's trip count follows the context, not the cache.
    ctx, rows = jnp.full((BATCH,), CONTEXT), CONTEXT + jnp.arange(WIDTH)[None].repeat(BATCH, 0)
    chunk = attention.chunk_rows(attention.KV_CHUNK)  # this CPU's: 256 rows
    counts = [int(attention.num_chunks(ctx, rows, s, chunk)) for s in (1024, 4096, 32768)]
    assert counts == [1, 1, 1]
    assert int(attention.num_chunks(ctx + 600, rows + 600, 4096, chunk)) == 3


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


def test_gpu_attention_steps_cut_the_cache_evenly():
    """On GPU the default step cuts a loop's cache (a round size plus the verify rows) into equal steps,
    so no step re-reads the rows of the one before; an explicit size and the other backends keep theirs."""
    s = 4096 + 17
    assert attention.step_rows(attention.KV_CHUNK, s, "gpu") == 2057  # 2 steps: 4114 rows for 4113
    assert attention.step_rows(attention.KV_CHUNK, 4096, "gpu") == 4096
    assert attention.step_rows(attention.KV_CHUNK, 32768 + 17, "gpu") == 3643  # 9 steps, 2 rows to spare
    assert attention.step_rows(attention.KV_CHUNK, s, "cpu") == attention.step_rows(attention.KV_CHUNK, s, "tpu") == 256
    assert attention.step_rows(300, s, "gpu") == 300 and attention.step_rows(None, s, "gpu") is None
    # A long prefill's step shrinks with its query rows (bounded f32 scores), never below CPU's 256.
    assert attention.step_rows(attention.KV_CHUNK, s, "gpu", queries=64) == 1371  # 3 x 1371, at most 2048
    assert attention.step_rows(attention.KV_CHUNK, s, "gpu", queries=3968) == 242  # 17 x 242, at most 256
    assert attention.step_rows(attention.KV_CHUNK, 32768 + 64, "gpu", queries=32768) == 255  # 129 steps


def test_gpu_static_steps():
    """On GPU the default steps are unrolled with static bounds: whole steps of a multiple of 256 rows (at
    most STEP_SCORES (query, row) pairs), the rest in a last one; one block when the cache fits a step,
    and a loop for explicit sizes, other backends, or more than STATIC_STEPS steps."""
    kv = attention.KV_CHUNK
    assert attention.static_steps(kv, 4096 + 16, "gpu", queries=16) == ((0, 4096), (4096, 16))
    assert attention.static_steps(kv, 4096 + 17, "gpu", queries=17) == ((0, 4096), (4096, 17))
    assert attention.static_steps(kv, 4096 + 33, "gpu", queries=33) == ((0, 3840), (3840, 289))  # 131072 // 33
    assert attention.static_steps(kv, 4096 + 64, "gpu", queries=64) == ((0, 2048), (2048, 2048), (4096, 64))
    assert attention.static_steps(kv, 32768 + 1, "gpu") == tuple((i * 4096, 4096) for i in range(8)) + ((32768, 1),)
    assert attention.static_steps(kv, 4096, "gpu") is None  # one block
    assert attention.static_steps(kv, 65536 + 1, "gpu") is None  # 17 steps: the loop
    assert attention.static_steps(300, 4113, "gpu") is None and attention.static_steps(kv, 4113, "cpu") is None


def test_attention_in_static_steps_equals_one_block(monkeypatch):
    """The unrolled path (forced here on CPU, with 32-row steps) gives one block's attention, never reads
    the NaN rows past the valid context, and skips the steps no row can see."""
    monkeypatch.setattr(attention, "STATIC_STEP_BACKENDS", ("cpu",))
    monkeypatch.setattr(attention, "KV_CHUNK_ROWS", {**attention.KV_CHUNK_ROWS, "cpu": 32})
    monkeypatch.setattr(attention, "STEP_ALIGN", 16)
    b, t, hq, hkv, dh, s = 2, 5, 4, 2, 16, 100
    assert attention.static_steps(attention.KV_CHUNK, s, queries=t) == ((0, 32), (32, 32), (64, 32), (96, 4))
    keys = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(keys[0], (b, t, hq, dh))
    for ctx in ([20, 27], [60, 83]):  # the first sees steps 0-1 only, the second steps 0-2
        ctx = jnp.array(ctx)
        rows = ctx[:, None] + jnp.arange(t)[None]
        valid = (jnp.arange(s)[None, :] < (ctx + t)[:, None])[:, None, :, None]
        k = jnp.where(valid, jax.random.normal(keys[1], (b, hkv, s, dh)), jnp.nan)
        v = jnp.where(valid, jax.random.normal(keys[2], (b, hkv, s, dh)), jnp.nan)
        for window in (0, 7):
            full = attention.attend(q, k, v, rows, rows, ctx, window=window, kv_chunk=None)
            stepped = jax.jit(lambda *a: attention.attend(*a, window=window))(q, k, v, rows, rows, ctx)
            assert bool(jnp.all(jnp.isfinite(full)))
            assert jnp.allclose(stepped, full, atol=1e-5)
    text = jax.jit(lambda *a: attention.attend(*a)).lower(q, k, v, rows, rows, ctx).as_text()
    assert text.count("stablehlo.case") + text.count("stablehlo.if") == 3  # steps 1-3 are conditional


def test_attention_in_uneven_steps_equals_one_block():
    """Steps that do not divide the cache (the last one clamped) give one block's attention, and rows
    past the valid context (NaN here) are never read."""
    b, t, hq, hkv, dh, s = 2, 5, 4, 2, 16, 100
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (b, t, hq, dh))
    ctx = jnp.array([60, 83])
    rows = ctx[:, None] + jnp.arange(t)[None]
    valid = (jnp.arange(s)[None, :] < (ctx + t)[:, None])[:, None, :, None]
    k = jnp.where(valid, jax.random.normal(keys[1], (b, hkv, s, dh)), jnp.nan)
    v = jnp.where(valid, jax.random.normal(keys[2], (b, hkv, s, dh)), jnp.nan)
    full = attention.attend(q, k, v, rows, rows, ctx, kv_chunk=None)
    assert bool(jnp.all(jnp.isfinite(full)))
    for step in (37, 51, 99):
        assert jnp.allclose(attention.attend(q, k, v, rows, rows, ctx, kv_chunk=step), full, atol=1e-5)


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
        return layers.rms_norm(h, p["final_norm"], CFG.rms_norm_eps)

    def through_module(p, c, t):
        return transformer.forward(p, CFG, t, pos, c).hidden

    def program(fn):
        text = jax.jit(fn).lower(params, cache, jnp.zeros((BATCH, WIDTH), jnp.int32)).compile().as_text()
        ops = re.findall(r"^\s*(?:ROOT )?%\S+ = (\S+) (\w[\w-]*)\(", text, flags=re.M)
        return sorted(ops)

    assert program(through_module) == program(direct)


# --- hybrid (Gated DeltaNet) targets ---------------------------------------------------------------

# GDN and attention layers, MoE and dense MLPs (layer 1), sized so that no activation has the shape of
# a weight, an expert stack or a K/V buffer.
HCFG = hybrid.HybridConfig(
    family="qwen3_next", vocab_size=96, hidden_size=36, num_layers=4,
    layer_types=("linear_attention", "full_attention") * 2, num_heads=4, num_kv_heads=2, head_dim=12,
    partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=6,
    linear_value_head_dim=10, linear_conv_kernel_dim=4, intermediate_size=44, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=14, shared_expert_intermediate_size=18, mlp_only_layers=(1,))


def _hybrid_inputs(cache_size: int):
    params = hybrid.init_params(HCFG, jax.random.key(0))
    cache = tm.init_cache(HCFG, BATCH, cache_size)
    pos = jnp.broadcast_to(CONTEXT + jnp.arange(WIDTH, dtype=jnp.int32), (BATCH, WIDTH))
    return params, cache, jnp.zeros((BATCH, WIDTH), jnp.int32), pos


def _hybrid_tree_passes():
    """A loop of tree verify passes like the speculative loop's, [anchor, 4 nodes] per row, each pass
    committing the state of its last node; and the nodes' positions."""
    nodes = jnp.broadcast_to(jnp.array([-1, 0, 0, 1]), (BATCH, WIDTH - 1))  # parents of nodes 1.. (-1: the anchor)
    parent = jnp.concatenate([jnp.full((BATCH, 1), -1), nodes + 1], axis=1)
    rows = CONTEXT + jnp.arange(WIDTH)[None].repeat(BATCH, 0)
    kw = dict(ctx_len=jnp.full((BATCH,), CONTEXT, jnp.int32), cache_rows=rows, tree_mask=ancestor_mask(nodes),
              parent=parent, keep_states=True)

    def passes(params, cache, tokens, pos):
        def step(_, carry):
            cache, tokens = carry
            hidden, cache, _, states = tm.forward(params, HCFG, tokens, pos, cache, **kw)
            cache = tm.commit_states(HCFG, cache, states, jnp.full((BATCH,), WIDTH - 1), jnp.ones((BATCH,), bool))
            return cache, jnp.argmax(tm.logits(params, HCFG, hidden), axis=-1).astype(jnp.int32)

        return jax.lax.fori_loop(0, 4, step, (cache, tokens))[1]

    depth = jnp.array([0, 1, 2, 2, 3])
    return jax.jit(passes), CONTEXT + depth[None].repeat(BATCH, 0)


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_hybrid_verify_passes_copy_no_weight_and_no_cache_buffer(kind):
    """The check above on a hybrid target: inside a loop of verify passes (keep_states=True; chains: the
    profiler's loop, trees: with each pass's commit) no weight matrix, expert stack or K/V buffer is
    copied, per-layer weights and caches passed as arguments.

    The recurrent states are not guarded: the recurrence computes a new [B, HV, dk, dv] state per token
    (work, not a copy), and the commit gathers one of the pass's per-position states."""
    params, cache, tokens, pos = _hybrid_inputs(1024)
    if kind == "chain":
        run = profile.timed_passes(HCFG)
    else:
        run, pos = _hybrid_tree_passes()
    module = parse_module(run.lower(params, cache, tokens, pos).compile().as_text())
    guarded = [x.shape for x in jax.tree_util.tree_leaves(params) if x.ndim >= 2]
    guarded += [x.shape for x in cache.k + cache.v]
    offenders, checked = set(), set()
    for comp, ins, _ in _sized_like(module, guarded, skip_entry=True):
        checked.add((comp.name, ins.name))
        if not _in_place(module, ins):
            offenders.add(f"{comp.name}: {ins.name} = {ins.opcode} {ins.shape}")
    assert len(checked) >= 2 * HCFG.counts["attn"], "the check saw none of the per-layer K/V updates"
    assert not offenders, "weight- or cache-sized buffers materialised in the loop:\n" + "\n".join(sorted(offenders))


def _ops(fn, *args) -> list[tuple[str, str]]:
    """(result type, opcode) of every instruction of fn's optimized CPU program, sorted."""
    import re

    text = jax.jit(fn).lower(*args).compile().as_text()
    return sorted(re.findall(r"^\s*(?:ROOT )?%\S+ = (\S+) (\w[\w-]*)\(", text, flags=re.M))


def test_the_hybrid_flax_module_costs_nothing_in_the_compiled_pass():
    """`hybrid.forward` applies the linen module; its optimized verify pass equals the one of the layer
    functions called directly on the same parameter pytree and per-layer caches."""
    params, cache, tokens, pos = _hybrid_inputs(512)
    ps = hybrid.PassInputs(pos, pos, pos[:, 0], None, None, None, jnp.asarray(hybrid.rope_inv_freq(HCFG)),
                           keep_states=True, gdn_impl="recurrent", chunk_size=64)

    def direct(p, c, t):
        h = p["embed"][t]
        states = {hybrid.FULL: list(zip(c.k, c.v)), hybrid.LINEAR: list(zip(c.conv, c.ssm))}
        for i, (lp, j) in enumerate(zip(p["layers"], HCFG.slots)):
            kind = HCFG.layer_types[i]
            h, states[kind][j], _ = hybrid._layer(HCFG, i, lp, h, states[kind][j], ps)
        return layers.zc_rms_norm(h, p["final_norm"], HCFG.rms_norm_eps)

    def through_module(p, c, t):
        return hybrid.forward(p, HCFG, t, pos, c, keep_states=True).hidden

    assert _ops(through_module, params, cache, tokens) == _ops(direct, params, cache, tokens)
