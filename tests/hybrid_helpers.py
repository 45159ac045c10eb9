"""Tiny random Qwen3-Next / Qwen3.5 checkpoints (written by transformers) and jitted jspec entry points."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax
import jax.numpy as jnp
import numpy as np

from jspec.io.hf_hybrid import load_hybrid_params
from jspec.models import hybrid as H

ATOL = 1e-4
CACHE = 48  # cache rows of every test pass (one shape, fewer compilations)
FAMILIES = ["qwen3_next", "qwen3_5"]

_COMMON = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, initializer_range=0.2, rms_norm_eps=1e-6,
    max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


@contextlib.contextmanager
def torch_eval():
    """no_grad on one intra-op thread: on a shared CPU torch's thread pool makes tiny models ~100x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(threads)


def make_hf_hybrid(family: str, seed: int = 0, **overrides):
    """A tiny random transformers model with a sensitive but well-conditioned init.

    Qwen3-Next: MoE (4 experts, top 2, shared expert), layers [GDN, GDN, GDN, attention], untied head.
    Qwen3.5: dense, layers [GDN, attention] x 2, tied head.
    Zero-centred norms get weights around 0 (scale 1 + w), the gated GDN norm around 1. A_log is drawn
    so that states mix several tokens and conv taps are large: otherwise the GDN output is often far
    below sqrt(eps) and the gated norm amplifies float32 rounding past the parity tolerance (the
    reference's own chunked and step-by-step paths then disagree by ~1e-4).
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    kw = {**_COMMON, **overrides}
    if family == "qwen3_next":
        kw.setdefault("layer_types", ["linear_attention"] * 3 + ["full_attention"])
        cfg = transformers.Qwen3NextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                           shared_expert_intermediate_size=24, **kw)
        model = transformers.Qwen3NextForCausalLM(cfg)
    else:
        kw.setdefault("layer_types", ["linear_attention", "full_attention"] * 2)
        kw.setdefault("tie_word_embeddings", True)
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 0.5).log())
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn_like(p))
    model.eval()
    return model


_TMP = tempfile.mkdtemp(prefix="jspec_hybrid_")
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def checkpoint(family: str) -> tuple[str, object]:
    """(directory written by save_pretrained, the transformers model), built once per process."""
    with torch_eval():
        model = make_hf_hybrid(family)
        path = os.path.join(_TMP, family)
        model.save_pretrained(path)
    return path, model


@functools.lru_cache(maxsize=None)
def loaded(family: str) -> tuple[H.HybridConfig, dict]:
    return load_hybrid_params(checkpoint(family)[0])


forward = jax.jit(H.forward, static_argnums=(1,), static_argnames=("taps", "keep_states", "gdn_impl", "chunk_size"))
logits = jax.jit(H.logits, static_argnums=(1,))


def run(cfg, params, tokens, positions, cache, **kw) -> tuple[np.ndarray, H.HybridForwardOut]:
    """jspec forward + head; returns (float32 logits [B, T, V] as numpy, the forward output)."""
    out = forward(params, cfg, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), cache, **kw)
    return np.asarray(logits(params, cfg, out.hidden)), out


FULL_T = 24  # every "whole sequence" pass is padded to this length, so one compilation serves them all
TAPS = (0, 2)


def full_pass(cfg, params, seqs) -> tuple[np.ndarray, np.ndarray]:
    """One causal pass over each of two sequences (lists of token ids, <= FULL_T long) from empty caches.

    Sequences are right-padded with filler tokens: a causal model's logits at position t do not depend
    on later tokens. Returns (logits [2, FULL_T, V], taps [len(TAPS), 2, FULL_T, D]).
    """
    x = np.full((2, FULL_T), 3, np.int64)
    for r, s in enumerate(seqs):
        x[r, : len(s)] = s
    pos = np.broadcast_to(np.arange(FULL_T), (2, FULL_T))
    lg, out = run(cfg, params, x, pos, H.HybridCache.zeros(cfg, 2, CACHE), taps=TAPS)
    return lg, np.asarray(out.taps)


PREFILL_T = 12


def prefill(cfg, params, x, lengths) -> tuple[np.ndarray, H.HybridCache]:
    """Right-padded prefill of x [2, >= lengths] (first PREFILL_T columns); row r keeps lengths[r] tokens."""
    lengths = np.asarray(lengths)
    pre = np.where(np.arange(PREFILL_T)[None] < lengths[:, None], np.asarray(x)[:, :PREFILL_T], 0)
    lg, out = run(cfg, params, pre, np.broadcast_to(np.arange(PREFILL_T), (2, PREFILL_T)),
                  H.HybridCache.zeros(cfg, 2, CACHE), lengths=lengths.astype(np.int32))
    return lg, out.cache


def hf_logits(model, ids, **kw) -> np.ndarray:
    import torch

    with torch_eval():
        return model(torch.tensor(np.asarray(ids)), **kw).logits.numpy()


def ids(b: int, t: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(3, 128, (b, t))
