"""Hybrid recurrent targets (Qwen3-Next, Qwen3.5 text): Gated DeltaNet layers mixed with gated attention.

A `flax.linen` module applied to a plain parameter pytree, like `transformer.py`: every parameter is
declared once in the modules below (`jspec.models.declare`: shape, dtype, initializer, logical axes,
HF name), and `init_params`, `param_shapes`, the HF loader (`jspec.io.hf_hybrid`) and the shardings
(`jspec.parallel.target_axes`) all read those declarations.

Parameters (a plain nested dict; `layers` is a list with one dict per layer, which holds that layer's
mixer and MLP leaves; matrices stored [out, in] as HF stores them, applied by `layers.linear`):

    embed [V, D]; final_norm [D]; lm_head [V, D] (absent when embeddings are tied)
    layers[i]: in_norm, mlp_norm [D]                               zero-centred: x_hat * (1 + w)
      full attention: wq [Hq*2*Dh, D] (per head [query Dh | gate Dh]), wk/wv [Hkv*Dh, D],
                      wo [D, Hq*Dh], q_norm/k_norm [Dh] (zero-centred)
      Gated DeltaNet: w_qkv [C, D] with C = 2*HK*dk + HV*dv, the conv channels [q | k | v];
                      w_z [HV*dv, D]; w_b/w_a [HV, D]; conv [K, C] (taps first, as `gdn.causal_conv`
                      reads them: HF's Conv1d weight [C, 1, K] transposed); dt_bias/A_log [HV];
                      norm [dv] (gated RMSNorm, ones-centred); w_out [D, HV*dv]
                      (one flat layout for both families: the loader converts Qwen3-Next's grouped
                      in_proj_qkvz / in_proj_ba)
      dense MLP:      w_gate/w_up [F, D], w_down [D, F]
      MoE:            router [E, D]; e_gate/e_up [E, Fe, D], e_down [E, D, Fe] (each expert [out, in]);
                      s_gate/s_up [Fs, D], s_down [D, Fs] (shared expert); shared_gate [1, D]

The layers run as an unrolled Python loop over these per-layer weights. Stacking the layers by kind
and scanning over repeats of the periodic block of kinds would trace a smaller program, but on XLA:GPU
and XLA:CPU a weight sliced out of a stack inside the scan body is copied whole before its matmul,
every pass, and stacked caches that are scan inputs and outputs are copied in and out of the loop:
a verify pass would move several times the bytes it must read.

Cache (`HybridCache`): per attention layer a K and a V buffer [B, Hkv, S, Dh] with
`transformer.KVCache` row semantics (each layer writes its rows in place, `attention.write_rows`, and
reads the valid ones, `attention.attend`); per GDN layer the conv window (last K-1 conv inputs) and the
recurrent state S (float32).

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

import dataclasses
import functools
import os
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jspec.models import gdn, quant
from jspec.models.attention import attend, write_rows
from jspec.models.config import REQUIRED_FIELDS, config_from_file, require_fields
from jspec.models.declare import abstract_tree, declare, init_tree, shapes, unbox
from jspec.models.layers import linear, lm_logits, rope, swiglu, zc_rms_norm
from jspec.models.transformer import from_linen, to_linen

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
    def slots(self) -> tuple[int, ...]:
        """Per layer, its index among the layers of its mixer kind: into `HybridCache.k` / `v`
        (attention layers) or `conv` / `ssm` (GDN layers)."""
        return tuple(self.layer_types[:i].count(kind) for i, kind in enumerate(self.layer_types))

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
        require_fields(hf, REQUIRED_FIELDS)
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
        """The config of a config.json; CheckpointError naming the file when it is damaged or unusable."""
        return config_from_file(cls, path)

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


# --- parameter declarations ---------------------------------------------------------------------
# Logical axes that `jspec.parallel.ShardingRules` does not name stay replicated: the GDN layers'
# channels and heads (gdn_channels, gdn_heads) and the MoE experts (experts, expert_mlp).


def _attention_params(decl, cfg: HybridConfig, pre: str) -> dict:
    d, dh = cfg.hidden_size, cfg.head_dim
    q, kv, sa = cfg.num_heads * dh, cfg.num_kv_heads * dh, pre + "self_attn."
    return {
        "wq": decl("wq", (2 * q, d), ("heads", "embed"), "normal", sa + "q_proj.weight"),
        "wk": decl("wk", (kv, d), ("kv_heads", "embed"), "normal", sa + "k_proj.weight"),
        "wv": decl("wv", (kv, d), ("kv_heads", "embed"), "normal", sa + "v_proj.weight"),
        "wo": decl("wo", (d, q), ("embed", "heads"), "normal", sa + "o_proj.weight"),
        "q_norm": decl("q_norm", (dh,), ("head_dim",), "zeros", sa + "q_norm.weight"),
        "k_norm": decl("k_norm", (dh,), ("head_dim",), "zeros", sa + "k_norm.weight"),
    }


def _gdn_params(decl, cfg: HybridConfig, pre: str) -> dict:
    d, c = cfg.hidden_size, cfg.conv_dim
    hv, dv, la = cfg.linear_num_value_heads, cfg.linear_value_head_dim, pre + "linear_attn."
    if cfg.family == "qwen3_next":  # two checkpoint tensors grouped per key head; the loader regroups
        hf = {"qkv": la + "in_proj_qkvz.weight", "z": la + "in_proj_qkvz.weight",
              "b": la + "in_proj_ba.weight", "a": la + "in_proj_ba.weight"}
    else:
        hf = {n: f"{la}in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")}
    proj = lambda n, width, axis: decl(f"w_{n}", (width, d), (axis, "embed"), "normal", hf[n])
    return {
        "w_qkv": proj("qkv", c, "gdn_channels"),
        "w_z": proj("z", hv * dv, "gdn_heads"),
        "w_b": proj("b", hv, "gdn_heads"),
        "w_a": proj("a", hv, "gdn_heads"),
        # The checkpoint's Conv1d weight is [C, 1, K]: transposed to [K, C], the layout `gdn.causal_conv`
        # reads as stored (each tap one contiguous row over the channels), the unit axis dropped.
        "conv": decl("conv", (cfg.linear_conv_kernel_dim, c), (None, "gdn_channels"), "normal",
                     la + "conv1d.weight", transpose=True),
        "dt_bias": decl("dt_bias", (hv,), ("gdn_heads",), "ones", la + "dt_bias"),
        "A_log": decl("A_log", (hv,), ("gdn_heads",), "log_uniform", la + "A_log"),
        "norm": decl("norm", (dv,), ("head_dim",), "ones", la + "norm.weight"),
        "w_out": decl("w_out", (d, hv * dv), ("embed", "gdn_heads"), "normal", la + "out_proj.weight"),
    }


def _mlp_params(decl, cfg: HybridConfig, pre: str) -> dict:
    d, f, m = cfg.hidden_size, cfg.intermediate_size, pre + "mlp."
    return {
        "w_gate": decl("w_gate", (f, d), ("mlp", "embed"), "normal", m + "gate_proj.weight"),
        "w_up": decl("w_up", (f, d), ("mlp", "embed"), "normal", m + "up_proj.weight"),
        "w_down": decl("w_down", (d, f), ("embed", "mlp"), "normal", m + "down_proj.weight"),
    }


def _moe_params(decl, cfg: HybridConfig, pre: str) -> dict:
    d, e, m = cfg.hidden_size, cfg.num_experts, pre + "mlp."
    fe, fs = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    # One checkpoint tensor per expert ("{e}"), each [out, in]; jspec stacks them on a leading axis.
    expert = lambda n, shape, axes: decl(f"e_{n}", shape, axes, "normal", m + "experts.{e}." + n + "_proj.weight")
    shared = lambda n, shape, axes: decl(f"s_{n}", shape, axes, "normal", f"{m}shared_expert.{n}_proj.weight")
    return {
        "router": decl("router", (e, d), ("experts", "embed"), "normal", m + "gate.weight"),
        "e_gate": expert("gate", (e, fe, d), ("experts", "expert_mlp", "embed")),
        "e_up": expert("up", (e, fe, d), ("experts", "expert_mlp", "embed")),
        "e_down": expert("down", (e, d, fe), ("experts", "embed", "expert_mlp")),
        "s_gate": shared("gate", (fs, d), ("expert_mlp", "embed")),
        "s_up": shared("up", (fs, d), ("expert_mlp", "embed")),
        "s_down": shared("down", (d, fs), ("embed", "expert_mlp")),
        "shared_gate": decl("shared_gate", (1, d), (None, "embed"), "normal", m + "shared_expert_gate.weight"),
    }


# --- cache and per-position states --------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HybridCache:
    """Static preallocated target state, one buffer per layer (`cfg.slots` maps a layer to its index).

    k[j], v[j] [B, Hkv, S, Dh]: K/V of the j-th attention layer; rows < ctx_len are committed,
    position == row index (same semantics as `transformer.KVCache`). conv[j] [B, K-1, C]: the last
    K-1 conv inputs of the j-th GDN layer, oldest first (cache dtype). ssm[j] [B, HV, dk, dv]: its
    recurrent state S, float32.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    conv: tuple[jax.Array, ...]
    ssm: tuple[jax.Array, ...]

    @property
    def size(self) -> int:
        return self.k[0].shape[2]

    @classmethod
    def zeros(cls, cfg: HybridConfig, batch: int, size: int, dtype=jnp.float32) -> "HybridCache":
        n = cfg.counts
        kv = (batch, cfg.num_kv_heads, size, cfg.head_dim)
        conv = (batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)
        ssm = (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        return cls(tuple(jnp.zeros(kv, dtype) for _ in range(n["attn"])),
                   tuple(jnp.zeros(kv, dtype) for _ in range(n["attn"])),
                   tuple(jnp.zeros(conv, dtype) for _ in range(n["gdn"])),
                   tuple(jnp.zeros(ssm, jnp.float32) for _ in range(n["gdn"])))


class GDNStates(NamedTuple):
    """Recurrent state after each token of a pass (keep_states=True), one entry per GDN layer."""

    conv: tuple[jax.Array, ...]  # [B, T, K-1, C]
    ssm: tuple[jax.Array, ...]  # [B, T, HV, dk, dv] float32


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
    def pick(x):  # [B, T, ...] -> [B, ...]
        return jnp.take_along_axis(x, index.reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0]

    conv = tuple(pick(w).astype(c.dtype) for w, c in zip(states.conv, cache.conv, strict=True))
    return dataclasses.replace(cache, conv=conv, ssm=tuple(map(pick, states.ssm)))


def reset_recurrent(cache: HybridCache, rows: jax.Array) -> HybridCache:
    """Zero the conv window and state of rows [B] bool (a recycled batch slot starts from scratch)."""
    zero = lambda x: jnp.where(rows.reshape((-1,) + (1,) * (x.ndim - 1)), 0, x)
    return dataclasses.replace(cache, conv=tuple(map(zero, cache.conv)), ssm=tuple(map(zero, cache.ssm)))


# --- layers -------------------------------------------------------------------------------------


def _attn_layer(cfg: HybridConfig, lp, x, k_cache, v_cache, positions, cache_rows, ctx_len, tree_mask, inv_freq):
    """Gated full attention. x [B, T, D] (normed); k_cache/v_cache [B, Hkv, S, Dh]."""
    b, t, _ = x.shape
    hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qg = linear(x, lp["wq"]).reshape(b, t, hq, 2 * dh)
    q, gate = qg[..., :dh], qg[..., dh:].reshape(b, t, hq * dh)
    k = linear(x, lp["wk"]).reshape(b, t, hkv, dh)
    v = linear(x, lp["wv"]).reshape(b, t, hkv, dh)
    q = rope(zc_rms_norm(q, lp["q_norm"], cfg.rms_norm_eps), positions, inv_freq)  # the first rotary_dim dims
    k = rope(zc_rms_norm(k, lp["k_norm"], cfg.rms_norm_eps), positions, inv_freq)

    k_cache, v_cache = write_rows(k_cache, k, cache_rows), write_rows(v_cache, v, cache_rows)
    attn = attend(q, k_cache, v_cache, positions, cache_rows, ctx_len, tree_mask).reshape(b, t, hq * dh)
    return linear(attn * jax.nn.sigmoid(gate), lp["wo"]), k_cache, v_cache


def _gdn_layer(cfg: HybridConfig, lp, x, window, state, *, parent, lengths, keep_states, impl, chunk_size):
    """Gated DeltaNet. x [B, T, D] (normed); window [B, K-1, C]; state [B, HV, dk, dv] float32.

    Returns (out [B, T, D], window, state, (windows [B, T, K-1, C], states [B, T, HV, dk, dv]) or None).
    """
    b, t, _ = x.shape
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    mixed = linear(x, lp["w_qkv"])
    z = linear(x, lp["w_z"]).reshape(b, t, hv, dv)
    beta = jax.nn.sigmoid(linear(x, lp["w_b"])).astype(jnp.float32)
    g = -jnp.exp(lp["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        linear(x, lp["w_a"]).astype(jnp.float32) + lp["dt_bias"].astype(jnp.float32))
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
    out = linear(o.reshape(b, t, hv * dv), lp["w_out"])
    return out, window, state, ((windows, states) if keep_states else None)


def _moe(cfg: HybridConfig, lp, x):
    """Sparse MoE with a sigmoid-gated shared expert. x [B, T, D].

    Router softmax in float32, top-k, optional renormalisation, then weights in x's dtype. Experts
    run by gathering each token's k expert matrices when that reads fewer weights than running all E
    experts densely (decoding), and densely otherwise (prefill); both are exact.
    """
    b, t, d = x.shape
    e, top = cfg.num_experts, cfg.num_experts_per_tok
    dense = quant.dense  # quantized expert stacks: the selected (or all) experts dequantized
    xf = x.reshape(b * t, d)
    logits = linear(xf, lp["router"])
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weight, idx = jax.lax.top_k(probs, top)
    if cfg.norm_topk_prob:
        weight = weight / jnp.sum(weight, axis=-1, keepdims=True)
    weight = weight.astype(logits.dtype)
    if b * t * top < e:
        hidden = jax.nn.silu(jnp.einsum("nd,nkfd->nkf", xf, dense(lp["e_gate"][idx]))) * jnp.einsum(
            "nd,nkfd->nkf", xf, dense(lp["e_up"][idx]))
        out = jnp.einsum("nkf,nkdf,nk->nd", hidden, dense(lp["e_down"][idx]), weight)
    else:
        # Batched over the experts, so that each expert's matrices are read as stored: with E a free
        # dimension of the gate / up products, or [E, D, Fe] contracted over E and Fe together (the
        # routing weights applied first), XLA:CPU can transpose whole stacks first.
        combine = jnp.zeros((b * t, e), weight.dtype).at[jnp.arange(b * t)[:, None], idx].set(weight)
        xe = jnp.broadcast_to(xf, (e,) + xf.shape)
        hidden = jax.nn.silu(jnp.einsum("end,efd->enf", xe, dense(lp["e_gate"]))) * jnp.einsum("end,efd->enf", xe,
                                                                                         dense(lp["e_up"]))
        out = jnp.einsum("end,ne->nd", jnp.einsum("enf,edf->end", hidden, dense(lp["e_down"])), combine)
    # The shared expert's gate is one output row: a product and a sum (as a matmul XLA:CPU copies it).
    gate = jax.nn.sigmoid(jnp.sum(xf * dense(lp["shared_gate"])[0], axis=-1, keepdims=True))
    shared = swiglu(xf, lp["s_gate"], lp["s_up"], lp["s_down"]) * gate
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


class PassInputs(NamedTuple):
    """What every layer of one pass reads besides its own weights and state (see `forward`)."""

    positions: jax.Array
    cache_rows: jax.Array
    ctx_len: jax.Array
    tree_mask: jax.Array | None
    parent: jax.Array | None
    lengths: jax.Array | None
    inv_freq: jax.Array
    keep_states: bool
    gdn_impl: str  # "chunked" | "recurrent"
    chunk_size: int


def _layer(cfg: HybridConfig, i: int, lp: dict, h, state: tuple, ps: PassInputs):
    """Layer i. h [B, T, D]; state: (k_cache, v_cache) of an attention layer, (conv window, S) of a GDN
    layer. Returns (h, the new state, (windows, states) after each token of a GDN layer when
    ps.keep_states, else None)."""
    x = zc_rms_norm(h, lp["in_norm"], cfg.rms_norm_eps)
    per_position = None
    if cfg.layer_types[i] == FULL:
        out, *state = _attn_layer(cfg, lp, x, *state, ps.positions, ps.cache_rows, ps.ctx_len, ps.tree_mask,
                                  ps.inv_freq)
    else:
        out, *state, per_position = _gdn_layer(cfg, lp, x, *state, parent=ps.parent, lengths=ps.lengths,
                                               keep_states=ps.keep_states, impl=ps.gdn_impl,
                                               chunk_size=ps.chunk_size)
    h = h + out
    x = zc_rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
    h = h + (_moe(cfg, lp, x) if cfg.mlp_types[i] == "moe" else swiglu(x, lp["w_gate"], lp["w_up"], lp["w_down"]))
    return h, tuple(state), per_position


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

    The layers run unrolled over per-layer weights and caches (module docstring): every attention
    layer writes its K/V rows into its own buffer in place.
    """
    _check_args(cfg, tokens, positions, taps, tree_mask, parent, keep_states, lengths, gdn_impl)
    if cache_rows is None:
        if tree_mask is not None:
            raise ValueError("a tree pass needs cache_rows: its nodes' positions repeat across branches, and "
                             "the cache takes consecutive rows per pass (e.g. ctx_len[:, None] + arange(T))")
        cache_rows = positions
    if ctx_len is None:
        ctx_len = positions[:, 0]
    impl = gdn_impl
    if impl == "auto":
        impl = "chunked" if (tokens.shape[1] > 1 and not keep_states and parent is None) else "recurrent"
    ps = PassInputs(positions, cache_rows, ctx_len, tree_mask, parent, lengths, jnp.asarray(rope_inv_freq(cfg)),
                    keep_states, impl, chunk_size)
    return HybridModel(cfg).apply({"params": to_linen(params)}, tokens, cache, ps, tuple(taps))


def logits(params: dict, cfg: HybridConfig, hidden: jax.Array) -> jax.Array:
    """LM head: final-normed hidden [..., D] -> float32 logits [..., V]."""
    return lm_logits(hidden, params["embed"] if cfg.tie_word_embeddings else params["lm_head"])


# --- modules ------------------------------------------------------------------------------------


class HybridLayer(nn.Module):
    """Layer `index`: its two norms, its mixer (full attention or Gated DeltaNet) and its MLP (dense or
    MoE), the kinds read from the config; parameters declared once (`jspec.models.declare`)."""

    cfg: HybridConfig
    index: int
    init_std: float = 0.02
    param_dtype: Any = jnp.float32

    def setup(self):
        c, i = self.cfg, self.index
        pre, d = f"model.layers.{i}.", c.hidden_size
        decl = functools.partial(declare, self, std=self.init_std, dtype=self.param_dtype)
        p = {"in_norm": decl("in_norm", (d,), ("embed",), "zeros", pre + "input_layernorm.weight"),
             "mlp_norm": decl("mlp_norm", (d,), ("embed",), "zeros", pre + "post_attention_layernorm.weight")}
        p.update((_attention_params if c.layer_types[i] == FULL else _gdn_params)(decl, c, pre))
        p.update((_moe_params if c.mlp_types[i] == "moe" else _mlp_params)(decl, c, pre))
        self.p = p

    def declare(self):
        return self.p

    def __call__(self, h, state: tuple, ps: PassInputs):
        return _layer(self.cfg, self.index, self.p, h, state, ps)


class HybridLayers(nn.Module):
    """Layers "0" .. "L-1" under one name (HF: `model.layers.{i}.`)."""

    cfg: HybridConfig
    init_std: float = 0.02
    param_dtype: Any = jnp.float32

    def setup(self):
        self.layers = [HybridLayer(self.cfg, i, self.init_std, self.param_dtype, name=str(i))
                       for i in range(self.cfg.num_layers)]

    def declare(self):
        return [layer.declare() for layer in self.layers]


class HybridModel(nn.Module):
    """The hybrid decoder: embedding, layers, final norm, LM head (absent when tied)."""

    cfg: HybridConfig
    init_std: float = 0.02
    param_dtype: Any = jnp.float32

    def setup(self):
        c = self.cfg
        d, v = c.hidden_size, c.vocab_size
        decl = functools.partial(declare, self, std=self.init_std, dtype=self.param_dtype)
        self.embed = decl("embed", (v, d), ("vocab", "embed"), "normal", "model.embed_tokens.weight")
        self.final_norm = decl("final_norm", (d,), ("embed",), "zeros", "model.norm.weight")
        if not c.tie_word_embeddings:
            self.lm_head = decl("lm_head", (v, d), ("vocab", "embed"), "normal", "lm_head.weight")
        self.layers = HybridLayers(c, self.init_std, self.param_dtype, name="layers")

    def declare(self):
        return self.embed, self.final_norm, self.layers.declare()

    def __call__(self, tokens, cache: HybridCache, ps: PassInputs, taps: tuple[int, ...]) -> HybridForwardOut:
        cfg = self.cfg
        h = quant.embed_rows(self.embed, tokens)
        k, v, conv, ssm = (list(x) for x in (cache.k, cache.v, cache.conv, cache.ssm))
        windows, states, outputs = [], [], []
        for i, (layer, j) in enumerate(zip(self.layers.layers, cfg.slots, strict=True)):
            if cfg.layer_types[i] == FULL:
                h, (k[j], v[j]), _ = layer(h, (k[j], v[j]), ps)
            else:
                h, (window, state), per_position = layer(h, (conv[j], ssm[j]), ps)
                if ps.keep_states:  # the cache keeps its pre-pass recurrent state (commit_states picks one)
                    windows.append(per_position[0])
                    states.append(per_position[1])
                else:
                    conv[j], ssm[j] = window, state
            outputs.append(h)
        tapped = jnp.stack([outputs[i] for i in taps]) if taps else None
        h = zc_rms_norm(h, self.final_norm, cfg.rms_norm_eps)
        new_cache = HybridCache(tuple(k), tuple(v), tuple(conv), tuple(ssm))
        return HybridForwardOut(h, new_cache, tapped, GDNStates(tuple(windows), tuple(states)) if ps.keep_states
                                else None)


@functools.lru_cache(maxsize=64)  # tracing the declarations is cheap but not free
def declarations(cfg: HybridConfig, dtype=jnp.float32) -> dict:
    """Every parameter's declaration (boxes of ShapeDtypeStructs), in jspec's layout."""
    return from_linen(abstract_tree(HybridModel(cfg, param_dtype=dtype), HybridModel.declare)["params"])


def param_shapes(cfg: HybridConfig) -> dict:
    """Shape of every parameter, in the pytree layout of the module docstring."""
    return shapes(declarations(cfg))


def init_params(cfg: HybridConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random parameters for tests and from-scratch training (transformers' init conventions: normal(std)
    matrices, zero-centred norms at 0, the gated norm and dt_bias at 1, A_log = log(uniform(0.01, 16)))."""
    tree = init_tree(HybridModel(cfg, init_std=std, param_dtype=dtype), HybridModel.declare, key)
    return from_linen(unbox(tree)["params"])
