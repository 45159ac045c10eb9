"""Helpers shared by the drafter checkpoint formats (Hugging Face layout: config.json + safetensors).

Each family's own format (config fields, tensor names, strict loading and saving) lives in its family
module (jspec.drafters.dflash, jspec.drafters.dspark, ...), built from these pieces.
"""

from __future__ import annotations

import json
import os

from safetensors.numpy import save_file

from jspec.io.files import read_json_object
from jspec.io.hf import CheckpointError, assemble, check_tensors, declared_tensors, read_safetensors
from jspec.models.config import ModelConfig


def read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"no config.json in {path!r}: pass a drafter checkpoint directory")
    return read_json_object(cfg_path)


def required(hf: dict, *names: str, where: str) -> list:
    """The values of config fields that must be present; CheckpointError naming every missing one."""
    missing = [n for n in names if n not in hf]
    if missing:
        raise CheckpointError(f"{where}: config.json lacks required fields {missing}")
    return [hf[n] for n in names]


def load_declared(path: str, declarations, param_shapes, what: str, dtype, rename=None) -> dict:
    """A drafter folder's parameters, strictly: every declared tensor present with its declared shape and
    nothing else (one CheckpointError naming each problem). rename: names -> names of an older release,
    applied to the file's tensors first. what: the format's name, for the message."""
    found = read_safetensors(path)
    if rename is not None:
        found = rename(found)
    expected = declared_tensors(declarations)
    check_tensors(found, {n: e[0] for n, e in expected.items()}, f"{what} checkpoint {path!r}",
                  f"point --drafter at a {what} checkpoint for this config")
    return assemble(found, expected, param_shapes, dtype)


def stack_config(hf: dict) -> ModelConfig:
    """A draft decoder stack stored as Qwen3 layer fields of the drafter's config (vocab = the target's)."""
    stack = dict(hf, model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    stack.setdefault("hidden_act", "silu")
    if stack.get("layer_types") and "sliding_attention" in stack["layer_types"]:
        stack["use_sliding_window"] = True
    return ModelConfig.from_hf_dict(stack)


def stack_hf(cfg: ModelConfig) -> dict:
    """The Qwen3 layer fields of a draft stack, for a drafter's config.json."""
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_parameters", "rope_theta",
            "max_position_embeddings", "attention_bias", "sliding_window", "layer_types", "tie_word_embeddings")
    hf = cfg.to_hf_dict()
    return {k: hf[k] for k in keep if k in hf}


def write_checkpoint(path: str, config: dict, tensors: dict) -> None:
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
