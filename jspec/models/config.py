"""Static model configuration for the Llama / Qwen3 target families, read from HF `config.json`."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from jspec.errors import CheckpointError
from jspec.io.files import read_json_object

SUPPORTED_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
}


LAYER_LOOPS = ("unroll", "scan")  # ModelConfig.layer_loop

# Fields a config.json must give (every other one has a default).
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def require_fields(hf: dict, names) -> None:
    """CheckpointError naming every required field that is absent, null, or not a positive integer."""
    missing = [n for n in names if hf.get(n) is None]
    if missing:
        many = len(missing) > 1
        raise CheckpointError(f"missing required field{'s' * many} {', '.join(repr(n) for n in missing)} (the "
                              f"Hugging Face config.json of a model gives {'them' if many else 'it'})")
    bad = [f"{n}={hf[n]!r}" for n in names if isinstance(hf[n], bool) or not isinstance(hf[n], int) or hf[n] < 1]
    if bad:
        raise CheckpointError(f"{', '.join(bad)}: {'each ' * (len(bad) > 1)}must be a positive integer")


def config_from_file(cls, path: str):
    """`cls.from_hf_dict` of the JSON object in `path`; its errors name the file."""
    hf = read_json_object(path)
    try:
        return cls.from_hf_dict(hf)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from err


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hashable description of a decoder-only transformer; used as a static jit argument."""

    family: str  # "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before RoPE
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" | "sliding_attention"; () = all full
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    max_position_embeddings: int = 4096
    # How `transformer.forward` runs the decoder layers (not part of the checkpoint; `with_layer_loop`):
    # "unroll": per-layer weight and cache arrays and a Python loop over them, the layout of CPU and GPU,
    # where a lax.scan copies every sliced weight matrix before its matmul; "scan": stacked [L, ...]
    # weights and caches and one lax.scan over the layers, for TPU, which slices inside its matmul
    # fusions and would otherwise keep per-operation temp slots for every unrolled layer
    # (`python -m jspec.benchmarks.layer_loop_temp`).
    layer_loop: str = "unroll"

    def __post_init__(self):
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop must be one of {', '.join(LAYER_LOOPS)}, got {self.layer_loop!r}")
        if self.family not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model family {self.family!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )
        if all(t == "full_attention" for t in self.layer_types):
            object.__setattr__(self, "layer_types", ())  # canonical form: () = every layer full attention
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_layers}"
            )
        bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ValueError(f"unsupported layer types {bad}; expected full_attention or sliding_attention")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("config has sliding_attention layers but no sliding_window size")

    @property
    def windows(self) -> tuple[int, ...]:
        """Attention window per layer; 0 means full attention."""
        return tuple(self.sliding_window if t == "sliding_attention" else 0 for t in self.all_layer_types)

    @property
    def all_layer_types(self) -> tuple[str, ...]:
        return self.layer_types or ("full_attention",) * self.num_layers

    @property
    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
        per_layer += 2 * self.head_dim if self.qk_norm else 0
        head = 0 if self.tie_word_embeddings else d * v
        return v * d + self.num_layers * per_layer + d + head

    # --- HF conversion -------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        family = hf.get("model_type")
        archs = tuple(hf.get("architectures") or ())
        if family not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture: model_type={family!r} architectures={list(archs)}; "
                f"jspec loads model_type in {sorted(SUPPORTED_ARCHITECTURES)} "
                f"({', '.join(a for v in SUPPORTED_ARCHITECTURES.values() for a in v)})"
            )
        unsupported = [a for a in archs if a not in SUPPORTED_ARCHITECTURES[family]]
        if unsupported:
            raise ValueError(
                f"unsupported architecture {unsupported} for model_type {family!r}; "
                f"expected {list(SUPPORTED_ARCHITECTURES[family])}"
            )
        require_fields(hf, REQUIRED_FIELDS)
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}: jspec implements SwiGLU (silu) MLPs")
        # Newer files nest RoPE settings in `rope_parameters`, older ones use `rope_theta`/`rope_scaling`.
        rope = dict(hf.get("rope_scaling") or {})
        rope.update(hf.get("rope_parameters") or {})
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
        n_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden // n_heads)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        num_layers = int(hf["num_hidden_layers"])
        layer_types = tuple(hf.get("layer_types") or ())
        window = hf.get("sliding_window")
        if family == "qwen3" and not hf.get("use_sliding_window", False):
            # Qwen3 keeps a window size in the file but only uses it with use_sliding_window.
            layer_types = ("full_attention",) * num_layers
            window = None
        if family == "llama":
            layer_types, window = (), None
        return cls(
            family=family,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=n_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=family == "qwen3",
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=int(window) if window else None,
            layer_types=layer_types,
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        )

    @classmethod
    def from_file(cls, path: str) -> "ModelConfig":
        """The config of a config.json; CheckpointError naming the file when it is damaged or unusable."""
        return config_from_file(cls, path)

    def to_hf_dict(self) -> dict[str, Any]:
        arch = SUPPORTED_ARCHITECTURES[self.family][0]
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(rope_type="llama3", **dataclasses.asdict(self.rope_scaling))
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.family == "llama":
            out["mlp_bias"] = self.mlp_bias
        else:
            sliding = "sliding_attention" in self.layer_types
            out.update(use_sliding_window=sliding, sliding_window=self.sliding_window,
                       layer_types=list(self.all_layer_types), max_window_layers=self.num_layers)
        return out


def default_rope_inv_freq(cfg: ModelConfig):
    """Inverse RoPE frequencies [head_dim // 2] (numpy float64 math, like HF's float32 result)."""
    import numpy as np

    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    s = cfg.rope_scaling
    if s is not None:
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def load_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json in {model_dir!r}: pass a Hugging Face model directory")
    return ModelConfig.from_file(path)
