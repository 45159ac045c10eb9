"""Offline round evaluator: the expected rounds and tau of chain speculative decoding along given texts,
computed from the drafter's and the target's distributions, without running the decode loop.

A row's text is prompt + y_0 .. y_{N-1}: y_0 is the prefill's token (the first anchor), N new tokens
(the last one may be EOS). A round anchored at y_a (committed: prompt + y_<=a) drafts g tokens for
y_{a+1} .. y_{a+g}, accepts n of them and emits n + 1 tokens, so the next round is anchored at
y_{a+n+1}. The row stops once y_{N-1} is committed, so rounds are anchored at a <= N - 2 only, and
tau = (N - 1) / rounds, the loop's tau (committed tokens per round, the prefill's token excluded).

Per row, anchor a and slot k = 1..g (the draft for y_{a+k}), `RolloutStats` holds
  log_ratio[a, k-1] = log q_{a,k}(y_{a+k}) - log p_{a+k}(y_{a+k})   (log rho, at the text's token)
  alpha[a, k-1]     = sum_x min(p_{a+k}(x), q_{a,k}(x))
  hits[a, k-1]      = (argmax of the drafter's logits for slot k) == y_{a+k}
with p_j the target's served distribution of y_j after prompt + y_<j and q_{a,k} the drafter's served
distribution for slot k of the round anchored at a, given drafts 1..k-1 equal to y_{a+1..a+k-1} (a
parallel drafter such as DFlash ignores them; DSpark's Markov head reads the previous one). Each family
computes these rows its own way (`Family.offline`: every family with a training recipe; DEdit greedy only);
tests/test_offline_eval.py checks each one's greedy rounds against the compiled loop's.

Survival given the text, s_k = P(n >= k | the round anchored at a and the text it commits):
  greedy       s_k = prod_{i<=k} hits_i                                  (0 or 1: deterministic)
  speculative  s_k = prod_{i<=k} min(1, rho_i)
  block        s_k = min(1, r_1, ..., r_k),  r_j = prod_{i<=j} rho_i
and P(n = k | text) = s_k - s_{k+1} (s_0 = 1, s_{g+1} = 0). Round starts then follow the Markov
chain over anchors a -> a + n + 1: the occupancy o_0 = 1, o_b = sum_{a<b} o_a P(n = b - a - 1 | a),
and E[rounds | text] = sum_{a<=N-2} o_a (`round_starts`, `expected_rounds`). For speculative sampling
this is EDR's occupancy recursion (DRAFTERS2.md section 10) with the acceptance A = min(1, rho) at the
text's token and the forced end after g drafts; `jspec.train.losses.edr_rounds` is its differentiable
form (jnp), this module the float64 numpy one.

What is exact. Given the text, these are the loop's own probabilities, not an approximation. A round
emits exactly z_1 .. z_{k+1} (n = k drafts accepted) with probability p(z_1..z_{k+1}) (s_k - s_{k+1}),
s along z (s_{g+1} = 0):
- speculative sampling emits y at slot i as the accepted draft with probability min(p, q)(y) and as
  the correction with (p - q)+(y); the two sum to p(y), so given the emitted token the draft was
  accepted with probability min(1, q(y) / p(y)) (the bonus after g acceptances is drawn from p);
- block verification accepts a prefix z of length k with probability P(n >= k, drafts = z) =
  min_{j<=k} q(z_<=j) p(z_>j | z_<=j) = p(z) m_k, and its correction after n = k, drawn from
  norm((w_k p - q)+), gives the k + 1 emitted tokens probability p(z) (m_k - m_{k+1})
(tests/test_offline_eval.py checks both laws against the rules' exact enumeration,
`jspec.verify.exact.chain_outputs`, for every block of a toy model);
- every round is lossless given the committed text (fresh coins and draft noise each round, and the
  drafter reads only committed text), so the text after a round boundary has the target's law
  whatever happened before: given the whole text, the boundaries form the Markov chain above.
So for a text the loop produced, `expected_rounds` is E[rounds | that text] (`rounds_variance`: its
variance), and over texts drawn from the target (plain sampling, e.g. `jspec.generate` without a
drafter) its mean is the loop's E[rounds], with no decode loop run.
What is not: at T > 0 the loop samples its own text, so on one fixed rollout the offline value is an
expectation over the loop's coins for that text, not the loop's count on the text it would have
written (after a rejection the loop's correction generally differs from the rollout's token). tau
pooled over rows is a ratio of sums, as the loop's. `survival(..., given_text=False)` (speculative
only) is the acceptance-rate chain s_k = prod alpha_i along the rollout: an approximation (given
acceptance the accepted drafts follow min(p, q) / alpha, not the rollout's p, and later rows are
conditioned on the rollout's tokens), exact only when the rows do not depend on the prefix. The
draft rows come from one target pass over the whole text where the loop uses its verify passes: the
same computation, possibly rounded differently (a greedy near-tie could flip).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafters import family
from jspec.models import target as tm
from jspec.verify.sampling import SamplingParams, served_logprobs

RULES = ("greedy", "speculative", "block")


@dataclasses.dataclass
class RolloutStats:
    """Per-slot statistics of B texts (see the module docstring); rows padded to N anchors."""

    n_tokens: np.ndarray  # [B] new tokens of each text (y_0 included)
    log_ratio: np.ndarray  # [B, N, g] float64 log q(y) - log p(y)
    alpha: np.ndarray  # [B, N, g] float64 sum_x min(p, q)
    hits: np.ndarray  # [B, N, g] bool draft argmax == text token

    @property
    def num_drafts(self) -> int:
        return self.log_ratio.shape[-1]


def survival(rule: str, stats: RolloutStats, *, given_text: bool = True) -> np.ndarray:
    """s [B, N, g + 1]: s[b, a, k] = P(n >= k) for the round anchored at a (s[..., 0] = 1).

    given_text=False (speculative only): the acceptance-rate chain prod_{i<=k} alpha_i (not exact)."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}: use one of {', '.join(RULES)}")
    if rule == "greedy":
        s = np.cumprod(stats.hits.astype(np.float64), axis=-1)
    elif not given_text:
        if rule != "speculative":
            raise ValueError("the acceptance-rate chain (given_text=False) is defined for speculative sampling only")
        s = np.cumprod(stats.alpha, axis=-1)
    elif rule == "speculative":
        s = np.exp(np.cumsum(np.minimum(stats.log_ratio, 0.0), axis=-1))
    else:
        with np.errstate(invalid="ignore"):
            log_r = np.cumsum(stats.log_ratio, axis=-1)
        # NaN = inf - inf: a token q cannot draft (r = 0) before one p cannot emit; the prefix is dead.
        log_r = np.where(np.isnan(log_r), -np.inf, log_r)
        s = np.exp(np.minimum(np.minimum.accumulate(log_r, axis=-1), 0.0))
    return np.concatenate([np.ones(s.shape[:-1] + (1,)), s], axis=-1)


def length_probs(surv: np.ndarray) -> np.ndarray:
    """P(n = k) [..., g + 1] from the survival [..., g + 1]."""
    return surv - np.concatenate([surv[..., 1:], np.zeros(surv.shape[:-1] + (1,))], axis=-1)


def round_starts(lengths: np.ndarray, n_tokens) -> np.ndarray:
    """o [B, N]: P(a round is anchored at y_a | text), 0 for a >= N - 1. lengths [B, N, g + 1] = P(n = k)."""
    b, n, g1 = lengths.shape
    n_tokens = np.asarray(n_tokens).reshape(b)
    o = np.zeros((b, n + g1 + 1))
    o[:, 0] = n_tokens > 1
    for a in range(n - 1):
        live = a < n_tokens - 1  # an anchor at N - 1 or later: the row is done
        o[:, a + 1:a + 1 + g1] += np.where(live, o[:, a], 0.0)[:, None] * lengths[:, a]
    return o[:, :n] * (np.arange(n)[None] < (n_tokens - 1)[:, None])


def expected_rounds(rule: str, stats: RolloutStats, *, given_text: bool = True) -> np.ndarray:
    """E[rounds | text] [B]."""
    return round_starts(length_probs(survival(rule, stats, given_text=given_text)), stats.n_tokens).sum(-1)


def rounds_variance(rule: str, stats: RolloutStats) -> np.ndarray:
    """Var[rounds | text] [B] (0 for greedy): E[R^2] = sum_a o_a + 2 sum_{a<b} o_a h_ab with h_ab =
    P(a round is anchored at b | one is anchored at a)."""
    lengths = length_probs(survival(rule, stats))
    o = round_starts(lengths, stats.n_tokens)
    b, n, g1 = lengths.shape
    h = np.zeros((b, n, n))  # h[:, a, c]: from anchor a (rows), reach anchor c
    idx = np.arange(n)
    h[:, idx, idx] = 1.0
    for c in range(1, n):
        for k in range(g1):  # c = a' + k + 1
            src = c - k - 1
            if src >= 0:
                h[:, :, c] += h[:, :, src] * lengths[:, src, k][:, None]
    upper = np.triu(h, 1)
    live = (idx[None] < (stats.n_tokens - 1)[:, None]).astype(np.float64)
    second = o.sum(-1) + 2 * np.einsum("ba,bac,bc->b", o, upper, live)
    return second - o.sum(-1) ** 2


def greedy_rounds(stats: RolloutStats) -> np.ndarray:
    """Rounds [B] of greedy verification, walking the text: anchor a -> a + n + 1 with n the number of
    leading drafts equal to the text (drafts past the text never match)."""
    out = np.zeros(len(stats.n_tokens), np.int64)
    g = stats.num_drafts
    for row, n_tok in enumerate(stats.n_tokens):
        a = 0
        while a < n_tok - 1:
            out[row] += 1
            hits = stats.hits[row, a]
            n = 0
            while n < g and a + n + 1 <= n_tok - 1 and hits[n]:
                n += 1
            a += n + 1
    return out


def pooled_tau(n_tokens, rounds) -> float:
    """Committed tokens per round over all rows: sum (N - 1) / sum rounds."""
    return float(np.sum(np.asarray(n_tokens) - 1) / max(np.sum(rounds), 1e-12))


# ---------------------------------------------------------------------------------------------
# The statistics from models: one target pass over each text, one drafter pass over every anchor.


ANCHOR_GROUP = 8  # anchors per drafter pass: the blocks' joint attention grows with their number squared


def supports(drafter) -> bool:
    """Whether the offline statistics cover this drafter: a chain of a family that says how its rounds read
    along a text (`Family.offline`: every family with a training recipe)."""
    if getattr(drafter, "kind", None) != "chain":
        return False
    try:
        return family.family_of(drafter).offline is not None
    except ValueError:  # a drafter class no family registers
        return False


def _rounds(target_params, target_cfg, drafter, dparams, taps, tokens, sampling):
    """anchors [B, A] -> the drafter's (logits, served log q) [B, A, g, V] for the rounds anchored there,
    teacher-forced on `tokens` (its family's `offline`)."""
    if not supports(drafter):
        raise TypeError(f"offline statistics cover chain drafters of families with an offline reading "
                        f"(Family.offline: {', '.join(n for n, f in family.FAMILIES.items() if f.offline)}), not "
                        f"{type(drafter).__name__} (kind {getattr(drafter, 'kind', None)!r})")
    return family.family_of(drafter).offline(target_params, target_cfg, drafter, dparams, taps, tokens, sampling)


def text_rows(target_params, target_cfg, drafter, dparams, tokens, sampling):
    """One target pass over texts tokens [B, L] -> (the target's served log-probs [B, L, V], row t for token
    t + 1; the drafter's rounds: anchors [B, A] -> (logits, served log q) [B, A, g, V], its family's
    `offline` reading of the text). sampling: a `Served`."""
    b, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length), (b, length))
    hidden, _, taps, _ = tm.forward(target_params, target_cfg, tokens, positions,
                                    tm.init_cache(target_cfg, b, length, target_params["embed"].dtype),
                                    taps=drafter.taps, kv_chunk=None)
    p_logp = served_logprobs(tm.logits(target_params, target_cfg, hidden), sampling)
    return p_logp, _rounds(target_params, target_cfg, drafter, dparams, taps, tokens, sampling)


@functools.partial(jax.jit, static_argnums=(1, 2, 7))
def _slot_stats(target_params, target_cfg, drafter, dparams, tokens, prompt_len, sampling, n):
    """tokens [B, L] = prompt + text (right-padded), prompt_len [B] -> log q(y), log p(y), alpha, hits
    [B, n, g] for anchors a = 0 .. n - 1 (those past a row's text read padding: masked by the caller)."""
    b, length = tokens.shape
    g = drafter.num_drafts
    p_logp, rounds = text_rows(target_params, target_cfg, drafter, dparams, tokens, sampling)
    groups = -(-n // ANCHOR_GROUP)
    rows = jnp.arange(b)[:, None, None]

    def group(i):
        a = i * ANCHOR_GROUP + jnp.arange(ANCHOR_GROUP)
        anchors = jnp.minimum(prompt_len[:, None] + a[None], length - 1)  # [B, A] absolute index of y_a
        label_pos = jnp.minimum(anchors[..., None] + 1 + jnp.arange(g), length - 1)  # [B, A, g]
        labels = tokens[rows, label_pos]
        logits, q_logp = rounds(anchors)
        p_rows = p_logp[rows, label_pos - 1]  # the target's distribution of each slot's token
        lq = jnp.take_along_axis(q_logp, labels[..., None], -1)[..., 0]
        lp = jnp.take_along_axis(p_rows, labels[..., None], -1)[..., 0]
        alpha = jnp.sum(jnp.minimum(jnp.exp(p_rows), jnp.exp(q_logp)), -1)
        return lq, lp, alpha, (jnp.argmax(logits, -1) == labels) & jnp.isfinite(lq)  # -inf: not drafted

    out = jax.lax.map(group, jnp.arange(groups))  # each [groups, B, A, g]
    return tuple(jnp.moveaxis(x, 0, 1).reshape(b, groups * ANCHOR_GROUP, g)[:, :n] for x in out)


def rollout_stats(target, drafter, dparams, prompts: Sequence[Sequence[int]], texts: Sequence[Sequence[int]],
                  sampling: SamplingParams = SamplingParams(1.0), batch: int = 4) -> RolloutStats:
    """RolloutStats of chain drafter `drafter` (`supports`, with its params) along `texts` (the new
    tokens y_0.. of each prompt, e.g. `jspec.generate(...).tokens`), under the served `sampling` of both
    models (greedy: only `hits` matters). `batch` texts per pass."""
    if drafter.kind != "chain":
        raise ValueError("offline evaluation covers chain drafters (no tree budget)")
    if len(prompts) != len(texts):
        raise ValueError(f"{len(prompts)} prompts but {len(texts)} texts")
    g = drafter.num_drafts
    n_max = max(len(t) for t in texts)
    served = sampling.traced()
    width = max(len(p) for p in prompts) + n_max  # one shape for every chunk
    parts = []
    for i in range(0, len(texts), batch):
        chunk_p, chunk_t = prompts[i:i + batch], texts[i:i + batch]
        chunk_p = list(chunk_p) + [chunk_p[0]] * (batch - len(chunk_p))  # one shape for every chunk
        chunk_t = list(chunk_t) + [chunk_t[0]] * (batch - len(chunk_t))
        tokens = np.zeros((batch, width), np.int32)
        for j, (p, t) in enumerate(zip(chunk_p, chunk_t)):
            tokens[j, :len(p) + len(t)] = list(p) + list(t)
        lq, lp, alpha, hits = jax.device_get(_slot_stats(
            target.params, target.cfg, drafter, dparams, jnp.asarray(tokens),
            jnp.asarray([len(p) for p in chunk_p], jnp.int32), served, n_max))
        keep = min(batch, len(texts) - i)
        parts.append((_log_ratio(np.asarray(lq, np.float64)[:keep], np.asarray(lp, np.float64)[:keep]),
                      np.asarray(alpha, np.float64)[:keep], np.asarray(hits)[:keep]))
    lr, alpha, hits = (np.concatenate(x) for x in zip(*parts))
    n_tokens = np.asarray([len(t) for t in texts])
    # Slots past a text compare against padding: never accepted (they only matter past the text's end).
    past = (np.arange(n_max)[None, :, None] + 1 + np.arange(g)[None, None]) > (n_tokens - 1)[:, None, None]
    return RolloutStats(n_tokens, np.where(past, -np.inf, lr), np.where(past, 0.0, alpha), hits & ~past)


def _log_ratio(lq: np.ndarray, lp: np.ndarray) -> np.ndarray:
    """log(q / p) with q = 0 -> -inf and p = 0 < q -> +inf."""
    with np.errstate(invalid="ignore"):
        out = lq - lp
    return np.where(np.isneginf(lq), -np.inf, np.where(np.isneginf(lp), np.inf, out))


def offline_tau(rule: str, stats: RolloutStats, *, given_text: bool = True) -> dict:
    """{"rounds": E[rounds | text] [B], "tau": pooled tau, "variance": Var[rounds | text] [B]} of one rule."""
    if rule == "greedy":
        rounds = greedy_rounds(stats).astype(np.float64)
        var = np.zeros_like(rounds)
    else:
        rounds = expected_rounds(rule, stats, given_text=given_text)
        var = rounds_variance(rule, stats) if given_text else np.full_like(rounds, np.nan)
    return {"rounds": rounds, "tau": pooled_tau(stats.n_tokens, rounds), "variance": var}
