"""Sampling transforms shared by target and drafter: the distribution actually served.

`served_logprobs` turns raw logits into the log-probabilities of the distribution a token is drawn
from after temperature, top-k and top-p. Verification rules compare exactly these p and q.
Removed tokens get -inf. Temperature 0 means greedy: a point mass on the argmax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static (hashable) sampling parameters.

    temperature: 0 = greedy (argmax), > 0 scales logits by 1/temperature.
    top_k: keep the k most likely tokens; 0 = off.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1 = off.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        validate_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Host-side check of sampling parameters; raises ValueError naming the problem and the fix."""
    if not isinstance(temperature, (int, float)) or temperature != temperature or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not isinstance(top_p, (int, float)) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must lie in (0, 1] (1 = off), got {top_p!r}")


def served_logprobs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Log-probabilities [..., V] (float32) of the served distribution; -inf where removed."""
    logits = jnp.asarray(logits, jnp.float32)
    vocab = logits.shape[-1]
    if params.greedy:
        best = jnp.argmax(logits, axis=-1)
        return jnp.where(jax.nn.one_hot(best, vocab, dtype=jnp.bool_), 0.0, -jnp.inf)
    logits = logits / params.temperature
    if 0 < params.top_k < vocab:
        kth = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    logp = jax.nn.log_softmax(logits, axis=-1)
    if params.top_p < 1.0:
        # Keep a token if the mass of the tokens strictly more likely than it is < top_p; ties with
        # the boundary token are kept together (order-free, so the result is deterministic).
        # Every comparison happens in sorted order and is mapped back by index: under jit, XLA may
        # recompute log_softmax inside another fusion with different rounding, so comparing it to a
        # threshold taken from the sorted copy can drop every token (NaN row).
        index = jnp.broadcast_to(jnp.arange(vocab), logp.shape)
        neg_sorted, order = jax.lax.sort_key_val(-logp, index, dimension=-1)
        sorted_desc = -neg_sorted
        probs_sorted = jnp.exp(sorted_desc)
        mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
        keep_sorted = mass_before < params.top_p
        # Smallest kept log-prob is the threshold.
        threshold = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        keep_sorted = sorted_desc >= threshold
        keep = jax.lax.sort_key_val(order, keep_sorted, dimension=-1)[1]
        logits = jnp.where(keep, logits, -jnp.inf)
        logp = jax.nn.log_softmax(logits, axis=-1)
    return logp


def gumbel_argmax(logp: jax.Array, noise: jax.Array) -> jax.Array:
    """Gumbel-max draw argmax(logp + noise) over the last axis; exact sample from softmax(logp).

    Greedy (a point mass) ignores the noise automatically since other entries are -inf.
    """
    return jnp.argmax(logp + noise, axis=-1).astype(jnp.int32)
