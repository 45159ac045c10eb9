"""Chain verification rules: pure, jittable, vmappable over batch rows, static shapes.

Conventions (one row; the decode loop vmaps):
- target_logp [g+1, V]: log-probs of the *served* target distribution (after `served_logprobs`;
  -inf marks removed tokens) after the anchor (row 0) and after each draft token (row i+1).
- draft [g] int32: draft token i is written at absolute index pos0 + i.
- draft_logp [g, V]: log-probs of the served proposal distribution that produced draft token i.
- seed, pos0: int32 scalars. Every random draw for the token at absolute index t is keyed by
  (seed, t, purpose) via `noise`, never by round or batch slot.
- length (optional int32 scalar, default g): verify only the first `length` drafts (a per-row verify
  budget); the rest are ignored exactly as if they had not been drafted.
- Result: `ChainResult(n, token)`: n accepted drafts in [0, length]; `token` is the correction
  (n < length) or bonus (n == length), written at pos0 + n.

Each sampling rule is split into a deterministic part that takes explicit coins
(`*_from_coins`, returning the coin thresholds and the distribution the emitted token is drawn from)
and a thin keyed sampler around it. The coin form is what the exactness tests integrate analytically.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec.verify import noise
from jspec.verify.sampling import first_argmax
from jspec.verify.validate import check_chain_inputs, check_concrete_chain

NEG_INF = -jnp.inf


class ChainResult(NamedTuple):
    """Outcome of verifying one chain: n accepted drafts, then `token` written at pos0 + n."""

    n: jax.Array  # int32[]
    token: jax.Array  # int32[]


class CoinOutcome(NamedTuple):
    """A sampling rule evaluated on explicit coins.

    Coin i passes iff coins[i] < threshold[i] (so threshold[i] is the probability that a uniform coin
    passes, given the outcomes of the coins read before it); the emitted token is a draw from
    softmax(token_logp).
    """

    n: jax.Array  # int32[]
    token_logp: jax.Array  # float32[V]
    threshold: jax.Array  # float32[g]


# ---------------------------------------------------------------------------------------------
# Shared numerics (log space; no NaN for -inf entries, q(x) = 0 or p == q).


def log_ratio(logp_x: jax.Array, logq_x: jax.Array) -> jax.Array:
    """log(p(x) / q(x)) with p = 0 -> -inf and q = 0 < p -> +inf (never NaN)."""
    safe_q = jnp.where(jnp.isneginf(logq_x), 0.0, logq_x)
    ratio = jnp.where(jnp.isneginf(logq_x), jnp.inf, logp_x - safe_q)
    return jnp.where(jnp.isneginf(logp_x), NEG_INF, ratio)


def acceptance_probability(logp_x: jax.Array, logq_x: jax.Array) -> jax.Array:
    """min(1, p(x) / q(x)) in float32."""
    return jnp.exp(jnp.minimum(log_ratio(logp_x, logq_x), 0.0))


def residual_unnormalized(logp: jax.Array, logq: jax.Array, log_w: jax.Array | float = 0.0) -> jax.Array:
    """log((w * p - q)+) over the last axis; -inf where the residual is zero."""
    a = log_w + logp
    keep = logq < a
    # -expm1 keeps 1 - q / (w p) accurate when q is close to w p.
    d = jnp.where(keep, logq - jnp.where(keep, a, 0.0), NEG_INF)
    return jnp.where(keep, a + jnp.log(-jnp.expm1(d)), NEG_INF)


def normalize_or(log_r: jax.Array, fallback: jax.Array) -> jax.Array:
    """Normalise log-weights over the last axis; rows with zero total mass become `fallback`.

    A zero residual only happens when its rule rejects with probability 0 (e.g. p == q), so the
    fallback is never sampled in exact arithmetic; it keeps the output finite.
    """
    total = jax.nn.logsumexp(log_r, axis=-1, keepdims=True)
    empty = jnp.isneginf(total)
    return jnp.where(empty, fallback, log_r - jnp.where(empty, 0.0, total))


def residual_logp(logp: jax.Array, logq: jax.Array, log_w: jax.Array | float = 0.0) -> jax.Array:
    """log norm((w p - q)+), or logp itself when the residual is empty."""
    return normalize_or(residual_unnormalized(logp, logq, log_w), logp)


def _length(length, g: int) -> jax.Array:
    if length is None:
        return jnp.int32(g)
    return jnp.clip(jnp.asarray(length, jnp.int32), 0, g)


def _first_false(ok: jax.Array) -> jax.Array:
    """Index of the first False in a bool vector, or its length when all are True."""
    return jnp.argmin(jnp.concatenate([ok, jnp.zeros((1,), bool)])).astype(jnp.int32)


def _draft_rows(target_logp, draft, draft_logp):
    idx = jnp.arange(draft.shape[0])
    safe = jnp.clip(draft, 0, target_logp.shape[-1] - 1)
    return target_logp[idx, safe], draft_logp[idx, safe]


def _emit(token_logp: jax.Array, seed, position) -> jax.Array:
    """Sample the emitted token at an absolute position from softmax(token_logp) with keyed noise."""
    vocab = token_logp.shape[-1]
    return first_argmax(token_logp + noise.gumbel(seed, jnp.asarray(position, jnp.int32), noise.RESIDUAL, vocab))


# ---------------------------------------------------------------------------------------------
# Deterministic rules.


def _match_prefix(choice: jax.Array, draft: jax.Array, length) -> ChainResult:
    g = draft.shape[0]
    limit = _length(length, g)
    ok = (draft == choice[:g]) & (jnp.arange(g) < limit)
    n = _first_false(ok)
    return ChainResult(n, choice[n].astype(jnp.int32))


@jax.jit
def _greedy_chain(target_logp, draft, length):
    return _match_prefix(first_argmax(target_logp), draft, length)


def greedy_chain(target_logp: jax.Array, draft: jax.Array, *, length=None) -> ChainResult:
    """Greedy matching: longest prefix with draft == target argmax, then the target's argmax.

    target_logp [g+1, V], draft [g] -> ChainResult. Ties go to the lowest token id (jnp.argmax), the
    same as the plain greedy decoder.
    """
    check_chain_inputs(target_logp, draft, length=length)
    check_concrete_chain(target_logp, draft, None)
    return _greedy_chain(target_logp, draft, length)


@jax.jit
def _gumbel_chain(target_logp, draft, seed, pos0, length):
    g, vocab = draft.shape[0], target_logp.shape[-1]
    positions = jnp.asarray(pos0, jnp.int32) + jnp.arange(g + 1, dtype=jnp.int32)
    # Same value as gumbel_argmax(target_logp, noise): logp + noise is never NaN, so first_argmax
    # picks the same first maximum.
    choice = first_argmax(target_logp + noise.gumbel(seed, positions, noise.GUMBEL, vocab))
    return _match_prefix(choice, draft, length)


def gumbel_chain(target_logp: jax.Array, draft: jax.Array, seed, pos0, *, length=None) -> ChainResult:
    """Gumbel coupling (Daliri et al. 2024): accept while the draft equals the target's Gumbel-max.

    target_logp [g+1, V], draft [g]. The target's choice at index t is
    gumbel_argmax(target_logp[t - pos0], noise.gumbel(seed, t, GUMBEL, V)), exactly the plain
    autoregressive sampler's draw, so the committed text is the target's own sample for that seed
    whatever the drafter proposed. A coupled drafter proposes its own Gumbel-max with the same noise.
    """
    check_chain_inputs(target_logp, draft, seed=seed, pos0=pos0, length=length)
    check_concrete_chain(target_logp, draft, None)
    return _gumbel_chain(target_logp, draft, seed, pos0, length)


# ---------------------------------------------------------------------------------------------
# Token-wise speculative sampling (Leviathan et al. 2023; Chen et al. 2023).


@jax.jit
def speculative_chain_from_coins(target_logp, draft, draft_logp, coins, length=None) -> CoinOutcome:
    """Token-wise speculative sampling on explicit coins [g] (uniform in [0, 1)).

    Draft i is accepted iff coins[i] < min(1, p_i(x_i) / q_i(x_i)); n = first rejection. The emitted
    token is drawn from norm((p_n - q_n)+) after a rejection, from p_n when all `length` drafts pass.
    """
    g = draft.shape[0]
    limit = _length(length, g)
    if g == 0:
        return CoinOutcome(jnp.int32(0), target_logp[0], jnp.zeros((0,), jnp.float32))
    lp, lq = _draft_rows(target_logp, draft, draft_logp)
    live = jnp.arange(g) < limit
    threshold = jnp.where(live, acceptance_probability(lp, lq), 0.0)
    n = _first_false(live & (coins < threshold))
    row_p = target_logp[n]
    row_q = draft_logp[jnp.minimum(n, g - 1)]
    token_logp = jnp.where(n >= limit, row_p, residual_logp(row_p, row_q))
    return CoinOutcome(n, token_logp, threshold)


@jax.jit
def _speculative_chain(target_logp, draft, draft_logp, seed, pos0, length):
    g = draft.shape[0]
    pos0 = jnp.asarray(pos0, jnp.int32)
    coins = noise.uniform(seed, pos0 + jnp.arange(g, dtype=jnp.int32), noise.ACCEPT)
    out = speculative_chain_from_coins(target_logp, draft, draft_logp, coins, length)
    return ChainResult(out.n, _emit(out.token_logp, seed, pos0 + out.n))


def speculative_chain(target_logp, draft, draft_logp, seed, pos0, *, length=None) -> ChainResult:
    """Token-wise speculative sampling with keyed coins; exact for drafts drawn from draft_logp.

    target_logp [g+1, V], draft [g], draft_logp [g, V]. Coin for draft i: noise.uniform(seed, pos0 + i,
    ACCEPT); the emitted token at pos0 + n uses noise.gumbel(seed, pos0 + n, RESIDUAL). Coins past the
    first rejection are never read, so a later round may use those positions afresh.
    """
    check_chain_inputs(target_logp, draft, draft_logp, seed, pos0, length)
    check_concrete_chain(target_logp, draft, draft_logp)
    return _speculative_chain(target_logp, draft, draft_logp, seed, pos0, length)


# ---------------------------------------------------------------------------------------------
# Block verification (Sun et al. 2024).


def block_weights(target_logp, draft, draft_logp) -> jax.Array:
    """log w_k for k = 0..g: w_0 = 1, w_k = min(1, w_{k-1} p_k(x_k) / q_k(x_k)); shape [g+1]."""
    lp, lq = _draft_rows(target_logp, draft, draft_logp)
    ratios = log_ratio(lp, lq)

    def step(log_w, r):
        dead = jnp.isneginf(log_w) | jnp.isneginf(r)
        nxt = jnp.where(dead, NEG_INF, jnp.minimum(0.0, jnp.where(dead, 0.0, log_w) + jnp.where(dead, 0.0, r)))
        return nxt, nxt

    _, log_w = jax.lax.scan(step, jnp.float32(0.0), ratios)
    return jnp.concatenate([jnp.zeros((1,), jnp.float32), log_w])


@jax.jit
def block_chain_from_coins(target_logp, draft, draft_logp, coins, length=None) -> CoinOutcome:
    """Block verification on explicit coins [g]; coin i belongs to the prefix of length k = i + 1.

    With w_k the running weight and rows p_k, q_k the distributions after the first k drafts
    (target_logp[k], draft_logp[k]):
      h_k = S_k / (S_k + 1 - w_k) with S_k = sum_x (w_k p_k(x) - q_k(x))+  for k < length,
      h_length = w_length.
    The accepted length n is the longest prefix k whose coin passes (coins[k-1] < h_k), 0 if none.
    The emitted token is drawn from p_n when n == length, else from norm((w_n p_n - q_n)+).
    When S_k + 1 - w_k == 0 (w_k = 1 and p_k == q_k), h_k is set to 1: then w_{k+1} = 1 too and a
    longer prefix always survives, so the value never decides the outcome.
    """
    g = draft.shape[0]
    limit = _length(length, g)
    if g == 0:
        return CoinOutcome(jnp.int32(0), target_logp[0], jnp.zeros((0,), jnp.float32))
    log_w = block_weights(target_logp, draft, draft_logp)  # [g+1]
    k = jnp.arange(1, g + 1)
    w = jnp.exp(log_w[1:])
    if g > 1:
        # Residual mass after each proper prefix k = 1..g-1, in probability space (absolute mass).
        mass = jnp.sum(jnp.maximum(w[:-1, None] * jnp.exp(target_logp[1:g]) - jnp.exp(draft_logp[1:g]), 0.0), -1)
        mass = jnp.concatenate([mass, jnp.zeros((1,), jnp.float32)])
    else:
        mass = jnp.zeros((1,), jnp.float32)
    denom = mass + (-jnp.expm1(log_w[1:]))
    h_mid = jnp.where(denom > 0, mass / jnp.where(denom > 0, denom, 1.0), 1.0)
    threshold = jnp.where(k < limit, h_mid, jnp.where(k == limit, w, 0.0))
    passed = (coins < threshold) & (k <= limit)
    n = jnp.max(jnp.where(passed, k, 0)).astype(jnp.int32)
    row_p = target_logp[n]
    row_q = draft_logp[jnp.minimum(n, g - 1)]
    token_logp = jnp.where(n >= limit, row_p, residual_logp(row_p, row_q, log_w[n]))
    return CoinOutcome(n, token_logp, threshold)


def block_coins(seed, pos0, g: int) -> jax.Array:
    """Coins [g] of block verification: draft i uses (seed, pos0 + i, BLOCK_ACCEPT) folded by i.

    Block verification reads coins past its accepted prefix; folding in the offset from the round
    start makes every round's coins fresh, so a later round never reuses a coin already conditioned on.
    """
    offsets = jnp.arange(g, dtype=jnp.int32)
    positions = jnp.asarray(pos0, jnp.int32) + offsets
    return jax.vmap(lambda t, i: noise.indexed_uniform(seed, t, noise.BLOCK_ACCEPT, i))(positions, offsets)


@jax.jit
def _block_chain(target_logp, draft, draft_logp, seed, pos0, length):
    pos0 = jnp.asarray(pos0, jnp.int32)
    out = block_chain_from_coins(target_logp, draft, draft_logp, block_coins(seed, pos0, draft.shape[0]), length)
    return ChainResult(out.n, _emit(out.token_logp, seed, pos0 + out.n))


def block_chain(target_logp, draft, draft_logp, seed, pos0, *, length=None) -> ChainResult:
    """Block verification (Sun et al. 2024) with keyed coins; exact for drafts drawn from draft_logp.

    target_logp [g+1, V], draft [g], draft_logp [g, V]. Decides the accepted prefix jointly and draws the
    correction from its own residual (w_n p - q)+ (never mix with token-wise residuals). Expected
    accepted length is never below token-wise speculative sampling.
    The decision reads every draft and coin of the round, so the drafter's own sampling noise must be
    fresh every round (noise.round_gumbel), not keyed by absolute index alone: otherwise the next
    round redraws the discarded drafts this decision depended on and the output is biased.
    """
    check_chain_inputs(target_logp, draft, draft_logp, seed, pos0, length)
    check_concrete_chain(target_logp, draft, draft_logp)
    return _block_chain(target_logp, draft, draft_logp, seed, pos0, length)
