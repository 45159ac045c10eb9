"""The DeepSeek-V3 layout of a multi-token-prediction module ("NextN"), over jspec's dense targets.

DeepSeek-V3 (and the models that reuse its layout) stores its MTP module as one more decoder layer after
the model's own, `model.layers.{n}.*` with n = num_hidden_layers, and config.json says how many:
`num_nextn_predict_layers` (1 in the released checkpoints). Beside the decoder layer's own tensors
(`input_layernorm`, `self_attn.*`, `post_attention_layernorm`, `mlp.*`) the layer holds

    enorm, hnorm          RMSNorms [D] of the embedding and of the target's hidden state
    eh_proj [D, 2D]       the projection of cat[enorm(embed(x_{i+1})), hnorm(h_i)]  (embedding first)
    shared_head.norm [D]  the norm before the head
    shared_head.head [V, D], embed_tokens [V, D]   the module's head and embedding (copies of the model's)

and row i at position i computes, as vLLM's `DeepSeekMultiTokenPredictorLayer` and SGLang's
`DeepseekModelNextN` run it:

    u_i = eh_proj(cat[enorm(embed(x_{i+1})), hnorm(h_i)])
    o_i = layer(u_i)                 the residual stream after the layer (no final norm); the layer
                                     attends over the module's own K/V rows 0 .. i
    q(x_{i+2}) = softmax of shared_head.head(shared_head.norm(o_i))

h_i is the target's final-normed hidden state after x_i. A chained depth k > 1 reads o_i itself, before
`shared_head.norm`, in place of the target's unknown hidden state (the DeepSeek-V3 report's h^k, and
what vLLM's DeepSeek MTP returns for the next step); the Qwen layout (`jspec.drafters.mtp`) passes the
normed output instead. vLLM zeroes the embedding of the row at position 0; SGLang and the report do not,
and neither does jspec (the row predicts x_2 from x_1, which it needs).

The decoder layer is the target's own kind: DeepSeek-V3's is a Multi-head Latent Attention layer with a
DeepSeekMoE MLP, which jspec does not implement (its targets are Llama / Qwen3 and Gated DeltaNet
hybrids), so jspec runs the layout over its dense targets, with a Llama / Qwen3 layer of the target's
shape (`transformer.DecoderLayer`), and refuses a DeepSeek-V3 module by name.

Where the tensors live:
- a target checkpoint whose config.json has `num_nextn_predict_layers: 1` holds them under
  `model.layers.{num_hidden_layers}.` (the target's loader leaves them to the drafter);
- a saved drafter folder (SGLang's standalone NextN export) holds them under `model.layers.0.`, with a
  one-layer config of the target's model type, `num_nextn_predict_layers: 1`, `architectures`
  [<the target's architecture>NextN] (DeepSeek's export: DeepseekV3ForCausalLMNextN) and
  `num_target_layers`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jspec.errors import CheckpointError
from jspec.io.drafters import write_checkpoint
from jspec.io.files import read_json_object
from jspec.io.hf import assemble, check_tensors, declared_tensors, export_tensors, read_safetensors
from jspec.models import quant, transformer
from jspec.models.attention import KV_CHUNK
from jspec.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, default_rope_inv_freq
from jspec.models.declare import abstract_tree, declare, init_tree, shapes, unbox
from jspec.models.layers import linear, lm_logits, rms_norm

PREFIX = "model.layers.0."  # the declared names: a saved folder's; a target checkpoint's are renamed to these
ARCH_SUFFIX = "NextN"
# Config fields of DeepSeek-V3's Multi-head Latent Attention and DeepSeekMoE layers.
DEEPSEEK_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "n_routed_experts")


def layer_config(target_cfg: ModelConfig) -> ModelConfig:
    """The module's decoder layer: one full-attention layer of the dense target's shape."""
    return dataclasses.replace(target_cfg, num_layers=1, layer_types=(), sliding_window=None)


class NextNNet(nn.Module):
    """The module's parameters, declared once (`jspec.models.declare`) under their `model.layers.0.` names:
    embed, enorm, hnorm, eh_proj ([out, in]; input = [embedding | hidden]), head_norm, head and the decoder
    layer `layer`."""

    cfg: ModelConfig
    init_std: float = 0.02
    param_dtype: Any = jnp.float32

    def setup(self):
        d, v = self.cfg.hidden_size, self.cfg.vocab_size
        decl = functools.partial(declare, self, std=self.init_std, dtype=self.param_dtype)
        norm = lambda name, hf: decl(name, (d,), ("embed",), "ones", PREFIX + hf)
        self.embed = decl("embed", (v, d), ("vocab", "embed"), "normal", PREFIX + "embed_tokens.weight")
        self.enorm = norm("enorm", "enorm.weight")
        self.hnorm = norm("hnorm", "hnorm.weight")
        self.eh_proj = decl("eh_proj", (d, 2 * d), ("embed", "taps"), "normal", PREFIX + "eh_proj.weight")
        self.head_norm = norm("head_norm", "shared_head.norm.weight")
        self.head = decl("head", (v, d), ("vocab", "embed"), "normal", PREFIX + "shared_head.head.weight")
        self.layer = transformer.DecoderLayer(self.cfg, PREFIX, self.init_std, self.param_dtype, name="layer")

    def declare(self):
        return self.embed, self.enorm, self.hnorm, self.eh_proj, self.head_norm, self.head, self.layer.declare()

    def __call__(self, tokens, hidden, k, v, positions, ctx_len, kv_chunk):
        """tokens [B, T] (x_{i+1}), hidden [B, T, D] (h_i) at positions [B, T] (also their cache rows) ->
        (o [B, T, D] before shared_head.norm, k, v)."""
        eps = self.cfg.rms_norm_eps
        e = rms_norm(quant.embed_rows(self.embed, tokens), self.enorm, eps)
        h = rms_norm(hidden, self.hnorm, eps).astype(e.dtype)
        u = linear(jnp.concatenate([e, h], axis=-1), self.eh_proj)
        inv_freq = jnp.asarray(default_rope_inv_freq(self.cfg))
        return self.layer(u, k, v, 0, positions, positions, ctx_len, None, "reference", kv_chunk, inv_freq)


@functools.lru_cache(maxsize=64)
def declarations(cfg: ModelConfig, dtype=jnp.float32) -> dict:
    return abstract_tree(NextNNet(cfg, param_dtype=dtype), NextNNet.declare)["params"]


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random parameters (unit norms, normal(std) matrices)."""
    return unbox(init_tree(NextNNet(cfg, init_std=std, param_dtype=dtype), NextNNet.declare, key))["params"]


def rows(params: dict, cfg: ModelConfig, tokens, hidden, positions, k, v, ctx_len, kv_chunk=KV_CHUNK):
    """The module over T consecutive rows per batch row (cache rows = positions), over cache rows < ctx_len
    [B] and the rows before them in this pass: (o [B, T, D], k, v). kv_chunk None: one attention block
    (training passes differentiate through it)."""
    return NextNNet(cfg).apply({"params": params}, tokens, hidden, k, v, positions, ctx_len, kv_chunk)


def logits(params: dict, cfg: ModelConfig, o: jax.Array) -> jax.Array:
    """float32 logits [..., V] of module outputs o: shared_head.head(shared_head.norm(o))."""
    return lm_logits(rms_norm(o, params["head_norm"], cfg.rms_norm_eps), params["head"])


# --- checkpoints ---------------------------------------------------------------------------------------------


def is_nextn_config(hf: dict) -> bool:
    """A saved NextN module's config.json (SGLang's standalone export: an architecture ending in NextN)."""
    return bool(hf.get("num_nextn_predict_layers")) and any(
        str(a).endswith(ARCH_SUFFIX) for a in hf.get("architectures") or ())


def check_layers_field(hf: dict, where: str) -> None:
    """num_nextn_predict_layers must be 1: jspec runs one module, chained (DeepSeek-V3 ships 1)."""
    n = hf.get("num_nextn_predict_layers")
    if n != 1:
        raise CheckpointError(f"{where}: num_nextn_predict_layers is {n!r}; the MTP drafter runs one DeepSeek-layout "
                              "MTP module, chained for later depths (DeepSeek-V3's checkpoints have 1)")


def refuse_deepseek_layers(hf: dict, where: str) -> None:
    """A DeepSeek-V3 (MLA + MoE) module, named as such."""
    fields = [f for f in DEEPSEEK_FIELDS if hf.get(f) is not None]
    if hf.get("model_type") in ("deepseek_v3", "deepseek_v2") or fields:
        raise CheckpointError(
            f"{where}: a {hf.get('model_type')!r} MTP module (config fields {fields or 'of DeepSeek'}): its decoder "
            "layer is DeepSeek-V3's Multi-head Latent Attention with a DeepSeekMoE MLP, which jspec does not "
            "implement (jspec's targets are Llama / Qwen3 and Gated DeltaNet hybrids); jspec reads this layout "
            "when the module's layer is a Llama / Qwen3 layer of its dense target")


def _load_found(found: dict, cfg: ModelConfig, where: str, dtype, prefix: str = PREFIX) -> dict:
    """The module's parameters from tensors named under `prefix` (its declared names, re-prefixed)."""
    decl = declarations(cfg)
    expected = {prefix + n[len(PREFIX):]: e for n, e in declared_tensors(decl).items()}
    check_tensors(found, {n: e[0] for n, e in expected.items()}, where,
                  "point at a checkpoint whose DeepSeek-layout MTP module was trained for this target (same hidden "
                  "size, heads, MLP and vocabulary)")
    return assemble(found, expected, shapes(decl), dtype)


def load_from_target(path: str, cfg: ModelConfig, num_target_layers: int, dtype) -> dict:
    """The module of a target checkpoint (`model.layers.{num_target_layers}.*`), strictly."""
    where_cfg = os.path.join(path, "config.json")
    check_layers_field(read_json_object(where_cfg), where_cfg)
    own = f"model.layers.{num_target_layers}."
    found = read_safetensors(path, own)
    if not found:
        raise CheckpointError(
            f"checkpoint {path!r}: config.json says num_nextn_predict_layers 1, but no tensor is named {own}*: the "
            "checkpoint lost its MTP module (some conversions drop it)\n"
            "  fix: use a checkpoint that ships it, or another drafter")
    return _load_found(found, cfg, f"the DeepSeek-layout MTP module of checkpoint {path!r} ({own}*)", dtype, own)


def load_folder(path: str, hf: dict, dtype) -> tuple[ModelConfig, int, dict]:
    """A saved NextN folder: (the layer config, the target's layer count, params)."""
    where = os.path.join(path, "config.json")
    refuse_deepseek_layers(hf, where)
    check_layers_field(hf, where)
    arch = [str(a)[: -len(ARCH_SUFFIX)] for a in hf.get("architectures") or () if str(a).endswith(ARCH_SUFFIX)]
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES or arch != [SUPPORTED_ARCHITECTURES[model_type][0]]:
        raise CheckpointError(f"{where}: architectures {hf.get('architectures')} with model_type {model_type!r}: a "
                              "saved DeepSeek-layout MTP module over a jspec target is one of "
                              f"{[a + ARCH_SUFFIX for v in SUPPORTED_ARCHITECTURES.values() for a in v]}")
    if hf.get("num_hidden_layers") != 1:
        raise CheckpointError(f"{where}: num_hidden_layers is {hf.get('num_hidden_layers')!r}; a saved NextN module "
                              "is one layer (model.layers.0.*)")
    n_target = hf.get("num_target_layers")
    if isinstance(n_target, bool) or not isinstance(n_target, int) or n_target < 1:
        raise CheckpointError(f"{where}: num_target_layers (the layer count of the target the module serves) is "
                              f"{n_target!r}; it must be an integer >= 1")
    try:
        cfg = layer_config(ModelConfig.from_hf_dict({**hf, "architectures": arch}))
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from err
    params = _load_found(read_safetensors(path), cfg, f"DeepSeek-layout MTP checkpoint {path!r}", dtype)
    return cfg, n_target, params


def save_folder(path: str, cfg: ModelConfig, num_target_layers: int, params: dict, dtype=None) -> None:
    hf = cfg.to_hf_dict()
    config = {**hf, "architectures": [hf["architectures"][0] + ARCH_SUFFIX], "num_nextn_predict_layers": 1,
              "num_target_layers": num_target_layers}
    write_checkpoint(path, config, export_tensors(params, declared_tensors(declarations(cfg)), dtype))
