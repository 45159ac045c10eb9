"""Self-distillation and drafter training runs.

    jspec train dflash --config configs/code-dflash.json --target runs/code-target/model --out runs/code-dflash

Any registered drafter family with a training recipe (jspec.drafters.family.TrainRecipe) trains here.

Drafters learn what the target actually says: prompts are cut from the training corpus, the target
continues them with jspec's compiled generation (greedy and sampled halves), and the sequences are
stored as a TFDS dataset; the drafter then trains on them with online target features.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from jspec.api import generate, load_target
from jspec.drafters import family
from jspec.train import data, lm
from jspec.train.drafter import DrafterLoss
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
        res = generate(target, chunk, max_new_tokens=new_tokens, sampling=sampling, seeds=seed + i, eos_ids=[])
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


def build_drafter(family_name: str, cfg: dict, target) -> tuple[object, dict]:
    """(Drafter, random params) of the family's training recipe for `target` from a run config, checked
    against the target."""
    fam = family.get_family(family_name)
    if fam.recipe is None:
        raise ValueError(f"the {family_name} drafter family has no training recipe: trainable families are "
                         f"{', '.join(family.trainable())}")
    return fam.recipe.build(cfg, target, jax.random.key(cfg["train"].get("seed", 0) + 1))


def train_drafter(family_name: str, config_path: str, target_path: str, out_dir: str, steps: int | None = None,
                  progress: bool = True) -> str:
    """Train a drafter of a registered family (its `TrainRecipe`) for the target; returns the model folder
    (written by the family's `save`, so `jspec.load_drafter` reads it back)."""
    cfg = lm.load_run_config(config_path)
    target = load_target(target_path)
    fam = family.get_family(family_name)
    dr, params = build_drafter(family_name, cfg, target)  # before any distillation: a bad config fails fast
    recipe = fam.recipe
    if recipe.data != "distilled":
        raise ValueError(f"the {family_name} recipe needs {recipe.data!r} data; jspec train prepares 'distilled'")
    os.makedirs(out_dir, exist_ok=True)
    dist = cfg["distill"]
    npz = os.path.join(out_dir, "distilled.npz")
    if not os.path.exists(npz):
        ds_dir, _ = lm.prepare_text({"data": cfg["data"]}, out_dir)
        prompts = corpus_prompts(target, ds_dir, "train", dist["num_prompts"], dist["prompt_len"], dist.get("seed", 0))
        self_distill(target, prompts, dist["new_tokens"], dist["batch"], dist.get("seed", 0), npz)
    tok_dir = data.build_token_dataset({"train": npz}, os.path.join(out_dir, "tfds"))
    arrays = data.padded_examples(data.read_split(tok_dir, "train"), dist["prompt_len"] + dist["new_tokens"])
    d = cfg["drafter"]
    spec = DrafterLoss(name=d.get("loss", "ce"), num_anchors=d.get("num_anchors", 16), gamma=d.get("gamma", 4.0))
    tc = TrainConfig(**cfg["train"])
    base_key = jax.random.key(tc.seed)
    frozen = {k: v for k, v in params.items() if k in recipe.frozen}
    trainable = {k: v for k, v in params.items() if k not in frozen}

    def loss_fn(p, batch, fixed):  # fixed: the target's parameters and the drafter's frozen ones
        key = jax.random.fold_in(base_key, batch["step"][0])
        return recipe.loss({**p, **fixed["drafter"]}, fixed["target"], target.cfg, dr, spec, batch, key)

    trainer = Trainer(loss_fn, trainable, tc, out_dir, fingerprint={"kind": family_name, "config": cfg,
                                                                      "target": os.path.abspath(target_path)},
                      frozen={"target": target.params, "drafter": frozen})
    start = trainer.restore_latest()
    ds = data.dict_batches(arrays, cfg["data"]["batch_size"], tc.seed)
    stepped = _with_step(ds)
    if progress:
        print(f"{family_name}: {len(arrays['tokens'])} distilled sequences; resuming at step {start}")
    state = trainer.run(stepped, steps=steps, progress=progress)
    model_dir = os.path.join(out_dir, "model")
    fam.save(model_dir, dr, {**state.params, **frozen})
    return model_dir


class _with_step:
    """Random-access batches with the step index attached (it keys the anchor sampling)."""

    def __init__(self, ds):
        self.ds = ds

    def __getitem__(self, i):
        b = dict(self.ds[i])
        b["step"] = np.full((1,), i, np.int32)
        return b
