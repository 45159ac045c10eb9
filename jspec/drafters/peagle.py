"""P-EAGLE: EAGLE-3's layer drafting a whole chain of K tokens in one pass.

The drafter (Hui et al. 2026, "P-EAGLE"; SpecForge `specforge/modeling/draft/peagle.py` for the model and
`specforge/algorithms/peagle/model.py` for the training forward) is EAGLE-3's architecture
(jspec.drafters.eagle3: fc over three target taps, one decoder layer whose input is
cat[input_layernorm(emb(x)), hidden_norm(g)], residual g, lm_head(norm(a)) over a draft vocabulary with
d2t / t2d) plus one learned vector mask_hidden [1, 1, 3 H_t]. Rows are of two kinds:

    depth 0, at position t:        g = fc(cat[u^1_t, u^2_t, u^3_t]),   token x_{t+1}   (EAGLE-3's row t)
    depth d > 0 of anchor t:       g = fc(mask_hidden),                token mask_token_id,  position t + d

(the training forward: `sampled_ids` = the data token at depth 0, `mask_token_id` elsewhere;
`sampled_hidden` = the taps at depth 0, `mask_hidden` elsewhere, both before `project_hidden_states` = fc;
`position_ids` = anchor + depth). Row (t, d) predicts x_{t+2+d}. Its attention (`create_peagle_mask_mod`)
sees the depth-0 rows of anchors <= t (the causal committed context) and the rows of its own rollout with
depth <= d. No row reads another row's output, so the K drafts come from one pass and each draft i is drawn
from row i's own served distribution: q_i does not depend on the drafts before it (independent per-slot q),
scattered to the target ids through d2t with q = 0 outside the draft vocabulary.

Inference: the committed depth-0 rows are EAGLE-3's catch-up (`Eagle3.catch_up`: the layer's K/V cache
holds committed rows only); its last row L - 2 (the anchor's input; L the committed length) is depth 0 and
gives draft 1 (x_L). Rows 1 .. K-1 then run in one pass at positions L - 2 + d, attending to cache rows
0 .. L - 2 and causally among themselves; they never enter the cache, so rejected drafts need no rollback.

Scope: one decoder layer (SpecForge's `num_hidden_layers` > 1 stacks standard Llama layers after the first;
such checkpoints are refused with an error) and a chain (no tree). Training (`jspec train peagle`) is
SpecForge's conditional-on-depth sampling (section "training").

Checkpoints: config.json with architectures [PEagleDraftModel] and EAGLE-3's fields (draft_vocab_size,
target_hidden_size, tap ids); SpecForge names the layer `layers.0.*` and keeps mask_token_id outside the
model config (training config or tokenizer), so jspec reads and writes a top-level `mask_token_id`
(a `dflash_config` section would make the folder detect as DFlash). Tensors: EAGLE-3's plus
`mask_hidden` [1, 1, 3 H_t].
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafters import eagle3
from jspec.drafters.base import DraftContext, Proposal
from jspec.drafters.eagle3 import Eagle3, Eagle3Config, Eagle3State
from jspec.drafters.family import Family, TrainRecipe, register_family
from jspec.errors import CheckpointError
from jspec.io.drafters import read_config, write_checkpoint
from jspec.io.hf import assemble, check_tensors, declared_tensors, export_tensors, read_safetensors
from jspec.models import quant
from jspec.models.declare import shapes
from jspec.verify.sampling import served_logprobs

ARCHITECTURE = "PEagleDraftModel"  # SpecForge's draft-model class, written into config.json
MASK_HIDDEN = "mask_hidden"  # the learned stand-in for the taps at depth > 0, [1, 1, 3 H_t]


def init_params(cfg: Eagle3Config, key: jax.Array, dtype=jnp.float32, std: float = 0.02, d2t=None) -> dict:
    """EAGLE-3's random parameters plus mask_hidden ~ normal(1) (SpecForge: `torch.randn(1, 1, 3 H_t)`)."""
    k1, k2 = jax.random.split(key)
    params = eagle3.init_params(cfg, k1, dtype, std, d2t)
    params[MASK_HIDDEN] = jax.random.normal(k2, (1, 1, 3 * cfg.target_hidden_size), dtype)
    return params


@dataclasses.dataclass(frozen=True)
class PEagle(Eagle3):
    """cfg: the EAGLE-3 layer; block_size: K, the drafts of one pass; mask_token_id: the token id the rows at
    depth > 0 embed. Chains only (tree_budget must stay 0)."""

    mask_token_id: int = 0

    def validate(self, target_cfg, dparams) -> None:
        super().validate(target_cfg, dparams)
        if self.tree_budget:
            raise ValueError(f"tree_budget {self.tree_budget}: a P-EAGLE drafter drafts a chain in one pass; set "
                             "tree_budget 0")
        if not 0 <= self.mask_token_id < target_cfg.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} lies outside the target vocabulary "
                             f"[0, {target_cfg.vocab_size}): use the id the drafter was trained with")
        want = (1, 1, 3 * self.cfg.target_hidden_size)
        if dparams is not None and tuple(dparams[MASK_HIDDEN].shape) != want:
            raise ValueError(f"mask_hidden has shape {tuple(dparams[MASK_HIDDEN].shape)}, expected {want} "
                             "(3 x target_hidden_size)")

    def param_axes(self):
        return {**super().param_axes(), MASK_HIDDEN: (None, None, "taps")}

    def propose(self, dparams, state: Eagle3State, ctx: DraftContext):
        last, k, v, fed = self.catch_up(dparams, state, ctx)
        length, n = ctx.length, self.block_size
        b = last.shape[0]
        index = eagle3.target_index(dparams["d2t"], ctx.target_cfg.vocab_size)
        logits = lambda a: eagle3.to_target(eagle3.draft_logits(dparams, self.cfg, a), index)
        outs = [last]
        if n > 1:  # rows at depth 1 .. K-1: mask_hidden through fc, token mask_token_id, one pass
            m = n - 1
            g = eagle3.fuse(dparams, dparams[MASK_HIDDEN].reshape(3, 1, 1, -1)).astype(last.dtype)
            g = jnp.broadcast_to(g, (b, m, g.shape[-1]))
            toks = jnp.full((b, m), self.mask_token_id, jnp.int32)
            pos = (length - 2)[:, None] + jnp.arange(1, n, dtype=jnp.int32)[None]
            embed = self._embed(dparams, ctx.target_params)
            q, kn, vn = eagle3.project(dparams, self.cfg, quant.embed_rows(embed, toks), g, pos)
            causal = jnp.broadcast_to(jnp.arange(m)[None, :] <= jnp.arange(m)[:, None], (b, m, m))
            limit = jnp.broadcast_to((length - 1)[:, None], (b, m))  # cache rows 0 .. L - 2
            attn = eagle3.attend(q, k, v, limit, (kn, vn, causal))
            a = eagle3.finish(dparams, self.cfg, g, attn)
            outs += [a[:, i] for i in range(m)]
        drafts, qs = [], []
        for i, a in enumerate(outs):
            tok, logp = self.choose(ctx, logits(a), length + i)
            drafts.append(tok)
            qs.append(logp)
        q = jnp.stack(qs, axis=1) if ctx.needs_q else None
        return Proposal(jnp.stack(drafts, axis=1), q), Eagle3State(k, v, state.pending, fed)


# --- checkpoints ----------------------------------------------------------------------------------------------


def _detect(hf: dict) -> bool:
    return ARCHITECTURE in (hf.get("architectures") or ())


def _mask_token_id(hf: dict, where: str) -> int:
    value = hf.get("mask_token_id")
    if value is None:
        raise CheckpointError(f"{where}: no mask_token_id; SpecForge takes it from the training config or the "
                              "tokenizer: add the id used in training to config.json as \"mask_token_id\"")
    if not isinstance(value, int) or isinstance(value, bool):
        raise CheckpointError(f"{where}: mask_token_id must be an integer, got {value!r}")
    return int(value)


def config_from_hf(hf: dict, target_cfg=None, own_embedding: bool = False,
                   where: str = "P-EAGLE config") -> tuple[Eagle3Config, int]:
    """(the layer's Eagle3Config, mask_token_id) of a P-EAGLE config.json."""
    archs = hf.get("architectures") or []
    if ARCHITECTURE not in archs:
        raise CheckpointError(f"{where}: architectures {archs} does not name {ARCHITECTURE}")
    layers = hf.get("num_hidden_layers", 1)
    if layers != 1:
        raise CheckpointError(f"{where}: num_hidden_layers is {layers!r}; jspec implements the one-layer P-EAGLE "
                              "draft model (later layers are standard Llama layers it does not run): use a "
                              "one-layer checkpoint")
    cfg = eagle3.config_from_hf({**hf, "architectures": [eagle3.ARCHITECTURES[0]]}, target_cfg, own_embedding,
                                where)
    return cfg, _mask_token_id(hf, where)


def load_checkpoint(path: str, target_cfg=None, dtype=jnp.float32) -> tuple[Eagle3Config, int, dict]:
    """(config, mask_token_id, parameters) of a P-EAGLE folder; strict about every tensor and both maps."""
    where = f"P-EAGLE checkpoint {path!r}"
    hf = read_config(path)
    found = eagle3.renamed_tensors(read_safetensors(path), where)
    cfg, mask_id = config_from_hf(hf, target_cfg, own_embedding="embed_tokens.weight" in found,
                                  where=os.path.join(path, "config.json"))
    expected = declared_tensors(eagle3.declarations(cfg))
    want = {n: e[0] for n, e in expected.items()}
    want.update(d2t=(cfg.draft_vocab_size,), t2d=(cfg.layer.vocab_size,),
                **{MASK_HIDDEN: (1, 1, 3 * cfg.target_hidden_size)})
    check_tensors(found, want, where, "point the drafter at a P-EAGLE checkpoint whose config.json describes it "
                  "(hidden_size, heads, intermediate_size, draft_vocab_size, vocab_size, target_hidden_size)",
                  dtypes={"d2t": ("int64", "int32"), "t2d": ("bool",)})
    eagle3.check_vocab_map(np.asarray(found["d2t"]), np.asarray(found["t2d"]), cfg, where)
    params = assemble({n: t for n, t in found.items() if n != MASK_HIDDEN}, expected,
                      shapes(eagle3.declarations(cfg)), dtype)
    params["d2t"] = jnp.asarray(np.asarray(found["d2t"]), jnp.int32)
    params[MASK_HIDDEN] = jnp.asarray(np.asarray(found[MASK_HIDDEN]), dtype)
    return cfg, mask_id, params


def save_checkpoint(path: str, cfg: Eagle3Config, mask_token_id: int, params: dict, dtype=None) -> None:
    """Write SpecForge's format: `layers.0.*` for the layer, `mask_hidden`, the maps; config.json with
    architectures [PEagleDraftModel] and mask_token_id."""
    tensors = export_tensors(params, declared_tensors(eagle3.declarations(cfg)), dtype)
    tensors = {(eagle3.VLLM_MIDLAYER + n[len(eagle3.MIDLAYER):] if n.startswith(eagle3.MIDLAYER) else n): t
               for n, t in tensors.items()}
    mask = np.asarray(jax.device_get(params[MASK_HIDDEN]))
    tensors[MASK_HIDDEN] = mask.astype(next(iter(tensors.values())).dtype) if dtype is not None else mask
    d2t = np.asarray(jax.device_get(params["d2t"])).astype(np.int64)
    t2d = np.zeros((cfg.layer.vocab_size,), bool)
    t2d[np.arange(cfg.draft_vocab_size) + d2t] = True
    tensors.update(d2t=d2t, t2d=t2d)
    hf = eagle3.config_to_hf(cfg)
    hf.update(architectures=[ARCHITECTURE], mask_token_id=int(mask_token_id))
    write_checkpoint(path, hf, tensors)


def _load(path: str, target, dtype) -> tuple[PEagle, dict]:
    cfg, mask_id, params = load_checkpoint(path, None if target is None else target.cfg, dtype)
    drafter = PEagle(cfg=cfg, mask_token_id=mask_id)
    if target is not None:
        drafter.validate(target.cfg, params)
    return drafter, params


def _save(path: str, drafter: PEagle, params: dict, dtype=None) -> None:
    save_checkpoint(path, drafter.cfg, drafter.mask_token_id, params, dtype)


def with_shape(drafter: PEagle, block_size: int, tree_budget: int) -> PEagle:
    """A chain of block_size drafts from one pass (P-EAGLE drafts no trees)."""
    if block_size < 1:
        raise ValueError(f"block_size {block_size}: a P-EAGLE drafter drafts at least one token")
    if tree_budget:
        raise ValueError(f"tree_budget {tree_budget}: a P-EAGLE drafter drafts a chain; set tree_budget 0")
    return dataclasses.replace(drafter, block_size=block_size)


# --- training: conditional-on-depth sampling -------------------------------------------------------------------
# SpecForge's OnlinePEagleModel (specforge/algorithms/peagle/model.py): every position t is a depth-0 row
# (EAGLE-3's row t); for d = 1 .. NUM_DEPTHS - 1 a random subset of the anchors whose depth d - 1 row was kept
# also gets a depth-d row, the kept fraction being max(KEEP_DECAY ** d, KEEP_MIN) of the positions
# (`generate_cod_sample_indices`). All rows run in one pass under `create_peagle_mask_mod`: row (t, d) sees
# the depth-0 rows t' <= t and the kept rows (t, d') with d' <= d. Row (t, d) is scored against the target's
# distribution of x_{t+2+d} restricted to the draft vocabulary and renormalised (`compute_peagle_metrics`),
# cross-entropy -sum p log q, averaged over all kept rows of all depths whose token is a response token and
# whose target argmax lies in the draft vocabulary. Here the rows are laid out statically (NUM_DEPTHS x T,
# unkept rows masked out of the keys and the loss), and each depth keeps an anchor kept at depth d - 1 with
# probability r_d / r_{d-1}, so the expected fraction at depth d is r_d.

NUM_DEPTHS, KEEP_DECAY, KEEP_MIN = 8, 0.7, 0.2


def keep_fractions(depths: int = NUM_DEPTHS) -> np.ndarray:
    """r_d = max(KEEP_DECAY ** d, KEEP_MIN) for d = 0 .. depths - 1 (r_0 = 1)."""
    return np.maximum(KEEP_DECAY ** np.arange(depths), KEEP_MIN)


def sample_keep(key: jax.Array, batch: int, length: int, depths: int = NUM_DEPTHS) -> jax.Array:
    """keep [depths, B, T] bool: all of depth 0; depth d nested in depth d - 1, expected fraction r_d."""
    r = keep_fractions(depths)
    u = jax.random.uniform(key, (depths, batch, length))
    step = u < jnp.asarray(np.concatenate([[1.0], r[1:] / r[:-1]]), u.dtype)[:, None, None]
    return jnp.cumprod(step.astype(jnp.int32), axis=0).astype(bool)


def depth_visible(keep: jax.Array) -> jax.Array:
    """[B, D T, D T] bool over rows (t, d) laid out depth-major (index d T + t), keep [D, B, T]: row (t, d) sees
    the depth-0 rows of anchors <= t and the kept rows of its own anchor at depths 1 .. d (itself included).
    The conditional drop-token layout of P-EAGLE and PARD (jspec.drafters.pard)."""
    d, b, t = keep.shape
    depth, anchor = jnp.repeat(jnp.arange(d), t), jnp.tile(jnp.arange(t), d)
    context = (depth[None, :] == 0) & (anchor[None, :] <= anchor[:, None])
    rollout = (depth[None, :] >= 1) & (anchor[None, :] == anchor[:, None]) & (depth[None, :] <= depth[:, None])
    return context[None] | (rollout[None] & jnp.moveaxis(keep, 0, 1).reshape(b, 1, d * t))


def cod_logq(params: dict, cfg: Eagle3Config, mask_token_id: int, embed, taps: jax.Array, tokens: jax.Array,
             keep: jax.Array) -> jax.Array:
    """Draft log q [D, B, T, draft_V] of every row (t, d) (module section above) over tokens [B, T] with the
    target's taps [3, B, T, H_t] and keep [D, B, T]; row (t, d) drafts x_{t+2+d} (rows not kept: garbage)."""
    d, b, t = keep.shape
    g0 = eagle3.fuse(params, taps)  # [B, T, H]
    gm = eagle3.fuse(params, params[MASK_HIDDEN].reshape(3, 1, 1, -1)).astype(g0.dtype)  # [1, 1, H]
    g = jnp.concatenate([g0[None], jnp.broadcast_to(gm[None], (d - 1, b, t, g0.shape[-1]))])  # [D, B, T, H]
    toks = jnp.concatenate([eagle3.shift_rows(tokens, 1)[None], jnp.full((d - 1, b, t), mask_token_id, tokens.dtype)])
    pos = jnp.arange(t, dtype=jnp.int32)[None, None] + jnp.arange(d, dtype=jnp.int32)[:, None, None]
    flat = lambda x: jnp.moveaxis(x, 0, 1).reshape((b, d * t) + x.shape[3:])  # [D, B, T, ...] -> [B, D T, ...]
    gf = flat(g)
    q, k, v = eagle3.project(params, cfg, quant.embed_rows(embed, flat(toks)), gf,
                             flat(jnp.broadcast_to(pos, (d, b, t))))
    visible = depth_visible(keep)
    c = cfg.layer
    qg = q.reshape(b, d * t, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * c.head_dim ** -0.5
    probs = jax.nn.softmax(jnp.where(visible[:, None, None], scores, -jnp.inf), axis=-1).astype(q.dtype)
    attn = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, d * t, c.num_heads, c.head_dim)
    a = eagle3.finish(params, cfg, gf, attn)
    logq = jax.nn.log_softmax(eagle3.draft_logits(params, cfg, a), axis=-1)
    return jnp.moveaxis(logq.reshape(b, d, t, -1), 1, 0)


OWN_LOSS = "cod"  # conditional-on-depth sampled training depths (the only objective this recipe trains)


def train_loss(params, target_params, target_cfg, drafter: PEagle, spec, batch: dict, key: jax.Array):
    """Scalar loss and metrics (module section above). batch: tokens [B, T], loss_mask [B, T]. The run's loss
    is "cod": P-EAGLE trains with its own objective only (`_build` refuses others)."""
    from jspec.train import drafter as train_drafter

    cfg = drafter.cfg
    tokens, loss_mask = batch["tokens"], batch["loss_mask"]
    taps, target_logp = train_drafter.target_pass(target_params, target_cfg, tokens, cfg.taps)
    embed = params["embed"] if cfg.own_embedding else target_params["embed"]
    keep = sample_keep(key, *tokens.shape)
    logq = cod_logq(params, cfg, drafter.mask_token_id, embed, taps, tokens, keep)
    ids = jnp.arange(cfg.draft_vocab_size) + params["d2t"]
    in_draft = jnp.zeros((target_cfg.vocab_size,), bool).at[ids].set(True)
    total, count, metrics = 0.0, 0, {}
    for i in range(logq.shape[0]):
        p_logp = eagle3.shift_rows(target_logp, 1 + i)  # row t: the target's distribution of x_{t+2+i}
        p = jax.nn.softmax(p_logp[..., ids], axis=-1)
        best = jnp.argmax(p_logp, axis=-1)
        mask = keep[i] & (eagle3.shift_rows(loss_mask, 2 + i) > 0) & in_draft[best]
        total = total + jnp.sum(jnp.where(mask, -jnp.sum(p * logq[i], axis=-1), 0.0))
        count = count + jnp.sum(mask)
        hit = (ids[jnp.argmax(logq[i], axis=-1)] == best) & mask
        metrics[f"acc_{i}"] = jnp.sum(hit) / jnp.maximum(jnp.sum(mask), 1)
    metrics["acc"] = metrics["acc_0"]
    return total / jnp.maximum(count, 1), metrics


def _build(run: dict, target, key) -> tuple[PEagle, dict]:
    """A P-EAGLE drafter from a run config's drafter section: EAGLE-3's keys (intermediate_size,
    target_layer_ids, block_size) plus mask_token_id (default the target's last id)."""
    if run["drafter"].get("loss", OWN_LOSS) != OWN_LOSS:
        raise ValueError(f"drafter.loss {run['drafter']['loss']!r}: P-EAGLE trains with its conditional-on-depth "
                         f"objective only; drop the key or set it to {OWN_LOSS!r}")
    base, _ = eagle3.build_drafter(run, target, key)
    mask_id = int(run["drafter"].get("mask_token_id", target.cfg.vocab_size - 1))
    drafter = PEagle(cfg=base.cfg, block_size=base.block_size, mask_token_id=mask_id)
    drafter.validate(target.cfg, None)
    return drafter, init_params(base.cfg, key, std=run.get("init_std", 0.02))


def _example(target) -> tuple[PEagle, dict]:
    """A random P-EAGLE drafter for the target over a draft vocabulary of two thirds of its ids, with a random
    mask_hidden and the target's last id as mask_token_id."""
    tc = target.cfg
    cfg = Eagle3Config(layer=eagle3.layer_config(tc), draft_vocab_size=max(1, 2 * tc.vocab_size // 3),
                       target_hidden_size=tc.hidden_size, taps=eagle3.default_taps(max(tc.num_layers, 4)))
    d2t = eagle3.draft_vocabulary(tc.vocab_size, cfg.draft_vocab_size)
    params = init_params(cfg, jax.random.key(0), target.params["embed"].dtype, std=0.3, d2t=d2t)
    return PEagle(cfg=cfg, block_size=3, mask_token_id=tc.vocab_size - 1), params


def offline_blocks(target_params, target_cfg, drafter: PEagle, dparams, taps, tokens, sampling):
    """The offline evaluator's rounds (`Family.offline`): `cod_logq` with every depth kept is the one pass
    of every round (row (t, d) is slot d + 1 of the round anchored at t + 1: `eagle3.steps_as_blocks`);
    no slot reads a draft."""
    cfg = drafter.cfg
    embed = dparams["embed"] if cfg.own_embedding else target_params["embed"]
    keep = jnp.ones((drafter.num_drafts,) + tokens.shape, bool)
    logq = cod_logq(dparams, cfg, drafter.mask_token_id, embed, taps, tokens, keep)
    logq = eagle3.to_target(logq, eagle3.target_index(dparams["d2t"], target_cfg.vocab_size))

    def blocks(anchors):
        rows = eagle3.steps_as_blocks(logq, anchors)
        return rows, served_logprobs(rows, sampling)
    return blocks


register_family(Family(name="peagle", drafter=PEagle, detect=_detect, load=_load, save=_save, with_shape=with_shape,
                       recipe=TrainRecipe(build=_build, loss=train_loss, frozen=("d2t",), own_loss=OWN_LOSS),
                       example=_example, offline=offline_blocks,
                       summary="P-EAGLE (SpecForge): config.json with architectures [PEagleDraftModel]"))
