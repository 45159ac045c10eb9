"""Verification rules and the sampling/noise primitives they share with the decode loop.

The registered verifiers (`rules`: one `Rule` per name, what the decode loop calls), the chain and
tree rule functions behind them (`chain`, `tree`), the DSpark verification budget (`budget`), input checks
(`validate`) and exact enumeration for small vocabularies (`exact`, analysis and tests only).
"""

from jspec.verify import noise
from jspec.verify.budget import choose_verify_lengths, expected_rate, survival
from jspec.verify.chain import (
    ChainResult,
    CoinOutcome,
    block_chain,
    block_chain_from_coins,
    greedy_chain,
    gumbel_chain,
    speculative_chain,
    speculative_chain_from_coins,
)
from jspec.verify.sampling import SamplingParams, gumbel_argmax, served_logprobs, validate_sampling
from jspec.verify.tree import (
    TreeCoinOutcome,
    TreeResult,
    greedy_tree,
    gumbel_tree,
    sampling_tree,
    sampling_tree_deterministic,
    sampling_tree_from_coins,
)
from jspec.verify.rules import RULES, Rule, get_rule, register_rule, verify_chain, verify_tree
from jspec.verify.validate import check_distribution, check_tree

__all__ = [
    "RULES",
    "Rule",
    "get_rule",
    "register_rule",
    "ChainResult",
    "CoinOutcome",
    "SamplingParams",
    "TreeCoinOutcome",
    "TreeResult",
    "block_chain",
    "block_chain_from_coins",
    "check_distribution",
    "check_tree",
    "choose_verify_lengths",
    "expected_rate",
    "greedy_chain",
    "greedy_tree",
    "gumbel_argmax",
    "gumbel_chain",
    "gumbel_tree",
    "noise",
    "sampling_tree",
    "sampling_tree_deterministic",
    "sampling_tree_from_coins",
    "served_logprobs",
    "speculative_chain",
    "speculative_chain_from_coins",
    "survival",
    "validate_sampling",
    "verify_chain",
    "verify_tree",
]
