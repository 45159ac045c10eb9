"""Target pretraining from scratch: a BPE tokenizer and a Llama/Qwen3 LM trained on a local corpus.

    jspec train target --config configs/code-target.json --out runs/code-target

Writes the run (checkpoints, metrics.jsonl) under --out and the trained model in Hugging Face format
(config.json, model.safetensors, tokenizer.json) under --out/model.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jspec.io.hf import save_params
from jspec.models import transformer
from jspec.models.config import ModelConfig
from jspec.train import data
from jspec.train.trainer import TrainConfig, Trainer

EOT = "<|endoftext|>"


def train_tokenizer(vocab_size: int, files: list[str]):
    """Byte-level BPE with one special token (<|endoftext|> = id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    return tok


def lm_loss(params, cfg: ModelConfig, batch: jax.Array):
    """Next-token cross-entropy over windows [B, T + 1]; returns (loss, {'acc'})."""
    inputs, labels = batch[:, :-1], batch[:, 1:]
    b, t = inputs.shape
    out = transformer.forward(params, cfg, inputs, jnp.broadcast_to(jnp.arange(t), (b, t)),
                              transformer.KVCache.zeros(cfg, b, t, params["embed"].dtype), kv_chunk=None)
    logits = transformer.logits(params, cfg, out.hidden)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    acc = jnp.mean(jnp.argmax(logits, -1) == labels)
    return jnp.mean(nll), {"acc": acc}


def load_run_config(path: str) -> dict:
    if not os.path.exists(path):
        raise FileNotFoundError(f"no training config at {path!r}: see configs/ for examples")
    with open(path) as f:
        return json.load(f)


def corpus_root(spec: str) -> str:
    return data.stdlib_dir() if spec == "stdlib" else spec


def prepare_text(cfg: dict, work_dir: str) -> tuple[str, list[str]]:
    """Build the TFDS corpus; returns (dataset dir, training file paths for the tokenizer)."""
    root = corpus_root(cfg["data"]["corpus"])
    files = data.split_files(root, data.corpus_files(root, cfg["data"].get("pattern", "**/*.py")))
    ds_dir = data.build_corpus(root, os.path.join(work_dir, "tfds"), cfg["data"].get("pattern", "**/*.py"))
    return ds_dir, files["train"]


def tokenized_windows(tok, ds_dir: str, split: str, seq_len: int) -> np.ndarray:
    docs = [tok.encode(ex["text"]).ids for ex in data.read_split(ds_dir, split)]
    return data.pack_tokens(docs, seq_len, tok.token_to_id(EOT))


def pretrain_target(config_path: str, out_dir: str, steps: int | None = None, progress: bool = True) -> str:
    cfg = load_run_config(config_path)
    os.makedirs(out_dir, exist_ok=True)
    ds_dir, train_files = prepare_text(cfg, out_dir)
    tok_path = os.path.join(out_dir, "tokenizer.json")
    if os.path.exists(tok_path):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tok_path)
    else:
        tok = train_tokenizer(cfg["model"]["vocab_size"], train_files)
        tok.save(tok_path)
    mcfg = ModelConfig(**{**cfg["model"], "eos_token_ids": (tok.token_to_id(EOT),)})
    seq_len, batch = cfg["data"]["seq_len"], cfg["data"]["batch_size"]
    windows = tokenized_windows(tok, ds_dir, "train", seq_len)
    tc = TrainConfig(**cfg["train"])
    params = transformer.init_params(mcfg, jax.random.key(tc.seed), std=cfg.get("init_std", 0.02))
    trainer = Trainer(lambda p, b: lm_loss(p, mcfg, b), params, tc, out_dir,
                      fingerprint={"kind": "target", "config": cfg})
    start = trainer.restore_latest()
    if progress:
        print(f"target {mcfg.num_params / 1e6:.2f}M parameters, {len(windows)} training windows of {seq_len}; "
              f"resuming at step {start}" if start else f"target {mcfg.num_params / 1e6:.2f}M parameters, "
              f"{len(windows)} training windows of {seq_len}")
    state = trainer.run(data.batches(windows, batch, tc.seed), steps=steps, progress=progress)
    model_dir = os.path.join(out_dir, "model")
    save_params(model_dir, mcfg, state.params)
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    return model_dir
