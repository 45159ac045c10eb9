"""A small, exact-resume trainer: optax AdamW (warmup + cosine, clipping), orbax checkpoints, JSONL metrics.

The state is (params, opt_state, step); batch i of the run is `dataset[i]` (a random-access grain
MapDataset), so the data position is the step and resuming continues bit for bit. A run directory
records a fingerprint of its configuration; resuming into a directory written by another
configuration is refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from jspec.errors import JspecError


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

    def __post_init__(self):
        ints = ("steps", "ckpt_every", "keep", "log_every", "seed")
        bad = [f"{n}={getattr(self, n)!r} (an integer)" for n in ints
               if isinstance(getattr(self, n), bool) or not isinstance(getattr(self, n), int)]
        bad += [f"{n}={getattr(self, n)!r} (a finite number)" for n in ("lr", "warmup_frac", "weight_decay", "clip")
                if isinstance(getattr(self, n), bool) or not isinstance(getattr(self, n), (int, float))
                or not math.isfinite(getattr(self, n))]
        if bad:
            raise ValueError("bad training config: " + ", ".join(bad))
        if (self.steps < 1 or self.lr <= 0 or not 0 <= self.warmup_frac < 1 or self.clip <= 0 or self.ckpt_every < 1
                or self.keep < 1 or self.log_every < 1 or self.weight_decay < 0):
            raise ValueError(f"bad training config {self}: need steps, ckpt_every, keep, log_every >= 1, lr > 0, "
                             "0 <= warmup_frac < 1, clip > 0, weight_decay >= 0")


class TrainingDiverged(JspecError, ValueError):
    """The loss or the gradient norm became NaN / inf; the run stopped without saving that state."""


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
    the program (a closed-over array would be: a second copy of a large model, and a slow compile)."""

    def __init__(self, loss_fn: Callable, params: Any, tc: TrainConfig, run_dir: str, fingerprint: dict,
                 sharding: Callable[[Any], Any] | None = None, frozen: Any = None):
        self.tc, self.run_dir, self.fingerprint = tc, os.path.abspath(run_dir), fingerprint
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
            with open(path) as f:
                old = json.load(f)
            if old != self.fingerprint:
                diff = sorted(k for k in set(old) | set(self.fingerprint) if old.get(k) != self.fingerprint.get(k))
                raise ValueError(
                    f"run directory {self.run_dir!r} was written by another configuration (differs in {diff}): "
                    "use a new --out directory, or the configuration that wrote it")
        else:
            with open(path, "w") as f:
                json.dump(self.fingerprint, f, indent=2, sort_keys=True)

    def restore_latest(self) -> int:
        """Resume from the newest complete checkpoint (half-written steps are not listed); returns its step."""
        step = self.manager.latest_step()
        if step is None:
            return 0
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, self.state)
        self.state = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        return int(step)

    def save(self) -> None:
        step = int(self.state.step)
        self.manager.save(step, args=ocp.args.StandardSave(self.state), force=True)
        self.manager.wait_until_finished()

    def run(self, dataset, steps: int | None = None, progress: bool = True, metrics_file: str | None = None) -> TrainState:
        """Train until `steps` (default: the config's) from wherever the state is; checkpoints on the way.

        A non-finite loss or gradient norm stops the run with TrainingDiverged naming the step; it is
        checked before every checkpoint, so the newest checkpoint always holds a finite state."""
        end = self.tc.steps if steps is None else steps
        if isinstance(end, bool) or not isinstance(end, int) or end < 1:
            raise ValueError(f"steps must be an integer >= 1 (the step to stop at), got {end!r}")
        start = int(self.state.step)
        metrics_file = metrics_file or os.path.join(self.run_dir, "metrics.jsonl")
        bar = tqdm(range(start, end), initial=start, total=end, disable=not progress, desc="train", unit="step")
        t0, tokens = time.perf_counter(), 0
        first_bad = jnp.zeros((), jnp.int32)
        last_saved = self.manager.latest_step()
        with open(metrics_file, "a") as log:
            for i in bar:
                batch = self.shard_batch(jax.tree_util.tree_map(jnp.asarray, dataset[i]))
                self.state, metrics, first_bad = self._step(self.state, batch, self.frozen, first_bad)
                tokens += int(np.prod(jax.tree_util.tree_leaves(batch)[0].shape))
                step = i + 1
                if step % self.tc.log_every == 0 or step == end:
                    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    m.update(step=step, tokens_per_s=tokens / (time.perf_counter() - t0))
                    log.write(json.dumps(m) + "\n")
                    log.flush()
                    bar.set_postfix({k: f"{v:.3g}" for k, v in m.items() if k in ("loss", "acc", "tau")})
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
