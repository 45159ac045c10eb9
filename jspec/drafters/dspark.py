"""DSpark: the DFlash backbone (anchor slot predicting) with a causal Markov head and a confidence head.

Markov head (rank r): the backbone's unary logits U_k at slot k are corrected with a bias that
depends on the token actually chosen at the previous slot (x_{-1} = the anchor), e = W1[x_{k-1}]:
  vanilla: bias = e W2
  gated:   bias = (sigmoid([h_k ; e] G) * e) W2                      (G = gate_proj, [H + r, r])
  rnn:     (g, c, o) = [h_k ; e ; s] J, s <- sigmoid(g) s + (1 - sigmoid(g)) tanh(c), bias = tanh(o) W2
           (J = joint_proj, [H + 2r, 3r], s_0 = 0; the input order [h ; e ; s] is this module's choice)
Slots are sampled left to right inside a `lax.scan`; the q reported for slot k is the served
distribution (temperature, top-k, top-p) of exactly the corrected logits it was drawn from.
h_k is the backbone's final-normed hidden state at slot k.

Confidence head: c_k = sigmoid([h_k ; e] w + b) (or [h_k] w + b without the Markov input) estimates
P(draft k accepted | drafts < k accepted). It reads x_{k-1}, never x_k, so a verify budget chosen
from it is non-anticipating (jspec.verify.budget) and keeps verification lossless.

With a tree budget, DDTree is built from the unary logits U: the Markov correction conditions on one
chosen predecessor, which a tree with several candidates per depth does not have.

The embedding and LM head are the drafter's own frozen copies of the target's (DeepSpec format).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafters import ddtree
from jspec.drafters.base import SAMPLE, DraftContext, Proposal, register
from jspec.drafters.dflash import DFlash, DFlashConfig, DFlashState, draft_block
from jspec.drafters.dflash import init_params as dflash_init_params
from jspec.drafters.dflash import param_shapes as dflash_param_shapes

MARKOV_TYPES = ("vanilla", "gated", "rnn")


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    backbone: DFlashConfig  # anchor_predicts must be True
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    confidence_with_markov: bool = True

    def __post_init__(self):
        if not self.backbone.anchor_predicts:
            raise ValueError("DSpark predicts from the anchor slot: build its backbone with anchor_predicts=True")
        if self.markov_rank and self.markov_head_type not in MARKOV_TYPES:
            raise ValueError(f"markov_head_type must be one of {MARKOV_TYPES}, got {self.markov_head_type!r}")


def param_shapes(cfg: DSparkConfig) -> dict:
    h, v, r = cfg.backbone.hidden_size, cfg.backbone.layers.vocab_size, cfg.markov_rank
    shapes = dflash_param_shapes(cfg.backbone)
    shapes.update(embed=(v, h), lm_head=(h, v))
    if r:
        markov = {"w1": (v, r), "w2": (r, v)}
        if cfg.markov_head_type == "gated":
            markov["gate_w"], markov["gate_b"] = (h + r, r), (r,)
        elif cfg.markov_head_type == "rnn":
            markov["joint_w"], markov["joint_b"] = (h + 2 * r, 3 * r), (3 * r,)
        shapes["markov"] = markov
    if cfg.confidence_head:
        shapes["confidence"] = {"w": (h + (r if cfg.confidence_with_markov and r else 0), 1), "b": (1,)}
    return shapes


def init_params(cfg: DSparkConfig, key: jax.Array, target_params: dict, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random backbone and heads; embedding and LM head copied from the target (frozen)."""
    k1, k2 = jax.random.split(key)
    params = dflash_init_params(cfg.backbone, k1, dtype, std)
    embed = target_params["embed"]
    params["embed"] = embed.astype(dtype)
    params["lm_head"] = target_params.get("lm_head", embed.T).astype(dtype)
    shapes = param_shapes(cfg)
    for group in ("markov", "confidence"):
        if group in shapes:
            keys = jax.random.split(jax.random.fold_in(k2, len(group)), len(shapes[group]))
            params[group] = {
                name: (jnp.zeros(s, dtype) if name.endswith("b") else (std * jax.random.normal(k, s)).astype(dtype))
                for k, (name, s) in zip(keys, sorted(shapes[group].items()))
            }
    return params


def markov_bias(params: dict, cfg: DSparkConfig, h: jax.Array, prev: jax.Array, s: jax.Array):
    """Markov correction [B, V] for hidden h [B, H] after previous tokens prev [B]; returns (bias, e, s)."""
    m = params["markov"]
    e = m["w1"][prev]
    if cfg.markov_head_type == "vanilla":
        return e @ m["w2"], e, s
    if cfg.markov_head_type == "gated":
        gate = jax.nn.sigmoid(jnp.concatenate([h, e], -1) @ m["gate_w"] + m["gate_b"])
        return (gate * e) @ m["w2"], e, s
    r = cfg.markov_rank
    z = jnp.concatenate([h, e, s], -1) @ m["joint_w"] + m["joint_b"]
    g, c, o = z[:, :r], z[:, r : 2 * r], z[:, 2 * r :]
    s = jax.nn.sigmoid(g) * s + (1 - jax.nn.sigmoid(g)) * jnp.tanh(c)
    return jnp.tanh(o) @ m["w2"], e, s


def confidence(params: dict, cfg: DSparkConfig, h: jax.Array, e: jax.Array | None) -> jax.Array:
    x = jnp.concatenate([h, e], -1) if (cfg.confidence_with_markov and e is not None) else h
    return jax.nn.sigmoid((x @ params["confidence"]["w"])[..., 0] + params["confidence"]["b"][0])


@register("dspark")
@dataclasses.dataclass(frozen=True)
class DSpark(DFlash):
    spark: DSparkConfig | None = None

    def __post_init__(self):
        if self.spark is not None and self.cfg is None:
            object.__setattr__(self, "cfg", self.spark.backbone)

    def backbone(self, dparams, state: DFlashState, ctx: DraftContext):
        """(hidden [B, g, H], unary logits U [B, g, V])."""
        anchor_pos = ctx.length - 1
        anchor = jnp.take_along_axis(ctx.tokens, anchor_pos[:, None], axis=1)[:, 0]
        hidden = draft_block(dparams, self.cfg, dparams["embed"], state.k, state.v, anchor, anchor_pos,
                             kernels=self.kernels)
        unary = jnp.einsum("bgh,hv->bgv", hidden, dparams["lm_head"], preferred_element_type=jnp.float32)
        return hidden, unary, anchor

    def propose(self, dparams, state: DFlashState, ctx: DraftContext):
        hidden, unary, anchor = self.backbone(dparams, state, ctx)
        if self.tree_budget:
            tokens, parent, depth = jax.vmap(
                lambda lg: ddtree.build_tree(jax.nn.log_softmax(lg, axis=-1), self.tree_budget))(unary)
            return Proposal(tokens, None, parent, depth), state
        cfg = self.spark
        b, g, _ = hidden.shape

        def slot(carry, k):
            prev, s = carry
            h = hidden[:, k]
            logits, e = unary[:, k], None
            if cfg.markov_rank:
                bias, e, s = markov_bias(dparams, cfg, h, prev, s)
                logits = logits + bias
            token, logp = self.choose(logits, ctx.seeds, ctx.length + k, ctx.length)
            conf = confidence(dparams, cfg, h, e) if cfg.confidence_head else jnp.ones((b,), jnp.float32)
            return (token, s), (token, logp if self.mode == SAMPLE else None, conf)

        s0 = jnp.zeros((b, max(cfg.markov_rank, 1)), jnp.float32)
        _, (tokens, logp, conf) = jax.lax.scan(slot, (anchor, s0), jnp.arange(g))
        q = None if logp is None else jnp.moveaxis(logp, 0, 1)
        return Proposal(tokens.T, q, confidence=conf.T), state
