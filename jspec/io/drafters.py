"""Strict loaders and savers for the official drafter checkpoint formats (Hugging Face layout).

- z-lab DFlash: `config.json` = Qwen3 fields of the draft stack (`num_hidden_layers` = draft depth)
  plus `block_size` (top level, or inside `dflash_config` in DFlash2 releases), `num_target_layers`,
  `layer_types`, `dflash_config: {mask_token_id, target_layer_ids}`; tensors `fc.weight [H, n*H]`,
  `hidden_norm.weight`, `norm.weight`, `layers.i.*` (no `model.` prefix, no embedding or LM head).
  The older naming `encoder.fc.*` / `encoder.output_norm_enc.*` is read as `fc.*` / `hidden_norm.*`.
  The block convention is z-lab's: `block_size` counts the anchor.
- DeepSpec DSpark: the same backbone names and config fields at the top level, architectures
  `Qwen3DSparkModel`, plus `embed_tokens.weight`, `lm_head.weight`, `markov_head.markov_w1.weight
  [V, r]` (an embedding), `markov_head.markov_w2.weight [V, r]` (a Linear r -> V, [out, in]),
  `markov_head.gate_proj.{weight,bias}` (gated) or `markov_head.joint_proj.{weight,bias}` (rnn) and
  `confidence_head.proj.{weight [1, H(+r)], bias [1]}`. The gated / rnn tensor names are not
  confirmed against a released file; this module uses exactly these names in both directions.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
from safetensors.numpy import save_file

from jspec.drafters.dflash import DFlashConfig
from jspec.drafters.dflash import declarations as dflash_declarations
from jspec.drafters.dflash import param_shapes as dflash_shapes
from jspec.drafters.dspark import DSparkConfig
from jspec.drafters.dspark import declarations as dspark_declarations
from jspec.drafters.dspark import param_shapes as dspark_shapes
from jspec.io.hf import (
    CheckpointError,
    assemble,
    check_tensors,
    declared_tensors,
    export_tensors,
    read_safetensors,
)
from jspec.models.config import ModelConfig

_OLD_NAMES = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}


def read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"no config.json in {path!r}: pass a drafter checkpoint directory")
    with open(cfg_path) as f:
        return json.load(f)


def drafter_format(hf: dict) -> str:
    """'dspark', 'dflash' or 'lm' (a plain causal LM used as a small drafter)."""
    if "Qwen3DSparkModel" in (hf.get("architectures") or []) or "markov_rank" in hf:
        return "dspark"
    if "dflash_config" in hf:
        return "dflash"
    return "lm"


def _required(hf: dict, *names: str, where: str):
    missing = [n for n in names if n not in hf]
    if missing:
        raise CheckpointError(f"{where}: config.json lacks required fields {missing}")
    return [hf[n] for n in names]


def _stack_config(hf: dict) -> ModelConfig:
    """The draft decoder stack: Qwen3 layers with the config's sizes (vocab = the target's)."""
    stack = dict(hf, model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    stack.setdefault("hidden_act", "silu")
    if stack.get("layer_types") and "sliding_attention" in stack["layer_types"]:
        stack["use_sliding_window"] = True
    return ModelConfig.from_hf_dict(stack)


def _backbone_tensors(cfg: DFlashConfig) -> dict:
    return declared_tensors(dflash_declarations(cfg))


def _dspark_tensors(cfg: DSparkConfig) -> dict:
    return declared_tensors(dspark_declarations(cfg))


def dflash_config_from_hf(hf: dict) -> DFlashConfig:
    where = "DFlash config"
    (dc,) = _required(hf, "dflash_config", where=where)
    mask, ids = _required(dc, "mask_token_id", "target_layer_ids", where=where + " (dflash_config)")
    block = hf.get("block_size", dc.get("block_size"))
    if block is None:
        raise CheckpointError(f"{where}: no block_size at the top level or in dflash_config")
    (n_target,) = _required(hf, "num_target_layers", where=where)
    return DFlashConfig(layers=_stack_config(hf), target_layer_ids=tuple(int(i) for i in ids),
                        num_target_layers=int(n_target), mask_token_id=int(mask), block_size=int(block),
                        anchor_predicts=False)


def dspark_config_from_hf(hf: dict) -> DSparkConfig:
    where = "DSpark config"
    ids, mask, _, conf, rank = _required(hf, "target_layer_ids", "mask_token_id", "num_anchors",
                                         "enable_confidence_head", "markov_rank", where=where)
    head_type = _required(hf, "markov_head_type", where=where)[0] if rank else "vanilla"
    with_markov = _required(hf, "confidence_head_with_markov", where=where)[0] if conf else False
    (block,) = _required(hf, "block_size", where=where)
    backbone = DFlashConfig(layers=_stack_config(hf), target_layer_ids=tuple(int(i) for i in ids),
                            num_target_layers=int(hf.get("num_target_layers", 0)), mask_token_id=int(mask),
                            block_size=int(block), anchor_predicts=True)
    return DSparkConfig(backbone=backbone, markov_rank=int(rank), markov_head_type=head_type,
                        confidence_head=bool(conf), confidence_with_markov=bool(with_markov))


def load_dflash(path: str, dtype=jnp.float32) -> tuple[DFlashConfig, dict]:
    hf = read_config(path)
    cfg = dflash_config_from_hf(hf)
    found = read_safetensors(path)
    for old, new in _OLD_NAMES.items():  # the older release's names
        found = {(new + n[len(old):] if n.startswith(old) else n): t for n, t in found.items()}
    expected = _backbone_tensors(cfg)
    check_tensors(found, {n: e[0] for n, e in expected.items()}, f"DFlash checkpoint {path!r}",
                  "point --drafter at a DFlash checkpoint for this config")
    return cfg, assemble(found, expected, dflash_shapes(cfg), dtype)


def load_dspark(path: str, dtype=jnp.float32) -> tuple[DSparkConfig, dict]:
    hf = read_config(path)
    cfg = dspark_config_from_hf(hf)
    found = read_safetensors(path)
    expected = _dspark_tensors(cfg)
    check_tensors(found, {n: e[0] for n, e in expected.items()}, f"DSpark checkpoint {path!r}",
                  "point --drafter at a DSpark checkpoint for this config")
    return cfg, assemble(found, expected, dspark_shapes(cfg), dtype)


def _stack_hf(cfg: ModelConfig) -> dict:
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_parameters", "rope_theta",
            "max_position_embeddings", "attention_bias", "sliding_window", "layer_types", "tie_word_embeddings")
    hf = cfg.to_hf_dict()
    return {k: hf[k] for k in keep if k in hf}


def _write(path: str, config: dict, tensors: dict) -> None:
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def save_dflash(path: str, cfg: DFlashConfig, params: dict, dtype=None) -> None:
    if cfg.anchor_predicts:
        raise ValueError("the z-lab DFlash format stores block_size counting the anchor: save an "
                         "anchor_predicts drafter with save_dspark")
    config = _stack_hf(cfg.layers)
    config.update(architectures=["DFlashDraftModel"], model_type="qwen3", block_size=cfg.block_size,
                  num_target_layers=cfg.num_target_layers,
                  dflash_config={"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)})
    _write(path, config, export_tensors(params, _backbone_tensors(cfg), dtype))


def save_dspark(path: str, cfg: DSparkConfig, params: dict, dtype=None, num_anchors: int = 512) -> None:
    b = cfg.backbone
    config = _stack_hf(b.layers)
    config.update(architectures=["Qwen3DSparkModel"], model_type="qwen3", block_size=b.block_size,
                  mask_token_id=b.mask_token_id, target_layer_ids=list(b.target_layer_ids),
                  num_target_layers=b.num_target_layers, num_anchors=num_anchors, markov_rank=cfg.markov_rank,
                  markov_head_type=cfg.markov_head_type, enable_confidence_head=cfg.confidence_head,
                  confidence_head_with_markov=cfg.confidence_with_markov)
    _write(path, config, export_tensors(params, _dspark_tensors(cfg), dtype))
