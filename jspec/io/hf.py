"""Strict loading and export of Hugging Face Llama / Qwen3 checkpoints (safetensors).

jspec stores the matrices as HF does, [out, in], one dict per layer, so loading is a plain read (the
declarations' `transpose` flag remains for tensors stored the other way).
Loading never falls back to random values: every missing, unexpected, misshapen or mistyped tensor is
collected and reported in one `CheckpointError`, a damaged file (config.json, index, safetensors) is
one `CheckpointError` naming it, and the weights are scanned for NaN / inf once per load (on the host;
`check_values=False` or the environment variable JSPEC_SKIP_VALUE_CHECK=1 skip the scan). The one
exception to "nothing unexpected": the multi-token-prediction layers that config.json's
`num_nextn_predict_layers` declares after the model's own (DeepSeek-V3's layout), which the MTP drafter
loads as strictly (`nextn_prefixes`).
"""

from __future__ import annotations

import glob
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jspec.errors import CheckpointError
from jspec.io.files import read_json_object
from jspec.models.config import ModelConfig, load_config
from jspec.models.declare import hf_names
from jspec.models.transformer import declarations, param_shapes

# The dtypes a float parameter may be stored in (any of them loads into any compute dtype).
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
# Set to 1 to skip the NaN / inf scan of every loaded checkpoint (e.g. for very large ones).
SKIP_VALUE_CHECK_ENV = "JSPEC_SKIP_VALUE_CHECK"
_SCAN_CHUNK = 1 << 22  # elements per pass: bounds the scan's temporary memory (and stays in cache)
# 16-bit floats are scanned as integers: a value is NaN / inf iff its exponent bits are all set (numpy's
# isfinite on bfloat16 converts each element, about 4x slower).
_EXPONENT_BITS = {"float16": 0x7C00, "bfloat16": 0x7F80}


def expected_tensors(cfg: ModelConfig) -> dict:
    """HF name -> (HF shape, jspec key path, None, transpose), from the model's declarations."""
    return declared_tensors(declarations(cfg))


def declared_tensors(declared) -> dict:
    """HF name -> (HF shape, jspec key path, None, transpose) of a tree of declarations."""
    return {name: (shape, path, None, tr) for name, (shape, path, tr) in hf_names(declared).items()}


def _weight_map(index: str) -> dict[str, str]:
    """The tensor name -> shard file map of a model.safetensors.index.json."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index} has no weight_map (an object of tensor name -> shard file): the index is "
                              "damaged or incomplete; download it again")
    return weight_map


def _safetensor_files(model_dir: str) -> tuple[list[str], dict[str, str] | None, str | None]:
    """(shard files, the index's weight map or None, the index file or None) of a checkpoint folder."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(index):
        weight_map = _weight_map(index)
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(model_dir, f))]
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return [os.path.join(model_dir, f) for f in files], weight_map, index
    if os.path.exists(single):
        return [single], None, None
    # Shards without an index (model-00001-of-00002.safetensors, ...): every tensor must be in one file.
    shards = sorted(glob.glob(os.path.join(glob.escape(model_dir), "model-*-of-*.safetensors")))
    if shards:
        return shards, None, None
    raise CheckpointError(
        f"no model.safetensors or model.safetensors.index.json in {model_dir!r}; "
        "jspec loads Hugging Face safetensors checkpoints (convert .bin files with save_pretrained)"
    )


def _damaged(path: str, err: Exception) -> CheckpointError:
    size = os.path.getsize(path) if os.path.exists(path) else None
    what = "empty (0 bytes)" if size == 0 else f"damaged or truncated ({size} bytes; {err})"
    return CheckpointError(f"{path} is not a readable safetensors file: it is {what}; an interrupted download or "
                           "copy leaves such files: download or write it again")


def read_safetensors(model_dir: str, prefix: str = "") -> dict[str, np.ndarray]:
    """Every tensor of a directory's model.safetensors (or its sharded index) whose name starts with
    `prefix`, as numpy arrays; with an index, only the shards it maps such tensors to are opened.

    With an index, a tensor is read from the shard the index names (a copy in another shard is
    ignored) and an index naming a shard that lacks the tensor is an error; without one, a tensor
    stored in two files is an error naming both. A damaged file is a CheckpointError naming it."""
    files, weight_map, index = _safetensor_files(model_dir)
    if weight_map is not None and prefix:
        weight_map = {n: s for n, s in weight_map.items() if n.startswith(prefix)}
        files = [f for f in files if f in {os.path.join(model_dir, s) for s in weight_map.values()}]
    shard_of = {os.path.join(model_dir, s): s for s in set((weight_map or {}).values())}  # path -> index's name
    found: dict[str, np.ndarray] = {}
    source: dict[str, str] = {}
    for path in files:
        shard = shard_of.get(path)
        try:
            with safe_open(path, framework="numpy") as f:
                names = [n for n in f.keys() if n.startswith(prefix)]
                if weight_map is not None:
                    absent = sorted(set(n for n, s in weight_map.items() if s == shard) - set(names))
                    if absent:
                        raise CheckpointError(
                            f"{index} maps {len(absent)} tensor(s) to {path}, which does not hold them: "
                            f"{', '.join(absent[:8])}{' ...' if len(absent) > 8 else ''}; the shard or the index is "
                            "damaged or from another checkpoint: download them again")
                for name in names:
                    if weight_map is not None and weight_map.get(name, shard) != shard:
                        continue  # the index names another shard's copy
                    if name in source:
                        raise CheckpointError(
                            f"tensor {name!r} is stored in two files, {source[name]} and {path}"
                            f"{'' if weight_map is None else f', and {index} names neither'}: jspec cannot tell "
                            "which copy to load; remove the stale file (or write an index that names one)")
                    found[name] = f.get_tensor(name)
                    source[name] = path
        except (SafetensorError, OSError) as err:
            raise _damaged(path, err) from err
    return found


def check_tensors(found: dict, expected: dict[str, tuple[int, ...]], where: str, fix: str,
                  allowed_extra: set[str] = frozenset(), hints=(), *, dtypes: dict[str, tuple[str, ...]] | None = None,
                  check_values: bool = True) -> None:
    """One CheckpointError naming every missing, unexpected, misshapen and mistyped tensor (no partial
    loads); then one naming every tensor that holds NaN / inf.

    dtypes: HF name -> the dtype names accepted for it (e.g. ("uint32",) for quantized codes); every
    other expected tensor must be a float of FLOAT_DTYPES. check_values=False (or the environment
    variable JSPEC_SKIP_VALUE_CHECK=1) skips the NaN / inf scan of the float tensors."""
    unexpected = sorted(n for n in found if n not in expected and n not in allowed_extra)
    missing = sorted(n for n in expected if n not in found)
    misshapen = sorted(
        f"{n}: checkpoint {tuple(found[n].shape)} vs config {tuple(expected[n])}"
        for n in expected
        if n in found and tuple(found[n].shape) != tuple(expected[n])
    )
    accepted = lambda n: (dtypes or {}).get(n, FLOAT_DTYPES)
    mistyped = sorted(
        f"{n}: {_dtype_name(found[n])} (expected {' / '.join(accepted(n))})"
        for n in expected
        if n in found and _dtype_name(found[n]) not in accepted(n)
    )
    if missing or unexpected or misshapen or mistyped:
        lines = [f"{where} does not match its config:"]
        if missing:
            lines.append(f"  missing tensors ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            lines.append(f"  unexpected tensors ({len(unexpected)}): {', '.join(unexpected)}")
        if misshapen:
            lines.append(f"  misshapen tensors ({len(misshapen)}): {'; '.join(misshapen)}")
        if mistyped:
            lines.append(f"  tensors of the wrong dtype ({len(mistyped)}): {'; '.join(mistyped)}")
        lines += [f"  {h}" for h in hints]
        lines.append(f"  fix: {fix}")
        raise CheckpointError("\n".join(lines))
    if check_values and not value_check_skipped():
        check_finite({n: found[n] for n in expected}, where)


def _dtype_name(arr) -> str:
    return np.dtype(arr.dtype).name


def value_check_skipped() -> bool:
    """Does the environment (JSPEC_SKIP_VALUE_CHECK=1) turn the NaN / inf scan of loaded weights off?"""
    return os.environ.get(SKIP_VALUE_CHECK_ENV, "").strip().lower() in ("1", "true", "yes")


def _all_finite(arr: np.ndarray) -> bool:
    flat = np.ascontiguousarray(arr).reshape(-1)
    chunks = range(0, flat.size, _SCAN_CHUNK)
    mask = _EXPONENT_BITS.get(_dtype_name(flat))
    if mask is None:
        return all(np.isfinite(flat[i:i + _SCAN_CHUNK]).all() for i in chunks)
    bits, mask = flat.view(np.uint16), np.uint16(mask)
    return not any(((bits[i:i + _SCAN_CHUNK] & mask) == mask).any() for i in chunks)


def check_finite(tensors: dict, where: str) -> None:
    """CheckpointError naming every float tensor holding NaN or inf (one host-side pass per tensor)."""
    bad = []
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        if _dtype_name(arr) in FLOAT_DTYPES + ("float64",) and not _all_finite(arr):
            nan, inf = int(np.isnan(arr).sum()), int(np.isinf(arr).sum())
            bad.append(f"{name} ({nan} NaN, {inf} inf of {arr.size} values)")
    if bad:
        raise CheckpointError(
            f"{where} holds NaN / inf weights in {len(bad)} tensor(s): {'; '.join(sorted(bad))}\n"
            "  such weights give meaningless output: the file is damaged, or the run that wrote it diverged; "
            "load the checkpoint it was made from (or an earlier one)\n"
            f"  (the scan reads every weight once on the host; to skip it for a very large checkpoint pass "
            f"check_values=False to load_params / load_hybrid_params, or set {SKIP_VALUE_CHECK_ENV}=1)")


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


def load_params(model_dir: str, cfg: ModelConfig | None = None, dtype=jnp.float32,
                check_values: bool = True) -> tuple[ModelConfig, dict]:
    """Load `config.json` + safetensors into a jspec parameter pytree of `dtype` (float32 or bfloat16).

    Every tensor must be a float16 / bfloat16 / float32 of the shape the config implies and hold no
    NaN / inf (check_values=False or JSPEC_SKIP_VALUE_CHECK=1 skip that scan); CheckpointError otherwise."""
    cfg = cfg or load_config(model_dir)
    expected = expected_tensors(cfg)
    found = read_safetensors(model_dir)
    nextn = nextn_prefixes(model_dir, cfg)
    found = {n: a for n, a in found.items() if not n.startswith(nextn)} if nextn else found
    allowed = set()
    # Some tied checkpoints also store lm_head.weight as a copy of the embedding; accept only that.
    if cfg.tie_word_embeddings and "lm_head.weight" in found and np.array_equal(
        np.asarray(found["lm_head.weight"]), np.asarray(found.get("model.embed_tokens.weight"))
    ):
        allowed.add("lm_head.weight")
    check_tensors(found, {n: e[0] for n, e in expected.items()}, f"checkpoint {model_dir!r} ({cfg.family}, "
                  f"{cfg.num_layers} layers)", "point --target at the matching checkpoint, or correct config.json",
                  allowed, check_values=check_values)
    return cfg, assemble(found, expected, param_shapes(cfg), dtype)


def nextn_prefixes(model_dir: str, cfg: ModelConfig) -> tuple[str, ...]:
    """The name prefixes of the multi-token-prediction layers that a checkpoint in DeepSeek-V3's layout
    stores after the model's own (`model.layers.{L + i}.`, i < config.json's num_nextn_predict_layers):
    the model does not run them, and the MTP drafter (`jspec.drafters.nextn`) loads them."""
    path = os.path.join(model_dir, "config.json")
    n = read_json_object(path).get("num_nextn_predict_layers") if os.path.exists(path) else None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return ()
    return tuple(f"model.layers.{cfg.num_layers + i}." for i in range(n))


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
