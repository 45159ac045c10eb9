"""Drafter training losses, each a pure function of per-position draft and target log-probabilities.

Shapes: draft_logp, target_logp [..., g, V] (log-probabilities; the target's is a constant), labels
[..., g] int32 (the data tokens the drafter should produce, e.g. self-distilled target text), mask
[..., g] (1 where the position counts). Position k (0-based within the block) is weighted
w_k = exp(-k / gamma), normalised over the counted positions. Every loss returns a scalar.

alpha_k = sum_x min(p_d(x), p_t(x)) = 1 - TV_k is the probability that speculative sampling accepts
the drafter's token at position k given that the earlier ones were accepted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def position_weights(g: int, gamma: float) -> jax.Array:
    """w_k = exp(-k / gamma), k = 0..g-1 (DFlash: gamma 7 for B 16, 5 for B 10, 4 for B 8)."""
    return jnp.exp(-jnp.arange(g, dtype=jnp.float32) / gamma)


def _weighted_mean(per_pos: jax.Array, mask: jax.Array, gamma: float) -> jax.Array:
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
    return _weighted_mean(nll, mask, gamma)


def kl_loss(draft_logp, target_logp, labels, mask, gamma=7.0):
    return _weighted_mean(forward_kl(draft_logp, target_logp), mask, gamma)


def tv_loss(draft_logp, target_logp, labels, mask, gamma=7.0):
    return _weighted_mean(tv_distance(draft_logp, target_logp), mask, gamma)


def lk_hybrid_loss(draft_logp, target_logp, labels, mask, gamma=7.0, eta=3.0):
    """lambda KL + (1 - lambda) TV with lambda = exp(-eta stopgrad(alpha)): KL where the drafter is
    poor (alpha -> 0 gives lambda = 1), moving toward TV, the acceptance objective, as alpha grows."""
    alpha = jax.lax.stop_gradient(acceptance(draft_logp, target_logp))
    lam = jnp.exp(-eta * alpha)
    per = lam * forward_kl(draft_logp, target_logp) + (1 - lam) * tv_distance(draft_logp, target_logp)
    return _weighted_mean(per, mask, gamma)


def lk_likelihood_loss(draft_logp, target_logp, labels, mask, gamma=7.0):
    """-log alpha per position."""
    return _weighted_mean(-jnp.log(jnp.maximum(acceptance(draft_logp, target_logp), 1e-9)), mask, gamma)


def e2e_tv_loss(draft_logp, target_logp, labels, mask, gamma=None):
    """-sum_k prod_{i<=k} (1 - TV_i): minus the expected number of accepted drafts of the block (a
    masked position ends the block)."""
    alive = jnp.cumprod(mask * (1 - tv_distance(draft_logp, target_logp)), axis=-1)
    return -jnp.mean(jnp.sum(alive, axis=-1))


def bv_loss(draft_logp, target_logp, labels, mask, gamma=None):
    """-log sum_k E_k for block verification along the data path x = labels: with r_i = p_t(x_i) /
    p_d(x_i) and block verification's running weight w_k = min(1, w_{k-1} r_k) (w_0 = 1),
    E_k = sum_x min(w_{k-1} p_d_k(x), p_t_k(x)) (the last token integrated over the vocabulary).
    For one token this is -log alpha."""
    pd, pt = jnp.exp(draft_logp), jnp.exp(target_logp)
    lr = (jnp.take_along_axis(target_logp, labels[..., None], -1) - jnp.take_along_axis(draft_logp, labels[..., None], -1))[..., 0]

    def step(log_w, lr_k):
        log_w = jnp.minimum(log_w + lr_k, 0.0)
        return log_w, log_w

    _, log_w = jax.lax.scan(step, jnp.zeros(lr.shape[:-1], lr.dtype), jnp.moveaxis(lr, -1, 0))
    log_w = jnp.moveaxis(log_w, 0, -1)
    w_prev = jnp.exp(jnp.concatenate([jnp.zeros_like(log_w[..., :1]), log_w[..., :-1]], axis=-1))
    e = jnp.sum(jnp.minimum(w_prev[..., None] * pd, pt), axis=-1)
    alive = jnp.cumprod(mask, axis=-1)
    return -jnp.mean(jnp.log(jnp.maximum(jnp.sum(alive * e, axis=-1), 1e-9)))


def dspark_loss(draft_logp, target_logp, labels, mask, confidence, gamma=4.0):
    """0.1 CE + 0.9 L1 (sum |p_d - p_t|, not halved) + 1.0 BCE(confidence, 1 - TV detached)."""
    nll = -jnp.take_along_axis(draft_logp, labels[..., None], axis=-1)[..., 0]
    l1 = 2 * tv_distance(draft_logp, target_logp)
    goal = jax.lax.stop_gradient(1 - tv_distance(draft_logp, target_logp))
    c = jnp.clip(confidence, 1e-6, 1 - 1e-6)
    bce = -(goal * jnp.log(c) + (1 - goal) * jnp.log(1 - c))
    return _weighted_mean(0.1 * nll + 0.9 * l1 + bce, mask, gamma)


def domino_curriculum(ce_final, ce_base, progress, fraction: float = 1.0):
    """(1 - lam) CE_final + lam CE_base, lam falling linearly from 1 to 0 over `fraction` of training
    (progress in [0, 1])."""
    lam = jnp.clip(1.0 - progress / fraction, 0.0, 1.0)
    return (1 - lam) * ce_final + lam * ce_base


LOSSES = {
    "ce": ce_loss, "kl": kl_loss, "tv": tv_loss, "lk_hybrid": lk_hybrid_loss, "lk_likelihood": lk_likelihood_loss,
    "e2e_tv": e2e_tv_loss, "bv": bv_loss,
}
