"""Timed intervals of a bench run.

- A generation call: `jspec.generate` on one prompt, timed by its own `stats["wall_s"]`: the compiled
  generation (prefill, drafter set-up, the decode loop) and the copy of its results to the host; input
  packing and validation excluded.
- Its prefill interval: what the compiled loop runs before its first round (the target prefill, which
  also chooses the first new token, and `Drafter.init`), jitted on its own with the same shapes and
  cache rows, up to its result being ready. decode = call - prefill: the rounds.
- The verify pass T(n): one target pass over the anchor and n drafts for one row, inside a compiled
  loop (no dispatch cost, `jspec.decode.profile`); T(0) is one target token step.
- The drafter's round: one `Drafter.propose` and one `Drafter.commit` (the drafter's update from the
  verify pass's taps and hidden states: DFlash's context projection and draft-layer K/V of the verify
  rows) for one row, inside a compiled loop the same way.
Both are `Probe`s: compiled once, then timed once per repeat beside that repeat's generation calls.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.api import pack_prompts
from jspec.decode import ar, profile, spec
from jspec.drafters.base import GREEDY, CommitInfo, DraftContext, Drafter
from jspec.models import target as tm
from jspec.verify.sampling import SamplingParams, first_argmax

# Passes per timed compiled loop: the ~50 us dispatch is under 0.3% of 16 target passes of >= 1 ms (a drafter
# far cheaper than a pass, such as lookup, reads a few microseconds high).
INNER = 16


@functools.lru_cache(maxsize=None)
def loop_setup(cfg, drafter: Drafter | None, dcfg: ar.DecodeConfig):
    """Jitted f(params, dparams, prompts, prompt_len, seeds) -> (loop state, drafter state): what
    `jspec.decode.ar` / `jspec.decode.spec` run before their first round, with the same cache rows (a
    drafter's verify width is allocated as scratch rows) and the drafter's taps. Cached on its static
    arguments, like the loops' own jit, so every method sharing them shares one compile."""
    if drafter is None:
        return jax.jit(lambda params, dparams, prompts, plen, seeds: (
            ar.prefill(params, cfg, dcfg, prompts, plen, seeds)[0], ()))

    @jax.jit
    def setup(params, dparams, prompts, plen, seeds):
        state = spec.start(params, dparams, cfg, drafter, dcfg, prompts, plen, seeds)
        return state.core, state.draft

    return setup


class Runner:
    """One decoding method of the run: plain AR (drafter None) or a prepared (Drafter, params) pair with
    its verifier. All runners share the target, cache size, seeds and `eos_ids=[]` (every call generates
    exactly max_new_tokens, so AR and speculative calls commit the same number of tokens)."""

    def __init__(self, label: str, target, temperature: float, cache_size: int, drafter=None, verifier=None):
        self.label, self.target, self.cache_size = label, target, cache_size
        self.sampling = SamplingParams(temperature)
        self.drafter, self.verifier = drafter, verifier

    def call(self, prompt, max_new_tokens: int, seed: int) -> jspec.GenerateResult:
        kw = dict(max_new_tokens=max_new_tokens, sampling=self.sampling, seeds=[seed], cache_size=self.cache_size,
                  eos_ids=[])
        if self.drafter is None:
            return jspec.generate(self.target, [prompt], **kw)
        return jspec.generate(self.target, [prompt], drafter=self.drafter, verifier=self.verifier, **kw)

    def prefill_seconds(self, prompt, max_new_tokens: int, seed: int) -> float:
        """Wall time of the loop's set-up for `call(prompt, max_new_tokens, seed)` (compiled on first use)."""
        dcfg = ar.DecodeConfig(max_new_tokens=max_new_tokens, cache_size=self.cache_size, sampling=self.sampling)
        setup = loop_setup(self.target.cfg, None if self.drafter is None else self.drafter[0], dcfg)
        packed, lens = pack_prompts([prompt], self.target.cfg.vocab_size)
        args = (jnp.asarray(packed), jnp.asarray(lens), jnp.asarray([seed], jnp.uint32))
        dparams = () if self.drafter is None else self.drafter[1]
        t0 = time.perf_counter()
        jax.block_until_ready(setup(self.target.params, dparams, *args))
        return time.perf_counter() - t0


class Probe:
    """One cost profile of a bench run, compiled once and timed again whenever asked: `seconds()` is one
    timed call of a compiled loop of INNER passes (no dispatch cost), divided by INNER. The bench times
    every probe once per repeat, beside the generation calls of that repeat (`jspec.bench.run`), so the
    costs of a round and the round itself see the same machine load."""

    def __init__(self, run, args):
        self.run, self.args = run, args
        jax.block_until_ready(run(*args))  # compiles

    def seconds(self) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(self.run(*self.args))
        return (time.perf_counter() - t0) / INNER


def verify_probe(target, drafts: int, context: int, cache_size: int) -> Probe:
    """T(drafts): one target pass over the anchor and `drafts` tokens for one row with `context` committed
    rows, in a cache of cache_size + drafts + 1 rows (the rows the speculative loop allocates for that
    width); T(0) is one target token step."""
    return Probe(profile.timed_passes(target.cfg, INNER),
                 profile.verify_pass_args(target.params, target.cfg, 1, drafts, context, cache_size + drafts + 1))


def verify_seconds(target, drafts: int, context: int, cache_size: int, repeats: int) -> float:
    """Median of `repeats` timings of `verify_probe`."""
    probe = verify_probe(target, drafts, context, cache_size)
    return statistics.median(probe.seconds() for _ in range(repeats))


def drafter_probe(target, drafter: Drafter, dparams, context_tokens, cache_size: int,
                  sampling: SamplingParams = SamplingParams(0.0), policy: str = GREEDY) -> Probe:
    """The drafter's work in one round for one row whose committed text is `context_tokens`: one
    `drafter.propose` under `policy` (a rule's draft policy) with the served `sampling`, then one
    `drafter.commit` of a verify pass's worth of taps and hidden states (zeros of the shapes the loop
    passes; the commit's cost does not depend on their values or on how many tokens it keeps).

    The drafter state comes from the loop's own set-up (target prefill with the drafter's taps, then
    `drafter.init`); INNER rounds then run in one compiled loop, each proposal's first draft becoming the
    next call's anchor, so no call is loop-invariant and none is optimised away.
    """
    cfg = target.cfg

    @jax.jit
    def loop(params, dparams, dstate, tokens, length, seeds, taps, hidden):
        rows = jnp.arange(tokens.shape[0])

        def step(_, carry):
            dstate, tokens = carry
            ctx = DraftContext(tokens, length, seeds, params, target_cfg=cfg, policy=policy, sampling=sampling)
            prop, dstate = drafter.propose(dparams, dstate, ctx)
            tokens = tokens.at[rows, length - 1].set(prop.tokens[:, 0])
            dstate = drafter.commit(dparams, dstate, CommitInfo(tokens, length, length + 1, taps, hidden))
            return dstate, tokens

        return jax.lax.fori_loop(0, INNER, step, (dstate, tokens))[1]

    core, dstate, seeds = _loop_start(target, drafter, dparams, context_tokens, cache_size, sampling)
    taps, hidden = _verify_outputs(target, drafter, core)
    return Probe(loop, (target.params, dparams, dstate, core.tokens, core.length, seeds, taps, hidden))


def pair_probe(target, drafter: Drafter, dparams, context_tokens, cache_size: int,
               sampling: SamplingParams = SamplingParams(0.0), policy: str = GREEDY) -> Probe:
    """The drafter's round and the verify pass together, as a round runs them: one `drafter.propose`, the
    target's pass over the anchor and the proposal (a tree as a chain of its width, as `verify_probe`),
    and `drafter.commit` of that pass's own taps and hidden states, INNER times in one compiled loop.

    What it costs beyond `verify_probe` + `drafter_probe` is the pair's contention: timed apart, each
    keeps its own weights in the CPU's caches; in a round they evict each other's. What a round costs
    beyond this probe is the rest of the loop: the rule, sampling, the target's commit, the statistics.
    """
    cfg = target.cfg
    width = drafter.max_depth + 1  # the rows the drafter's commit reads: the anchor and its deepest path

    @jax.jit
    def loop(params, dparams, dstate, cache, tokens, length, seeds):
        rows = jnp.arange(tokens.shape[0])

        def step(_, carry):
            dstate, cache, tokens = carry
            ctx = DraftContext(tokens, length, seeds, params, target_cfg=cfg, policy=policy, sampling=sampling)
            prop, dstate = drafter.propose(dparams, dstate, ctx)
            anchor = tokens[rows, length - 1]
            vt = jnp.concatenate([anchor[:, None], prop.tokens], axis=1)
            positions = length[:, None] - 1 + jnp.arange(vt.shape[1])[None]
            hidden, cache, taps, _ = tm.forward(params, cfg, vt, positions, cache, taps=drafter.taps,
                                                keep_states=True)
            best = first_argmax(tm.logits(params, cfg, hidden))  # every row's logits feed the next anchor
            tokens = tokens.at[rows, length - 1].set(jnp.max(best, axis=1))
            taps = None if taps is None else taps[:, :, :width]
            dstate = drafter.commit(dparams, dstate, CommitInfo(tokens, length, length + 1, taps, hidden[:, :width]))
            return dstate, cache, tokens

        return jax.lax.fori_loop(0, INNER, step, (dstate, cache, tokens))[2]

    core, dstate, seeds = _loop_start(target, drafter, dparams, context_tokens, cache_size, sampling)
    return Probe(loop, (target.params, dparams, dstate, core.cache, core.tokens, core.length, seeds))


def _loop_start(target, drafter: Drafter, dparams, context_tokens, cache_size: int, sampling: SamplingParams):
    """(loop state, drafter state, seeds) of one row whose committed text is `context_tokens`, from the
    speculative loop's own set-up (`loop_setup`: its cache of cache_size rows and the verify width's)."""
    cfg = target.cfg
    packed, lens = pack_prompts([list(context_tokens)], cfg.vocab_size)
    if packed.shape[1] >= cache_size:
        raise ValueError(f"a context of {packed.shape[1]} tokens does not fit the cache of {cache_size} rows")
    setup = loop_setup(cfg, drafter, ar.DecodeConfig(max_new_tokens=1, cache_size=cache_size, sampling=sampling))
    seeds = jnp.zeros((1,), jnp.uint32)
    core, dstate = setup(target.params, dparams, jnp.asarray(packed), jnp.asarray(lens), seeds)
    return core, dstate, seeds


def _verify_outputs(target, drafter: Drafter, core):
    """Zeros shaped as the (taps, hidden) a verify pass hands `drafter.commit` for `core`'s batch: the
    anchor and the drafter's deepest path (taps None for a drafter that reads none)."""
    width = drafter.max_depth + 1
    tokens = jnp.zeros((core.tokens.shape[0], width), jnp.int32)
    out = jax.eval_shape(lambda p, c: tm.forward(p, target.cfg, tokens, tokens, c, taps=drafter.taps),
                         target.params, core.cache)
    hidden, taps = out[0], out[2]
    zeros = lambda a: None if a is None else jnp.zeros(a.shape, a.dtype)
    return zeros(taps), zeros(hidden)


def stream_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Measured device memory bandwidth in bytes/s: one compiled elementwise pass that reads and writes an
    array of `nbytes` in place (2 * nbytes moved), median of repeats; the array is large enough that the
    dispatch cost is a small share."""
    step = jax.jit(lambda x: x + np.float32(1.0), donate_argnums=0)
    x = step(jnp.zeros((max(nbytes // 4, 1024),), jnp.float32))
    x.block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = step(x)
        x.block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * x.size * 4 / statistics.median(times)
