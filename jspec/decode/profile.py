"""Profiling the verify pass: the cost curve T(n) and the steps-per-second table of the DSpark budget."""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp

from jspec.models import target as tm
from jspec.verify.sampling import first_argmax

INNER = 32  # passes per timed call, inside one compiled loop, so dispatch cost is not counted


def median_seconds(run, args=(), repeats: int = 5, calls: int = 1) -> float:
    """Median wall seconds of `run(*args)` up to its result being ready, over `repeats` timings after
    one untimed call (which compiles), divided by `calls` (the calls one run makes inside its loop)."""
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def verify_pass_seconds(params, cfg, batch: int, drafts: int, context: int, cache_size: int,
                        repeats: int = 5, inner: int = INNER) -> float:
    """Median seconds of one target verify pass over [anchor, `drafts` tokens] per row, `context` rows cached.

    The weights are arguments of the timed program, not constants folded into it (a constant copy of
    a large model costs its size again in memory and makes the compile slow)."""
    return median_seconds(timed_passes(cfg, inner), verify_pass_args(params, cfg, batch, drafts, context, cache_size),
                          repeats, inner)


def verify_pass_args(params, cfg, batch: int, drafts: int, context: int, cache_size: int) -> tuple:
    """The arguments of `timed_passes` for passes over [anchor, `drafts` tokens] per row, `context` rows cached."""
    width = drafts + 1
    cache = tm.init_cache(cfg, batch, cache_size, params["embed"].dtype)
    pos = jnp.broadcast_to(context + jnp.arange(width, dtype=jnp.int32), (batch, width))
    return params, cache, jnp.zeros((batch, width), jnp.int32), pos


@functools.lru_cache(maxsize=None)
def timed_passes(cfg, inner: int = INNER):
    """Jitted f(params, cache, tokens [B, W], positions [B, W]): `inner` verify passes of width W in one loop."""

    def passes(params, cache, tokens, pos):
        def step(_, carry):  # each pass verifies the previous pass's argmax, so nothing is dead code
            cache, tokens = carry
            hidden, cache, _, _ = tm.forward(params, cfg, tokens, pos, cache, keep_states=True)
            return cache, first_argmax(tm.logits(params, cfg, hidden))

        return jax.lax.fori_loop(0, inner, step, (cache, tokens))[1]

    return jax.jit(passes)


def sps_table(seconds_by_drafts: dict[int, float], batch: int, g: int) -> tuple[float, ...]:
    """sps[m], m = 0..batch*g: verify rounds per second with m draft tokens across the batch.

    The compiled verify pass is padded to the widest row, so m tokens cost at least a pass of
    ceil(m / batch) drafts per row, rounded up to the next profiled width (an estimate for batch > 1).
    """
    widths = sorted(seconds_by_drafts)
    table = []
    for m in range(batch * g + 1):
        need = -(-m // batch)
        w = next((w for w in widths if w >= need), widths[-1])
        table.append(1.0 / seconds_by_drafts[w])
    return tuple(table)
