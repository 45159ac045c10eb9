"""The checks every drafter family inherits (tests/test_conformance.py runs them on each registered family;
a family defined elsewhere calls them on itself, as tests/test_family.py does).

Each check takes a target and a family and uses the family's `example(target)` drafter:
- greedy decoding through the greedy rule, chains and (where the family drafts them) trees, gives plain
  greedy decoding's tokens; Gumbel-coupled sampling gives plain sampling's tokens for the same seeds;
  every other registered rule runs and serves finite log-probs;
- batch invariance: a row's output does not depend on the rows decoded beside it;
- a target cache whose unwritten rows are NaN is never read (the output stays finite and exact; where
  every check runs with NaN caches, as tests/test_conformance.py does, the first check already covers it);
- checkpoint round trip: `save`, then `detect` and `load` give the same parameters and the same output;
- bad input (a shape the family cannot draft, more drafts than cache rows) is refused before any
  compilation.
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.decode import ar, spec
from jspec.drafters import family as families
from jspec.models import transformer
from jspec.verify import rules
from jspec.verify.sampling import SamplingParams

PROMPTS = [[5, 9, 17, 3, 44, 5, 9, 17], [7, 8, 7, 8, 7, 8], [11, 12, 13, 14, 11, 12, 13]]
NEW = 12
CACHE = 64  # one cache size for every call: fewer compilations
GREEDY, SAMPLED = SamplingParams(0.0), SamplingParams(1.0, top_k=20)


def _generate(target, drafter=None, prompts=PROMPTS, sampling=GREEDY, seeds=(3, 4, 5), **kw):
    return jspec.generate(target, prompts, max_new_tokens=NEW, sampling=sampling, seeds=list(seeds),
                          cache_size=CACHE, eos_ids=[], drafter=drafter, **kw)


def _shapes(fam, drafter, shapes=((3, 0), (3, 5))):
    """The drafters of the (block size, tree budget) shapes the family accepts (a chain-only family
    refuses trees), without duplicates."""
    out = []
    for block_size, tree_budget in shapes:
        try:
            d = fam.with_shape(drafter, block_size, tree_budget)
        except ValueError:
            continue
        if d not in out:
            out.append(d)
    return out


def check_equals_plain_decoding(target, fam):
    drafter, params = fam.example(target)
    plain = {s: _generate(target, sampling=s).tokens for s in (GREEDY, SAMPLED)}
    for dr in _shapes(fam, drafter):
        for s in (GREEDY, SAMPLED):
            res = _generate(target, (dr, params), sampling=s)
            assert res.tokens == plain[s], (fam.name, dr.kind, s)
            assert all(np.isfinite(lp).all() for lp in res.logprobs), (fam.name, dr.kind, s)
            assert res.stats["tau"] >= 1.0


def check_every_rule_runs(target, fam):
    drafter, params = fam.example(target)
    for dr in _shapes(fam, drafter):
        for name, rule in rules.RULES.items():
            if dr.kind == "tree" and rule.chain_only:
                continue
            s = GREEDY if rule.greedy_only else SAMPLED
            res = _generate(target, (dr, params), sampling=s, verifier=name)
            assert [len(t) for t in res.tokens] == [NEW] * len(PROMPTS), (fam.name, name)
            assert all(np.isfinite(lp).all() for lp in res.logprobs), (fam.name, name)
            assert all(0 <= t < target.cfg.vocab_size for row in res.tokens for t in row)


def check_batch_invariance(target, fam):
    drafter, params = fam.example(target)
    for s in (GREEDY, SAMPLED):
        together = _generate(target, (drafter, params), sampling=s).tokens
        for i, seed in enumerate((3, 4, 5)):
            alone = _generate(target, (drafter, params), prompts=PROMPTS[i:i + 1], sampling=s, seeds=(seed,))
            assert alone.tokens[0] == together[i], (fam.name, s, i)


@contextlib.contextmanager
def nan_filled_caches(monkeypatch):
    """Inside the block every dense KV cache (the target's, a small-LM drafter's) starts as NaN, so one
    read of a row that was never written poisons the output. Compiled programs are dropped on entry and
    exit (they hold the zero-initialised caches)."""
    real_zeros = transformer.KVCache.zeros.__func__

    def nan_cache(cls, cfg, batch, size, dtype=jnp.float32):
        return jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), real_zeros(cls, cfg, batch, size, dtype))

    monkeypatch.setattr(transformer.KVCache, "zeros", classmethod(nan_cache))
    jax.clear_caches()
    try:
        yield
    finally:
        monkeypatch.undo()
        jax.clear_caches()


def check_unwritten_cache_rows_are_never_read(target, fam, monkeypatch):
    drafter, params = fam.example(target)
    plain = _generate(target, sampling=GREEDY).tokens
    with nan_filled_caches(monkeypatch):
        for dr in _shapes(fam, drafter):
            res = _generate(target, (dr, params), sampling=GREEDY)
            assert res.tokens == plain, (fam.name, dr.kind)
            res = _generate(target, (dr, params), sampling=SAMPLED)
            assert all(np.isfinite(lp).all() for lp in res.logprobs), (fam.name, dr.kind)


def check_checkpoint_round_trip(target, fam, tmp_path):
    drafter, params = fam.example(target)
    path = os.path.join(str(tmp_path), fam.name)
    fam.save(path, drafter, params)
    assert families.detect(path) is fam
    loaded, loaded_params = jspec.load_drafter(path, target)
    flat, tree = jax.tree_util.tree_flatten(params)
    flat2, tree2 = jax.tree_util.tree_flatten(loaded_params)
    assert tree == tree2 and all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(flat, flat2))
    assert _generate(target, path).tokens == _generate(target, (drafter, params)).tokens


def check_bad_input_refused_before_compiling(target, fam):
    drafter, params = fam.example(target)
    compiled = ar.generate_ar._cache_size(), spec.generate_spec._cache_size()
    too_many = [d for d in _shapes(fam, drafter, ((CACHE, 0), (3, CACHE))) if d.num_drafts >= CACHE]
    for d in too_many:
        with pytest.raises(ValueError, match="do not fit a cache"):
            _generate(target, (d, params))
    for d in _shapes(fam, drafter, ((3, 5),)):
        if d.kind == "tree":
            with pytest.raises(ValueError, match="chain-only"):
                _generate(target, (d, params), sampling=SAMPLED, verifier="block")
    bad = [fam.with_shape(drafter, 3, 0), params]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _generate(target, tuple(bad), prompts=[[target.cfg.vocab_size + 1]])
    assert (ar.generate_ar._cache_size(), spec.generate_spec._cache_size()) == compiled


def applies(check, fam) -> bool:
    """Whether a check concerns this family (only families with a checkpoint format round-trip one)."""
    if check is check_checkpoint_round_trip:
        return None not in (fam.save, fam.load, fam.detect)
    return True


CHECKS = [check_equals_plain_decoding, check_every_rule_runs, check_batch_invariance,
          check_unwritten_cache_rows_are_never_read, check_checkpoint_round_trip,
          check_bad_input_refused_before_compiling]
