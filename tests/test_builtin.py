"""The shipped built-in models: they load by name and reach their acceptance on held-out files."""

from __future__ import annotations

import pytest

import jspec
from jspec.benchmarks.tau_table import folder_prompts, held_out_prompts
from jspec.verify.sampling import SamplingParams


@pytest.fixture(scope="module")
def setup():
    target = jspec.load_target("builtin:code-target")
    return target, held_out_prompts(target, 32, 48)


_TAUS: dict = {}  # (drafter, sampling, verifier, block size) -> tau: a run that two tests read runs once


def _tau(target, prompts, drafter, sampling, verifier, block_size=None):
    key = (drafter, sampling, verifier, block_size)
    if key not in _TAUS:
        res = jspec.generate(target, prompts, max_new_tokens=128, sampling=sampling, seeds=0, eos_ids=[],
                             drafter=drafter, verifier=verifier, block_size=block_size)
        _TAUS[key] = res.stats["tau"]
    return _TAUS[key]


def test_dflash_greedy_tau_at_block_8(setup):
    """32 held-out prompts x 128 tokens, greedy (deterministic): tau >= 4.0 at block 8 (measured: 4.11)."""
    target, prompts = setup
    assert _tau(target, prompts, "builtin:code-dflash", SamplingParams(0.0), "greedy") >= 4.0


def test_dspark_greedy_tau_reaches_4_at_8_tokens_a_round(setup):
    """Same prompts, greedy: DSpark (7 drafts + the bonus token, as DFlash's block 8) reaches tau >= 4
    (measured: 4.36)."""
    target, prompts = setup
    assert _tau(target, prompts, "builtin:code-dspark", SamplingParams(0.0), "greedy") >= 4.0


def test_dspark_beats_dflash_at_temperature_1(setup):
    """Same prompts, T = 1, speculative sampling, fixed seeds (measured: 2.65 vs 1.93)."""
    target, prompts = setup
    spark = _tau(target, prompts, "builtin:code-dspark", SamplingParams(1.0), "speculative")
    flash = _tau(target, prompts, "builtin:code-dflash", SamplingParams(1.0), "speculative")
    assert spark > flash


def test_unknown_builtin_is_named():
    with pytest.raises(FileNotFoundError, match="no built-in model 'nope'.*code-dflash"):
        jspec.load_target("builtin:nope")


def test_dflash2_drafts_longer_greedy_chains_than_its_backbone(setup):
    """Same prompts, greedy: the built-in DFlash2 (the built-in DFlash's tensors plus the convolutions and
    the pair selector, fine-tuned 400 steps: configs/code-dflash2.json) beats DFlash's tau (measured: 4.29 vs
    4.11)."""
    target, prompts = setup
    two = _tau(target, prompts, "builtin:code-dflash2", SamplingParams(0.0), "greedy")
    one = _tau(target, prompts, "builtin:code-dflash", SamplingParams(0.0), "greedy")
    assert two > one and two >= 4.1


def test_autoregressive_feature_drafters_reach_their_acceptance(setup):
    """Same prompts, greedy: the built-in MTP module (one target-shaped layer on the target's last hidden
    state, chained; configs/code-mtp.json) at 4 drafts, and the built-in EAGLE-3 (the step-200 checkpoint of
    configs/code-eagle3.json) at 6 (measured: 3.89 and 2.49)."""
    target, prompts = setup
    assert _tau(target, prompts, "builtin:code-mtp", SamplingParams(0.0), "greedy", block_size=4) >= 3.6
    assert _tau(target, prompts, "builtin:code-eagle3", SamplingParams(0.0), "greedy", block_size=6) >= 2.2


def test_folder_prompts_are_windows_of_the_folders_sources(setup, tmp_path):
    """--folder's prompts (out-of-corpus code): windows of the folder's .py files, fixed by the seed."""
    target, _ = setup
    src = "def add(a, b):\n    return a + b\n\n" * 20
    (tmp_path / "m.py").write_text(src)
    ids = target.encode(src)
    prompts = folder_prompts(target, str(tmp_path), 5, 16)
    assert len(prompts) == 5 and all(len(p) == 16 for p in prompts)
    assert all(any(ids[i:i + 16] == p for i in range(len(ids) - 15)) for p in prompts)
    assert folder_prompts(target, str(tmp_path), 5, 16) == prompts
    (tmp_path / "m.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="longer than 16 tokens"):
        folder_prompts(target, str(tmp_path), 5, 16)
