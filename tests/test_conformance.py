"""Every registered drafter family passes the conformance checks of tests/conformance.py on a tiny dense
target, with its registered `example` drafter.

The whole module decodes with NaN-filled caches (`conformance.nan_filled_caches`), so every check here
also checks that no unwritten cache row is read: a single read poisons the output, which then neither
equals plain decoding nor stays finite. `check_unwritten_cache_rows_are_never_read` is left out for that
reason: its decoding runs are `check_equals_plain_decoding`'s, which already runs them with NaN caches.
The plain decoding the checks compare with is checked once against plain decoding with zeroed caches."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import conformance
import jspec
from jspec.drafters import family
from jspec.models import transformer
from jspec.models.config import ModelConfig

CFG = ModelConfig(family="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=8, qk_norm=True)
FAMILIES = [name for name, f in family.FAMILIES.items() if f.example is not None]
CHECKS = [c for c in conformance.CHECKS if c is not conformance.check_unwritten_cache_rows_are_never_read]
CASES = [pytest.param(name, check, id=f"{name}-{check.__name__.removeprefix('check_')}")
         for name in FAMILIES for check in CHECKS if conformance.applies(check, family.get_family(name))]


@pytest.fixture(scope="module")
def target():
    target = jspec.Target(CFG, transformer.init_params(CFG, jax.random.key(0), std=0.3))
    zeroed = {s: conformance._generate(target, sampling=s) for s in (conformance.GREEDY, conformance.SAMPLED)}
    with pytest.MonkeyPatch.context() as mp, conformance.nan_filled_caches(mp):
        assert np.isnan(transformer.KVCache.zeros(CFG, 1, 4).k[0]).all()
        for s, want in zeroed.items():
            got = conformance._generate(target, sampling=s)
            assert got.tokens == want.tokens and all(np.isfinite(lp).all() for lp in got.logprobs), s
        yield target


def test_every_built_in_family_has_an_example():
    assert set(FAMILIES) == set(family.FAMILIES) and len(FAMILIES) >= 4
    assert len(CASES) == len(FAMILIES) * len(CHECKS) - 1  # prompt lookup has no checkpoints


@pytest.mark.parametrize("name, check", CASES)
def test_conformance(target, name, check, tmp_path):
    kwargs = {"tmp_path": tmp_path} if "tmp_path" in check.__code__.co_varnames else {}
    check(target, family.get_family(name), **kwargs)
