"""Language-model checkpoints of every supported architecture (dense Llama / Qwen3 and the Gated DeltaNet
hybrids) behind one strict loader and one exporter: the target, and small LMs used as drafters, go
through them."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from jspec.errors import CheckpointError
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


GENERATION_CONFIG = "generation_config.json"


def generation_eos_ids(path: str) -> tuple[int, ...]:
    """The `eos_token_id` (an int or a list of ints) of the folder's generation_config.json; () when the file or
    the field is absent; CheckpointError naming the file when it is damaged or the field is not token ids."""
    gen_path = os.path.join(path, GENERATION_CONFIG)
    if not os.path.exists(gen_path):
        return ()
    eos = read_json_object(gen_path).get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    bad = [e for e in ids if isinstance(e, bool) or not isinstance(e, int) or e < 0]
    if bad:
        raise CheckpointError(f"{gen_path}: eos_token_id is {eos!r}; it must be a token id (an integer >= 0) or a "
                              "list of them: the file is damaged")
    return tuple(ids)


def with_generation_eos(cfg, path: str):
    """`cfg` whose EOS ids also hold generation_config.json's (config.json's first, in order, no duplicates):
    transformers' generate stops at those, so jspec's default EOS does too."""
    extra = generation_eos_ids(path)
    merged = tuple(dict.fromkeys((*cfg.eos_token_ids, *extra)))
    return cfg if merged == tuple(cfg.eos_token_ids) else dataclasses.replace(cfg, eos_token_ids=merged)


def load_model(path: str, dtype=jnp.float32):
    """(config, parameters, tokenizer or None) of an HF model folder (float, or affine Q4 group-64 in the
    MLX layout: `jspec.io.q4`); the tokenizer must fit the model. The config's EOS ids are config.json's
    joined by generation_config.json's (`with_generation_eos`)."""
    cfg_path = os.path.join(path, "config.json")
    hf_config = read_json_object(cfg_path) if os.path.exists(cfg_path) else {}
    model_type = hf_config.get("model_type")
    if q4.q4_settings(hf_config, path) is not None:
        cfg, params = q4.load_q4_params(path, hf_config, dtype=dtype)
    elif model_type in hybrid.SUPPORTED_ARCHITECTURES:
        cfg, params = load_hybrid_params(path, dtype=dtype)
    else:
        cfg, params = load_params(path, dtype=dtype)
    cfg = with_generation_eos(cfg, path)
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
