"""Drafter training pieces shared by the block drafters' recipes: online target features, many anchors
per sequence in one pass (DFlash, DSpark: `train_loss` in their family modules).

For a batch of token sequences [B, T] with a loss mask (1 on response tokens):
1. The frozen target runs over the sequences once, giving the tapped features (the drafter's
   context) and its next-token distributions p_t (the teacher for distribution-matching losses).
2. A anchors per sequence are drawn among positions a with mask[a] and mask[a + 1]; block a is
   [x_a, MASK x (W - 1)] at positions a .. a + W - 1.
3. All blocks run in one drafter pass (`dflash.draft_blocks`): block a sees context features
   strictly before a and itself only, so no block reads a token it must predict (no leakage).
4. Slot k of block a is labelled with the data token it drafts (x_{a+k}, or x_{a+k+1} when the anchor
   slot predicts); p_t at that label is the target's distribution of the same token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.models import target as tm
from jspec.train import losses


@dataclasses.dataclass(frozen=True)
class DrafterLoss:
    name: str = "ce"  # a key of losses.LOSSES, or the family's own objective (TrainRecipe.own_loss)
    num_anchors: int = 16
    gamma: float = 4.0  # position decay of the loss weights
    eta: float = 3.0  # LK hybrid


def sample_anchors(key: jax.Array, loss_mask: jax.Array, num_anchors: int) -> tuple[jax.Array, jax.Array]:
    """Distinct anchors [B, A] uniformly among positions a with mask[a] and mask[a+1]; valid [B, A]."""
    ok = (loss_mask[:, :-1] > 0) & (loss_mask[:, 1:] > 0)
    ok = jnp.pad(ok, ((0, 0), (0, 1)))
    scores = jnp.where(ok, jax.random.uniform(key, ok.shape), -1.0)
    top, idx = jax.lax.top_k(scores, num_anchors)
    return idx.astype(jnp.int32), top >= 0


def window_anchors(key: jax.Array, loss_mask: jax.Array, num_anchors: int) -> tuple[jax.Array, jax.Array]:
    """Anchors [B, A] at consecutive positions s_b .. s_b + A - 1 of each sequence's response (the loss
    mask's span), s_b uniform among the starts that keep the window inside it (the response's first
    position when it is shorter than A); valid [B, A]: the anchor lies on the response."""
    b, t = loss_mask.shape
    on = loss_mask > 0
    first = jnp.argmax(on, axis=1)
    end = t - jnp.argmax(on[:, ::-1], axis=1)  # one past the last response position
    last_start = jnp.maximum(first, end - num_anchors)
    start = first + jnp.floor(jax.random.uniform(key, (b,)) * (last_start - first + 1)).astype(first.dtype)
    anchors = start[:, None] + jnp.arange(num_anchors)[None]
    valid = (anchors < end[:, None]) & jnp.any(on, axis=1, keepdims=True)
    return jnp.minimum(anchors, t - 1).astype(jnp.int32), valid


def anchors_for(spec, key: jax.Array, loss_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The anchors a run's loss trains on: a window of consecutive ones for the rollout losses (EDR),
    distinct random ones otherwise (`sample_anchors`)."""
    if spec.name in losses.WINDOW_LOSSES:
        return window_anchors(key, loss_mask, spec.num_anchors)
    return sample_anchors(key, loss_mask, spec.num_anchors)


def target_pass(target_params, target_cfg, tokens: jax.Array, taps: tuple[int, ...]):
    """Frozen target (dense or hybrid) over [B, T]: (taps [n, B, T, H], next-token log-probs [B, T, V])."""
    b, t = tokens.shape
    hidden, _, tapped, _ = tm.forward(target_params, target_cfg, tokens, jnp.broadcast_to(jnp.arange(t), (b, t)),
                                      tm.init_cache(target_cfg, b, t, target_params["embed"].dtype), taps=taps,
                                      kv_chunk=None)
    logp = jax.nn.log_softmax(tm.logits(target_params, target_cfg, hidden), axis=-1)
    return jax.lax.stop_gradient(tapped), jax.lax.stop_gradient(logp)


def block_targets(g: int, tokens, loss_mask, target_logp, anchors, valid):
    """Labels [B, A, g] of g drafts per anchor, their mask, and the target's distributions of them
    [B, A, g, V]."""
    t = tokens.shape[1]
    label_pos = anchors[:, :, None] + 1 + jnp.arange(g)[None, None]  # draft i (either convention) is x_{a+1+i}
    inside = label_pos < t
    safe = jnp.minimum(label_pos, t - 1)
    rows = jnp.arange(tokens.shape[0])[:, None, None]
    labels = tokens[rows, safe]
    mask = inside & valid[:, :, None] & (loss_mask[rows, safe] > 0)
    # A block stops counting at its first masked label: later slots draft past the response.
    mask = jnp.cumprod(mask.astype(jnp.float32), axis=-1)
    p_t = target_logp[rows, jnp.maximum(safe - 1, 0)]  # distribution of token j is the output at j - 1
    return labels, mask, p_t


def distribution_loss(spec: DrafterLoss, draft_logp, p_t, labels, mask):
    """The run config's loss (a key of losses.LOSSES) of draft log-probs [..., g, V] against the labels and
    the target's distributions of them."""
    if spec.name not in losses.LOSSES:
        raise ValueError(f"unknown drafter loss {spec.name!r}: use one of {', '.join(losses.LOSSES)}")
    fn = losses.LOSSES[spec.name]
    if spec.name in ("e2e_tv", "bv", "dpace", *losses.WINDOW_LOSSES):
        return fn(draft_logp, p_t, labels, mask)
    kw = {"eta": spec.eta} if spec.name == "lk_hybrid" else {}
    return fn(draft_logp, p_t, labels, mask, spec.gamma, **kw)


def metrics(draft_logp, p_t, labels, mask):
    """acc: top-1 agreement with the labels; alpha: mean acceptance 1 - TV; tau_greedy: expected
    committed tokens per round of greedy verification along the data path (pooled)."""
    hit = (jnp.argmax(draft_logp, -1) == labels).astype(jnp.float32) * mask
    n = jnp.maximum(jnp.sum(mask), 1.0)
    tau = 1 + jnp.sum(jnp.cumprod(hit, axis=-1)) / jnp.maximum(jnp.sum(mask[..., 0]), 1.0)
    alpha = jnp.sum(losses.acceptance(draft_logp, p_t) * mask) / n
    return {"acc": jnp.sum(hit) / n, "alpha": alpha, "tau": tau}
