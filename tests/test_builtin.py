"""The shipped built-in models: they load by name and reach their acceptance on held-out files."""

from __future__ import annotations

import pytest

import jspec
from jspec.benchmarks.tau_table import held_out_prompts
from jspec.verify.sampling import SamplingParams


@pytest.fixture(scope="module")
def setup():
    target = jspec.load_target("builtin:code-target")
    return target, held_out_prompts(target, 32, 48)


def _tau(target, prompts, drafter, sampling, verifier, block_size=None):
    res = jspec.generate(target, prompts, max_new_tokens=128, sampling=sampling, seeds=0, eos_ids=[],
                         drafter=drafter, verifier=verifier, block_size=block_size)
    return res.stats["tau"]


def test_dflash_greedy_tau_at_block_8(setup):
    """32 held-out prompts x 128 tokens, greedy (deterministic): tau >= 3.0 at block 8."""
    target, prompts = setup
    assert _tau(target, prompts, "builtin:code-dflash", SamplingParams(0.0), "greedy") >= 3.0


def test_dspark_beats_dflash_at_temperature_1(setup):
    """Same prompts, T = 1, speculative sampling, fixed seeds."""
    target, prompts = setup
    spark = _tau(target, prompts, "builtin:code-dspark", SamplingParams(1.0), "speculative")
    flash = _tau(target, prompts, "builtin:code-dflash", SamplingParams(1.0), "speculative")
    assert spark > flash


def test_unknown_builtin_is_named():
    with pytest.raises(FileNotFoundError, match="no built-in model 'nope'.*code-dflash"):
        jspec.load_target("builtin:nope")


def test_dflash2_drafts_longer_greedy_chains_than_its_backbone(setup):
    """Same prompts, greedy: the built-in DFlash2 (the built-in DFlash's tensors plus the convolutions and
    the pair selector, fine-tuned 400 steps: configs/code-dflash2.json) beats DFlash's tau."""
    target, prompts = setup
    two = _tau(target, prompts, "builtin:code-dflash2", SamplingParams(0.0), "greedy")
    one = _tau(target, prompts, "builtin:code-dflash", SamplingParams(0.0), "greedy")
    assert two > one and two >= 3.3


def test_autoregressive_feature_drafters_reach_their_acceptance(setup):
    """Same prompts, greedy: the built-in MTP module (one target-shaped layer on the target's last hidden
    state, chained; configs/code-mtp.json) at 4 drafts, and the built-in EAGLE-3 (the step-200 checkpoint of
    configs/code-eagle3.json) at 6."""
    target, prompts = setup
    assert _tau(target, prompts, "builtin:code-mtp", SamplingParams(0.0), "greedy", block_size=4) >= 3.3
    assert _tau(target, prompts, "builtin:code-eagle3", SamplingParams(0.0), "greedy", block_size=6) >= 1.9
