"""Strict loading and export of Qwen3-Next / Qwen3.5 text checkpoints (safetensors).

Tensor names (under `model.`, or `model.language_model.` in multimodal Qwen3.5 checkpoints):
embed_tokens, norm, layers.{i}.{input_layernorm, post_attention_layernorm}, attention layers
`self_attn.{q,k,v,o}_proj, q_norm, k_norm`, GDN layers `linear_attn.{conv1d, dt_bias, A_log, norm,
out_proj}` plus Qwen3-Next's grouped `in_proj_qkvz, in_proj_ba` or Qwen3.5's flat `in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a`, dense `mlp.{gate,up,down}_proj`, MoE `mlp.gate`,
`mlp.experts.{e}.{gate,up,down}_proj`, `mlp.shared_expert.*`, `mlp.shared_expert_gate`; `lm_head`.

The tensor names, shapes and orientations come from the parameter declarations of
`jspec.models.hybrid` (one per jspec leaf; the layouts the loader converts are listed below).
Loading never falls back to random values: every missing, unexpected or misshapen tensor is named in
one `CheckpointError`, with a hint when the layer pattern disagrees with config.json. Known extras
that the text model does not use are skipped by the target's loader, as transformers skips them:
`mtp.*` (the multi-token-prediction module of released checkpoints, which the MTP drafter reads with
`load_mtp_params`, as strictly) and `model.visual.*` (Qwen3.5's vision tower).
Export writes `Qwen3NextForCausalLM` or `Qwen3_5ForCausalLM` (prefix `model.`).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jspec.errors import CheckpointError
from jspec.io.hf import check_tensors, np_dtype, read_safetensors
from jspec.models.declare import Declared
from jspec.models.hybrid import HybridConfig, declarations, load_hybrid_config

MTP_PREFIX = "mtp."  # the multi-token-prediction module's tensors, top-level in every released checkpoint
KNOWN_EXTRAS = (MTP_PREFIX, "model.visual.")

# The checkpoint names of the declarations (`jspec.models.hybrid`) are read here. A tensor is stored
# as HF stores it ([out, in] for matrices) unless its declaration says `transpose`; three layouts
# the loader converts besides:
# - "{e}" in a name: one tensor per expert, stacked in jspec on a leading expert axis;
# - conv1d.weight: HF's Conv1d weight [C, 1, K] (jspec: conv [K, C], the unit axis dropped);
# - several declarations naming one tensor (Qwen3-Next's in_proj_qkvz, in_proj_ba): their rows,
#   grouped per key head in the checkpoint (`_split_grouped`).


def _rename(name: str, prefix: str) -> str:
    """A declared name (under `model.`) under the checkpoint's prefix."""
    return prefix + name[len("model."):] if name.startswith("model.") else name


def _is_conv(name: str) -> bool:
    return name.endswith("conv1d.weight")


def _hf_shape(decl: Declared) -> tuple[int, ...]:
    """Shape of the checkpoint tensor (of one expert's) that one declaration reads."""
    shape = tuple(decl.value.shape[1:] if "{e}" in decl.hf else decl.value.shape)
    shape = tuple(reversed(shape)) if decl.transpose else shape
    return (shape[0], 1, shape[1]) if _is_conv(decl.hf) else shape


def _declared(cfg: HybridConfig) -> list[dict[str, Declared]]:
    """The declarations as dicts: the top-level parameters, then one dict per layer."""
    top = declarations(cfg)
    return [{k: d for k, d in top.items() if k != "layers"}, *top["layers"]]


def expected_tensors(cfg: HybridConfig, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the config implies -> its HF shape (`prefix` in place of `model.`)."""
    return _expected(cfg, _declared(cfg), prefix)


def _expected(cfg: HybridConfig, groups: list[dict[str, Declared]], prefix: str) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for group in groups:
        for decl in group.values():
            name, shape = _rename(decl.hf, prefix), _hf_shape(decl)
            if "{e}" in name:
                out.update({name.format(e=e): shape for e in range(cfg.num_experts)})
            elif name in out:  # a grouped tensor: the declarations' rows together
                out[name] = (out[name][0] + shape[0],) + shape[1:]
            else:
                out[name] = shape
    return out


def _split_grouped(cfg: HybridConfig, qkvz: np.ndarray, ba: np.ndarray) -> dict[str, np.ndarray]:
    """Qwen3-Next per-key-head groups [q dk, k dk, v r*dv, z r*dv] / [b r, a r] -> flat [out, in] rows."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk
    d = qkvz.shape[-1]
    q, k, v, z = np.split(qkvz.reshape(hk, 2 * dk + 2 * r * dv, d), [dk, 2 * dk, 2 * dk + r * dv], axis=1)
    b, a = np.split(ba.reshape(hk, 2 * r, d), [r], axis=1)
    flat = lambda x: x.reshape(-1, d)
    return {"qkv": np.concatenate([flat(q), flat(k), flat(v)]), "z": flat(z), "b": flat(b), "a": flat(a)}


def _join_grouped(cfg: HybridConfig, qkv: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray):
    """Inverse of `_split_grouped`: flat [out, in] rows -> (in_proj_qkvz, in_proj_ba)."""
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    d = qkv.shape[-1]
    q, k, v = np.split(qkv, [hk * dk, 2 * hk * dk])
    grp = lambda x: x.reshape(hk, -1, d)
    qkvz = np.concatenate([grp(q), grp(k), grp(v), grp(z)], axis=1).reshape(-1, d)
    ba = np.concatenate([grp(b), grp(a)], axis=1).reshape(-1, d)
    return qkvz, ba


def _grouped(group: dict[str, Declared]) -> bool:
    return "w_qkv" in group and group["w_qkv"].hf == group["w_z"].hf


def _to_jspec(cfg: HybridConfig, group: dict[str, Declared], get) -> dict[str, np.ndarray]:
    """The jspec arrays of one dict of declarations from the checkpoint tensors `get(name)`."""
    out = {}
    if _grouped(group):
        rows = _split_grouped(cfg, get(group["w_qkv"].hf), get(group["w_b"].hf))
        out = {f"w_{n}": rows[n] for n in rows}
    for key, decl in group.items():
        if key in out:
            continue
        if "{e}" in decl.hf:
            arr = np.stack([get(decl.hf.format(e=e)) for e in range(cfg.num_experts)])
            out[key] = arr.swapaxes(1, 2) if decl.transpose else arr
            continue
        arr = get(decl.hf)
        arr = arr[:, 0] if _is_conv(decl.hf) else arr
        out[key] = arr.T if decl.transpose else arr
    return out


def _to_hf(cfg: HybridConfig, group: dict[str, Declared], params: dict) -> dict[str, np.ndarray]:
    """Inverse of `_to_jspec`: checkpoint name -> array, from the jspec arrays `params` of the group."""
    host = {key: np.asarray(jax.device_get(params[key])) for key in group}
    out = {}
    if _grouped(group):
        qkvz, ba = _join_grouped(cfg, *(host.pop(f"w_{n}") for n in ("qkv", "z", "b", "a")))
        out = {group["w_qkv"].hf: qkvz, group["w_b"].hf: ba}
    for key, arr in host.items():
        decl = group[key]
        if "{e}" in decl.hf:
            out.update({decl.hf.format(e=e): arr[e].T if decl.transpose else arr[e] for e in range(len(arr))})
            continue
        arr = arr.T if decl.transpose else arr
        out[decl.hf] = arr[:, None] if _is_conv(decl.hf) else arr
    return out


def _pattern_hints(cfg: HybridConfig, names: set[str], prefix: str) -> list[str]:
    """Per layer, where the checkpoint's mixer / MLP kind disagrees with config.json."""
    hints = []
    for i in range(cfg.num_layers):
        base = f"{prefix}layers.{i}."
        has = lambda part: any(n.startswith(base + part) for n in names)
        found_mixer = "full_attention" if has("self_attn.") else "linear_attention" if has("linear_attn.") else None
        if found_mixer and found_mixer != cfg.layer_types[i]:
            hints.append(f"layer {i}: config.json says {cfg.layer_types[i]}, "
                         f"the checkpoint holds {found_mixer} tensors")
        found_mlp = "moe" if has("mlp.experts.") else "dense" if has("mlp.gate_proj.") else None
        if found_mlp and found_mlp != cfg.mlp_types[i]:
            hints.append(f"layer {i}: config.json implies a {cfg.mlp_types[i]} MLP, "
                         f"the checkpoint holds a {found_mlp} one")
    return hints


def load_hybrid_params(model_dir: str, dtype=jnp.float32, cfg: HybridConfig | None = None,
                       check_values: bool = True) -> tuple[HybridConfig, dict]:
    """Load `config.json` + safetensors into a jspec hybrid parameter pytree of `dtype`.

    Raises CheckpointError naming every missing, unexpected, misshapen and mistyped tensor (a config whose
    layer pattern, head counts or conv kernel disagree with the tensors fails here, before any compute),
    then every tensor holding NaN / inf (check_values=False or JSPEC_SKIP_VALUE_CHECK=1 skip that scan).
    """
    cfg = cfg or load_hybrid_config(model_dir)
    found = {n: t for n, t in read_safetensors(model_dir).items() if not n.startswith(KNOWN_EXTRAS)}
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in found) else "model."
    expected = expected_tensors(cfg, prefix)
    allowed = set()
    if cfg.tie_word_embeddings and "lm_head.weight" in found and np.array_equal(
            found["lm_head.weight"], found.get(prefix + "embed_tokens.weight")):
        allowed.add("lm_head.weight")  # a tied checkpoint may store the head as a copy of the embedding
    hints = [f"layer pattern: {h}" for h in _pattern_hints(cfg, set(found), prefix)]
    check_tensors(found, expected, f"checkpoint {model_dir!r} ({cfg.family}, {cfg.num_layers} layers, prefix {prefix!r})",
                  "point at the matching checkpoint, or correct layer_types / head counts / linear_conv_kernel_dim "
                  "in config.json", allowed, hints, check_values=check_values)

    dt = np_dtype(dtype)
    get = lambda name: np.asarray(found[_rename(name, prefix)])
    top, *layers = (
        {k: jnp.asarray(a.astype(dt)) for k, a in _to_jspec(cfg, group, get).items()} for group in _declared(cfg))
    return cfg, {**top, "layers": layers}


def save_hybrid_params(model_dir: str, cfg: HybridConfig, params: dict, dtype=None) -> None:
    """Write `config.json` + `model.safetensors` that transformers loads (AutoModelForCausalLM)."""
    os.makedirs(model_dir, exist_ok=True)
    top, *layers = _declared(cfg)
    tensors = _to_hf(cfg, top, params)
    for group, lp in zip(layers, params["layers"], strict=True):
        tensors.update(_to_hf(cfg, group, lp))
    cast = None if dtype is None else np_dtype(dtype)
    tensors = {n: np.ascontiguousarray(a if cast is None else a.astype(cast)) for n, a in tensors.items()}
    save_file(tensors, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf_dict()
    hf["dtype"] = "bfloat16" if tensors["model.norm.weight"].dtype == ml_dtypes.bfloat16 else "float32"
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)


# --- the multi-token-prediction module (`mtp.*`) ------------------------------------------------


def read_tensors_under(model_dir: str, prefix: str) -> dict[str, np.ndarray]:
    """The checkpoint's tensors whose names start with `prefix` (`jspec.io.hf.read_safetensors`): with an
    index, only the shards it maps them to are read; the MTP module of a large checkpoint is a few tensors
    beside the whole model."""
    return read_safetensors(model_dir, prefix)


def _mtp_groups(declared: dict) -> list[dict[str, Declared]]:
    """The MTP module's declarations (`jspec.drafters.mtp.declarations`: its top-level tensors and its
    decoder layer under "layer") as the loader's groups: the top level, then the layer."""
    return [{k: d for k, d in declared.items() if k != "layer"}, declared["layer"]]


def expected_mtp_tensors(cfg: HybridConfig, declared: dict) -> dict[str, tuple[int, ...]]:
    """Every `mtp.*` tensor name of the MTP module -> its HF shape. cfg: the module's layer config (the
    target's, with one full-attention layer); declared: its declarations."""
    return _expected(cfg, _mtp_groups(declared), MTP_PREFIX)


def load_mtp_params(model_dir: str, cfg: HybridConfig, declared: dict, dtype=jnp.float32,
                    check_values: bool = True) -> dict:
    """The `mtp.*` tensors of a checkpoint folder (the target's own, or a saved MTP drafter's) as the MTP
    module's jspec parameters ({top-level arrays..., "layer": the decoder layer's dict}), `dtype`.

    Strict like the target's loader: a folder without `mtp.*` tensors, and every missing, unexpected,
    misshapen or mistyped one (and NaN / inf values unless check_values=False), is a CheckpointError naming
    the tensors."""
    expected = expected_mtp_tensors(cfg, declared)
    found = read_tensors_under(model_dir, MTP_PREFIX)
    if not found:
        names = sorted(expected)
        shown = ", ".join(names[:20]) + (f", ... ({len(names) - 20} more)" if len(names) > 20 else "")
        raise CheckpointError(
            f"checkpoint {model_dir!r} holds no multi-token-prediction tensors ({MTP_PREFIX}*): the MTP drafter "
            f"reads its {len(names)} tensors ({shown}) from the checkpoint\n"
            "  fix: use a checkpoint that ships its MTP module (the released Qwen3.5 / Qwen3-Next checkpoints do; "
            "some conversions and quantized exports drop it), or another drafter")
    check_tensors(found, expected, f"the MTP module of checkpoint {model_dir!r} ({cfg.family}, {MTP_PREFIX}*)",
                  "point at a checkpoint whose mtp.* tensors were trained for this model (same hidden size, heads "
                  "and MLP as config.json says)", check_values=check_values)
    dt = np_dtype(dtype)
    get = lambda name: np.asarray(found[_rename(name, MTP_PREFIX)])
    top, layer = ({k: jnp.asarray(a.astype(dt)) for k, a in _to_jspec(cfg, group, get).items()}
                  for group in _mtp_groups(declared))
    return {**top, "layer": layer}


def mtp_tensors(cfg: HybridConfig, declared: dict, params: dict, dtype=None) -> dict[str, np.ndarray]:
    """The MTP module's parameters as checkpoint tensors under their official `mtp.*` names (inverse of
    `load_mtp_params`)."""
    top, layer = _mtp_groups(declared)
    tensors = {**_to_hf(cfg, top, params), **_to_hf(cfg, layer, params["layer"])}
    cast = None if dtype is None else np_dtype(dtype)
    return {_rename(n, MTP_PREFIX): np.ascontiguousarray(a if cast is None else a.astype(cast))
            for n, a in tensors.items()}
