"""MTP: the target's own multi-token-prediction module (Qwen3.5 / Qwen3-Next checkpoints), drafting a chain.

Released Qwen3.5 and Qwen3-Next checkpoints carry, beside the model, one extra decoder layer trained to
predict the token after next (config.json: `mtp_num_hidden_layers` 1, `mtp_use_dedicated_embeddings`
false). Its tensors, top-level under `mtp.`: `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `norm`
(zero-centred RMSNorms, [D]), `fc` [D, 2D] and `layers.0.*`, a full-attention layer of the target's own
kind (gated q_proj, q/k norms, partial RoPE, a dense or MoE MLP by the target's rule for layer 0). The
embedding and the LM head are the target's. Row i of the module, at position i, reads the target's
final-normed hidden state h_i (after token x_i) and the next token x_{i+1}:

    u_i = fc(cat[pre_fc_norm_embedding(embed(x_{i+1})), pre_fc_norm_hidden(h_i)])     (embedding first)
    o_i = norm(layer(u_i))            the layer attends over the module's own K/V rows 0 .. i
    q(x_{i+2}) = the served softmax of the target's LM head on o_i

as vLLM runs it (vllm/model_executor/models/qwen3_next_mtp.py and qwen3_5_mtp.py,
`*MultiTokenPredictor.forward`: norm both inputs, cat([embeds, hidden]), fc, layer, `self.norm`; the
proposer shifts the input ids left by one and keeps the target's positions,
vllm/v1/spec_decode/llm_base_proposer.py `set_inputs_first_pass`; the target hidden it passes is the
model's output after its final norm, `Qwen3NextModel.forward`). Depth k > 1 reuses the one module
autoregressively: row i + 1 reads the previous draft and, in place of the target's unknown h_{i+1}, the
module's own output o_i after `mtp.norm`, since the Qwen MTP models return that one tensor both for the
logits and as the next step's hidden state (`llm_base_proposer.py` `model_returns_tuple`: False for
method "mtp" unless the architecture is one of DeepSeek's, GLM-5's or Kimi's).

The module's K/V row i needs h_i, which the target computes when it verifies x_i, so the module's
context lags the target's by one token: with the committed text x_0 .. x_{L-1} (anchor x_{L-1}), rows
0 .. L-2 are exact, and row L-2 (h_{L-2}, the anchor) is the first draft's. The state keeps the rows
before `fed` in its cache and the target hidden states of the committed rows not fed yet (the prompt's
last one after the prefill, the verify pass's rows after a commit). Each round first feeds those rows
(at most g + 1, causal among themselves), the last of them giving draft 1, then runs g - 1 single rows
on its own outputs. Draft rows lie at or past row L - 1: the round's later drafts read them, and the next
round's catch-up starts at row L - 1 with only rows below it as context, overwriting them, so rejected
drafts need no rollback.

The prompt's hidden states reach `init` as a tap of the target's last layer (PrefillInfo.taps), to which
the drafter applies the target's final norm; the committed rows' come with CommitInfo.hidden.

The same drafter runs DeepSeek-V3's layout of the module (`layout="deepseek"`, `jspec.drafters.nextn`:
`enorm`, `hnorm`, `eh_proj`, `shared_head.*` around a decoder layer of a dense target, the module's own
embedding and head, and the pre-norm output fed to the next depth). Only the module's rows and its head
differ (`MTP.rows`, `MTP.head_logits`); the rounds, the commit and the training are the same.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jspec.drafters import nextn
from jspec.drafters.base import CommitInfo, DraftContext, Drafter, PrefillInfo, Proposal
from jspec.drafters.family import Family, TrainRecipe, register_family
from jspec.errors import CheckpointError
from jspec.io.drafters import read_config, write_checkpoint
from jspec.io.files import read_json_object
from jspec.io.hf_hybrid import load_mtp_params, mtp_tensors
from jspec.models import hybrid, quant
from jspec.models import target as tm
from jspec.models.attention import KV_CHUNK
from jspec.models.config import ModelConfig
from jspec.models.declare import abstract_tree, declare, init_tree, logical_axes, unbox
from jspec.models.layers import linear, zc_rms_norm
from jspec.verify.sampling import served_logprobs

# The draft-model architectures of vLLM's MTP models, by the family of the target they serve: the
# `architectures` of a saved MTP drafter's config.json (what `detect` recognises).
ARCHITECTURES = {"qwen3_5": "Qwen3_5MTP", "qwen3_next": "Qwen3NextMTP"}
_CAUSAL_LM = {"qwen3_5": ("qwen3_5_text", "Qwen3_5ForCausalLM"), "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM")}
LAYOUTS = ("qwen", "deepseek")  # the module's tensors: Qwen3.5 / Qwen3-Next `mtp.*`, or DeepSeek-V3's (nextn.py)


def layer_config(target_cfg) -> hybrid.HybridConfig:
    """The MTP layer's config: a hybrid target's own, with one full-attention layer (index 0, so the
    target's rule for layer 0 picks a dense or MoE MLP, as vLLM's `extract_layer_index("mtp.layers.0")`
    does). A dense target (which has no MTP module; tests and the conformance example draft with a random
    one) gets a Qwen3.5 layer of its sizes."""
    if tm.is_hybrid(target_cfg):
        return dataclasses.replace(target_cfg, num_layers=1, layer_types=(hybrid.FULL,))
    c = target_cfg
    rotary = 0.25 if int(c.head_dim * 0.25) >= 2 and int(c.head_dim * 0.25) % 2 == 0 else 1.0
    return hybrid.HybridConfig(
        family="qwen3_5", vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=1,
        layer_types=(hybrid.FULL,), num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=c.head_dim,
        linear_value_head_dim=c.head_dim, linear_conv_kernel_dim=4, intermediate_size=c.intermediate_size,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, partial_rotary_factor=rotary,
        tie_word_embeddings=c.tie_word_embeddings, eos_token_ids=c.eos_token_ids, bos_token_id=c.bos_token_id,
        max_position_embeddings=c.max_position_embeddings)


class MTPNet(nn.Module):
    """The MTP module's parameters, declared once (`jspec.models.declare`): the three zero-centred norms
    [D], fc [D, 2D] ([out, in]; input = [embedding | hidden]) and the decoder layer `layer`
    (`hybrid.HybridLayer` of `cfg`, declared as `model.layers.0.*`, which the loader reads under `mtp.`)."""

    cfg: hybrid.HybridConfig
    init_std: float = 0.02
    param_dtype: Any = jnp.float32

    def setup(self):
        d = self.cfg.hidden_size
        decl = functools.partial(declare, self, std=self.init_std, dtype=self.param_dtype)
        norm = lambda name: decl(name, (d,), ("embed",), "zeros", f"mtp.{name}.weight")
        self.pre_fc_norm_embedding = norm("pre_fc_norm_embedding")
        self.pre_fc_norm_hidden = norm("pre_fc_norm_hidden")
        self.fc = decl("fc", (d, 2 * d), ("embed", "taps"), "normal", "mtp.fc.weight")
        self.norm = norm("norm")
        self.layer = hybrid.HybridLayer(self.cfg, 0, self.init_std, self.param_dtype, name="layer")

    def declare(self):
        return self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.fc, self.norm, self.layer.declare()

    def __call__(self, embedded, hidden, k, v, ps: hybrid.PassInputs):
        """embedded [B, T, D] (the target's embedding rows of x_{i+1}), hidden [B, T, D] (h_i) ->
        (o [B, T, D] after `mtp.norm`, k, v)."""
        eps = self.cfg.rms_norm_eps
        e = zc_rms_norm(embedded, self.pre_fc_norm_embedding, eps)
        h = zc_rms_norm(hidden, self.pre_fc_norm_hidden, eps).astype(e.dtype)
        u = linear(jnp.concatenate([e, h], axis=-1), self.fc)
        out, (k, v), _ = self.layer(u, (k, v), ps)
        return zc_rms_norm(out, self.norm, eps), k, v


@functools.lru_cache(maxsize=64)  # tracing the declarations is cheap but not free
def declarations(cfg: hybrid.HybridConfig, dtype=jnp.float32) -> dict:
    """Every parameter's declaration (boxes of ShapeDtypeStructs): the top-level ones and "layer"."""
    return abstract_tree(MTPNet(cfg, param_dtype=dtype), MTPNet.declare)["params"]


def init_params(cfg: hybrid.HybridConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random parameters (zero-centred norms at 0, matrices normal(std))."""
    return unbox(init_tree(MTPNet(cfg, init_std=std, param_dtype=dtype), MTPNet.declare, key))["params"]


def mtp_rows(params: dict, cfg: hybrid.HybridConfig, embed, tokens, hidden, positions, k, v, ctx_len):
    """The module over T rows per batch row: tokens [B, T] (x_{i+1}), hidden [B, T, D] (h_i), at
    positions [B, T] (also their cache rows; consecutive), over cache rows < ctx_len [B] and the rows
    before them in this pass. embed: the target's embedding. Returns (o [B, T, D], k, v)."""
    ps = hybrid.PassInputs(positions, positions, ctx_len, None, None, None, jnp.asarray(hybrid.rope_inv_freq(cfg)),
                           False, "recurrent", 64)
    return MTPNet(cfg).apply({"params": params}, quant.embed_rows(embed, tokens), hidden, k, v, ps)


def _architecture(cfg: hybrid.HybridConfig) -> hybrid.HybridConfig:
    """cfg without its token ids and context length (which do not change the module's computation)."""
    ids = dict(eos_token_ids=(), bos_token_id=None, pad_token_id=None, max_position_embeddings=0)
    return dataclasses.replace(cfg, **{k: v for k, v in ids.items() if hasattr(cfg, k)})


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MTPState:
    k: jax.Array  # [B, Hkv, S, Dh] the module's K/V; rows < fed are exact
    v: jax.Array
    hidden: jax.Array  # [B, g + 1, D] the target's hidden states at positions fed, fed + 1, ... (not fed yet)
    fed: jax.Array  # [B] module rows computed from committed inputs (0 .. fed - 1)


@dataclasses.dataclass(frozen=True)
class MTP(Drafter):
    """cfg: the MTP layer's config (`layer_config` of the target's, or `nextn.layer_config` for the DeepSeek
    layout); target_layers: the target's layer count (its last layer is tapped for the prompt's hidden
    states); block_size: drafts per round; layout: "qwen" or "deepseek" (module docstring)."""

    cfg: hybrid.HybridConfig | ModelConfig | None = None
    target_layers: int = 0
    block_size: int = 4
    layout: str = "qwen"

    @property
    def num_drafts(self) -> int:
        return self.block_size

    @property
    def taps(self) -> tuple[int, ...]:
        return (self.target_layers - 1,)

    def validate(self, target_cfg, dparams) -> None:
        if self.cfg is None:
            raise ValueError("the MTP drafter needs its layer config: MTP(cfg=layer_config(target_cfg), ...)")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown MTP layout {self.layout!r}: one of {list(LAYOUTS)}")
        if self.target_layers != target_cfg.num_layers:
            raise ValueError(f"the MTP drafter was built for a target of {self.target_layers} layers, this one has "
                             f"{target_cfg.num_layers}: build it for this target (jspec.load_drafter('mtp', target))")
        if self.layout == "deepseek":
            if tm.is_hybrid(target_cfg):
                raise ValueError("a DeepSeek-layout MTP module runs over a dense (Llama / Qwen3) target here; a "
                                 "Qwen3.5 / Qwen3-Next target carries its own mtp.* module: "
                                 "jspec.load_drafter('mtp', target)")
            if _architecture(self.cfg) != _architecture(nextn.layer_config(target_cfg)):
                raise ValueError("the DeepSeek-layout MTP module's layer differs from the target's (hidden size, "
                                 "heads, MLP, RoPE or vocabulary): it serves only the model it was trained with")
        elif tm.is_hybrid(target_cfg) and _architecture(self.cfg) != _architecture(layer_config(target_cfg)):
            raise ValueError("the MTP module's config differs from the target's (hidden size, heads, MLP, RoPE or "
                             "vocabulary): an MTP module serves only the model it was trained with; load it from "
                             "the target's own checkpoint (jspec.load_drafter('mtp', target))")
        for name, mine, theirs in (("vocabulary", self.cfg.vocab_size, target_cfg.vocab_size),
                                   ("hidden size", self.cfg.hidden_size, target_cfg.hidden_size)):
            if mine != theirs:
                raise ValueError(f"MTP module {name} ({mine}) differs from the target's ({theirs}): it reads the "
                                 "target's hidden states and shares its embedding and LM head")

    def param_axes(self):
        return logical_axes((nextn.declarations if self.layout == "deepseek" else declarations)(self.cfg))

    def rows(self, dparams, target_params, tokens, hidden, positions, k, v, ctx_len, kv_chunk=KV_CHUNK):
        """The module over T rows per batch row: tokens [B, T] (x_{i+1}), hidden [B, T, D] (h_i), at positions
        [B, T] (also their cache rows; consecutive), over cache rows < ctx_len [B] and the rows before them in
        this pass. Returns (o [B, T, D]: what the head reads and the next depth takes as its hidden, k, v).
        kv_chunk: the DeepSeek layout's attention step (None: one block, for training passes)."""
        if self.layout == "deepseek":
            return nextn.rows(dparams, self.cfg, tokens, hidden, positions, k, v, ctx_len, kv_chunk)
        return mtp_rows(dparams, self.cfg, target_params["embed"], tokens, hidden, positions, k, v, ctx_len)

    def head_logits(self, dparams, target_params, target_cfg, o) -> jax.Array:
        """float32 logits of module outputs o: the target's head (Qwen) or the module's shared_head (DeepSeek)."""
        if self.layout == "deepseek":
            return nextn.logits(dparams, self.cfg, o)
        return tm.logits(target_params, target_cfg, o)

    def init(self, dparams, prefill: PrefillInfo, cache_size: int) -> MTPState:
        b, p = prefill.prompts.shape
        c = self.cfg
        dtype = dparams["eh_proj" if self.layout == "deepseek" else "fc"].dtype
        kv = jnp.zeros((b, c.num_kv_heads, cache_size, c.head_dim), dtype)
        k, v = kv, kv
        hidden = tm.final_norm(prefill.target_params, prefill.target_cfg, prefill.taps[0])  # [B, P, D]
        if p > 1:  # rows 0 .. P-2: (h_i, x_{i+1}); a shorter prompt's rows past its own are overwritten later
            pos = jnp.broadcast_to(jnp.arange(p - 1, dtype=jnp.int32), (b, p - 1))
            _, k, v = self.rows(dparams, prefill.target_params, prefill.prompts[:, 1:], hidden[:, : p - 1], pos, k,
                                v, jnp.zeros((b,), jnp.int32))
        last = jnp.take_along_axis(hidden, (prefill.prompt_len - 1)[:, None, None], axis=1)  # h at the prompt's end
        pending = jnp.zeros((b, self.block_size + 1, c.hidden_size), hidden.dtype).at[:, :1].set(last)
        return MTPState(k, v, pending, prefill.prompt_len - 1)

    def propose(self, dparams, state: MTPState, ctx: DraftContext):
        length, g = ctx.length, self.block_size
        # Catch up on rows fed .. length - 2 (at most g + 1; none for a row that is done), their inputs the
        # committed tokens after them; the last one's output drafts the token at index `length`.
        start, width = state.fed, g + 1
        pos = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
        toks = jnp.take_along_axis(ctx.tokens, jnp.minimum(pos + 1, ctx.tokens.shape[1] - 1), axis=1)
        new = jnp.clip(length - 1 - start, 0, width)
        out, k, v = self.rows(dparams, ctx.target_params, toks, state.hidden, pos, state.k, state.v, start)
        last = jnp.take_along_axis(out, jnp.maximum(new - 1, 0)[:, None, None], axis=1)[:, 0]
        head = functools.partial(self.head_logits, dparams, ctx.target_params, ctx.target_cfg)
        first, first_logp = self.choose(ctx, head(last), length)

        # Depth > 1: the previous draft and, for the unknown h, the module's own output (after mtp.norm in the
        # Qwen layout, the one tensor vLLM's Qwen MTP models return for both the logits and the next step;
        # before shared_head.norm in DeepSeek's; module docstrings).
        def step(carry, i):
            k, v, h, token = carry
            row = (length - 2 + i)[:, None]  # draft i + 1's input row
            o, k, v = self.rows(dparams, ctx.target_params, token[:, None], h[:, None], row, k, v, row[:, 0])
            nxt, logp = self.choose(ctx, head(o[:, 0]), length + i)
            return (k, v, o[:, 0], nxt), (nxt, logp if ctx.needs_q else None)

        (k, v, _, _), (rest, rest_logp) = jax.lax.scan(step, (k, v, last, first), jnp.arange(1, g))
        drafts = jnp.concatenate([first[:, None], rest.T], axis=1)
        q = None
        if ctx.needs_q:
            q = jnp.concatenate([first_logp[:, None], jnp.moveaxis(rest_logp, 0, 1)], axis=1)
        return Proposal(drafts, q), MTPState(k, v, state.hidden, start + new)

    def commit(self, dparams, state: MTPState, info: CommitInfo) -> MTPState:
        # The committed rows old_length - 1 .. new_length - 2 are the next round's catch-up: their target
        # hidden states are info.hidden's first rows, at positions fed (= old_length - 1 after propose) on.
        hidden = info.hidden[:, : self.block_size + 1].astype(state.hidden.dtype)
        return dataclasses.replace(state, hidden=hidden)


# --- checkpoints --------------------------------------------------------------------------------
# A saved MTP drafter: config.json (the layer's hybrid config, one full-attention layer, with
# architectures [Qwen3_5MTP] or [Qwen3NextMTP], mtp_num_hidden_layers 1, mtp_use_dedicated_embeddings
# false and num_target_layers) and model.safetensors holding the mtp.* tensors under their official names.


def _detect(hf: dict) -> bool:
    return any(a in ARCHITECTURES.values() for a in hf.get("architectures") or ()) or nextn.is_nextn_config(hf)


def _check_mtp_fields(hf: dict, where: str) -> None:
    """The config's MTP fields must describe the module jspec runs: one layer sharing the target's embedding."""
    layers = hf.get("mtp_num_hidden_layers", hf.get("num_nextn_predict_layers", 1))
    if layers != 1:
        raise CheckpointError(f"{where}: mtp_num_hidden_layers is {layers!r}; the MTP drafter runs one MTP layer "
                              "(the released Qwen3.5 / Qwen3-Next checkpoints have 1)")
    if hf.get("mtp_use_dedicated_embeddings", False):
        raise CheckpointError(f"{where}: mtp_use_dedicated_embeddings is true, which the MTP drafter does not "
                              "support: it embeds with the target's embedding")


def _text_config(hf: dict) -> dict:
    return hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf


def load(path: str, target, dtype) -> tuple[MTP, dict]:
    """A saved MTP drafter (see above); with a target, it must be the target's own module."""
    hf = read_config(path)
    if nextn.is_nextn_config(hf):
        cfg, n_target, params = nextn.load_folder(path, hf, dtype)
        drafter = MTP(cfg=cfg, target_layers=n_target, layout="deepseek")
        if target is not None:
            drafter.validate(target.cfg, None)
        return drafter, params
    where = os.path.join(path, "config.json")
    fam = next((f for f, a in ARCHITECTURES.items() if a in (hf.get("architectures") or ())), None)
    if fam is None:
        raise CheckpointError(f"{where}: architectures {hf.get('architectures')} names no MTP drafter; a saved MTP "
                              f"drafter's is one of {sorted(ARCHITECTURES.values())}")
    _check_mtp_fields(hf, where)
    model_type, causal = _CAUSAL_LM[fam]
    cfg = hybrid.HybridConfig.from_hf_dict({**hf, "model_type": model_type, "architectures": [causal]})
    if cfg.layer_types != (hybrid.FULL,):
        raise CheckpointError(f"{where}: an MTP drafter's config describes its one full-attention layer, got "
                              f"layer_types {list(cfg.layer_types)}")
    n_target = hf.get("num_target_layers")
    if not isinstance(n_target, int) or n_target < 1:
        raise CheckpointError(f"{where}: num_target_layers (the layer count of the target the module serves) is "
                              f"{n_target!r}; it must be an integer >= 1")
    drafter = MTP(cfg=cfg, target_layers=n_target)
    if target is not None:
        drafter.validate(target.cfg, None)
    return drafter, load_mtp_params(path, cfg, declarations(cfg), dtype)


def save(path: str, drafter: MTP, params: dict, dtype=None) -> None:
    cfg = drafter.cfg
    if drafter.layout == "deepseek":
        return nextn.save_folder(path, cfg, drafter.target_layers, params, dtype)
    config = {**cfg.to_hf_dict(), "architectures": [ARCHITECTURES[cfg.family]], "mtp_num_hidden_layers": 1,
              "mtp_use_dedicated_embeddings": False, "num_target_layers": drafter.target_layers}
    write_checkpoint(path, config, mtp_tensors(cfg, declarations(cfg), params, dtype))


def _nextn_layers(target) -> Any:
    """config.json's num_nextn_predict_layers of a target folder (None without one)."""
    path = os.path.join(target.path, "config.json") if target.path else None
    return _text_config(read_json_object(path)).get("num_nextn_predict_layers") if path and os.path.exists(path) else None


def from_target(target) -> tuple[MTP, dict]:
    """The target's own MTP module: the `mtp.*` tensors of a Qwen3.5 / Qwen3-Next checkpoint folder, or the
    DeepSeek-layout layer after a dense model's own (config.json's num_nextn_predict_layers)."""
    if not tm.is_hybrid(target.cfg):
        if not _nextn_layers(target):
            raise ValueError(
                f"the mtp drafter runs the multi-token-prediction module a checkpoint carries (Qwen3.5 / Qwen3-Next "
                f"mtp.* tensors, or a DeepSeek-layout layer that config.json's num_nextn_predict_layers declares); "
                f"the target {target.path!r} is a {target.cfg.family} model which has none: pick another drafter")
        cfg = nextn.layer_config(target.cfg)
        params = nextn.load_from_target(target.path, cfg, target.cfg.num_layers, target.params["final_norm"].dtype)
        return MTP(cfg=cfg, target_layers=target.cfg.num_layers, layout="deepseek"), params
    if target.path is None:
        raise ValueError("the mtp drafter reads the mtp.* tensors of the target's checkpoint folder, and this target "
                         "has none (target.path is None): load the target with jspec.load_target(folder), or pass "
                         "(MTP(...), params) built with jspec.drafters.mtp")
    cfg_path = os.path.join(target.path, "config.json")
    if os.path.exists(cfg_path):
        _check_mtp_fields(_text_config(read_json_object(cfg_path)), cfg_path)
    cfg = layer_config(target.cfg)
    params = load_mtp_params(target.path, cfg, declarations(cfg), target.params["final_norm"].dtype)
    return MTP(cfg=cfg, target_layers=target.cfg.num_layers), params


def with_shape(drafter: MTP, block_size: int, tree_budget: int) -> MTP:
    if tree_budget:
        raise ValueError("the MTP drafter drafts chains: drop the tree budget for it")
    return dataclasses.replace(drafter, block_size=block_size)


# --- training (`jspec train mtp`): the module on a frozen target, next-next-token objective -----------------
# Row i reads (h_i, x_{i+1}) and is scored on x_{i+2} against the target's distribution of it (the run's
# loss: "ce" is the published objective, CE(q, x_{t+2})), with one teacher-forced pass over the whole
# sequence, causal like the catch-up rows. Depth 1 only: the chained depths reuse the module on its own
# outputs at inference, as vLLM runs the released modules, which were trained the same way.


def _build(run: dict, target, key) -> tuple[MTP, dict]:
    """From the drafter section: block_size (drafts per round, default 4) and layout ("qwen", the default, or
    "deepseek" over a dense target: its embedding and shared head start as copies of the target's and stay
    frozen, as DeepSeek-V3 shares them with the model)."""
    section = run["drafter"]
    block = section.get("block_size", 4)
    layout = section.get("layout", "qwen")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"the MTP drafter's block_size (drafts per round) must be an int >= 1, got {block!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"the MTP drafter's layout must be one of {list(LAYOUTS)}, got {layout!r}")
    dtype, std = target.params["final_norm"].dtype, run.get("init_std", 0.02)
    if layout == "deepseek":
        if tm.is_hybrid(target.cfg):
            raise ValueError("the DeepSeek MTP layout trains over a dense (Llama / Qwen3) target; a Qwen3.5 / "
                             "Qwen3-Next target's module has the Qwen layout: drop \"layout\" from the drafter section")
        cfg = nextn.layer_config(target.cfg)
        drafter = MTP(cfg=cfg, target_layers=target.cfg.num_layers, block_size=block, layout=layout)
        params = nextn.init_params(cfg, key, dtype, std=std)
        head = target.params["embed"] if target.cfg.tie_word_embeddings else target.params["lm_head"]
        return drafter, {**params, "embed": target.params["embed"], "head": head}
    cfg = layer_config(target.cfg)
    params = init_params(cfg, key, dtype, std=std)
    return MTP(cfg=cfg, target_layers=target.cfg.num_layers, block_size=block), params


def train_loss(params, target_params, target_cfg, drafter: MTP, spec, batch: dict, key: jax.Array):
    """The run's distribution loss of row i's q against the target's row for x_{i+2}, over response tokens
    (row i is the one-draft round anchored at x_{i+1}); the rollout losses (EDR, Draft-OPD) over a window of
    consecutive anchors of the response (`drafter.window_anchors`)."""
    from jspec.train import drafter as train_drafter
    from jspec.train import losses

    tokens, loss_mask = batch["tokens"], batch["loss_mask"]
    b, t = tokens.shape
    taps, target_logp = train_drafter.target_pass(target_params, target_cfg, tokens, drafter.taps)
    hidden = tm.final_norm(target_params, target_cfg, taps[0])
    c = drafter.cfg
    kv = jnp.zeros((b, c.num_kv_heads, t, c.head_dim), hidden.dtype)
    pos = jnp.broadcast_to(jnp.arange(t - 2, dtype=jnp.int32), (b, t - 2))
    out, _, _ = drafter.rows(params, target_params, tokens[:, 1:-1], hidden[:, :-2], pos, kv, kv,
                             jnp.zeros((b,), jnp.int32), kv_chunk=None)
    draft_logp = jax.nn.log_softmax(drafter.head_logits(params, target_params, target_cfg, out), axis=-1)[:, :, None]
    labels = tokens[:, 2:, None]
    mask = (loss_mask[:, 2:, None] > 0).astype(jnp.float32)
    p_t = target_logp[:, 1:-1, None]  # the target's distribution of x_{i+2}: its output at i + 1
    if spec.name in losses.WINDOW_LOSSES:  # the rollout losses read a window of consecutive anchors a (row a - 1)
        anchors, valid = train_drafter.window_anchors(key, loss_mask, spec.num_anchors)
        rows = jnp.clip(anchors - 1, 0, t - 3)
        draft_logp, p_t, labels, mask = (jnp.take_along_axis(x, rows.reshape(rows.shape + (1,) * (x.ndim - 2)), 1)
                                         for x in (draft_logp, p_t, labels, mask))
        mask = mask * (valid & (anchors >= 1) & (anchors <= t - 2))[..., None]
    loss = train_drafter.distribution_loss(spec, draft_logp, p_t, labels, mask)
    return loss, train_drafter.metrics(draft_logp, p_t, labels, mask)


def offline_blocks(target_params, target_cfg, drafter: MTP, dparams, taps, tokens, sampling):
    """The offline evaluator's rounds (`Family.offline`), as `MTP.propose` teacher-forced: one pass over
    the text fills the module's cache rows j = 0 .. T - 2 with (h_j, x_{j+1}); slot 1 of the round anchored
    at a is row a - 1's output; slot i + 1 runs row a - 1 + i on slot i's output and the text's x_{a+i}
    (draft i when accepted) over that cache, in which slots 2 .. i wrote their rows."""
    c, g = drafter.cfg, drafter.num_drafts
    b, t = tokens.shape
    hidden = tm.final_norm(target_params, target_cfg, taps[0])
    kv = jnp.zeros((b, c.num_kv_heads, t + g, c.head_dim), hidden.dtype)  # rows up to a - 1 + g - 1 <= T + g - 2
    pos = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32), (b, t - 1))
    out, k0, v0 = drafter.rows(dparams, target_params, tokens[:, 1:], hidden[:, :-1], pos, kv, kv,
                               jnp.zeros((b,), jnp.int32))

    def blocks(anchors):
        n = anchors.shape[1]
        a = anchors.reshape(-1)
        text = jnp.repeat(tokens, n, axis=0)
        first = out[jnp.arange(b)[:, None], jnp.maximum(anchors - 1, 0)].reshape(b * n, -1)

        def step(carry, i):
            k, v, h = carry
            row = a - 1 + i
            token = jnp.take_along_axis(text, jnp.minimum(a + i, t - 1)[:, None], axis=1)
            o, k, v = drafter.rows(dparams, target_params, token, h[:, None], row[:, None], k, v, row)
            return (k, v, o[:, 0]), o[:, 0]

        kv0 = tuple(jnp.repeat(x, n, axis=0) for x in (k0, v0))
        _, rest = jax.lax.scan(step, kv0 + (first,), jnp.arange(1, g))
        states = jnp.concatenate([first[:, None], jnp.moveaxis(rest, 0, 1)], axis=1)  # [B A, g, D]
        logits = drafter.head_logits(dparams, target_params, target_cfg, states).reshape(b, n, g, -1)
        return logits, served_logprobs(logits, sampling)
    return blocks


def _example(target) -> tuple[MTP, dict]:
    """A random MTP module for the target's shape (conformance fixtures are dense targets without one)."""
    cfg = layer_config(target.cfg)
    params = init_params(cfg, jax.random.key(0), target.params["final_norm"].dtype, std=0.3)
    return MTP(cfg=cfg, target_layers=target.cfg.num_layers, block_size=3), params


register_family(Family(name="mtp", drafter=MTP, detect=_detect, load=load, save=save, lookup=from_target,
                       with_shape=with_shape, example=_example,
                       recipe=TrainRecipe(build=_build, loss=train_loss, frozen=("embed", "head")),
                       offline=offline_blocks,
                       summary="the target's own multi-token-prediction module (mtp.* tensors of a Qwen3.5 / "
                               "Qwen3-Next checkpoint, or DeepSeek-V3's layout over a dense target)"))
