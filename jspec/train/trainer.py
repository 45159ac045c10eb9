"""A small, exact-resume trainer: optax AdamW (warmup + cosine, clipping), orbax checkpoints, JSONL metrics.

The state is (params, opt_state, step); batch i of the run is `dataset[i]` (a random-access grain
MapDataset), so the data position is the step and resuming continues bit for bit. A run directory
records a fingerprint of its configuration; resuming into a directory written by another
configuration is refused.

A run's folder survives crashes: one run at a time holds it (`.lock`, RunFolderBusy for a second one); a
damaged newest checkpoint is moved aside with a warning and the previous one restored; metrics.jsonl
keeps each step once across resumes; a full disk at a checkpoint is one CheckpointWriteError saying
that the previous checkpoint is intact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from jspec.errors import CheckpointError, ConfigError, JspecError
from jspec.io.files import read_json_object
from jspec.train.runfiles import RunFolderBusy, RunLock, atomic_text  # noqa: F401 (RunFolderBusy: raised here)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    clip: float = 1.0
    ckpt_every: int = 200
    keep: int = 2
    log_every: int = 10
    seed: int = 0
    tensorboard: bool = False  # also write the logged scalars to RUN/tensorboard (needs tensorboardX)
    # Drafters: every eval_every steps (0 = never) the greedy tau of the drafter on eval_prompts held-out
    # prompts, from the exact offline evaluator (jspec.train.evaluate), logged as val_tau.
    eval_every: int = 0
    eval_prompts: int = 16

    def __post_init__(self):
        ints = ("steps", "ckpt_every", "keep", "log_every", "seed", "eval_every", "eval_prompts")
        bad = [f"{n}={getattr(self, n)!r} (an integer)" for n in ints
               if isinstance(getattr(self, n), bool) or not isinstance(getattr(self, n), int)]
        bad += [f"{n}={getattr(self, n)!r} (a finite number)" for n in ("lr", "warmup_frac", "weight_decay", "clip")
                if isinstance(getattr(self, n), bool) or not isinstance(getattr(self, n), (int, float))
                or not math.isfinite(getattr(self, n))]
        if not isinstance(self.tensorboard, bool):
            bad.append(f"tensorboard={self.tensorboard!r} (true or false)")
        if bad:
            raise ValueError("bad training config: " + ", ".join(bad))
        if (self.steps < 1 or self.lr <= 0 or not 0 <= self.warmup_frac < 1 or self.clip <= 0 or self.ckpt_every < 1
                or self.keep < 1 or self.log_every < 1 or self.weight_decay < 0 or self.eval_every < 0
                or self.eval_prompts < 1):
            raise ValueError(f"bad training config {self}: need steps, ckpt_every, keep, log_every, eval_prompts >= 1, "
                             "eval_every >= 0, lr > 0, 0 <= warmup_frac < 1, clip > 0, weight_decay >= 0")


# Train settings that change what a run reports, not what it computes: a resume may switch them.
REPORTING_KEYS = ("tensorboard", "log_every", "eval_every", "eval_prompts")


def _settings(fingerprint: dict) -> dict:
    """A run fingerprint without the reporting keys of its config's train section."""
    config = fingerprint.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("train"), dict):
        return fingerprint
    train = {k: v for k, v in config["train"].items() if k not in REPORTING_KEYS}
    return dict(fingerprint, config=dict(config, train=train))


class TrainingDiverged(JspecError, ValueError):
    """The loss or the gradient norm became NaN / inf; the run stopped without saving that state."""


class CheckpointWriteError(JspecError, ValueError):
    """A checkpoint could not be written (the disk is full); the previous checkpoint is intact."""


def _disk_full(err: BaseException) -> bool:
    """Is `err`, or an error it was raised from, "no space left on the device" (orbax and tensorstore wrap
    the OSError, or only keep its text)?"""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(err) or "ENOSPC" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    warmup = max(1, int(tc.warmup_frac * tc.steps))
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, warmup, max(tc.steps, warmup + 1), end_value=0.1 * tc.lr)
    return optax.chain(optax.clip_by_global_norm(tc.clip), optax.adamw(schedule, weight_decay=tc.weight_decay))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array


class Trainer:
    """loss_fn(params, batch) -> (loss, metrics dict of scalars); params is the trainable pytree.

    frozen: a pytree the loss reads but does not train (a frozen target's parameters); with it the loss is
    loss_fn(params, batch, frozen), and it is an argument of the compiled step, not a constant folded into
    the program (a closed-over array would be: a second copy of a large model, and a slow compile).

    lock: the run folder's RunLock when the caller holds it for a whole run (tokenizer, data, training,
    export; see jspec.train.lm); without one the Trainer takes its own lock from its creation to the end
    of `run` (or `close`), and a second Trainer on the folder meanwhile is refused with RunFolderBusy. In
    a run of several processes only process 0 locks the (shared) folder."""

    def __init__(self, loss_fn: Callable, params: Any, tc: TrainConfig, run_dir: str, fingerprint: dict,
                 sharding: Callable[[Any], Any] | None = None, frozen: Any = None, lock: RunLock | None = None):
        self.tc, self.run_dir, self.fingerprint = tc, os.path.abspath(run_dir), fingerprint
        self._own_lock = None
        if lock is None and jax.process_index() == 0:
            self._own_lock = RunLock(self.run_dir).acquire()
        try:
            self._setup(loss_fn, params, tc, sharding, frozen)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the run folder (when this Trainer locked it itself)."""
        if self._own_lock is not None:
            self._own_lock.release()

    def _setup(self, loss_fn, params, tc, sharding, frozen) -> None:
        self.opt = make_optimizer(tc)
        self.state = TrainState(params, self.opt.init(params), jnp.zeros((), jnp.int32))
        self.shard_batch = sharding or (lambda b: b)
        self.frozen = frozen

        def step(state: TrainState, batch, frozen, first_bad):
            """One optimizer step; first_bad: the first step whose loss or gradient was not finite (0: none)."""
            args = (batch,) if frozen is None else (batch, frozen)
            (loss_value, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, *args)
            updates, opt_state = self.opt.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            grad_norm = optax.tree.norm(grads)
            metrics = dict(metrics, loss=loss_value, grad_norm=grad_norm)
            finite = jnp.isfinite(loss_value) & jnp.isfinite(grad_norm)
            first_bad = jnp.where((first_bad == 0) & ~finite, state.step + 1, first_bad)
            return TrainState(params, opt_state, state.step + 1), metrics, first_bad

        self._step = jax.jit(step, donate_argnums=(0,))
        os.makedirs(self.run_dir, exist_ok=True)
        self.manager = ocp.CheckpointManager(
            os.path.join(self.run_dir, "checkpoints"),
            options=ocp.CheckpointManagerOptions(max_to_keep=tc.keep, create=True),
        )
        self._check_fingerprint()

    def _check_fingerprint(self) -> None:
        path = os.path.join(self.run_dir, "run_config.json")
        if os.path.exists(path):
            old = read_json_object(path, error=ConfigError)
            if _settings(old) != _settings(self.fingerprint):
                diff = sorted(k for k in set(old) | set(self.fingerprint) if old.get(k) != self.fingerprint.get(k))
                raise ValueError(
                    f"run directory {self.run_dir!r} was written by another configuration (differs in {diff}): "
                    "use a new --out directory, or the configuration that wrote it")
        else:
            atomic_text(path, json.dumps(self.fingerprint, indent=2, sort_keys=True))

    def restore_latest(self) -> int:
        """Resume from the newest complete checkpoint (half-written steps are not listed); returns its step.

        A checkpoint that cannot be restored (damaged files) is moved aside to <run>/damaged-checkpoints/
        with a warning naming its step and the error, and the one before it is restored instead;
        CheckpointError when none can be."""
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, self.state)
        failures = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                self.state = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
            except Exception as err:  # orbax / tensorstore raise bare Exceptions for damaged files
                if isinstance(err, MemoryError) or "RESOURCE_EXHAUSTED" in str(err):
                    raise  # the checkpoint may be fine: the device is out of memory
                reason = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
                failures.append(f"step {step} ({reason})")
                if jax.process_count() > 1:  # the processes read different shards: they must agree on a step
                    raise CheckpointError(
                        f"checkpoint of step {step} in {self.run_dir!r} cannot be restored ({reason}): move "
                        f"{os.path.join(self.run_dir, 'checkpoints', str(step))} out of the checkpoints folder "
                        "and run again to resume from the previous one") from err
                moved = self._set_aside(step)
                message = (f"checkpoint of step {step} in {self.run_dir!r} cannot be restored ({reason}); "
                           f"it was moved to {moved}; trying the previous checkpoint")
                warnings.warn(message, RuntimeWarning, stacklevel=2)
                continue
            return int(step)
        if failures:
            raise CheckpointError(
                f"no checkpoint of run folder {self.run_dir!r} can be restored: {'; '.join(failures)}; the damaged "
                f"checkpoints were moved to {os.path.join(self.run_dir, 'damaged-checkpoints')}: run again to "
                "start from step 0, or use a new --out folder")
        return 0

    def _set_aside(self, step: int) -> str:
        """Move a damaged checkpoint out of the manager's folder (it would block saving that step again)."""
        src = os.path.join(self.run_dir, "checkpoints", str(step))
        dst_dir = os.path.join(self.run_dir, "damaged-checkpoints")
        os.makedirs(dst_dir, exist_ok=True)
        dst = os.path.join(dst_dir, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        os.replace(src, dst)
        self.manager.reload()
        return dst

    def save(self) -> None:
        """Write the state's checkpoint; a full disk is one CheckpointWriteError naming the run folder, the
        step and the previous checkpoint, which is intact (orbax writes a temporary folder first)."""
        step = int(self.state.step)
        previous = self.manager.latest_step()
        try:
            self.manager.save(step, args=ocp.args.StandardSave(self.state), force=True)
            self.manager.wait_until_finished()
        except Exception as err:
            if not _disk_full(err):
                raise
            kept = (f"the previous checkpoint, step {previous}, is intact" if previous is not None
                    else "no earlier checkpoint exists")
            raise CheckpointWriteError(
                f"no space left on the device of run folder {self.run_dir!r}: the checkpoint of step {step} was "
                f"not written ({kept}); free some space (or lower train.keep) and run the same command again "
                "to resume") from err

    def run(self, dataset, steps: int | None = None, progress: bool = True, metrics_file: str | None = None,
            evaluate: Callable[[Any], dict] | None = None) -> TrainState:
        """Train until `steps` (default: the config's) from wherever the state is; checkpoints on the way.

        A non-finite loss or gradient norm stops the run with TrainingDiverged naming the step; it is
        checked before every checkpoint, so the newest checkpoint always holds a finite state. Lines of
        the metrics file for steps after the state's (logged by an earlier run that stopped before its
        next checkpoint) are dropped first, so every step is logged once.

        evaluate: params -> dict of scalars, called every tc.eval_every steps (and at the end) and logged
        with that step's metrics (e.g. a drafter's validation tau)."""
        end = self.tc.steps if steps is None else steps
        if isinstance(end, bool) or not isinstance(end, int) or end < 1:
            raise ValueError(f"steps must be an integer >= 1 (the step to stop at), got {end!r}")
        if self._own_lock is not None:
            self._own_lock.acquire()  # held since __init__, or again for a second run of this Trainer
        try:
            return self._run(dataset, end, progress, metrics_file, evaluate)
        finally:
            self.close()

    def _run(self, dataset, end: int, progress: bool, metrics_file: str | None, evaluate=None) -> TrainState:
        start = int(self.state.step)
        metrics_file = metrics_file or os.path.join(self.run_dir, "metrics.jsonl")
        board = self._tensorboard()  # before anything is written: a missing tensorboardX stops the run here
        trim_metrics(metrics_file, start)
        bar = tqdm(range(start, end), initial=start, total=end, disable=not progress, desc="train", unit="step")
        # tokens_per_s: the batch tokens of the steps after this process's first one (which compiles the
        # step) over the time since that first step ended; absent until a second step has run.
        t0, tokens, eval_s = None, 0, 0.0
        first_bad = jnp.zeros((), jnp.int32)
        last_saved = self.manager.latest_step()
        with open(metrics_file, "a") as log, contextlib.closing(board) if board is not None else \
                contextlib.nullcontext():
            for i in bar:
                batch = self.shard_batch(jax.tree_util.tree_map(jnp.asarray, dataset[i]))
                self.state, metrics, first_bad = self._step(self.state, batch, self.frozen, first_bad)
                if t0 is None:
                    jax.block_until_ready(metrics)
                    t0 = time.perf_counter()
                else:
                    tokens += int(np.prod(jax.tree_util.tree_leaves(batch)[0].shape))
                step = i + 1
                evaluating = evaluate is not None and self.tc.eval_every and (
                    step % self.tc.eval_every == 0 or step == end)
                if step % self.tc.log_every == 0 or step == end or evaluating:
                    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    m["step"] = step
                    if tokens:
                        m["tokens_per_s"] = tokens / (time.perf_counter() - t0 - eval_s)
                    if evaluating:  # its time is not training time
                        t_eval = time.perf_counter()
                        m.update({k: float(v) for k, v in evaluate(self.state.params).items()})
                        eval_s += time.perf_counter() - t_eval
                    log.write(json.dumps(m) + "\n")
                    log.flush()
                    if board is not None:
                        for k, v in m.items():
                            if k != "step":
                                board.add_scalar(f"train/{k}", v, step)
                        board.flush()
                    bar.set_postfix({k: f"{v:.3g}" for k, v in m.items() if k in ("loss", "acc", "tau", "val_tau")})
                if step % self.tc.ckpt_every == 0 or step == end:
                    bad = int(first_bad)
                    if bad:
                        kept = (f"the newest checkpoint, step {last_saved}, is kept" if last_saved
                                else "no checkpoint was written yet")
                        raise TrainingDiverged(
                            f"training diverged: the loss or gradient became NaN / inf at step {bad} ({kept}): "
                            f"lower lr (now {self.tc.lr:g}), raise warmup_frac or lower clip, then resume or restart")
                    self.save()
                    last_saved = step
        return self.state

    def _tensorboard(self):
        """A tensorboardX SummaryWriter on RUN/tensorboard when the config asks for one (process 0 only)."""
        if not self.tc.tensorboard or jax.process_index() != 0:
            return None
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError("the run config sets \"tensorboard\": true but tensorboardX is not installed: "
                              "pip install 'jspec[tensorboard]' (or set it to false)") from None
        return SummaryWriter(os.path.join(self.run_dir, "tensorboard"))


def trim_metrics(path: str, step: int) -> None:
    """Keep the lines of a metrics file for steps <= `step` (and drop a last line cut short by a crash):
    a resumed run logs the steps after its checkpoint again. Not a regular file (os.devnull): left alone."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = f.read().splitlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line)
    if len(kept) != len(lines):
        logger.info("%s: dropped %d line(s) of steps after step %d (logged again on resume)", path,
                    len(lines) - len(kept), step)
        atomic_text(path, "".join(k + "\n" for k in kept))
