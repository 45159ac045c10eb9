"""DFlash2: DFlash layers wrapped in dynamic two-tap convolutions, and a candidate-pair selector.

The backbone is DFlash (jspec.drafters.dflash: the same context cache, taps, block conventions and
config knobs). Each draft layer adds a dynamic convolution around its attention and around its MLP:

    x = input_layernorm(h);  D = kernel_projection(x) viewed [.., 2, K, G]  (G = H / group)
    h = h + Conv(attn(Conv(x; D[0], base[0])); D[1], base[1])
    x = post_attention_layernorm(h);  the same with the MLP and the MLP's own convolution

    Conv(x; d, b)[t, c] = sum_{o < K} (b[o, c] + d[t, o, c // group]) x[t - o, c],  x[t < 0] = 0,

over the block's slots only (slot 0 is the anchor): both kernels of a sublayer come from its normed
input. The selector then drafts the slots t = 1 .. B - 1 left to right:

    (U_t, C_t) = top-k of the draft logits of slot t (after output_multiplier / softcapping)
    S_t(j) = U_t(j) + sum_r A[a_{t-1}, r] h'_t[r] Bs[C_t(j), r],   h'_t = hidden_projection(h_t)

with a_0 the anchor and a_{t-1} the token drafted at slot t - 1 (A, Bs: the predecessor and successor
codebooks, h_t the final-normed slot state). Greedy drafting takes argmax_j S_t(j); otherwise slot t
draws from q_t = softmax(S_t / T) over the k candidates (the temperature only: no top-k / top-p), and
the proposal's q is q_t scattered into the vocabulary (0 off the candidates), given the predecessor
actually drafted: exactly the law of the draw, as the sampling rules need. Gumbel coupling draws
argmax_j (log q_t(j) + g[C_t(j)]) with the target's noise g of that position.

With the official initialisation (identity base kernels, zero kernel projections, zero successor
codebook) a DFlash2 drafter drafts exactly as its DFlash backbone.

Trees (`tree_budget` > 0): best-first along the selector. The children of a node holding token x at
depth t are slot t + 1's candidates ranked by log softmax(S_{t+1}) given predecessor x (temperature 1),
a path's score the sum along it (`ddtree.build_conditional_tree`); children are fixed choices, verified
as point masses. A DDTree over the backbone's logits alone would drop the selector.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jspec.drafters import ddtree, dflash
from jspec.drafters.base import DraftContext, Proposal, draft_noise
from jspec.drafters.dflash import DFlash, DFlashConfig, DFlashNet, DFlashState
from jspec.drafters.family import Family, TrainRecipe, register_family
from jspec.io.drafters import load_declared, read_config, stack_hf, write_checkpoint
from jspec.io.hf import CheckpointError, declared_tensors, export_tensors
from jspec.kernels.draft import ref_block_attention
from jspec.models import layers, transformer
from jspec.models.attention import KV_CHUNK
from jspec.models.declare import abstract_tree, declare, init_tree, logical_axes, shapes, unbox
from jspec.train import drafter as train_drafter
from jspec.verify import noise
from jspec.verify.rules import GREEDY, GUMBEL
from jspec.verify.sampling import Served, served_logprobs

# dflash_config settings of DFlash2 on top of DFlash's
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclasses.dataclass(frozen=True)
class DFlash2Config:
    backbone: DFlashConfig
    conv_kernel_size: int = 2
    conv_group_size: int = 16  # channels sharing one dynamic tap
    selector_rank: int = 256
    selector_top_k: int = 16

    def __post_init__(self):
        h, v = self.backbone.hidden_size, self.backbone.layers.vocab_size
        problems = []
        if self.backbone.anchor_predicts:
            problems.append("the DFlash2 block counts the anchor (anchor_predicts must be False)")
        if self.conv_kernel_size < 1 or self.conv_group_size < 1 or h % self.conv_group_size:
            problems.append(f"conv_kernel_size {self.conv_kernel_size} must be >= 1 and conv_group_size "
                            f"{self.conv_group_size} must divide the hidden size {h}")
        if self.selector_rank < 1 or not 1 <= self.selector_top_k <= v:
            problems.append(f"selector_rank {self.selector_rank} must be >= 1 and selector_top_k "
                            f"{self.selector_top_k} in [1, {v}]")
        if problems:
            raise ValueError("bad DFlash2 config: " + "; ".join(problems))

    @property
    def groups(self) -> int:
        return self.backbone.hidden_size // self.conv_group_size


class ConvLayer(nn.Module):
    """The two dynamic convolutions of draft layer i (HF `layers.{i}.{attention,mlp}_conv.*`): base
    kernels [2, K, H] (pre / post sublayer) and kernel projections [2 K G, H] ([out, in])."""

    cfg: DFlash2Config
    hf_prefix: str
    init_std: float = 0.02
    param_dtype: Any = jnp.float32

    def setup(self):
        c = self.cfg
        h, k, g = c.backbone.hidden_size, c.conv_kernel_size, c.groups
        decl = functools.partial(declare, self, std=self.init_std, dtype=self.param_dtype)
        for part in ("attention", "mlp"):
            setattr(self, f"{part}_base", decl(f"{part}_base", (2, k, h), (None, None, "embed"), "first_tap",
                                               f"{self.hf_prefix}{part}_conv.base_kernel"))
            setattr(self, f"{part}_proj", decl(f"{part}_proj", (2 * k * g, h), (None, "embed"), "zeros",
                                               f"{self.hf_prefix}{part}_conv.kernel_projection.weight"))

    def declare(self):
        return self.attention_base, self.attention_proj, self.mlp_base, self.mlp_proj


class DFlash2Net(DFlashNet):
    """DFlash's parameters plus `convs` (one ConvLayer per draft layer) and the selector: hidden
    projection [R, H], predecessor / successor codebooks [V, R] (HF names `candidate_selector.*`, the
    codebooks without `.weight`)."""

    cfg2: DFlash2Config | None = None

    def setup(self):
        super().setup()
        c = self.cfg2
        h, v, r = c.backbone.hidden_size, c.backbone.layers.vocab_size, c.selector_rank
        decl = functools.partial(declare, self, std=self.init_std, dtype=self.param_dtype)
        self.sel_hidden = decl("sel_hidden", (r, h), ("rank", "embed"), "normal",
                               "candidate_selector.hidden_projection.weight")
        self.sel_pred = decl("sel_pred", (v, r), ("vocab", "rank"), "normal", "candidate_selector.predecessor_codebook")
        self.sel_succ = decl("sel_succ", (v, r), ("vocab", "rank"), "zeros", "candidate_selector.successor_codebook")
        self.convs = [ConvLayer(c, f"layers.{i}.", self.init_std, self.param_dtype, name=f"conv{i}")
                      for i in range(c.backbone.layers.num_layers)]

    def declare(self):
        return (*super().declare(), self.sel_hidden, self.sel_pred, self.sel_succ,
                [conv.declare() for conv in self.convs])


def _layout(tree: dict) -> dict:
    """The module's tree -> jspec's layout: `layers` and `convs` as lists, the selector as one dict."""
    tree = transformer.from_linen(tree)
    n = len(tree["layers"])
    out = {k: v for k, v in tree.items() if not k.startswith(("conv", "sel_"))}
    out["convs"] = [tree[f"conv{i}"] for i in range(n)]
    out["selector"] = {"hidden": tree["sel_hidden"], "pred": tree["sel_pred"], "succ": tree["sel_succ"]}
    return out


def _net(cfg: DFlash2Config, **kw) -> DFlash2Net:
    return DFlash2Net(cfg.backbone, cfg2=cfg, **kw)


@functools.lru_cache(maxsize=64)
def declarations(cfg: DFlash2Config, dtype=jnp.float32) -> dict:
    return _layout(abstract_tree(_net(cfg, param_dtype=dtype), DFlash2Net.declare)["params"])


def param_shapes(cfg: DFlash2Config) -> dict:
    return shapes(declarations(cfg))


def init_params(cfg: DFlash2Config, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """The official initialisation: identity base kernels, zero kernel projections and successor codebook
    (so the drafter starts as its DFlash backbone); normal(std) elsewhere."""
    return _layout(unbox(init_tree(_net(cfg, init_std=std, param_dtype=dtype), DFlash2Net.declare, key))["params"])


def from_dflash(backbone: DFlashConfig, backbone_params: dict, key: jax.Array, **settings) -> tuple[DFlash2Config, dict]:
    """A DFlash2 drafter that drafts exactly as a trained DFlash one: the DFlash tensors as they are, the
    convolutions and the selector at the official initialisation (settings: DFlash2Config's fields)."""
    cfg = DFlash2Config(backbone=backbone, **settings)
    params = init_params(cfg, key, dtype=backbone_params["fc"].dtype)
    params.update({k: backbone_params[k] for k in ("fc", "hidden_norm", "norm", "layers")})
    return cfg, params


# --- the network ------------------------------------------------------------------------------------------


def dynamic_kernels(x: jax.Array, proj: jax.Array, cfg: DFlash2Config) -> jax.Array:
    """[..., 2, K, G] dynamic taps (pre / post sublayer) from the normed sublayer input x [..., H]."""
    d = layers.linear(x, proj)
    return d.reshape(*x.shape[:-1], 2, cfg.conv_kernel_size, cfg.groups)


def block_conv(x: jax.Array, dyn: jax.Array, base: jax.Array, group: int) -> jax.Array:
    """Conv(x; d, b) over the slots of each block: x [B, A, W, H], dyn [B, A, W, K, G], base [K, H];
    tap o reads slot t - o (zero before slot 0), float32 accumulation, x's dtype out."""
    k, w = base.shape[0], x.shape[2]
    out = jnp.zeros(x.shape, jnp.float32)
    for o in range(k):
        shifted = jnp.pad(x, [(0, 0), (0, 0), (o, 0), (0, 0)])[:, :, :w]
        tap = base[o].astype(jnp.float32) + jnp.repeat(dyn[..., o, :].astype(jnp.float32), group, axis=-1)
        out = out + tap * shifted.astype(jnp.float32)
    return out.astype(x.dtype)


def draft_layer(h, lp, cp, ctx_k, ctx_v, anchor_pos, window, cfg: DFlash2Config, causal: bool,
                kv_chunk: int | str | None) -> jax.Array:
    """One DFlash2 draft layer: [B, A, W, H] (arguments as `jspec.kernels.draft.ref_draft_layer`; cp: the
    layer's convolutions)."""
    lc, g = cfg.backbone.layers, cfg.conv_group_size
    x = layers.rms_norm(h, lp["attn_norm"], lc.rms_norm_eps)
    d = dynamic_kernels(x, cp["attention_proj"], cfg)
    a = ref_block_attention(block_conv(x, d[..., 0, :, :], cp["attention_base"][0], g), lp, ctx_k, ctx_v,
                            anchor_pos, window, lc, kv_chunk, causal)
    h = h + block_conv(a, d[..., 1, :, :], cp["attention_base"][1], g)
    x = layers.rms_norm(h, lp["mlp_norm"], lc.rms_norm_eps)
    d = dynamic_kernels(x, cp["mlp_proj"], cfg)
    m = layers.swiglu(block_conv(x, d[..., 0, :, :], cp["mlp_base"][0], g), lp["w_gate"], lp["w_up"], lp["w_down"])
    return h + block_conv(m, d[..., 1, :, :], cp["mlp_base"][1], g)


def draft_blocks(params: dict, cfg: DFlash2Config, embed, ctx_k, ctx_v, anchor_pos, block_tokens,
                 kv_chunk: int | str | None = None) -> jax.Array:
    """Final-normed hidden states [B, A, W, H] of A blocks per row (as `dflash.draft_blocks`)."""
    b = cfg.backbone
    h = dflash.block_embeddings(b, embed, block_tokens)
    for i, (lp, cp) in enumerate(zip(params["layers"], params["convs"])):
        h = draft_layer(h, lp, cp, ctx_k[i], ctx_v[i], anchor_pos, jnp.int32(b.layers.windows[i]), cfg,
                        b.layer_causal[i], kv_chunk)
    return layers.rms_norm(h, params["norm"], b.layers.rms_norm_eps)


def candidates(params: dict, cfg: DFlash2Config, logits: jax.Array, hidden: jax.Array):
    """Unary scores U [..., k], candidate ids C [..., k] (the top-k of the draft logits) and the slot
    factors h' [..., R] of final-normed slot states hidden [..., H]."""
    unary, ids = ddtree.top_k(logits, cfg.selector_top_k)
    return unary, ids.astype(jnp.int32), layers.linear(hidden, params["selector"]["hidden"])


def pair_scores(params: dict, unary, ids, factors, prev) -> jax.Array:
    """S(j) = U(j) + sum_r A[prev, r] h'[r] Bs[C(j), r]: [..., k] (prev [...] the predecessor token)."""
    sel = params["selector"]
    pred = jnp.take(sel["pred"], prev, axis=0).astype(jnp.float32) * factors.astype(jnp.float32)  # [..., R]
    succ = jnp.take(sel["succ"], ids, axis=0).astype(jnp.float32)  # [..., k, R]
    return unary + jnp.einsum("...r,...kr->...k", pred, succ)


@dataclasses.dataclass(frozen=True)
class DFlash2(DFlash):
    dflash2: DFlash2Config | None = None

    def __post_init__(self):
        if self.dflash2 is not None and self.cfg is None:
            object.__setattr__(self, "cfg", self.dflash2.backbone)

    def with_kernels(self, kernels: str) -> "DFlash2":
        if kernels == "pallas":
            raise ValueError("DFlash2's convolution layers have no fused kernel: use kernels='reference' (or "
                             "'auto', which keeps its draft layers on the reference)")
        return self

    def param_axes(self):
        return logical_axes(declarations(self.dflash2))

    def block_hidden(self, dparams, state: DFlashState, ctx: DraftContext) -> jax.Array:
        anchor_pos = ctx.length - 1
        anchor = jnp.take_along_axis(ctx.tokens, anchor_pos[:, None], axis=1)[:, 0]
        tokens = dflash.block_inputs(self.cfg, anchor)
        return draft_blocks(dparams, self.dflash2, ctx.target_params["embed"], state.k, state.v,
                            anchor_pos[:, None], tokens[:, None], KV_CHUNK)[:, 0]

    def slot_states(self, dparams, state: DFlashState, ctx: DraftContext):
        """(anchor [B], final-normed states of the draft slots [B, g, H], their draft logits [B, g, V],
        the whole block's states [B, W, H])."""
        block = self.block_hidden(dparams, state, ctx)
        anchor = jnp.take_along_axis(ctx.tokens, ctx.length[:, None] - 1, axis=1)[:, 0]
        hidden = block[:, 1:]
        return anchor, hidden, dflash.draft_logits(ctx.target_params, ctx.target_cfg, self.cfg, hidden), block

    def logits(self, dparams, state: DFlashState, ctx: DraftContext) -> jax.Array:
        """The backbone's draft logits [B, g, V] (what DDTree would read; the selector acts in `propose`)."""
        return self.slot_states(dparams, state, ctx)[2]

    def propose(self, dparams, state: DFlashState, ctx: DraftContext):
        if self.tree_budget:
            return self.tree(dparams, state, ctx), state
        return self.stage(dparams, state, ctx)[0], state

    def tree(self, dparams, state: DFlashState, ctx: DraftContext) -> Proposal:
        """A best-first tree whose paths follow the selector: the children of a node holding token x at
        depth d are slot d's candidates ranked by the selector's log-probs (temperature 1) given
        predecessor x (`ddtree.build_conditional_tree`); deterministic children."""
        anchor, hidden, logits, _ = self.slot_states(dparams, state, ctx)
        unary, ids, factors = candidates(dparams, self.dflash2, logits, hidden)
        g = logits.shape[1]

        def one(unary, ids, factors, anchor):
            def ranked(t, prev):
                lq = jax.nn.log_softmax(pair_scores(dparams, unary[t], ids[t], factors[t], prev))
                order = jnp.argsort(-lq)
                return lq[order], ids[t][order]

            return ddtree.build_conditional_tree(ranked(0, anchor), ranked, g, self.tree_budget)

        tokens, parent, depth = jax.vmap(one)(unary, ids, factors, anchor)
        return Proposal(tokens, None, parent, depth)

    def stage(self, dparams, state: DFlashState, ctx: DraftContext):
        """(Proposal, the selector's log-probs at temperature 1 of the drafts [B, g], the block's states, the
        backbone's per-slot logits [B, g, V])."""
        anchor, hidden, logits, block = self.slot_states(dparams, state, ctx)
        unary, ids, factors = candidates(dparams, self.dflash2, logits, hidden)
        b, g, vocab = logits.shape
        index = ctx.length[:, None] + jnp.arange(g)[None]  # draft t is written at length + t
        if ctx.policy == GREEDY:
            g_noise = None
        elif ctx.policy == GUMBEL:  # the target's noise of each position, read at the candidates
            g_noise = noise.gumbel(ctx.seeds, index, noise.GUMBEL, vocab)
        else:
            g_noise = draft_noise(ctx.seeds, index, ctx.noise_start, vocab)
        temperature = ctx.sampling.temperature

        def slot(prev, t):
            scores = pair_scores(dparams, unary[:, t], ids[:, t], factors[:, t], prev)  # [B, k]
            if ctx.policy == GREEDY:
                j = jnp.argmax(scores, axis=-1)
                logq = None
            else:
                logq = jax.nn.log_softmax(scores / temperature, axis=-1)
                j = jnp.argmax(logq + jnp.take_along_axis(g_noise[:, t], ids[:, t], axis=-1), axis=-1)
            token = jnp.take_along_axis(ids[:, t], j[:, None], axis=-1)[:, 0]
            own = jnp.take_along_axis(jax.nn.log_softmax(scores, axis=-1), j[:, None], axis=-1)[:, 0]
            row = None
            if ctx.needs_q:  # q_t scattered into the vocabulary: -inf off the candidates
                row = jnp.full((b, vocab), -jnp.inf, jnp.float32).at[jnp.arange(b)[:, None], ids[:, t]].set(logq)
            return token, (token, row, own)

        _, (tokens, rows, own) = jax.lax.scan(slot, anchor, jnp.arange(g))
        return Proposal(tokens.T, None if rows is None else jnp.moveaxis(rows, 0, 1)), own.T, block, logits


# --- checkpoints: the official format ------------------------------------------------------------------
# DFlash's (jspec.drafters.dflash) with architectures `DFlash2DraftModel`, the dflash_config settings
# conv_kernel_size, conv_group_size, selector_rank and selector_top_k, and the tensors
# `layers.{i}.{attention,mlp}_conv.base_kernel [2, K, H]`, `layers.{i}.{attention,mlp}_conv.kernel_projection.weight
# [2 K G, H]`, `candidate_selector.hidden_projection.weight [R, H]` and
# `candidate_selector.{predecessor,successor}_codebook [V, R]`.


def config_from_hf(hf: dict) -> DFlash2Config:
    where = "DFlash2 config"
    backbone = dflash.config_from_hf(hf, own_keys=DFLASH2_KEYS, where=where)
    dc = hf["dflash_config"]
    missing = [k for k in DFLASH2_KEYS if k not in dc]
    if missing:
        raise CheckpointError(f"{where}: dflash_config lacks the DFlash2 settings {missing}")
    try:
        return DFlash2Config(backbone=backbone, **{k: int(dc[k]) for k in DFLASH2_KEYS})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from e


def load_checkpoint(path: str, dtype=jnp.float32) -> tuple[DFlash2Config, dict]:
    """(config, parameters) of a DFlash2 checkpoint folder; strict about every tensor."""
    cfg = config_from_hf(read_config(path))
    return cfg, load_declared(path, declarations(cfg), param_shapes(cfg), "DFlash2", dtype)


def save_checkpoint(path: str, cfg: DFlash2Config, params: dict, dtype=None) -> None:
    b = cfg.backbone
    settings = dflash.hf_settings(b)
    config = stack_hf(b.layers)
    config.update(architectures=["DFlash2DraftModel"], model_type="qwen3", num_target_layers=b.num_target_layers,
                  **{k: v for k, v in settings.items() if k != "dflash_config"},
                  dflash_config={"block_size": b.block_size, "mask_token_id": b.mask_token_id,
                                 "target_layer_ids": list(b.target_layer_ids), **settings["dflash_config"],
                                 **{k: getattr(cfg, k) for k in DFLASH2_KEYS}})
    write_checkpoint(path, config, export_tensors(params, declared_tensors(declarations(cfg)), dtype))


# --- training -----------------------------------------------------------------------------------------


def _build(run: dict, target, key) -> tuple[DFlash2, dict]:
    d = run["drafter"]
    backbone = dflash.config_from_run(d, target.cfg, anchor_predicts=False)
    cfg = DFlash2Config(backbone=backbone, conv_kernel_size=d.get("conv_kernel_size", 2),
                        conv_group_size=d.get("conv_group_size", 16), selector_rank=d.get("selector_rank", 64),
                        selector_top_k=d.get("selector_top_k", 16))
    return DFlash2(dflash2=cfg), init_params(cfg, key, std=run.get("init_std", 0.02))


def with_truth(unary, ids, logits, labels):
    """The candidates with the true token in: where it is missing it replaces the weakest one (the last
    of the top-k) with its own draft logit as unary score. unary / ids [..., k], logits [..., V]."""
    hit = jnp.any(ids == labels[..., None], axis=-1, keepdims=True)
    own = jnp.take_along_axis(logits, labels[..., None], axis=-1)
    last = ids.shape[-1] - 1
    return (jnp.where(hit, unary, unary.at[..., last].set(own[..., 0])),
            jnp.where(hit, ids, ids.at[..., last].set(labels)))


def selector_loss(scores, ids, labels, mask):
    """Cross-entropy of the k-way selector at the true next token (which `with_truth` put among the
    candidates): scores / ids [..., k], labels / mask [...]."""
    target = jnp.argmax(ids == labels[..., None], axis=-1)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(scores, axis=-1), target[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def train_loss(params, target_params, target_cfg, drafter: DFlash2, spec, batch: dict, key: jax.Array):
    """The run's distribution loss on the backbone's draft logits (the unary part) plus the selector's
    cross-entropy with the true predecessor teacher-forced (speculators' recipe; the official objective is
    unpublished)."""
    cfg, b = drafter.dflash2, drafter.cfg
    tokens, loss_mask = batch["tokens"], batch["loss_mask"]
    taps, target_logp = train_drafter.target_pass(target_params, target_cfg, tokens, b.target_layer_ids)
    anchors, valid = train_drafter.anchors_for(spec, key, loss_mask)
    labels, mask, p_t = train_drafter.block_targets(b.num_drafts, tokens, loss_mask, target_logp, anchors, valid)
    n, t = tokens.shape
    ctx_k, ctx_v = dflash.context_kv(params, b, taps, jnp.broadcast_to(jnp.arange(t), (n, t)))
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)
    hidden = draft_blocks(params, cfg, target_params["embed"], ctx_k, ctx_v, anchors,
                          dflash.block_inputs(b, anchor_tok))[:, :, 1:]
    logits = dflash.draft_logits(target_params, target_cfg, b, hidden)
    draft_logp = jax.nn.log_softmax(logits, axis=-1)
    unary_loss = train_drafter.distribution_loss(spec, draft_logp, p_t, labels, mask)
    unary, ids, factors = candidates(params, cfg, logits, hidden)
    unary, ids = with_truth(unary, ids, logits, labels)
    prev = jnp.concatenate([anchor_tok[..., None], labels[..., :-1]], axis=-1)  # teacher forcing
    scores = pair_scores(params, unary, ids, factors, prev)
    sel = selector_loss(scores, ids, labels, mask)
    metrics = train_drafter.metrics(draft_logp, p_t, labels, mask)
    return unary_loss + sel, dict(metrics, selector_ce=sel)


def offline_blocks(target_params, target_cfg, drafter: DFlash2, dparams, taps, tokens, sampling):
    """The offline evaluator's rounds (`Family.offline`): slot k's selector reads the text's token before
    it (the anchor for k = 1) as its predecessor, which is its draft when the drafts before it were
    accepted; q_k = softmax(S_k / T) over the candidates, -inf elsewhere (the temperature only, as `stage`:
    the sampling's top-k / top-p do not apply to it)."""
    cfg, bb = drafter.dflash2, drafter.cfg
    n, t = tokens.shape
    ctx_k, ctx_v = dflash.context_kv(dparams, bb, taps, jnp.broadcast_to(jnp.arange(t), (n, t)))
    temperature_only = Served(sampling.temperature, jnp.int32(0), jnp.float32(1.0), sampling.greedy,
                              top_k_on=False, top_p_on=False)

    def blocks(anchors):
        anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)
        hidden = draft_blocks(dparams, cfg, target_params["embed"], ctx_k, ctx_v, anchors,
                              dflash.block_inputs(bb, anchor_tok))[:, :, 1:]
        logits = dflash.draft_logits(target_params, target_cfg, bb, hidden)
        unary, ids, factors = candidates(dparams, cfg, logits, hidden)
        b, _, g, _ = ids.shape
        prev = tokens[jnp.arange(b)[:, None, None], jnp.minimum(anchors[..., None] + jnp.arange(g), t - 1)]
        scores = pair_scores(dparams, unary, ids, factors, prev)  # [B, A, g, k]
        scattered = jnp.put_along_axis(jnp.full(logits.shape, -jnp.inf, jnp.float32), ids, scores, axis=-1,
                                       inplace=False)
        return scattered, served_logprobs(scattered, temperature_only)
    return blocks


def _load(path: str, target, dtype) -> tuple[DFlash2, dict]:
    cfg, params = load_checkpoint(path, dtype)
    return DFlash2(dflash2=cfg), params


def _save(path: str, drafter: DFlash2, params: dict, dtype=None) -> None:
    save_checkpoint(path, drafter.dflash2, params, dtype)


def with_shape(drafter: DFlash2, block_size: int, tree_budget: int) -> DFlash2:
    """The block size is the checkpoint's; a tree budget builds best-first trees along the selector."""
    return dataclasses.replace(drafter, tree_budget=tree_budget)


EXAMPLE_RUN = {"drafter": {**dflash.EXAMPLE_RUN["drafter"], "conv_group_size": 16, "selector_rank": 8,
                           "selector_top_k": 4}, "init_std": 0.3}


def _example(target) -> tuple[DFlash2, dict]:
    """A DFlash2 drafter for `target` whose convolutions and successor codebook are random too (the
    official init would make them no-ops, which a conformance check could not tell apart)."""
    drafter, params = _build(EXAMPLE_RUN, target, jax.random.key(0))
    keys = iter(jax.random.split(jax.random.key(1), 64))
    noisy = lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype)
    params = dict(params, convs=jax.tree_util.tree_map(noisy, params["convs"]),
                  selector=dict(params["selector"], succ=noisy(params["selector"]["succ"])))
    return drafter, params


register_family(Family(name="dflash2", drafter=DFlash2, detect=dflash.is_dflash2_config, load=_load, save=_save,
                       with_shape=with_shape, recipe=TrainRecipe(build=_build, loss=train_loss), example=_example,
                       offline=offline_blocks,
                       summary="DFlash2: architectures DFlash2DraftModel (dynamic convolutions, candidate-pair "
                               "selector)"))

