"""Shared helpers for the verification tests: Monte Carlo rounds on toy tables and a G-test."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from jspec.verify import exact, noise, rules
from jspec.verify.sampling import gumbel_argmax

# Every statistical test rejects at this p-value: with the asymptotic chi-square law of G, each test
# fails with probability ~1e-6 when the rule is exact (seeds are fixed, so a run is reproducible).
P_FAIL = 1e-6
MC_SAMPLES = 200_000


def g_test(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int, float]:
    """G-test of observed counts against cell probabilities; returns (G, degrees of freedom, p-value).

    Cells with probability 0 must be empty (asserted: an impossible output is a hard failure); cells
    with expected count below `min_expected` are pooled into one cell.
    """
    counts = np.asarray(counts, np.float64)
    probs = np.asarray(probs, np.float64)
    total = counts.sum()
    impossible = probs <= 1e-12
    assert counts[impossible].sum() == 0, f"{int(counts[impossible].sum())} samples fell in zero-probability cells"
    expected = probs * total
    small = (expected < min_expected) & ~impossible
    obs = np.concatenate([counts[~small & ~impossible], [counts[small].sum()]])
    exp = np.concatenate([expected[~small & ~impossible], [expected[small].sum()]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    nz = obs > 0
    g = 2.0 * np.sum(obs[nz] * np.log(obs[nz] / exp[nz]))
    df = max(len(obs) - 1, 1)
    return float(g), df, float(stats.chi2.sf(g, df))


def jnp_tables(tables: exact.Tables):
    return [jnp.asarray(a) for a in tables.logp], [jnp.asarray(a) for a in tables.logq]


def _complete(lp, seed, pos0, emitted, n, length, vocab):
    """Code of the round's output emitted[:n] + [token] completed to `length` by the AR sampler."""
    code = jnp.int32(0)
    for k in range(length):
        ar = gumbel_argmax(lp[k][code], noise.gumbel(seed, jnp.int32(pos0 + k), noise.GUMBEL, vocab))
        tok = jnp.where(k <= n, emitted[k], ar)
        code = code * vocab + tok
    return code


def chain_mc_codes(rule: str, tables: exact.Tables, g: int, seeds: np.ndarray, pos0: int = 11,
                   claimed_logq=None) -> np.ndarray:
    """Run one round per seed (drafts sampled from q, or coupled for 'gumbel'); return completed codes.

    claimed_logq: tables the verifier is told q is (default: the q the drafts really come from).
    """
    lp, lq = jnp_tables(tables)
    told = lq if claimed_logq is None else [jnp.asarray(a) for a in claimed_logq]
    run = _chain_runner(rule, g, tables.vocab, pos0)
    return np.asarray(run(jnp.asarray(seeds, jnp.int32), tuple(lp), tuple(lq), tuple(told)))


@functools.lru_cache(maxsize=None)
def _chain_runner(rule: str, g: int, vocab: int, pos0: int):
    """Compiled once per (rule, shape): the tables are arguments, not constants."""
    purpose = noise.GUMBEL if rule == "gumbel" else noise.DRAFT

    def one(seed, lp, lq, told):
        code = jnp.int32(0)
        draft, trows, drows = [], [], []
        for k in range(g):
            trows.append(lp[k][code])
            drows.append(told[k][code])
            x = gumbel_argmax(lq[k][code], noise.gumbel(seed, jnp.int32(pos0 + k), purpose, vocab))
            draft.append(x)
            code = code * vocab + x
        trows.append(lp[g][code])
        draft = jnp.stack(draft)
        res = rules.verify_chain(rule, jnp.stack(trows), draft, jnp.stack(drows), seed=seed, pos0=jnp.int32(pos0))
        emitted = jnp.concatenate([draft, jnp.zeros((1,), jnp.int32)]).at[res.n].set(res.token)
        return _complete(lp, seed, pos0, emitted, res.n, g + 1, vocab)

    return jax.jit(jax.vmap(one, in_axes=(0, None, None, None)))


def tree_mc_codes(rule: str, tables: exact.Tables, parent, seeds: np.ndarray, fixed_tokens=None,
                  pos0: int = 5) -> np.ndarray:
    """One tree round per seed; children drawn i.i.d. from q (or fixed tokens); completed codes."""
    lp, lq = jnp_tables(tables)
    run = _tree_runner(rule, tuple(int(p) for p in parent), tables.vocab, pos0, fixed_tokens is not None)
    fixed = jnp.asarray(np.zeros(len(parent)) if fixed_tokens is None else fixed_tokens, jnp.int32)
    return np.asarray(run(jnp.asarray(seeds, jnp.int32), tuple(lp), tuple(lq), fixed))


@functools.lru_cache(maxsize=None)
def _tree_runner(rule: str, parent: tuple, vocab: int, pos0: int, fixed: bool):
    paths = exact.tree_paths(parent)
    depth = np.array([len(p) for p in paths], np.int32)
    length = int(depth.max()) + 1
    parent_arr = jnp.asarray(parent, jnp.int32)

    def one(seed, lp, lq, fixed_tokens):
        node_code = []
        tokens = []
        for i, pa in enumerate(parent):
            ctx = jnp.int32(0) if pa < 0 else node_code[pa]
            if fixed:
                x = fixed_tokens[i]
            else:
                key = jax.random.fold_in(noise.position_key(seed, pos0 + depth[i] - 1, noise.DRAFT), i)
                x = gumbel_argmax(lq[depth[i] - 1][ctx], jax.random.gumbel(key, (vocab,)))
            tokens.append(x)
            node_code.append(ctx * vocab + x)
        tokens = jnp.stack(tokens)
        trows = jnp.stack([lp[0][0]] + [lp[depth[i]][node_code[i]] for i in range(len(parent))])
        drows = jnp.stack([lq[0][0]] + [lq[depth[i]][node_code[i]] for i in range(len(parent))])
        res = rules.verify_tree(rule, trows, tokens, parent_arr, jnp.asarray(depth), drows, seed=seed,
                                pos0=jnp.int32(pos0), children="deterministic" if fixed else "iid")
        emitted = jnp.concatenate([tokens[jnp.maximum(res.path, 0)], jnp.zeros((1,), jnp.int32)])
        emitted = emitted[:length].at[res.n].set(res.token)
        return _complete(lp, seed, pos0, emitted, res.n, length, vocab)

    return jax.jit(jax.vmap(one, in_axes=(0, None, None, None)))


def assert_matches_target(codes: np.ndarray, tables: exact.Tables, length: int) -> float:
    """G-test of completed output codes against the target joint; returns the p-value."""
    probs = exact.target_joint(tables, length)
    counts = np.bincount(codes, minlength=probs.size)
    g, df, pval = g_test(counts, probs)
    assert pval > P_FAIL, f"G = {g:.1f} on {df} df, p = {pval:.2e} < {P_FAIL}: output is not the target's law"
    return pval


@jax.jit
def gumbel_draw(logp_row, seed, position):
    """The plain sampler's token at an absolute index: gumbel_argmax with GUMBEL noise."""
    return gumbel_argmax(logp_row, noise.gumbel(seed, position, noise.GUMBEL, logp_row.shape[-1]))


def ar_gumbel_sequence(tables: exact.Tables, seed: int, pos0: int, length: int) -> list[int]:
    """The plain autoregressive Gumbel-max sampler's tokens at indices pos0 .. pos0 + length - 1."""
    vocab = tables.vocab
    out, code = [], 0
    for k in range(length):
        tok = int(gumbel_draw(jnp.asarray(tables.logp[k][code]), jnp.int32(seed), jnp.int32(pos0 + k)))
        out.append(tok)
        code = code * vocab + tok
    return out


def multi_round_codes(rule: str, tables: exact.Tables, g: int, total: int, seeds: np.ndarray,
                      base: int = 3, draft_noise: str = "round") -> np.ndarray:
    """Decode `total` tokens per seed in rounds of g drafts (drafts ~ q) with keyed noise; codes [S].

    Rounds start wherever the previous round ended, so this checks that noise read by one round is
    never reused by the next. draft_noise="round": the drafter draws with noise.round_gumbel (fresh
    per round, as block verification requires); "position": keyed by absolute index only.
    Tables need depth >= total + g.
    """
    vocab = tables.vocab
    flat_p = jnp.asarray(np.concatenate(tables.logp))
    flat_q = jnp.asarray(np.concatenate(tables.logq))
    run = _multi_round_runner(rule, g, total, vocab, tables.depth, base, draft_noise)
    return np.asarray(run(jnp.asarray(seeds, jnp.int32), flat_p, flat_q))


@functools.lru_cache(maxsize=None)
def _multi_round_runner(rule, g, total, vocab, depth, base, draft_noise):
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum([vocab ** k for k in range(depth)])]), jnp.int32)
    size = total + g + 1
    place = jnp.asarray(vocab ** np.arange(size - 1, -1, -1), jnp.int32)

    def row(flat, buf, k):
        # Code of buf[:k]: digits weighted by V^(size-1-i), then shifted down by V^(size-k).
        code = jnp.sum(jnp.where(jnp.arange(size) < k, buf * place, 0)) // (vocab ** (size - k))
        return flat[offsets[k] + code]

    def one(seed, flat_p, flat_q):
        def round_(_, carry):
            buf, m = carry
            if draft_noise == "round":
                draws = noise.round_gumbel(seed, base + m, g, noise.DRAFT, vocab)
            else:
                draws = noise.gumbel(seed, base + m + jnp.arange(g), noise.DRAFT, vocab)
            drafted, draft = buf, []
            for k in range(g):
                x = gumbel_argmax(row(flat_q, drafted, m + k), draws[k])
                draft.append(x)
                drafted = drafted.at[m + k].set(x)
            trows = jnp.stack([row(flat_p, drafted, m + k) for k in range(g + 1)])
            drows = jnp.stack([row(flat_q, drafted, m + k) for k in range(g)])
            res = rules.verify_chain(rule, trows, jnp.stack(draft), drows, seed=seed, pos0=base + m)
            active = m < total
            buf = jnp.where(active, drafted.at[m + res.n].set(res.token), buf)
            return buf, jnp.where(active, m + res.n + 1, m)

        # Each round commits at least one token, so `total` rounds always finish the sequence.
        buf, _ = jax.lax.fori_loop(0, total, round_, (jnp.zeros((size,), jnp.int32), jnp.int32(0)))
        return jnp.sum(buf[:total] * place[size - total:])

    return jax.jit(jax.vmap(one, in_axes=(0, None, None)))
