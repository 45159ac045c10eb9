"""Sampling transforms shared by target and drafter: the distribution actually served.

`served_logprobs` turns raw logits into the log-probabilities of the distribution a token is drawn
from after temperature, top-k and top-p. Verification rules compare exactly these p and q.
Removed tokens get -inf. Temperature 0 means greedy: a point mass on the argmax. The top-k and top-p
thresholds are searched for without sorting the vocabulary (they run for target and drafter every
round); `_served_logprobs_sorted` is the sort-based reference they are tested against.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of a request (hashable, checked on construction; `traced()` gives what the
    compiled loops read).

    temperature: 0 = greedy (argmax), > 0 scales logits by 1/temperature.
    top_k: keep the k most likely tokens; 0 = off.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1 = off.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        validate_sampling(self.temperature, self.top_k, self.top_p)
        # numpy scalars become Python numbers: equal requests hash (and compile) alike.
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def traced(self) -> "Served":
        """The same parameters as traced values: host (numpy) scalars, so they also serve compiles for
        devices this process does not have. Static: `greedy`, and whether top-k and top-p are on."""
        sampled = not self.greedy
        return Served(np.asarray(self.temperature if sampled else 1.0, np.float32), np.asarray(self.top_k, np.int32),
                      np.asarray(self.top_p, np.float32), self.greedy, top_k_on=sampled and self.top_k > 0,
                      top_p_on=sampled and self.top_p < 1.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Served:
    """Sampling parameters as the compiled loops read them: temperature, top-k and top-p are traced
    scalars, so one compilation serves every request's values. Static, since they change the program:
    `greedy` (temperature 0: an argmax instead of a draw, and the verification rules that apply), and
    whether the top-k and top-p stages are in the program at all (`top_k_on`, `top_p_on`). A stage that
    is off is not compiled, so a request that never filters pays neither its passes over the
    vocabulary nor their buffers; one that is on still serves the unfiltered distribution for an off
    value at run time (top_k 0 or >= V, top_p 1), so the flags only need to be true whenever the value
    may filter. Build one with `SamplingParams.traced()`, which validates the values and sets
    the flags from them (one compilation per greedy / top-k / top-p combination, at most five)."""

    temperature: jax.Array  # [] float32 > 0 (1 when greedy: unused)
    top_k: jax.Array  # [] int32, 0 = off
    top_p: jax.Array  # [] float32 in (0, 1], 1 = off
    greedy: bool = dataclasses.field(default=False, metadata=dict(static=True))
    top_k_on: bool = dataclasses.field(default=True, kw_only=True, metadata=dict(static=True))
    top_p_on: bool = dataclasses.field(default=True, kw_only=True, metadata=dict(static=True))


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Host-side check of sampling parameters; raises ValueError naming the value, the range and the fix.
    Python and numpy numbers are accepted; bools, inf and NaN are not."""
    if (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not math.isfinite(temperature)
            or temperature < 0):
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), finite (not inf or NaN), got "
                         f"{temperature!r}: pass e.g. 0 for greedy decoding or 0.7 to sample")
    if temperature > 0 and not (_F32.tiny <= temperature <= _F32.max):
        raise ValueError(f"temperature {temperature!r} is outside the float32 range the loops divide by "
                         f"[{_F32.tiny:.3g}, {_F32.max:.3g}]: pass 0 for greedy decoding")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if top_k > np.iinfo(np.int32).max:
        raise ValueError(f"top_k must be below 2**31 (it is an int32), got {top_k}: any k >= the vocabulary size keeps "
                         "every token, so pass 0 (off)")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must lie in (0, 1] (1 = off), got {top_p!r}")
    if top_p < _F32.tiny:
        raise ValueError(f"top_p {top_p!r} is below float32's smallest normal number {_F32.tiny:.3g}, which the "
                         "compiled loops may flush to 0 (then no token would be kept): pass a top_p >= 1.2e-38; any "
                         "top_p below the most likely token's probability keeps only the most likely token(s)")


_F32 = np.finfo(np.float32)


def served_logprobs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Log-probabilities [..., V] (float32) of the served distribution; -inf where removed.

    logits: [..., V], any float dtype (cast to float32); params: a SamplingParams, or a `Served` whose
    temperature / top-k / top-p may be traced (a stage whose flag is off is not traced; one whose flag
    is on and whose value is off at run time passes its input through). Rows are independent.
    Stages, in this order:

    - temperature 0: a point mass on the first argmax (top-k and top-p do not apply);
    - temperature T > 0: logits / T;
    - top-k (0 < k < V): keep every token whose scaled logit is >= the k-th largest one counted
      with multiplicity (ties with it are kept, so more than k tokens may survive);
    - top-p (< 1), on the renormalised distribution p = exp(logp): keep token i iff the mass of the
      tokens strictly more likely than i (p_j > p_i) is < top_p: the smallest set of most likely
      tokens reaching top_p, with the whole tie group at the boundary kept. Never empty. The kept
      tokens' log-probabilities are logp - log(kept mass) (`_renormalise`, shared with the sorted
      reference).

    Nothing sorts the vocabulary: each threshold is found by `_bisect_threshold`, a search over the
    order-preserving int32 image of float32 that settles several bits per pass over the row: top-k's
    threshold is any float (8 passes, each testing 15 candidate thresholds at once), top-p's a
    probability, in [0, 1] (6 passes of 31 candidates; on CPU 10 passes of 7, see `_top_p_cut`).

    Exactness. All comparisons are the float comparisons `x >= t` of the backend, on values whose
    subnormals were flushed to zero first and against thresholds that are never subnormal
    (`flush_subnormals`: backends may flush them in one fused kernel and not in another); the argument
    below only needs a total preorder consistent with <= on floats.
    - top-k: c(t) = #{i : x_i >= t} is a non-increasing integer function of t. Let x_k be the k-th
      largest value. For t comparing equal to x_k, c(t) >= k; for t strictly above x_k only tokens
      strictly above x_k count, and there are fewer than k of them. So the largest float t* with
      c(t*) >= k compares equal to x_k, and `x >= t*` is exactly `x >= lax.top_k(x, k)[0][..., -1:]`:
      integer counting, no rounding anywhere.
    - top-p: m(t) = fl(sum_i p_i [p_i >= t]) over one materialised p = exp(logp), with one reduction
      order for every t, is non-increasing in t (a float sum of non-negative terms is monotone in each
      term). For the largest t* with m(t*) >= top_p, token i is kept iff p_i >= t* iff m(t) < top_p
      for the smallest float t above p_i, and that m(t) is the mass of the tokens strictly more likely
      than i: the rule above, decided per value, so ties stay together. m(above the max) = 0 < top_p,
      so the most likely tokens are always kept and t* <= max p <= 1; if rounding leaves even the
      full mass below top_p, no t >= 0 qualifies and the search returns 0, whose mask p >= 0 keeps
      every token (as the sorted rule does): the search need only cover [0, 1]. In exact arithmetic
      this is the sort-and-cumsum rule token for token. In float32 the two sums differ in rounding,
      so they can disagree only on a boundary tie group whose strictly greater mass lies within
      summation rounding (at most about V * 2**-24) of top_p, where the sorted rule's own answer
      depends on how the backend lowers cumsum. The search and the kept mass read p alone: one read
      of the row per pass.
    - Under jit, XLA may recompute an elementwise producer (log_softmax, exp) inside each consumer
      fusion with different rounding, and a threshold taken from one copy then compared with
      another can keep nothing. `lax.optimization_barrier` pins the scaled logits (top-k) and p
      (top-p) to single buffers that the search and the final mask both read. logp itself is not
      pinned: it only feeds p and the kept tokens' output values, and a fusion that recomputes it
      changes no kept set (on an H200, Qwen3-8B chain at batch 8 / 4k, top-p: a write and a read of
      the [B, g+1, V] rows less, 0.27 GB a round).
    """
    if isinstance(params, SamplingParams):
        params = params.traced()
    logits = jnp.asarray(logits, jnp.float32)
    vocab = logits.shape[-1]
    if params.greedy:
        return jnp.where(jnp.arange(vocab) == first_argmax(logits)[..., None], 0.0, -jnp.inf)
    logits = flush_subnormals(logits / params.temperature)
    if params.top_k_on:
        logits = _keep_top_k(logits, params.top_k)
    logp = log_softmax(logits)
    if params.top_p_on:
        logp = _keep_top_p(logp, params.top_p)
    return logp


# A stage that is compiled in always runs its search, and a value that is off at run time selects
# the stage's input, unchanged, as its output. No `lax.cond`: a conditional's branches are separate
# computations, whose operand and result buffers XLA keeps apart (one more vocabulary-sized buffer
# live per stage) and whose boundary no fusion crosses; only a hand-built `Served` with a flag on
# and its value off pays the search for nothing.
def _keep_top_k(logits: jax.Array, k: jax.Array) -> jax.Array:
    logits = jax.lax.optimization_barrier(logits)
    on = (k > 0) & (k < logits.shape[-1])
    return jnp.where(on, jnp.where(logits >= _kth_largest(logits, k), logits, -jnp.inf), logits)


def _keep_top_p(logp: jax.Array, top_p: jax.Array) -> jax.Array:
    probs = jax.lax.optimization_barrier(flush_subnormals(jnp.exp(logp)))
    return jnp.where(top_p < 1.0, _renormalise(logp, probs, probs >= _top_p_cut(probs, top_p)), logp)


def _renormalise(logp: jax.Array, probs: jax.Array, keep: jax.Array) -> jax.Array:
    """log-probabilities of logp's distribution restricted to `keep` (never empty): logp - log(kept mass),
    -inf elsewhere, with the kept mass summed from probs (at least top_p, so the shift is well conditioned)."""
    kept_mass = jnp.sum(jnp.where(keep, probs, 0.0), axis=-1, keepdims=True)
    return jnp.where(keep, logp - jnp.log(kept_mass), -jnp.inf)


# Jitted so that eager calls reuse one compiled search per shape instead of tracing the loop again;
# under an outer jit they are inlined.
@jax.jit
def _kth_largest(x: jax.Array, k: jax.Array) -> jax.Array:
    """[..., 1] float32: the k-th largest entry (with multiplicity) of x [..., V], up to values that
    compare equal; 0 < k < V."""
    return _bisect_threshold(lambda t: jnp.sum(x[..., None, :] >= t, axis=-1, keepdims=True) >= k,
                             x.shape[:-1] + (1,))


@jax.jit
def _top_p_cut(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """[..., 1] float32: the largest t with sum(probs[probs >= t]) >= top_p, or 0 if none (whose mask
    probs >= 0 keeps every token, as the rule does then); probs [..., V] in [0, 1], materialised by the
    caller, subnormals flushed: each pass of the search reads it alone. The answer lies in [0, 1], so
    the search runs over non-negative floats (`nonnegative=True`: 30 bits of key). Bits per pass: 5 on
    GPU and TPU, which read the row from device memory once per pass (6 passes of 31 candidates, 2
    passes fewer than a search over every float); 3 on CPU, where testing the candidates against
    each entry costs more than reading the row (10 passes of 7: 70 tests per entry instead of 186)."""
    top_p = jnp.asarray(top_p, jnp.float32)

    def search(digit_bits: int):
        return lambda probs, top_p: _bisect_threshold(
            lambda t: jnp.sum(jnp.where(probs[..., None, :] >= t, probs[..., None, :], 0.0), axis=-1, keepdims=True)
            >= top_p, probs.shape[:-1] + (1,), nonnegative=True, digit_bits=digit_bits)

    return jax.lax.platform_dependent(probs, top_p, cpu=search(3), default=search(5))


# int32 images (see _key_to_float) of -inf and +inf; the search never leaves this range, so it
# never builds a NaN threshold (every comparison with NaN is false, which would break monotonicity).
_KEY_NEG_INF = -0x7F800000
_KEY_POS_INF = 0x7F800000


_KEY_TINY = 0x00800000  # key of the smallest normal float32


def flush_subnormals(x: jax.Array) -> jax.Array:
    """x with subnormal entries set to 0. Backends may flush subnormals in some fused kernels and not
    in others (XLA:CPU did, under jit: a top-p search settled on a subnormal threshold that the final
    mask then compared exactly, keeping nothing), so thresholds are searched and applied on flushed
    values only, and `_bisect_threshold` never proposes a subnormal threshold.

    x: float32. Integer arithmetic on the bits, no comparison: `where(|x| < tiny, 0, x)` gives the same
    values (-0.0 and subnormals become +0.0; inf and NaN stay), but XLA:GPU wrote its boolean mask out
    once and read it again in every fusion over the row, where these three integer ops fuse into each
    (H200, Qwen3-8B chain at batch 8 / 4k, top-p: 32.18 -> 31.88 GB a round)."""
    if x.dtype != jnp.float32:
        raise TypeError(f"flush_subnormals takes float32, got {x.dtype}: cast first")
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    normal = jnp.minimum(bits & 0x7F800000, 1)  # 1 where the exponent field is not 0, else 0
    return jax.lax.bitcast_convert_type(bits * normal, jnp.float32)


def _key_to_float(key: jax.Array) -> jax.Array:
    """float32 [...] whose order is the order of int32 key [...] in [_KEY_NEG_INF, _KEY_POS_INF].

    key >= 0 is the bit pattern of a non-negative float; key < 0 is minus the magnitude bits of a
    negative float (so -0.0 has no key of its own: it equals +0.0).
    """
    key = jnp.clip(key, _KEY_NEG_INF, _KEY_POS_INF)
    key = jnp.where(jnp.abs(key) < _KEY_TINY, 0, key)  # subnormal magnitudes are 0 (see flush_subnormals)
    bits = jnp.where(key < 0, (-key) | jnp.int32(-0x80000000), key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


# (key bits searched, offset added to a key to order it unsigned)
_ANY_FLOAT = (32, 0x80000000)  # every float32 key, offset binary
_NONNEGATIVE = (30, 0)  # keys of floats in [0, 2): the integers below 2**30


def _bisect_threshold(pred, shape: tuple[int, ...], *, nonnegative: bool = False, digit_bits: int = 4) -> jax.Array:
    """Largest float32 t in [-inf, +inf] with pred(t), per row ([*shape], last axis 1); -inf if pred
    holds nowhere.

    pred: float32 [*shape[:-1], n, 1] (n candidate thresholds per row) -> bool of the same shape,
    non-increasing in t (pred(t) and s <= t imply pred(s)); each candidate is decided on its own.
    The int32 key of the answer is built digit by digit from the top in offset binary (u = key +
    2**31, which orders like key), digit_bits (default 4) per step: with the higher digits final, the
    15 candidates that set the next digit to 1..15 (lower bits 0) increase with the digit, so by
    monotonicity pred holds for a prefix of them, and the answer's digit is the length of that prefix.
    8 calls of pred, each one pass over the row for all 15 candidates (a pass per bit would read the
    row 32 times).

    nonnegative=True: the caller knows the answer is a float in [0, 2) or that pred(0) is false (then
    0 is returned, not -inf). Those keys are the integers below 2**30 themselves (u = key), so the
    search settles 30 bits. digit_bits (dividing the bits searched) sets the bits per step: 2**digit_bits
    - 1 candidates per call of pred, key bits / digit_bits calls.
    """
    key_bits, offset = _NONNEGATIVE if nonnegative else _ANY_FLOAT
    if key_bits % digit_bits:
        raise ValueError(f"digit_bits {digit_bits} does not divide the {key_bits} key bits searched")
    digits = jnp.arange(1, 1 << digit_bits, dtype=jnp.uint32)[:, None]  # [2**digit_bits - 1, 1]

    def step(i, u):
        shift = (key_bits - digit_bits * (i + 1)).astype(jnp.uint32)
        trial = u[..., None, :] | jax.lax.shift_left(digits, shift)  # [*shape[:-1], candidates, 1]
        held = pred(_key_to_float(_unsigned_to_key(trial, offset)))
        return u | jax.lax.shift_left(jnp.sum(held, axis=-2, dtype=jnp.uint32), shift)

    u = jax.lax.fori_loop(0, key_bits // digit_bits, step, jnp.zeros(shape, jnp.uint32))
    return _key_to_float(_unsigned_to_key(u, offset))


def _unsigned_to_key(u: jax.Array, offset: int) -> jax.Array:
    return jax.lax.bitcast_convert_type(u ^ jnp.uint32(offset), jnp.int32)


def _served_logprobs_sorted(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Sort-based reference for `served_logprobs` (same contract): top-k through `lax.top_k`, top-p
    through a full-vocabulary sort and cumsum. Kept for tests and benchmarks only."""
    logits = jnp.asarray(logits, jnp.float32)
    vocab = logits.shape[-1]
    if params.greedy:
        best = jnp.argmax(logits, axis=-1)
        return jnp.where(jax.nn.one_hot(best, vocab, dtype=jnp.bool_), 0.0, -jnp.inf)
    logits = flush_subnormals(logits / params.temperature)
    if 0 < params.top_k < vocab:
        kth = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    logp = log_softmax(logits)
    if params.top_p < 1.0:
        # Comparisons happen in sorted order and map back by index, so no recomputed copy of the
        # probabilities is ever compared with a threshold taken from the sorted one.
        probs = flush_subnormals(jnp.exp(logp))
        index = jnp.broadcast_to(jnp.arange(vocab), logp.shape)
        neg_sorted, order = jax.lax.sort_key_val(-probs, index, dimension=-1)
        probs_sorted = -neg_sorted
        mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
        keep_sorted = mass_before < params.top_p
        threshold = jnp.min(jnp.where(keep_sorted, probs_sorted, jnp.inf), axis=-1, keepdims=True)
        keep_sorted = probs_sorted >= threshold
        keep = jax.lax.sort_key_val(order, keep_sorted, dimension=-1)[1]
        logp = _renormalise(logp, probs, keep)
    return logp


def first_argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis, as int32: the first index of the maximum (of the first NaN, if any).

    Every per-round vocabulary argmax (greedy tokens, Gumbel-max draws, greedy drafts) goes through
    it. On XLA:CPU it is a max, then a min over the matching indices: two reductions that vectorise,
    where jnp.argmax's variadic (value, index) reduction is 5-9x slower (V = 4k-32k). On GPU it is
    jnp.argmax itself: one pass that reads x once, fused with whatever computes x (Gumbel noise added
    to a draft's log-probabilities), where the two reductions materialise x and read it twice (H200,
    Qwen3-8B chain at batch 8 / 4k, top-p: 32.68 -> 32.45 GB a round). XLA:TPU keeps the two
    reductions: its variadic reduction of the same draw moved 0.07 GB less a round but needed 0.15 GB
    more temp memory (v5p, same row).
    """
    return jax.lax.platform_dependent(x, cpu=_first_argmax_two_passes, tpu=_first_argmax_two_passes,
                                      default=lambda v: jnp.argmax(v, axis=-1).astype(jnp.int32))


def log_softmax(x: jax.Array) -> jax.Array:
    """jax.nn.log_softmax over the last axis of x [..., V]: x - max - log(sum(exp(x - max))).

    Every per-round vocabulary log-softmax of a served distribution (and of DFlash's tree building)
    goes through it. On GPU the maximum and the sum come from one reduction
    (`_log_softmax_stats_one_pass`: a running maximum and a sum rescaled to it), one read of the row
    where jax.nn.log_softmax's max and sum are two (H200, Qwen3-8B tree of 32 nodes at batch 8 / 4k,
    top-p: 32.18 -> 31.95 GB a round). XLA:CPU's variadic reductions are several times slower than
    two plain ones (see `first_argmax`), and XLA:TPU moved the same bytes either way (v5p chain at
    batch 1 / 4k, top-p: 19.467 GB), so both keep jax.nn.log_softmax. The two differ only in the
    rounding of the sum.
    """
    return jax.lax.platform_dependent(x, cpu=_log_softmax_two_passes, tpu=_log_softmax_two_passes,
                                      default=_log_softmax_one_pass)


def _log_softmax_two_passes(x: jax.Array) -> jax.Array:
    return jax.nn.log_softmax(x, axis=-1)


def _log_softmax_one_pass(x: jax.Array) -> jax.Array:
    top, total = _log_softmax_stats_one_pass(x)
    shifted = x - top[..., None]
    return shifted - jnp.log(total)[..., None]


def _log_softmax_stats_one_pass(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(max, sum(exp(x - max))) over the last axis in one variadic reduction: each element enters as
    (x_i, 1); two partial results (m_a, s_a), (m_b, s_b) combine to (m, s_a e^(m_a - m) + s_b e^(m_b - m))
    with m = max(m_a, m_b), a part whose maximum is m keeping its sum as it is (so -inf parts, whose
    sum is 0, never make -inf - -inf)."""
    def combine(a, b):
        (m_a, s_a), (m_b, s_b) = a, b
        m = jnp.maximum(m_a, m_b)
        rescale = lambda m_i, s_i: jnp.where(m_i == m, s_i, s_i * jnp.exp(m_i - m))
        return m, rescale(m_a, s_a) + rescale(m_b, s_b)

    init = (np.array(-np.inf, x.dtype), np.array(0, x.dtype))
    return jax.lax.reduce((x, jnp.ones_like(x)), init, combine, (x.ndim - 1,))


def _first_argmax_two_passes(x: jax.Array) -> jax.Array:
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    hit = (x == top) | jnp.isnan(x)  # the max propagates NaN: then the first NaN, as jnp.argmax
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1).astype(jnp.int32)


def log_softmax_at(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """jax.nn.log_softmax(logits)[..., tokens] by its own arithmetic (the same bits), without a
    vocabulary-sized buffer per verify row: what `logprobs` reports under greedy decoding (the served
    distribution is a point mass; the model's own log-prob is the informative number)."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    shifted = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0] - top[..., 0]
    return shifted - jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1))


def gumbel_argmax(logp: jax.Array, noise: jax.Array) -> jax.Array:
    """Gumbel-max draw argmax(logp + noise) over the last axis; exact sample from softmax(logp).

    Greedy (a point mass) ignores the noise automatically since other entries are -inf.
    """
    return first_argmax(logp + noise)
