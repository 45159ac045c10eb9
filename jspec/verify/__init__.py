"""Verification rules and the sampling/noise primitives they share with the decode loop.

The registered verifiers (`rules`: one `Rule` per name, what the decode loop calls), the chain and
tree rule functions behind them (`chain`, `tree`), the DSpark verification budget (`budget`), input checks
(`validate`) and exact enumeration for small vocabularies (`exact`, analysis and tests only).
"""

from jspec.verify import noise
from jspec.verify.budget import choose_verify_lengths, expected_rate, survival
from jspec.verify.chain import (
    CHAIN_RULE_NEEDS_DRAFT_LOGP,
    CHAIN_RULES,
    ChainResult,
    CoinOutcome,
    block_chain,
    block_chain_from_coins,
    greedy_chain,
    gumbel_chain,
    speculative_chain,
    speculative_chain_from_coins,
    verify_chain,
)
from jspec.verify.sampling import SamplingParams, gumbel_argmax, served_logprobs, validate_sampling
from jspec.verify.tree import (
    TREE_RULE_NEEDS_DRAFT_LOGP,
    TREE_RULES,
    TreeCoinOutcome,
    TreeResult,
    greedy_tree,
    gumbel_tree,
    sampling_tree,
    sampling_tree_deterministic,
    sampling_tree_from_coins,
    verify_tree,
)
from jspec.verify.validate import check_distribution, check_tree

__all__ = [
    "CHAIN_RULES",
    "CHAIN_RULE_NEEDS_DRAFT_LOGP",
    "ChainResult",
    "CoinOutcome",
    "SamplingParams",
    "TREE_RULES",
    "TREE_RULE_NEEDS_DRAFT_LOGP",
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
