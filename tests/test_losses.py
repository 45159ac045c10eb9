"""Drafter losses: values and gradients against direct numpy computations, and their limiting cases.
The block-verification loss is checked against block verification itself: the exact expected accepted
length that `jspec.verify.exact` integrates from the rule's coin form (`block_chain_from_coins`)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.train import losses
from jspec.verify import exact
from jspec.verify.chain import block_chain_from_coins

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
    lam = np.exp(-eta * (alpha * mask).sum(0) / mask.sum(0))  # [G]: batch mean of alpha per position
    out = {"ce": wm(nll), "kl": wm(kl), "tv": wm(tv), "lk_hybrid": wm(lam * kl + (1 - lam) * tv),
           "lk_likelihood": wm(-np.log(alpha))}
    e2e = 0.0
    for b in range(2):
        run = 1.0
        for k in range(G):
            run *= mask[b, k] * (1 - tv[b, k])
            e2e -= run
    out["e2e_tv"] = e2e / 2
    return out


# bv: against the rule, below; dpace: weights held constant, below; the window losses: below and in
# tests/test_offline_eval.py (against EDR on the rollout)
@pytest.mark.parametrize("name", sorted(set(losses.LOSSES) - {"bv", "dpace", *losses.WINDOW_LOSSES}))
def test_value_and_gradient_match_numpy(name):
    d, t, labels, mask = _case()
    fn = losses.LOSSES[name]

    def ours(logits):
        args = (jax.nn.log_softmax(logits), jax.nn.log_softmax(jnp.asarray(t)), jnp.asarray(labels), jnp.asarray(mask))
        return fn(*args) if name == "e2e_tv" else fn(*args, 4.0)

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
    alpha = np.minimum(np.exp(ld0), np.exp(_logsoftmax(t))).sum(-1)
    lam = np.exp(-3.0 * (alpha * mask).sum(0) / mask.sum(0))  # one lambda per position, frozen

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


# --- block verification: the loss against the rule's exact enumeration -----------------------------------

P_BV = np.array([0.462, 0.511, 0.028]) / 1.001  # target (DRAFTERS2.md section 10)
Q_BV = np.array([0.375, 0.511, 0.113]) / 0.999  # drafter


def _paths(tables: exact.Tables, g: int):
    """Every data path x in V^g with p(x), and the rows along it: draft / target log-probs [D, g, V]
    (float64 from the tables' float32 logs, renormalised as exact.py reads them), labels [D, g]."""
    vocab = tables.vocab
    paths = np.array(list(itertools.product(range(vocab), repeat=g)), np.int64)
    prob = np.ones(len(paths))
    d_rows, t_rows = [], []
    for k in range(g):
        codes = np.array([exact.code(x[:k], vocab) for x in paths])
        prob *= tables.p(k)[codes, paths[:, k]]
        with np.errstate(divide="ignore"):  # sparse rows: log 0 = -inf, as the rules read them
            d_rows.append(np.log(tables.q(k)[codes]))
            t_rows.append(np.log(tables.p(k)[codes]))
    return paths, prob, np.stack(d_rows, 1), np.stack(t_rows, 1)


def _bv_block_values(draft_logp, target_logp, labels):
    """exp(-bv_loss) of each path on its own: sum_k E_k along it."""
    one = jnp.ones(labels.shape[-1:])
    per = jax.vmap(lambda d, t, x: losses.bv_loss(d[None], t[None], x[None], one[None]))
    return jnp.exp(-per(draft_logp, target_logp, labels))


def _bv_expectation(tables, g):
    """E_{x ~ p}[sum_k E_k(x)]: the loss's per-block quantity averaged over target data paths."""
    paths, prob, d_rows, t_rows = _paths(tables, g)
    keep = prob > 0
    with jax.enable_x64(True):
        vals = _bv_block_values(jnp.asarray(d_rows[keep]), jnp.asarray(t_rows[keep]), jnp.asarray(paths[keep]))
    return float(np.sum(prob[keep] * np.asarray(vals)))


def test_bv_concrete_case():
    """g = 3, the same p (target) and q (drafter) at every position: block verification accepts 2.522506
    drafts per round (its enumeration), the loss integrates to the same; the former formula gave 2.685373."""
    tables = exact.constant_tables(P_BV, Q_BV, depth=4)
    rule = exact.expected_accepted(exact.chain_outputs(block_chain_from_coins, tables, 3))
    np.testing.assert_allclose(rule, 2.522506, atol=5e-7)
    np.testing.assert_allclose(_bv_expectation(tables, 3), rule, rtol=1e-6)
    assert abs(rule - 2.685373) > 0.1
    # Per path (section 10): x = (0, 0, 0) gives terms 0.913837, 0.743236, 0.604484 (loss -0.816053);
    # x = (2, 0, 1) gives 0.913837, 1, 1.
    lp, lq = jnp.log(jnp.asarray(P_BV, jnp.float32)), jnp.log(jnp.asarray(Q_BV, jnp.float32))
    rows_p, rows_q = jnp.broadcast_to(lp, (2, 3, 3)), jnp.broadcast_to(lq, (2, 3, 3))
    e, _ = losses.bv_terms(rows_q, rows_p, jnp.array([[0, 0, 0], [2, 0, 1]]))
    np.testing.assert_allclose(e, [[0.913837, 0.743236, 0.604484], [0.913837, 1, 1]], atol=2e-6)
    np.testing.assert_allclose(losses.bv_loss(rows_q[:1], rows_p[:1], jnp.zeros((1, 3), jnp.int32), jnp.ones((1, 3))),
                               -0.816053, atol=2e-6)


@pytest.mark.parametrize("g", [1, 2, 3])
@pytest.mark.parametrize("family", ["dirichlet", "sparse", "near", "served"])
def test_bv_integrates_to_block_verification_acceptance(g, family):
    """Context-dependent random tables (seeded): E_{x ~ p}[exp(-bv_loss(x))] = E[accepted drafts] of block
    verification, integrated exactly over drafts and coins from the rule (not from the loss's formula)."""
    rng = np.random.default_rng([g, ["dirichlet", "sparse", "near", "served"].index(family)])
    for _ in range(2):
        tables = exact.random_tables(rng, 3, g + 1, family)
        rule = exact.expected_accepted(exact.chain_outputs(block_chain_from_coins, tables, g))
        np.testing.assert_allclose(_bv_expectation(tables, g), rule, rtol=2e-6, atol=1e-6)


def test_bv_gradient_is_the_gradient_of_block_verification_acceptance():
    """d/d(drafter logits) of E_{x ~ p}[exp(-bv_loss(x))] (autodiff through r, m and the rows) against
    central differences of the rule's enumerated E[accepted] (float32 tables: eps 1e-3, atol 5e-4)."""
    g, vocab = 2, 3
    rng = np.random.default_rng(7)
    base = exact.random_tables(rng, vocab, g + 1, "dirichlet")
    theta = [rng.normal(size=(vocab ** k, vocab)) for k in range(g + 1)]  # drafter logits per level

    def tables_of(th):
        logq = tuple(np.asarray(_logsoftmax(t), np.float32) for t in th)
        return exact.Tables(base.logp, logq)

    def rule_value(th):
        return exact.expected_accepted(exact.chain_outputs(block_chain_from_coins, tables_of(th), g))

    paths, prob, _, t_rows = _paths(base, g)
    codes = [np.array([exact.code(x[:k], vocab) for x in paths]) for k in range(g)]

    def loss_value(th):
        d_rows = jnp.stack([jax.nn.log_softmax(th[k])[codes[k]] for k in range(g)], 1)
        return jnp.sum(jnp.asarray(prob) * _bv_block_values(d_rows, jnp.asarray(t_rows), jnp.asarray(paths)))

    with jax.enable_x64(True):
        value, grad = jax.value_and_grad(loss_value)([jnp.asarray(t) for t in theta])
    np.testing.assert_allclose(float(value), rule_value(theta), rtol=1e-6)
    eps = 1e-3
    for k in range(g):  # the last level never drafts
        for idx in np.ndindex(theta[k].shape):
            hi = [t.copy() for t in theta]
            lo = [t.copy() for t in theta]
            hi[k][idx] += eps
            lo[k][idx] -= eps
            num = (rule_value(hi) - rule_value(lo)) / (2 * eps)
            np.testing.assert_allclose(float(grad[k][idx]), num, atol=5e-4)


def test_bv_value_and_gradient_with_masks():
    """The batch mean of -log sum_k alive_k E_k over blocks with a counted position (a masked position
    ends its block, an empty block is left out), against numpy on the same E_k; its gradient against
    central differences of the loss itself (float64)."""
    d, t, labels, _ = _case(5)
    mask = np.array([[1, 1, 0], [0, 0, 0]], np.float64)
    d = np.concatenate([d, d[:1] + 0.3])
    t = np.concatenate([t, t[:1]])
    labels = np.concatenate([labels, labels[:1]])
    mask = np.concatenate([mask, [[1, 1, 1]]])

    @jax.jit
    def loss(x):
        return losses.bv_loss(jax.nn.log_softmax(x), jax.nn.log_softmax(jnp.asarray(t)), jnp.asarray(labels),
                              jnp.asarray(mask))

    with jax.enable_x64(True):
        value, grad = jax.value_and_grad(loss)(jnp.asarray(d))
        e, _ = losses.bv_terms(jax.nn.log_softmax(jnp.asarray(d)), jax.nn.log_softmax(jnp.asarray(t)),
                               jnp.asarray(labels))
        e = np.asarray(e)
        want = -(np.log(e[0, :2].sum()) + np.log(e[2].sum())) / 2
        np.testing.assert_allclose(float(value), want, rtol=1e-12)
        eps, num = 1e-6, np.zeros_like(d)
        for idx in np.ndindex(d.shape):
            hi, lo = d.copy(), d.copy()
            hi[idx] += eps
            lo[idx] -= eps
            num[idx] = (float(loss(jnp.asarray(hi))) - float(loss(jnp.asarray(lo)))) / (2 * eps)
    np.testing.assert_allclose(np.asarray(grad), num, atol=1e-7)
    assert np.all(np.asarray(grad)[1] == 0)  # the empty block does not count


# --- D-PACE and Draft-OPD ---------------------------------------------------------------------------


def _np_dpace(d, t, labels, mask, weights=None):
    """D-PACE by loops: w_k = (1 / alpha_k) sum_{j >= k} prod_{i <= j} alpha_i over the counted prefix."""
    ld, lt = _logsoftmax(d), _logsoftmax(t)
    alpha = np.minimum(np.exp(ld), np.exp(lt)).sum(-1)
    if weights is None:
        weights = np.zeros_like(alpha)
        for b in range(alpha.shape[0]):
            n = int(np.cumprod(mask[b]).sum())
            for k in range(n):
                weights[b, k] = sum(np.prod(alpha[b, :j + 1]) for j in range(k, n)) / alpha[b, k]
    nll = -np.take_along_axis(ld, labels[..., None], -1)[..., 0]
    return (weights * nll).sum() / weights.sum(), weights


def test_dpace_value_and_gradient():
    """Value against loops; gradient against central differences with the position weights held constant
    (they are a stop-gradient); early slots and slots behind confident prefixes weigh most."""
    d, t, labels, mask = _case(3)
    with jax.enable_x64(True):
        value, grad = jax.value_and_grad(lambda x: losses.dpace_loss(
            jax.nn.log_softmax(x), jax.nn.log_softmax(jnp.asarray(t)), jnp.asarray(labels), jnp.asarray(mask)))(
            jnp.asarray(d))
    want, w = _np_dpace(d, t, labels, mask)
    np.testing.assert_allclose(float(value), want, rtol=1e-9)
    assert np.all(w[:, 0] >= w[:, 1]) and w[1, 2] == 0
    eps, num = 1e-6, np.zeros_like(d)
    for idx in np.ndindex(d.shape):
        hi, lo = d.copy(), d.copy()
        hi[idx] += eps
        lo[idx] -= eps
        num[idx] = (_np_dpace(hi, t, labels, mask, w)[0] - _np_dpace(lo, t, labels, mask, w)[0]) / (2 * eps)
    np.testing.assert_allclose(np.asarray(grad), num, atol=1e-6)


def _np_opd(ld, lt_rows, y, n_tok, g):
    """Draft-OPD on one rollout y [N] of n_tok tokens by loops: blocks at every anchor a, slot k (1-based)
    drafting y_{a+k} with row ld[a, k-1]; lt_rows[j] the target's row of y_j. Weight of (a, k): the
    occupancy o_a times s_{a,k-1} = prod_{i<k} min(1, q/p) (speculative), for a + k <= n_tok - 1."""
    n = len(y)
    s = np.ones((n, g + 1))
    for a in range(n):
        for k in range(1, g + 1):
            j = min(a + k, n - 1)
            rho = np.exp(ld[a, k - 1, y[j]] - lt_rows[j, y[j]])
            s[a, k] = s[a, k - 1] * min(1.0, rho)
    o, incoming = np.zeros(n), np.zeros(n + g + 2)
    for a in range(n):
        if a <= n_tok - 2:
            o[a] = incoming[a] + (a == 0)
            for m in range(g + 1):
                incoming[a + 1 + m] += o[a] * (s[a, m] - (s[a, m + 1] if m < g else 0.0))
    num = den = 0.0
    for a in range(n):
        for k in range(1, g + 1):
            if a + k <= n_tok - 1:
                j = a + k
                kl = (np.exp(lt_rows[j]) * (lt_rows[j] - ld[a, k - 1])).sum()
                num += o[a] * s[a, k - 1] * kl
                den += o[a] * s[a, k - 1]
    return num, den


def test_opd_weights_slots_by_where_rounds_verify():
    """Draft-OPD on blocks anchored along rollouts equals the loop reference: KL per slot weighted by the
    probability that a round starts at the anchor and reaches the slot."""
    from jspec.train import drafter as train_drafter

    rng = np.random.default_rng(5)
    b, n, g, v = 2, 7, 3, 4
    y = rng.integers(0, v, size=(b, n))
    lens = np.array([7, 5])
    lt_rows = _logsoftmax(rng.normal(size=(b, n, v)))
    ld = _logsoftmax(1.5 * rng.normal(size=(b, n, g, v)))
    tokens = np.concatenate([np.zeros((b, 1), int), y], axis=1)  # a prompt token, then the rollout
    loss_mask = np.concatenate([np.zeros((b, 1)), np.arange(n)[None] < lens[:, None]], axis=1)
    target_logp = np.concatenate([lt_rows, lt_rows[:, :1]], axis=1)  # row i: the token at i + 1
    anchors, valid = train_drafter.window_anchors(jax.random.key(0), jnp.asarray(loss_mask), n)
    labels, mask, p_t = train_drafter.block_targets(g, jnp.asarray(tokens), jnp.asarray(loss_mask),
                                                    jnp.asarray(target_logp, jnp.float32), anchors, valid)
    got = losses.opd_loss(jnp.asarray(ld, jnp.float32), p_t, labels, mask)
    parts = [_np_opd(ld[i], lt_rows[i], y[i], lens[i], g) for i in range(b)]
    np.testing.assert_allclose(float(got), sum(p[0] for p in parts) / sum(p[1] for p in parts), rtol=1e-5)
