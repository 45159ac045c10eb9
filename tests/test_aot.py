"""jspec.aot: the HLO byte walker (exact counts on hand-made loops), its classes on a model loop, and
deviceless TPU / H200 compiles of the real loops through `jspec bench --aot` in the AOT interpreter."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jspec.aot import devices, hlo_bytes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _walk(fn, *shapes, weight_min=1, donate=()):
    text = jax.jit(fn, donate_argnums=donate).lower(*shapes).compile().as_text()
    return hlo_bytes.decode_loop_bytes(text, weight_min_bytes=weight_min, trace=True)


def test_walker_exact_bytes_of_a_matmul_loop():
    # Per round: x[8,256] @ w[256,512] -> tanh -> @ w.T: two GEMMs read w (512 KiB each) and the
    # activations; the tanh reads and writes [8,512]; the counter add reads 2 and writes 1 scalar.
    def f(w, x):
        def body(c):
            i, x = c
            return i + 1, jnp.tanh(x @ w) @ w.T
        return jax.lax.while_loop(lambda c: c[0] < 5, body, (0, x))

    r = _walk(f, jax.ShapeDtypeStruct((256, 512), jnp.float32), jax.ShapeDtypeStruct((8, 256), jnp.float32))
    w, x, h = 256 * 512 * 4, 8 * 256 * 4, 8 * 512 * 4
    assert r.weights == 2 * w
    assert r.other == (x + h) + (h + h) + (h + x) + 12
    assert r.kv_reads == 0 and r.cache_writes == 0
    assert r.total == r.weights + r.other
    assert r.kernels == 4 and not r.unknown_trips


def test_walker_in_place_update_slices_and_trip_count():
    # An inner fori_loop of 3 trips: a dynamic-update-slice of one [2,128] row block into a carried
    # rank-4 cache (written in place: only the update counts) and a dynamic-slice of one weight row.
    def g(cache, upd, w):
        def body(c):
            i, cache, acc = c

            def inner(j, st):
                cache, acc = st
                cache = jax.lax.dynamic_update_slice(cache, upd[None, None], (j, 0, i, 0))
                return cache, acc + jax.lax.dynamic_slice(w, (j, 0), (1, 128))[0]

            cache, acc = jax.lax.fori_loop(0, 3, inner, (cache, acc))
            return i + 1, cache, acc
        return jax.lax.while_loop(lambda c: c[0] < 7, body, (0, cache, jnp.zeros((128,), jnp.float32)))

    r = _walk(g, jax.ShapeDtypeStruct((3, 2, 64, 128), jnp.float32), jax.ShapeDtypeStruct((2, 128), jnp.float32),
              jax.ShapeDtypeStruct((3, 128), jnp.float32), weight_min=1536, donate=(0,))
    assert not r.unknown_trips
    assert r.weights == 3 * 128 * 4  # one row of w per trip, not the whole of w
    assert r.cache_writes == 3 * 2 * 128 * 4  # the update, not the [3,2,64,128] cache
    assert r.kv_reads == 0
    assert r.other > 3 * 2 * 128 * 4  # the update read, the accumulator, counters


def test_walker_counts_a_data_dependent_loop_at_its_static_bound():
    # An inner loop over the valid part of a [32,128] table in chunks of 4 rows, its trip count
    # clip(n - i, 1, 8) traced: counted at its upper bound, 8 trips of one 4-row chunk each.
    def g(table, n):
        def body(c):
            i, acc = c
            inner = lambda j, a: a + jax.lax.dynamic_slice(table, (j * 4, 0), (4, 128)).sum(0)
            return i + 1, jax.lax.fori_loop(0, jnp.clip(n - i, 1, 8), inner, acc)
        return jax.lax.while_loop(lambda c: c[0] < n, body, (0, jnp.zeros((128,), jnp.float32)))

    r = _walk(g, jax.ShapeDtypeStruct((32, 128), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32), weight_min=4096)
    assert not r.unknown_trips
    assert list(r.bounded_trips.values()) == [8]
    assert r.weights == 8 * 4 * 128 * 4


def test_an_inner_loops_running_sums_are_not_a_cache():
    # A rank-4 accumulator of 64 KiB carried by an inner loop (as attention's chunk loop carries its
    # running sums): its reads and writes are `other`, not K/V reads or cache writes.
    def g(x, n):
        def body(c):
            i, x = c
            acc = jax.lax.fori_loop(0, 3, lambda j, a: jnp.tanh(a) + x, jnp.zeros((2, 8, 8, 128), jnp.float32))
            return i + 1, x + acc.sum((0, 1))
        return jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))

    r = _walk(g, jax.ShapeDtypeStruct((8, 128), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32),
              weight_min=4096)
    assert r.kv_reads == 0 and r.cache_writes == 0 and r.other > 3 * 2 * 65536


def test_classes_on_a_model_decode_loop():
    from jspec.decode import ar
    from jspec.models.config import ModelConfig
    from jspec.models.transformer import init_params

    cfg = ModelConfig(family="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e4,
                      tie_word_embeddings=False, qk_norm=True, eos_token_ids=(), max_position_embeddings=4096)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    dcfg = ar.DecodeConfig(max_new_tokens=200, cache_size=256)
    args = (jax.ShapeDtypeStruct((1, 16), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.uint32))
    text = ar.generate_ar.lower(params, cfg, dcfg, *args).compile().as_text()
    r = hlo_bytes.decode_loop_bytes(text, weight_min_bytes=16384)
    matrices = sum(math.prod(x.shape) * 4 for x in jax.tree_util.tree_leaves(params) if x.ndim >= 2)
    embed = cfg.vocab_size * cfg.hidden_size * 4
    # Every matrix but the (gathered) embedding is read once per step.
    assert matrices - embed <= r.weights <= matrices - embed + 8192
    cache = 2 * cfg.num_layers * 256 * cfg.num_kv_heads * cfg.head_dim * 4
    assert r.kv_reads >= cache  # at least one pass over the whole cache (no valid-length cut-off here)
    assert 0 < r.cache_writes <= 4 * cache
    assert not r.unknown_trips  # the layer scan's trip count is known


# A dot fusion whose weight operand is read through a nested bitcast fusion (as XLA:TPU emits for the
# operands of its convolution fusions), hand-written: the weight is read whole, not scored zero.
_NESTED_HLO = """
HloModule nested

%bitcast_fusion (bitcast_input: bf16[4096,12288]) -> bf16[4096,12288] {
  %bitcast_input = bf16[4096,12288]{1,0} parameter(0)
  ROOT %bitcast.1 = bf16[4096,12288]{1,0} bitcast(%bitcast_input)
}

%slice_fusion (p.0: bf16[4096,12288]) -> bf16[4096,4096] {
  %p.0 = bf16[4096,12288]{1,0} parameter(0)
  %b.0 = bf16[4096,12288]{1,0} bitcast(%p.0)
  ROOT %s.0 = bf16[4096,4096]{1,0} slice(%b.0), slice={[0:4096], [0:4096]}
}

%dot_fusion (x: bf16[16,4096], w: bf16[4096,12288]) -> f32[16,12288] {
  %x = bf16[16,4096]{1,0} parameter(0)
  %w = bf16[4096,12288]{1,0} parameter(1)
  %nested = bf16[4096,12288]{1,0} fusion(%w), kind=kLoop, calls=%bitcast_fusion
  %conv = bf16[16,12288]{1,0} convolution(%x, %nested), dim_labels=bf_io->bf, metadata={op_name="jit(f)/dot_general"}
  ROOT %cvt = f32[16,12288]{1,0} convert(%conv)
}

%sliced_dot_fusion (x.1: bf16[16,4096], w.1: bf16[4096,12288]) -> bf16[16,4096] {
  %x.1 = bf16[16,4096]{1,0} parameter(0)
  %w.1 = bf16[4096,12288]{1,0} parameter(1)
  %nested.1 = bf16[4096,4096]{1,0} fusion(%w.1), kind=kLoop, calls=%slice_fusion
  ROOT %conv.1 = bf16[16,4096]{1,0} convolution(%x.1, %nested.1), dim_labels=bf_io->bf
}

%relayout_fusion (r.0: bf16[4096,12288]) -> bf16[12288,4096] {
  %r.0 = bf16[4096,12288]{1,0} parameter(0)
  ROOT %r.1 = bf16[12288,4096]{0,1} bitcast(%r.0)
}

%body (arg: (s32[], bf16[16,4096], bf16[4096,12288], bf16[4096,12288])) -> (s32[], bf16[16,4096], bf16[4096,12288], bf16[4096,12288]) {
  %arg = (s32[], bf16[16,4096]{1,0}, bf16[4096,12288]{1,0}, bf16[4096,12288]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %h = bf16[16,4096]{1,0} get-tuple-element(%arg), index=1
  %wt = bf16[4096,12288]{1,0} get-tuple-element(%arg), index=2
  %tab = bf16[4096,12288]{1,0} get-tuple-element(%arg), index=3
  %y = f32[16,12288]{1,0} fusion(%h, %wt), kind=kOutput, calls=%dot_fusion
  %z = bf16[16,4096]{1,0} fusion(%h, %wt), kind=kOutput, calls=%sliced_dot_fusion
  %t = bf16[12288,4096]{0,1} fusion(%tab), kind=kLoop, calls=%relayout_fusion
  ROOT %out = (s32[], bf16[16,4096]{1,0}, bf16[4096,12288]{1,0}, bf16[4096,12288]{1,0}) tuple(%next, %z, %wt, %tab)
}

%cond (carg: (s32[], bf16[16,4096], bf16[4096,12288], bf16[4096,12288])) -> pred[] {
  %carg = (s32[], bf16[16,4096]{1,0}, bf16[4096,12288]{1,0}, bf16[4096,12288]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%carg), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (w.2: bf16[4096,12288], x.2: bf16[16,4096], table.2: bf16[4096,12288]) -> bf16[16,4096] {
  %w.2 = bf16[4096,12288]{1,0} parameter(0), metadata={op_name="params['layers'][0]['w_up']"}
  %x.2 = bf16[16,4096]{1,0} parameter(1), metadata={op_name="x"}
  %table.2 = bf16[4096,12288]{1,0} parameter(2), metadata={op_name="table"}
  %zero = s32[] constant(0)
  %init = (s32[], bf16[16,4096]{1,0}, bf16[4096,12288]{1,0}, bf16[4096,12288]{1,0}) tuple(%zero, %x.2, %w.2, %table.2)
  %loop = (s32[], bf16[16,4096]{1,0}, bf16[4096,12288]{1,0}, bf16[4096,12288]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %res = bf16[16,4096]{1,0} get-tuple-element(%loop), index=1
}
"""


# A loop that updates a stacked [4, 1, 2, 64, 128] bf16 cache in place and hands it to two TPU kernels
# (hand-written): %one declares what it moves (its cost estimate: q, its output and one layer of the
# cache, 2048 + 2048 + 32768 bytes), %all declares nothing and is counted at its whole operands.
_DECLARED_HLO = """HloModule declared

%body (arg: (s32[], bf16[4,1,2,64,128], bf16[8,128])) -> (s32[], bf16[4,1,2,64,128], bf16[8,128]) {
  %arg = (s32[], bf16[4,1,2,64,128]{4,3,2,1,0}, bf16[8,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %z = s32[] constant(0)
  %step = s32[] constant(1)
  %next = s32[] add(%i, %step)
  %cache = bf16[4,1,2,64,128]{4,3,2,1,0} get-tuple-element(%arg), index=1
  %q = bf16[8,128]{1,0} get-tuple-element(%arg), index=2
  %row = bf16[1,1,2,1,128]{4,3,2,1,0} slice(%cache), slice={[0:1], [0:1], [0:2], [0:1], [0:128]}
  %upd = bf16[4,1,2,64,128]{4,3,2,1,0} dynamic-update-slice(%cache, %row, %i, %z, %z, %z, %z)
  %one = bf16[8,128]{1,0} custom-call(%q, %upd), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"x","cost_estimate":{"flops":"1","transcendentals":"0","bytes_accessed":"36864","remote_bytes_transferred":"0"}}}
  %all = bf16[8,128]{1,0} custom-call(%one, %upd), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"x"}}
  ROOT %out = (s32[], bf16[4,1,2,64,128]{4,3,2,1,0}, bf16[8,128]{1,0}) tuple(%next, %upd, %all)
}

%cond (carg: (s32[], bf16[4,1,2,64,128], bf16[8,128])) -> pred[] {
  %carg = (s32[], bf16[4,1,2,64,128]{4,3,2,1,0}, bf16[8,128]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%carg), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (c.2: bf16[4,1,2,64,128], q.2: bf16[8,128]) -> bf16[8,128] {
  %c.2 = bf16[4,1,2,64,128]{4,3,2,1,0} parameter(0), metadata={op_name="cache"}
  %q.2 = bf16[8,128]{1,0} parameter(1), metadata={op_name="q"}
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4,1,2,64,128]{4,3,2,1,0}, bf16[8,128]{1,0}) tuple(%zero, %c.2, %q.2)
  %loop = (s32[], bf16[4,1,2,64,128]{4,3,2,1,0}, bf16[8,128]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %res = bf16[8,128]{1,0} get-tuple-element(%loop), index=2
}
"""


def test_walker_takes_a_kernels_declared_bytes_for_its_cache_operands():
    layer, q = 2 * 64 * 128 * 2, 8 * 128 * 2
    r = hlo_bytes.decode_loop_bytes(_DECLARED_HLO, trace=True, weight_min_bytes=4096)
    items = {n.split("/")[-1]: b for n, _, b, _ in r.items}
    assert items["one"] == 36864 == q + q + layer  # one layer of the four, as declared
    assert items["all"] == q + 4 * layer + q  # no declaration: every operand whole
    assert r.kv_reads == layer + 4 * layer + 2 * 128 * 2  # and the slice of one [2, 128] row
    # A declaration never adds reads: scaled only down, and only the weight and cache operands.
    w, c, o = hlo_bytes.WEIGHT, hlo_bytes.CACHE, hlo_bytes.OTHER
    reads = [(c, 100.0), (w, 300.0), (o, 10.0)]
    assert hlo_bytes._within_declared(reads, 1000.0) == reads
    assert hlo_bytes._within_declared(reads, 110.0) == [(c, 25.0), (w, 75.0), (o, 10.0)]
    assert hlo_bytes._within_declared(reads, 5.0) == [(c, 0.0), (w, 0.0), (o, 10.0)]


def test_walker_reads_weights_through_nested_bitcast_fusions():
    w, x = 4096 * 12288 * 2, 16 * 4096 * 2
    by_size = hlo_bytes.decode_loop_bytes(_NESTED_HLO, trace=True)
    items = {n.split("/")[-1]: b for n, _, b, _ in by_size.items}
    assert items["y"] == w + x + 16 * 12288 * 4  # the whole weight, not 0
    assert items["z"] == 4096 * 4096 * 2 + x + 16 * 4096 * 2  # the nested fusion slices a third of it
    assert items["t"] == 2 * w  # a top-level fusion that only relayouts its operand reads it whole
    # By size, the loop-invariant table is a weight too; by argument, it is not.
    assert by_size.weights == w + 4096 * 4096 * 2 + w
    by_arg = hlo_bytes.decode_loop_bytes(_NESTED_HLO, trace=True, weight_args=("params", "dparams"))
    assert by_arg.weights == w + 4096 * 4096 * 2
    assert by_arg.total == by_size.total
    assert by_arg.op_names["body/y"] == "jit(f)/dot_general"


# Split-K partial sums [4,128,384] f32, as XLA:GPU's GEMM emits them, consumed by kernels that each keep
# a part of the sum (hand-written): the reduce over the splits runs before the slice, yet each output
# element reads its own column of every partial, so a kernel reads only the columns its output needs.
_PARTIALS_HLO = """
HloModule partials

%add_f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%k_fusion (p: f32[4,128,384], g: bf16[64]) -> bf16[128,64] {
  %p = f32[4,128,384]{2,1,0} parameter(0)
  %g = bf16[64]{0} parameter(1)
  %zero = f32[] constant(0)
  %sum = f32[128,384]{1,0} reduce(%p, %zero), dimensions={0}, to_apply=%add_f32
  %cvt = bf16[128,384]{1,0} convert(%sum)
  %k = bf16[128,64]{1,0} slice(%cvt), slice={[0:128], [256:320]}
  %gb = bf16[128,64]{1,0} broadcast(%g), dimensions={1}
  ROOT %m = bf16[128,64]{1,0} multiply(%k, %gb)
}

%all_fusion (q: f32[4,128,384], r: f32[4,128,384]) -> bf16[128,64] {
  %q = f32[4,128,384]{2,1,0} parameter(0)
  %r = f32[4,128,384]{2,1,0} parameter(1)
  %zero.1 = f32[] constant(0)
  %sum.1 = f32[128,384]{1,0} reduce(%q, %zero.1), dimensions={0}, to_apply=%add_f32
  %tot = f32[128]{0} reduce(%sum.1, %zero.1), dimensions={1}, to_apply=%add_f32
  %v = f32[128,64]{1,0} slice(%sum.1), slice={[0:128], [320:384]}
  %tb = f32[128,64]{1,0} broadcast(%tot), dimensions={0}
  %rs = f32[4,128,64]{2,1,0} slice(%r), slice={[0:4], [0:128], [0:64]}
  %rt = f32[4,64,128]{2,1,0} transpose(%rs), dimensions={0,2,1}
  %rd = f32[64,128]{1,0} reduce(%rt, %zero.1), dimensions={0}, to_apply=%add_f32
  %rdt = f32[128,64]{1,0} transpose(%rd), dimensions={1,0}
  %a1 = f32[128,64]{1,0} add(%v, %tb)
  %a2 = f32[128,64]{1,0} add(%a1, %rdt)
  ROOT %o = bf16[128,64]{1,0} convert(%a2)
}

%body (arg: (s32[], f32[4,128,384], bf16[64], bf16[128,64], bf16[128,64])) -> (s32[], f32[4,128,384], bf16[64], bf16[128,64], bf16[128,64]) {
  %arg = (s32[], f32[4,128,384]{2,1,0}, bf16[64]{0}, bf16[128,64]{1,0}, bf16[128,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %parts = f32[4,128,384]{2,1,0} get-tuple-element(%arg), index=1
  %gain = bf16[64]{0} get-tuple-element(%arg), index=2
  %kout = bf16[128,64]{1,0} fusion(%parts, %gain), kind=kLoop, calls=%k_fusion
  %aout = bf16[128,64]{1,0} fusion(%parts, %parts), kind=kLoop, calls=%all_fusion
  ROOT %out = (s32[], f32[4,128,384]{2,1,0}, bf16[64]{0}, bf16[128,64]{1,0}, bf16[128,64]{1,0}) tuple(%next, %parts, %gain, %kout, %aout)
}

%cond (carg: (s32[], f32[4,128,384], bf16[64], bf16[128,64], bf16[128,64])) -> pred[] {
  %carg = (s32[], f32[4,128,384]{2,1,0}, bf16[64]{0}, bf16[128,64]{1,0}, bf16[128,64]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%carg), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (p.2: f32[4,128,384], g.2: bf16[64], o.2: bf16[128,64]) -> bf16[128,64] {
  %p.2 = f32[4,128,384]{2,1,0} parameter(0)
  %g.2 = bf16[64]{0} parameter(1)
  %o.2 = bf16[128,64]{1,0} parameter(2)
  %zero.2 = s32[] constant(0)
  %init = (s32[], f32[4,128,384]{2,1,0}, bf16[64]{0}, bf16[128,64]{1,0}, bf16[128,64]{1,0}) tuple(%zero.2, %p.2, %g.2, %o.2, %o.2)
  %loop = (s32[], f32[4,128,384]{2,1,0}, bf16[64]{0}, bf16[128,64]{1,0}, bf16[128,64]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %res = bf16[128,64]{1,0} get-tuple-element(%loop), index=3
}
"""


def test_walker_reads_only_the_columns_a_fusion_keeps_of_a_reduced_value():
    items = {n.split("/")[-1]: b for n, _, b, _ in hlo_bytes.decode_loop_bytes(_PARTIALS_HLO, trace=True).items}
    out = 128 * 64 * 2
    # A slice of the reduced partials (a sixth of the columns of all 4 partials) and the broadcast gain.
    assert items["kout"] == 4 * 128 * 64 * 4 + 64 * 2 + out
    # The row total reads every column, so the first operand is read whole; the second operand is read
    # through a slice, a transpose and a reduce: its first 64 columns of each partial.
    assert items["aout"] == 4 * 128 * 384 * 4 + 4 * 128 * 64 * 4 + out


_HOISTED_HLO = """
HloModule hoisted

%dot_fusion (x: f32[8,256], w: f32[256,256]) -> f32[8,256] {
  %x = f32[8,256]{1,0} parameter(0)
  %w = f32[256,256]{1,0} parameter(1)
  ROOT %d = f32[8,256]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (arg: (s32[], f32[8,256], f32[256,256], f32[256,256])) -> (s32[], f32[8,256], f32[256,256], f32[256,256]) {
  %arg = (s32[], f32[8,256]{1,0}, f32[256,256]{1,0}, f32[256,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %h = f32[8,256]{1,0} get-tuple-element(%arg), index=1
  %wkv = f32[256,256]{1,0} get-tuple-element(%arg), index=2
  %mixed = f32[256,256]{1,0} get-tuple-element(%arg), index=3
  %y = f32[8,256]{1,0} fusion(%h, %wkv), kind=kOutput, calls=%dot_fusion
  %z = f32[8,256]{1,0} fusion(%y, %mixed), kind=kOutput, calls=%dot_fusion
  ROOT %out = (s32[], f32[8,256]{1,0}, f32[256,256]{1,0}, f32[256,256]{1,0}) tuple(%next, %z, %wkv, %mixed)
}

%cond (carg: (s32[], f32[8,256], f32[256,256], f32[256,256])) -> pred[] {
  %carg = (s32[], f32[8,256]{1,0}, f32[256,256]{1,0}, f32[256,256]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%carg), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (wk: f32[256,128], wv: f32[256,128], x.2: f32[8,256], m.2: f32[256,256]) -> f32[8,256] {
  %wk = f32[256,128]{1,0} parameter(0), metadata={op_name="params['layers'][0]['wk']"}
  %wv = f32[256,128]{1,0} parameter(1), metadata={op_name="params['layers'][0]['wv']"}
  %x.2 = f32[8,256]{1,0} parameter(2), metadata={op_name="x"}
  %m.2 = f32[256,256]{1,0} parameter(3), metadata={op_name="mask"}
  %cat = f32[256,256]{1,0} concatenate(%wk, %wv), dimensions={1}
  %cat.copy = f32[256,256]{0,1} copy(%cat)
  %mix = f32[256,256]{1,0} add(%cat, %m.2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,256]{1,0}, f32[256,256]{1,0}, f32[256,256]{1,0}) tuple(%zero, %x.2, %cat.copy, %mix)
  %loop = (s32[], f32[8,256]{1,0}, f32[256,256]{1,0}, f32[256,256]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %res = f32[8,256]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_weights_hoisted_out_of_the_loop_stay_weights():
    # XLA:TPU hoists loop-invariant work on weights (a concatenation of wk and wv, a relayout) out of
    # the decode loop: the result, made of weight arguments only, is a weight; one that mixes in a
    # non-weight argument is not.
    r = hlo_bytes.decode_loop_bytes(_HOISTED_HLO, weight_args=("params",))
    assert r.weights == 256 * 256 * 4
    assert r.other == 256 * 256 * 4 + 4 * 8 * 256 * 4 + 12


def test_weights_are_classified_by_argument_on_a_cpu_loop():
    # `mask` is loop-invariant and as large as the weight: by size it would be a weight.
    def f(params, mask, x):
        def body(c):
            i, x = c
            return i + 1, jnp.tanh(x @ params["w"]) * mask[i % 4]
        return jax.lax.while_loop(lambda c: c[0] < 5, body, (0, x))

    w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    text = jax.jit(f).lower({"w": w}, jax.ShapeDtypeStruct((4, 8, 256), jnp.float32),
                            jax.ShapeDtypeStruct((8, 256), jnp.float32)).compile().as_text()
    r = hlo_bytes.decode_loop_bytes(text, weight_min_bytes=1024, weight_args=("params",))
    assert r.weights == 256 * 256 * 4
    assert hlo_bytes.decode_loop_bytes(text, weight_min_bytes=1024).weights > r.weights


_TPU_NESTED_MATMUL = """
import jax, jax.numpy as jnp
from jspec.aot import devices, hlo_bytes
dev = devices.aot_device("tpu-v5p")
def f(w, x):
    def body(c):
        i, x = c
        y = (x @ w).reshape(16, 3, 4096).astype(jnp.float32).sum(1)
        return i + 1, (y + x).astype(x.dtype)
    return jax.lax.while_loop(lambda c: c[0] < 5, body, (0, x))
args = devices.abstract((jax.ShapeDtypeStruct((4096, 12288), jnp.bfloat16),
                         jax.ShapeDtypeStruct((16, 4096), jnp.bfloat16)), dev)
text = jax.jit(f).lower(*args).compile().as_text()
r = hlo_bytes.decode_loop_bytes(text, trace=True)
dots = [b for n, op, b, k in r.items if "convolution" in n]
print("NESTED", "bitcast_fusion" in text, r.weights, dots)
"""


def test_tpu_dot_fusion_reads_its_whole_weight():
    # A deviceless TPU compile of a bf16 [16,4096] @ [4096,12288] matmul in a while loop: XLA:TPU
    # feeds the weight to its convolution fusion through a nested bitcast fusion.
    env = {**os.environ, **devices.aot_env("tpu-v5p"), "PYTHONPATH": REPO}
    proc = subprocess.run([_aot_python(), "-c", _TPU_NESTED_MATMUL], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("NESTED")][0].split(" ", 3)
    assert line[1] == "True"  # the pattern is there
    w = 4096 * 12288 * 2
    assert float(line[2]) == w
    # the dot fusion: the weight + x [16,4096] bf16 read, f32 [16,12288] written
    assert json.loads(line[3]) == [w + 16 * 4096 * 2 + 16 * 12288 * 4]


def test_ideal_bytes_definition():
    from jspec.aot import bench

    info = {"weights_target": 1000, "embed_bytes": 300, "tied_head": False, "weights_drafter": 50,
            "drafter_head_bytes": 200, "kv_ideal": 70, "writes_ideal": 7}
    parts = bench.ideal_bytes(info)
    # the embedding table is only gathered; the drafter reads the shared head once more
    assert parts == {"weights": 1000 - 300 + 50, "drafter_head": 200, "kv": 70, "writes": 7,
                     "total": 750 + 200 + 77}
    tied = bench.ideal_bytes({**info, "tied_head": True})  # the table is the head: read whole
    assert tied["weights"] == 1050


def test_devices_contracts(monkeypatch):
    assert set(devices.CHIPS) == {"tpu-v5e", "tpu-v5p", "tpu-v6e", "h200"}
    assert devices.aot_env("tpu-v6e")["TPU_ACCELERATOR_TYPE"] == "v5litepod-1"
    assert devices.aot_env("h200")["XLA_FLAGS"] == "--xla_gpu_autotune_level=0"
    with pytest.raises(ValueError, match="unknown AOT chip 'v5p'"):
        devices.aot_env("v5p")
    assert "core_count: 132" in devices.h200_target_config()
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="libtpu==0.0.42.1"):
        devices.check_plugin("tpu-v5p")
    with pytest.raises(RuntimeError, match="jax-cuda12-plugin==0.10.2"):
        devices.check_plugin("h200")


def _aot_python() -> str:
    path = os.environ.get("JSPEC_AOT_PYTHON") or os.path.join(REPO, ".venv-aot", "bin", "python")
    if not os.path.exists(path):
        pytest.fail(f"no AOT interpreter at {path}: run `make .venv-aot/.done` (make test does) or set "
                    f"JSPEC_AOT_PYTHON to a Python with libtpu and jax-cuda12-plugin installed")
    return path


# About 40 s (TPU) and 20 s (H200) on 2 idle cores: three compiles each.
@pytest.mark.parametrize("chip", [pytest.param("tpu-v5p", marks=pytest.mark.slow), "h200"])
def test_bench_aot_real_loops_at_a_small_shape(chip, tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, **devices.aot_env(chip), "PYTHONPATH": REPO, "JSPEC_AOT_DUMP": str(tmp_path / "hlo")}
    proc = subprocess.run([_aot_python(), "-m", "jspec.cli", "bench", "--aot", chip, "--aot-shape", "tiny",
                           "--aot-quick", "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for label in ("chain B1 4k greedy", "tree B1 4k greedy", "ar B1 4k greedy"):
        assert label in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["chain B1 4k greedy", "tree B1 4k greedy", "ar B1 4k greedy"]
    for r in rows:
        b = r["bytes"]
        assert b["weights"] > 0 and b["kv_reads"] > 0 and b["other"] > 0
        if chip == "h200":  # XLA:TPU may keep this tiny model's target caches in VMEM (S(1)) across
            assert b["cache_writes"] > 0  # rounds, whose writes are on-chip and count zero
        assert b["total"] == pytest.approx(b["weights"] + b["kv_reads"] + b["cache_writes"] + b["other"])
        assert r["ideal"] == r["ideal_weights"] + r["ideal_drafter_head"] + r["ideal_kv"] + r["ideal_writes"] > 0
        if chip == "h200":  # every weight but the gathered embedding is read each round (XLA:TPU keeps
            assert b["weights"] >= r["ideal_weights"]  # this tiny model's weights in VMEM across rounds)
        assert r["ratio"] == pytest.approx(r["ideal"] / b["total"])
        assert r["kernels"] > 0 and r["memory"]["temp"] > 0 and r["cache_bytes"] > 0
        assert r["pass"] == all(r["checks"].values())
        split = r["temp_split"]  # read from the program's own buffer assignment (jspec.aot.temp)
        assert split["temp"] == r["memory"]["temp"] and 0 < split["data"] <= split["temp"]
        assert split["data"] + split["tables"] + split["outside"] == split["temp"]
    spec, tree, plain = rows
    # The speculative rounds also read the drafter's weights and, for its logits, the target's LM head
    # (tiny: vocab 1024 x 256, bf16); the embedding table is not in the ideal; a tree verifies more
    # rows than a chain.
    assert spec["ideal_weights"] > plain["ideal_weights"]
    assert spec["ideal_drafter_head"] == tree["ideal_drafter_head"] == 1024 * 256 * 2
    assert plain["ideal_drafter_head"] == 0
    assert tree["ideal_writes"] > spec["ideal_writes"]
    if chip == "h200":
        # XLA:GPU once merged the drafter's 10 context K/V products (5 layers x wk, wv [128, 256], one
        # shared input) by concatenating their weights into one [1280, 256] matrix every round.
        with gzip.open(tmp_path / "hlo" / "h200_tiny_chain-B1-4k-greedy.hlo.gz", "rt") as f:
            module = hlo_bytes.parse_module(f.read())
        body = module.computations[hlo_bytes.find_decode_loop(module).attr("body")]
        stacked = [i.name for i in body.instrs.values() if "concatenate" in i.name
                   and getattr(i.shape, "dims", None) == (1280, 256)]
        assert not stacked, stacked


def test_device_round_times_the_aot_loops_on_this_device(tmp_path):
    """`jspec.benchmarks.device_round` runs the --aot programs for real (here: the CPU, the tiny shape) and
    scores the program it timed: AR commits one token a loop step, so the two lengths differ by as many
    steps as tokens; the ratios are the ones its columns define."""
    from jspec.benchmarks import device_round

    out = tmp_path / "rows.json"
    assert device_round.main(["--shape", "tiny", "--cases", "ar-1-1k-greedy,chain-1-1k-greedy", "--repeats", "1",
                              "--lengths", "8,24", "--bandwidth-gb", "0.05", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["case"] for r in rows] == ["ar B1 1k greedy", "chain B1 1k greedy"]
    plain, chain = rows
    assert plain["iterations"]["24"] - plain["iterations"]["8"] == 16
    assert chain["iterations"]["24"] - chain["iterations"]["8"] >= 1
    for r in rows:
        # a difference of two timings: its sign is the machine's load, not the code's (no timing asserted)
        assert math.isfinite(r["round_s"]) and r["hlo_bytes"] > 0 and 0 < r["ideal_bytes"]
        assert r["hlo_ratio"] == pytest.approx(r["ideal_bytes"] / r["hlo_bytes"])
        assert r["achieved"] == pytest.approx(r["ideal_bytes"] / (r["round_s"] * r["bandwidth"]))
    assert chain["ideal_bytes"] > plain["ideal_bytes"]  # the drafter's weights and its head read
    with pytest.raises(SystemExit, match="KIND-BATCH-CONTEXTk-VERIFIER"):
        device_round.parse_case("chain-1-4096-greedy")
