"""Drafter training losses, each a pure function of per-position draft and target log-probabilities.

Shapes: draft_logp, target_logp [..., g, V] (log-probabilities; the target's is a constant), labels
[..., g] int32 (the data tokens the drafter should produce, e.g. self-distilled target text), mask
[..., g] (1 where the position counts). Position k (0-based within the block) is weighted
w_k = exp(-k / gamma), normalised over the counted positions. Every loss returns a scalar.

alpha_k = sum_x min(p_d(x), p_t(x)) = 1 - TV_k is the probability that speculative sampling accepts
the drafter's token at position k given that the earlier ones were accepted.

`edr_rounds` / `edr_loss` read whole target rollouts instead of blocks (the drafter anchored at every
rollout token: [B, N, g, V]); LOSSES holds their window forms ("edr", "edr_block", and "opd", which
weights by the occupancy), which a recipe feeds blocks anchored at consecutive positions
(`jspec.train.drafter.anchors_for`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def position_weights(g: int, gamma: float) -> jax.Array:
    """w_k = exp(-k / gamma), k = 0..g-1 (DFlash: gamma 7 for B 16, 5 for B 10, 4 for B 8)."""
    return jnp.exp(-jnp.arange(g, dtype=jnp.float32) / gamma)


def weighted_mean(per_pos: jax.Array, mask: jax.Array, gamma: float) -> jax.Array:
    w = position_weights(per_pos.shape[-1], gamma) * mask
    return jnp.sum(per_pos * w) / jnp.maximum(jnp.sum(w), 1e-9)


def tv_distance(draft_logp, target_logp) -> jax.Array:
    """[..., g] total variation 0.5 sum |p_d - p_t|."""
    return 0.5 * jnp.sum(jnp.abs(jnp.exp(draft_logp) - jnp.exp(target_logp)), axis=-1)


def acceptance(draft_logp, target_logp) -> jax.Array:
    """[..., g] alpha = sum_x min(p_d, p_t)."""
    return jnp.sum(jnp.minimum(jnp.exp(draft_logp), jnp.exp(target_logp)), axis=-1)


def forward_kl(draft_logp, target_logp) -> jax.Array:
    """[..., g] KL(p_t || p_d); terms with p_t = 0 contribute 0."""
    pt = jnp.exp(target_logp)
    return jnp.sum(jnp.where(pt > 0, pt * (target_logp - draft_logp), 0.0), axis=-1)


def ce_loss(draft_logp, target_logp, labels, mask, gamma=7.0):
    nll = -jnp.take_along_axis(draft_logp, labels[..., None], axis=-1)[..., 0]
    return weighted_mean(nll, mask, gamma)


def kl_loss(draft_logp, target_logp, labels, mask, gamma=7.0):
    return weighted_mean(forward_kl(draft_logp, target_logp), mask, gamma)


def tv_loss(draft_logp, target_logp, labels, mask, gamma=7.0):
    return weighted_mean(tv_distance(draft_logp, target_logp), mask, gamma)


def lk_hybrid_loss(draft_logp, target_logp, labels, mask, gamma=7.0, eta=3.0):
    """lambda_k KL + (1 - lambda_k) TV per position k with lambda_k = exp(-eta stopgrad(mean alpha_k)), the
    mean over the batch (every leading axis) of alpha at position k, counted where mask > 0 (lambda_k = 1
    at a position nothing counts at; its weight is 0 anyway). One lambda per position, shared by the
    batch and not differentiated: KL while the drafter is poor at k (alpha -> 0 gives lambda = 1), moving
    toward TV, the acceptance objective, as its acceptance there grows."""
    alpha = jax.lax.stop_gradient(acceptance(draft_logp, target_logp))
    m = mask.reshape(-1, mask.shape[-1])
    mean_alpha = jnp.sum(alpha.reshape(m.shape) * m, axis=0) / jnp.maximum(jnp.sum(m, axis=0), 1e-9)  # [g]
    lam = jnp.exp(-eta * mean_alpha)
    per = lam * forward_kl(draft_logp, target_logp) + (1 - lam) * tv_distance(draft_logp, target_logp)
    return weighted_mean(per, mask, gamma)


def lk_likelihood_loss(draft_logp, target_logp, labels, mask, gamma=7.0):
    """-log alpha per position."""
    return weighted_mean(-jnp.log(jnp.maximum(acceptance(draft_logp, target_logp), 1e-9)), mask, gamma)


def e2e_tv_loss(draft_logp, target_logp, labels, mask, gamma=None):
    """-sum_k prod_{i<=k} (1 - TV_i): minus the expected number of accepted drafts of the block (a
    masked position ends the block)."""
    alive = jnp.cumprod(mask * (1 - tv_distance(draft_logp, target_logp)), axis=-1)
    return -jnp.mean(jnp.sum(alive, axis=-1))


def _log_ratio(num, den):
    """log(num / den) of log-probabilities: num = 0 -> -inf, den = 0 < num -> +inf (never NaN)."""
    safe = jnp.where(jnp.isneginf(den), 0.0, den)
    ratio = jnp.where(jnp.isneginf(den), jnp.inf, num - safe)
    return jnp.where(jnp.isneginf(num), -jnp.inf, ratio)


def bv_terms(draft_logp, target_logp, labels):
    """Block verification along the data path x = labels, with p = the target (target_logp) and q = the
    drafter (draft_logp) at each position of the block, both at the data prefix:
      r_k = prod_{i<=k} q_i(x_i) / p_i(x_i),  m_k = min(1, r_1, ..., r_k),  r_0 = m_0 = 1,
      E_k = sum_x min(m_{k-1} p_k(x), r_{k-1} q_k(x))   (the k-th token integrated over the vocabulary).
    Returns (E [..., g], log m [..., g] (m_1..m_g)). In log space (r over- and underflows); gradients flow
    through r and m as well as through the rows.

    Why: block verification accepts a prefix z of length k with probability
    P(n >= k, drafts = z) = min_{j<=k} q(z_<=j) p(z_>j | z_<=j), which is p(z) m_k(z); summing the last
    token out, E_{x ~ p}[E_k] = P(n >= k) (m_k itself is P(n >= k | the text starts with z))."""
    lq = jnp.take_along_axis(draft_logp, labels[..., None], -1)[..., 0]
    lp = jnp.take_along_axis(target_logp, labels[..., None], -1)[..., 0]
    log_r = jnp.cumsum(_log_ratio(lq, lp), axis=-1)
    log_m = jnp.minimum(jax.lax.cummin(log_r, axis=log_r.ndim - 1), 0.0)
    zero = jnp.zeros_like(log_r[..., :1])
    log_r_prev = jnp.concatenate([zero, log_r[..., :-1]], axis=-1)
    log_m_prev = jnp.concatenate([zero, log_m[..., :-1]], axis=-1)
    b = log_r_prev[..., None] + draft_logp  # NaN only for r = inf (p(x_i) = 0) and q(x) = 0: take 0
    e = jnp.sum(jnp.exp(jnp.minimum(log_m_prev[..., None] + target_logp, jnp.where(jnp.isnan(b), -jnp.inf, b))), -1)
    return e, log_m


def bv_loss(draft_logp, target_logp, labels, mask, gamma=None):
    """Block-verification loss: the mean over blocks of -log sum_k E_k (`bv_terms`; p = target_logp, the
    target, q = draft_logp, the drafter, x = labels the data path; a masked position ends the block).

    sum_k E_k is the expected number of drafts block verification accepts in a round whose first tokens
    are the data prefix, with the last token of each prefix integrated out: for data drawn from the
    target (x ~ p, e.g. self-distilled text sampled at the served temperature), E_x[sum_k E_k] =
    E[accepted drafts of a block-verification round] exactly. The loss is -log of that per-block
    estimate, an upper bound (Jensen) of -log E[accepted]; its minimum is at q = p. For one token
    it is -log alpha. Blocks with no counted position (mask[..., 0] = 0) are left out of the mean."""
    e, _ = bv_terms(draft_logp, target_logp, labels)
    alive = jnp.cumprod(mask, axis=-1)
    total = jnp.sum(alive * e, axis=-1)
    valid = mask[..., 0] > 0
    per = -jnp.log(jnp.maximum(jnp.where(valid, total, 1.0), 1e-30))
    return jnp.sum(jnp.where(valid, per, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def edr_rounds(draft_logp, target_logp, tokens, mask, rule="speculative", parts=False):
    """Expected rounds [B] of chain speculative decoding along target rollouts (EDR, DRAFTERS2.md section 10),
    one value per rollout whose mean over rollouts drawn from the target is E[rounds] exactly.

    tokens [B, N]: a rollout's new tokens y_0 .. y_{N-1} (y_0 the first anchor), mask [B, N] 1 on the
    rollout (a prefix of n_b tokens); target_logp [B, N, V]: row j = the target's p_j, the distribution of
    y_j after prompt + y_<j (row 0 unused); draft_logp [B, N, g, V]: row a, slot k - 1 = the drafter's q
    for y_{a+k} in the round anchored at y_a (teacher-forced on the rollout). rule: "speculative" or
    "block" (the verification rule whose rounds are counted).

    A round anchored at a accepts n drafts and the next one is anchored at a + n + 1; rounds are anchored
    at a <= n_b - 2. Given the rollout, P(n >= k) is s_k = prod_{i<=k} min(1, rho_i) (speculative) or
    min(1, r_1..r_k) (block), rho_i = q_{a,i}(y_{a+i}) / p_{a+i}(y_{a+i}), r_k = prod rho (exact: see
    jspec.train.evaluate), and o_a = P(a round is anchored at a) follows o_0 = 1,
    o_b = sum_{a<b} o_a P(n = b - a - 1 | a) (the occupancy). The value is
      R = 1 + sum_a o_a [sum_{k<=g} c_{a,k} [a + k <= n_b - 2] + s_{a,g} [a + g + 1 <= n_b - 2]],
    round ends at slot k, c_{a,k} = the expectation over y_{a+k} ~ p of P(end at k | rollout):
      speculative: s_{k-1} TV(p_{a+k}, q_{a,k}),  block: m_{k-1} - E_k (`bv_terms`),
    plus the forced end after g acceptances (the block cap). Replacing the posterior end probability by its
    expectation over the next token keeps E_rollouts[R] = E[rounds] (o_a and s_{k-1} depend on the rollout
    before the token only), so R and its gradient (through o, s and c) are unbiased.
    parts: also return the occupancy o [B, N] and the survivals s [B, N, g + 1] (s_0 = 1)."""
    b, n, g, _ = draft_logp.shape
    n_tok = jnp.sum(mask, axis=-1).astype(jnp.int32)  # [B]
    a = jnp.arange(n)[:, None]
    label_pos = jnp.minimum(a + 1 + jnp.arange(g)[None], n - 1)  # [N, g]: index j = a + k of slot k's token
    labels = tokens[:, label_pos]  # [B, N, g]
    p_rows = target_logp[:, label_pos]  # [B, N, g, V]
    lq = jnp.take_along_axis(draft_logp, labels[..., None], -1)[..., 0]
    lp = jnp.take_along_axis(p_rows, labels[..., None], -1)[..., 0]
    log_rho = _log_ratio(lq, lp)
    if rule == "speculative":
        log_s = jnp.cumsum(jnp.minimum(log_rho, 0.0), axis=-1)
    elif rule == "block":
        e_terms, log_s = bv_terms(draft_logp, p_rows, labels)
    else:
        raise ValueError(f"edr rule must be 'speculative' or 'block', got {rule!r}")
    s = jnp.exp(jnp.concatenate([jnp.zeros_like(log_s[..., :1]), log_s], axis=-1))  # [B, N, g + 1], s_0 = 1
    lengths = s - jnp.concatenate([s[..., 1:], jnp.zeros_like(s[..., :1])], axis=-1)  # P(n = k), k = 0..g
    if rule == "speculative":
        ends = s[..., :-1] * tv_distance(draft_logp, p_rows)
    else:
        ends = s[..., :-1] - e_terms
    ends = jnp.concatenate([ends, s[..., -1:]], axis=-1)  # [B, N, g + 1]: ends at slot k = 1..g + 1
    live = jnp.arange(n)[None] <= n_tok[:, None] - 2  # [B, N] anchors that start a round
    reach = (jnp.arange(n)[:, None] + 1 + jnp.arange(g + 1)[None])[None] <= n_tok[:, None, None] - 2

    def step(incoming, a):
        o_a = jnp.where(live[:, a], incoming[:, a] + (a == 0), 0.0)
        add = o_a[:, None] * lengths[:, a]
        incoming = jax.lax.dynamic_update_slice_in_dim(
            incoming, jax.lax.dynamic_slice_in_dim(incoming, a + 1, g + 1, axis=1) + add, a + 1, axis=1)
        return incoming, o_a

    _, o = jax.lax.scan(step, jnp.zeros((b, n + g + 2), s.dtype), jnp.arange(n))
    o = jnp.moveaxis(o, 0, 1)  # [B, N]
    rounds = (n_tok >= 2) + jnp.sum(o[..., None] * ends * reach, axis=(-2, -1))
    return (rounds, o, s) if parts else rounds


def edr_loss(draft_logp, target_logp, tokens, mask, rule="speculative"):
    """EDR loss: expected rounds per committed token, pooled, sum_b R_b / sum_b (n_b - 1) (`edr_rounds`);
    1 / tau of the rollouts in expectation. Not in LOSSES: it reads whole rollouts [B, N] with the drafter
    anchored at every token, not blocks."""
    committed = jnp.sum(jnp.maximum(jnp.sum(mask, axis=-1) - 1, 0))
    return jnp.sum(edr_rounds(draft_logp, target_logp, tokens, mask, rule)) / jnp.maximum(committed, 1)


def confidence_bce(draft_logp, target_logp, confidence):
    """Per-position BCE of a confidence head against the slot's acceptance 1 - TV (detached) [..., g]."""
    goal = jax.lax.stop_gradient(1 - tv_distance(draft_logp, target_logp))
    c = jnp.clip(confidence, 1e-6, 1 - 1e-6)
    return -(goal * jnp.log(c) + (1 - goal) * jnp.log(1 - c))


def dspark_loss(draft_logp, target_logp, labels, mask, confidence, gamma=4.0):
    """0.1 CE + 0.9 L1 (sum |p_d - p_t|, not halved) + 1.0 BCE(confidence, 1 - TV detached); confidence None:
    a drafter without a confidence head (no BCE term)."""
    nll = -jnp.take_along_axis(draft_logp, labels[..., None], axis=-1)[..., 0]
    l1 = 2 * tv_distance(draft_logp, target_logp)
    bce = 0.0 if confidence is None else confidence_bce(draft_logp, target_logp, confidence)
    return weighted_mean(0.1 * nll + 0.9 * l1 + bce, mask, gamma)


def domino_curriculum(ce_final, ce_base, progress, fraction: float = 1.0):
    """(1 - lam) CE_final + lam CE_base, lam falling linearly from 1 to 0 over `fraction` of training
    (progress in [0, 1])."""
    lam = jnp.clip(1.0 - progress / fraction, 0.0, 1.0)
    return (1 - lam) * ce_final + lam * ce_base


def window_rollout(target_logp, labels, mask):
    """The rollout form `edr_rounds` reads, from the block tensors of anchors at consecutive positions
    a_0, a_0 + 1, .. (a window of a rollout, y_j the token at a_0 + j): slot 0 of block j labels y_{j+1}
    with the target's row for it, so tokens [B, A] (y_0 is never read), target rows [B, A, V] (row 0
    unused) and the rollout mask [B, A] (1 while y_j lies on the rollout)."""
    first = labels[:, :, 0]
    tokens = jnp.concatenate([jnp.zeros_like(first[:, :1]), first[:, :-1]], axis=1)
    rows = target_logp[:, :, 0]
    rows = jnp.concatenate([rows[:, :1], rows[:, :-1]], axis=1)
    live = mask[:, :, 0]
    return tokens, rows, jnp.concatenate([live[:, :1], live[:, :-1]], axis=1)


def edr_window_loss(draft_logp, target_logp, labels, mask, rule="speculative"):
    """EDR (`edr_loss`) on a window of a rollout with the drafter anchored at every position of it: the
    block tensors of consecutive anchors (`window_rollout`); what the run config's "edr" / "edr_block"
    losses train (the recipe then anchors blocks at consecutive positions: `drafter.anchors_for`)."""
    tokens, rows, live = window_rollout(target_logp, labels, mask)
    return edr_loss(draft_logp, rows, tokens, live, rule)


def dpace_loss(draft_logp, target_logp, labels, mask, gamma=None):
    """D-PACE (Wu et al. 2026; published form not located, DRAFTERS2.md section 10): cross-entropy with
    position weights from a differentiable tau surrogate. With alpha_k the acceptance of slot k (1 - TV
    against the target's row; the published surrogate reads "the drafter's confidences") and
    tau = sum_j prod_{i<=j} alpha_i the expected accepted drafts of a chain, slot k is weighted by
    w_k = sg(d tau / d alpha_k) = sg((1 / alpha_k) sum_{j>=k} prod_{i<=j} alpha_i): the slots whose
    improvement lengthens rounds most (early ones, and those behind confident prefixes) weigh most.
    Normalised by the summed weights of the counted slots; gamma is not used."""
    alive = jnp.cumprod(mask, axis=-1)
    alpha = jax.lax.stop_gradient(acceptance(draft_logp, target_logp))
    surv = jnp.cumprod(jnp.where(alive > 0, alpha, 0.0), axis=-1)  # prod_{i<=j} alpha_i
    tail = jnp.flip(jnp.cumsum(jnp.flip(surv, -1), -1), -1)  # sum_{j>=k}
    w = jax.lax.stop_gradient(tail / jnp.maximum(alpha, 1e-6)) * alive
    nll = -jnp.take_along_axis(draft_logp, labels[..., None], axis=-1)[..., 0]
    return jnp.sum(w * nll) / jnp.maximum(jnp.sum(w), 1e-9)


def opd_loss(draft_logp, target_logp, labels, mask, rule="speculative"):
    """Draft-OPD (Lei et al. 2026; published form not located, DRAFTERS2.md section 10): distillation
    weighted where verification actually happens. On a rollout window with the drafter anchored at every
    position (`window_rollout`), slot k of the block at a is verified with probability o_a s_{a,k-1}:
    a round starts at a (the occupancy of `edr_rounds`) and its first k - 1 drafts are accepted. The loss
    is KL(p || q) per slot under those weights (held constant), normalised by their sum: on-policy in the
    anchors and depths the drafter's own rounds reach. The published method also replays the drafter's
    proposals (drafts off the data path); this form keeps the data path."""
    tokens, rows, live = window_rollout(target_logp, labels, mask)
    _, o, s = edr_rounds(draft_logp, rows, tokens, live, rule, parts=True)
    w = jax.lax.stop_gradient(o[..., None] * s[..., :-1]) * jnp.cumprod(mask, axis=-1)
    return jnp.sum(w * forward_kl(draft_logp, target_logp)) / jnp.maximum(jnp.sum(w), 1e-9)


LOSSES = {
    "ce": ce_loss, "kl": kl_loss, "tv": tv_loss, "lk_hybrid": lk_hybrid_loss, "lk_likelihood": lk_likelihood_loss,
    "e2e_tv": e2e_tv_loss, "bv": bv_loss, "edr": edr_window_loss, "dpace": dpace_loss, "opd": opd_loss,
    "edr_block": lambda draft_logp, target_logp, labels, mask: edr_window_loss(draft_logp, target_logp, labels,
                                                                              mask, "block"),
}
WINDOW_LOSSES = ("edr", "edr_block", "opd")  # losses over every anchor of a rollout window, not sampled anchors
