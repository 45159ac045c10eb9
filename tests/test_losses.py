"""Drafter losses: values and gradients against direct numpy computations, and their limiting cases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.train import losses

RNG = np.random.default_rng(0)
G, V = 3, 5


def _case(seed=0):
    rng = np.random.default_rng(seed)
    d = rng.normal(size=(2, G, V))
    t = rng.normal(size=(2, G, V))
    labels = rng.integers(0, V, size=(2, G))
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.float64)
    return d, t, labels, mask


def _logsoftmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_losses(d, t, labels, mask, gamma=4.0, eta=3.0):
    """Straight numpy versions of every loss, over raw logits d (draft) and t (target)."""
    ld, lt = _logsoftmax(d), _logsoftmax(t)
    pd, pt = np.exp(ld), np.exp(lt)
    w = np.exp(-np.arange(G) / gamma) * mask
    wm = lambda per: (per * w).sum() / w.sum()
    nll = -np.take_along_axis(ld, labels[..., None], -1)[..., 0]
    kl = (pt * (lt - ld)).sum(-1)
    tv = 0.5 * np.abs(pd - pt).sum(-1)
    alpha = np.minimum(pd, pt).sum(-1)
    lam = np.exp(-eta * alpha)
    out = {"ce": wm(nll), "kl": wm(kl), "tv": wm(tv), "lk_hybrid": wm(lam * kl + (1 - lam) * tv),
           "lk_likelihood": wm(-np.log(alpha))}
    e2e = 0.0
    for b in range(2):
        run = 1.0
        for k in range(G):
            run *= mask[b, k] * (1 - tv[b, k])
            e2e -= run
    out["e2e_tv"] = e2e / 2
    bv = 0.0
    for b in range(2):
        total, w_prev, alive = 0.0, 1.0, 1.0
        for k in range(G):
            alive *= mask[b, k]
            total += alive * np.minimum(w_prev * pd[b, k], pt[b, k]).sum()
            x = labels[b, k]
            w_prev = min(1.0, w_prev * pt[b, k, x] / pd[b, k, x])  # block verification's running weight
        bv -= np.log(total)
    out["bv"] = bv / 2
    return out


@pytest.mark.parametrize("name", sorted(losses.LOSSES))
def test_value_and_gradient_match_numpy(name):
    d, t, labels, mask = _case()
    fn = losses.LOSSES[name]

    def ours(logits):
        args = (jax.nn.log_softmax(logits), jax.nn.log_softmax(jnp.asarray(t)), jnp.asarray(labels), jnp.asarray(mask))
        return fn(*args) if name in ("e2e_tv", "bv") else fn(*args, 4.0)

    with jax.enable_x64(True):
        value, grad = jax.value_and_grad(ours)(jnp.asarray(d))
    np.testing.assert_allclose(float(value), np_losses(d, t, labels, mask)[name], rtol=1e-9)
    # Central finite differences of the numpy reference (which never calls JAX).
    eps, num = 1e-6, np.zeros_like(d)
    for idx in np.ndindex(d.shape):
        hi, lo = d.copy(), d.copy()
        hi[idx] += eps
        lo[idx] -= eps
        num[idx] = (np_losses(hi, t, labels, mask)[name] - np_losses(lo, t, labels, mask)[name]) / (2 * eps)
    if name == "lk_hybrid":  # lambda is a stop-gradient: differentiate with lambda frozen
        return _check_lk_gradient(d, t, labels, mask, np.asarray(grad))
    np.testing.assert_allclose(np.asarray(grad), num, atol=1e-6)


def _check_lk_gradient(d, t, labels, mask, grad):
    ld0 = _logsoftmax(d)
    lam = np.exp(-3.0 * np.minimum(np.exp(ld0), np.exp(_logsoftmax(t))).sum(-1))

    def frozen(x):
        ld, lt = _logsoftmax(x), _logsoftmax(t)
        kl = (np.exp(lt) * (lt - ld)).sum(-1)
        tv = 0.5 * np.abs(np.exp(ld) - np.exp(lt)).sum(-1)
        w = np.exp(-np.arange(G) / 4.0) * mask
        return ((lam * kl + (1 - lam) * tv) * w).sum() / w.sum()

    eps, num = 1e-6, np.zeros_like(d)
    for idx in np.ndindex(d.shape):
        hi, lo = d.copy(), d.copy()
        hi[idx] += eps
        lo[idx] -= eps
        num[idx] = (frozen(hi) - frozen(lo)) / (2 * eps)
    np.testing.assert_allclose(grad, num, atol=1e-6)


def test_lk_hybrid_limits():
    t = jax.nn.log_softmax(jnp.array([[[4.0, 0.0, -25.0]]]))
    one = jnp.ones((1, 1))
    lab = jnp.zeros((1, 1), jnp.int32)
    # alpha = 0 (disjoint supports up to fp): lambda = 1, the loss is KL.
    far = jax.nn.log_softmax(jnp.array([[[-30.0, -30.0, 30.0]]]))
    assert float(losses.acceptance(far, t)[0, 0]) < 1e-6
    np.testing.assert_allclose(losses.lk_hybrid_loss(far, t, lab, one), losses.kl_loss(far, t, lab, one), rtol=1e-5)
    # As alpha grows, the weight moves to TV: the gap to TV shrinks relative to the gap to KL.
    prev = None
    for scale in (0.2, 0.5, 0.8):
        d = jax.nn.log_softmax(jnp.array([[[4.0 * scale, 0.0, -25.0 * scale]]]))
        h, kl, tv = (float(f(d, t, lab, one)) for f in (losses.lk_hybrid_loss, losses.kl_loss, losses.tv_loss))
        frac_tv = (kl - h) / (kl - tv)  # 0 = pure KL, 1 = pure TV
        assert 0 <= frac_tv <= 1 and (prev is None or frac_tv > prev)
        prev = frac_tv


def test_bv_on_one_token_is_minus_log_alpha():
    d, t, labels, _ = _case(1)
    ld, lt = jax.nn.log_softmax(jnp.asarray(d[:, :1])), jax.nn.log_softmax(jnp.asarray(t[:, :1]))
    m = jnp.ones((2, 1))
    got = losses.bv_loss(ld, lt, jnp.asarray(labels[:, :1]), m)
    want = -jnp.mean(jnp.log(losses.acceptance(ld, lt)[:, 0]))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_e2e_tv_is_the_product_formula():
    d, t, labels, _ = _case(2)
    ld, lt = jax.nn.log_softmax(jnp.asarray(d)), jax.nn.log_softmax(jnp.asarray(t))
    tv = np.asarray(losses.tv_distance(ld, lt))
    want = -np.mean([sum(np.prod(1 - tv[b, : k + 1]) for k in range(G)) for b in range(2)])
    np.testing.assert_allclose(losses.e2e_tv_loss(ld, lt, jnp.asarray(labels), jnp.ones((2, G))), want, rtol=1e-6)


def test_dspark_loss_and_curriculum():
    d, t, labels, mask = _case(3)
    ld, lt = jax.nn.log_softmax(jnp.asarray(d)), jax.nn.log_softmax(jnp.asarray(t))
    conf = jnp.asarray(np.random.default_rng(4).uniform(0.1, 0.9, size=(2, G)))
    got = losses.dspark_loss(ld, lt, jnp.asarray(labels), jnp.asarray(mask), conf, 4.0)
    ref = np_losses(d, t, labels, mask)
    pd, pt = np.exp(_logsoftmax(d)), np.exp(_logsoftmax(t))
    goal = 1 - 0.5 * np.abs(pd - pt).sum(-1)
    c = np.asarray(conf)
    bce = -(goal * np.log(c) + (1 - goal) * np.log(1 - c))
    w = np.exp(-np.arange(G) / 4.0) * mask
    nll = -np.take_along_axis(_logsoftmax(d), labels[..., None], -1)[..., 0]
    want = ((0.1 * nll + 0.9 * np.abs(pd - pt).sum(-1) + bce) * w).sum() / w.sum()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert ref["ce"] > 0
    assert float(losses.domino_curriculum(2.0, 5.0, 0.0)) == 5.0
    assert float(losses.domino_curriculum(2.0, 5.0, 1.0)) == 2.0
    assert float(losses.domino_curriculum(2.0, 5.0, 0.25, fraction=0.5)) == pytest.approx(3.5)
