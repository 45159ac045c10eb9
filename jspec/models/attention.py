"""Attention of new tokens over a static KV cache, at a cost proportional to the valid context.

The cache is preallocated ([B, Hkv, S, Dh] per layer), but a decode round only needs the rows that
hold committed history plus the rows the pass itself writes. `attend` reads the cache in chunks of
`kv_chunk` rows up to the highest row any query of the batch may see (a dynamic trip count), with an
online softmax in float32, so its cost follows the longest valid row, not `S`. No masked copy of the
cache is ever built: scores of rows a query may not see are set to -inf, and the value rows nobody
may see are zeroed chunk by chunk (stale or NaN-filled memory must not leak through 0 * NaN).

Visibility (the same for every path): query i of row b sees cache row r iff
  r < ctx_len[b]                              (committed history), or
  r == cache_rows[b, k] and new_vis[b, i, k]  (a new token of this pass: causal by position, or the
                                               tree's ancestor mask),
and, for a sliding layer of window W, the key's position > query position - W (committed rows sit at
their own index, new rows at their given position).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jspec.platform import compile_backend

KV_CHUNK = "auto"  # the attention step of the compile backend (`chunk_rows`); an int asks for that many rows
# Cache rows per attention step, by compile backend. On CPU, 256: big enough to amortise a step, small
# enough that the trip count follows the valid context. On a GPU each step launches its own kernels, and
# at 256 rows the launches, not the bytes, set a round's time: on an H200 at Qwen3-8B / context 4k
# (`python -m jspec.benchmarks.device_round`), plain AR took 22.4 ms a token with 256-row steps and 5.85 ms
# with 4096 (0.80 of the copy-bandwidth roofline), a DFlash-b16 round 30.0 and 10.4 ms. TPU keeps 256
# (its figures are bytes from deviceless compiles, not times).
KV_CHUNK_ROWS = {"cpu": 256, "gpu": 4096, "tpu": 256}
EQUAL_STEPS = ("gpu",)  # backends whose default steps cut the cache evenly (`step_rows`)
# Backends whose default steps are unrolled with static bounds (`static_steps`), up to STATIC_STEPS of
# them: XLA:GPU fuses a static slice of the cache into the GEMM that reads it, while the dynamic slice of
# a `fori_loop` step is first copied out (the chunk's K and V written and read once more), and a chunk of
# rows that is not a multiple of STEP_ALIGN is padded, K, V and probabilities copied again. On CPU and
# TPU steps are 256 rows (many per cache) and stay a loop.
STATIC_STEP_BACKENDS = ("gpu",)
STATIC_STEPS = 16
STEP_ALIGN = 256
STEP_SCORES = 1 << 17  # there, query rows x cache rows of one step at most (a prefill's f32 scores)


def chunk_rows(kv_chunk: int | str | None, backend: str | None = None) -> int | None:
    """Rows per attention step: `kv_chunk` itself, or for KV_CHUNK the backend's (KV_CHUNK_ROWS; default:
    the compile backend)."""
    if isinstance(kv_chunk, str):
        if kv_chunk != KV_CHUNK:
            raise ValueError(f"kv_chunk must be a number of rows, None or {KV_CHUNK!r}, got {kv_chunk!r}")
        return KV_CHUNK_ROWS.get(backend or compile_backend(), KV_CHUNK_ROWS["cpu"])
    return kv_chunk


def step_rows(kv_chunk: int | str | None, size: int, backend: str | None = None, queries: int = 1) -> int | None:
    """Rows per attention step over a cache of `size` rows for `queries` query rows: `chunk_rows(kv_chunk)`,
    except for the default on a backend of EQUAL_STEPS, where the cache is cut into equal steps of at
    most that many rows. A loop's cache is a round size plus the verify pass's rows (4096 + 17), so fixed
    4096-row steps would end in a second, clamped step that re-reads almost the whole context for the
    last rows; equal steps (2 x 2057) read each row once. There a step also scores at most STEP_SCORES
    (query, row) pairs, down to CPU's 256 rows: a 64-token prefill takes 2048-row steps, a 4k one 256,
    so a prefill's f32 scores stay small (a verify pass of up to 32 rows keeps 4k-row steps). Where
    `static_steps` applies (a few steps), it sets the bounds instead. CPU and TPU keep
    fixed steps: their boundaries then do not depend on the cache size, so plain and speculative decoding
    add up the same rows in the same order."""
    backend = backend or compile_backend()
    rows = chunk_rows(kv_chunk, backend)
    if kv_chunk != KV_CHUNK or backend not in EQUAL_STEPS:
        return rows
    rows = min(rows, max(KV_CHUNK_ROWS["cpu"], STEP_SCORES // max(queries, 1)))
    if size <= rows:
        return rows
    return -(-size // -(-size // rows))


def static_steps(kv_chunk: int | str | None, size: int, backend: str | None = None,
                 queries: int = 1) -> tuple[tuple[int, int], ...] | None:
    """(start, rows) of each attention step over a cache of `size` rows, unrolled with static bounds, for
    the default step on a backend of STATIC_STEP_BACKENDS; None where `attend` takes one block (the cache
    fits a step) or loops. Steps of `chunk_rows` rows, or of at most STEP_SCORES (query, row) pairs, in
    multiples of STEP_ALIGN rows; the last one takes the rest (4096 + 17 rows: 4096 and 17). Every
    step after the first runs only if some row of the batch can see its first row, so the cost still
    follows the valid context, a step at a time."""
    backend = backend or compile_backend()
    if kv_chunk != KV_CHUNK or backend not in STATIC_STEP_BACKENDS:
        return None
    rows = min(chunk_rows(kv_chunk, backend), max(KV_CHUNK_ROWS["cpu"], STEP_SCORES // max(queries, 1)))
    rows = max(STEP_ALIGN, rows // STEP_ALIGN * STEP_ALIGN)
    steps = -(-size // rows)
    if steps <= 1 or steps > STATIC_STEPS:
        return None
    return tuple((i * rows, min(rows, size - i * rows)) for i in range(steps))


def write_rows(cache: jax.Array, new: jax.Array, cache_rows: jax.Array, layer: jax.Array | None = None) -> jax.Array:
    """cache [B, Hkv, S, Dh] with new [B, T, Hkv, Dh] written at rows cache_rows [B, T] (T <= S).

    Every pass writes consecutive rows per batch row (cache_rows[b] = start_b + arange(T): prefill,
    decoding, chain and tree verification, whose nodes take consecutive scratch rows), and that is the
    contract: only cache_rows[:, 0] is read. Rows >= S are dropped (`write_block`). layer: a traced
    index into a stacked cache [L, B, Hkv, S, Dh] (a scanned layer loop), whose layer `layer` takes
    the rows in place."""
    return write_block(cache, jnp.swapaxes(new, 1, 2), cache_rows[:, 0], axis=2, layer=layer)


UNROLL_MAX_ROWS = 64  # batch rows up to which XLA:TPU gets one block slice / update per row (see write_block)
STACKED_MIN_ROWS = 8  # the least rows of a block written into a layer of a stacked cache (see write_block)


def _per_row(batch: int) -> bool:
    return compile_backend() == "tpu" and batch <= UNROLL_MAX_ROWS


def _lead(layer) -> tuple:
    """Index prefix of a stacked cache's layer (none for a cache of one layer)."""
    return () if layer is None else (jnp.asarray(layer, jnp.int32),)


def _corner(shape: tuple[int, ...], i: int, first, axis: int, lead: tuple) -> tuple:
    return lead + (i,) + (0,) * (axis - 1) + (first,) + (0,) * (len(shape) - axis - 1)


_IN_BOUNDS = jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS  # every block was clipped into the cache


def _windows(batch: int, ndim: int, block_start: jax.Array, lead: tuple):
    """(corners [B, len(lead) + 2], window dims, collapsed dims): each batch row's block as one gather /
    scatter window of a cache of rank len(lead) + ndim."""
    index = [jnp.broadcast_to(x, (batch,)) for x in lead] + [jnp.arange(batch, dtype=jnp.int32), block_start]
    return jnp.stack(index, axis=1), tuple(range(1, ndim)), tuple(range(len(lead) + 1))


def _read_blocks(cache: jax.Array, block_start: jax.Array, axis: int, t: int, lead: tuple = ()) -> jax.Array:
    """[B, ..., T, ...]: each batch row's T-row block along `axis` from block_start (see write_block);
    lead: the layer index of a stacked cache."""
    n = len(lead)
    shape = cache.shape[n:]  # one layer's [B, ...]
    size = (1,) + shape[1:axis] + (t,) + shape[axis + 1:]
    if _per_row(shape[0]):
        return jnp.concatenate([jax.lax.dynamic_slice(cache, _corner(shape, i, block_start[i], axis, lead),
                                                      (1,) * n + size).reshape(size)
                                for i in range(shape[0])], axis=0)
    corners, window, collapsed = _windows(shape[0], len(shape), block_start, lead)
    return jax.lax.gather(cache, corners, jax.lax.GatherDimensionNumbers(
        offset_dims=window, collapsed_slice_dims=collapsed, start_index_map=collapsed + (n + axis,)),
        (1,) * n + size, indices_are_sorted=True, mode=_IN_BOUNDS)


def _write_blocks(cache: jax.Array, blocks: jax.Array, block_start: jax.Array, axis: int, lead: tuple = ()) -> jax.Array:
    """cache with each batch row's block written at block_start along `axis` (see write_block)."""
    n = len(lead)
    shape = cache.shape[n:]
    if _per_row(shape[0]):
        for i in range(shape[0]):
            block = blocks[i:i + 1].reshape((1,) * (n + 1) + blocks.shape[1:])
            cache = jax.lax.dynamic_update_slice(cache, block, _corner(shape, i, block_start[i], axis, lead))
        return cache
    corners, window, collapsed = _windows(shape[0], len(shape), block_start, lead)
    return jax.lax.scatter(cache, corners, blocks, jax.lax.ScatterDimensionNumbers(
        update_window_dims=window, inserted_window_dims=collapsed, scatter_dims_to_operand_dims=collapsed + (n + axis,)),
        indices_are_sorted=True, unique_indices=True, mode=_IN_BOUNDS)


def write_block(cache: jax.Array, new: jax.Array, start: jax.Array, axis: int,
                keep: jax.Array | None = None, layer: jax.Array | None = None) -> jax.Array:
    """cache [B, ...] with the T rows of new (cache's rank, T along `axis`) written at rows start[b] +
    0..T-1 of that axis, where keep [B, T] (default: all); rows past the cache are dropped. layer: the
    cache is stacked [L, B, ...] and layer `layer` (a traced index) takes the rows.

    Each batch row's T-row block is read, merged and written back whole, in place under jit when the
    old cache is dead. A scatter of single rows would make XLA:TPU keep the cache in a row-scatter
    layout and relay it out and back around every Pallas kernel that reads it (two copies of every
    layer's cache per pass). How the blocks move is the one choice per platform that keeps every cache
    in place (checked in the optimized HLO: tests/test_bandwidth_hlo.py on CPU, `jspec bench --aot` for
    TPU and GPU): on TPU one dynamic slice / update per batch row, unrolled up to UNROLL_MAX_ROWS rows
    (XLA:TPU lays a windowed scatter's cache out batch-minor, and copies a cache carried through a loop
    over rows); elsewhere, and for larger batches, one windowed gather and scatter of all rows' blocks
    (XLA:CPU copies the cache between unrolled updates)."""
    lead = _lead(layer)
    t, s = new.shape[axis], cache.shape[len(lead) + axis]
    if t > s:
        raise ValueError(f"a pass of {t} tokens does not fit a cache of {s} rows")
    # A layer of a stacked cache takes blocks of at least STACKED_MIN_ROWS rows: for a block of one row
    # (a decode step) XLA:TPU lays the whole stacked cache out rows-major and copies it around every
    # kernel that reads it (v5p, AR at batch 8: 368 GB a round instead of 20).
    w = min(max(t, STACKED_MIN_ROWS), s) if lead else t
    start = start.astype(jnp.int32)
    block_start = jnp.clip(start, 0, s - w)  # the block stays inside the cache; rows past it drop out
    offset = block_start[:, None] + jnp.arange(w) - start[:, None]  # [B, W]: new row of each block row
    valid = (offset >= 0) & (offset < t)
    if keep is not None:
        valid &= jnp.take_along_axis(keep, jnp.clip(offset, 0, t - 1), axis=1)
    along = (slice(None),) + (None,) * (axis - 1) + (slice(None),) + (None,) * (new.ndim - axis - 1)
    fresh = jnp.take_along_axis(new.astype(cache.dtype), jnp.clip(offset, 0, t - 1)[along], axis=axis)
    block = jnp.where(valid[along], fresh, _read_blocks(cache, block_start, axis, w, lead))
    return _write_blocks(cache, block, block_start, axis, lead)


def read_rows(cache: jax.Array, start: jax.Array, width: int) -> jax.Array:
    """[B, Hkv, width, Dh]: each batch row's cache rows start[b] .. start[b] + width - 1 (clipped to
    the cache), read as one block per row (a gather of single rows would make XLA:TPU keep the cache
    in a row-gather layout: see `write_block`)."""
    s = cache.shape[2]
    if width > s:
        raise ValueError(f"a block of {width} rows does not fit a cache of {s} rows")
    return _read_blocks(cache, jnp.clip(start.astype(jnp.int32), 0, s - width), 2, width)


def _layers_blocks(cache: jax.Array, block_start: jax.Array, t: int) -> jax.Array:
    """[L, B, Hkv, T, Dh]: each batch row's T rows from block_start of every layer of a stacked cache
    [L, B, Hkv, S, Dh], one block per batch row (as `_read_blocks`)."""
    l, b, h, _, d = cache.shape
    if _per_row(b):
        return jnp.concatenate([jax.lax.dynamic_slice(cache, (0, i, 0, block_start[i], 0), (l, 1, h, t, d))
                                for i in range(b)], axis=1)
    corners = jnp.stack([jnp.arange(b, dtype=jnp.int32), block_start], axis=1)
    return jax.lax.gather(cache, corners, jax.lax.GatherDimensionNumbers(
        offset_dims=(0, 2, 3, 4), collapsed_slice_dims=(1,), start_index_map=(1, 3)), (l, 1, h, t, d),
        indices_are_sorted=True, mode=_IN_BOUNDS)


def _write_layers_blocks(cache: jax.Array, blocks: jax.Array, block_start: jax.Array) -> jax.Array:
    """cache with blocks [L, B, Hkv, T, Dh] written at block_start (the inverse of `_layers_blocks`)."""
    b = cache.shape[1]
    if _per_row(b):
        for i in range(b):
            cache = jax.lax.dynamic_update_slice(cache, blocks[:, i:i + 1], (0, i, 0, block_start[i], 0))
        return cache
    corners = jnp.stack([jnp.arange(b, dtype=jnp.int32), block_start], axis=1)
    return jax.lax.scatter(cache, corners, blocks, jax.lax.ScatterDimensionNumbers(
        update_window_dims=(0, 2, 3, 4), inserted_window_dims=(1,), scatter_dims_to_operand_dims=(1, 3)),
        indices_are_sorted=True, unique_indices=True, mode=_IN_BOUNDS)


def move_rows_all_layers(cache: jax.Array, dst: jax.Array, src: jax.Array, start: jax.Array, span: int) -> jax.Array:
    """A stacked cache [L, B, Hkv, S, Dh] with rows src [B, N] copied to rows dst [B, N] in every layer
    (tree path compaction, `jspec.models.target.compact_rows`): every src lies in the span rows
    start[b] .. start[b] + span - 1 and dst is consecutive per row. Each batch row reads its span of
    every layer as one block, picks the path and writes it back as one block (`write_block`'s rules:
    rows past the cache are dropped), so a scanned layer loop's cache needs no loop over its layers."""
    s, n = cache.shape[3], dst.shape[1]
    if span > s:
        raise ValueError(f"a block of {span} rows does not fit a cache of {s} rows")
    first = jnp.clip(start.astype(jnp.int32), 0, s - span)
    begin = dst[:, 0].astype(jnp.int32)
    block_start = jnp.clip(begin, 0, s - n)
    offset = block_start[:, None] + jnp.arange(n) - begin[:, None]  # [B, N]: path row of each block row
    valid = (offset >= 0) & (offset < n)
    rows = jnp.take_along_axis(src, jnp.clip(offset, 0, n - 1), axis=1) - first[:, None]  # [B, N] in the span
    # The rows are picked by a one-hot product (exact: one term per output), not a gather along the rows:
    # XLA:TPU would lay the whole stacked cache out rows-major for a gather and copy it both ways.
    pick = (rows[:, :, None] == jnp.arange(span)).astype(cache.dtype)  # [B, N, span]
    fresh = jnp.einsum("bnr,lbhrd->lbhnd", pick, _layers_blocks(cache, first, span),
                       preferred_element_type=jnp.float32).astype(cache.dtype)
    block = jnp.where(valid[None, :, None, :, None], fresh, _layers_blocks(cache, block_start, n))
    return _write_layers_blocks(cache, block, block_start)


def visible_rows(ctx_len: jax.Array, cache_rows: jax.Array) -> jax.Array:
    """Scalar int32: one past the highest cache row any query of the batch may read."""
    return jnp.maximum(jnp.max(ctx_len), jnp.max(cache_rows) + 1).astype(jnp.int32)


def num_chunks(ctx_len: jax.Array, cache_rows: jax.Array, size: int, kv_chunk: int) -> jax.Array:
    """Chunks of `kv_chunk` rows that `attend` visits for a cache of `size` rows (a traced count)."""
    return jnp.clip(-(-visible_rows(ctx_len, cache_rows) // kv_chunk), 1, -(-size // kv_chunk))


def empty_softmax_stats(shape: tuple[int, ...], dh: int):
    """(running max, running sum, weighted values) of an online softmax over no key yet: shape [..., T]."""
    return (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (dh,), jnp.float32))


def online_softmax_step(carry, scores: jax.Array, vals: jax.Array, pv_spec: str):
    """Fold one chunk into the online-softmax stats: scores [..., T, C] (f32, -inf where unseen), vals
    the chunk's value rows, combined by the einsum `pv_spec` (probabilities, values -> [..., T, Dh])."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # all -inf so far: nothing to rescale
    p = jnp.exp(scores - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    pv = jnp.einsum(pv_spec, p.astype(vals.dtype), vals, preferred_element_type=jnp.float32)
    return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv


def _chunk_mask(rows, positions, cache_rows, ctx_len, new_vis, window):
    """mask [B, T, C] (query sees row) and key_valid [B, C] (some query may see row) for rows [C]."""
    committed = rows[None, :] < ctx_len[:, None]  # [B, C]
    onehot = cache_rows[:, :, None] == rows[None, None, :]  # [B, T(k), C]
    sees_new = jnp.einsum("bik,bkc->bic", new_vis.astype(jnp.int32), onehot.astype(jnp.int32)) > 0
    mask = committed[:, None, :] | sees_new
    if not (isinstance(window, int) and window == 0):
        key_pos = jnp.where(jnp.any(onehot, axis=1),
                            jnp.einsum("bkc,bk->bc", onehot.astype(jnp.int32), positions), rows[None, :])
        in_window = key_pos[:, None, :] > positions[:, :, None] - window
        mask = mask & ((window == 0) | in_window)
    return mask, committed | jnp.any(onehot, axis=1)


def attend(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array, cache_rows: jax.Array,
           ctx_len: jax.Array, tree_mask: jax.Array | None = None, window=0,
           kv_chunk: int | str | None = KV_CHUNK, layer: jax.Array | None = None) -> jax.Array:
    """Attention output [B, T, Hq, Dh] (q's dtype) of q [B, T, Hq, Dh] over k/v_cache [B, Hkv, S, Dh].

    The pass's own K/V must already be written at cache_rows [B, T]. positions [B, T]; ctx_len [B];
    tree_mask [B, T, T] (query i may see new token k) or None for causal order by position; window: 0
    (full attention) or the sliding window, a Python int or a traced scalar.
    kv_chunk: rows per step (KV_CHUNK: the compile backend's, `step_rows`); None attends over all S rows
    in one block (static shapes, differentiable: training passes whose every row is valid). A query that
    sees no row (padding) gets zeros. layer: the caches are stacked [L, B, Hkv, S, Dh] and layer `layer`
    (a traced index: a scanned layer loop) is read, chunk by chunk, in place.
    """
    b, t, hq, dh = q.shape
    lead = _lead(layer)
    hkv, s = k_cache.shape[len(lead) + 1], k_cache.shape[len(lead) + 2]
    bounds = static_steps(kv_chunk, s, queries=t)
    kv_chunk = step_rows(kv_chunk, s, queries=t)
    qg = q.reshape(b, t, hkv, hq // hkv, dh)
    new_vis = positions[:, None, :] <= positions[:, :, None] if tree_mask is None else tree_mask
    scale = dh**-0.5

    def block(start, size, first_new_row):
        """Masked scores [B, Hkv, G, T, C] (f32), value rows [B, Hkv, C, Dh] of rows start..+size, and
        whether each query [B, T] sees any of them."""
        rows = start + jnp.arange(size)
        mask, valid = _chunk_mask(rows, positions, cache_rows, ctx_len, new_vis, window)
        if first_new_row is not None:  # a clamped last chunk overlaps rows already attended to
            fresh = rows >= first_new_row
            mask, valid = mask & fresh[None, None, :], valid & fresh[None, :]
        if lead:  # the chunk of one layer of a stacked cache
            keys, vals = (jax.lax.dynamic_slice(c, lead + (0, 0, start, 0), (1, b, hkv, size, dh))[0]
                          for c in (k_cache, v_cache))
        elif isinstance(start, int):  # a static slice (see STATIC_STEP_BACKENDS)
            keys, vals = (jax.lax.slice_in_dim(c, start, start + size, axis=2) for c in (k_cache, v_cache))
        else:
            keys, vals = (jax.lax.dynamic_slice_in_dim(c, start, size, axis=2) for c in (k_cache, v_cache))
        # Scores leave the matmul in the compute dtype (f32 accumulation inside it) and are scaled in
        # float32 by their consumers: a bf16 model writes and reads them at half the bytes.
        scores = jnp.einsum("btkgd,bkcd->bkgtc", qg, keys.astype(q.dtype), preferred_element_type=q.dtype)
        scores = jnp.where(mask[:, None, None], scores.astype(jnp.float32) * scale, -jnp.inf)
        vals = jnp.where(valid[:, None, :, None], vals, 0).astype(q.dtype)
        return scores, vals, jnp.any(mask, axis=-1)

    if kv_chunk is None or s <= kv_chunk:  # one block: normalise before the value matmul, as softmax does
        scores, vals, seen = block(0, s, None)
        probs = jnp.where(seen[:, None, None, :, None], jax.nn.softmax(scores, axis=-1), 0.0)  # sees nothing: 0
        out = jnp.einsum("bkgtc,bkcd->bkgtd", probs.astype(vals.dtype), vals)
        return jnp.moveaxis(out, 3, 1).reshape(b, t, hq, dh).astype(q.dtype)

    def step(i, carry):
        scores, vals, _ = block(jnp.minimum(i * kv_chunk, s - kv_chunk), kv_chunk, i * kv_chunk)
        return online_softmax_step(carry, scores, vals, "bkgtc,bkcd->bkgtd")

    def static_step(start, size, carry):
        scores, vals, _ = block(start, size, None)
        return online_softmax_step(carry, scores, vals, "bkgtc,bkcd->bkgtd")

    stats = empty_softmax_stats((b, hkv, hq // hkv, t), dh)
    if bounds is not None:
        visible = visible_rows(ctx_len, cache_rows)
        stats = static_step(*bounds[0], stats)
        for start, size in bounds[1:]:  # a step past every row's visible context is skipped
            stats = jax.lax.cond(start < visible, functools.partial(static_step, start, size), lambda c: c, stats)
        m, l, acc = stats
    else:
        m, l, acc = jax.lax.fori_loop(0, num_chunks(ctx_len, cache_rows, s, kv_chunk), step, stats)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)  # [B, Hkv, G, T, Dh]
    return jnp.moveaxis(out, 3, 1).reshape(b, t, hq, dh).astype(q.dtype)
