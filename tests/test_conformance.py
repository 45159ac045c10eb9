"""Every registered drafter family passes the conformance checks of tests/conformance.py on a tiny dense
target, with its registered `example` drafter."""

from __future__ import annotations

import jax
import pytest

import conformance
import jspec
from jspec.drafters import family
from jspec.models import transformer
from jspec.models.config import ModelConfig

CFG = ModelConfig(family="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=8, qk_norm=True)
FAMILIES = [name for name, f in family.FAMILIES.items() if f.example is not None]
CASES = [pytest.param(name, check, id=f"{name}-{check.__name__.removeprefix('check_')}")
         for name in FAMILIES for check in conformance.CHECKS if conformance.applies(check, family.get_family(name))]


@pytest.fixture(scope="module")
def target():
    return jspec.Target(CFG, transformer.init_params(CFG, jax.random.key(0), std=0.3))


def test_every_built_in_family_has_an_example():
    assert set(FAMILIES) == set(family.FAMILIES) and len(FAMILIES) >= 4
    assert len(CASES) == len(FAMILIES) * len(conformance.CHECKS) - 1  # prompt lookup has no checkpoints


@pytest.mark.parametrize("name, check", CASES)
def test_conformance(target, name, check, monkeypatch, tmp_path):
    kwargs = {k: v for k, v in (("monkeypatch", monkeypatch), ("tmp_path", tmp_path))
              if k in check.__code__.co_varnames}
    check(target, family.get_family(name), **kwargs)
