"""Prompt lookup: propose what followed the most recent earlier occurrence of the current suffix.

Needs no parameters and no training. The suffix is the last `ngram` committed tokens (anchor
included); shorter suffixes are tried when the longest has no earlier match. With a tree budget, the
`branches` most recent matches each contribute a chain of budget // branches tokens below the anchor.
Proposals are deterministic, so q is a point mass (the sampling rules treat them accordingly).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafters.base import DraftContext, Drafter, Proposal, point_mass_logp
from jspec.drafters.family import Family, register_family


def _match_ends(tokens: jax.Array, length: jax.Array, k: int) -> jax.Array:
    """[S] bool: an earlier copy of the last k tokens ends at j (j + 1 < length, so it has a follower)."""
    s = tokens.shape[0]
    j = jnp.arange(s)
    ok = (j >= k - 1) & (j + 1 < length) & (length >= k)
    for o in range(k):
        ok &= tokens[jnp.clip(j - o, 0, s - 1)] == tokens[jnp.clip(length - 1 - o, 0, s - 1)]
    return ok


def _latest_matches(tokens: jax.Array, length: jax.Array, ngram: int, count: int) -> tuple[jax.Array, jax.Array]:
    """End indices [count] of the most recent matches of the longest matching suffix, and validity [count]."""
    s = tokens.shape[0]
    best = jnp.full((count,), -1, jnp.int32)
    for k in range(1, ngram + 1):  # longer suffixes override shorter ones when they match at all
        ends = jnp.where(_match_ends(tokens, length, k), jnp.arange(s, dtype=jnp.int32), -1)
        top = jax.lax.top_k(ends, count)[0]
        best = jnp.where(top[0] >= 0, top, best)
    return best, best >= 0


def _continuation(tokens: jax.Array, length: jax.Array, end: jax.Array, valid: jax.Array, n: int) -> jax.Array:
    """The n tokens after index `end` (clipped to committed text); the anchor repeated when no match."""
    idx = jnp.clip(end + 1 + jnp.arange(n), 0, jnp.maximum(length - 1, 0))
    anchor = tokens[jnp.maximum(length - 1, 0)]
    return jnp.where(valid, tokens[idx], anchor)


@dataclasses.dataclass(frozen=True)
class PromptLookup(Drafter):
    """block_size = g draft tokens (chain) or, with tree_budget > 0, a tree of that many nodes."""

    block_size: int = 8
    ngram: int = 3
    tree_budget: int = 0
    branches: int = 4
    vocab_size: int = 0  # filled from the target by the loop (q needs the vocabulary size)

    @property
    def kind(self) -> str:  # type: ignore[override]
        return "tree" if self.tree_budget else "chain"

    @property
    def num_drafts(self) -> int:
        return self.tree_budget or self.block_size

    @property
    def _branches(self) -> int:
        return max(1, min(self.branches, self.tree_budget))

    @property
    def max_depth(self) -> int:
        return self.tree_budget // self._branches if self.tree_budget else self.block_size

    def propose(self, dparams, state, ctx: DraftContext):
        if self.kind == "chain":
            def row(tokens, length):
                end, valid = _latest_matches(tokens, length, self.ngram, 1)
                return _continuation(tokens, length, end[0], valid[0], self.block_size)

            drafts = jax.vmap(row)(ctx.tokens, ctx.length)
            q = point_mass_logp(drafts, self.vocab_size) if ctx.needs_q else None
            return Proposal(drafts, q), state

        m, depth = self._branches, self.max_depth
        n = m * depth  # budget rounded down to whole branches; the rest of the budget is padding below

        def row(tokens, length):
            ends, valid = _latest_matches(tokens, length, self.ngram, m)
            return jax.vmap(lambda e, v: _continuation(tokens, length, e, v, depth))(ends, valid).reshape(n)

        drafts = jax.vmap(row)(ctx.tokens, ctx.length)
        d = jnp.arange(n) % depth
        parent = jnp.where(d == 0, -1, jnp.arange(n) - 1)
        pad = self.tree_budget - n
        b = drafts.shape[0]
        # Leftover budget: extra leaves under the anchor repeating the first branch's first token
        # (a duplicate sibling is harmless: the rules never accept a token twice at one node).
        drafts = jnp.concatenate([drafts, jnp.broadcast_to(drafts[:, :1], (b, pad))], axis=1)
        parent = jnp.concatenate([parent, jnp.full((pad,), -1)])
        depth_arr = jnp.concatenate([d + 1, jnp.ones((pad,), jnp.int32)])
        return Proposal(drafts, None, jnp.broadcast_to(parent, (b, self.tree_budget)).astype(jnp.int32),
                        jnp.broadcast_to(depth_arr, (b, self.tree_budget)).astype(jnp.int32)), state


def with_shape(drafter: PromptLookup, block_size: int, tree_budget: int) -> PromptLookup:
    return dataclasses.replace(drafter, block_size=block_size, tree_budget=tree_budget)


register_family(Family(name="lookup", drafter=PromptLookup,
                       lookup=lambda target: PromptLookup(vocab_size=target.cfg.vocab_size), with_shape=with_shape,
                       example=lambda target: (PromptLookup(block_size=3, vocab_size=target.cfg.vocab_size), ()),
                       summary="prompt lookup (n-gram matches in the committed text; no parameters)"))
