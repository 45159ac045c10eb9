"""Drafter training step (DFlash, DSpark): online target features, many anchors per sequence in one pass.

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

from jspec.drafters import dflash as dfl
from jspec.drafters import dspark as dsp
from jspec.models import transformer
from jspec.models.config import ModelConfig
from jspec.train import losses


@dataclasses.dataclass(frozen=True)
class DrafterLoss:
    name: str = "ce"  # a key of losses.LOSSES, or "dspark"
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


def target_pass(target_params, target_cfg: ModelConfig, tokens: jax.Array, taps: tuple[int, ...]):
    """Frozen target over [B, T]: (taps [n, B, T, H], next-token log-probs [B, T, V])."""
    b, t = tokens.shape
    out = transformer.forward(target_params, target_cfg, tokens, jnp.broadcast_to(jnp.arange(t), (b, t)),
                              transformer.KVCache.zeros(target_cfg, b, t, target_params["embed"].dtype), taps=taps,
                              kv_chunk=None)
    logp = jax.nn.log_softmax(transformer.logits(target_params, target_cfg, out.hidden), axis=-1)
    return jax.lax.stop_gradient(out.taps), jax.lax.stop_gradient(logp)


def block_targets(cfg: dfl.DFlashConfig, tokens, loss_mask, target_logp, anchors, valid):
    """Labels [B, A, g], their mask, and the target's distributions of them [B, A, g, V]."""
    t = tokens.shape[1]
    g = cfg.num_drafts
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


def drafter_forward(params, cfg: dfl.DFlashConfig, embed, taps, tokens, anchors):
    """Hidden states of the draft slots [B, A, g, H] for blocks at `anchors`."""
    b, t = tokens.shape
    ctx_k, ctx_v = dfl.context_kv(params, cfg, taps, jnp.broadcast_to(jnp.arange(t), (b, t)))
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)
    hidden = dfl.draft_blocks(params, cfg, embed, ctx_k, ctx_v, anchors, dfl.block_inputs(cfg, anchor_tok))
    return hidden if cfg.anchor_predicts else hidden[:, :, 1:]


def dflash_loss(params, target_params, target_cfg: ModelConfig, cfg: dfl.DFlashConfig, spec: DrafterLoss,
                batch: dict, key: jax.Array):
    """Scalar loss and metrics for a DFlash drafter. batch: tokens [B, T], loss_mask [B, T]."""
    tokens, loss_mask = batch["tokens"], batch["loss_mask"]
    taps, target_logp = target_pass(target_params, target_cfg, tokens, cfg.target_layer_ids)
    anchors, valid = sample_anchors(key, loss_mask, spec.num_anchors)
    labels, mask, p_t = block_targets(cfg, tokens, loss_mask, target_logp, anchors, valid)
    hidden = drafter_forward(params, cfg, target_params["embed"], taps, tokens, anchors)
    draft_logp = jax.nn.log_softmax(transformer.logits(target_params, target_cfg, hidden), axis=-1)
    fn = losses.LOSSES[spec.name]
    kw = {"eta": spec.eta} if spec.name == "lk_hybrid" else {}
    loss = fn(draft_logp, p_t, labels, mask, spec.gamma, **kw) if spec.name not in ("e2e_tv", "bv") else fn(
        draft_logp, p_t, labels, mask)
    return loss, _metrics(draft_logp, p_t, labels, mask)


def dspark_train_loss(params, target_params, target_cfg: ModelConfig, cfg: dsp.DSparkConfig, spec: DrafterLoss,
                      batch: dict, key: jax.Array):
    """DSpark: Markov head teacher-forced on the true previous token; 0.1 CE + 0.9 L1 + confidence BCE."""
    b_cfg = cfg.backbone
    tokens, loss_mask = batch["tokens"], batch["loss_mask"]
    taps, target_logp = target_pass(target_params, target_cfg, tokens, b_cfg.target_layer_ids)
    anchors, valid = sample_anchors(key, loss_mask, spec.num_anchors)
    labels, mask, p_t = block_targets(b_cfg, tokens, loss_mask, target_logp, anchors, valid)
    hidden = drafter_forward(params, b_cfg, params["embed"], taps, tokens, anchors)  # [B, A, g, H]
    logits = jnp.einsum("bagh,vh->bagv", hidden, params["lm_head"], preferred_element_type=jnp.float32)
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)
    prev = jnp.concatenate([anchor_tok[..., None], labels[..., :-1]], axis=-1)  # teacher forcing
    b, a, g, h = hidden.shape
    conf = jnp.ones((b, a, g), jnp.float32)
    if cfg.markov_rank:
        flat_h, flat_prev = hidden.reshape(b * a, g, h), prev.reshape(b * a, g)

        def slot(s, k):
            bias, e, s = dsp.markov_bias(params, cfg, flat_h[:, k], flat_prev[:, k], s)
            c = dsp.confidence(params, cfg, flat_h[:, k], e) if cfg.confidence_head else jnp.ones((b * a,))
            return s, (bias, c)

        _, (bias, c) = jax.lax.scan(slot, jnp.zeros((b * a, cfg.markov_rank)), jnp.arange(g))
        logits = logits + jnp.moveaxis(bias, 0, 1).reshape(b, a, g, -1)
        conf = jnp.moveaxis(c, 0, 1).reshape(b, a, g)
    elif cfg.confidence_head:
        conf = dsp.confidence(params, cfg, hidden, None)
    draft_logp = jax.nn.log_softmax(logits, axis=-1)
    loss = losses.dspark_loss(draft_logp, p_t, labels, mask, conf, spec.gamma)
    return loss, _metrics(draft_logp, p_t, labels, mask)


def _metrics(draft_logp, p_t, labels, mask):
    """acc: top-1 agreement with the labels; alpha: mean acceptance 1 - TV; tau_greedy: expected
    committed tokens per round of greedy verification along the data path (pooled)."""
    hit = (jnp.argmax(draft_logp, -1) == labels).astype(jnp.float32) * mask
    n = jnp.maximum(jnp.sum(mask), 1.0)
    tau = 1 + jnp.sum(jnp.cumprod(hit, axis=-1)) / jnp.maximum(jnp.sum(mask[..., 0]), 1.0)
    alpha = jnp.sum(losses.acceptance(draft_logp, p_t) * mask) / n
    return {"acc": jnp.sum(hit) / n, "alpha": alpha, "tau": tau}
