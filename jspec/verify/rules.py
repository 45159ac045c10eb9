"""The verification rules as registered objects: one `Rule` per verifier name, one call per round.

A rule owns its metadata (how drafters must propose under it, whether it reads the proposal
distribution q, whether it verifies trees, whether its output is plain decoding's, token for token)
and two per-row functions with one signature each, whatever the rule:

    chain(logp [g+1, V], draft [g], q_logp [g, V] | None, seed, pos0, length | None) -> ChainResult
    tree(logp [N+1, V], tokens [N], parent [N], depth [N], q_logp [N+1, V] | None, seed, pos0,
         children: "iid" | "deterministic") -> TreeResult

`Rule.verify_chain` / `Rule.verify_tree` map them over the batch; the decode loop calls one of them
and never looks at a rule's name. A new rule is one `Rule(...)` and one `register_rule` line; the
CLI, the API and `jspec bench` read names and constraints from `RULES`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from jspec.verify.chain import ChainResult, block_chain, greedy_chain, gumbel_chain, speculative_chain
from jspec.verify.tree import TreeResult, greedy_tree, gumbel_tree, sampling_tree, sampling_tree_deterministic

# How a drafter turns its own distribution into proposals under a rule (`Rule.draft_policy`).
GREEDY, SAMPLE, GUMBEL = "greedy", "sample", "gumbel"


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    draft_policy: str  # GREEDY: argmax drafts; SAMPLE: drafts drawn from q; GUMBEL: the target's own noise
    chain: Callable[..., ChainResult]
    tree: Callable[..., TreeResult] | None = None  # None: chain-only
    needs_q: bool = False  # reads the q that sampled the drafts (given iff draft_policy == SAMPLE)
    greedy_only: bool = False  # lossless only at temperature 0
    plain_tokens: bool = False  # emits plain decoding's tokens for the same seed (not only its law)

    @property
    def chain_only(self) -> bool:
        return self.tree is None

    def verify_chain(self, logp, drafts, q_logp, seeds, pos0, lengths=None) -> ChainResult:
        """Batched: logp [B, g+1, V], drafts [B, g], q_logp [B, g, V] or None, seeds / pos0 [B],
        lengths [B] (drafts to verify per row) or None (all g)."""
        return jax.vmap(self.chain)(logp, drafts, q_logp, seeds, pos0, lengths)

    def verify_tree(self, logp, tokens, parent, depth, q_logp, seeds, pos0, children: str) -> TreeResult:
        """Batched: logp [B, N+1, V], tokens / parent / depth [B, N], q_logp [B, N+1, V] or None,
        seeds / pos0 [B]; children: "iid" (siblings drawn i.i.d. from q) or "deterministic"."""
        if self.tree is None:
            raise ValueError(f"the {self.name!r} verifier is chain-only and cannot verify a tree")
        return jax.vmap(lambda *a: self.tree(*a, children))(logp, tokens, parent, depth, q_logp, seeds, pos0)


RULES: dict[str, Rule] = {}


def register_rule(rule: Rule) -> Rule:
    if rule.name in RULES:
        raise ValueError(f"a verification rule named {rule.name!r} is already registered")
    if rule.draft_policy not in (GREEDY, SAMPLE, GUMBEL):
        raise ValueError(f"rule {rule.name!r}: draft_policy must be one of {GREEDY}, {SAMPLE}, {GUMBEL}")
    RULES[rule.name] = rule
    return rule


def get_rule(name: str) -> Rule:
    if name not in RULES:
        raise ValueError(f"unknown verifier {name!r}; choose one of {', '.join(RULES)}")
    return RULES[name]


def verify_chain(name: str, target_logp, draft, draft_logp=None, *, seed=0, pos0=0, length=None) -> ChainResult:
    """One row through the registered rule `name` (static): target_logp [g + 1, V], draft [g], draft_logp
    [g, V] (the q that drew the drafts; rules that only compare tokens ignore it). The per-row form of
    `Rule.verify_chain`, for tests and analysis."""
    rule = get_rule(name)
    if rule.needs_q and draft_logp is None:
        raise ValueError(f"the {name!r} rule needs draft_logp [g, V], the proposal distribution that produced "
                         f"the draft; pass it or use a rule that only compares tokens "
                         f"({', '.join(n for n, r in RULES.items() if not r.needs_q)})")
    return rule.chain(target_logp, draft, draft_logp, seed, pos0, length)


def verify_tree(name: str, target_logp, tokens, parent, depth, draft_logp=None, *, seed=0, pos0=0,
                children: str = "iid") -> TreeResult:
    """One tree through the registered rule `name` (static): target_logp [N + 1, V], tokens / parent / depth
    [N], draft_logp [N + 1, V] (needed by sampling rules when children are i.i.d. draws from q). The
    per-row form of `Rule.verify_tree`."""
    rule = get_rule(name)
    if rule.tree is None:
        raise ValueError(f"the {name!r} verifier is chain-only and cannot verify a tree")
    if rule.needs_q and children == "iid" and draft_logp is None:
        raise ValueError(f"the {name!r} rule needs draft_logp [N + 1, V] for i.i.d. children (the q they were drawn "
                         "from); pass it, or children='deterministic' for fixed children")
    return rule.tree(target_logp, tokens, parent, depth, draft_logp, seed, pos0, children)


def default_rule(greedy_sampling: bool) -> str:
    """The verifier a request gets when it names none: the plain-decoding-exact rule for its sampling."""
    return next(r.name for r in RULES.values() if r.plain_tokens and r.greedy_only == greedy_sampling)


def _speculative_tree(logp, tokens, parent, depth, q_logp, seed, pos0, children):
    if children == "deterministic":  # fixed children: accept x w.p. p(x), else remove x
        return sampling_tree_deterministic(logp, tokens, parent, depth, seed, pos0)
    return sampling_tree(logp, tokens, parent, depth, q_logp, seed, pos0)  # recursive rejection over siblings


register_rule(Rule(
    "greedy", GREEDY, greedy_only=True, plain_tokens=True,
    chain=lambda logp, d, q, seed, pos0, n: greedy_chain(logp, d, length=n),
    tree=lambda logp, t, par, dep, q, seed, pos0, children: greedy_tree(logp, t, par, dep)))
register_rule(Rule(
    "speculative", SAMPLE, needs_q=True,
    chain=lambda logp, d, q, seed, pos0, n: speculative_chain(logp, d, q, seed, pos0, length=n),
    tree=_speculative_tree))
register_rule(Rule(
    "block", SAMPLE, needs_q=True,
    chain=lambda logp, d, q, seed, pos0, n: block_chain(logp, d, q, seed, pos0, length=n)))
register_rule(Rule(
    "gumbel", GUMBEL, plain_tokens=True,
    chain=lambda logp, d, q, seed, pos0, n: gumbel_chain(logp, d, seed, pos0, length=n),
    tree=lambda logp, t, par, dep, q, seed, pos0, children: gumbel_tree(logp, t, par, dep, seed, pos0)))
