"""Fused DFlash draft layer by Pallas kernels, beside its pure-jnp reference `ref_draft_layer`.

TPU (Mosaic), a chain of two kernels per layer, intermediates kept on chip. bf16 operands feed the MXU
at default precision with float32 accumulation (`preferred_element_type`); tile sizes per generation
come from `jspec.kernels._backend.TPU_TILES` (bytes per tile stated there). Both backends read every
weight as stored, [out, in]: a block or tile of a matrix is a range of its output rows (for wo and
w_down in the TPU kernels, of its input columns), and each product contracts the in-dimension, the
last of both operands (`_tiles.mm_nt`), so no weight is transposed in memory (Mosaic latches such a
tile into the MXU in its transposed mode: as many weight loads as an [in, out] tile, no transpose op).
Kernel 1 (attention half), grid (query block, KV-head group, context tile); the group's weight rows
(wq / wk / wv [group heads x Dh, D]) and wo columns ([D, group heads x Dh]) are one block per group,
fetched once per group while the context streams tile by tile (at Qwen3-8B shape, bf16, one KV head
per step: 4 + 1 + 1 + 4 MiB = 10 MiB of weights per step, 20 MiB double-buffered, plus 2 x 2 x 512
KiB of K/V tiles):
    input RMSNorm -> q / k / v projections of the block -> q_norm / k_norm -> RoPE -> attention of
    the block over [context K/V rows < anchor (sliding layers: the per-slot window) ; block K/V
    (bidirectional)] by online softmax, the context streamed tile by tile -> o_proj -> residual add.
    Block Q/K/V, scores and the running softmax never leave VMEM; the o_proj partial sums of the
    head groups accumulate in VMEM and the residual is written once.
Kernel 2 (MLP half), grid (row tile, F tile), the intermediate dimension F streamed in tiles of
    block_f (gate / up rows [block_f, D], down columns [D, block_f]: 12 MiB per step at 512, bf16):
    post-attention RMSNorm -> SwiGLU (gate / up tile) -> down-projection accumulated in VMEM -> residual.

GPU (Triton lowering of `pallas_call`, impl "portable"), a chain of five kernels with every block a
power of two and within shared memory (`jspec.kernels._backend.gpu_tiles`):
    projection, grid (query block, KV head, group + 2): one program per q / k / v head, the input RMSNorm
        folded into its K loop over D (q_norm / k_norm and RoPE on the [Wp, Dh] result);
    attention, grid (query block, q head): block keys, then the context in tiles of kv_rows rows;
    o_proj + residual, grid (row tile, D / cols), K loop over Hq*Dh;
    gate / up, grid (row tile, F / cols), the post-attention RMSNorm in the K loop over D, SwiGLU out;
    down + residual, grid (row tile, D / cols), K loop over F.
The [rows, F] activations and q / k / v / attention outputs are the only intermediates in memory
(about 1 MiB at block 16, against the layer's 380 MiB of bf16 weights).

`ref_draft_layer` is the specification: exactly one layer of `jspec.drafters.dflash.draft_blocks`.
Shapes: h [B, A, W, D] (A blocks of W slots per row; block a sits at positions anchor_pos[b, a] + i),
one layer's parameters lp (matrices stored [out, in], as `layers.linear` applies them:
wq [Hq*Dh, D], wk / wv [Hkv*Dh, D], wo [D, Hq*Dh], w_gate / w_up [F, D], w_down [D, F]; q_norm / k_norm
[Dh], attn_norm / mlp_norm [D]), the layer's context cache ctx_k / ctx_v [B, S, Hkv * Dh] (row =
position, heads flattened), anchor_pos [B, A], window: int32 scalar (0 = full).
Context row j is visible to slot i of a block anchored at p iff j < p and (window == 0 or
j > p + i - window); rows >= p are never read into the result. Inside the block (`block_visible`) slot
j is visible to slot i iff (not causal or j <= i) and, with a window, i - j < window (and, unless
causal, j - i < window): the window acts on absolute positions, so for window < W block slots that
far apart do not see each other. `causal` is a static per-layer flag. `draft_layer` runs the
kernels under a `custom_vjp` whose backward pass is the reference's, so it also works under
`jax.grad` (training normally uses the reference).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jspec.kernels import _tiles
from jspec.kernels._backend import (GpuTiles, TpuTiles, gpu_tiles, kv_heads_per_step, largest_divisor_tile,
                                    pallas_setup, pow2_at_most, pow2_divisor, query_rows, require_pow2, round_up,
                                    tpu_tiles, vmem_limit)
from jspec.models.attention import empty_softmax_stats, online_softmax_step, static_steps, step_rows
from jspec.models.config import ModelConfig, default_rope_inv_freq
from jspec.models.layers import linear, rms_norm, rope, rope_angles, swiglu

_MIB = 1 << 20


def block_visible(q_slot, k_slot, window, causal: bool):
    """Is block slot k_slot visible to slot q_slot (both at positions anchor + slot)? window: int32
    (0 = full); causal: static. Every slot sees itself."""
    near = (window == 0) | (q_slot - k_slot < window)
    if causal:
        return near & (k_slot <= q_slot)
    return near & ((window == 0) | (k_slot - q_slot < window))


def ref_draft_layer(h, lp, ctx_k, ctx_v, anchor_pos, window, cfg: ModelConfig, kv_chunk: int | str | None = None,
                    causal: bool = False) -> jax.Array:
    """One DFlash draft layer in pure jnp, as `dflash.draft_blocks` computes it: [B, A, W, D].

    kv_chunk: None attends over every context row in one block (static shapes, differentiable:
    training); an int reads the context in chunks of that many rows, only up to the furthest anchor
    of the batch (a dynamic trip count, an online softmax in float32): inference, whose cost then
    follows the committed context instead of the cache's size."""
    eps = cfg.rms_norm_eps
    h = h + ref_block_attention(rms_norm(h, lp["attn_norm"], eps), lp, ctx_k, ctx_v, anchor_pos, window, cfg,
                                kv_chunk, causal)
    return h + swiglu(rms_norm(h, lp["mlp_norm"], eps), lp["w_gate"], lp["w_up"], lp["w_down"])


def ref_block_attention(x, lp, ctx_k, ctx_v, anchor_pos, window, cfg: ModelConfig,
                        kv_chunk: int | str | None = None, causal: bool = False) -> jax.Array:
    """The attention sublayer of a draft layer, o_proj included, residual not: [B, A, W, D] from the
    normed block inputs x [B, A, W, D] (queries and block keys / values; the context K / V come from
    ctx_k / ctx_v). Arguments as `ref_draft_layer`."""
    b, a, w, _ = x.shape
    bounds = static_steps(kv_chunk, ctx_k.shape[1], queries=a * w)
    kv_chunk = step_rows(kv_chunk, ctx_k.shape[1], queries=a * w)
    x = x.reshape(b, a * w, -1)
    positions = (anchor_pos[:, :, None] + jnp.arange(w)[None, None]).reshape(b, a * w)
    inv_freq = jnp.asarray(default_rope_inv_freq(cfg))
    anchors = jnp.repeat(anchor_pos, w, axis=1)  # [B, T]: the anchor of each slot's block
    group, slot = jnp.repeat(jnp.arange(a), w), jnp.tile(jnp.arange(w), a)
    in_block = (group[:, None] == group[None, :]) & block_visible(slot[:, None], slot[None, :], window, causal)
    same_block = jnp.broadcast_to(in_block, (b, a * w, a * w))
    hq, hkv, dh, eps, t = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, a * w
    s = ctx_k.shape[1]

    q = linear(x, lp["wq"]).reshape(b, t, hq, dh)
    kb = linear(x, lp["wk"]).reshape(b, t, hkv, dh)
    vb = linear(x, lp["wv"]).reshape(b, t, hkv, dh)
    q = rope(rms_norm(q, lp["q_norm"], eps), positions, inv_freq)
    kb = rope(rms_norm(kb, lp["k_norm"], eps), positions, inv_freq)
    qg = q.reshape(b, t, hkv, hq // hkv, dh)
    scale = dh**-0.5

    def context(start, size):
        """Masked scores [B, Hkv, G, T, C] and zeroed-where-unseen values [B, C, Hkv, Dh] of rows start..
        (a static slice for a Python int start: see `attention.STATIC_STEP_BACKENDS`). Chunked, keys need
        no zeroing: an unseen row's score, NaN or not, is replaced by -inf; in one block (training) they
        are zeroed, so that no gradient multiplies a NaN key by a zero cotangent."""
        rows = start + jnp.arange(size)
        mask = (rows[None, None, :] < anchors[:, :, None]) & (
            (window == 0) | (rows[None, None, :] >= positions[:, :, None] - (window - 1)))
        seen = jnp.any(mask, axis=1)  # [B, C]
        if isinstance(start, int):
            rows_of = lambda c: jax.lax.slice_in_dim(c, start, start + size, axis=1).reshape(b, size, hkv, dh)
        else:
            rows_of = lambda c: jax.lax.dynamic_slice_in_dim(c, start, size, axis=1).reshape(b, size, hkv, dh)
        vals = jnp.where(seen[:, :, None, None], rows_of(ctx_v), 0)
        keys = rows_of(ctx_k) if kv_chunk is not None else jnp.where(seen[:, :, None, None], rows_of(ctx_k), 0)
        # Scores in the compute dtype out of the matmul, scaled in float32 (as `attention.attend`).
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, preferred_element_type=q.dtype)
        return jnp.where(mask[:, None, None], scores.astype(jnp.float32) * scale, -jnp.inf), vals

    block_scores = jnp.einsum("btkgd,bskd->bkgts", qg, kb, preferred_element_type=jnp.float32) * scale
    block_scores = jnp.where(same_block[:, None, None], block_scores, -jnp.inf)
    if kv_chunk is None or s <= kv_chunk:
        ctx_scores, vals = context(0, s)
        probs = jax.nn.softmax(jnp.concatenate([ctx_scores, block_scores], axis=-1), axis=-1)
        values = jnp.concatenate([vals, vb], axis=1)
        attn = jnp.einsum("bkgts,bskd->btkgd", probs.astype(values.dtype), values).reshape(b, t, hq * dh)
    else:
        # Online softmax: start from the block's own keys (every slot sees itself), add context chunks.
        pv_spec = "bkgts,bskd->bkgtd"
        stats = online_softmax_step(empty_softmax_stats(block_scores.shape[:-1], dh), block_scores, vb, pv_spec)

        def step(i, carry):
            start = jnp.minimum(i * kv_chunk, s - kv_chunk)
            scores, vals = context(start, kv_chunk)
            scores = jnp.where(start + jnp.arange(kv_chunk) >= i * kv_chunk, scores, -jnp.inf)  # clamped overlap
            return online_softmax_step(carry, scores, vals, pv_spec)

        def static_step(start, size, carry):
            return online_softmax_step(carry, *context(start, size), pv_spec)

        if bounds is not None:  # unrolled; a step after the first that is past every anchor is skipped
            stats = static_step(*bounds[0], stats)
            for start, size in bounds[1:]:
                stats = jax.lax.cond(start < jnp.max(anchor_pos), functools.partial(static_step, start, size),
                                     lambda c: c, stats)
            _, l, acc = stats
        else:
            chunks = jnp.clip(-(-jnp.max(anchor_pos) // kv_chunk), 0, -(-s // kv_chunk))
            _, l, acc = jax.lax.fori_loop(0, chunks, step, stats)
        attn = jnp.moveaxis(acc / l[..., None], 3, 1).astype(q.dtype).reshape(b, t, hq * dh)
    return linear(attn, lp["wo"]).reshape(b, a, w, -1)


@dataclasses.dataclass(frozen=True)
class _Options:
    cfg: ModelConfig
    impl: str
    interpret: Any
    block_k: int | None
    kv_heads: int | None
    block_f: int | None
    block_rows: int
    causal: bool


def draft_layer(h, lp, ctx_k, ctx_v, anchor_pos, window, cfg: ModelConfig, *, causal: bool = False,
                impl: str | None = None, interpret: Any = None, block_k: int | None = None,
                kv_heads: int | None = None, block_f: int | None = None, block_rows: int = 256) -> jax.Array:
    """One draft layer by the fused kernels; same contract and result as `ref_draft_layer`.

    impl / interpret: see `jspec.kernels.pallas_setup`. block_k: context rows per tile (TPU: a multiple
    of 8, default the generation's `ctx_rows`; GPU: rounded down to a power of two, default 64 rows for
    bf16, 32 for float32; S need not be a multiple). kv_heads: KV heads per grid step on TPU (default:
    the fewest whose lanes are a multiple of 128). block_f: MLP intermediate units per step on TPU
    (rows of w_gate / w_up, columns of w_down; must divide F; default the largest multiple of 128
    dividing F whose gate + up + down tiles fit the generation's `mlp_step_bytes`). block_rows: MLP
    rows per program on TPU."""
    impl, interpret = pallas_setup(impl, interpret)
    opts = _Options(cfg, impl, interpret, block_k, kv_heads, block_f, block_rows, causal)
    return _fused(opts, h, lp, ctx_k, ctx_v, jnp.asarray(anchor_pos, jnp.int32), jnp.asarray(window, jnp.int32))


def draft_stack(params: dict, cfg: ModelConfig, h: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array,
                anchor_pos: jax.Array, causal: tuple[bool, ...] = (), **options) -> jax.Array:
    """`dflash.draft_blocks` with every layer fused: final-normed hidden states [B, A, W, D].

    params: the drafter's parameters (per-layer `layers`, `norm`); cfg: its layer stack's config;
    h [B, A, W, D]: the block inputs (embedded); ctx_k / ctx_v per layer [B, S, Hkv * Dh]; causal: per
    layer (() = none); options: as `draft_layer`."""
    for i, lp in enumerate(params["layers"]):
        h = draft_layer(h, lp, ctx_k[i], ctx_v[i], anchor_pos, jnp.int32(cfg.windows[i]), cfg,
                        causal=bool(causal and causal[i]), **options)
    return rms_norm(h, params["norm"], cfg.rms_norm_eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(opts: _Options, h, lp, ctx_k, ctx_v, anchor_pos, window):
    return _forward(opts, h, lp, ctx_k, ctx_v, anchor_pos, window)


def _fused_fwd(opts, h, lp, ctx_k, ctx_v, anchor_pos, window):
    return _forward(opts, h, lp, ctx_k, ctx_v, anchor_pos, window), (h, lp, ctx_k, ctx_v, anchor_pos, window)


def _fused_bwd(opts, res, grad):
    h, lp, ctx_k, ctx_v, anchor_pos, window = res
    # Recompute through the reference: kernels have no transpose rule, and training is not the hot path.
    _, vjp = jax.vjp(lambda *x: ref_draft_layer(*x, anchor_pos, window, opts.cfg, causal=opts.causal),
                     h, lp, ctx_k, ctx_v)
    return (*vjp(grad), None, None)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _forward(opts: _Options, h, lp, ctx_k, ctx_v, anchor_pos, window):
    cfg = opts.cfg
    b, a, w, d = h.shape
    s, hkv, dh = ctx_k.shape[1], cfg.num_kv_heads, cfg.head_dim
    f = lp["w_gate"].shape[0]
    if opts.impl == "portable" and not opts.interpret:
        require_pow2(head_dim=dh)
        if min(pow2_divisor(n, 16) for n in (d, f, cfg.num_heads * dh)) < 16:
            raise ValueError(f"the GPU (Triton-lowered) kernels need the hidden size ({d}), MLP width ({f}) "
                             "and Hq * Dh to be multiples of 16: use kernels='reference' for this model")
    wp = query_rows(w, opts.impl)  # padded slots are no block's keys and are dropped
    dt = jnp.result_type(h.dtype, *(lp[k].dtype for k in ("attn_norm", "wq", "wk", "wv", "q_norm", "k_norm")))
    anchor = anchor_pos.reshape(b * a)
    positions = anchor[:, None] + jnp.arange(wp)[None]
    emb = rope_angles(positions, jnp.asarray(default_rope_inv_freq(cfg)))  # [B*A, Wp, Dh], as `layers.rope`
    lo = jnp.where(window > 0, jnp.maximum(anchor - window + 1, 0), 0).astype(jnp.int32)
    scalars = (lo, anchor, window.reshape(1))
    row = lambda v: v.reshape(1, -1)
    tensors = (
        jnp.pad(h, [(0, 0), (0, 0), (0, wp - w), (0, 0)]).reshape(b * a, wp, d),
        jnp.cos(emb).astype(dt), jnp.sin(emb).astype(dt),
        row(lp["attn_norm"]), row(lp["q_norm"]), row(lp["k_norm"]), jnp.asarray(_tiles.rotation(dh, dt)),
        lp["wq"], lp["wk"], lp["wv"], lp["wo"],
        ctx_k, ctx_v,
    )
    common = dict(cfg=cfg, a=a, w=w, dt=dt, causal=opts.causal)
    mlp = (row(lp["mlp_norm"]), lp["w_gate"], lp["w_up"], lp["w_down"])
    if opts.impl == "tpu":
        tiles = tpu_tiles()
        hk = opts.kv_heads or kv_heads_per_step(hkv, dh)
        bk = min(round_up(opts.block_k or tiles.ctx_rows, 8), round_up(s, 8))
        h_attn = _attn_tpu_call(scalars, tensors, hk=hk, block_k=bk, interpret=opts.interpret, tiles=tiles,
                                **common)
        wg = lp["w_gate"]
        block_f = opts.block_f or mlp_f_tile(d, f, wg.dtype.itemsize, tiles.mlp_step_bytes)
        if f % block_f:
            raise ValueError(f"block_f {block_f} must divide the MLP width {f}")
        rows = h_attn.reshape(b * a * wp, d)
        block_rows = min(round_up(opts.block_rows, 8), rows.shape[0])
        out = _mlp_tpu_call((rows, *mlp), eps=cfg.rms_norm_eps, block_f=block_f, block_rows=block_rows,
                            interpret=opts.interpret, tiles=tiles)
    else:
        gt = gpu_tiles(jnp.dtype(dt).itemsize)
        bk = pow2_at_most(min(opts.block_k or gt.kv_rows, s))
        out = _layer_gpu(scalars, tensors, mlp, block_k=bk, gt=gt, interpret=opts.interpret, **common)
    return out.reshape(b, a, wp, d)[:, :, :w]


def mlp_f_tile(d: int, f: int, itemsize: int, step_bytes: int) -> int:
    """MLP intermediate units per TPU grid step (rows of w_gate / w_up, columns of w_down): the largest
    multiple of 128 dividing f whose gate, up and down tiles (3 x d x block_f x itemsize bytes) fit
    step_bytes; f itself when no multiple of 128 divides it (w_down's tile has block_f lanes)."""
    cap = max(128, step_bytes // (3 * d * itemsize))
    return largest_divisor_tile(f, cap, 128)


def _project(x, wq_ref, wk_ref, wv_ref, qn, kn, cos, sin, rot, c: int, group: int, dh: int, eps: float, dt):
    """Block K, V [Wp, Dh] of KV head c and the queries [Wp, Dh] of its group's heads (a list); each head
    is a [Dh, D] row range of the step's weight blocks."""
    rows = slice(c * dh, (c + 1) * dh)
    k = _tiles.rope(rms_norm(_tiles.mm_nt(x, wk_ref[rows, :]).astype(dt), kn, eps), cos, sin, rot)
    v = _tiles.mm_nt(x, wv_ref[rows, :]).astype(dt)
    qs = []
    for g in range(group):
        head = slice((c * group + g) * dh, (c * group + g + 1) * dh)
        qs.append(_tiles.rope(rms_norm(_tiles.mm_nt(x, wq_ref[head, :]).astype(dt), qn, eps), cos, sin, rot))
    return qs, k, v


def _context_mask(rows, hi, window, wp: int, group: int = 1):
    """[group * Wp, N] visibility of context rows [1, N] to the slots of a block anchored at hi, the
    slots repeated for `group` heads stacked along the rows."""
    slot = lax.broadcasted_iota(jnp.int32, (wp, 1), 0)
    if group > 1:
        slot = jnp.concatenate([slot] * group, axis=0)
    return (rows < hi) & ((window == 0) | (rows > hi + slot - window))


def _block_mask(w: int, wp: int, window, causal: bool, group: int = 1):
    """[group * Wp, Wp] visibility of the block's keys to its slots (stacked for `group` heads): padded
    slots (>= w) are nobody's keys; the rest as `block_visible`."""
    q_slot = lax.broadcasted_iota(jnp.int32, (wp, 1), 0)
    if group > 1:
        q_slot = jnp.concatenate([q_slot] * group, axis=0)
    k_slot = lax.broadcasted_iota(jnp.int32, (1, wp), 1)
    return (k_slot < w) & block_visible(q_slot, k_slot, window, causal)


def _attn_tpu_kernel(lo_ref, hi_ref, win_ref, h_ref, cos_ref, sin_ref, an_ref, qn_ref, kn_ref, rot_ref,
                     wq_ref, wk_ref, wv_ref, wo_ref, kc_ref, vc_ref, out_ref, x_s, q_s, m_s, l_s, acc_s, o_s, *,
                     hk, group, dh, wp, w, eps, block_k, num_tiles, num_groups, scale, dt, causal):
    ba, g, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi, window = lo_ref[ba], hi_ref[ba], win_ref[0]
    first, last = _tiles.context_tiles(lo, hi, block_k, num_tiles)
    rows_stat = group * wp
    store, load = _tiles.stats_in_scratch(m_s, l_s, acc_s, rows_stat)

    @pl.when((g == 0) & (j == 0))
    def _norm():
        x_s[...] = rms_norm(h_ref[...], an_ref[...], eps)
        o_s[...] = jnp.zeros_like(o_s)

    @pl.when(j == 0)
    def _block():
        x, rot = x_s[...], rot_ref[...]
        keys = _block_mask(w, wp, window, causal, group)
        for c in range(hk):
            qs, k, v = _project(x, wq_ref, wk_ref, wv_ref, qn_ref[...], kn_ref[...], cos_ref[...], sin_ref[...], rot,
                                c, group, dh, eps, dt)
            q = jnp.concatenate(qs, axis=0)  # the group's heads stacked: one matmul per KV head
            q_s[c] = q
            store(c, _tiles.attend(_tiles.init_stats(rows_stat, dh), q, k, v, keys, scale))

    @pl.when((j >= first) & (j <= last) & (lo < hi))
    def _context():
        rows = j * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        vis = _context_mask(rows, hi, window, wp, group)
        rows_c = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        readable = (rows_c >= lo) & (rows_c < hi)  # zero the rest: 0 * NaN would poison the sum
        for c in range(hk):
            cols = slice(c * dh, (c + 1) * dh)
            v = jnp.where(readable, vc_ref[:, cols], 0).astype(dt)
            store(c, _tiles.attend(load(c), q_s[c], kc_ref[:, cols].astype(dt), v, vis, scale))

    @pl.when(j == num_tiles - 1)
    def _out_proj():
        for c in range(hk):
            _, l, acc = load(c)
            o = _tiles.finish(l, acc).astype(dt)
            for gi in range(group):
                head = c * group + gi
                o_s[...] += _tiles.mm_nt(o[gi * wp:(gi + 1) * wp], wo_ref[:, head * dh:(head + 1) * dh])

        @pl.when(g == num_groups - 1)
        def _residual():
            out_ref[...] = (h_ref[...] + o_s[...].astype(dt)).astype(out_ref.dtype)


def _attn_tpu_call(scalars, tensors, *, cfg: ModelConfig, a, w, dt, causal, hk, block_k, interpret,
                   tiles: TpuTiles):
    hp, cos, sin, an, qn, kn, rot, wq, wk, wv, wo, kc, vc = tensors
    ba, wp, d = hp.shape
    s = kc.shape[1]
    hkv, dh, group = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    num_tiles, num_groups = -(-s // block_k), hkv // hk

    def ctx_map(i, g, j, lo_ref, hi_ref, win_ref):
        first, last = _tiles.context_tiles(lo_ref[i], hi_ref[i], block_k, num_tiles)
        return i // a, jnp.clip(j, first, last), g

    block = lambda i, g, j, *_: (i, 0, 0)
    fixed = lambda i, g, j, *_: (0, 0)
    in_specs = [
        pl.BlockSpec((None, wp, d), block),
        pl.BlockSpec((None, wp, dh), block),
        pl.BlockSpec((None, wp, dh), block),
        pl.BlockSpec((1, d), fixed),
        pl.BlockSpec((1, dh), fixed),
        pl.BlockSpec((1, dh), fixed),
        pl.BlockSpec((dh, dh), fixed),
        pl.BlockSpec((hk * group * dh, d), lambda i, g, j, *_: (g, 0)),  # wq / wk / wv: the group's rows
        pl.BlockSpec((hk * dh, d), lambda i, g, j, *_: (g, 0)),
        pl.BlockSpec((hk * dh, d), lambda i, g, j, *_: (g, 0)),
        pl.BlockSpec((d, hk * group * dh), lambda i, g, j, *_: (0, g)),  # wo: the group's input columns
        pl.BlockSpec((None, block_k, hk * dh), ctx_map),
        pl.BlockSpec((None, block_k, hk * dh), ctx_map),
    ]
    x_dtype = jnp.result_type(hp.dtype, an.dtype)
    out_dtype = jnp.result_type(hp.dtype, dt)
    scratch = [
        pltpu.VMEM((wp, d), x_dtype),
        pltpu.VMEM((hk, group * wp, dh), dt),
        pltpu.VMEM((hk, group * wp, _tiles.STAT_LANES), jnp.float32),
        pltpu.VMEM((hk, group * wp, _tiles.STAT_LANES), jnp.float32),
        pltpu.VMEM((hk, group * wp, dh), jnp.float32),
        pltpu.VMEM((wp, d), jnp.float32),
    ]
    # Double-buffered blocks plus scratch. At Qwen3-8B shape, bf16, hk 1: h / out 2 x 128 KiB, weights
    # 1280 x 4096 x 2 B = 10 MiB, K + V tiles 2 x 512 KiB (2048 rows): 2 x 11.3 MiB + 0.6 MiB of scratch.
    blocks = [(2 * wp, d, hp.dtype), (hk * (2 * group + 2) * dh, d, wq.dtype), (2 * block_k, hk * dh, kc.dtype)]
    scratch_bytes = 4 * (hk * group * wp * (dh + 2 * _tiles.STAT_LANES) + 2 * wp * d)
    need = sum(2 * r * c * jnp.dtype(t).itemsize for r, c, t in blocks) + scratch_bytes
    kernel = functools.partial(_attn_tpu_kernel, hk=hk, group=group, dh=dh, wp=wp, w=w, eps=cfg.rms_norm_eps,
                               block_k=block_k, num_tiles=num_tiles, num_groups=num_groups, scale=dh**-0.5, dt=dt,
                               causal=causal)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=3, grid=(ba, num_groups, num_tiles),
                                               in_specs=in_specs, out_specs=pl.BlockSpec((None, wp, d), block),
                                               scratch_shapes=scratch),
        out_shape=jax.ShapeDtypeStruct((ba, wp, d), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit(need, tiles)),
        interpret=interpret,
    )(*scalars, *tensors)


def _gpu_params(gt: GpuTiles) -> pltriton.CompilerParams:
    return pltriton.CompilerParams(num_warps=gt.warps, num_stages=gt.stages)


def _row_norm_scale(x_ref, chunk: int, eps: float):
    """rsqrt(mean(x^2) + eps) [R, 1] of the rows of x_ref [R, D], read in chunks of `chunk` columns."""
    d = x_ref.shape[1]

    def step(c, acc):
        x = x_ref[:, pl.ds(c * chunk, chunk)].astype(jnp.float32)
        return acc + jnp.sum(x * x, axis=1, keepdims=True)

    ss = lax.fori_loop(0, d // chunk, step, jnp.zeros((x_ref.shape[0], 1), jnp.float32))
    return lax.rsqrt(ss / d + eps)


def _normed_matmul(x_ref, n_ref, inv, w_refs, chunk: int):
    """[rms_norm(x) @ w.T for w in w_refs] (each w [N, D], stored [out, in]) in float32 [R, N], the norm
    (as `layers.rms_norm`: scale in float32, cast back, times the gain) applied chunk by chunk inside
    the K loop over D."""
    d = x_ref.shape[1]

    def step(c, accs):
        cols = pl.ds(c * chunk, chunk)
        x = x_ref[:, cols]
        x = n_ref[:, cols] * (x.astype(jnp.float32) * inv).astype(x.dtype)
        return tuple(acc + _tiles.mm_nt(x.astype(jnp.result_type(x.dtype, w.dtype)), w[:, cols])
                     for acc, w in zip(accs, w_refs))

    zeros = tuple(jnp.zeros((x_ref.shape[0], w.shape[0]), jnp.float32) for w in w_refs)
    return lax.fori_loop(0, d // chunk, step, zeros)


def _proj_gpu_kernel(h_ref, cos_ref, sin_ref, an_ref, qn_ref, kn_ref, rot_ref, wq_ref, wk_ref, wv_ref,
                     q_ref, k_ref, v_ref, *, group, eps, chunk, dt):
    """One head's projection of one query block: q heads j < group, then k (j == group), v."""
    j = pl.program_id(2)
    inv = _row_norm_scale(h_ref, chunk, eps)
    cos, sin, rot = cos_ref[...], sin_ref[...], rot_ref[...]

    @pl.when(j < group)
    def _q():
        (q,) = _normed_matmul(h_ref, an_ref, inv, (wq_ref,), chunk)
        q = _tiles.rope(rms_norm(q.astype(dt), qn_ref[...], eps), cos, sin, rot)
        q_ref[...] = q.astype(q_ref.dtype)

    @pl.when(j == group)
    def _k():
        (k,) = _normed_matmul(h_ref, an_ref, inv, (wk_ref,), chunk)
        k_ref[...] = _tiles.rope(rms_norm(k.astype(dt), kn_ref[...], eps), cos, sin, rot).astype(k_ref.dtype)

    @pl.when(j == group + 1)
    def _v():
        (v,) = _normed_matmul(h_ref, an_ref, inv, (wv_ref,), chunk)
        v_ref[...] = v.astype(v_ref.dtype)


def _attn_gpu_kernel(lo_ref, hi_ref, win_ref, q_ref, kb_ref, vb_ref, kc_ref, vc_ref, o_ref, *, w, block_k, scale, dt,
                     causal):
    """One q head of one query block: its block's keys (bidirectional), then the visible context."""
    i = pl.program_id(0)
    lo, hi, window = lo_ref[i], hi_ref[i], win_ref[0]
    s = kc_ref.shape[0]
    wp, dh = q_ref.shape
    first, last = _tiles.context_tiles(lo, hi, block_k, -(-s // block_k))
    q = q_ref[...]
    keys = _block_mask(w, wp, window, causal)
    state = _tiles.attend(_tiles.init_stats(wp, dh), q, kb_ref[...], vb_ref[...], keys, scale)

    def tile(t, state):
        # The last tile is shifted back to end at row S (no read past the cache); rows it shares with
        # the previous tile are masked so that no key is counted twice.
        start = jnp.minimum(t * block_k, s - block_k)
        rows = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        vis = (rows >= t * block_k) & _context_mask(rows, hi, window, wp)
        rows_c = start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        readable = (rows_c >= jnp.maximum(lo, t * block_k)) & (rows_c < hi)
        k = kc_ref[pl.ds(start, block_k), :].astype(dt)
        v = jnp.where(readable, vc_ref[pl.ds(start, block_k), :], 0).astype(dt)
        return _tiles.attend(state, q, k, v, vis, scale)

    _, l, acc = lax.fori_loop(first, jnp.where(lo < hi, last + 1, first), tile, state)
    o_ref[...] = _tiles.finish(l, acc).astype(o_ref.dtype)


def _matmul_residual_kernel(x_ref, w_ref, r_ref, out_ref, *, chunk):
    """out = r + (x @ w.T) for one [rows, cols] output tile (w [cols, K]), the K loop over x's columns."""

    def step(c, acc):
        cols = pl.ds(c * chunk, chunk)
        x = x_ref[:, cols]
        return acc + _tiles.mm_nt(x.astype(jnp.result_type(x.dtype, w_ref.dtype)), w_ref[:, cols])

    acc = lax.fori_loop(0, x_ref.shape[1] // chunk, step, jnp.zeros(out_ref.shape, jnp.float32))
    r = r_ref[...]
    out_ref[...] = (r + acc.astype(jnp.result_type(r.dtype, w_ref.dtype))).astype(out_ref.dtype)


def _matmul_residual(x, wmat, r, gt: GpuTiles, interpret):
    """r + x @ wmat.T for x [N, K], wmat [M, K] (stored [out, in]), r [N, M] (N a multiple of 16): grid
    (row tile, column tile)."""
    n, k = x.shape
    m = wmat.shape[0]
    br, bn, chunk = pow2_divisor(n, gt.rows), pow2_divisor(m, gt.cols), pow2_divisor(k, gt.k_chunk)
    return pl.pallas_call(
        functools.partial(_matmul_residual_kernel, chunk=chunk),
        grid=(n // br, m // bn),
        in_specs=[pl.BlockSpec((br, k), lambda r_, c: (r_, 0)), pl.BlockSpec((bn, k), lambda r_, c: (c, 0)),
                  pl.BlockSpec((br, bn), lambda r_, c: (r_, c))],
        out_specs=pl.BlockSpec((br, bn), lambda r_, c: (r_, c)),
        out_shape=jax.ShapeDtypeStruct((n, m), jnp.result_type(r.dtype, wmat.dtype)),
        compiler_params=_gpu_params(gt),
        interpret=interpret,
    )(x, wmat, r)


def _layer_gpu(scalars, tensors, mlp, *, cfg: ModelConfig, a, w, dt, causal, block_k, gt: GpuTiles, interpret):
    """The whole layer on GPU: projection, attention, o_proj + residual, gate / up, down + residual."""
    hp, cos, sin, an, qn, kn, rot, wq, wk, wv, wo, kc, vc = tensors
    ba, wp, d = hp.shape
    hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group, eps = hq // hkv, cfg.rms_norm_eps
    chunk = pow2_divisor(d, gt.k_chunk)
    params = _gpu_params(gt)
    x_dtype = jnp.result_type(hp.dtype, an.dtype)

    blk = lambda i, c, j: (i, 0, 0)
    fixed = lambda i, c, j: (0, 0)
    q_head = lambda i, c, j: (i, 0, c * group + jnp.minimum(j, group - 1))
    kv_head = lambda i, c, j: (i, 0, c)
    q, k, v = pl.pallas_call(
        functools.partial(_proj_gpu_kernel, group=group, eps=eps, chunk=chunk, dt=dt),
        grid=(ba, hkv, group + 2),
        in_specs=[pl.BlockSpec((None, wp, d), blk), pl.BlockSpec((None, wp, dh), blk),
                  pl.BlockSpec((None, wp, dh), blk), pl.BlockSpec((1, d), fixed), pl.BlockSpec((1, dh), fixed),
                  pl.BlockSpec((1, dh), fixed), pl.BlockSpec((dh, dh), fixed),
                  pl.BlockSpec((dh, d), lambda i, c, j: (c * group + jnp.minimum(j, group - 1), 0)),
                  pl.BlockSpec((dh, d), lambda i, c, j: (c, 0)), pl.BlockSpec((dh, d), lambda i, c, j: (c, 0))],
        out_specs=[pl.BlockSpec((None, wp, dh), q_head), pl.BlockSpec((None, wp, dh), kv_head),
                   pl.BlockSpec((None, wp, dh), kv_head)],
        out_shape=[jax.ShapeDtypeStruct((ba, wp, hq * dh), dt), jax.ShapeDtypeStruct((ba, wp, hkv * dh), dt),
                   jax.ShapeDtypeStruct((ba, wp, hkv * dh), dt)],
        compiler_params=params,
        interpret=interpret,
    )(hp, cos, sin, an, qn, kn, rot, wq, wk, wv)

    s = kc.shape[1]
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, h: (0,) * x.ndim)
    attn = pl.pallas_call(
        functools.partial(_attn_gpu_kernel, w=w, block_k=block_k, scale=dh**-0.5, dt=dt, causal=causal),
        grid=(ba, hq),
        in_specs=[*(whole(x) for x in scalars), pl.BlockSpec((None, wp, dh), lambda i, h: (i, 0, h)),
                  pl.BlockSpec((None, wp, dh), lambda i, h: (i, 0, h // group)),
                  pl.BlockSpec((None, wp, dh), lambda i, h: (i, 0, h // group)),
                  pl.BlockSpec((None, s, dh), lambda i, h: (i // a, 0, h // group)),
                  pl.BlockSpec((None, s, dh), lambda i, h: (i // a, 0, h // group))],
        out_specs=pl.BlockSpec((None, wp, dh), lambda i, h: (i, 0, h)),
        out_shape=jax.ShapeDtypeStruct((ba, wp, hq * dh), dt),
        compiler_params=params,
        interpret=interpret,
    )(*scalars, q, k, v, kc, vc)

    n = ba * wp
    h2 = hp.reshape(n, d)
    h_attn = _matmul_residual(attn.reshape(n, hq * dh), wo, h2.astype(jnp.result_type(hp.dtype, dt)), gt,
                              interpret)

    norm, wg, wu, wd = mlp
    f = wg.shape[0]
    br, bn = pow2_divisor(n, gt.rows), pow2_divisor(f, gt.cols)
    acts = pl.pallas_call(
        functools.partial(_gate_up_gpu_kernel, eps=eps, chunk=chunk),
        grid=(n // br, f // bn),
        in_specs=[pl.BlockSpec((br, d), lambda r, c: (r, 0)), pl.BlockSpec((1, d), lambda r, c: (0, 0)),
                  pl.BlockSpec((bn, d), lambda r, c: (c, 0)), pl.BlockSpec((bn, d), lambda r, c: (c, 0))],
        out_specs=pl.BlockSpec((br, bn), lambda r, c: (r, c)),
        out_shape=jax.ShapeDtypeStruct((n, f), jnp.result_type(h_attn.dtype, norm.dtype, wg.dtype)),
        compiler_params=params,
        interpret=interpret,
    )(h_attn, norm, wg, wu)
    out_dtype = jnp.result_type(h_attn.dtype, norm.dtype, wg.dtype, wd.dtype)
    return _matmul_residual(acts, wd, h_attn.astype(out_dtype), gt, interpret)


def _swiglu(x, wg, wu, wd):
    """SwiGLU of x [R, D] through one F tile (gate / up rows wg, wu [Ft, D], down columns wd [D, Ft]),
    down-projected and accumulated in float32: [R, D]."""
    dt = jnp.result_type(x.dtype, wg.dtype)
    gate, up = _tiles.mm_nt(x, wg).astype(dt), _tiles.mm_nt(x, wu).astype(dt)
    acts = jax.nn.silu(gate.astype(jnp.float32)).astype(dt) * up  # float32 math: GPU lowerings lack bf16 division
    return _tiles.mm_nt(acts.astype(jnp.result_type(acts.dtype, wd.dtype)), wd)


def _mlp_tpu_kernel(h_ref, n_ref, wg_ref, wu_ref, wd_ref, out_ref, x_s, acc_s, *, eps, num_f):
    f = pl.program_id(1)

    @pl.when(f == 0)
    def _norm():
        x_s[...] = rms_norm(h_ref[...], n_ref[...], eps)
        acc_s[...] = jnp.zeros_like(acc_s)

    acc_s[...] += _swiglu(x_s[...], wg_ref[...], wu_ref[...], wd_ref[...])

    @pl.when(f == num_f - 1)
    def _residual():
        h = h_ref[...]
        out_ref[...] = (h + acc_s[...].astype(jnp.result_type(h.dtype, wd_ref.dtype))).astype(out_ref.dtype)


def _mlp_tpu_call(args, *, eps, block_f, block_rows, interpret, tiles: TpuTiles):
    h, norm, wg, wu, wd = args
    n, d = h.shape
    f = wg.shape[0]
    grid = (-(-n // block_rows), f // block_f)
    rows = pl.BlockSpec((block_rows, d), lambda r, k: (r, 0))
    out_dtype = jnp.result_type(h.dtype, norm.dtype, wg.dtype, wd.dtype)
    # Double-buffered gate / up / down tiles and row blocks, plus the x / acc scratch. At Qwen3-8B shape,
    # bf16, block_f 512, 16 rows: 2 x (12 MiB + 256 KiB) + 384 KiB.
    need = 2 * (3 * d * block_f * wg.dtype.itemsize + 2 * block_rows * d * h.dtype.itemsize) + 8 * block_rows * d
    return pl.pallas_call(
        functools.partial(_mlp_tpu_kernel, eps=eps, num_f=grid[1]),
        grid=grid,
        in_specs=[rows, pl.BlockSpec((1, d), lambda r, k: (0, 0)), pl.BlockSpec((block_f, d), lambda r, k: (k, 0)),
                  pl.BlockSpec((block_f, d), lambda r, k: (k, 0)), pl.BlockSpec((d, block_f), lambda r, k: (0, k))],
        out_specs=rows,
        out_shape=jax.ShapeDtypeStruct((n, d), out_dtype),
        scratch_shapes=[pltpu.VMEM((block_rows, d), jnp.result_type(h.dtype, norm.dtype)),
                        pltpu.VMEM((block_rows, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit(need, tiles)),
        interpret=interpret,
    )(h, norm, wg, wu, wd)


def _gate_up_gpu_kernel(h_ref, n_ref, wg_ref, wu_ref, out_ref, *, eps, chunk):
    """SwiGLU activations of one [rows, cols] tile of F: silu(norm(h) @ wg) * (norm(h) @ wu)."""
    inv = _row_norm_scale(h_ref, chunk, eps)
    gate, up = _normed_matmul(h_ref, n_ref, inv, (wg_ref, wu_ref), chunk)
    dt = out_ref.dtype
    gate, up = gate.astype(dt), up.astype(dt)
    out_ref[...] = (jax.nn.silu(gate.astype(jnp.float32)).astype(dt) * up).astype(dt)  # as `_swiglu`

