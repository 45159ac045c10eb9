"""Streaming committed tokens from inside the compiled loops (generate(on_commit=...)): the chunks add up
to the result, one call after the prefill and one per round, and the default program has no callback."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.decode import ar, spec
from jspec.models import transformer
from jspec.models.config import ModelConfig
from jspec.verify.sampling import SamplingParams

CFG = ModelConfig(family="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, qk_norm=True)
PROMPTS = [[5, 9, 17, 3, 44, 5, 9, 17], [7, 8, 7, 8, 7, 8]]
NEW = 24


@pytest.fixture(scope="module")
def target():
    return jspec.Target(CFG, transformer.init_params(CFG, jax.random.key(0), std=0.3))


def _check_chunks(chunks, res):
    assert all(isinstance(c, list) and len(c) == len(PROMPTS) for c in chunks)
    assert all(isinstance(t, int) for c in chunks for row in c for t in row)
    for row in range(len(PROMPTS)):
        assert sum((c[row] for c in chunks), []) == res.tokens[row]
    assert [len(row) for row in chunks[0]] == [1] * len(PROMPTS)  # the prefill's first token, at once


@pytest.mark.parametrize("sampling", [SamplingParams(0.0), SamplingParams(1.0, top_k=20)])
def test_plain_decoding_streams_every_step(target, sampling):
    kw = dict(max_new_tokens=NEW, sampling=sampling, seeds=[1, 2], eos_ids=[])
    base = jspec.generate(target, PROMPTS, **kw)
    chunks = []
    res = jspec.generate(target, PROMPTS, on_commit=chunks.append, **kw)
    assert res.tokens == base.tokens
    _check_chunks(chunks, res)
    assert len(chunks) == 1 + res.stats["rounds"] == NEW
    assert all(len(row) == 1 for c in chunks for row in c)


@pytest.mark.parametrize("kw", [dict(block_size=3), dict(tree_budget=4)])
def test_speculative_decoding_streams_every_round(target, kw):
    run = dict(max_new_tokens=NEW, seeds=[1, 2], eos_ids=[], drafter="lookup", **kw)
    base = jspec.generate(target, PROMPTS, **run)
    chunks = []
    res = jspec.generate(target, PROMPTS, on_commit=chunks.append, **run)
    assert res.tokens == base.tokens
    _check_chunks(chunks, res)
    assert len(chunks) == 1 + res.stats["loop_rounds"]
    assert sum(len(c[0]) for c in chunks[1:]) == res.stats["new_tokens"] // 2 - 1


def test_finished_rows_stream_nothing(target):
    free = jspec.generate(target, PROMPTS, max_new_tokens=NEW, eos_ids=[])
    eos = free.tokens[0][4]  # row 0 stops early, row 1 later (or at max_new_tokens)
    chunks = []
    res = jspec.generate(target, PROMPTS, max_new_tokens=NEW, eos_ids=[eos], drafter="lookup", block_size=3,
                         on_commit=chunks.append)
    _check_chunks(chunks, res)
    assert len(res.tokens[0]) < len(res.tokens[1])
    done = next(i for i in range(len(chunks)) if sum(len(c[0]) for c in chunks[: i + 1]) == len(res.tokens[0]))
    assert all(c[0] == [] for c in chunks[done + 1:]) and len(chunks) > done + 1


def test_another_callable_reuses_the_compiled_loop(target):
    kw = dict(max_new_tokens=NEW, eos_ids=[])
    jspec.generate(target, PROMPTS, on_commit=lambda c: None, **kw)
    before = ar.generate_ar._cache_size()
    seen = []
    jspec.generate(target, PROMPTS, on_commit=lambda c: seen.append(c), **kw)
    jspec.generate(target, [[3, 4, 5], [6]], on_commit=seen.append, **kw)
    assert ar.generate_ar._cache_size() == before and seen


def test_an_exception_in_the_callable_ends_the_generation(target):
    class Cancel(Exception):
        pass

    calls = []

    def cancel(chunks):
        calls.append(chunks)
        if len(calls) == 3:
            raise Cancel("client went away")

    with pytest.raises(Cancel, match="client went away"):
        jspec.generate(target, PROMPTS, max_new_tokens=NEW, eos_ids=[], on_commit=cancel)
    assert len(calls) == 3
    ok = jspec.generate(target, PROMPTS, max_new_tokens=4, eos_ids=[], on_commit=lambda c: None)  # still fine
    assert [len(t) for t in ok.tokens] == [4, 4]


def _args():
    packed, lens = jspec.api.pack_prompts(PROMPTS, CFG.vocab_size)
    return jnp.asarray(packed), jnp.asarray(lens), jnp.zeros((len(PROMPTS),), jnp.uint32)


def test_the_default_program_has_no_host_callback(target):
    dcfg = ar.DecodeConfig(max_new_tokens=NEW, cache_size=64)
    streamed = ar.DecodeConfig(max_new_tokens=NEW, cache_size=64, on_commit=print)
    drafter, _ = jspec.load_drafter("lookup", target, block_size=3)
    texts = {}
    for name, d in (("default", dcfg), ("streamed", streamed)):
        texts["ar", name] = ar.generate_ar.lower(target.params, CFG, d, *_args()).as_text()
        texts["spec", name] = spec.generate_spec.lower(target.params, (), CFG, drafter, spec.SpecConfig(d, "greedy"),
                                                       *_args()).as_text()
    for loop in ("ar", "spec"):
        assert "callback" not in texts[loop, "default"]
        assert "callback" in texts[loop, "streamed"]


def test_direct_loop_calls_stream_too(target):
    """generate_ar with a DecodeConfig carrying on_commit streams, and returns once the loop is done."""
    chunks = []
    dcfg = ar.DecodeConfig(max_new_tokens=6, cache_size=64, on_commit=chunks.append)
    state = ar.generate_ar(target.params, CFG, dcfg, *_args())
    tokens, length = np.asarray(state.tokens), np.asarray(state.length)
    for row, p in enumerate(PROMPTS):
        assert sum((c[row] for c in chunks), []) == tokens[row, len(p): length[row]].tolist()
    assert len(chunks) == 1 + int(state.steps)
