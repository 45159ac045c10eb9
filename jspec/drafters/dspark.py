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
from jspec.drafters import dflash
from jspec.drafters.base import DraftContext, Proposal
from jspec.drafters.dflash import DFlash, DFlashConfig, DFlashNet, DFlashState, draft_block
from jspec.drafters.family import Family, TrainRecipe, register_family
from jspec.io.drafters import load_declared, read_config, required, stack_config, stack_hf, write_checkpoint
from jspec.io.hf import declared_tensors, export_tensors
from jspec.models import quant, transformer
from jspec.models.declare import abstract_tree, declare, init_tree, logical_axes, shapes, unbox
from jspec.train import drafter as train_drafter
from jspec.train import losses
from jspec.verify.sampling import log_softmax_at, served_logprobs

MARKOV_TYPES = ("vanilla", "gated", "rnn")


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    backbone: DFlashConfig  # anchor_predicts must be True
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    confidence_with_markov: bool = True
    num_anchors: int = 512  # training anchors per sequence (a DeepSpec config field; no effect on drafting)

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
    embed = target_params["embed"]  # a Q4 target's are dequantized: the drafter's own copies are float
    params["embed"] = quant.dense(embed).astype(dtype)
    params["lm_head"] = quant.dense(target_params.get("lm_head", embed)).astype(dtype)
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


@dataclasses.dataclass(frozen=True)
class DSpark(DFlash):
    spark: DSparkConfig | None = None

    def __post_init__(self):
        if self.spark is not None and self.cfg is None:
            object.__setattr__(self, "cfg", self.spark.backbone)

    @property
    def reports_confidence(self) -> bool:
        return self.kind == "chain" and self.spark.confidence_head

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
        if self.tree_budget:
            _, unary, _ = self.backbone(dparams, state, ctx)
            tokens, parent, depth = jax.vmap(
                lambda lg: ddtree.build_tree(jax.nn.log_softmax(lg, axis=-1), self.tree_budget))(unary)
            return Proposal(tokens, None, parent, depth), state
        return self.stage(dparams, state, ctx)[0], state

    def stage(self, dparams, state: DFlashState, ctx: DraftContext):
        """(Proposal, the corrected (Markov) log-probs at temperature 1 of the drafts [B, g], the block's
        states [B, g, H]: the anchor slot predicts, so every slot is a draft slot; the unary logits
        [B, g, V] its DDTree reads)."""
        hidden, unary, anchor = self.backbone(dparams, state, ctx)
        cfg = self.spark
        b, g, _ = hidden.shape

        def slot(carry, k):
            prev, s = carry
            h = hidden[:, k]
            logits, e = unary[:, k], None
            if cfg.markov_rank:
                bias, e, s = markov_bias(dparams, cfg, h, prev, s)
                logits = logits + bias
            token, logp = self.choose(ctx, logits, ctx.length + k)
            conf = confidence(dparams, cfg, h, e) if cfg.confidence_head else jnp.ones((b,), jnp.float32)
            return (token, s), (token, logp if ctx.needs_q else None, conf, log_softmax_at(logits, token))

        s0 = jnp.zeros((b, max(cfg.markov_rank, 1)), jnp.float32)
        _, (tokens, logp, conf, own) = jax.lax.scan(slot, (anchor, s0), jnp.arange(g))
        q = None if logp is None else jnp.moveaxis(logp, 0, 1)
        return Proposal(tokens.T, q, confidence=conf.T), own.T, hidden, unary


# --- checkpoints: the DeepSpec format ------------------------------------------------------------------
# The DFlash backbone's names and config fields at the top level, architectures `Qwen3DSparkModel`, plus
# `embed_tokens.weight`, `lm_head.weight`, `markov_head.markov_w1.weight [V, r]` (an embedding),
# `markov_head.markov_w2.weight [V, r]` (a Linear r -> V, [out, in]), `markov_head.gate_proj.{weight,bias}`
# (gated) or `markov_head.joint_proj.{weight,bias}` (rnn) and `confidence_head.proj.{weight [1, H(+r)],
# bias [1]}`. The gated / rnn tensor names are not confirmed against a released file; this module uses
# exactly these names in both directions.


def is_dspark_config(hf: dict) -> bool:
    return "Qwen3DSparkModel" in (hf.get("architectures") or []) or "markov_rank" in hf


def config_from_hf(hf: dict) -> DSparkConfig:
    where = "DSpark config"
    ids, mask, anchors, conf, rank = required(hf, "target_layer_ids", "mask_token_id", "num_anchors",
                                              "enable_confidence_head", "markov_rank", where=where)
    head_type = required(hf, "markov_head_type", where=where)[0] if rank else "vanilla"
    with_markov = required(hf, "confidence_head_with_markov", where=where)[0] if conf else False
    (block,) = required(hf, "block_size", where=where)
    backbone = DFlashConfig(layers=stack_config(hf), target_layer_ids=tuple(int(i) for i in ids),
                            num_target_layers=int(hf.get("num_target_layers", 0)), mask_token_id=int(mask),
                            block_size=int(block), anchor_predicts=True)
    return DSparkConfig(backbone=backbone, markov_rank=int(rank), markov_head_type=head_type,
                        confidence_head=bool(conf), confidence_with_markov=bool(with_markov),
                        num_anchors=int(anchors))


def load_checkpoint(path: str, dtype=jnp.float32) -> tuple[DSparkConfig, dict]:
    """(config, parameters) of a DeepSpec DSpark checkpoint folder; strict about every tensor."""
    cfg = config_from_hf(read_config(path))
    return cfg, load_declared(path, declarations(cfg), param_shapes(cfg), "DSpark", dtype)


def save_checkpoint(path: str, cfg: DSparkConfig, params: dict, dtype=None) -> None:
    b = cfg.backbone
    config = stack_hf(b.layers)
    config.update(architectures=["Qwen3DSparkModel"], model_type="qwen3", block_size=b.block_size,
                  mask_token_id=b.mask_token_id, target_layer_ids=list(b.target_layer_ids),
                  num_target_layers=b.num_target_layers, num_anchors=cfg.num_anchors, markov_rank=cfg.markov_rank,
                  markov_head_type=cfg.markov_head_type, enable_confidence_head=cfg.confidence_head,
                  confidence_head_with_markov=cfg.confidence_with_markov)
    write_checkpoint(path, config, export_tensors(params, declared_tensors(declarations(cfg)), dtype))


# --- training -----------------------------------------------------------------------------------------


def _build(run: dict, target, key) -> tuple[DSpark, dict]:
    d = run["drafter"]
    spark = DSparkConfig(backbone=dflash.config_from_run(d, target.cfg, anchor_predicts=True),
                         markov_rank=d.get("markov_rank", 64), markov_head_type=d.get("markov_head_type", "vanilla"),
                         num_anchors=d.get("num_anchors", 16))
    return DSpark(spark=spark), init_params(spark, key, target.params,
                                                                    std=run.get("init_std", 0.02))


OWN_LOSS = "dspark"


def train_loss(params, target_params, target_cfg, drafter: DSpark, spec, batch: dict, key: jax.Array):
    """DSpark: Markov head teacher-forced on the true previous token. Loss "dspark" (the default): 0.1 CE +
    0.9 L1 + confidence BCE; any other run loss (losses.LOSSES) replaces the CE + L1 part, the confidence
    head (if any) still trained by its BCE (position-weighted by gamma)."""
    cfg = drafter.spark
    b_cfg = cfg.backbone
    tokens, loss_mask = batch["tokens"], batch["loss_mask"]
    taps, target_logp = train_drafter.target_pass(target_params, target_cfg, tokens, b_cfg.target_layer_ids)
    anchors, valid = train_drafter.anchors_for(spec, key, loss_mask)
    labels, mask, p_t = train_drafter.block_targets(b_cfg.num_drafts, tokens, loss_mask, target_logp, anchors,
                                                    valid)
    hidden = dflash.train_hidden(params, b_cfg, params["embed"], taps, tokens, anchors)  # [B, A, g, H]
    logits = jnp.einsum("bagh,vh->bagv", hidden, params["lm_head"], preferred_element_type=jnp.float32)
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)
    prev = jnp.concatenate([anchor_tok[..., None], labels[..., :-1]], axis=-1)  # teacher forcing
    b, a, g, h = hidden.shape
    conf = jnp.ones((b, a, g), jnp.float32)
    if cfg.markov_rank:
        flat_h, flat_prev = hidden.reshape(b * a, g, h), prev.reshape(b * a, g)

        def slot(s, k):
            bias, e, s = markov_bias(params, cfg, flat_h[:, k], flat_prev[:, k], s)
            c = confidence(params, cfg, flat_h[:, k], e) if cfg.confidence_head else jnp.ones((b * a,))
            return s, (bias, c)

        _, (bias, c) = jax.lax.scan(slot, jnp.zeros((b * a, cfg.markov_rank)), jnp.arange(g))
        logits = logits + jnp.moveaxis(bias, 0, 1).reshape(b, a, g, -1)
        conf = jnp.moveaxis(c, 0, 1).reshape(b, a, g)
    elif cfg.confidence_head:
        conf = confidence(params, cfg, hidden, None)
    draft_logp = jax.nn.log_softmax(logits, axis=-1)
    loss = run_loss(spec, draft_logp, p_t, labels, mask, conf if cfg.confidence_head else None)
    return loss, train_drafter.metrics(draft_logp, p_t, labels, mask)


def run_loss(spec, draft_logp, p_t, labels, mask, conf=None):
    """The run's loss of the drafts [B, A, g, V] (`train_loss`): DSpark's own, or a loss of losses.LOSSES plus
    the confidence head's BCE when conf [B, A, g] is given."""
    if spec.name == OWN_LOSS:
        return losses.dspark_loss(draft_logp, p_t, labels, mask, conf, spec.gamma)
    loss = train_drafter.distribution_loss(spec, draft_logp, p_t, labels, mask)
    if conf is not None:
        loss = loss + losses.weighted_mean(losses.confidence_bce(draft_logp, p_t, conf), mask, spec.gamma)
    return loss


def _load(path: str, target, dtype) -> tuple[DSpark, dict]:
    cfg, params = load_checkpoint(path, dtype)
    return DSpark(spark=cfg), params


def _save(path: str, drafter: DSpark, params: dict, dtype=None) -> None:
    save_checkpoint(path, drafter.spark, params, dtype)


def _example(target) -> tuple[DSpark, dict]:
    run = {**dflash.EXAMPLE_RUN, "drafter": {**dflash.EXAMPLE_RUN["drafter"], "markov_rank": 8,
                                             "markov_head_type": "rnn"}}
    return _build(run, target, jax.random.key(0))


def offline_blocks(target_params, target_cfg, drafter: DSpark, dparams, taps, tokens, sampling):
    """The offline evaluator's rounds (`Family.offline`): slot k's Markov head reads the text's token before
    it (the anchor for k = 1), which is its draft when the drafts before it were accepted."""
    cfg = drafter.spark
    context = dflash.train_context(dparams, cfg.backbone, taps, tokens)  # once for every anchor group

    def blocks(anchors):
        hid = dflash.slot_hidden(dparams, cfg.backbone, dparams["embed"], context, tokens, anchors)
        logits = jnp.einsum("bagh,vh->bagv", hid, dparams["lm_head"], preferred_element_type=jnp.float32)
        if cfg.markov_rank:
            b, a, g, _ = hid.shape
            pos = jnp.minimum(anchors[..., None] + jnp.arange(g), tokens.shape[1] - 1)
            prev = jnp.take_along_axis(tokens, pos.reshape(b, -1), axis=1).reshape(b * a, g)
            flat_h = hid.reshape(b * a, g, -1)

            def slot(s, k):
                bias, _, s = markov_bias(dparams, cfg, flat_h[:, k], prev[:, k], s)
                return s, bias

            _, bias = jax.lax.scan(slot, jnp.zeros((b * a, cfg.markov_rank)), jnp.arange(g))
            logits = logits + jnp.moveaxis(bias, 0, 1).reshape(b, a, g, -1)
        return logits, served_logprobs(logits, sampling)
    return blocks


register_family(Family(name="dspark", drafter=DSpark, detect=is_dspark_config, load=_load, save=_save,
                       with_shape=dflash.with_shape, example=_example, offline=offline_blocks,
                       recipe=TrainRecipe(build=_build, loss=train_loss, frozen=("embed", "lm_head"),
                                          own_loss=OWN_LOSS),
                       summary="DeepSpec DSpark: architectures Qwen3DSparkModel"))
