"""Affine Q4 group-64 checkpoints (the MLX layout): strict loading into `jspec.models.quant.Q4` weights,
and quantizing a float checkpoint into one (`jspec convert --q4`).

A quantized matrix `NAME.weight` [out, in] is stored as three tensors (see `jspec.models.quant`):
`NAME.weight` uint32 [out, in / 8], `NAME.scales` and `NAME.biases` [out, in / 64]; config.json says
`"quantization": {"group_size": 64, "bits": 4}` (optionally `"mode": "affine"`; mlx-lm also copies it
to `quantization_config`). Which matrices a file quantizes is the file's choice, as in mlx-lm (every
Linear / Embedding whose input dimension is a multiple of 64, unless a model skips some): a 2-d
`.weight` tensor comes quantized when its `.scales` are present and as a float tensor otherwise; every
other tensor (norms, biases, convolution taps, ...) is float. Names, shapes and dtypes are checked as
strictly as float checkpoints: one `CheckpointError` names every missing, unexpected, misshapen or
mistyped tensor. Bit widths, group sizes, modes or per-layer settings other than uniform 4-bit
group-64 affine are refused by name.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from jspec.io import hf, hf_hybrid
from jspec.io.files import read_json_object
from jspec.models import hybrid, quant, transformer
from jspec.models.config import ModelConfig

QUANT_KEYS = ("quantization", "quantization_config")
SETTINGS = {"group_size": quant.GROUP_SIZE, "bits": quant.BITS, "mode": "affine"}


def q4_settings(hf_config: dict, where: str) -> dict | None:
    """None for a float checkpoint; the settings of an affine Q4 group-64 one; CheckpointError for any
    other quantization (named, with what jspec implements)."""
    found = [k for k in QUANT_KEYS if hf_config.get(k) is not None]
    if not found:
        return None
    q = hf_config[found[0]]
    if not isinstance(q, dict):
        raise hf.CheckpointError(f"{where}: config.json's {found[0]!r} must be an object, got {q!r}")
    if "quant_method" in q:
        raise hf.CheckpointError(
            f"{where}: quantization method {q['quant_method']!r} (config.json {found[0]}) is not supported: jspec "
            "loads the MLX affine layout ({'group_size': 64, 'bits': 4}); convert a float checkpoint with "
            "`jspec convert SRC OUT --q4`")
    per_layer = sorted(k for k, v in q.items() if isinstance(v, (dict, bool)))
    if per_layer:
        raise hf.CheckpointError(
            f"{where}: per-layer quantization settings ({', '.join(per_layer[:4])}{' ...' if len(per_layer) > 4 else ''}) "
            "are not supported: jspec implements uniform 4-bit group-64 affine weights")
    got = {"group_size": q.get("group_size"), "bits": q.get("bits"), "mode": q.get("mode", "affine")}
    if got != SETTINGS:
        raise hf.CheckpointError(
            f"{where}: quantization {got} is not supported: jspec implements affine weights with group_size 64 "
            "and bits 4 only")
    return dict(SETTINGS)


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Can this checkpoint tensor be stored quantized: a 2-d matrix whose input dimension divides into groups."""
    return name.endswith(".weight") and len(shape) == 2 and quant.quantizable(tuple(shape))


def _parts(name: str) -> tuple[str, str]:
    base = name[: -len(".weight")]
    return base + ".scales", base + ".biases"


def layout(found: dict, expected: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(every tensor name the file must hold -> its shape, the quantized matrix names) for the float
    names and shapes `expected`: a quantizable matrix is quantized iff its scales are in the file."""
    names, quantized = {}, set()
    for name, shape in expected.items():
        scales, biases = _parts(name) if name.endswith(".weight") else (None, None)
        if scales in found and quantizable(name, shape):
            out, n_in = shape
            names[name] = (out, n_in // quant.CODES_PER_WORD)
            names[scales] = names[biases] = (out, n_in // quant.GROUP_SIZE)
            quantized.add(name)
        else:
            names[name] = shape
    return names, quantized


def _tied_copy(found: dict, embed: str, quantized: bool) -> set[str]:
    """Names of a stored copy of the tied embedding as `lm_head` (allowed, ignored), if it is one."""
    names = ["lm_head.weight", *(_parts("lm_head.weight") if quantized else ())]
    sources = [embed, *(_parts(embed) if quantized else ())]
    if all(n in found and s in found and np.array_equal(found[n], found[s]) for n, s in zip(names, sources)):
        return set(names)
    return set()


def _value(found: dict, name: str, quantized: set[str], dt, transpose: bool = False):
    if name in quantized:
        s, b = _parts(name)
        return quant.Q4(jnp.asarray(found[name]), jnp.asarray(found[s].astype(dt)), jnp.asarray(found[b].astype(dt)))
    arr = np.asarray(found[name])
    return jnp.asarray((arr.T if transpose else arr).astype(dt))


def _checked(model_dir: str, cfg, expected: dict[str, tuple[int, ...]], found: dict, embed: str, fix: str):
    names, quantized = layout(found, expected)
    allowed = _tied_copy(found, embed, embed in quantized) if cfg.tie_word_embeddings else set()
    where = f"Q4 checkpoint {model_dir!r} ({cfg.family}, {cfg.num_layers} layers)"
    hf.check_tensors(found, names, where, fix, allowed, dtypes={n: ("uint32",) for n in quantized})
    return quantized


def load_q4_params(model_dir: str, hf_config: dict, dtype=jnp.float32):
    """(config, parameters) of a dense or hybrid Q4 checkpoint; Q4 leaves for its quantized matrices,
    their scales / biases and every float tensor in `dtype`."""
    dt = hf.np_dtype(dtype)
    fix = "point at the matching checkpoint, or re-export it with `jspec convert SRC OUT --q4`"
    found = hf.read_safetensors(model_dir)
    if hf_config.get("model_type") in hybrid.SUPPORTED_ARCHITECTURES:
        return _load_hybrid(model_dir, hf_config, found, dt, fix)
    cfg = ModelConfig.from_hf_dict(hf_config)
    expected = hf.expected_tensors(cfg)
    quantized = _checked(model_dir, cfg, {n: e[0] for n, e in expected.items()}, found, "model.embed_tokens.weight", fix)
    tree = jax.tree_util.tree_map(lambda s: None, transformer.param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple))
    for name, (_, path, _, transpose) in expected.items():
        keys = path if isinstance(path, tuple) else (path,)
        node = tree
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = _value(found, name, quantized, dt, transpose)
    return cfg, tree


def _load_hybrid(model_dir: str, hf_config: dict, found: dict, dt, fix: str):
    cfg = hybrid.HybridConfig.from_hf_dict(hf_config)
    found = {n: t for n, t in found.items() if not n.startswith(hf_hybrid.KNOWN_EXTRAS)}
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in found) else "model."
    quantized = _checked(model_dir, cfg, hf_hybrid.expected_tensors(cfg, prefix), found, prefix + "embed_tokens.weight",
                         fix)
    rename = lambda name: hf_hybrid._rename(name, prefix)

    def part(i: int):  # the checkpoint's tensors with each quantized matrix replaced by one of its parts
        def get(name):
            name = rename(name)
            if name not in quantized:
                return np.asarray(found[name])
            return np.asarray(found[name] if i == 0 else found[_parts(name)[i - 1]])
        return get

    groups = []
    for group in hf_hybrid._declared(cfg):
        codes, scales, biases = (hf_hybrid._to_jspec(cfg, group, part(i)) for i in range(3))
        out = {}
        for key, decl in group.items():
            if rename(decl.hf.format(e=0)) in quantized:
                out[key] = quant.Q4(jnp.asarray(codes[key]), jnp.asarray(scales[key].astype(dt)),
                                    jnp.asarray(biases[key].astype(dt)))
            else:
                out[key] = jnp.asarray(codes[key].astype(dt))
        groups.append(out)
    top, *layers = groups
    return cfg, {**top, "layers": layers}


# --- conversion -----------------------------------------------------------------------------------


def quantize_tensors(tensors: dict[str, np.ndarray], dtype=None) -> dict[str, np.ndarray]:
    """A float checkpoint's tensors with every quantizable matrix (`quantizable`) as codes, scales and
    biases (`quant.quantize`; scales and biases in `dtype`, default each matrix's own)."""
    out = {}
    for name, arr in tensors.items():
        if quantizable(name, arr.shape):
            q = quant.quantize(arr, None if dtype is None else hf.np_dtype(dtype))
            scales, biases = _parts(name)
            out[name], out[scales], out[biases] = np.asarray(q.codes), np.asarray(q.scales), np.asarray(q.biases)
        else:
            out[name] = arr if dtype is None else arr.astype(hf.np_dtype(dtype))
    return out


def convert_q4(src: str, dst: str, dtype=None) -> dict:
    """Write the Q4 form of the float checkpoint `src` into `dst` (config.json with the quantization
    settings, model.safetensors, and the tokenizer files); the source is loaded strictly first, so only
    a checkpoint jspec reads converts. Returns {"quantized": n, "float": m, "bytes": ...}."""
    hf_config = read_json_object(os.path.join(src, "config.json"))
    if q4_settings(hf_config, src) is not None:
        raise hf.CheckpointError(f"{src!r} is already quantized (config.json has {QUANT_KEYS[0]}): convert a float checkpoint")
    if hf_config.get("model_type") in hybrid.SUPPORTED_ARCHITECTURES:
        hf_hybrid.load_hybrid_params(src)
    else:
        hf.load_params(src)
    tensors = hf.read_safetensors(src)
    out = quantize_tensors(tensors, dtype)
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "mlx"})
    hf_config = {**hf_config, QUANT_KEYS[0]: dict(SETTINGS), QUANT_KEYS[1]: dict(SETTINGS)}
    if dtype is not None:
        hf_config["dtype"] = jnp.dtype(dtype).name
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(src, name)):
            with open(os.path.join(src, name), "rb") as a, open(os.path.join(dst, name), "wb") as b:
                b.write(a.read())
    n_q = sum(1 for n, t in tensors.items() if quantizable(n, t.shape))
    return {"quantized": n_q, "float": len(tensors) - n_q, "bytes": int(sum(a.nbytes for a in out.values())),
            "source_bytes": int(sum(a.nbytes for a in tensors.values()))}
