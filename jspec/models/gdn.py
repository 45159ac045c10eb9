"""Gated DeltaNet (GDN) math: causal depthwise conv over a carried window, and the gated delta rule.

Pure functions; the layer that projects, gates and normalises around them lives in `hybrid.py`.

Delta rule, per token t and value head (state S [dk, dv], float32):

    S <- exp(g_t) S;   u = beta_t (v_t - S^T k_t);   S <- S + k_t u^T;   o_t = S^T q_t

Two equal forms of a causal chain are provided: `gdn_recurrent` (token by token; also serves trees,
where token t continues from the state after its parent) and `gdn_chunked` (WY/UT transform inside
chunks, a scan over chunks; used for prefill). Both take q, k already L2-normalised, q already scaled
by dk^-0.5, and q/k already repeated to the value heads.

A token that must not advance the state (right padding) is given g = 0 and beta = 0: then exp(g) = 1
and u = 0, so S passes through it unchanged in both forms, exactly.

Matmuls on the state run at HIGHEST precision so that TPU/GPU default (bf16 / TF32) passes do not
perturb the float32 state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis (the FLA / transformers convention)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_rms_norm(x: jax.Array, gate: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNormGated: normalise x in float32, cast back, times w (ones-initialised), times silu(gate)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = w * xf.astype(x.dtype)
    return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


# --- causal depthwise conv ----------------------------------------------------------------------


def _tree_taps(parent: jax.Array, k: int) -> jax.Array:
    """Index into [window (K-1) ; x (T)] of the input d steps back along each token's root path.

    parent [B, T] (-1 = continues from the window). Returns idx [B, T, K], idx[..., d] for d = 0..K-1
    (d = 0 is the token itself). A chain (parent = t - 1) gives idx = K - 1 + t - d.
    """
    b, t = parent.shape
    node = jnp.broadcast_to(jnp.arange(t), (b, t))
    inside = jnp.zeros((b, t), jnp.int32)  # how many of the first d steps stayed inside the pass
    cols = []
    for d in range(k):
        in_pass = node >= 0
        # Outside the pass the walk continues backwards through the window: newest entry is K - 2.
        cols.append(jnp.where(in_pass, k - 1 + node, k - 2 - d + inside))
        inside = inside + in_pass.astype(jnp.int32)
        node = jnp.where(in_pass, jnp.take_along_axis(parent, jnp.maximum(node, 0), axis=1), -1)
    return jnp.stack(cols, axis=-1)


def causal_conv(
    x: jax.Array,
    window: jax.Array,
    w: jax.Array,
    *,
    parent: jax.Array | None = None,
    lengths: jax.Array | None = None,
    keep_windows: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Depthwise causal conv1d (no bias, no activation) continuing from a window of past inputs.

    x [B, T, C] new inputs; window [B, K-1, C] the last K-1 inputs before them (oldest first);
    w [K, C] taps (w[K-1] multiplies the current input). parent [B, T]: token t continues from
    token parent[t] of this pass (-1 = from `window`); None = a chain. lengths [B] (chains only):
    tokens at index >= lengths[b] are padding and do not enter the returned window.

    Returns (y [B, T, C] float32, window after the chain (after lengths[b] tokens) [B, K-1, C],
    windows after each token [B, T, K-1, C] when keep_windows else None).
    """
    b, t, c = x.shape
    k = w.shape[0]
    ext = jnp.concatenate([window.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    wf = w.astype(jnp.float32)
    if parent is None:
        # Chain: token t reads ext[t : t+K], so the taps are K static slices.
        y = sum(wf[i] * ext[:, i : i + t].astype(jnp.float32) for i in range(k))
        idx = jnp.arange(t)[:, None] + 1 + jnp.arange(k - 1)[None, :]  # window after t: ext[t+1 : t+K]
        windows = ext[:, idx] if keep_windows else None
    else:
        # Each token's K inputs along its root path, oldest first like the taps of w (the index is
        # reversed, not w: a reversed or transposed w would be a copy of the weight every pass).
        taps = _tree_taps(parent, k)[..., ::-1]  # [B, T, K]
        gathered = jnp.take_along_axis(ext[:, None], taps[..., None], axis=2)  # [B, T, K, C]
        y = jnp.sum(gathered.astype(jnp.float32) * wf, axis=2)
        windows = gathered[:, :, 1:] if keep_windows else None
    if lengths is None:
        last = ext[:, t:]
    else:
        last = jnp.take_along_axis(ext, (lengths[:, None] + jnp.arange(k - 1)[None, :])[..., None], axis=1)
    return y, last.astype(window.dtype), windows


# --- the gated delta rule -----------------------------------------------------------------------


def _step(s, q, k, v, g, beta):
    """One token. s [B, H, dk, dv]; q, k [B, H, dk]; v [B, H, dv]; g, beta [B, H]."""
    s = s * jnp.exp(g)[..., None, None]
    kv_mem = jnp.einsum("bhkv,bhk->bhv", s, k, precision=_HI)
    u = (v - kv_mem) * beta[..., None]
    s = s + k[..., :, None] * u[..., None, :]
    return s, jnp.einsum("bhkv,bhk->bhv", s, q, precision=_HI)


def gdn_recurrent(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    parent: jax.Array | None = None,
    keep_states: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Token-by-token gated delta rule (float32).

    q, k [B, T, H, dk]; v [B, T, H, dv]; g, beta [B, T, H]; state [B, H, dk, dv] before the pass.
    parent [B, T] (trees; parent[t] < t): token t starts from the state after token parent[t], or
    from `state` where parent[t] = -1. None = a chain.

    Returns (o [B, T, H, dv], state after the last token [B, H, dk, dv] (chains; for trees the state
    after token T-1), states after each token [B, T, H, dk, dv] when keep_states or trees, else None).
    """
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    state = state.astype(jnp.float32)
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    if parent is None:

        def body(s, x):
            s, o = _step(s, *x)
            return s, (o, s if keep_states else None)

        final, (o, states) = jax.lax.scan(body, state, xs)
        states = None if states is None else jnp.moveaxis(states, 0, 1)
        return jnp.moveaxis(o, 0, 1), final, states

    b, t = parent.shape
    rows = jnp.arange(b)

    def tree_body(buf, x):
        i, par, xi = x[0], x[1], x[2:]
        prev = jnp.where((par < 0)[:, None, None, None], state, buf[rows, jnp.maximum(par, 0)])
        s, o = _step(prev, *xi)
        return buf.at[:, i].set(s), o

    buf0 = jnp.zeros((b, t) + state.shape[1:], jnp.float32)
    states, o = jax.lax.scan(tree_body, buf0, (jnp.arange(t), parent.T) + xs)
    return jnp.moveaxis(o, 0, 1), states[:, -1], states


def gdn_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """Chunked gated delta rule over a causal chain; equal to `gdn_recurrent` up to float rounding.

    Same shapes as `gdn_recurrent` (no trees, no per-token states). Inside a chunk of C tokens the C
    rank-one updates are folded by the UT transform (one unit-lower-triangular solve); the chunks
    are a `lax.scan`. T is padded to a multiple of C with g = beta = 0 tokens (no state change).
    Returns (o [B, T, H, dv], state after the last token [B, H, dk, dv]).
    """
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    c = min(chunk_size, t)
    pad = (-t) % c
    n = (t + pad) // c

    def prep(x):  # [B, T, H, ...] -> [N, B, H, C, ...] float32
        x = x.astype(jnp.float32)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((b, n, c) + x.shape[2:]), (1, 3), (0, 2))

    q, k, v, g, beta = (prep(x) for x in (q, k, v, g, beta))
    gc = jnp.cumsum(g, axis=-1)  # [N, B, H, C] log decay from the chunk start through token i
    causal = jnp.tril(jnp.ones((c, c), bool))
    # decay[i, j] = exp(gc_i - gc_j) for j <= i: the decay a write at j has seen when read at i.
    decay = jnp.exp(jnp.where(causal, gc[..., :, None] - gc[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    strict = jnp.einsum("...ik,...jk->...ij", k_beta, k, precision=_HI) * decay * ~jnp.eye(c, dtype=bool)
    # (I + strict) X = B solves the within-chunk delta-rule coupling for all C tokens at once.
    solve = lambda rhs: jax.lax.linalg.triangular_solve(strict, rhs, left_side=True, lower=True,
                                                        unit_diagonal=True)
    u0 = solve(v_beta)  # new values if the chunk started from S = 0
    w = solve(k_beta * jnp.exp(gc)[..., None])  # how the incoming state S corrects them: u = u0 - w S
    attn = jnp.einsum("...ik,...jk->...ij", q, k, precision=_HI) * decay
    q_dec = q * jnp.exp(gc)[..., None]
    k_dec = k * jnp.exp(gc[..., -1:] - gc)[..., None]
    last = jnp.exp(gc[..., -1])[..., None, None]

    def body(s, x):
        u0_i, w_i, attn_i, q_i, k_i, last_i = x
        u = u0_i - jnp.einsum("bhck,bhkv->bhcv", w_i, s, precision=_HI)
        o = jnp.einsum("bhck,bhkv->bhcv", q_i, s, precision=_HI) + jnp.einsum(
            "bhij,bhjv->bhiv", attn_i, u, precision=_HI)
        s = s * last_i + jnp.einsum("bhck,bhcv->bhkv", k_i, u, precision=_HI)
        return s, o

    final, o = jax.lax.scan(body, state.astype(jnp.float32), (u0, w, attn, q_dec, k_dec, last))
    o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(b, n * c, h, dv)  # [N, B, H, C, dv] -> [B, T, H, dv]
    return o[:, :t], final
