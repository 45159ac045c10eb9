"""Gated DeltaNet math: the chunked form equals the token-by-token recurrence; trees follow root paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models import gdn

B, H, DK, DV, C, K = 2, 4, 8, 8, 6, 4


def _inputs(t: int, seed: int = 0):
    """Random normalised q/k, values, log-decays g <= 0, beta in (0, 1), a non-zero initial state."""
    r = np.random.RandomState(seed)
    f = lambda *s: jnp.asarray(r.randn(*s), jnp.float32)
    q = gdn.l2norm(f(B, t, H, DK)) * DK**-0.5
    k = gdn.l2norm(f(B, t, H, DK))
    g = -jnp.asarray(r.uniform(0.0, 1.5, (B, t, H)), jnp.float32)
    beta = jax.nn.sigmoid(f(B, t, H))
    return q, k, f(B, t, H, DV), g, beta, f(B, H, DK, DV)


def _random_tree(n: int, seed: int) -> np.ndarray:
    """parent [n] with parent[t] < t, several roots (-1)."""
    r = np.random.RandomState(seed)
    return np.array([-1 if t == 0 or r.rand() < 0.2 else r.randint(-1, t) for t in range(n)])


def _root_path(parent: np.ndarray, t: int) -> list[int]:
    path = [t]
    while parent[path[-1]] >= 0:
        path.append(parent[path[-1]])
    return path[::-1]


def ref_delta_rule(q, k, v, g, beta, s0):
    """Float64 numpy reference, one row: q, k [T, H, dk]; v [T, H, dv]; g, beta [T, H]; s0 [H, dk, dv].

    Returns (o [T, H, dv], states after each token [T, H, dk, dv]).
    """
    q, k, v, g, beta, s = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, s0))
    outs, states = [], []
    for t in range(q.shape[0]):
        s = s * np.exp(g[t])[:, None, None]
        u = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", s, k[t]))
        s = s + k[t][:, :, None] * u[:, None, :]
        outs.append(np.einsum("hkv,hk->hv", s, q[t]))
        states.append(s)
    return np.stack(outs), np.stack(states)


def ref_conv(x, window, w):
    """Float64 reference, one row: x [T, C], window [K-1, C], w [K, C] -> (y [T, C], windows [T, K-1, C])."""
    hist = np.concatenate([window, x]).astype(np.float64)
    kk = w.shape[0]
    y = np.stack([(np.asarray(w, np.float64) * hist[t : t + kk]).sum(0) for t in range(x.shape[0])])
    return y, np.stack([hist[t + 1 : t + kk] for t in range(x.shape[0])])


recurrent = jax.jit(gdn.gdn_recurrent, static_argnames=("keep_states",))
chunked = jax.jit(gdn.gdn_chunked, static_argnames=("chunk_size",))
conv = jax.jit(gdn.causal_conv, static_argnames=("keep_windows",))


@pytest.mark.parametrize("t, chunk", [(21, 4), (21, 8), (5, 64)])
def test_chunked_equals_recurrent(t, chunk):
    q, k, v, g, beta, s0 = _inputs(t)
    o_rec, s_rec, states = recurrent(q, k, v, g, beta, s0, keep_states=True)
    o_chk, s_chk = chunked(q, k, v, g, beta, s0, chunk_size=chunk)
    assert np.abs(np.asarray(o_rec)).max() > 0.1
    np.testing.assert_allclose(np.asarray(o_chk), np.asarray(o_rec), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(s_chk), np.asarray(s_rec), atol=1e-5, rtol=0)
    # Both against the float64 reference; per-position states are the states after each prefix.
    for row in range(B):
        o_ref, st_ref = ref_delta_rule(q[row], k[row], v[row], g[row], beta[row], s0[row])
        np.testing.assert_allclose(np.asarray(o_rec[row]), o_ref, atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(states[row]), st_ref, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(states[:, -1]), np.asarray(s_rec))


def test_padding_tokens_do_not_move_the_state():
    """g = beta = 0 past lengths[b]: both forms end in the state after exactly lengths[b] tokens."""
    q, k, v, g, beta, s0 = _inputs(12, seed=2)
    lengths = np.array([12, 7])
    live = (np.arange(12)[None, :] < lengths[:, None])[..., None]
    gp, bp = jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0)
    _, s_rec, states = recurrent(q, k, v, gp, bp, s0, keep_states=True)
    _, s_chk = chunked(q, k, v, gp, bp, s0, chunk_size=4)
    for r, n in enumerate(lengths):
        np.testing.assert_array_equal(np.asarray(s_rec[r]), np.asarray(states[r, n - 1]))
        np.testing.assert_allclose(np.asarray(s_chk[r]), np.asarray(states[r, n - 1]), atol=1e-5, rtol=0)


def test_conv_window_carries_across_calls_and_padding():
    r = np.random.RandomState(3)
    x = jnp.asarray(r.randn(B, 10, C), jnp.float32)
    w = jnp.asarray(r.randn(K, C), jnp.float32)
    win0 = jnp.asarray(r.randn(B, K - 1, C), jnp.float32)
    y_all, win_all, windows = conv(x, win0, w, keep_windows=True)
    for row in range(B):
        y_ref, win_ref = ref_conv(np.asarray(x[row]), np.asarray(win0[row]), np.asarray(w))
        np.testing.assert_allclose(np.asarray(y_all[row]), y_ref, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(np.asarray(windows[row]), win_ref)
    # Two calls of 6 + 4 tokens equal one of 10.
    y1, win1, _ = conv(x[:, :6], win0, w)
    y2, win2, _ = conv(x[:, 6:], win1, w)
    np.testing.assert_allclose(np.concatenate([y1, y2], axis=1), np.asarray(y_all), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(win2), np.asarray(win_all))
    np.testing.assert_array_equal(np.asarray(windows[:, 5]), np.asarray(win1))
    # lengths: the window after exactly lengths[b] inputs (0 keeps the old window).
    _, win_len, _ = conv(x, win0, w, lengths=jnp.array([6, 0]))
    np.testing.assert_array_equal(np.asarray(win_len[0]), np.asarray(win1[0]))
    np.testing.assert_array_equal(np.asarray(win_len[1]), np.asarray(win0[1]))


def test_tree_follows_root_paths():
    """Every node's conv output, recurrence output and states equal the chain along its root path."""
    n = 10
    parent = np.stack([_random_tree(n, 0), _random_tree(n, 1)])
    q, k, v, g, beta, s0 = _inputs(n, seed=4)
    r = np.random.RandomState(4)
    x = jnp.asarray(r.randn(B, n, C), jnp.float32)
    w = jnp.asarray(r.randn(K, C), jnp.float32)
    win0 = jnp.asarray(r.randn(B, K - 1, C), jnp.float32)
    par = jnp.asarray(parent)
    y, _, windows = conv(x, win0, w, parent=par, keep_windows=True)
    o, _, states = recurrent(q, k, v, g, beta, s0, parent=par, keep_states=True)
    assert (parent[:, 1:] != np.arange(n - 1)).any()  # really a tree, not a chain
    for row in range(B):
        for t in range(n):
            p = _root_path(parent[row], t)
            y_ref, win_ref = ref_conv(np.asarray(x[row, p]), np.asarray(win0[row]), np.asarray(w))
            o_ref, st_ref = ref_delta_rule(*(a[row, p] for a in (q, k, v, g, beta)), s0[row])
            np.testing.assert_allclose(np.asarray(y[row, t]), y_ref[-1], atol=1e-5, rtol=0)
            np.testing.assert_array_equal(np.asarray(windows[row, t]), win_ref[-1])
            np.testing.assert_allclose(np.asarray(o[row, t]), o_ref[-1], atol=1e-5, rtol=0)
            np.testing.assert_allclose(np.asarray(states[row, t]), st_ref[-1], atol=1e-5, rtol=0)
