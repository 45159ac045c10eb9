"""Hybrid recurrent targets (Qwen3-Next, Qwen3.5 text): Gated DeltaNet layers mixed with gated attention.

Pure functions over a parameter pytree, mirroring `transformer.py` (matrices stored [in, out]).
Per-layer tensors are stacked by kind, in layer order within each stack:

    embed [V, D]; final_norm [D]; lm_head [D, V] (absent when embeddings are tied)
    norms:  in_norm, mlp_norm [L, D]                         zero-centred: x_hat * (1 + w)
    attn:   (La full-attention layers)
            wq [La, D, Hq*2*Dh] (per head [query Dh | gate Dh]), wk/wv [La, D, Hkv*Dh],
            wo [La, Hq*Dh, D], q_norm/k_norm [La, Dh] (zero-centred)
    gdn:    (Lg Gated DeltaNet layers; one flat projection layout for both families, the loader
            converts Qwen3-Next's grouped in_proj_qkvz / in_proj_ba)
            w_qkv [Lg, D, C] with C = 2*HK*dk + HV*dv, the conv channels [q | k | v];
            w_z [Lg, D, HV*dv]; w_b/w_a [Lg, D, HV]; conv [Lg, K, C]; dt_bias/A_log [Lg, HV];
            norm [Lg, dv] (gated RMSNorm, ones-centred); w_out [Lg, HV*dv, D]
    mlp:    (Ld dense SwiGLU layers) w_gate/w_up [Ld, D, F], w_down [Ld, F, D]
    moe:    (Lm sparse layers) router [Lm, D, E]; e_gate/e_up [Lm, E, D, Fe]; e_down [Lm, E, Fe, D];
            s_gate/s_up [Lm, D, Fs], s_down [Lm, Fs, D] (shared expert); shared_gate [Lm, D, 1]

A group is absent when the model has no layer of that kind. The layer stack runs as one `lax.scan`
over repeats of the shortest periodic block of layer kinds (Qwen3-Next: 3 GDN + 1 attention), the
layers of a block unrolled; stacks are reshaped [L_x] -> [blocks, per block] for the scan.

Cache (`HybridCache`): K/V of the attention layers with `transformer.KVCache` row semantics, and per
GDN layer the conv window (last K-1 conv inputs) and the recurrent state S (float32).

Committing after a verify pass uses the **per-position states** strategy (HYBRID.md): the pass
(`keep_states=True`) returns the conv window and S after every one of its T tokens, and
`commit_states` gathers the accepted one. Chosen over replay because the commit is then a gather
with no second recurrent pass, verify and plain decoding run the same token-by-token kernel (greedy
equality), and trees come for free (a node's state is computed from its parent's). The price is
transient memory, T x state per GDN layer and row during the pass: for a Qwen3-Next-80B GDN layer
(HK 16, HV 32, dk = dv 128, conv_dim 8192, K 4) at T = 16 that is 16 x (32*128*128*4 B = 2 MiB of S
+ 3*8192*2 B = 48 KiB of bf16 window) = 34,340,864 B (32.75 MiB); x 36 GDN layers = 1.15 GiB per
row. Replay would keep only the pass's (q, k, v, g, beta): 16 x 8256 x 4 B = 528,384 B per layer
and row, 65x less, for a second (<= T step) recurrent pass after verification.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models import gdn
from jspec.models.attention import attend, write_rows
from jspec.models.transformer import rope

LINEAR, FULL = "linear_attention", "full_attention"
SUPPORTED_ARCHITECTURES = {
    "qwen3_next": ("Qwen3NextForCausalLM",),
    "qwen3_5_text": ("Qwen3_5ForCausalLM",),
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
}


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """Hashable description of a Qwen3-Next / Qwen3.5 text model; used as a static jit argument.

    family "qwen3_next" stores GDN projections grouped per key head and may use MoE MLPs;
    family "qwen3_5" stores them flat and uses dense MLPs.
    """

    family: str  # "qwen3_next" | "qwen3_5"
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # per layer: "linear_attention" | "full_attention"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    max_position_embeddings: int = 32768

    def __post_init__(self):
        if self.family not in ("qwen3_next", "qwen3_5"):
            raise ValueError(f"unsupported hybrid family {self.family!r}; expected qwen3_next or qwen3_5")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                             f"{self.num_layers}")
        bad = sorted(set(self.layer_types) - {LINEAR, FULL})
        if bad:
            raise ValueError(f"unsupported layer types {bad}; expected {LINEAR} or {FULL}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                             f"({self.num_kv_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_num_key_heads})")
        if self.linear_conv_kernel_dim < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {self.linear_conv_kernel_dim}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) * partial_rotary_factor ({self.partial_rotary_factor}) "
                             f"must give an even rotary dimension >= 2")
        if "moe" in self.mlp_types and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must lie in [1, num_experts "
                             f"({self.num_experts})]")

    # --- derived static structure ---------------------------------------------------------------

    @property
    def mlp_types(self) -> tuple[str, ...]:
        """Per layer "moe" or "dense" (transformers' rule: mlp_only_layers, decoder_sparse_step)."""
        return tuple(
            "moe" if (i not in self.mlp_only_layers and self.num_experts > 0
                      and (i + 1) % self.decoder_sparse_step == 0) else "dense"
            for i in range(self.num_layers)
        )

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * \
            self.linear_value_head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def counts(self) -> dict[str, int]:
        """Layers per stack: attn, gdn, mlp, moe."""
        return {"attn": self.layer_types.count(FULL), "gdn": self.layer_types.count(LINEAR),
                "mlp": self.mlp_types.count("dense"), "moe": self.mlp_types.count("moe")}

    @property
    def block(self) -> tuple[tuple[str, str], ...]:
        """The shortest period of per-layer (mixer stack, MLP stack) names that tiles the layer stack."""
        kinds = tuple(("attn" if m == FULL else "gdn", "moe" if f == "moe" else "mlp")
                      for m, f in zip(self.layer_types, self.mlp_types))
        n = self.num_layers
        return next(kinds[:p] for p in range(1, n + 1)
                    if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)))

    @property
    def num_params(self) -> int:
        return int(sum(np.prod(s) for s in jax.tree_util.tree_leaves(
            param_shapes(self), is_leaf=lambda s: isinstance(s, tuple))))

    # --- HF conversion --------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "HybridConfig":
        model_type = hf.get("model_type")
        archs = tuple(hf.get("architectures") or ())
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture: model_type={model_type!r} architectures={list(archs)}; the hybrid "
                f"loader reads model_type in {sorted(SUPPORTED_ARCHITECTURES)}")
        unsupported = [a for a in archs if a not in SUPPORTED_ARCHITECTURES[model_type]]
        if unsupported:
            raise ValueError(f"unsupported architecture {unsupported} for model_type {model_type!r}; expected one "
                             f"of {list(SUPPORTED_ARCHITECTURES[model_type])}")
        top = hf
        if model_type == "qwen3_5":
            # The multimodal checkpoint nests the language model's settings under text_config.
            if not isinstance(hf.get("text_config"), dict):
                raise ValueError("model_type qwen3_5 config.json has no text_config section")
            hf = {**hf["text_config"]}
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}: jspec implements SwiGLU (silu) MLPs")
        if hf.get("attention_bias", False):
            raise ValueError("attention_bias=True is not supported for hybrid models (no released checkpoint uses it)")
        rope = dict(hf.get("rope_scaling") or {})
        rope.update(hf.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r} for hybrid models; supported: default")
        n_layers = int(hf["num_hidden_layers"])
        layer_types = hf.get("layer_types")
        if not layer_types:
            interval = int(hf.get("full_attention_interval", 4))
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(n_layers)]

        def pick(name, default=None):
            return hf.get(name, top.get(name, default))

        eos = pick("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        moe = model_type == "qwen3_next"
        n_heads = int(hf["num_attention_heads"])
        return cls(
            family="qwen3_next" if moe else "qwen3_5",
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            num_layers=n_layers,
            layer_types=tuple(layer_types),
            num_heads=n_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=int(hf.get("head_dim", 256)),
            linear_num_key_heads=int(hf.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(hf.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(hf.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(hf.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(hf.get("linear_conv_kernel_dim", 4)),
            intermediate_size=int(hf["intermediate_size"]),
            # transformers' defaults where a field is absent (Qwen3-Next-80B's values).
            num_experts=int(hf.get("num_experts", 512)) if moe else 0,
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 10)) if moe else 0,
            moe_intermediate_size=int(hf.get("moe_intermediate_size", 512)) if moe else 0,
            shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size", 512)) if moe else 0,
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in (hf.get("mlp_only_layers") or ())),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
            tie_word_embeddings=bool(pick("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=pick("bos_token_id"),
            pad_token_id=pick("pad_token_id"),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        )

    @classmethod
    def from_file(cls, path: str) -> "HybridConfig":
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json for Qwen3NextForCausalLM, or Qwen3_5ForCausalLM (model_type qwen3_5_text)."""
        out: dict[str, Any] = {
            "architectures": ["Qwen3NextForCausalLM" if self.family == "qwen3_next" else "Qwen3_5ForCausalLM"],
            "model_type": "qwen3_next" if self.family == "qwen3_next" else "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "attention_bias": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "pad_token_id": self.pad_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.family == "qwen3_next":
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size,
                       shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                       norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                       mlp_only_layers=list(self.mlp_only_layers))
        return out


def load_hybrid_config(model_dir: str) -> HybridConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json in {model_dir!r}: pass a Hugging Face model directory")
    return HybridConfig.from_file(path)


def rope_inv_freq(cfg: HybridConfig) -> np.ndarray:
    """Inverse RoPE frequencies over the rotary part of the head [rotary_dim // 2], float32 like HF."""
    rd = cfg.rotary_dim
    return (1.0 / np.float32(cfg.rope_theta) ** (np.arange(0, rd, 2, dtype=np.float32) / np.float32(rd))
            ).astype(np.float32)


# --- parameters ---------------------------------------------------------------------------------


def param_shapes(cfg: HybridConfig) -> dict:
    """Shape of every parameter, in the pytree layout of the module docstring."""
    d, v, n = cfg.hidden_size, cfg.vocab_size, cfg.counts
    hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    shapes: dict = {"embed": (v, d), "final_norm": (d,),
                    "norms": {"in_norm": (cfg.num_layers, d), "mlp_norm": (cfg.num_layers, d)}}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, v)
    if n["attn"]:
        la = n["attn"]
        shapes["attn"] = {"wq": (la, d, hq * 2 * dh), "wk": (la, d, hkv * dh), "wv": (la, d, hkv * dh),
                          "wo": (la, hq * dh, d), "q_norm": (la, dh), "k_norm": (la, dh)}
    if n["gdn"]:
        lg, c = n["gdn"], cfg.conv_dim
        shapes["gdn"] = {"w_qkv": (lg, d, c), "w_z": (lg, d, hv * dv), "w_b": (lg, d, hv), "w_a": (lg, d, hv),
                         "conv": (lg, cfg.linear_conv_kernel_dim, c), "dt_bias": (lg, hv), "A_log": (lg, hv),
                         "norm": (lg, dv), "w_out": (lg, hv * dv, d)}
    if n["mlp"]:
        ld, f = n["mlp"], cfg.intermediate_size
        shapes["mlp"] = {"w_gate": (ld, d, f), "w_up": (ld, d, f), "w_down": (ld, f, d)}
    if n["moe"]:
        lm, e, fe, fs = n["moe"], cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        shapes["moe"] = {"router": (lm, d, e), "e_gate": (lm, e, d, fe), "e_up": (lm, e, d, fe),
                         "e_down": (lm, e, fe, d), "s_gate": (lm, d, fs), "s_up": (lm, d, fs),
                         "s_down": (lm, fs, d), "shared_gate": (lm, d, 1)}
    return shapes


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def init_params(cfg: HybridConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random parameters for tests and from-scratch training (transformers' init conventions)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple))
    sizes = [int(np.prod(shape)) for _, shape in flat]
    # One draw for all leaves: a threefry call per leaf makes XLA's compile time grow with the leaf count.
    k_normal, k_uniform = jax.random.split(key)
    normal = jax.random.normal(k_normal, (sum(sizes),))
    uniform = jax.random.uniform(k_uniform, (sum(sizes),), minval=0.01, maxval=16.0)
    out, offset = [], 0
    for (path, shape), size in zip(flat, sizes):
        name = jax.tree_util.keystr(path[-1:]).strip("[]'")
        if name in ("in_norm", "mlp_norm", "final_norm", "q_norm", "k_norm"):
            x = jnp.zeros(shape)  # zero-centred: scale 1 + w
        elif name in ("norm", "dt_bias"):
            x = jnp.ones(shape)
        elif name == "A_log":
            x = jnp.log(uniform[offset : offset + size]).reshape(shape)
        else:
            x = std * normal[offset : offset + size].reshape(shape)
        out.append(x.astype(dtype))
        offset += size
    return jax.tree_util.tree_unflatten(treedef, out)


# --- cache and per-position states --------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HybridCache:
    """Static preallocated target state.

    k, v [La, B, Hkv, S, Dh]: attention K/V; rows < ctx_len are committed, position == row index
    (same semantics as `transformer.KVCache`). conv [Lg, B, K-1, C]: the last K-1 conv inputs of each
    GDN layer, oldest first (cache dtype). ssm [Lg, B, HV, dk, dv]: recurrent state S, float32.
    """

    k: jax.Array
    v: jax.Array
    conv: jax.Array
    ssm: jax.Array

    @property
    def size(self) -> int:
        return self.k.shape[3]

    @classmethod
    def zeros(cls, cfg: HybridConfig, batch: int, size: int, dtype=jnp.float32) -> "HybridCache":
        n = cfg.counts
        kv = (n["attn"], batch, cfg.num_kv_heads, size, cfg.head_dim)
        return cls(
            jnp.zeros(kv, dtype), jnp.zeros(kv, dtype),
            jnp.zeros((n["gdn"], batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype),
            jnp.zeros((n["gdn"], batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                       cfg.linear_value_head_dim), jnp.float32),
        )


class GDNStates(NamedTuple):
    """Recurrent state after each token of a pass (keep_states=True)."""

    conv: jax.Array  # [Lg, B, T, K-1, C]
    ssm: jax.Array  # [Lg, B, T, HV, dk, dv] float32


class HybridForwardOut(NamedTuple):
    hidden: jax.Array  # [B, T, D] final-normed hidden states (feed to `logits`)
    cache: HybridCache
    taps: jax.Array | None  # [n_taps, B, T, D] outputs of the requested layers (HF hidden_states[i+1])
    states: GDNStates | None  # per-position states when keep_states, else None


def commit_states(cache: HybridCache, states: GDNStates, index: jax.Array) -> HybridCache:
    """Make the state after token `index` [B] (0 <= index < T, position within the pass) committed.

    With a chain pass [anchor, d_1..d_g] and n accepted drafts, index = n; for a tree, the node index
    of the last accepted node (0 = the anchor). K/V are untouched (compact them as for dense models).
    """
    def pick(x):
        idx = index.reshape((1, -1, 1) + (1,) * (x.ndim - 3))
        return jnp.take_along_axis(x, idx, axis=2)[:, :, 0]

    return dataclasses.replace(cache, conv=pick(states.conv).astype(cache.conv.dtype), ssm=pick(states.ssm))


def reset_recurrent(cache: HybridCache, rows: jax.Array) -> HybridCache:
    """Zero the conv window and state of rows [B] bool (a recycled batch slot starts from scratch)."""
    conv = jnp.where(rows[None, :, None, None], 0, cache.conv)
    ssm = jnp.where(rows[None, :, None, None, None], 0, cache.ssm)
    return dataclasses.replace(cache, conv=conv, ssm=ssm)


# --- layers -------------------------------------------------------------------------------------


def zc_rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm: normalise in float32, scale by (1 + w), then cast back."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def _partial_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    rd = 2 * inv_freq.shape[0]
    return jnp.concatenate([rope(x[..., :rd], positions, inv_freq), x[..., rd:]], axis=-1)


def _attn_layer(cfg: HybridConfig, lp, x, k_cache, v_cache, positions, cache_rows, ctx_len, tree_mask, inv_freq):
    """Gated full attention. x [B, T, D] (normed); k_cache/v_cache [B, Hkv, S, Dh]."""
    b, t, _ = x.shape
    hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qg = (x @ lp["wq"]).reshape(b, t, hq, 2 * dh)
    q, gate = qg[..., :dh], qg[..., dh:].reshape(b, t, hq * dh)
    k = (x @ lp["wk"]).reshape(b, t, hkv, dh)
    v = (x @ lp["wv"]).reshape(b, t, hkv, dh)
    q = _partial_rope(zc_rms_norm(q, lp["q_norm"], cfg.rms_norm_eps), positions, inv_freq)
    k = _partial_rope(zc_rms_norm(k, lp["k_norm"], cfg.rms_norm_eps), positions, inv_freq)

    k_cache, v_cache = write_rows(k_cache, k, cache_rows), write_rows(v_cache, v, cache_rows)
    attn = attend(q, k_cache, v_cache, positions, cache_rows, ctx_len, tree_mask).reshape(b, t, hq * dh)
    return (attn * jax.nn.sigmoid(gate)) @ lp["wo"], k_cache, v_cache


def _gdn_layer(cfg: HybridConfig, lp, x, window, state, *, parent, lengths, keep_states, impl, chunk_size):
    """Gated DeltaNet. x [B, T, D] (normed); window [B, K-1, C]; state [B, HV, dk, dv] float32.

    Returns (out [B, T, D], window, state, (windows [B, T, K-1, C], states [B, T, HV, dk, dv]) or None).
    """
    b, t, _ = x.shape
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    mixed = x @ lp["w_qkv"]
    z = (x @ lp["w_z"]).reshape(b, t, hv, dv)
    beta = jax.nn.sigmoid(x @ lp["w_b"]).astype(jnp.float32)
    g = -jnp.exp(lp["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        (x @ lp["w_a"]).astype(jnp.float32) + lp["dt_bias"].astype(jnp.float32))
    if lengths is not None:
        # Padding tokens get g = beta = 0: the state passes through them unchanged (see gdn.py).
        live = (jnp.arange(t)[None, :] < lengths[:, None])[..., None]
        g, beta = jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0)
    conv, window, windows = gdn.causal_conv(mixed, window, lp["conv"], parent=parent, lengths=lengths,
                                            keep_windows=keep_states)
    conv = jax.nn.silu(conv).astype(x.dtype)
    q = conv[..., : hk * dk].reshape(b, t, hk, dk).astype(jnp.float32)
    k = conv[..., hk * dk : 2 * hk * dk].reshape(b, t, hk, dk).astype(jnp.float32)
    v = conv[..., 2 * hk * dk :].reshape(b, t, hv, dv)
    # Value head j*r + m reads key head j; normalise before repeating (same result, fewer rows).
    r = hv // hk
    q = jnp.repeat(gdn.l2norm(q) * dk**-0.5, r, axis=2)
    k = jnp.repeat(gdn.l2norm(k), r, axis=2)
    if impl == "chunked":
        o, state = gdn.gdn_chunked(q, k, v, g, beta, state, chunk_size=chunk_size)
        states = None
    else:
        o, state, states = gdn.gdn_recurrent(q, k, v, g, beta, state, parent=parent, keep_states=keep_states)
    o = gdn.gated_rms_norm(o.astype(x.dtype), z, lp["norm"], cfg.rms_norm_eps)
    out = o.reshape(b, t, hv * dv) @ lp["w_out"]
    return out, window, state, ((windows, states) if keep_states else None)


def _swiglu(x, w_gate, w_up, w_down):
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def _moe(cfg: HybridConfig, lp, x):
    """Sparse MoE with a sigmoid-gated shared expert. x [B, T, D].

    Router softmax in float32, top-k, optional renormalisation, then weights in x's dtype. Experts
    run by gathering each token's k expert matrices when that reads fewer weights than running all E
    experts densely (decoding), and densely otherwise (prefill); both are exact.
    """
    b, t, d = x.shape
    e, top = cfg.num_experts, cfg.num_experts_per_tok
    xf = x.reshape(b * t, d)
    logits = xf @ lp["router"]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weight, idx = jax.lax.top_k(probs, top)
    if cfg.norm_topk_prob:
        weight = weight / jnp.sum(weight, axis=-1, keepdims=True)
    weight = weight.astype(logits.dtype)
    if b * t * top < e:
        hidden = jax.nn.silu(jnp.einsum("nd,nkdf->nkf", xf, lp["e_gate"][idx])) * jnp.einsum(
            "nd,nkdf->nkf", xf, lp["e_up"][idx])
        out = jnp.einsum("nkf,nkfd,nk->nd", hidden, lp["e_down"][idx], weight)
    else:
        combine = jnp.zeros((b * t, e), weight.dtype).at[jnp.arange(b * t)[:, None], idx].set(weight)
        hidden = jax.nn.silu(jnp.einsum("nd,edf->nef", xf, lp["e_gate"])) * jnp.einsum("nd,edf->nef", xf, lp["e_up"])
        out = jnp.einsum("nef,efd,ne->nd", hidden, lp["e_down"], combine)
    shared = _swiglu(xf, lp["s_gate"], lp["s_up"], lp["s_down"]) * jax.nn.sigmoid(xf @ lp["shared_gate"])
    return (out + shared).reshape(b, t, d)


# --- forward ------------------------------------------------------------------------------------


def _check_args(cfg, tokens, positions, taps, tree_mask, parent, keep_states, lengths, gdn_impl):
    if tokens.ndim != 2 or positions.shape != tokens.shape:
        raise ValueError(f"tokens and positions must both be [B, T]; got {tokens.shape} and {positions.shape}")
    bad = [i for i in taps if not 0 <= i < cfg.num_layers]
    if bad:
        raise ValueError(f"tap layers {bad} outside [0, {cfg.num_layers})")
    if tree_mask is not None and parent is None:
        raise ValueError("a tree pass (tree_mask) also needs parent [B, T] for the recurrent layers")
    if parent is not None and not keep_states:
        raise ValueError("parent is only meaningful with keep_states=True (a tree has no single final state)")
    if lengths is not None and keep_states:
        raise ValueError("lengths (per-row prefill lengths) cannot be combined with keep_states; commit "
                         "the wanted position with commit_states instead")
    if gdn_impl not in ("auto", "chunked", "recurrent"):
        raise ValueError(f"gdn_impl must be auto, chunked or recurrent, got {gdn_impl!r}")
    if gdn_impl == "chunked" and keep_states:
        raise ValueError("keep_states needs the recurrent GDN form (the chunked form has no per-token states)")


def forward(
    params: dict,
    cfg: HybridConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: HybridCache,
    *,
    ctx_len: jax.Array | None = None,
    cache_rows: jax.Array | None = None,
    tree_mask: jax.Array | None = None,
    taps: tuple[int, ...] = (),
    parent: jax.Array | None = None,
    keep_states: bool = False,
    lengths: jax.Array | None = None,
    gdn_impl: str = "auto",
    chunk_size: int = 64,
) -> HybridForwardOut:
    """Run T new tokens per row against the cache.

    tokens, positions [B, T] int32; ctx_len [B], cache_rows [B, T], tree_mask [B, T, T], taps: as in
    `transformer.forward` (attention layers read committed rows < ctx_len plus the masked new rows).

    Recurrent layers:
    - keep_states=False: the T tokens are a causal chain continuing from the cache's conv window and
      state; the returned cache holds the state after the last token, or after lengths[b] tokens when
      lengths [B] is given (right-padded prefill: tokens at index >= lengths[b] change nothing).
    - keep_states=True (verify passes): `states` holds the state after each token and the returned
      cache keeps the pre-pass recurrent state (K/V are still written at cache_rows); pick one with
      `commit_states`. parent [B, T] (trees; parent[t] < t, -1 = continue from the cache) makes
      token t continue from the state after token parent[t]; None = a chain.
    gdn_impl: "auto" (chunked form for multi-token chains without keep_states, else token by token),
    "chunked" or "recurrent"; chunk_size is the chunked form's block length.
    """
    _check_args(cfg, tokens, positions, taps, tree_mask, parent, keep_states, lengths, gdn_impl)
    b, t = tokens.shape
    if cache_rows is None:
        cache_rows = positions
    if ctx_len is None:
        ctx_len = positions[:, 0]
    impl = gdn_impl
    if impl == "auto":
        impl = "chunked" if (t > 1 and not keep_states and parent is None) else "recurrent"
    inv_freq = jnp.asarray(rope_inv_freq(cfg))

    block = cfg.block
    nb = cfg.num_layers // len(block)
    per_block = collections.Counter(kind for layer in block for kind in layer)

    def split(x, n):  # [L_kind, ...] -> [blocks, n per block, ...]
        return x.reshape((nb, n) + x.shape[1:])

    xs: dict = {"norms": jax.tree_util.tree_map(lambda a: split(a, len(block)), params["norms"])}
    for kind in ("attn", "gdn", "mlp", "moe"):
        if per_block[kind]:
            xs[kind] = jax.tree_util.tree_map(lambda a, n=per_block[kind]: split(a, n), params[kind])
    if per_block["attn"]:
        xs["k"], xs["v"] = split(cache.k, per_block["attn"]), split(cache.v, per_block["attn"])
    if per_block["gdn"]:
        xs["conv"], xs["ssm"] = split(cache.conv, per_block["gdn"]), split(cache.ssm, per_block["gdn"])

    def body(h, x):
        seen = {"attn": 0, "gdn": 0, "mlp": 0, "moe": 0}
        ys: dict = {"k": [], "v": [], "conv": [], "ssm": [], "windows": [], "states": [], "hidden": []}
        for p, (mixer, mlp) in enumerate(block):
            j = seen[mixer]
            seen[mixer] += 1
            lp = jax.tree_util.tree_map(lambda a: a[j], x[mixer])
            xn = zc_rms_norm(h, x["norms"]["in_norm"][p], cfg.rms_norm_eps)
            if mixer == "attn":
                out, k_l, v_l = _attn_layer(cfg, lp, xn, x["k"][j], x["v"][j], positions, cache_rows, ctx_len,
                                            tree_mask, inv_freq)
                ys["k"].append(k_l)
                ys["v"].append(v_l)
            else:
                out, win, s, per_pos = _gdn_layer(cfg, lp, xn, x["conv"][j], x["ssm"][j], parent=parent,
                                                  lengths=lengths, keep_states=keep_states, impl=impl,
                                                  chunk_size=chunk_size)
                if keep_states:  # the cache keeps its pre-pass recurrent state
                    ys["windows"].append(per_pos[0])
                    ys["states"].append(per_pos[1])
                else:
                    ys["conv"].append(win)
                    ys["ssm"].append(s)
            h = h + out
            j = seen[mlp]
            seen[mlp] += 1
            lp = jax.tree_util.tree_map(lambda a: a[j], x[mlp])
            xn = zc_rms_norm(h, x["norms"]["mlp_norm"][p], cfg.rms_norm_eps)
            h = h + (_moe(cfg, lp, xn) if mlp == "moe" else _swiglu(xn, lp["w_gate"], lp["w_up"], lp["w_down"]))
            if taps:
                ys["hidden"].append(h)
        return h, {k: jnp.stack(v) for k, v in ys.items() if v}

    h, ys = jax.lax.scan(body, params["embed"][tokens], xs)

    def merge(y):  # [blocks, per block, ...] -> [L_kind, ...]
        return y.reshape((-1,) + y.shape[2:])

    new_cache = HybridCache(
        merge(ys["k"]) if "k" in ys else cache.k, merge(ys["v"]) if "v" in ys else cache.v,
        merge(ys["conv"]) if "conv" in ys else cache.conv, merge(ys["ssm"]) if "ssm" in ys else cache.ssm,
    )
    states = None
    if keep_states:
        if "windows" in ys:
            states = GDNStates(merge(ys["windows"]), merge(ys["states"]))
        else:  # no GDN layer at all: empty per-position states keep the output structure uniform
            states = GDNStates(cache.conv[:, :, None].repeat(t, 2), cache.ssm[:, :, None].repeat(t, 2))
    tapped = merge(ys["hidden"])[jnp.asarray(taps)] if taps else None
    h = zc_rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    return HybridForwardOut(h, new_cache, tapped, states)


def logits(params: dict, cfg: HybridConfig, hidden: jax.Array) -> jax.Array:
    """LM head: hidden [..., D] -> float32 logits [..., V]."""
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.einsum("...d,dv->...v", hidden, head, preferred_element_type=jnp.float32)
