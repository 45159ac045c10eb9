"""Acceptance and rate summaries: pure functions over loop counters and wall times (DESIGN.md, "Measuring").

Counters are those of `jspec.decode.spec.SpecStats` summed over prompts (as `jspec.generate` reports
them): rounds, committed tokens (the prefill's first token excluded), the histogram of accepted counts
and per_position[i] = rounds whose draft at depth i + 1 was accepted. Rates are pooled: sum of tokens /
sum of time, never a mean of ratios.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence


def acceptance(rounds: int, committed: int, hist: Sequence[int], per_position: Sequence[int],
               verified: int) -> dict:
    """tau, the accepted-length histogram, per-position conditional acceptance and the survival curve.

    tau = committed / rounds (tokens one round commits: accepted drafts + 1 correction or bonus, cut at
    the token budget). conditional[i] = P(draft i + 1 accepted | drafts <= i accepted)
    = per_position[i] / per_position[i - 1] with per_position[-1] := rounds (None where no round got
    that far). survival[i] = S(i + 1) = per_position[i] / rounds, the share of rounds accepting more
    than i drafts: non-increasing, since a round that accepts draft i + 1 accepted draft i.
    """
    if rounds < 1:
        raise ValueError("acceptance needs at least one round: raise max_new_tokens above 1")
    conditional = []
    previous = rounds
    for count in per_position:
        conditional.append(count / previous if previous else None)
        previous = count
    return {
        "rounds": int(rounds),
        "committed": int(committed),
        "tau": committed / rounds,
        "accept_hist": [int(h) for h in hist],
        "accepted_per_position": [int(k) for k in per_position],
        "conditional_acceptance": conditional,
        "survival": [k / rounds for k in per_position],
        "verified": int(verified),
    }


def spread(values: Sequence[float]) -> dict:
    """Median, min and max of per-repeat values."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def decode_timing(call_s: Sequence[Sequence[float]], prefill_s: Sequence[Sequence[float]],
                  tokens: Sequence[Sequence[int]]) -> dict:
    """Pooled decode rate from per-(repeat, prompt) wall times.

    call_s[r][p]: one generation call of max_new_tokens; prefill_s[r][p]: the part of that call before
    its first round (prefill, drafter set-up, the first token); tokens[r][p]: tokens committed after the
    first one. decode = call - prefill. tokens_per_s = sum tokens / sum decode over
    every prompt and repeat; per_repeat pools over prompts within one repeat.
    """
    decode = _decode(call_s, prefill_s)
    rates = [sum(tr) / sum(dr) for tr, dr in zip(tokens, decode)]
    total_tokens = sum(sum(tr) for tr in tokens)
    total_decode = sum(sum(dr) for dr in decode)
    return {
        "call_s": [list(map(float, r)) for r in call_s],
        "prefill_s": [list(map(float, r)) for r in prefill_s],
        "tokens": [list(map(int, r)) for r in tokens],
        "decode_s_total": total_decode,
        "prefill_s_total": float(sum(sum(r) for r in prefill_s)),
        "tokens_total": int(total_tokens),
        "tokens_per_s": total_tokens / total_decode,
        "tokens_per_s_repeats": spread(rates),
    }


def speedup(ar: dict, spec: dict) -> dict:
    """Plain-AR decode time / speculative decode time of the same run (both `decode_timing` records over
    the same prompts and repeats); per-repeat ratios give the spread, and `ci95` a 95% interval of the
    pooled ratio (`pooled_ratio_interval`, None below MIN_CI_REPEATS usable repeats).

    decode = call - prefill, with the prefill timed in a call of its own, so on a busy machine a short
    repeat can come out at <= 0 s. Such a repeat has no meaningful ratio: it is left out of the spread
    and the interval and counted in `noisy_repeats` (the report marks the row); with none, the pooled
    value lies inside the per-repeat range (a ratio of sums of positive times is a mediant of the
    per-repeat ratios).
    """
    pairs = [(sum(a), sum(s)) for a, s in zip(_decode(ar["call_s"], ar["prefill_s"]),
                                              _decode(spec["call_s"], spec["prefill_s"]))]
    usable = [(a, s) for a, s in pairs if a > 0 and s > 0]
    per_repeat = [a / s for a, s in usable]
    return {"value": ar["decode_s_total"] / spec["decode_s_total"], "ar_decode_s": ar["decode_s_total"],
            "decode_s": spec["decode_s_total"], "repeats": spread(per_repeat) if per_repeat else None,
            "ci95": pooled_ratio_interval(usable), "noisy_repeats": len(pairs) - len(usable)}


MIN_CI_REPEATS = 5
CI_RESAMPLES = 2000


def pooled_ratio_interval(pairs: Sequence[tuple[float, float]], level: float = 0.95, resamples: int = CI_RESAMPLES,
                          seed: int = 0) -> dict | None:
    """Percentile-bootstrap interval of the pooled ratio sum(a) / sum(s) over repeats (a, s) = (plain-AR decode
    seconds, speculative decode seconds of one repeat): the repeats are resampled with replacement, pairs
    kept together (the two methods of a repeat ran back to back, under the same load). Deterministic for
    a seed. None with fewer than MIN_CI_REPEATS repeats, where a bootstrap says little."""
    if len(pairs) < MIN_CI_REPEATS:
        return None
    rng = random.Random(seed)
    n = len(pairs)
    ratios = []
    for _ in range(resamples):
        pick = [pairs[rng.randrange(n)] for _ in range(n)]
        ratios.append(sum(a for a, _ in pick) / sum(s for _, s in pick))
    ratios.sort()
    tail = (1 - level) / 2
    return {"low": ratios[int(tail * resamples)], "high": ratios[min(resamples - 1, int((1 - tail) * resamples))],
            "level": level, "method": f"percentile bootstrap over {n} repeats, {resamples} resamples, seed {seed}"}


def _decode(call_s, prefill_s) -> list[list[float]]:
    """decode[r][p] = call_s[r][p] - prefill_s[r][p]: the rounds of one call."""
    return [[c - p for c, p in zip(cr, pr)] for cr, pr in zip(call_s, prefill_s)]


def round_costs(round_s: Sequence[float], verify_s: Sequence[float], draft_s: Sequence[float],
                target_step_s: Sequence[float], pair_s: Sequence[float] | None = None) -> dict:
    """A round's cost split from per-repeat measurements taken in the same repeats (same machine load):
    round_s[r] = the repeat's decode time / its loop iterations; verify_s[r] = one verify pass of the
    round's width, draft_s[r] = the drafter's round (propose + commit), target_step_s[r] = T(0), one target
    token step; pair_s[r] = the drafter's round and the verify pass run together (None: verify + draft).

    Each value is the median over repeats; the shares are of the median round and sum to 1: verify,
    draft, contention (the pair together beyond the two apart: on a CPU, each evicting the other's weights
    from the caches) and overhead, what the round spends beyond the pair (the rule, sampling, the target's
    commit, statistics, loop control). The overhead's per-repeat spread shows how stable that remainder
    is; a negative one means the passes timed alone cost more than inside the loop (noise, cache effects).
    """
    med = statistics.median
    if pair_s is None:
        pair_s = [v + d for v, d in zip(verify_s, draft_s)]
    r, v, d, t0, pair = med(round_s), med(verify_s), med(draft_s), med(target_step_s), med(pair_s)
    per_repeat = [(rr - pp) / rr for rr, pp in zip(round_s, pair_s)]
    return {"round_s": r, "verify_s": v, "draft_s": d, "pair_s": pair, "target_step_s": t0,
            "c": med(dd / tt for dd, tt in zip(draft_s, target_step_s)) if any(draft_s) else None,
            "verify_share": v / r, "draft_share": d / r, "contention_share": (pair - v - d) / r,
            "overhead_share": (r - pair) / r, "overhead_share_repeats": spread(per_repeat), "repeats": len(round_s)}
