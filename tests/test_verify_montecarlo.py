"""Monte Carlo, end to end with keyed randomness: 200,000 rounds per configuration (one seed per
round, fixed seed ranges), each round's output completed by the plain sampler, and a G-test against
the target's joint law over V^L sequences (cells with expected count < 5 pooled; outputs with target
probability 0 must never appear). Each test fails with probability ~1e-6 when the rule is exact
(asymptotic chi-square law of G, rejection at p < 1e-6)."""

from __future__ import annotations

import numpy as np
import pytest

from jspec.verify import exact
from verify_helpers import (MC_SAMPLES, P_FAIL, assert_matches_target, chain_mc_codes, g_test, multi_round_codes,
                            tree_mc_codes)

VOCAB, G = 4, 3
TREE = [-1, -1, 0, 0, 2]  # root with two children; node 0 with two; node 2 with one (depth 3)


def _seeds(offset):
    return np.arange(MC_SAMPLES, dtype=np.int64) + offset * MC_SAMPLES


@pytest.mark.parametrize("rule, family", [("speculative", "sparse"), ("speculative", "dirichlet"), ("block", "sparse"),
                                          ("block", "dirichlet"), ("gumbel", "served")])
def test_chain_rule_samples_follow_the_target(rule, family):
    tables = exact.random_tables(np.random.default_rng(21), VOCAB, G + 1, family)
    codes = chain_mc_codes(rule, tables, G, _seeds(1))
    assert_matches_target(codes, tables, G + 1)


@pytest.mark.parametrize("rule, children", [("speculative", "iid"), ("speculative", "deterministic"),
                                            ("gumbel", "iid")])
def test_tree_rule_samples_follow_the_target(rule, children):
    tables = exact.random_tables(np.random.default_rng(22), VOCAB, 4, "sparse")
    fixed = None
    if children == "deterministic":
        # DDTree-like: the drafter's top-2 at the root and under node 0, its top-1 under node 2.
        top_root = np.argsort(-tables.logq[0][0])
        under0 = np.argsort(-tables.logq[1][top_root[0]])
        under2 = np.argsort(-tables.logq[2][top_root[0] * VOCAB + under0[0]])
        fixed = [top_root[0], top_root[1], under0[0], under0[1], under2[0]]
    codes = tree_mc_codes(rule, tables, TREE, _seeds(2), fixed_tokens=fixed)
    assert_matches_target(codes, tables, 4)


@pytest.mark.parametrize("rule", ["speculative", "block"])
def test_multi_round_decoding_with_keyed_noise_follows_the_target(rule):
    """Five tokens decoded in rounds of g = 2 with noise keyed by absolute index: rounds begin at
    data-dependent indices, and no coin or draft noise one round conditioned on leaks into the next."""
    tables = exact.random_tables(np.random.default_rng(24), 3, 7, "dirichlet")
    codes = multi_round_codes(rule, tables, 2, 5, _seeds(4))
    assert_matches_target(codes, tables, 5)


def test_block_verification_needs_draft_noise_that_is_fresh_every_round():
    """Contract check: a sampling drafter keyed by absolute index only redraws, next round, the same
    discarded drafts that block verification's decision depended on; the output is then biased
    (token-wise speculative sampling is unaffected: it never reads a draft past the emitted index)."""
    tables = exact.random_tables(np.random.default_rng(24), 3, 7, "dirichlet")
    probs = exact.target_joint(tables, 5)
    block = multi_round_codes("block", tables, 2, 5, _seeds(5), draft_noise="position")
    assert g_test(np.bincount(block, minlength=probs.size), probs)[2] < P_FAIL
    token = multi_round_codes("speculative", tables, 2, 5, _seeds(5), draft_noise="position")
    assert_matches_target(token, tables, 5)


def test_the_g_test_rejects_a_rule_told_the_wrong_q():
    """Power check: the same test rejects block verification when the verifier is told a q other
    than the one that produced the drafts (the proposal-probability contract broken)."""
    tables = exact.random_tables(np.random.default_rng(23), VOCAB, G + 1, "dirichlet")
    wrong_q = tuple(np.flip(a, -1).copy() for a in tables.logq)
    codes = chain_mc_codes("block", tables, G, _seeds(3), claimed_logq=wrong_q)
    counts = np.bincount(codes, minlength=VOCAB ** (G + 1))
    assert g_test(counts, exact.target_joint(tables, G + 1))[2] < P_FAIL
