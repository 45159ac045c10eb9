"""Strict loading and export of Qwen3-Next / Qwen3.5 text checkpoints (safetensors).

Tensor names (under `model.`, or `model.language_model.` in multimodal Qwen3.5 checkpoints):
embed_tokens, norm, layers.{i}.{input_layernorm, post_attention_layernorm}, attention layers
`self_attn.{q,k,v,o}_proj, q_norm, k_norm`, GDN layers `linear_attn.{conv1d, dt_bias, A_log, norm,
out_proj}` plus Qwen3-Next's grouped `in_proj_qkvz, in_proj_ba` or Qwen3.5's flat `in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a`, dense `mlp.{gate,up,down}_proj`, MoE `mlp.gate`,
`mlp.experts.{e}.{gate,up,down}_proj`, `mlp.shared_expert.*`, `mlp.shared_expert_gate`; `lm_head`.

Loading never falls back to random values: every missing, unexpected or misshapen tensor is named in
one `CheckpointError`, with a hint when the layer pattern disagrees with config.json. Known extras
that the text model does not use are skipped, as transformers skips them: `mtp.*` (the multi-token
prediction head of released checkpoints) and `model.visual.*` (Qwen3.5's vision tower).
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

from jspec.io.hf import check_tensors, read_safetensors
from jspec.models.hybrid import FULL, HybridConfig, load_hybrid_config, param_shapes

KNOWN_EXTRAS = ("mtp.", "model.visual.")


def _layer_shapes(cfg: HybridConfig, i: int) -> dict[str, tuple[int, ...]]:
    """HF name (below `layers.{i}.`) -> HF shape, for layer i."""
    d, hq, hkv, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    out = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,)}
    if cfg.layer_types[i] == FULL:
        out.update({"self_attn.q_proj.weight": (hq * 2 * dh, d), "self_attn.k_proj.weight": (hkv * dh, d),
                    "self_attn.v_proj.weight": (hkv * dh, d), "self_attn.o_proj.weight": (d, hq * dh),
                    "self_attn.q_norm.weight": (dh,), "self_attn.k_norm.weight": (dh,)})
    else:
        la = "linear_attn."
        if cfg.family == "qwen3_next":
            out.update({la + "in_proj_qkvz.weight": (2 * hk * dk + 2 * hv * dv, d),
                        la + "in_proj_ba.weight": (2 * hv, d)})
        else:
            out.update({la + "in_proj_qkv.weight": (cfg.conv_dim, d), la + "in_proj_z.weight": (hv * dv, d),
                        la + "in_proj_b.weight": (hv, d), la + "in_proj_a.weight": (hv, d)})
        out.update({la + "conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim), la + "dt_bias": (hv,),
                    la + "A_log": (hv,), la + "norm.weight": (dv,), la + "out_proj.weight": (d, hv * dv)})
    if cfg.mlp_types[i] == "moe":
        fe, fs = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        out["mlp.gate.weight"] = (cfg.num_experts, d)
        for e in range(cfg.num_experts):
            out.update({f"mlp.experts.{e}.gate_proj.weight": (fe, d), f"mlp.experts.{e}.up_proj.weight": (fe, d),
                        f"mlp.experts.{e}.down_proj.weight": (d, fe)})
        out.update({"mlp.shared_expert.gate_proj.weight": (fs, d), "mlp.shared_expert.up_proj.weight": (fs, d),
                    "mlp.shared_expert.down_proj.weight": (d, fs), "mlp.shared_expert_gate.weight": (1, d)})
    else:
        f = cfg.intermediate_size
        out.update({"mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)})
    return out


def expected_tensors(cfg: HybridConfig, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the config implies -> its HF shape."""
    out = {f"{prefix}embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
           f"{prefix}norm.weight": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for i in range(cfg.num_layers):
        out.update({f"{prefix}layers.{i}.{k}": s for k, s in _layer_shapes(cfg, i).items()})
    return out


def _stack_index(cfg: HybridConfig, i: int) -> tuple[int, int]:
    """Index of layer i within its mixer stack and within its MLP stack."""
    mixer = cfg.layer_types[i]
    mlp = cfg.mlp_types[i]
    return cfg.layer_types[:i].count(mixer), cfg.mlp_types[:i].count(mlp)


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


def _layer_to_jspec(cfg: HybridConfig, i: int, get) -> dict[tuple[str, str], np.ndarray]:
    """HF tensors of layer i (get(name below layers.{i}.)) -> {(group, key): jspec array}."""
    out = {("norms", "in_norm"): get("input_layernorm.weight"),
           ("norms", "mlp_norm"): get("post_attention_layernorm.weight")}
    if cfg.layer_types[i] == FULL:
        sa = "self_attn."
        out.update({("attn", "wq"): get(sa + "q_proj.weight").T, ("attn", "wk"): get(sa + "k_proj.weight").T,
                    ("attn", "wv"): get(sa + "v_proj.weight").T, ("attn", "wo"): get(sa + "o_proj.weight").T,
                    ("attn", "q_norm"): get(sa + "q_norm.weight"), ("attn", "k_norm"): get(sa + "k_norm.weight")})
    else:
        la = "linear_attn."
        if cfg.family == "qwen3_next":
            p = _split_grouped(cfg, get(la + "in_proj_qkvz.weight"), get(la + "in_proj_ba.weight"))
        else:
            p = {n: get(f"{la}in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")}
        out.update({("gdn", f"w_{n}"): p[n].T for n in ("qkv", "z", "b", "a")})
        out.update({("gdn", "conv"): get(la + "conv1d.weight")[:, 0, :].T, ("gdn", "dt_bias"): get(la + "dt_bias"),
                    ("gdn", "A_log"): get(la + "A_log"), ("gdn", "norm"): get(la + "norm.weight"),
                    ("gdn", "w_out"): get(la + "out_proj.weight").T})
    if cfg.mlp_types[i] == "moe":
        e = cfg.num_experts
        experts = lambda n: np.stack([get(f"mlp.experts.{x}.{n}.weight").T for x in range(e)])
        se = "mlp.shared_expert."
        out.update({("moe", "router"): get("mlp.gate.weight").T, ("moe", "e_gate"): experts("gate_proj"),
                    ("moe", "e_up"): experts("up_proj"), ("moe", "e_down"): experts("down_proj"),
                    ("moe", "s_gate"): get(se + "gate_proj.weight").T, ("moe", "s_up"): get(se + "up_proj.weight").T,
                    ("moe", "s_down"): get(se + "down_proj.weight").T,
                    ("moe", "shared_gate"): get("mlp.shared_expert_gate.weight").T})
    else:
        out.update({("mlp", f"w_{n}"): get(f"mlp.{n}_proj.weight").T for n in ("gate", "up", "down")})
    return out


def _layer_to_hf(cfg: HybridConfig, i: int, params: dict) -> dict[str, np.ndarray]:
    """jspec parameters of layer i -> {HF name below layers.{i}.: array}."""
    jm, jf = _stack_index(cfg, i)
    host = lambda group, key, j: np.asarray(jax.device_get(params[group][key][j]))
    out = {"input_layernorm.weight": host("norms", "in_norm", i),
           "post_attention_layernorm.weight": host("norms", "mlp_norm", i)}
    if cfg.layer_types[i] == FULL:
        sa = "self_attn."
        out.update({sa + f"{n}_proj.weight": host("attn", f"w{n}", jm).T for n in ("q", "k", "v", "o")})
        out.update({sa + "q_norm.weight": host("attn", "q_norm", jm), sa + "k_norm.weight": host("attn", "k_norm", jm)})
    else:
        la = "linear_attn."
        flat = {n: host("gdn", f"w_{n}", jm).T for n in ("qkv", "z", "b", "a")}
        if cfg.family == "qwen3_next":
            out[la + "in_proj_qkvz.weight"], out[la + "in_proj_ba.weight"] = _join_grouped(cfg, **flat)
        else:
            out.update({f"{la}in_proj_{n}.weight": flat[n] for n in flat})
        out.update({la + "conv1d.weight": host("gdn", "conv", jm).T[:, None, :],
                    la + "dt_bias": host("gdn", "dt_bias", jm),
                    la + "A_log": host("gdn", "A_log", jm), la + "norm.weight": host("gdn", "norm", jm),
                    la + "out_proj.weight": host("gdn", "w_out", jm).T})
    if cfg.mlp_types[i] == "moe":
        out["mlp.gate.weight"] = host("moe", "router", jf).T
        for n in ("gate", "up", "down"):
            w = host("moe", f"e_{n}", jf)
            out.update({f"mlp.experts.{e}.{n}_proj.weight": w[e].T for e in range(cfg.num_experts)})
            out[f"mlp.shared_expert.{n}_proj.weight"] = host("moe", f"s_{n}", jf).T
        out["mlp.shared_expert_gate.weight"] = host("moe", "shared_gate", jf).T
    else:
        out.update({f"mlp.{n}_proj.weight": host("mlp", f"w_{n}", jf).T for n in ("gate", "up", "down")})
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


def load_hybrid_params(model_dir: str, dtype=jnp.float32, cfg: HybridConfig | None = None) -> tuple[HybridConfig, dict]:
    """Load `config.json` + safetensors into a jspec hybrid parameter pytree of `dtype`.

    Raises CheckpointError naming every missing, unexpected and misshapen tensor (a config whose layer
    pattern, head counts or conv kernel disagree with the tensors fails here, before any compute).
    """
    cfg = cfg or load_hybrid_config(model_dir)
    np_dtype = ml_dtypes.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(dtype)
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
                  "in config.json", allowed, hints)

    shapes = param_shapes(cfg)
    host = {k: (np.empty(s, np_dtype) if isinstance(s, tuple) else {kk: np.empty(ss, np_dtype) for kk, ss in s.items()})
            for k, s in shapes.items()}
    host["embed"][...] = found[prefix + "embed_tokens.weight"]
    host["final_norm"][...] = found[prefix + "norm.weight"]
    if not cfg.tie_word_embeddings:
        host["lm_head"][...] = found["lm_head.weight"].T
    for i in range(cfg.num_layers):
        jm, jf = _stack_index(cfg, i)
        get = lambda name, base=f"{prefix}layers.{i}.": np.asarray(found[base + name])
        for (group, key), arr in _layer_to_jspec(cfg, i, get).items():
            j = i if group == "norms" else jm if group in ("attn", "gdn") else jf
            host[group][key][j] = arr
    return cfg, jax.tree_util.tree_map(jnp.asarray, host)


def save_hybrid_params(model_dir: str, cfg: HybridConfig, params: dict, dtype=None) -> None:
    """Write `config.json` + `model.safetensors` that transformers loads (AutoModelForCausalLM)."""
    os.makedirs(model_dir, exist_ok=True)
    top = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    if not cfg.tie_word_embeddings:
        top["lm_head.weight"] = params["lm_head"].T
    tensors = {n: np.asarray(jax.device_get(a)) for n, a in top.items()}
    for i in range(cfg.num_layers):
        tensors.update({f"model.layers.{i}.{n}": a for n, a in _layer_to_hf(cfg, i, params).items()})
    cast = None if dtype is None else ml_dtypes.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(dtype)
    tensors = {n: np.ascontiguousarray(a if cast is None else a.astype(cast)) for n, a in tensors.items()}
    save_file(tensors, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf_dict()
    hf["dtype"] = "bfloat16" if tensors["model.norm.weight"].dtype == ml_dtypes.bfloat16 else "float32"
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
