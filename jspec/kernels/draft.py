"""Fused DFlash draft layer: a chain of two Pallas kernels per layer, intermediates kept on chip.

Kernel 1 (attention half), one program per block of W query rows and per KV-head group:
    input RMSNorm -> q / k / v projections of the block -> q_norm / k_norm -> RoPE -> attention of
    the block over [context K/V rows < anchor (sliding layers: the per-slot window) ; block K/V
    (bidirectional)] by online softmax, the context streamed tile by tile -> o_proj -> residual add.
    Block Q/K/V, scores and the running softmax never leave VMEM; the o_proj partial sums of the
    head groups accumulate in VMEM and the residual is written once.
Kernel 2 (MLP half), one program per row tile, the intermediate dimension F streamed in tiles:
    post-attention RMSNorm -> SwiGLU (gate / up tile) -> down-projection accumulated in VMEM -> residual.

`ref_draft_layer` is the specification: exactly one layer of `jspec.drafters.dflash.draft_blocks`.
Shapes: h [B, A, W, D] (A blocks of W slots per row; block a sits at positions anchor_pos[b, a] + i),
one layer's parameters lp (wq [D, Hq*Dh], wk / wv [D, Hkv*Dh], wo [Hq*Dh, D], q_norm / k_norm [Dh],
attn_norm / mlp_norm [D], w_gate / w_up [D, F], w_down [F, D]), the layer's context cache
ctx_k / ctx_v [B, S, Hkv, Dh] (row = position), anchor_pos [B, A], window: int32 scalar (0 = full).
Context row j is visible to slot i of a block anchored at p iff j < p and (window == 0 or
j > p + i - window); rows >= p are never read into the result. Block slots see each other without a
window. `draft_layer` runs the kernels under a `custom_vjp` whose backward pass is the reference's,
so it also works under `jax.grad` (training normally uses the reference).
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
from jspec.kernels._backend import kv_heads_per_step, pallas_setup, pow2_at_most, query_rows, require_pow2, round_up
from jspec.models import transformer
from jspec.models.config import ModelConfig, default_rope_inv_freq

_MIB = 1 << 20


def ref_draft_layer(h, lp, ctx_k, ctx_v, anchor_pos, window, cfg: ModelConfig) -> jax.Array:
    """One DFlash draft layer in pure jnp, as `dflash.draft_blocks` computes it: [B, A, W, D]."""
    b, a, w, _ = h.shape
    h = h.reshape(b, a * w, -1)
    positions = (anchor_pos[:, :, None] + jnp.arange(w)[None, None]).reshape(b, a * w)
    inv_freq = jnp.asarray(default_rope_inv_freq(cfg))
    rows = jnp.arange(ctx_k.shape[1])
    visible = rows[None, None, :] < jnp.repeat(anchor_pos, w, axis=1)[:, :, None]
    any_visible = rows[None, :] < jnp.max(anchor_pos, axis=1)[:, None]
    group = jnp.repeat(jnp.arange(a), w)
    same_block = jnp.broadcast_to(group[:, None] == group[None, :], (b, a * w, a * w))
    hq, hkv, dh, eps, t = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, a * w

    x = transformer.rms_norm(h, lp["attn_norm"], eps)
    q = (x @ lp["wq"]).reshape(b, t, hq, dh)
    kb = (x @ lp["wk"]).reshape(b, t, hkv, dh)
    vb = (x @ lp["wv"]).reshape(b, t, hkv, dh)
    q = transformer.rope(transformer.rms_norm(q, lp["q_norm"], eps), positions, inv_freq)
    kb = transformer.rope(transformer.rms_norm(kb, lp["k_norm"], eps), positions, inv_freq)
    in_window = rows[None, None, :] >= positions[:, :, None] - (window - 1)
    ctx_mask = visible & ((window == 0) | in_window)
    keys = jnp.concatenate([jnp.where(any_visible[:, :, None, None], ctx_k, 0), kb], axis=1)
    vals = jnp.concatenate([jnp.where(any_visible[:, :, None, None], ctx_v, 0), vb], axis=1)
    mask = jnp.concatenate([ctx_mask, same_block], axis=2)
    qg = q.reshape(b, t, hkv, hq // hkv, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, preferred_element_type=jnp.float32) * dh**-0.5
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -jnp.inf), axis=-1)
    attn = jnp.einsum("bkgts,bskd->btkgd", probs.astype(vals.dtype), vals).reshape(b, t, hq * dh)
    h = h + attn @ lp["wo"]
    x = transformer.rms_norm(h, lp["mlp_norm"], eps)
    h = h + (jax.nn.silu(x @ lp["w_gate"]) * (x @ lp["w_up"])) @ lp["w_down"]
    return h.reshape(b, a, w, -1)


@dataclasses.dataclass(frozen=True)
class _Options:
    cfg: ModelConfig
    impl: str
    interpret: Any
    block_k: int
    kv_heads: int | None
    block_f: int | None
    block_rows: int


def draft_layer(h, lp, ctx_k, ctx_v, anchor_pos, window, cfg: ModelConfig, *, impl: str | None = None,
                interpret: Any = None, block_k: int = 512, kv_heads: int | None = None, block_f: int | None = None,
                block_rows: int = 256) -> jax.Array:
    """One draft layer by the fused kernels; same contract and result as `ref_draft_layer`.

    impl / interpret: see `jspec.kernels.pallas_setup`. block_k: context rows per tile (multiple of 8;
    S need not be a multiple). kv_heads: KV heads per grid step on TPU (default: the fewest whose
    lanes are a multiple of 128). block_f: MLP intermediate columns per step (must divide F; default
    the largest power of two in [128, 2048] that does, else F). block_rows: MLP rows per program."""
    impl, interpret = pallas_setup(impl, interpret)
    opts = _Options(cfg, impl, interpret, block_k, kv_heads, block_f, block_rows)
    return _fused(opts, h, lp, ctx_k, ctx_v, jnp.asarray(anchor_pos, jnp.int32), jnp.asarray(window, jnp.int32))


def draft_stack(params: dict, cfg: ModelConfig, embed: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array,
                anchor_pos: jax.Array, block_tokens: jax.Array, **options) -> jax.Array:
    """`dflash.draft_blocks` with every layer fused: final-normed hidden states [B, A, W, D].

    params: the drafter's parameters (stacked `layers`, `norm`); cfg: its layer stack's config;
    ctx_k / ctx_v [Ld, B, S, Hkv, Dh]; block_tokens [B, A, W]; options: as `draft_layer`."""
    h = embed[block_tokens]
    windows = jnp.asarray(cfg.windows, jnp.int32)

    def layer(h, xs):
        lp, kc, vc, window = xs
        return draft_layer(h, lp, kc, vc, anchor_pos, window, cfg, **options), None

    h, _ = lax.scan(layer, h, (params["layers"], ctx_k, ctx_v, windows))
    return transformer.rms_norm(h, params["norm"], cfg.rms_norm_eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(opts: _Options, h, lp, ctx_k, ctx_v, anchor_pos, window):
    return _forward(opts, h, lp, ctx_k, ctx_v, anchor_pos, window)


def _fused_fwd(opts, h, lp, ctx_k, ctx_v, anchor_pos, window):
    return _forward(opts, h, lp, ctx_k, ctx_v, anchor_pos, window), (h, lp, ctx_k, ctx_v, anchor_pos, window)


def _fused_bwd(opts, res, grad):
    h, lp, ctx_k, ctx_v, anchor_pos, window = res
    # Recompute through the reference: kernels have no transpose rule, and training is not the hot path.
    _, vjp = jax.vjp(lambda *x: ref_draft_layer(*x, anchor_pos, window, opts.cfg), h, lp, ctx_k, ctx_v)
    return (*vjp(grad), None, None)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _forward(opts: _Options, h, lp, ctx_k, ctx_v, anchor_pos, window):
    cfg = opts.cfg
    b, a, w, d = h.shape
    s, hkv, dh = ctx_k.shape[1], cfg.num_kv_heads, cfg.head_dim
    if opts.impl == "portable" and not opts.interpret:
        require_pow2(hidden_size=d, head_dim=dh, block_f=opts.block_f or _f_tile(lp["w_gate"].shape[1]))
    wp = query_rows(w, opts.impl)  # padded slots are no block's keys and are dropped
    dt = jnp.result_type(h.dtype, *(lp[k].dtype for k in ("attn_norm", "wq", "wk", "wv", "q_norm", "k_norm")))
    anchor = anchor_pos.reshape(b * a)
    positions = anchor[:, None] + jnp.arange(wp)[None]
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(default_rope_inv_freq(cfg))
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B*A, Wp, Dh], as transformer.rope builds it
    lo = jnp.where(window > 0, jnp.maximum(anchor - window + 1, 0), 0).astype(jnp.int32)
    scalars = (lo, anchor, window.reshape(1))
    row = lambda v: v.reshape(1, -1)
    tensors = (
        jnp.pad(h, [(0, 0), (0, 0), (0, wp - w), (0, 0)]).reshape(b * a, wp, d),
        jnp.cos(emb).astype(dt), jnp.sin(emb).astype(dt),
        row(lp["attn_norm"]), row(lp["q_norm"]), row(lp["k_norm"]), jnp.asarray(_tiles.rotation(dh, dt)),
        lp["wq"], lp["wk"], lp["wv"], lp["wo"],
        ctx_k.reshape(b, s, hkv * dh), ctx_v.reshape(b, s, hkv * dh),
    )
    common = dict(cfg=cfg, a=a, w=w, dt=dt)
    if opts.impl == "tpu":
        hk = opts.kv_heads or kv_heads_per_step(hkv, dh)
        bk = min(round_up(opts.block_k, 8), round_up(s, 8))
        h_attn = _attn_tpu_call(scalars, tensors, hk=hk, block_k=bk, interpret=opts.interpret, **common)
    else:
        bk = pow2_at_most(min(opts.block_k, s))
        h_attn = _attn_portable_call(scalars, tensors, block_k=bk, interpret=opts.interpret, **common)
    f = lp["w_gate"].shape[1]
    block_f = opts.block_f or _f_tile(f)
    if f % block_f:
        raise ValueError(f"block_f {block_f} must divide the MLP width {f}")
    rows = h_attn.reshape(b * a * wp, d)
    block_rows = min(round_up(opts.block_rows, 8), rows.shape[0])
    if opts.impl != "tpu":
        block_rows = pow2_at_most(block_rows)
    mlp = (rows, row(lp["mlp_norm"]), lp["w_gate"], lp["w_up"], lp["w_down"])
    call = _mlp_tpu_call if opts.impl == "tpu" else _mlp_portable_call
    out = call(mlp, eps=cfg.rms_norm_eps, block_f=block_f, block_rows=block_rows, interpret=opts.interpret)
    return out.reshape(b, a, wp, d)[:, :, :w]


def _f_tile(f: int) -> int:
    """The largest power of two in [128, 2048] dividing f (lane-aligned on TPU, a power of two as GPU
    lowerings want), else f."""
    tile = 2048
    while tile >= 128:
        if f % tile == 0:
            return tile
        tile //= 2
    return f


def _project(x, wq_ref, wk_ref, wv_ref, qn, kn, cos, sin, rot, c: int, group: int, dh: int, eps: float, dt):
    """Block K, V [Wp, Dh] of KV head c and the queries [Wp, Dh] of its group's heads (a list)."""
    cols = slice(c * dh, (c + 1) * dh)
    k = _tiles.rope(_tiles.rms_norm(_tiles.mm(x, wk_ref[:, cols]).astype(dt), kn, eps), cos, sin, rot)
    v = _tiles.mm(x, wv_ref[:, cols]).astype(dt)
    qs = []
    for g in range(group):
        head = slice((c * group + g) * dh, (c * group + g + 1) * dh)
        qs.append(_tiles.rope(_tiles.rms_norm(_tiles.mm(x, wq_ref[:, head]).astype(dt), qn, eps), cos, sin, rot))
    return qs, k, v


def _context_mask(rows, hi, window, wp: int, group: int = 1):
    """[group * Wp, N] visibility of context rows [1, N] to the slots of a block anchored at hi, the
    slots repeated for `group` heads stacked along the rows."""
    slot = lax.broadcasted_iota(jnp.int32, (wp, 1), 0)
    if group > 1:
        slot = jnp.concatenate([slot] * group, axis=0)
    return (rows < hi) & ((window == 0) | (rows > hi + slot - window))


def _attn_tpu_kernel(lo_ref, hi_ref, win_ref, h_ref, cos_ref, sin_ref, an_ref, qn_ref, kn_ref, rot_ref,
                     wq_ref, wk_ref, wv_ref, wo_ref, kc_ref, vc_ref, out_ref, x_s, q_s, m_s, l_s, acc_s, o_s, *,
                     hk, group, dh, wp, w, eps, block_k, num_tiles, num_groups, scale, dt):
    ba, g, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi, window = lo_ref[ba], hi_ref[ba], win_ref[0]
    first, last = _tiles.context_tiles(lo, hi, block_k, num_tiles)
    rows_stat = group * wp
    store, load = _tiles.stats_in_scratch(m_s, l_s, acc_s, rows_stat)

    @pl.when((g == 0) & (j == 0))
    def _norm():
        x_s[...] = _tiles.rms_norm(h_ref[...], an_ref[...], eps)
        o_s[...] = jnp.zeros_like(o_s)

    @pl.when(j == 0)
    def _block():
        x, rot = x_s[...], rot_ref[...]
        keys = lax.broadcasted_iota(jnp.int32, (1, wp), 1) < w  # padded slots are nobody's keys
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
                o_s[...] += _tiles.mm(o[gi * wp:(gi + 1) * wp], wo_ref[head * dh:(head + 1) * dh, :])

        @pl.when(g == num_groups - 1)
        def _residual():
            out_ref[...] = (h_ref[...] + o_s[...].astype(dt)).astype(out_ref.dtype)


def _attn_tpu_call(scalars, tensors, *, cfg: ModelConfig, a, w, dt, hk, block_k, interpret):
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
        pl.BlockSpec((d, hk * group * dh), lambda i, g, j, *_: (0, g)),
        pl.BlockSpec((d, hk * dh), lambda i, g, j, *_: (0, g)),
        pl.BlockSpec((d, hk * dh), lambda i, g, j, *_: (0, g)),
        pl.BlockSpec((hk * group * dh, d), lambda i, g, j, *_: (g, 0)),
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
    # Double-buffered blocks plus scratch, at least the usual 32 MiB default, at most 64 MiB (v7x's VMEM).
    blocks = [(wp, d, hp.dtype), (d, hk * (2 * group + 2) * dh, wq.dtype), (2 * block_k, hk * dh, kc.dtype)]
    scratch_bytes = 4 * (hk * group * wp * (dh + 2 * _tiles.STAT_LANES) + 2 * wp * d)
    need = sum(2 * r * c * jnp.dtype(t).itemsize for r, c, t in blocks) + scratch_bytes
    kernel = functools.partial(_attn_tpu_kernel, hk=hk, group=group, dh=dh, wp=wp, w=w, eps=cfg.rms_norm_eps,
                               block_k=block_k, num_tiles=num_tiles, num_groups=num_groups, scale=dh**-0.5, dt=dt)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=3, grid=(ba, num_groups, num_tiles),
                                               in_specs=in_specs, out_specs=pl.BlockSpec((None, wp, d), block),
                                               scratch_shapes=scratch),
        out_shape=jax.ShapeDtypeStruct((ba, wp, d), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=int(min(max(need + 8 * _MIB, 32 * _MIB), 64 * _MIB))),
        interpret=interpret,
    )(*scalars, *tensors)


def _attn_portable_kernel(lo_ref, hi_ref, win_ref, h_ref, cos_ref, sin_ref, an_ref, qn_ref, kn_ref, rot_ref,
                          wq_ref, wk_ref, wv_ref, wo_ref, kc_ref, vc_ref, out_ref, *,
                          hkv, group, dh, wp, w, eps, block_k, scale, dt):
    i = pl.program_id(0)
    lo, hi, window = lo_ref[i], hi_ref[i], win_ref[0]
    s = kc_ref.shape[0]
    first, last = _tiles.context_tiles(lo, hi, block_k, -(-s // block_k))
    x = _tiles.rms_norm(h_ref[...], an_ref[...], eps)
    keys = lax.broadcasted_iota(jnp.int32, (1, wp), 1) < w  # padded slots are nobody's keys
    qs, states = [], []  # per query head (no row stacking: GPU lowerings concatenate only along lanes)
    for c in range(hkv):
        q_heads, k, v = _project(x, wq_ref, wk_ref, wv_ref, qn_ref[...], kn_ref[...], cos_ref[...], sin_ref[...],
                                 rot_ref[...], c, group, dh, eps, dt)
        qs += q_heads
        states += [_tiles.attend(_tiles.init_stats(wp, dh), q, k, v, keys, scale) for q in q_heads]

    def tile(t, states):
        # The last tile is shifted back to end at row S (no read past the cache); rows it shares with
        # the previous tile are masked so that no key is counted twice.
        start = jnp.minimum(t * block_k, s - block_k)
        rows = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        vis = (rows >= t * block_k) & _context_mask(rows, hi, window, wp)
        rows_c = start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        readable = (rows_c >= jnp.maximum(lo, t * block_k)) & (rows_c < hi)
        out = []
        for c in range(hkv):
            cols = pl.ds(c * dh, dh)
            k = kc_ref[pl.ds(start, block_k), cols].astype(dt)
            v = jnp.where(readable, vc_ref[pl.ds(start, block_k), cols], 0).astype(dt)
            out += [_tiles.attend(states[head], qs[head], k, v, vis, scale)
                    for head in range(c * group, (c + 1) * group)]
        return out

    states = lax.fori_loop(first, jnp.where(lo < hi, last + 1, first), tile, states)
    o_proj = jnp.zeros(out_ref.shape, jnp.float32)
    for head, (_, l, acc) in enumerate(states):
        o = _tiles.finish(l, acc).astype(dt)
        o_proj = o_proj + _tiles.mm(o, wo_ref[head * dh:(head + 1) * dh, :])
    out_ref[...] = (h_ref[...] + o_proj.astype(dt)).astype(out_ref.dtype)


def _attn_portable_call(scalars, tensors, *, cfg: ModelConfig, a, w, dt, block_k, interpret):
    hp = tensors[0]
    ba, wp, d = hp.shape
    dh = cfg.head_dim
    kernel = functools.partial(_attn_portable_kernel, hkv=cfg.num_kv_heads, group=cfg.num_heads // cfg.num_kv_heads,
                               dh=dh, wp=wp, w=w, eps=cfg.rms_norm_eps, block_k=block_k, scale=dh**-0.5, dt=dt)
    whole = lambda x: pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)
    per_block = lambda x: pl.BlockSpec((None, *x.shape[1:]), lambda i: (i, 0, 0))
    per_row = lambda x: pl.BlockSpec((None, *x.shape[1:]), lambda i: (i // a, 0, 0))
    specs = ([whole(x) for x in scalars] + [per_block(x) for x in tensors[:3]] + [whole(x) for x in tensors[3:11]]
             + [per_row(x) for x in tensors[11:]])
    return pl.pallas_call(
        kernel,
        grid=(ba,),
        compiler_params=pltriton.CompilerParams(),
        in_specs=specs,
        out_specs=per_block(hp),
        out_shape=jax.ShapeDtypeStruct((ba, wp, d), jnp.result_type(hp.dtype, dt)),
        interpret=interpret,
    )(*scalars, *tensors)


def _swiglu(x, wg, wu, wd):
    """SwiGLU of x [R, D] through one F tile, down-projected and accumulated in float32: [R, D]."""
    dt = jnp.result_type(x.dtype, wg.dtype)
    gate, up = _tiles.mm(x, wg).astype(dt), _tiles.mm(x, wu).astype(dt)
    acts = jax.nn.silu(gate.astype(jnp.float32)).astype(dt) * up  # float32 math: GPU lowerings lack bf16 division
    return _tiles.mm(acts.astype(jnp.result_type(acts.dtype, wd.dtype)), wd)


def _mlp_tpu_kernel(h_ref, n_ref, wg_ref, wu_ref, wd_ref, out_ref, x_s, acc_s, *, eps, num_f):
    f = pl.program_id(1)

    @pl.when(f == 0)
    def _norm():
        x_s[...] = _tiles.rms_norm(h_ref[...], n_ref[...], eps)
        acc_s[...] = jnp.zeros_like(acc_s)

    acc_s[...] += _swiglu(x_s[...], wg_ref[...], wu_ref[...], wd_ref[...])

    @pl.when(f == num_f - 1)
    def _residual():
        h = h_ref[...]
        out_ref[...] = (h + acc_s[...].astype(jnp.result_type(h.dtype, wd_ref.dtype))).astype(out_ref.dtype)


def _mlp_tpu_call(args, *, eps, block_f, block_rows, interpret):
    h, norm, wg, wu, wd = args
    n, d = h.shape
    f = wg.shape[1]
    grid = (-(-n // block_rows), f // block_f)
    rows = pl.BlockSpec((block_rows, d), lambda r, k: (r, 0))
    out_dtype = jnp.result_type(h.dtype, norm.dtype, wg.dtype, wd.dtype)
    need = 2 * (3 * d * block_f * wg.dtype.itemsize + 2 * block_rows * d * h.dtype.itemsize) + 8 * block_rows * d
    return pl.pallas_call(
        functools.partial(_mlp_tpu_kernel, eps=eps, num_f=grid[1]),
        grid=grid,
        in_specs=[rows, pl.BlockSpec((1, d), lambda r, k: (0, 0)), pl.BlockSpec((d, block_f), lambda r, k: (0, k)),
                  pl.BlockSpec((d, block_f), lambda r, k: (0, k)), pl.BlockSpec((block_f, d), lambda r, k: (k, 0))],
        out_specs=rows,
        out_shape=jax.ShapeDtypeStruct((n, d), out_dtype),
        scratch_shapes=[pltpu.VMEM((block_rows, d), jnp.result_type(h.dtype, norm.dtype)),
                        pltpu.VMEM((block_rows, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=int(min(max(need + 8 * _MIB, 32 * _MIB), 64 * _MIB))),
        interpret=interpret,
    )(h, norm, wg, wu, wd)


def _mlp_portable_kernel(h_ref, n_ref, wg_ref, wu_ref, wd_ref, out_ref, *, eps, block_f):
    x = _tiles.rms_norm(h_ref[...], n_ref[...], eps)

    def step(k, acc):
        cols = pl.ds(k * block_f, block_f)
        return acc + _swiglu(x, wg_ref[:, cols], wu_ref[:, cols], wd_ref[cols, :])

    acc = lax.fori_loop(0, wg_ref.shape[1] // block_f, step, jnp.zeros(out_ref.shape, jnp.float32))
    h = h_ref[...]
    out_ref[...] = (h + acc.astype(jnp.result_type(h.dtype, wd_ref.dtype))).astype(out_ref.dtype)


def _mlp_portable_call(args, *, eps, block_f, block_rows, interpret):
    h, norm, wg, wu, wd = args
    n, d = h.shape
    rows = pl.BlockSpec((block_rows, d), lambda r: (r, 0))
    whole = lambda x: pl.BlockSpec(x.shape, lambda r: (0, 0))
    return pl.pallas_call(
        functools.partial(_mlp_portable_kernel, eps=eps, block_f=block_f),
        grid=(-(-n // block_rows),),
        compiler_params=pltriton.CompilerParams(),
        in_specs=[rows, whole(norm), whole(wg), whole(wu), whole(wd)],
        out_specs=rows,
        out_shape=jax.ShapeDtypeStruct((n, d), jnp.result_type(h.dtype, norm.dtype, wg.dtype, wd.dtype)),
        interpret=interpret,
    )(h, norm, wg, wu, wd)
