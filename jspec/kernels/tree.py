"""Tree attention: T new tokens (a token tree's nodes) over the committed cache plus, among
themselves, the keys a compact per-row bitmask allows (ancestors and the node itself).

Contract (`ref_tree_attention` is the specification):
    q [B, T, Hq, Dh]; k_cache, v_cache [B, Hkv, S, Dh] (heads-major: the target's `KVCache` layer
    buffers, read in place); k_new, v_new [B, T, Hkv, Dh] (the new tokens' own keys / values, in the
    projections' layout like q); positions [B, T] int32; ctx_len [B]: cache rows < ctx_len are
    committed, their position is their row index; bits [B, T, ceil(T / 32)] int32: new key k is
    visible to query i iff bit k % 32 of bits[b, i, k // 32] is set; window: int32 scalar, 0 = full
    attention, else a key is visible iff key_pos > query_pos - window (applied to new keys too unless
    window_new=False). Returns [B, T, Hq, Dh] in q's dtype; a query with no visible key gets zeros.
    Cache rows >= ctx_len are never read into the result (NaN there cannot leak). Query head h reads
    KV head h // (Hq / Hkv).

Kernels: "tpu" (Mosaic TPU: grid (batch, kv-head group, cache tile), the cache streamed in blocks of
(heads per step, tile rows, Dh) through the double-buffered BlockSpec pipeline with tiles outside
[window start, ctx_len) skipped without DMA, online softmax in VMEM scratch; tile rows and KV heads per
step from the generation's `TPU_TILES` budget: at Qwen3-8B shape on v5p, 8 heads x 1024 rows x 128 x 2 B
= 2 MiB per K tile, K + V double-buffered 8 MiB) and "portable" (the GPU variant, lowered through
Triton: grid (batch, KV head), each program walks its KV head's contiguous [S, Dh] cache slab once,
in tiles of kv_rows rows [64 bf16 / 32 float32] by an in-kernel loop, and folds every tile into the
online softmax of each of the head's Hq / Hkv query heads: q [Tp, Dh] per head + K, V tiles are its dot
operands, within shared memory: 48 KiB per pipeline stage at Tp 64, bf16, plus the group's q). See jspec.kernels for
selection.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jspec.kernels import _tiles
from jspec.kernels._backend import (GpuTiles, TpuTiles, gpu_tiles, kv_heads_per_step, pallas_setup, pow2_at_least,
                                    pow2_at_most, query_rows, require_pow2, round_up, tpu_tiles, vmem_limit)


def pack_bits(mask: jax.Array) -> jax.Array:
    """Dense visibility [..., T, N] bool -> bitmask [..., T, ceil(N / 32)] int32."""
    n = mask.shape[-1]
    words = -(-n // 32)
    padded = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, words * 32 - n)])
    bits = padded.reshape(*mask.shape[:-1], words, 32).astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32)
    return lax.bitcast_convert_type(jnp.sum(bits, axis=-1, dtype=jnp.uint32), jnp.int32)


def unpack_bits(bits: jax.Array, n: int) -> jax.Array:
    """Bitmask [..., T, W] int32 -> dense visibility [..., T, n] bool (the inverse of `pack_bits`)."""
    k = jnp.arange(n)
    return ((jnp.take(bits, k // 32, axis=-1) >> (k % 32)) & 1).astype(bool)


def ref_tree_attention(q, k_cache, v_cache, k_new, v_new, positions, ctx_len, bits, window, *,
                       window_new: bool = True) -> jax.Array:
    """Pure-jnp tree attention (the specification of the kernels; see the module docstring)."""
    b, t, hq, dh = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    rows = jnp.arange(s)
    committed = rows[None, :] < ctx_len[:, None]  # [B, S]
    in_window = rows[None, None, :] > positions[:, :, None] - window
    cache_vis = committed[:, None, :] & ((window == 0) | in_window)  # [B, T, S]
    new_vis = unpack_bits(bits, t)  # [B, T, T]
    if window_new:
        new_vis = new_vis & ((window == 0) | (positions[:, None, :] > positions[:, :, None] - window))
    # Keys / values [B, Hkv, S + T, Dh]: the committed cache rows, then the new tokens'.
    joined = lambda cache, new: jnp.concatenate(
        [jnp.where(committed[:, None, :, None], cache, 0).astype(q.dtype), jnp.swapaxes(new, 1, 2)], axis=2)
    keys, vals = joined(k_cache, k_new), joined(v_cache, v_new)
    mask = jnp.concatenate([cache_vis, new_vis], axis=2)
    qg = q.reshape(b, t, hkv, hq // hkv, dh)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, keys, preferred_element_type=jnp.float32) * dh**-0.5
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -jnp.inf), axis=-1)
    probs = jnp.where(jnp.any(mask, axis=-1)[:, None, None, :, None], probs, 0.0)
    out = jnp.einsum("bkgts,bksd->btkgd", probs.astype(vals.dtype), vals)
    return out.reshape(b, t, hq, dh)


def tree_attention(q, k_cache, v_cache, k_new, v_new, positions, ctx_len, bits, window, *,
                   window_new: bool = True, impl: str | None = None, interpret: Any = None,
                   block_k: int | None = None, kv_heads: int | None = None, layer=None) -> jax.Array:
    """Tree attention by a Pallas kernel; same contract and result as `ref_tree_attention`.

    impl / interpret: see `jspec.kernels.pallas_setup`. block_k: cache rows per tile (TPU: a multiple
    of 8, default the generation's `cache_rows`; GPU: rounded down to a power of two, default 64 for
    bf16, 32 for float32; the cache needs no padding: the TPU kernel's last tile overhangs and is
    masked, the portable kernel shifts its last tile back inside). kv_heads: KV heads per grid step on
    TPU (default: the most whose K tile fits the generation's `cache_tile_bytes`, at least the fewest
    whose lanes are a multiple of 128). layer: the caches are stacked [L, B, Hkv, S, Dh] (a scanned
    layer loop) and the kernel reads layer `layer` (a traced index, prefetched as a scalar that picks
    each tile's block) in place; TPU kernel only."""
    impl, interpret = pallas_setup(impl, interpret)
    b, t, hq, dh = q.shape
    if impl == "portable" and not interpret:
        require_pow2(head_dim=dh)
    if layer is not None and impl != "tpu":
        raise ValueError("a stacked cache (layer_loop='scan') is read by the TPU kernel only; on GPU keep the "
                         "unrolled layer loop (layer_loop='unroll'), whose per-layer caches the GPU kernel reads")
    lead = 0 if layer is None else 1
    hkv, s = k_cache.shape[lead + 1], k_cache.shape[lead + 2]
    group = hq // hkv
    window = jnp.asarray(window, jnp.int32)
    tp = query_rows(t, impl)  # padded rows see no new key and are dropped
    lo = jnp.where(window > 0, jnp.maximum(jnp.min(positions, axis=1) - window + 1, 0), 0).astype(jnp.int32)
    hi = ctx_len.astype(jnp.int32)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2))
    # On GPU, q, the new keys / values and the output keep their t rows: the kernel's [tp]-row blocks
    # overhang them, with loads and stores masked to the first t rows (no padded copy per layer).
    rows = pad if impl == "tpu" else (lambda x: x)
    qf = rows(q).reshape(b, -1, hq * dh)
    knf, vnf = (rows(x.astype(q.dtype)).reshape(b, -1, hkv * dh) for x in (k_new, v_new))
    pos = jnp.pad(positions.astype(jnp.int32), [(0, 0), (0, tp - t)], mode="edge")
    words = bits.shape[-1] if impl == "tpu" else pow2_at_least(bits.shape[-1])  # GPU: power-of-two shapes
    bits = jnp.pad(pad(bits.astype(jnp.int32)), [(0, 0), (0, 0), (0, words - bits.shape[-1])])
    common = dict(group=group, dh=dh, tp=tp, scale=dh**-0.5, window_new=window_new)
    scalars = (lo, hi, window.reshape(1))
    tensors = (qf, knf, vnf, pos[:, :, None], pos[:, None, :], bits, k_cache, v_cache)
    if impl == "tpu":
        tiles = tpu_tiles()
        bk = min(round_up(block_k or tiles.cache_rows, 8), round_up(s, 8))
        hk = kv_heads or _tpu_kv_heads(hkv, dh, bk, k_cache.dtype.itemsize, tiles.cache_tile_bytes)
        out = _tpu_call(scalars, tensors, hk=hk, block_k=bk, interpret=interpret, tiles=tiles, layer=layer, **common)
    else:
        gt = gpu_tiles(jnp.dtype(q.dtype).itemsize)
        out = _portable_call(scalars, tensors, block_k=pow2_at_most(min(block_k or gt.kv_rows, s)), gt=gt,
                             interpret=interpret, **common)
    return out[:, :t].reshape(b, t, hq, dh)  # TPU: drops the padded rows; GPU: already t rows


def _tpu_kv_heads(hkv: int, dh: int, block_k: int, itemsize: int, tile_bytes: int) -> int:
    """The most KV heads per TPU step (a divisor of hkv whose q / new-key lanes, heads * dh, are a
    multiple of 128) whose K tile [heads, block_k, dh] fits tile_bytes in VMEM; at least the fewest
    lane-aligned ones."""
    best = kv_heads_per_step(hkv, dh)
    for k in range(best, hkv + 1):
        if hkv % k == 0 and (k * dh) % 128 == 0 and _cache_tile_bytes(k, block_k, dh, itemsize) <= tile_bytes:
            best = k
    return best


def _cache_tile_bytes(heads: int, block_k: int, dh: int, itemsize: int) -> int:
    """VMEM bytes of one K (or V) cache block (heads, block_k, dh) on TPU: each head's [block_k, dh] tile
    takes whole 128-lane rows."""
    return heads * block_k * round_up(dh, 128) * itemsize


def layer_attention(q, k, v, k_cache, v_cache, positions, cache_rows, ctx_len, tree_mask, window, layer=None,
                    **options):
    """The attention of `transformer._layer` in a tree pass, by the kernel: [B, T, Hq, Dh].

    q [B, T, Hq, Dh]; k, v [B, T, Hkv, Dh]: the new tokens' keys / values; k_cache, v_cache
    [B, Hkv, S, Dh] (the layer's cache buffers as they are) with those already written at cache_rows
    [B, T]; tree_mask [B, T, T] dense, packed here into the bitmask. Contract (every jspec tree pass):
    cache_rows >= ctx_len, so new tokens never overwrite committed rows. layer: the caches are stacked
    [L, B, Hkv, S, Dh] and layer `layer` is read. options: as `tree_attention`."""
    s = k_cache.shape[-2]
    # A new token whose row fell outside the cache was dropped by the write: the reference cannot see it.
    written = (cache_rows >= 0) & (cache_rows < s)
    bits = pack_bits(tree_mask & written[:, None, :])
    # The reference reads new keys back from the cache, so round them through its dtype the same way.
    k_new, v_new = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
    return tree_attention(q, k_cache, v_cache, k_new, v_new, positions, ctx_len, bits, window, layer=layer,
                          **options)


def _stack_heads(q_ref, c: int, group: int, dh: int) -> jax.Array:
    """Query rows of KV head c's group heads stacked [group * T, Dh]: one matmul per KV head (TPU)."""
    return jnp.concatenate([q_ref[:, (c * group + g) * dh:(c * group + g + 1) * dh] for g in range(group)], axis=0)


def _new_visibility(bits_ref, pos_col, pos_row, window, tp: int, window_new: bool, group: int = 1):
    """[group * T, T] visibility of the new keys to the queries, repeated for `group` stacked heads."""
    vis = _tiles.unpack_bits(bits_ref, tp)
    if window_new:
        vis = vis & ((window == 0) | (pos_row > pos_col - window))
    return jnp.concatenate([vis] * group, axis=0) if group > 1 else vis


def _tpu_kernel(lo_ref, hi_ref, win_ref, q_ref, kn_ref, vn_ref, pc_ref, pr_ref, bits_ref, kc_ref, vc_ref,
                o_ref, q_s, m_s, l_s, acc_s, *, hk, group, dh, tp, block_k, num_tiles, scale, window_new):
    b, j = pl.program_id(0), pl.program_id(2)
    lo, hi, window = lo_ref[b], hi_ref[b], win_ref[0]
    first, last = _tiles.context_tiles(lo, hi, block_k, num_tiles)
    rows_stat = group * tp
    store, load = _tiles.stats_in_scratch(m_s, l_s, acc_s, rows_stat)

    @pl.when(j == 0)
    def _new_keys():
        vis = _new_visibility(bits_ref, pc_ref[...], pr_ref[...], window, tp, window_new, group)
        for c in range(hk):
            q = _stack_heads(q_ref, c, group, dh)
            q_s[c] = q
            cols = slice(c * dh, (c + 1) * dh)
            store(c, _tiles.attend(_tiles.init_stats(rows_stat, dh), q, kn_ref[:, cols], vn_ref[:, cols], vis, scale))

    @pl.when((j >= first) & (j <= last) & (lo < hi))
    def _cache_tile():
        pos = jnp.concatenate([pc_ref[...]] * group, axis=0)  # [group * T, 1]
        rows = j * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        vis = (rows < hi) & ((window == 0) | (rows > pos - window))
        rows_c = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        readable = (rows_c >= lo) & (rows_c < hi)  # zero the rest: 0 * NaN would poison the sum
        for c in range(hk):
            v = jnp.where(readable, vc_ref[c], 0).astype(q_s.dtype)
            store(c, _tiles.attend(load(c), q_s[c], kc_ref[c].astype(q_s.dtype), v, vis, scale))

    @pl.when(j == num_tiles - 1)
    def _finish():
        for c in range(hk):
            _, l, acc = load(c)
            o = _tiles.finish(l, acc)
            for g in range(group):
                head = c * group + g
                o_ref[:, head * dh:(head + 1) * dh] = o[g * tp:(g + 1) * tp].astype(o_ref.dtype)


def _tpu_call(scalars, tensors, *, hk, group, dh, tp, block_k, scale, window_new, interpret, tiles: TpuTiles,
              layer=None):
    qf, knf, vnf, pos_col, pos_row, bits, kc, vc = tensors
    stacked = layer is not None  # a stacked [L, B, Hkv, S, Dh] cache: the layer is a 4th prefetched scalar
    if stacked:
        scalars += (jnp.asarray(layer, jnp.int32).reshape(1),)
    b, hkv, s, _ = kc.shape[-4:]
    num_tiles = -(-s // block_k)
    words = bits.shape[-1]

    def cache_map(bi, g, j, lo_ref, hi_ref, win_ref, *layer_ref):
        first, last = _tiles.context_tiles(lo_ref[bi], hi_ref[bi], block_k, num_tiles)
        return tuple(r[0] for r in layer_ref) + (bi, g, jnp.clip(j, first, last), 0)

    row_map = lambda bi, g, j, *_: (bi, 0, g)
    fixed = lambda bi, g, j, *_: (bi, 0, 0)
    kernel = functools.partial(_tpu_kernel, hk=hk, group=group, dh=dh, tp=tp, block_k=block_k,
                               num_tiles=num_tiles, scale=scale, window_new=window_new)
    if stacked:  # the layer index only picks the cache blocks
        kernel = functools.partial(lambda body, lo, hi, win, _layer, *refs: body(lo, hi, win, *refs), kernel)
    cache_block = (None,) * (1 + stacked) + (hk, block_k, dh)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(b, hkv // hk, num_tiles),
        in_specs=[
            pl.BlockSpec((None, tp, hk * group * dh), row_map),
            pl.BlockSpec((None, tp, hk * dh), row_map),
            pl.BlockSpec((None, tp, hk * dh), row_map),
            pl.BlockSpec((None, tp, 1), fixed),
            pl.BlockSpec((None, 1, tp), fixed),
            pl.BlockSpec((None, tp, words), fixed),
            pl.BlockSpec(cache_block, cache_map),
            pl.BlockSpec(cache_block, cache_map),
        ],
        out_specs=pl.BlockSpec((None, tp, hk * group * dh), row_map),
        scratch_shapes=[
            pltpu.VMEM((hk, group * tp, dh), qf.dtype),
            pltpu.VMEM((hk, group * tp, _tiles.STAT_LANES), jnp.float32),
            pltpu.VMEM((hk, group * tp, _tiles.STAT_LANES), jnp.float32),
            pltpu.VMEM((hk, group * tp, dh), jnp.float32),
        ],
    )
    # Double-buffered blocks (q / out [tp, hk*group*dh], new K / V, bits, cache K / V tiles) plus scratch.
    q_bytes = tp * hk * group * dh * qf.dtype.itemsize
    tile_bytes = _cache_tile_bytes(hk, block_k, dh, kc.dtype.itemsize)
    need = (2 * (2 * q_bytes + 2 * tp * hk * dh * knf.dtype.itemsize + 2 * tile_bytes)
            + q_bytes + 4 * hk * group * tp * (2 * _tiles.STAT_LANES + dh))
    # What a call moves at most (every tile of the context): its blocks, the output and one layer's K and
    # V, however many layers a stacked cache holds. XLA sees the kernel's whole operands; the byte
    # accounting of compiled rounds (jspec.aot.hlo_bytes) reads this declaration instead.
    layer_cache = 2 * b * hkv * s * dh * kc.dtype.itemsize
    small = sum(x.size * x.dtype.itemsize for x in (*scalars, qf, knf, vnf, pos_col, pos_row, bits))
    cost = pl.CostEstimate(flops=4 * b * hkv * group * tp * (s + tp) * dh,
                           transcendentals=b * hkv * group * tp * (s + tp),
                           bytes_accessed=small + qf.size * qf.dtype.itemsize + layer_cache)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qf.shape, qf.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit(need, tiles)),
        cost_estimate=cost,
        interpret=interpret,
    )(*scalars, *tensors)


def _portable_kernel(lo_ref, hi_ref, win_ref, q_ref, kn_ref, vn_ref, pc_ref, pr_ref, bits_ref, kc_ref, vc_ref,
                     o_ref, *, group, dh, t, tp, block_k, scale, window_new):
    """One KV head of one batch row and the `group` q heads that read it: the new keys its bitmask
    allows, then the cache in tiles, each K / V tile loaded once for the whole group."""
    b = pl.program_id(0)
    lo, hi, window = lo_ref[b], hi_ref[b], win_ref[0]
    s = kc_ref.shape[0]
    first, last = _tiles.context_tiles(lo, hi, block_k, -(-s // block_k))
    vis_new = _new_visibility(bits_ref, pc_ref[...], pr_ref[...], window, tp, window_new)
    pos = pc_ref[...]
    # q, the new keys / values and the output have t rows; their [tp, .] blocks overhang: rows >= t
    # are loaded as zeros (invisible new keys, whose zero values add nothing) and never stored.
    valid = jnp.broadcast_to(lax.broadcasted_iota(jnp.int32, (tp, 1), 0) < t, (tp, dh))
    rows = lambda ref: pltriton.load(ref, mask=valid, other=0)
    qs = [rows(q_ref.at[:, g * dh:(g + 1) * dh]) for g in range(group)]  # q head g of the group: [Tp, Dh]
    dt = qs[0].dtype
    kn, vn = rows(kn_ref), rows(vn_ref)
    states = tuple(_tiles.attend(_tiles.init_stats(tp, dh), q, kn, vn, vis_new, scale) for q in qs)

    def tile(i, states):
        # The last tile is shifted back to end at row S (no read past the cache); rows it shares with
        # the previous tile are masked so that no key is counted twice.
        start = jnp.minimum(i * block_k, s - block_k)
        rows = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        rows_c = start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        vis = (rows >= i * block_k) & (rows < hi) & ((window == 0) | (rows > pos - window))
        readable = (rows_c >= jnp.maximum(lo, i * block_k)) & (rows_c < hi)
        k = kc_ref[pl.ds(start, block_k), :].astype(dt)
        v = jnp.where(readable, vc_ref[pl.ds(start, block_k), :], 0).astype(dt)
        return tuple(_tiles.attend(st, q, k, v, vis, scale) for st, q in zip(states, qs))

    states = lax.fori_loop(first, jnp.where(lo < hi, last + 1, first), tile, states)
    for g, (_, l, acc) in enumerate(states):
        pltriton.store(o_ref.at[:, g * dh:(g + 1) * dh], _tiles.finish(l, acc).astype(o_ref.dtype), mask=valid)


def _portable_call(scalars, tensors, *, group, dh, tp, block_k, scale, window_new, gt: GpuTiles, interpret):
    qf, knf, vnf, pos_col, pos_row, bits, kc, vc = tensors
    b, hkv, s, _ = kc.shape
    kernel = functools.partial(_portable_kernel, group=group, dh=dh, t=qf.shape[1], tp=tp, block_k=block_k,
                               scale=scale, window_new=window_new)
    whole = lambda x: pl.BlockSpec(x.shape, lambda bi, h: (0,) * x.ndim)
    per_row = lambda x: pl.BlockSpec((None, *x.shape[1:]), lambda bi, h: (bi,) + (0,) * (x.ndim - 1))
    heads = lambda width: pl.BlockSpec((None, tp, width), lambda bi, h: (bi, 0, h))  # columns h * width ..
    cache = pl.BlockSpec((None, None, s, dh), lambda bi, h: (bi, h, 0, 0))  # the KV head's [S, Dh]
    return pl.pallas_call(
        kernel,
        grid=(b, hkv),
        compiler_params=pltriton.CompilerParams(num_warps=gt.warps, num_stages=gt.stages),
        in_specs=[*(whole(x) for x in scalars), heads(group * dh), heads(dh), heads(dh), per_row(pos_col),
                  per_row(pos_row), per_row(bits), cache, cache],
        out_specs=heads(group * dh),
        out_shape=jax.ShapeDtypeStruct(qf.shape, qf.dtype),
        interpret=interpret,
    )(*scalars, *tensors)
