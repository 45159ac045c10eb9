"""Language-model checkpoints of every supported architecture (dense Llama / Qwen3 and the Gated DeltaNet
hybrids) behind one strict loader and one exporter: the target, and small LMs used as drafters, go
through them."""

from __future__ import annotations

import os

import jax.numpy as jnp

from jspec.io import q4
from jspec.io.files import read_json_object
from jspec.io.hf import load_params, save_params
from jspec.io.hf_hybrid import load_hybrid_params, save_hybrid_params
from jspec.io.tokenizer import load_tokenizer
from jspec.models import config, hybrid, quant


def is_causal_lm(hf: dict) -> bool:
    """Does config.json describe a causal LM of a supported architecture (dense or hybrid)?"""
    model_type = hf.get("model_type")
    archs = tuple(hf.get("architectures") or ())
    for table in (config.SUPPORTED_ARCHITECTURES, hybrid.SUPPORTED_ARCHITECTURES):
        if model_type in table:
            return all(a in table[model_type] for a in archs)
    return False


def load_model(path: str, dtype=jnp.float32):
    """(config, parameters, tokenizer or None) of an HF model folder (float, or affine Q4 group-64 in the
    MLX layout: `jspec.io.q4`); the tokenizer must fit the model."""
    cfg_path = os.path.join(path, "config.json")
    hf_config = read_json_object(cfg_path) if os.path.exists(cfg_path) else {}
    model_type = hf_config.get("model_type")
    if q4.q4_settings(hf_config, path) is not None:
        cfg, params = q4.load_q4_params(path, hf_config, dtype=dtype)
    elif model_type in hybrid.SUPPORTED_ARCHITECTURES:
        cfg, params = load_hybrid_params(path, dtype=dtype)
    else:
        cfg, params = load_params(path, dtype=dtype)
    tok = load_tokenizer(path)
    if tok is not None and tok.get_vocab_size() > cfg.vocab_size:
        raise ValueError(
            f"tokenizer.json in {path!r} has {tok.get_vocab_size()} tokens but the model's vocabulary is "
            f"{cfg.vocab_size}: the tokenizer does not belong to this checkpoint"
        )
    return cfg, params, tok


def save_model(path: str, cfg, params: dict, dtype=None) -> None:
    """config.json + model.safetensors that `load_model` (and transformers) read back."""
    if quant.has_q4(params):
        raise ValueError("save_model writes float checkpoints and these parameters hold Q4 matrices: save the float "
                         "model and quantize it with `jspec convert SRC OUT --q4`")
    (save_hybrid_params if isinstance(cfg, hybrid.HybridConfig) else save_params)(path, cfg, params, dtype=dtype)
