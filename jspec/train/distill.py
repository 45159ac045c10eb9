"""Self-distillation and drafter training runs.

    jspec train dflash --config configs/code-dflash.json --target runs/code-target/model --out runs/code-dflash

Drafters learn what the target actually says: prompts are cut from the training corpus, the target
continues them with jspec's compiled generation (greedy and sampled halves), and the sequences are
stored as a TFDS dataset; the drafter then trains on them with online target features.
"""

from __future__ import annotations

import os

import jax
import numpy as np

import jspec
from jspec.drafters import dflash as dfl
from jspec.drafters import dspark as dsp
from jspec.io import drafters as drafter_io
from jspec.models.config import ModelConfig
from jspec.train import data, lm
from jspec.train.drafter import DrafterLoss, dflash_loss, dspark_train_loss
from jspec.train.trainer import TrainConfig, Trainer
from jspec.verify.sampling import SamplingParams


def corpus_prompts(target, ds_dir: str, split: str, count: int, prompt_len: int, seed: int) -> list[list[int]]:
    """`count` prompts of prompt_len tokens cut at random places of the split's files."""
    rng = np.random.default_rng(seed)
    docs = [d for d in (target.encode(ex["text"]) for ex in data.read_split(ds_dir, split)) if len(d) > prompt_len]
    if not docs:
        raise ValueError(f"no document of the {split!r} split is longer than {prompt_len} tokens")
    out = []
    for _ in range(count):
        d = docs[rng.integers(len(docs))]
        start = rng.integers(len(d) - prompt_len)
        out.append(d[start : start + prompt_len])
    return out


def self_distill(target, prompts: list[list[int]], new_tokens: int, batch: int, seed: int, out_path: str) -> str:
    """Continue every prompt with the target (even batches greedy, odd ones at temperature 1) and save
    tokens / length / prompt_len to an .npz file."""
    seqs, lengths, plens = [], [], []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        sampling = SamplingParams(0.0) if (i // batch) % 2 == 0 else SamplingParams(1.0)
        res = jspec.generate(target, chunk, max_new_tokens=new_tokens, sampling=sampling, seeds=seed + i, eos_ids=[])
        for p, t in zip(chunk, res.tokens):
            seqs.append(p + t)
            plens.append(len(p))
    width = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), width), np.int32)
    for j, s in enumerate(seqs):
        tokens[j, : len(s)] = s
        lengths.append(len(s))
    np.savez(out_path, tokens=tokens, length=np.asarray(lengths), prompt_len=np.asarray(plens))
    return out_path


def build_drafter(kind: str, cfg: dict, target) -> tuple[object, dict]:
    """(config, random params) of a DFlash or DSpark drafter for `target` from a run config."""
    d = cfg["drafter"]
    tcfg: ModelConfig = target.cfg
    import dataclasses

    layers = dataclasses.replace(tcfg, num_layers=d["num_layers"], layer_types=(), qk_norm=True, family="qwen3")
    taps = tuple(d.get("target_layer_ids") or dfl.default_target_layer_ids(d.get("num_taps", 1), tcfg.num_layers))
    backbone = dfl.DFlashConfig(layers=layers, target_layer_ids=taps, num_target_layers=tcfg.num_layers,
                                mask_token_id=d["mask_token_id"], block_size=d["block_size"],
                                anchor_predicts=kind == "dspark")
    key = jax.random.key(cfg["train"].get("seed", 0) + 1)
    if kind == "dflash":
        return backbone, dfl.init_params(backbone, key, std=cfg.get("init_std", 0.02))
    spark = dsp.DSparkConfig(backbone=backbone, markov_rank=d.get("markov_rank", 64),
                             markov_head_type=d.get("markov_head_type", "vanilla"))
    return spark, dsp.init_params(spark, key, target.params, std=cfg.get("init_std", 0.02))


def train_drafter(kind: str, config_path: str, target_path: str, out_dir: str, steps: int | None = None,
                  progress: bool = True) -> str:
    cfg = lm.load_run_config(config_path)
    target = jspec.load_target(target_path)
    os.makedirs(out_dir, exist_ok=True)
    dist = cfg["distill"]
    npz = os.path.join(out_dir, "distilled.npz")
    if not os.path.exists(npz):
        ds_dir, _ = lm.prepare_text({"data": cfg["data"]}, out_dir)
        prompts = corpus_prompts(target, ds_dir, "train", dist["num_prompts"], dist["prompt_len"], dist.get("seed", 0))
        self_distill(target, prompts, dist["new_tokens"], dist["batch"], dist.get("seed", 0), npz)
    tok_dir = data.build_token_dataset({"train": npz}, os.path.join(out_dir, "tfds"))
    arrays = data.padded_examples(data.read_split(tok_dir, "train"), dist["prompt_len"] + dist["new_tokens"])
    dcfg, params = build_drafter(kind, cfg, target)
    d = cfg["drafter"]
    spec = DrafterLoss(name=d.get("loss", "ce"), num_anchors=d.get("num_anchors", 16), gamma=d.get("gamma", 4.0))
    tc = TrainConfig(**cfg["train"])
    base_key = jax.random.key(tc.seed)
    fn = dflash_loss if kind == "dflash" else dspark_train_loss
    frozen = {k: v for k, v in params.items() if k in ("embed", "lm_head")}  # DSpark's copies stay frozen
    trainable = {k: v for k, v in params.items() if k not in frozen}

    def loss_fn(p, batch):
        key = jax.random.fold_in(base_key, batch["step"][0])
        return fn({**p, **frozen}, target.params, target.cfg, dcfg, spec, batch, key)

    trainer = Trainer(loss_fn, trainable, tc, out_dir, fingerprint={"kind": kind, "config": cfg,
                                                                      "target": os.path.abspath(target_path)})
    start = trainer.restore_latest()
    ds = data.dict_batches(arrays, cfg["data"]["batch_size"], tc.seed)
    stepped = _with_step(ds)
    if progress:
        print(f"{kind}: {len(arrays['tokens'])} distilled sequences; resuming at step {start}")
    state = trainer.run(stepped, steps=steps, progress=progress)
    model_dir = os.path.join(out_dir, "model")
    full = {**state.params, **frozen}
    if kind == "dflash":
        drafter_io.save_dflash(model_dir, dcfg, full)
    else:
        drafter_io.save_dspark(model_dir, dcfg, full, num_anchors=spec.num_anchors)
    return model_dir


class _with_step:
    """Random-access batches with the step index attached (it keys the anchor sampling)."""

    def __init__(self, ds):
        self.ds = ds

    def __getitem__(self, i):
        b = dict(self.ds[i])
        b["step"] = np.full((1,), i, np.int32)
        return b
