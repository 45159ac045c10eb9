"""A small model that jspec makes itself: a BPE tokenizer trained on local Python source and a random
Qwen3-shaped target, saved in Hugging Face format. `jspec demo` uses it to show the checkpoint round trip
(write, strict reload, generate), and the benchmarks and tests take its shape for random-weight models.
Its weights are random, so its text is not meaningful; the trained built-in models are `builtin:NAME`."""

from __future__ import annotations

import glob
import os
import sysconfig

import jax

from jspec.io.hf import save_params
from jspec.models.config import ModelConfig
from jspec.models.transformer import init_params

DEMO_CONFIG = ModelConfig(
    family="qwen3", vocab_size=512, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=64, qk_norm=True, tie_word_embeddings=True, eos_token_ids=(0,), bos_token_id=None,
    max_position_embeddings=2048,
)


def stdlib_files(limit: int | None = None) -> list[str]:
    """Python source files of this interpreter's standard library (a real local code corpus)."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if not files:
        raise FileNotFoundError("no Python standard-library sources found: cannot train the demo tokenizer")
    return files[:limit] if limit else files


def train_tokenizer(vocab_size: int, files: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(files, trainer)
    return tok


def create_demo_model(out_dir: str, seed: int = 0, cfg: ModelConfig = DEMO_CONFIG) -> str:
    """Write config.json, model.safetensors (random weights) and tokenizer.json into out_dir."""
    tok = train_tokenizer(cfg.vocab_size, stdlib_files(limit=40))
    if tok.get_vocab_size() != cfg.vocab_size:
        raise RuntimeError(f"tokenizer trained to {tok.get_vocab_size()} tokens, expected {cfg.vocab_size}")
    params = init_params(cfg, jax.random.key(seed), std=0.05)
    save_params(out_dir, cfg, params)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    return out_dir
