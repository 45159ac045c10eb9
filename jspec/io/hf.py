"""Strict loading and export of Hugging Face Llama / Qwen3 checkpoints (safetensors).

jspec stores the matrices as HF does, [out, in], one dict per layer, so loading is a plain read (the
declarations' `transpose` flag remains for tensors stored the other way).
Loading never falls back to random values: every missing, unexpected or misshapen tensor is
collected and reported in one `CheckpointError`.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jspec.models.config import ModelConfig, load_config
from jspec.models.declare import hf_names
from jspec.models.transformer import declarations, param_shapes


class CheckpointError(ValueError):
    """A checkpoint does not match the configuration it is loaded with."""


def expected_tensors(cfg: ModelConfig) -> dict:
    """HF name -> (HF shape, jspec key path, None, transpose), from the model's declarations."""
    return declared_tensors(declarations(cfg))


def declared_tensors(declared) -> dict:
    """HF name -> (HF shape, jspec key path, None, transpose) of a tree of declarations."""
    return {name: (shape, path, None, tr) for name, (shape, path, tr) in hf_names(declared).items()}


def _safetensor_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(model_dir, f))]
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return [os.path.join(model_dir, f) for f in files]
    if os.path.exists(single):
        return [single]
    raise CheckpointError(
        f"no model.safetensors or model.safetensors.index.json in {model_dir!r}; "
        "jspec loads Hugging Face safetensors checkpoints (convert .bin files with save_pretrained)"
    )


def read_safetensors(model_dir: str) -> dict[str, np.ndarray]:
    """Every tensor of a directory's model.safetensors (or its sharded index), as numpy arrays."""
    found: dict[str, np.ndarray] = {}
    for path in _safetensor_files(model_dir):
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                found[name] = f.get_tensor(name)
    return found


def check_tensors(found: dict, expected: dict[str, tuple[int, ...]], where: str, fix: str,
                  allowed_extra: set[str] = frozenset(), hints=()) -> None:
    """One CheckpointError naming every missing, unexpected and misshapen tensor (no partial loads)."""
    unexpected = sorted(n for n in found if n not in expected and n not in allowed_extra)
    missing = sorted(n for n in expected if n not in found)
    misshapen = sorted(
        f"{n}: checkpoint {tuple(found[n].shape)} vs config {tuple(expected[n])}"
        for n in expected
        if n in found and tuple(found[n].shape) != tuple(expected[n])
    )
    if missing or unexpected or misshapen:
        lines = [f"{where} does not match its config:"]
        if missing:
            lines.append(f"  missing tensors ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            lines.append(f"  unexpected tensors ({len(unexpected)}): {', '.join(unexpected)}")
        if misshapen:
            lines.append(f"  misshapen tensors ({len(misshapen)}): {'; '.join(misshapen)}")
        lines += [f"  {h}" for h in hints]
        lines.append(f"  fix: {fix}")
        raise CheckpointError("\n".join(lines))


def np_dtype(dtype):
    return ml_dtypes.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(dtype)


def assemble(found: dict, expected: dict, shapes: dict, dtype) -> dict:
    """Build a jspec param pytree from HF tensors; `expected` maps HF name -> (shape, path, layer, transpose)
    where path is a key or a tuple of nested keys."""
    dt = np_dtype(dtype)
    host = jax.tree_util.tree_map(lambda s: np.empty(s, dt), shapes, is_leaf=lambda s: isinstance(s, tuple))
    for name, (_, path, layer, tr) in expected.items():
        keys = path if isinstance(path, tuple) else (path,)
        node = host
        for k in keys[:-1]:
            node = node[k]
        arr = np.asarray(found[name])
        arr = (arr.T if tr else arr).astype(dt)
        if layer is None:
            node[keys[-1]][...] = arr
        else:
            node[keys[-1]][layer] = arr
    return jax.tree_util.tree_map(jnp.asarray, host)


def export_tensors(params: dict, expected: dict, dtype=None) -> dict[str, np.ndarray]:
    """HF name -> numpy array ([out, in] matrices) from a jspec param pytree (inverse of `assemble`)."""
    tensors = {}
    for name, (_, path, layer, tr) in expected.items():
        node = params
        for k in path if isinstance(path, tuple) else (path,):
            node = node[k]
        arr = np.asarray(jax.device_get(node if layer is None else node[layer]))
        if dtype is not None:
            arr = arr.astype(np_dtype(dtype))
        tensors[name] = np.ascontiguousarray(arr.T if tr else arr)
    return tensors


def load_params(model_dir: str, cfg: ModelConfig | None = None, dtype=jnp.float32) -> tuple[ModelConfig, dict]:
    """Load `config.json` + safetensors into a jspec parameter pytree of `dtype` (float32 or bfloat16)."""
    cfg = cfg or load_config(model_dir)
    expected = expected_tensors(cfg)
    found = read_safetensors(model_dir)
    allowed = set()
    # Some tied checkpoints also store lm_head.weight as a copy of the embedding; accept only that.
    if cfg.tie_word_embeddings and "lm_head.weight" in found and np.array_equal(
        np.asarray(found["lm_head.weight"]), np.asarray(found.get("model.embed_tokens.weight"))
    ):
        allowed.add("lm_head.weight")
    check_tensors(found, {n: e[0] for n, e in expected.items()}, f"checkpoint {model_dir!r} ({cfg.family}, "
                  f"{cfg.num_layers} layers)", "point --target at the matching checkpoint, or correct config.json",
                  allowed)
    return cfg, assemble(found, expected, param_shapes(cfg), dtype)


def save_params(model_dir: str, cfg: ModelConfig, params: dict, dtype=None, extra_config: dict | None = None) -> None:
    """Write `config.json` + `model.safetensors` that transformers loads as LlamaForCausalLM/Qwen3ForCausalLM."""
    os.makedirs(model_dir, exist_ok=True)
    tensors = export_tensors(params, expected_tensors(cfg), dtype)
    save_file(tensors, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf_dict()
    hf["dtype"] = "bfloat16" if tensors["model.norm.weight"].dtype == ml_dtypes.bfloat16 else "float32"
    hf.update(extra_config or {})
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
