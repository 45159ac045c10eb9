"""The scanned layer loop (ModelConfig.layer_loop = "scan": stacked [L, ...] weights and caches, one
lax.scan over the layers) computes what the unrolled loop computes, pass by pass and through the decode
loops, and refuses parameters or caches in the other layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
import jspec
from jspec.drafters import family
from jspec.models import target as tm
from jspec.models import transformer
from jspec.models.attention import move_rows_all_layers, read_rows, write_rows
from jspec.models.config import ModelConfig

# A sliding layer between two full ones: the scan carries a traced window.
CFG = ModelConfig(family="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8, qk_norm=True, sliding_window=5,
                  layer_types=("full_attention", "sliding_attention", "full_attention"))
B, PROMPT, ROWS = 2, 12, 40


@pytest.fixture(scope="module")
def models():
    params = transformer.init_params(CFG, jax.random.key(0), std=0.2)
    return (CFG, params), transformer.with_layer_loop(CFG, params, "scan")


def _passes(cfg, params, attention):
    """Prefill (with taps, one asked twice), a chain pass and a tree pass with its path compaction:
    every output and the final cache's K per layer."""
    toks = jax.random.randint(jax.random.key(1), (B, PROMPT), 0, CFG.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(PROMPT), (B, PROMPT))
    pre = transformer.forward(params, cfg, toks, pos, transformer.KVCache.zeros(cfg, B, ROWS), taps=(2, 0, 2),
                              attention=attention)
    chain = transformer.forward(params, cfg, toks[:, :4], PROMPT + jnp.broadcast_to(jnp.arange(4), (B, 4)),
                                pre.cache, attention=attention)
    parent = np.array([-1, 0, 0, 1, 2])
    anc = np.eye(5, dtype=bool)
    for i in range(1, 5):
        anc[i] |= anc[parent[i]]
    start = PROMPT + 4
    tree = transformer.forward(params, cfg, toks[:, :5], start + jnp.broadcast_to(jnp.array([0, 1, 1, 2, 2]), (B, 5)),
                               chain.cache, ctx_len=jnp.full((B,), start), tree_mask=jnp.broadcast_to(anc, (B, 5, 5)),
                               cache_rows=start + jnp.broadcast_to(jnp.arange(5), (B, 5)), attention=attention)
    # accepted paths: nodes 0, 2, 4 in row 0 and 0, 1, 3 in row 1 move to rows start .. start + 2
    src = start + jnp.array([[0, 2, 4], [0, 1, 3]])
    compact = tm.compact_rows(tree.cache, start + jnp.broadcast_to(jnp.arange(3), (B, 3)), src,
                              jnp.full((B,), start), 5)
    return [pre.hidden, pre.taps, chain.hidden, tree.hidden, *(np.asarray(k) for k in compact.k)]


@pytest.mark.parametrize("attention", ["reference", "pallas"])
def test_scan_passes_equal_the_unrolled_ones(models, attention):
    (cfg, params), (scfg, sparams) = models
    assert isinstance(sparams["layers"], dict) and sparams["layers"]["wq"].shape[0] == CFG.num_layers
    want, got = _passes(cfg, params, attention), _passes(scfg, sparams, attention)
    assert len(got) == len(want) == 4 + CFG.num_layers
    for w, g in zip(want, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(want[-1])).sum() > 0  # the compacted rows hold K


def test_layouts_convert_both_ways_and_mismatches_are_refused(models):
    (cfg, params), (scfg, sparams) = models
    back = transformer.unstack_layers(sparams)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)))
    assert transformer.init_params(scfg, jax.random.key(0), std=0.2)["layers"]["wq"].shape == (3, 32, 32)
    toks = jnp.zeros((1, 2), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(2), (1, 2))
    with pytest.raises(ValueError, match="layer_loop='scan' but the parameters' layers are a list.*with_layer_loop"):
        transformer.forward(params, scfg, toks, pos, transformer.KVCache.zeros(scfg, 1, 8))
    with pytest.raises(ValueError, match="layer_loop='unroll' but the parameters' layers are stacked"):
        transformer.forward(sparams, cfg, toks, pos, transformer.KVCache.zeros(cfg, 1, 8))
    with pytest.raises(ValueError, match="layer_loop='scan' but the KV cache is per-layer"):
        transformer.forward(sparams, scfg, toks, pos, transformer.KVCache.zeros(cfg, 1, 8))
    with pytest.raises(ValueError, match="layer_loop must be one of unroll, scan, got 'loop'"):
        ModelConfig(family="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                    num_kv_heads=1, head_dim=8, layer_loop="loop")


# 70 > attention.UNROLL_MAX_ROWS: the gather / scatter form on TPU; passes of 1 and 3 rows, both written
# as blocks of STACKED_MIN_ROWS rows into a stacked cache
@pytest.mark.parametrize("batch, t", [(2, 1), (2, 3), (70, 3)])
def test_stacked_row_moves_equal_per_layer_ones(batch, t):
    """Writing a layer of a stacked cache and moving every layer's rows at once are the per-layer
    operations on each layer (rows past the cache dropped alike)."""
    k = jax.random.split(jax.random.key(2), 4)
    stacked = jax.random.normal(k[0], (3, batch, 2, 16, 4))
    new = jax.random.normal(k[1], (batch, t, 2, 4))
    start = jax.random.randint(k[2], (batch,), 0, 18)  # rows from 16 on run past the cache
    rows = start[:, None] + jnp.arange(t)
    got = write_rows(stacked, new, rows, jnp.int32(1))
    np.testing.assert_array_equal(got[1], write_rows(stacked[1], new, rows))
    np.testing.assert_array_equal(np.delete(np.asarray(got), 1, 0), np.delete(np.asarray(stacked), 1, 0))
    assert not np.array_equal(got[1], stacked[1])
    start = jnp.minimum(start, 14)
    first = jnp.clip(start, 0, 11)
    src = first[:, None] + jax.random.randint(k[3], (batch, 2), 0, 5)
    dst = start[:, None] + jnp.arange(2)
    moved = move_rows_all_layers(stacked, dst, src, first, 5)
    for layer in range(3):
        one = stacked[layer]
        path = jnp.take_along_axis(read_rows(one, first, 5), (src - first[:, None])[:, None, :, None], axis=2)
        np.testing.assert_array_equal(moved[layer], write_rows(one, jnp.swapaxes(path, 1, 2), dst))


def test_scan_target_decodes_like_the_unrolled_one_and_speculation_stays_exact(models, monkeypatch):
    """Plain decoding of the scanned target gives the unrolled target's tokens and log-probs (greedy and
    sampled, 3 prompts x 12 tokens), and speculative decoding on it gives plain decoding's tokens (greedy
    and Gumbel-coupled, chain and tree verify passes, and the drafter reading the target's hidden states:
    DFlash's conformance check), with NaN-filled caches: no unwritten row of the stacked cache is read."""
    (cfg, params), (scfg, sparams) = models
    unrolled, scanned = jspec.Target(cfg, params), jspec.Target(scfg, sparams)
    for s in (conformance.GREEDY, conformance.SAMPLED):
        want, got = conformance._generate(unrolled, sampling=s), conformance._generate(scanned, sampling=s)
        assert got.tokens == want.tokens, s
        np.testing.assert_allclose(np.concatenate(got.logprobs), np.concatenate(want.logprobs), atol=1e-5)
    with conformance.nan_filled_caches(monkeypatch):
        assert np.isnan(np.asarray(transformer.KVCache.zeros(scfg, 1, 4).k)).all()
        conformance.check_equals_plain_decoding(scanned, family.get_family("dflash"))


def test_stacked_layers_take_one_layers_logical_axes(models):
    """Shardings of the stacked layout: each [L, ...] array has the layer axis, then its layer's axes
    (a tree that matches the stacked parameters, so that no leaf falls back to replication)."""
    from jspec import parallel

    (cfg, params), (scfg, sparams) = models
    axes = parallel.target_axes(scfg)
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(sparams)
    one = parallel.target_axes(cfg)["layers"][0]
    assert axes["layers"]["wq"] == ("layers", *one["wq"]) == ("layers", "heads", "embed")
    assert axes["embed"] == parallel.target_axes(cfg)["embed"]


@pytest.mark.parametrize("kernel", ["reference", "pallas"])
def test_quantized_stacks_multiply_one_layer_in_place(kernel):
    """A Q4 target in the stacked layout: each layer's matmuls take the stack and the layer index
    (quant.Q4Layer; the Pallas kernel prefetches the index to pick its blocks) and compute what the
    unrolled Q4 target computes."""
    import jspec.kernels  # noqa: F401  (registers the Pallas Q4 matmul)
    from jspec.models import quant

    cfg = ModelConfig(family="qwen3", vocab_size=128, hidden_size=128, intermediate_size=256, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True)
    params = quant.with_kernel(quant.quantize_tree(transformer.init_params(cfg, jax.random.key(0), std=0.1),
                                                   tm.declarations(cfg)), kernel)
    scfg, sparams = transformer.with_layer_loop(cfg, params, "scan")
    assert quant.is_q4(sparams["layers"]["w_up"]) and sparams["layers"]["w_up"].shape == (3, 256, 128)
    toks = jax.random.randint(jax.random.key(1), (2, 6), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    want = transformer.forward(params, cfg, toks, pos, transformer.KVCache.zeros(cfg, 2, 16))
    got = transformer.forward(sparams, scfg, toks, pos, transformer.KVCache.zeros(scfg, 2, 16))
    np.testing.assert_allclose(np.asarray(got.hidden), np.asarray(want.hidden), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"a Q4Layer indexes a stack of matrices \[L, out, in\]"):
        quant.matmul(jnp.ones((1, 128)), quant.Q4Layer(params["layers"][0]["w_up"], jnp.int32(0)))


def test_load_target_runs_the_layer_loop_asked_for():
    """load_target converts a dense target to the asked layer loop (default: the backend's, "unroll" on
    this CPU); the built-in target decodes the same tokens either way."""
    unrolled = jspec.load_target("builtin:code-target")
    scanned = jspec.load_target("builtin:code-target", layer_loop="scan")
    assert unrolled.cfg.layer_loop == "unroll" and isinstance(unrolled.params["layers"], list)
    assert scanned.cfg.layer_loop == "scan" and isinstance(scanned.params["layers"], dict)
    prompt = [unrolled.encode("def add(a, b):")]
    want = jspec.generate(unrolled, prompt, max_new_tokens=16, cache_size=64).tokens
    assert jspec.generate(scanned, prompt, max_new_tokens=16, cache_size=64).tokens == want
    # the bench's early-exit assistant (the first layers) takes either layout
    from jspec.bench.peer import early_exit_assistant

    small, small_scanned = early_exit_assistant(unrolled, 2), early_exit_assistant(scanned, 2)
    assert small_scanned.params["layers"]["wq"].shape[0] == 2
    want = jspec.generate(small, prompt, max_new_tokens=8, cache_size=64).tokens
    assert jspec.generate(small_scanned, prompt, max_new_tokens=8, cache_size=64).tokens == want
