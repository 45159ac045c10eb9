"""Plain autoregressive decoding in one compiled `lax.while_loop`: the baseline of every speculative path.

The token emitted at absolute index t of a row is
    argmax(served_logp_t + gumbel(seed, t, GUMBEL))
(the argmax itself when greedy), so a row's text depends only on its prompt, its seed and the model,
never on its batch neighbours or on how decoding is split into calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jspec.models import target as tm
from jspec.models.config import ModelConfig
from jspec.verify import noise
from jspec.verify.sampling import SamplingParams, Served, first_argmax, gumbel_argmax, log_softmax_at, served_logprobs


# Cache rows come in multiples of 16 (never read past the text, so they cost nothing but memory): with
# an unaligned row count, XLA:TPU's compact layout of a [B, Hkv, S, Dh] cache is rows-major (no
# padding of S to its 8- or 16-row tile), and a loop whose kernels read it heads-major relays every
# cache at the program's end, a second copy of the caches in temp memory.
CACHE_ROW_ALIGN = 16


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Settings of one generation. The compiled loops take the shapes, EOS and stop ids, kernels, whether
    decoding is greedy, whether there are stop strings (and their table's bucket) and whether commits are
    streamed as static; max_new_tokens, the sampling values (temperature, top-k, top-p) and the stop
    strings' table as traced inputs (`request`), so changing them between calls does not recompile.
    Inside a compiled loop these fields hold the traced values (`with_request`).

    stop_ids: ids that end a row like an EOS (the token is kept). stop_table: None, or the stop strings'
    token table [bucket, vocab] (`jspec.decode.stop.build_table`): a row ends at the first token that
    completes one of them (kept). on_commit: None, or a callable the loop calls on the host (an ordered
    `io_callback`, compiled in only when given) after the prefill and after every round with each row's
    newly committed tokens, list[list[int]] (`RequestJit` calls it and returns once the loop is done)."""

    max_new_tokens: int | jax.Array
    cache_size: int
    sampling: SamplingParams | Served = SamplingParams(temperature=0.0)
    eos_ids: tuple[int, ...] = ()
    scratch_rows: int = 0  # cache rows beyond cache_size for verify passes that reach past the text
    # The target's attention in decode and verify passes: "reference" | "pallas" | "auto"
    # (jspec.models.transformer.forward; hybrid targets always use their reference attention).
    attention: str = "reference"
    stop_ids: tuple[int, ...] = ()
    stop_table: object = None  # host: np.ndarray [bucket, V] | static(): its ShapeDtypeStruct | in the loop: traced
    on_commit: object = None  # host: a callable | static(): True | in the loop: the traced id of its sink

    def __post_init__(self):
        if isinstance(self.max_new_tokens, int) and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def static(self) -> "DecodeConfig":
        """The part a compilation depends on: the request fields set to fixed placeholders (the stop table
        to its shape and dtype, a streaming callable to True)."""
        table = self.stop_table
        return dataclasses.replace(
            self, max_new_tokens=1, sampling=SamplingParams(0.0 if self.sampling.greedy else 1.0),
            stop_table=None if table is None else jax.ShapeDtypeStruct(table.shape, table.dtype),
            on_commit=None if self.on_commit is None else True)

    def request(self, sink: int = 0) -> "Request":
        """The traced values; sink: the id under which the streaming callable is registered (`RequestJit`)."""
        sampling = self.sampling.traced() if isinstance(self.sampling, SamplingParams) else self.sampling
        return Request(np.asarray(self.max_new_tokens, np.int32), sampling,
                       None if self.stop_table is None else np.asarray(self.stop_table),
                       None if self.on_commit is None else np.asarray(sink, np.int32))

    def with_request(self, request: "Request") -> "DecodeConfig":
        return dataclasses.replace(self, max_new_tokens=request.max_new_tokens, sampling=request.sampling,
                                   stop_table=request.stop_table, on_commit=request.sink)

    @property
    def cache_rows(self) -> int:
        """Rows of the target's KV cache: cache_size + scratch_rows rounded up to CACHE_ROW_ALIGN."""
        return -(-(self.cache_size + self.scratch_rows) // CACHE_ROW_ALIGN) * CACHE_ROW_ALIGN


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Request:
    """The per-call settings a compiled loop reads as traced values."""

    max_new_tokens: jax.Array  # [] int32
    sampling: Served
    stop_table: jax.Array | None = None  # [bucket, V] stop-string token table (jspec.decode.stop), if any
    sink: jax.Array | None = None  # [] int32: the registered on_commit callable, when streaming


class RequestJit:
    """A jitted decode loop whose config argument is split into its static part and its traced request
    (`DecodeConfig.static` / `request`): one compilation per shape, drafter, rule and greedy flag, whatever
    max_new_tokens and the sampling values. Called (and `lower`ed) with the loop's documented arguments.

    config_arg: the position of the DecodeConfig (or of a config with one in its `decode` field); the
    jitted function takes the request right after it."""

    def __init__(self, fn: Callable, config_arg: int, static_argnums: tuple[int, ...]):
        self._config_arg = config_arg
        self._jit = jax.jit(fn, static_argnums=static_argnums)

    def _split(self, args, sink: int = 0):
        i = self._config_arg
        config = args[i]
        decode = getattr(config, "decode", config)
        static = decode.static()
        config = dataclasses.replace(config, decode=static) if config is not decode else static
        return (*args[:i], config, decode.request(sink), *args[i + 1:])

    def __call__(self, *args):
        config = args[self._config_arg]
        on_commit = getattr(config, "decode", config).on_commit
        if not callable(on_commit):
            return self._jit(*self._split(args))
        with _streaming(on_commit) as sink:  # the callable is reachable while the loop runs
            return jax.block_until_ready(self._jit(*self._split(args, sink)))

    def lower(self, *args):
        return self._jit.lower(*self._split(args))

    def _cache_size(self) -> int:
        return self._jit._cache_size()


# Streaming: the compiled loop calls one fixed host function with the id of the request's callable, so the
# callable itself is no part of the compiled program (another callable reuses it).
_SINKS: dict[int, list] = {}  # id -> [callable, first exception it raised or None]
_SINK_IDS = itertools.count(1)


@contextlib.contextmanager
def _streaming(on_commit: Callable):
    sink = next(_SINK_IDS) % (2**31 - 1) or 1
    record = _SINKS[sink] = [on_commit, None]
    try:
        yield sink
    except Exception as err:
        if record[1] is not None and record[1] is not err:  # the callable's own error, not the runtime's
            raise record[1] from err
        raise
    finally:
        del _SINKS[sink]


def _deliver(sink, emitted, kept) -> None:
    """Host side of a streamed commit: row r committed emitted[r, :kept[r]]."""
    record = _SINKS.get(int(sink))
    if record is None:  # a program lowered or run without RequestJit's registration
        return
    emitted, kept = np.asarray(emitted), np.asarray(kept)
    try:
        record[0]([emitted[r, : int(kept[r])].tolist() for r in range(emitted.shape[0])])
    except Exception as err:
        record[1] = err
        raise


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ARState:
    """Loop state. tokens/logprobs [B, S]; the token at length-1 is pending (its K/V not yet cached)."""

    tokens: jax.Array
    logprobs: jax.Array
    length: jax.Array  # [B] tokens in the buffer (prompt + generated)
    prompt_len: jax.Array  # [B]
    seeds: jax.Array  # [B]
    done: jax.Array  # [B]
    cache: object  # the target's cache (jspec.models.target.init_cache)
    steps: jax.Array  # [] target forward passes after prefill
    # [B] int32 stop-string automaton state per row (jspec.decode.stop; -1: the row completed a stop string);
    # None without stop strings
    stop_state: jax.Array | None = None


def choose_tokens(logits: jax.Array, seeds: jax.Array, index: jax.Array, sampling: SamplingParams, vocab: int):
    """Token and its reported log-prob for logits [B, V] emitted at absolute indices [B].

    The reported log-prob is under the served distribution; for greedy decoding (a point mass) it is
    the model's own log-softmax, which is the informative number.
    """
    logp = served_logprobs(logits, sampling)
    if sampling.greedy:
        token = first_argmax(logits)
        return token, log_softmax_at(logits.astype(jnp.float32), token)
    token = gumbel_argmax(logp, noise.gumbel(seeds, index, noise.GUMBEL, vocab))
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def _stop_states(table: jax.Array, start: jax.Array, emitted: jax.Array, offered: jax.Array) -> jax.Array:
    """[B, K] stop-automaton state of each row after each offered token of emitted [B, K], from start [B];
    -1 (jspec.decode.stop.STOPPED) at a token that completes a stop string (later entries are unused)."""
    s, out = start, []
    for j in range(emitted.shape[1]):  # K <= drafts + 1: a short, unrolled chain of [B] gathers
        nxt = table[jnp.maximum(s, 0), emitted[:, j]].astype(jnp.int32)
        s = jnp.where(offered[:, j], nxt, s)
        out.append(s)
    return jnp.stack(out, axis=1)


def append_tokens(state: ARState, emitted: jax.Array, logprobs: jax.Array, count: jax.Array, dcfg: DecodeConfig):
    """Append up to `count` [B] tokens of emitted [B, K] per live row, then update the stop flags.

    A row keeps a prefix of its offer: it stops after an EOS or a stop id (kept), after the token that
    completes a stop string (kept), at max_new_tokens, or when its buffer of cache_size tokens is full;
    done rows keep nothing. With on_commit, the host gets each row's kept tokens. Returns (state, kept [B]).
    """
    b, k = emitted.shape
    i = jnp.arange(k)[None, :]
    offered = i < count[:, None]
    end_ids = tuple(dcfg.eos_ids) + tuple(dcfg.stop_ids)
    if end_ids:
        is_eos = jnp.isin(emitted, jnp.asarray(end_ids, jnp.int32)) & offered
        count = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, count)
    else:
        is_eos = jnp.zeros_like(offered)
    if dcfg.stop_table is not None:
        stop_states = _stop_states(dcfg.stop_table, state.stop_state, emitted, offered)
        completes = (stop_states < 0) & offered
        count = jnp.where(jnp.any(completes, axis=1), jnp.minimum(count, jnp.argmax(completes, axis=1) + 1), count)
        is_eos = is_eos | completes
    budget = dcfg.max_new_tokens - (state.length - state.prompt_len)
    room = dcfg.cache_size - state.length
    kept = jnp.where(state.done, 0, jnp.minimum(count, jnp.minimum(budget, room)))
    idx = jnp.where(i < kept[:, None], state.length[:, None] + i, state.tokens.shape[1])  # out of range: dropped
    rows = jnp.arange(b)[:, None]
    tokens = state.tokens.at[rows, idx].set(emitted, mode="drop")
    logps = state.logprobs.at[rows, idx].set(logprobs, mode="drop")
    length = state.length + kept
    hit_eos = jnp.any(is_eos & (i < kept[:, None]), axis=1)
    done = state.done | hit_eos | (length - state.prompt_len >= dcfg.max_new_tokens) | (length >= dcfg.cache_size)
    stop_state = state.stop_state
    if dcfg.stop_table is not None:  # the state after the last kept token (-1 if it completed a stop string)
        last = jnp.take_along_axis(stop_states, jnp.maximum(kept - 1, 0)[:, None], axis=1)[:, 0]
        stop_state = jnp.where(kept > 0, last, stop_state)
    if dcfg.on_commit is not None:
        io_callback(_deliver, None, dcfg.on_commit, emitted, kept, ordered=True)
    return dataclasses.replace(state, tokens=tokens, logprobs=logps, length=length, done=done,
                               stop_state=stop_state), kept


def _emit(state: ARState, token, logprob, dcfg: DecodeConfig) -> ARState:
    """Append one token per live row."""
    one = jnp.ones_like(state.length)
    return append_tokens(state, token[:, None], logprob[:, None], one, dcfg)[0]


def prefill(params, cfg: ModelConfig, dcfg: DecodeConfig, prompts, prompt_len, seeds, taps=()):
    """Cache the prompts (right-padded [B, P]) and choose the first new token of every row.

    Returns (state, taps [n_taps, B, P, D] or None).
    """
    b, p = prompts.shape
    cache = tm.init_cache(cfg, b, dcfg.cache_rows, params["embed"].dtype)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    hidden, cache, tapped, _ = tm.forward(params, cfg, prompts, positions, cache, taps=taps, lengths=prompt_len)
    last = jnp.take_along_axis(hidden, (prompt_len - 1)[:, None, None], axis=1)[:, 0]
    token, logprob = choose_tokens(tm.logits(params, cfg, last), seeds, prompt_len, dcfg.sampling, cfg.vocab_size)
    tokens = jnp.zeros((b, dcfg.cache_size), jnp.int32).at[:, :p].set(prompts)
    state = ARState(
        tokens=tokens, logprobs=jnp.zeros((b, dcfg.cache_size), jnp.float32), length=prompt_len,
        prompt_len=prompt_len, seeds=seeds, done=jnp.zeros((b,), bool), cache=cache,
        steps=jnp.zeros((), jnp.int32),
        stop_state=None if dcfg.stop_table is None else jnp.zeros((b,), jnp.int32),  # the prompt does not count
    )
    return _emit(state, token, logprob, dcfg), tapped


def decode_step(params, cfg: ModelConfig, dcfg: DecodeConfig, state: ARState) -> ARState:
    """One target forward over every row's pending token, then one emitted token per live row."""
    pos = state.length - 1
    pending = jnp.take_along_axis(state.tokens, pos[:, None], axis=1)
    # Finished rows recompute their last K/V row (harmless) but must not advance a recurrent state.
    live = (~state.done).astype(jnp.int32)
    hidden, cache, _, _ = tm.forward(params, cfg, pending, pos[:, None], state.cache, lengths=live,
                                     attention=dcfg.attention)
    token, logprob = choose_tokens(tm.logits(params, cfg, hidden[:, 0]), state.seeds, state.length, dcfg.sampling,
                                   cfg.vocab_size)
    state = dataclasses.replace(state, cache=cache, steps=state.steps + 1)
    return _emit(state, token, logprob, dcfg)


def _generate(params, cfg: ModelConfig, dcfg: DecodeConfig, request: Request, prompts, prompt_len, seeds) -> ARState:
    dcfg = dcfg.with_request(request)
    state, _ = prefill(params, cfg, dcfg, prompts, prompt_len, seeds)
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: decode_step(params, cfg, dcfg, s), state)


generate_ar = RequestJit(_generate, 2, static_argnums=(1, 2))
"""generate_ar(params, cfg, dcfg, prompts [B, P], prompt_len [B], seeds [B]) -> ARState; one compiled call."""

prefill_jit = RequestJit(lambda p, c, d, r, *a: prefill(p, c, d.with_request(r), *a)[0], 2, static_argnums=(1, 2))
_decode_step = jax.jit(lambda p, c, d, r, s: decode_step(p, c, d.with_request(r), s), static_argnums=(1, 2),
                       donate_argnums=(4,))


def decode_step_jit(params, cfg: ModelConfig, dcfg: DecodeConfig, state: ARState) -> ARState:
    """A single step with the state donated: the Python-loop baseline that benchmarks compare against."""
    return _decode_step(params, cfg, dcfg.static(), dcfg.request(), state)
