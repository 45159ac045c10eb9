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
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jspec.drafters import ddtree
from jspec.drafters.base import SAMPLE, DraftContext, Proposal, register
from jspec.drafters.dflash import DFlash, DFlashConfig, DFlashNet, DFlashState, draft_block
from jspec.models import transformer
from jspec.models.declare import abstract_tree, declare, init_tree, logical_axes, shapes, unbox

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


class _MarkovHead(nn.Module):
    cfg: DSparkConfig
    init_std: float = 0.02
    param_dtype: Any = jnp.float32

    def setup(self):
        c = self.cfg
        h, v, r = c.backbone.hidden_size, c.backbone.layers.vocab_size, c.markov_rank
        decl = functools.partial(declare, self, std=self.init_std, dtype=self.param_dtype)
        pre = "markov_head."
        p = {"w1": decl("w1", (v, r), ("vocab", "rank"), "normal", pre + "markov_w1.weight"),
             "w2": decl("w2", (r, v), ("rank", "vocab"), "normal", pre + "markov_w2.weight", transpose=True)}
        if c.markov_head_type == "gated":
            p["gate_w"] = decl("gate_w", (h + r, r), (None, "rank"), "normal", pre + "gate_proj.weight",
                               transpose=True)
            p["gate_b"] = decl("gate_b", (r,), ("rank",), "zeros", pre + "gate_proj.bias")
        elif c.markov_head_type == "rnn":
            p["joint_w"] = decl("joint_w", (h + 2 * r, 3 * r), (None, None), "normal", pre + "joint_proj.weight",
                                transpose=True)
            p["joint_b"] = decl("joint_b", (3 * r,), (None,), "zeros", pre + "joint_proj.bias")
        self.p = p


class _ConfidenceHead(nn.Module):
    cfg: DSparkConfig
    init_std: float = 0.02
    param_dtype: Any = jnp.float32

    def setup(self):
        c = self.cfg
        c_in = c.backbone.hidden_size + (c.markov_rank if c.confidence_with_markov and c.markov_rank else 0)
        decl = functools.partial(declare, self, std=self.init_std, dtype=self.param_dtype)
        self.w = decl("w", (c_in, 1), (None, None), "normal", "confidence_head.proj.weight", transpose=True)
        self.b = decl("b", (1,), (None,), "zeros", "confidence_head.proj.bias")


class DSparkNet(DFlashNet):
    """The DFlash backbone's declarations plus the drafter's own embedding / LM head copies
    (`embed_tokens.weight`, `lm_head.weight`) and the Markov and confidence heads (DeepSpec names)."""

    spark: DSparkConfig | None = None

    def setup(self):
        super().setup()
        c = self.spark
        h, v = c.backbone.hidden_size, c.backbone.layers.vocab_size
        decl = functools.partial(declare, self, std=self.init_std, dtype=self.param_dtype)
        self.embed = decl("embed", (v, h), ("vocab", "embed"), "normal", "embed_tokens.weight")
        self.lm_head = decl("lm_head", (v, h), ("vocab", "embed"), "normal", "lm_head.weight")
        if c.markov_rank:
            self.markov = _MarkovHead(c, self.init_std, self.param_dtype, name="markov")
        if c.confidence_head:
            self.confidence = _ConfidenceHead(c, self.init_std, self.param_dtype, name="confidence")

    def declare(self):
        heads = (self.markov.p if self.spark.markov_rank else None,
                 self.confidence.w if self.spark.confidence_head else None)
        return super().declare(), self.embed, self.lm_head, heads


def _net(cfg: DSparkConfig, **kw) -> DSparkNet:
    return DSparkNet(cfg.backbone, spark=cfg, **kw)


@functools.lru_cache(maxsize=64)
def declarations(cfg: DSparkConfig, dtype=jnp.float32) -> dict:
    """Every parameter's declaration (boxes of ShapeDtypeStructs), `layers` as a list."""
    return transformer.from_linen(abstract_tree(_net(cfg, param_dtype=dtype), DSparkNet.declare)["params"])


def param_shapes(cfg: DSparkConfig) -> dict:
    return shapes(declarations(cfg))


def init_params(cfg: DSparkConfig, key: jax.Array, target_params: dict, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random backbone and heads; embedding and LM head copied from the target (frozen)."""
    params = transformer.from_linen(unbox(init_tree(_net(cfg, init_std=std, param_dtype=dtype), DSparkNet.declare,
                                                    key))["params"])
    embed = target_params["embed"]
    params["embed"] = embed.astype(dtype)
    params["lm_head"] = target_params.get("lm_head", embed).astype(dtype)
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

    def param_axes(self):
        return logical_axes(declarations(self.spark))

    def backbone(self, dparams, state: DFlashState, ctx: DraftContext):
        """(hidden [B, g, H], unary logits U [B, g, V])."""
        anchor_pos = ctx.length - 1
        anchor = jnp.take_along_axis(ctx.tokens, anchor_pos[:, None], axis=1)[:, 0]
        hidden = draft_block(dparams, self.cfg, dparams["embed"], state.k, state.v, anchor, anchor_pos,
                             kernels=self.kernels)
        unary = jnp.einsum("bgh,vh->bgv", hidden, dparams["lm_head"], preferred_element_type=jnp.float32)
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
