"""The rule registry: the loop verifies through a registered `Rule` and nothing else.

A rule defined here (never named in any jspec module) runs through `jspec.generate` unchanged and
equals the built-in rule it re-implements; registry lookups name the valid rules.
"""

from __future__ import annotations

import numpy as np
import pytest

import jspec
from jspec.verify import rules
from jspec.verify.chain import first_argmax
from jspec.verify.sampling import SamplingParams
from jspec.verify.tree import greedy_tree

PROMPTS = [[5, 9, 13, 2, 7, 11], [3, 4]]


def _argmax_prefix_chain(logp, draft, q, seed, pos0, length):
    """Greedy matching written from scratch: accept while draft == argmax, then emit the argmax."""
    import jax.numpy as jnp

    choice = first_argmax(logp)  # [g + 1]
    g = draft.shape[0]
    ok = draft == choice[:g]
    if length is not None:
        ok &= jnp.arange(g) < length
    n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32))).astype(jnp.int32)
    return rules.ChainResult(n=n, token=choice[n])


@pytest.fixture(scope="module")
def tiny_target(hf_checkpoints):
    return jspec.load_target(hf_checkpoints("qwen3")[0])


@pytest.fixture
def argmax_rule():
    rule = rules.register_rule(rules.Rule(
        "test-argmax-prefix", rules.GREEDY, chain=_argmax_prefix_chain, greedy_only=True,
        tree=lambda logp, t, par, dep, q, seed, pos0, children: greedy_tree(logp, t, par, dep)))
    yield rule
    del rules.RULES[rule.name]


def test_a_rule_registered_outside_jspec_runs_in_the_loop(tiny_target, argmax_rule):
    kw = dict(max_new_tokens=12, cache_size=48, drafter="lookup", block_size=3, sampling=SamplingParams(0.0))
    ours = jspec.generate(tiny_target, PROMPTS, verifier=argmax_rule.name, **kw)
    builtin = jspec.generate(tiny_target, PROMPTS, verifier="greedy", **kw)
    plain = jspec.generate(tiny_target, PROMPTS, max_new_tokens=12, cache_size=48)
    assert ours.tokens == builtin.tokens == plain.tokens
    assert ours.stats["rounds"] == builtin.stats["rounds"] and ours.stats["accept_hist"] == builtin.stats["accept_hist"]
    kw.pop("block_size")  # a lookup tree takes its shape from the budget alone
    tree = jspec.generate(tiny_target, PROMPTS, verifier=argmax_rule.name, tree_budget=4, **kw)
    assert tree.tokens == plain.tokens


def test_registry_lookups_name_the_rules():
    assert list(rules.RULES) == ["greedy", "speculative", "block", "gumbel"]
    with pytest.raises(ValueError, match="unknown verifier 'nucleus'; choose one of greedy, speculative, block, gumbel"):
        rules.get_rule("nucleus")
    with pytest.raises(ValueError, match="already registered"):
        rules.register_rule(rules.Rule("greedy", rules.GREEDY, chain=_argmax_prefix_chain))
    with pytest.raises(ValueError, match="draft_policy"):
        rules.register_rule(rules.Rule("test-bad-policy", "argmax", chain=_argmax_prefix_chain))
    assert "test-bad-policy" not in rules.RULES
    assert rules.default_rule(True) == "greedy" and rules.default_rule(False) == "gumbel"
    assert [n for n, r in rules.RULES.items() if r.chain_only] == ["block"]
    assert [n for n, r in rules.RULES.items() if r.needs_q] == ["speculative", "block"]
    with pytest.raises(ValueError, match="chain-only"):
        rules.get_rule("block").verify_tree(*([np.zeros(1)] * 7), "iid")
