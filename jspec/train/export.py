"""Training runs in the official checkpoint formats, and official checkpoints as the start of a run.

    jspec convert RUN_DIR OUT [--step N] [--dtype bfloat16|float32]
    jspec train target|dflash|dspark --init MODEL_DIR --config C --out RUN_DIR

A run folder (`jspec train ... --out RUN_DIR`) holds orbax checkpoints of the trainable parameters and
the optimizer state, and run_config.json: which model (`kind`: "target" or a drafter family), the run
config, and a drafter run's target. `export_run` restores one checkpoint (the newest one that restores,
or step N) and writes what the run writes at its end, in the official format of its model: the target in
Hugging Face format (config.json, model.safetensors, the run's tokenizer.json), a drafter with its
family's `save` (z-lab DFlash, DeepSpec DSpark, ...). What a drafter needs beyond its trained tensors (its
shapes, DSpark's frozen copies of the target's embedding and head) comes from the target recorded in the
run, as during training. An interrupted run exports the same way, and so does one still training:
orbax lists a checkpoint only once it is written whole, and nothing in the run folder is written.

A folder that already is a checkpoint in an official format is refused (`NothingToConvert`): there is
nothing to convert, it loads as it is.

The other way, `init_drafter_params` / `init_target_params` read an official checkpoint as the start of a
new run (`jspec train --init`, or "init" in the run config's train section): strictly, every config field
and every tensor must be what the run config describes (one error naming each that is not), and the
parameters start as the file's, bit for bit (in the run's float32). A run that already has checkpoints
resumes from them and ignores the init checkpoint, saying so (`checkpoint_steps` tells which); the init
path is no part of the run's fingerprint, so a run started from one resumes with or without it.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jspec.errors import CheckpointError, ConfigError, JspecError
from jspec.io.files import read_json_object

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
# The end-of-text token of a target run's tokenizer (lm imports it from here: this module cannot import lm).
EOT = "<|endoftext|>"


def run_model_config(cfg: dict, tok):
    """A target run's ModelConfig: the config's model section, EOS = the run tokenizer's end-of-text id."""
    from jspec.models.config import ModelConfig

    return ModelConfig(**{**cfg["model"], "eos_token_ids": (tok.token_to_id(EOT),)})
HF_FORMAT = "Hugging Face (config.json, model.safetensors, tokenizer.json)"
# Config fields an init checkpoint need not share with the run: ModelConfig fields the drafter formats do
# not store and drafters do not use (the target's stop tokens), and DSpark's num_anchors (training anchors
# per sequence, kept in its config.json; no effect on drafting; the run's is its drafter section's).
_DRAFTER_IGNORED = ("eos_token_ids", "bos_token_id", "num_anchors")
# ... and those a target run takes from its tokenizer, not from its config.
_TARGET_IGNORED = ("eos_token_ids", "bos_token_id")


class NothingToConvert(JspecError, ValueError):
    """The source of `jspec convert` already is a checkpoint in an official format."""


@dataclasses.dataclass
class RunCheckpoint:
    """One restored checkpoint of a run, as the model it trains: what the run would save at that step."""

    run_dir: str
    kind: str  # "target" or the drafter family's name
    step: int
    steps: list[int]  # every checkpoint step of the run
    params: dict  # the whole model's parameters (a drafter's frozen copies of the target included)
    drafter: object = None  # drafter runs: the Drafter the run builds from its config
    cfg: object = None  # target runs: the ModelConfig (eos from the run's tokenizer)
    tokenizer: object = None  # target runs: the run's tokenizer
    target_path: str | None = None  # drafter runs: the target it was trained for

    @property
    def format(self) -> str:
        if self.kind == "target":
            return HF_FORMAT
        from jspec.drafters import family

        fam = family.get_family(self.kind)
        return fam.summary or fam.name

    def save(self, folder: str, dtype=None) -> None:
        """Write the official checkpoint into `folder` (a new folder); dtype: None (the parameters', float32),
        "bfloat16" or "float32"."""
        dt = _dtype(dtype)
        if self.kind == "target":
            from jspec.io.hf import save_params

            save_params(folder, self.cfg, self.params, dtype=dt)
            self.tokenizer.save(os.path.join(folder, "tokenizer.json"))
        else:
            from jspec.drafters import family

            family.get_family(self.kind).save(folder, self.drafter, self.params, dt)


def _dtype(dtype):
    if dtype is None:
        return None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


# --- reading a run ---------------------------------------------------------------------------------------


def _official_format(path: str) -> str | None:
    """The official format of a checkpoint folder (its config.json), or None when it is none jspec knows."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None
    from jspec.drafters import family

    try:
        fam = family.detect(path)
    except (ValueError, OSError):
        return "a model format (it has a config.json)"
    if fam.fallback:
        return "the Hugging Face format (a causal LM: it loads as a target)"
    return f"the {fam.name} format ({fam.summary})" if fam.summary else f"the {fam.name} format"


def read_run(run_dir: str) -> dict:
    """The run folder's run_config.json (kind, config, target); NothingToConvert for a folder that is a
    checkpoint in an official format, ConfigError for one that is no training run."""
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"no run folder {run_dir!r}: pass the --out folder of a `jspec train` run")
    path = os.path.join(run_dir, "run_config.json")
    if not os.path.exists(path):
        official = _official_format(run_dir)
        if official is not None:
            raise NothingToConvert(
                f"{run_dir!r} is already a checkpoint, in {official}: there is nothing to "
                "convert; load it as it is (--target / --drafter PATH, jspec.load_target / jspec.load_drafter), "
                "start a run from it with `jspec train ... --init PATH`, or quantize a float target with --q4")
        raise ConfigError(f"{run_dir!r} is no training run folder (it has no run_config.json): pass the --out folder "
                          "of a `jspec train` run")
    fingerprint = read_json_object(path, error=ConfigError)
    if not isinstance(fingerprint.get("kind"), str) or not isinstance(fingerprint.get("config"), dict):
        raise ConfigError(f"{path} names no model kind and run config (\"kind\", \"config\"): it was not written by "
                          "`jspec train`")
    return fingerprint


def _reader(folder: str):
    """An orbax CheckpointManager that only reads (it never creates, cleans up or deletes anything)."""
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(folder, options=ocp.CheckpointManagerOptions(
        read_only=True, save_interval_steps=0, max_to_keep=None, create=False))


def checkpoint_steps(run_dir: str) -> list[int]:
    """The steps of the run's complete checkpoints, oldest first (half-written ones are not listed); [] when
    it has none. Reads only."""
    folder = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(folder):
        return []
    manager = _reader(folder)
    try:
        return sorted(int(s) for s in manager.all_steps())
    finally:
        manager.close()


def _train_config(cfg: dict, where: str):
    from jspec.train.trainer import TrainConfig

    train = cfg.get("train")
    if not isinstance(train, dict):
        raise ConfigError(f"{where}: the run config has no train section")
    try:
        return TrainConfig(**{k: v for k, v in train.items() if k != "init"})
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from None


def _restore_params(run_dir: str, trainable: dict, tc, step: int | None, steps: list[int]) -> tuple[int, dict]:
    """(step, trainable parameters) of the checkpoint of `step`, or of the newest one that restores (a damaged
    one is skipped with a warning and left where it is)."""
    import orbax.checkpoint as ocp

    from jspec.train.trainer import TrainState, make_optimizer

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # a mesh run's checkpoint restores onto one device
    params = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), trainable)
    abstract = TrainState(params, jax.eval_shape(make_optimizer(tc).init, params), jax.ShapeDtypeStruct((), jnp.int32))
    abstract = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), abstract)
    folder = os.path.join(run_dir, "checkpoints")
    manager = _reader(folder)
    failures = []
    try:
        for s in [step] if step is not None else sorted(steps, reverse=True):
            try:
                state = manager.restore(s, args=ocp.args.StandardRestore(abstract))
            except Exception as err:  # orbax / tensorstore raise bare Exceptions for damaged files
                if isinstance(err, MemoryError) or "RESOURCE_EXHAUSTED" in str(err):
                    raise
                reason = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
                where = os.path.join(folder, str(s))
                if step is not None:
                    raise CheckpointError(
                        f"the checkpoint of step {s} in {run_dir!r} cannot be restored ({reason}): its files "
                        f"({where}) are damaged, or hold other shapes than the run's config gives; the run's "
                        f"checkpoints are steps {', '.join(map(str, steps))}") from err
                failures.append(f"step {s} ({reason})")
                warnings.warn(f"the checkpoint of step {s} in {run_dir!r} cannot be restored ({reason}); trying the "
                              "one before it", RuntimeWarning, stacklevel=3)
                continue
            return int(s), state.params
    finally:
        manager.close()
    raise CheckpointError(f"no checkpoint of run folder {run_dir!r} can be restored: {'; '.join(failures)} (damaged "
                          "files, or other shapes than the run's config gives)")


def _run_target(fingerprint: dict, run_dir: str, kind: str):
    """The target a drafter run was trained for (recorded in run_config.json); CheckpointError when it is gone."""
    from jspec.api import load_target, resolve_path

    path = fingerprint.get("target")
    if not isinstance(path, str):
        raise ConfigError(f"{os.path.join(run_dir, 'run_config.json')} records no target: the {kind} drafter's "
                          "shapes come from the target it was trained for")
    if not os.path.isdir(path) and os.path.basename(path).startswith("builtin:"):
        path = resolve_path(os.path.basename(path))  # the run recorded builtin:NAME as a path
    if not os.path.isdir(path):
        from jspec.drafters import family

        recipe = family.get_family(kind).recipe
        needs = "shapes and its frozen copies of the target" if recipe and recipe.frozen else "shapes"
        raise CheckpointError(
            f"the target the {kind} run {run_dir!r} was trained for, {path!r} (recorded in its run_config.json), no "
            f"longer exists: the drafter's {needs} come from it; put that target back at that path to export the run")
    return path, load_target(path)


def restore_run(run_dir: str, step: int | None = None) -> RunCheckpoint:
    """The model of one checkpoint of a run (`step`, or the newest one that restores), strictly as the run's
    config describes it; CheckpointError listing the run's steps when `step` is not one of them."""
    fingerprint = read_run(run_dir)
    kind, cfg = fingerprint["kind"], fingerprint["config"]
    where = os.path.join(run_dir, "run_config.json")
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise CheckpointError(f"run folder {run_dir!r} has no checkpoint yet: a run writes one every train.ckpt_every "
                              "steps and at its last step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step not in steps):
        raise CheckpointError(f"run folder {run_dir!r} has no checkpoint of step {step!r}: its checkpoints are steps "
                              f"{', '.join(map(str, steps))}")
    tc = _train_config(cfg, where)
    if kind == "target":
        from jspec.io.tokenizer import load_tokenizer
        from jspec.models import transformer

        tok = load_tokenizer(run_dir)  # CheckpointError naming a damaged one
        if tok is None:
            raise CheckpointError(f"target run {run_dir!r} has no tokenizer.json: the exported model needs the run's "
                                  "tokenizer")
        if not isinstance(cfg.get("model"), dict):
            raise ConfigError(f"{where}: the target run's config has no model section")
        mcfg = run_model_config(cfg, tok)
        shapes = jax.eval_shape(lambda: transformer.init_params(mcfg, jax.random.key(0)))
        got, params = _restore_params(run_dir, shapes, tc, step, steps)
        return RunCheckpoint(run_dir, kind, got, steps, params, cfg=mcfg, tokenizer=tok)
    from jspec.drafters import family

    try:
        fam = family.get_family(kind)
    except ValueError as err:
        raise ConfigError(f"{where}: the run trained a {kind!r} drafter: {err} (import the module that registers "
                          "it)") from None
    if fam.recipe is None:
        raise ConfigError(f"{where}: the {kind} drafter family has no training recipe: no run trains one")
    target_path, target = _run_target(fingerprint, run_dir, kind)
    # The drafter as the run built it (jspec.train.distill.build_drafter, whose checks the config passed when
    # the run started): its random parameters give the checkpoint's shapes, and the frozen ones are copies.
    try:
        dr, built = fam.recipe.build(cfg, target, jax.random.key(cfg.get("train", {}).get("seed", 0) + 1))
        dr.validate(target.cfg, built)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: the run's {kind} drafter does not fit its target {target_path!r} ({err}): is "
                              "that the target the run was trained for?") from err
    frozen = {k: v for k, v in built.items() if k in fam.recipe.frozen}
    got, params = _restore_params(run_dir, {k: v for k, v in built.items() if k not in frozen}, tc, step, steps)
    return RunCheckpoint(run_dir, kind, got, steps, {**params, **frozen}, drafter=dr, target_path=target_path)


def _check_out(run_dir: str, out: str) -> None:
    src, dst = os.path.abspath(run_dir), os.path.abspath(out)
    if dst == src or src.startswith(dst + os.sep):
        raise ValueError(f"convert {run_dir!r} into another folder (OUT {out!r} would hold the run itself)")
    if not os.path.exists(dst):
        return
    if not os.path.isdir(dst):
        raise ValueError(f"OUT {out!r} is a file: pass a folder to write the checkpoint into")
    if os.path.exists(os.path.join(dst, "run_config.json")):
        raise ValueError(f"OUT {out!r} is a training run folder: write the checkpoint into another folder")
    if os.listdir(dst) and not os.path.exists(os.path.join(dst, "config.json")):
        raise ValueError(f"OUT {out!r} exists and holds files that are not a model checkpoint: pass a new or empty "
                         "folder (a model folder, with a config.json, is replaced whole)")


def export_run(run_dir: str, out: str, step: int | None = None, dtype: str | None = None) -> RunCheckpoint:
    """Write one checkpoint of a run (`step`, or the newest one that restores) into `out` in the official
    format of its model; `out` is written whole or not at all (a model folder there is replaced). Returns the
    restored checkpoint (kind, step, steps, format)."""
    from jspec.train import runfiles

    read_run(run_dir)
    _check_out(run_dir, out)
    _dtype(dtype)
    ckpt = restore_run(run_dir, step)
    runfiles.replace_folder(out, lambda folder: ckpt.save(folder, dtype))
    return ckpt


# --- starting a run from an official checkpoint -----------------------------------------------------------


def _init_folder(path: str) -> str:
    from jspec.api import resolve_path

    path = resolve_path(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no init checkpoint folder {path!r}: --init (train.init) names a checkpoint folder "
                                "in an official format, or builtin:NAME")
    if not os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "run_config.json")):
        raise CheckpointError(f"init {path!r} is a training run folder, not a checkpoint: export one of its "
                              "checkpoints with `jspec convert RUN_DIR OUT` and start from OUT (or train into it "
                              "with --out to resume it)")
    return path


def config_differences(found, wanted, prefix: str = "", ignore=(), _seen=None) -> list[str]:
    """'field: checkpoint X, run config Y' for every (nested dataclass) field where two configs differ (a
    config reached twice, e.g. DSpark's backbone, is reported once)."""
    if dataclasses.is_dataclass(found) and type(found) is type(wanted):
        seen = set() if _seen is None else _seen
        if (id(found), id(wanted)) in seen:
            return []
        seen.add((id(found), id(wanted)))
        out = []
        for f in dataclasses.fields(found):
            if f.name in ignore:
                continue
            out += config_differences(getattr(found, f.name), getattr(wanted, f.name),
                                      f"{prefix}.{f.name}" if prefix else f.name, ignore, seen)
        return out
    if found == wanted:
        return []
    return [f"{prefix or 'config'}: checkpoint {found!r}, run config {wanted!r}"]


def _named_leaves(tree) -> dict:
    """'layers.0.wq' -> leaf."""
    def name(path):
        return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)

    return {name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def tensor_differences(found, wanted) -> list[str]:
    """Every tensor missing, unexpected, or of another shape / dtype in `found` than in `wanted`."""
    a, b = _named_leaves(found), _named_leaves(wanted)
    out = [f"tensor {n}: missing" for n in sorted(set(b) - set(a))]
    out += [f"tensor {n}: not in the run's model" for n in sorted(set(a) - set(b))]
    for n in sorted(set(a) & set(b)):
        if tuple(a[n].shape) != tuple(b[n].shape):
            out.append(f"tensor {n}: checkpoint {tuple(a[n].shape)}, run config {tuple(b[n].shape)}")
        elif np.dtype(a[n].dtype) != np.dtype(b[n].dtype):
            out.append(f"tensor {n}: checkpoint {np.dtype(a[n].dtype).name}, run {np.dtype(b[n].dtype).name}")
    return out


def _same_copy(found, wanted) -> bool:
    """Is `found` the tensor `wanted`, exactly or as stored at 16-bit precision?"""
    a, b = np.asarray(found), np.asarray(wanted)
    if a.shape != b.shape:
        return False
    return np.array_equal(a, b) or any(np.array_equal(a, b.astype(d).astype(a.dtype))
                                       for d in (ml_dtypes.bfloat16, np.float16))


def _mismatch(what: str, path: str, problems: list[str], fix: str) -> CheckpointError:
    return CheckpointError(f"init checkpoint {path!r} does not match {what}:\n  " + "\n  ".join(problems)
                           + f"\n  fix: {fix}")


def init_drafter_params(family_name: str, drafter, params: dict, path: str, target) -> dict:
    """The parameters of the official checkpoint at `path` as the start of a run whose config built
    (`drafter`, `params`) (jspec.train.distill.build_drafter): its family (or, for a wrapping family, the
    family of the drafter it wraps), every config field and every tensor's shape and dtype must be the
    run's (CheckpointError naming each that is not). The trained tensors
    are the file's bit for bit; the frozen copies of the target (TrainRecipe.frozen) stay the target's, as in
    every run, and the file's must equal them (up to the file's 16-bit storage)."""
    from jspec.drafters import family

    path = _init_folder(path)
    fam = family.get_family(family_name)
    found_fam = family.detect(path)
    # A wrapping family (DLoop, D-Loop, DEdit) also starts from a checkpoint of the drafter it wraps: a
    # trained backbone fine-tuned for the wrapper's way of drafting.
    backbone = fam.wraps and found_fam.name == family.family_of(drafter.inner).name
    if found_fam.name != fam.name and not backbone:
        wrapped = f" or of the {family.family_of(drafter.inner).name} drafter it wraps" if fam.wraps else ""
        raise CheckpointError(f"init checkpoint {path!r} is a {found_fam.name} checkpoint ({found_fam.summary}): "
                              f"`jspec train {fam.name} --init` starts from a {fam.name} checkpoint{wrapped}")
    leaves = jax.tree_util.tree_leaves(params)
    dtype = leaves[0].dtype if leaves else jnp.float32
    if backbone:
        found_inner, found = found_fam.load(path, target, dtype)
        found_dr = dataclasses.replace(drafter, inner=found_inner)
    else:
        found_dr, found = fam.load(path, target, dtype)
    problems = config_differences(found_dr, drafter, "drafter", ignore=_DRAFTER_IGNORED)
    problems += tensor_differences(found, params)
    frozen = tuple(fam.recipe.frozen) if fam.recipe is not None else ()
    if not problems:
        problems = [f"tensor {k}: the checkpoint's frozen copy differs from the target's (a drafter made for "
                    "another target)" for k in frozen if k in params and not _same_copy(found[k], params[k])]
    if problems:
        raise _mismatch(f"the run config's {fam.name} drafter", path, problems,
                        "describe the checkpoint's drafter in the run config's drafter section (its depth, block "
                        "size, mask token, target layers, ...) and train it for the target it was made for, or "
                        "start from a checkpoint made for this run config")
    return {**found, **{k: params[k] for k in frozen if k in params}}


def init_tokenizer(path: str):
    """The tokenizer of the init checkpoint of a target run; CheckpointError when it has none (the run
    tokenizes its corpus with the tokenizer of the model it starts from)."""
    from jspec.io.tokenizer import load_tokenizer

    path = _init_folder(path)
    tok = load_tokenizer(path)
    if tok is None:
        raise CheckpointError(f"init checkpoint {path!r} has no tokenizer.json: a target run that starts from a "
                              "model tokenizes its corpus with that model's tokenizer")
    return tok


def init_target_params(path: str, cfg, params: dict) -> dict:
    """The parameters of the HF checkpoint at `path` as the start of a target run whose config gives the
    ModelConfig `cfg` and (random) `params`: every config field (the end-of-text ids aside: the tokenizer's)
    and every tensor must be the run's (CheckpointError naming each that is not); the file's values, bit for
    bit."""
    from jspec.io.models import load_model
    from jspec.models import quant
    from jspec.models.config import ModelConfig

    path = _init_folder(path)
    leaves = jax.tree_util.tree_leaves(params)
    found_cfg, found, _ = load_model(path, leaves[0].dtype if leaves else jnp.float32)
    if not isinstance(found_cfg, ModelConfig) or quant.has_q4(found):
        raise CheckpointError(f"init checkpoint {path!r} is a {'Q4' if quant.has_q4(found) else 'hybrid'} model: "
                              "`jspec train target` trains dense float Llama / Qwen3 models")
    problems = config_differences(found_cfg, cfg, "model", ignore=_TARGET_IGNORED) + tensor_differences(found, params)
    if problems:
        raise _mismatch("the run config's model section", path, problems,
                        "give the checkpoint's settings in the run config's model section, or start from a "
                        "checkpoint of the model it describes")
    return found
