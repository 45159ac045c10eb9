"""Self-distillation and drafter training runs.

    jspec train dflash --config configs/code-dflash.json --target runs/code-target/model --out runs/code-dflash

Any registered drafter family with a training recipe (jspec.drafters.family.TrainRecipe) trains here.

Drafters learn what the target actually says: prompts are cut from the training corpus, the target
continues them with jspec's compiled generation (greedy and sampled halves), and the sequences are
stored as a TFDS dataset; the drafter then trains on them with online target features.

The distilled sequences depend on the target, the data section and the distill section only, so drafters
of one target can share them: `distilled.json` beside `distilled.npz` records that identity, and a run
started with `distilled=` (`jspec train ... --distilled RUN_DIR`) copies another run's sequences after
checking that identity against its own; any difference is refused by name.

The run config is checked whole before anything runs: its fixed sections by jspec.train.runconfig, the
drafter section by `build_drafter` (the keys the family's recipe reads, and the drafter it builds checked
against the target exactly as generation checks it: `Drafter.validate`). The run holds --out for its
duration, and the distilled data and the model folder are written whole or not at all.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import math
import os
import shutil

import jax
import numpy as np
from tqdm.auto import tqdm

from jspec.api import generate, load_target
from jspec.drafters import family
from jspec.errors import ConfigError
from jspec.train import data, export, lm, losses, runfiles
from jspec.train.drafter import DrafterLoss
from jspec.train.runconfig import ReadKeys
from jspec.train.trainer import TrainConfig, Trainer
from jspec.verify.sampling import SamplingParams

logger = logging.getLogger(__name__)


def corpus_prompts(target, ds_dir: str, split: str, count: int, prompt_len: int, seed: int) -> list[list[int]]:
    """`count` prompts of prompt_len tokens cut at random places of the split's files."""
    docs = [d for d in (target.encode(ex["text"]) for ex in data.read_split(ds_dir, split)) if len(d) > prompt_len]
    if not docs:
        raise ValueError(f"no document of the {split!r} split is longer than {prompt_len} tokens")
    return cut_prompts(docs, count, prompt_len, seed)


def cut_prompts(docs: list[list[int]], count: int, prompt_len: int, seed: int) -> list[list[int]]:
    """`count` windows of prompt_len tokens at random places of random documents (each longer than that)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        d = docs[rng.integers(len(docs))]
        start = rng.integers(len(d) - prompt_len)
        out.append(d[start : start + prompt_len])
    return out


def self_distill(target, prompts: list[list[int]], new_tokens: int, batch: int, seed: int, out_path: str,
                 progress: bool = False) -> str:
    """Continue every prompt with the target (even batches greedy, odd ones at temperature 1) and save
    tokens / length / prompt_len to an .npz file; progress: a progress bar over the prompts."""
    seqs, lengths, plens = [], [], []
    bar = tqdm(total=len(prompts), disable=not progress, desc="self-distill", unit="prompt")
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        sampling = SamplingParams(0.0) if (i // batch) % 2 == 0 else SamplingParams(1.0)
        res = generate(target, chunk, max_new_tokens=new_tokens, sampling=sampling, seeds=seed + i, eos_ids=[])
        for p, t in zip(chunk, res.tokens):
            seqs.append(p + t)
            plens.append(len(p))
        bar.update(len(chunk))
    bar.close()
    width = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), width), np.int32)
    for j, s in enumerate(seqs):
        tokens[j, : len(s)] = s
        lengths.append(len(s))

    def write(tmp):
        with open(tmp, "wb") as f:  # a file, not a name: np.savez would append .npz to the name
            np.savez(f, tokens=tokens, length=np.asarray(lengths), prompt_len=np.asarray(plens))

    return runfiles.atomic_file(out_path, write)


LOSS_KEYS = ("loss", "num_anchors", "gamma")  # the drafter section's keys the run itself reads


def drafter_loss(section: dict, where: str = "the run config", own: str | None = None) -> DrafterLoss:
    """The training objective's settings from the drafter section (loss, num_anchors, gamma), checked. own:
    the family's own objective (`TrainRecipe.own_loss`), the default loss when there is one."""
    spec = DrafterLoss(name=section.get("loss", own or "ce"), num_anchors=section.get("num_anchors", 16),
                       gamma=section.get("gamma", 4.0))
    names = (own, *losses.LOSSES) if own else tuple(losses.LOSSES)
    problems = []
    if not isinstance(spec.name, str) or spec.name not in names:
        problems.append(f"drafter.loss {spec.name!r} is no loss of this drafter: use one of {', '.join(names)}")
    if isinstance(spec.num_anchors, bool) or not isinstance(spec.num_anchors, int) or spec.num_anchors < 1:
        problems.append(f"drafter.num_anchors must be an integer >= 1, got {spec.num_anchors!r}")
    if (isinstance(spec.gamma, bool) or not isinstance(spec.gamma, (int, float)) or not math.isfinite(spec.gamma)
            or spec.gamma <= 0):
        problems.append(f"drafter.gamma must be a finite number > 0, got {spec.gamma!r}")
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    return spec


def build_drafter(family_name: str, cfg: dict, target, config_path: str | None = None) -> tuple[object, dict]:
    """(Drafter, random params) of the family's training recipe for `target` from a run config, checked
    as generation checks a drafter (`Drafter.validate` against the target: taps, mask token, hidden size,
    vocabulary). The drafter section may hold only the keys the recipe reads and those of the loss
    (LOSS_KEYS); ConfigError naming the file (config_path) and each unknown or missing key."""
    where = f"training config {config_path}" if config_path else "the run config"
    fam = family.get_family(family_name)
    if fam.recipe is None:
        raise ValueError(f"the {family_name} drafter family has no training recipe: trainable families are "
                         f"{', '.join(family.trainable())}")
    if not isinstance(cfg.get("drafter"), dict):
        raise ConfigError(f"{where}: needs a \"drafter\" section, an object of the {family_name} drafter's settings")
    section = ReadKeys(cfg["drafter"])
    drafter_loss(section, where, fam.recipe.own_loss)
    run = {**cfg, "drafter": section}
    try:
        dr, params = fam.recipe.build(run, target, jax.random.key(cfg.get("train", {}).get("seed", 0) + 1))
    except Exception as err:
        missing = sorted(k for k in section.absent
                         if (isinstance(err, KeyError) and err.args and err.args[0] == k) or str(k) in str(err))
        if missing:
            names = ", ".join(repr(f"drafter.{k}") for k in missing)
            raise ConfigError(f"{where}: missing required key{'s' if len(missing) > 1 else ''} {names} (the "
                              f"{family_name} recipe needs {'them' if len(missing) > 1 else 'it'})"
                              f"{_suggest(section.unread(), missing)}") from err
        if isinstance(err, ValueError) and config_path and not isinstance(err, ConfigError):
            raise ConfigError(f"{where}: {err}") from err
        raise
    unknown = sorted(section.unread())
    if unknown:
        known = sorted(section.read | set(LOSS_KEYS))
        raise ConfigError(
            f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(repr(f'drafter.{k}') for k in unknown)} "
            f"(the {family_name} recipe does not read {'them' if len(unknown) > 1 else 'it'}: a misspelling, or a "
            f"setting that does not apply alongside the others; it read {', '.join(known)})"
            f"{_suggest(unknown, known)}")
    try:
        dr.validate(target.cfg, params)  # as jspec.api.prepare_drafter does before generating
    except ValueError as err:
        if not config_path:
            raise
        raise ConfigError(f"{where}: the {family_name} drafter it describes does not fit the target "
                          f"({err})") from err
    return dr, params


def validation_tau(dr, frozen: dict, target, cfg: dict, out_dir: str, tc: TrainConfig):
    """params -> {"val_tau": greedy tau} of the drafter on tc.eval_prompts prompts from the corpus's
    held-out split (files no training step reads), continued greedily by the target once, here; the tau
    of each evaluation comes from the exact offline evaluator (`jspec.train.evaluate`: equal to the
    compiled loop's greedy tau on the same texts, without running the loop)."""
    from jspec.train import evaluate

    if not evaluate.supports(dr):
        raise ConfigError(f"train.eval_every: the offline evaluator scores chain drafters of families with an "
                          f"offline reading (jspec.drafters.family.Family.offline), not this {type(dr).__name__} "
                          f"(kind {dr.kind!r}): drop eval_every from the run config")
    dist = cfg["distill"]
    ds_dir, _ = lm.prepare_text({"data": cfg["data"]}, out_dir)
    prompts = corpus_prompts(target, ds_dir, "validation", tc.eval_prompts, dist["prompt_len"], dist.get("seed", 0))
    texts = generate(target, prompts, max_new_tokens=dist["new_tokens"], eos_ids=[]).tokens
    greedy = SamplingParams(0.0)

    def run(params) -> dict:
        stats = evaluate.rollout_stats(target, dr, {**params, **frozen}, prompts, texts, greedy)
        return {"val_tau": evaluate.offline_tau("greedy", stats)["tau"]}

    return run


def _suggest(given, wanted) -> str:
    """'; did you mean ...' for keys of `given` spelt close to one of `wanted`."""
    pairs = []
    for k in sorted(given):
        close = difflib.get_close_matches(str(k), [str(w) for w in wanted], n=1, cutoff=0.6)
        if close:
            pairs.append(f"drafter.{close[0]!s} for drafter.{k!s}")
    return f"; did you mean {', '.join(pairs)}?" if pairs else ""


def distill_identity(target, cfg: dict) -> dict:
    """What a run's distilled sequences depend on: a digest of the target's parameters and vocabulary, and
    the run config's data and distill sections."""
    h = hashlib.sha256()
    for name, leaf in sorted(jax.tree_util.tree_leaves_with_path(target.params), key=lambda kv: str(kv[0])):
        arr = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(name)}:{arr.dtype}:{arr.shape};".encode())
        h.update(arr.tobytes())
    if target.tokenizer is not None:
        h.update(target.tokenizer.to_str().encode())
    data_section = {k: v for k, v in cfg["data"].items() if k != "batch_size"}  # the training batch: not read here
    return {"target_sha256": h.hexdigest(), "data": data_section, "distill": cfg["distill"]}


def share_distilled(source: str, out_dir: str, identity: dict) -> None:
    """Copy another run's distilled sequences (source: its run folder) into out_dir, after checking that
    they were distilled for this run's target, data and distill sections."""
    src_npz, src_json = (os.path.join(source, n) for n in ("distilled.npz", "distilled.json"))
    if not os.path.exists(src_npz):
        raise ConfigError(f"--distilled {source!r}: no distilled.npz there: pass the run folder of a drafter run "
                          "that has distilled its sequences")
    if not os.path.exists(src_json):
        raise ConfigError(f"--distilled {source!r}: distilled.npz has no distilled.json beside it (a run of an "
                          "older jspec), so what it was distilled from is unknown: drop --distilled")
    with open(src_json) as f:
        theirs = json.load(f)
    differ = [k for k in sorted(set(identity) | set(theirs)) if identity.get(k) != theirs.get(k)]
    if differ:
        what = {"target_sha256": "target"}
        raise ConfigError(f"--distilled {source!r}: its sequences were distilled with another "
                          f"{', '.join(what.get(k, k + ' section') for k in differ)} than this run's; drop "
                          "--distilled, or make the sections equal")
    for name in ("distilled.npz", "distilled.json"):  # the identity last: it vouches for the sequences beside it
        runfiles.atomic_file(os.path.join(out_dir, name), lambda tmp, name=name: shutil.copyfile(
            os.path.join(source, name), tmp))
    logger.info("distilled sequences shared from %s", source)


def train_drafter(family_name: str, config_path: str, target_path: str, out_dir: str, steps: int | None = None,
                  progress: bool = True, init: str | None = None, distilled: str | None = None) -> str:
    """Train a drafter of a registered family (its `TrainRecipe`) for the target; returns the model folder
    (written by the family's `save`, so `jspec.load_drafter` reads it back).

    init (or "init" in the config's train section; init wins): a checkpoint of the family in its official
    format that a new run starts from instead of random parameters (jspec.train.export.init_drafter_params:
    it must match the run config exactly). A run folder that has checkpoints resumes from them and ignores
    it, saying so. The init path is not part of the run's fingerprint.

    distilled: another drafter run's folder whose distilled sequences this run uses instead of distilling
    its own (`share_distilled`: same target, data and distill sections, or refused)."""
    cfg = lm.load_run_config(config_path, "drafter")
    config_init = cfg["train"].pop("init", None)  # a start, not a setting: kept out of the fingerprint
    init = init if init is not None else config_init
    fam = family.get_family(family_name)
    if fam.recipe is not None and fam.recipe.data != "distilled":
        raise ValueError(f"the {family_name} recipe needs {fam.recipe.data!r} data; jspec train prepares 'distilled'")
    with runfiles.locked(out_dir) as lock:
        target = load_target(target_path)
        # Before any distillation: a bad config, or a drafter that does not fit the target, fails fast.
        dr, params = build_drafter(family_name, cfg, target, config_path)
        if init is not None:
            steps_done = export.checkpoint_steps(out_dir)
            if steps_done:
                logger.warning("%s: %s has checkpoints (step %d the newest): the run resumes from them and ignores "
                               "the init checkpoint %r (it starts new runs only)", fam.name, out_dir, steps_done[-1],
                               init)
            else:
                params = export.init_drafter_params(family_name, dr, params, init, target)
                logger.info("%s: starting from the parameters of %s", fam.name, init)
        return _train(fam, dr, params, cfg, target, target_path, out_dir, steps, progress, lock, distilled)


def _train(fam, dr, params, cfg, target, target_path, out_dir, steps, progress, lock, distilled=None) -> str:
    recipe = fam.recipe
    dist = cfg["distill"]
    npz = os.path.join(out_dir, "distilled.npz")
    if not os.path.exists(npz):
        identity = distill_identity(target, cfg)
        if distilled is not None:
            share_distilled(distilled, out_dir, identity)
        else:
            ds_dir, _ = lm.prepare_text({"data": cfg["data"]}, out_dir)
            prompts = corpus_prompts(target, ds_dir, "train", dist["num_prompts"], dist["prompt_len"],
                                     dist.get("seed", 0))
            self_distill(target, prompts, dist["new_tokens"], dist["batch"], dist.get("seed", 0), npz,
                         progress=progress)
            runfiles.atomic_text(os.path.join(out_dir, "distilled.json"), json.dumps(identity, indent=1))
    elif distilled is not None:
        logger.warning("%s already has distilled.npz: the run uses it and ignores --distilled %r", out_dir, distilled)
    tok_dir = data.build_token_dataset({"train": npz}, os.path.join(out_dir, "tfds"))
    arrays = data.padded_examples(data.read_split(tok_dir, "train"), dist["prompt_len"] + dist["new_tokens"])
    spec = drafter_loss(cfg["drafter"], own=recipe.own_loss)
    tc = TrainConfig(**cfg["train"])
    base_key = jax.random.key(tc.seed)
    frozen = {k: v for k, v in params.items() if k in recipe.frozen}
    trainable = {k: v for k, v in params.items() if k not in frozen}

    def loss_fn(p, batch, fixed):  # fixed: the target's parameters and the drafter's frozen ones
        key = jax.random.fold_in(base_key, batch["step"][0])
        return recipe.loss({**p, **fixed["drafter"]}, fixed["target"], target.cfg, dr, spec, batch, key)

    trainer = Trainer(loss_fn, trainable, tc, out_dir, fingerprint={"kind": fam.name, "config": cfg,
                                                                      "target": os.path.abspath(target_path)},
                      frozen={"target": target.params, "drafter": frozen}, lock=lock)
    start = trainer.restore_latest()
    ds = data.dict_batches(arrays, cfg["data"]["batch_size"], tc.seed)
    stepped = _with_step(ds)
    logger.info("%s: %d distilled sequences; %s", fam.name, len(arrays["tokens"]),
                f"resuming at step {start}" if start else "starting at step 0")
    evaluate = validation_tau(dr, frozen, target, cfg, out_dir, tc) if tc.eval_every else None
    state = trainer.run(stepped, steps=steps, progress=progress, evaluate=evaluate)
    model_dir = os.path.join(out_dir, "model")
    runfiles.replace_folder(model_dir, lambda folder: fam.save(folder, dr, {**state.params, **frozen}))
    return model_dir


class _with_step:
    """Random-access batches with the step index attached (it keys the anchor sampling)."""

    def __init__(self, ds):
        self.ds = ds

    def __getitem__(self, i):
        b = dict(self.ds[i])
        b["step"] = np.full((1,), i, np.int32)
        return b
