"""Parity of jspec's Llama/Qwen3 forward with transformers on tiny random checkpoints (float32)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jspec.io.hf import load_params, save_params
from jspec.models import transformer as T

VARIANTS = ["qwen3", "qwen3-tied", "llama-scaled", "llama-tied", "qwen3-sliding"]
ATOL = 1e-4


def _ids(b, t, seed=0):
    return np.random.RandomState(seed).randint(3, 128, (b, t))


def _hf_logits(model, ids, **kw):
    with torch.no_grad():
        return model(torch.tensor(ids), **kw).logits.numpy()


def _jspec_full(cfg, params, ids, cache_size=64):
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    out = T.forward(params, cfg, jnp.asarray(ids), pos, T.KVCache.zeros(cfg, b, cache_size))
    return np.asarray(T.logits(params, cfg, out.hidden)), out


@pytest.mark.parametrize("name", VARIANTS)
def test_full_sequence_logits(hf_checkpoints, name):
    path, model = hf_checkpoints(name)
    cfg, params = load_params(path)
    ids = _ids(2, 40)
    ours, _ = _jspec_full(cfg, params, ids)
    ref = _hf_logits(model, ids)
    assert np.abs(ref).max() > 1.0  # a sensitive init: logits far from zero
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)


def test_sliding_window_is_used(hf_checkpoints):
    """The window changes the logits past it, so the parity above really covers sliding attention."""
    path, _ = hf_checkpoints("qwen3-sliding")
    cfg, params = load_params(path)
    import dataclasses

    full_cfg = dataclasses.replace(cfg, layer_types=("full_attention",) * cfg.num_layers)
    ids = _ids(1, 20)
    a, _ = _jspec_full(cfg, params, ids)
    b, _ = _jspec_full(full_cfg, params, ids)
    np.testing.assert_allclose(a[:, : cfg.sliding_window], b[:, : cfg.sliding_window], atol=1e-5)
    assert np.abs(a[:, cfg.sliding_window + 1 :] - b[:, cfg.sliding_window + 1 :]).max() > 1e-2


@pytest.mark.parametrize("name", ["qwen3", "llama-scaled", "qwen3-sliding"])
def test_prefill_then_chunks_match_full_forward(hf_checkpoints, name):
    """Prefill 20 rows, then 4-token chunks, then single tokens, rows of different lengths per batch."""
    path, _ = hf_checkpoints(name)
    cfg, params = load_params(path)
    ids = _ids(2, 36, seed=1)
    full, _ = _jspec_full(cfg, params, ids)
    # Row 0 prefills 20 tokens, row 1 prefills 17: per-row positions in one batch.
    starts = np.array([20, 17])
    cache = T.KVCache.zeros(cfg, 2, 64)
    pre = np.zeros((2, 20), np.int64)
    for r in range(2):
        pre[r, : starts[r]] = ids[r, : starts[r]]
    out = T.forward(params, cfg, jnp.asarray(pre), jnp.broadcast_to(jnp.arange(20), (2, 20)), cache)
    cache, got = out.cache, {0: {}, 1: {}}
    lg = np.asarray(T.logits(params, cfg, out.hidden))
    for r in range(2):
        for t in range(starts[r]):
            got[r][t] = lg[r, t]
    length = starts.copy()
    for chunk in [4, 4, 1, 1, 1, 1]:
        pos = length[:, None] + np.arange(chunk)[None]
        toks = np.take_along_axis(ids, pos, axis=1)
        out = T.forward(params, cfg, jnp.asarray(toks), jnp.asarray(pos), cache)
        cache = out.cache
        lg = np.asarray(T.logits(params, cfg, out.hidden))
        for r in range(2):
            for j in range(chunk):
                got[r][int(pos[r, j])] = lg[r, j]
        length += chunk
    for r in range(2):
        for t, v in got[r].items():
            np.testing.assert_allclose(v, full[r, t], atol=ATOL, rtol=0, err_msg=f"row {r} position {t}")
    assert len(got[0]) == 32 and len(got[1]) == 29


def _tree():
    # 6 nodes below the anchor: parents (-1 = anchor), depths 1..3.
    parent = np.array([-1, -1, 0, 0, 1, 2])
    depth = np.array([1, 1, 2, 2, 2, 3])
    n = len(parent)
    anc = np.eye(n, dtype=bool)
    for i in range(n):
        j = parent[i]
        while j >= 0:
            anc[i, j] = True
            j = parent[j]
    return parent, depth, anc


@pytest.mark.parametrize("name", ["qwen3", "llama-tied"])
def test_tree_ancestor_mask_matches_transformers_4d_mask(hf_checkpoints, name):
    path, model = hf_checkpoints(name)
    cfg, params = load_params(path)
    _, depth, anc = _tree()
    n, ctx = len(depth), 10
    ids = _ids(1, ctx + 1 + n, seed=2)  # prefix (anchor included) then the tree nodes
    prefix, nodes = ids[:, : ctx + 1], ids[:, ctx + 1 :]
    # transformers: one pass over prefix + nodes with an explicit additive 4-D mask.
    total = ctx + 1 + n
    allowed = np.tril(np.ones((total, total), bool))
    allowed[ctx + 1 :, ctx + 1 :] = anc
    mask4 = torch.where(torch.tensor(allowed), 0.0, torch.finfo(torch.float32).min)[None, None]
    position_ids = torch.tensor(np.concatenate([np.arange(ctx + 1), ctx + depth])[None])
    before = model.config._attn_implementation
    model.config._attn_implementation = "eager"  # additive float masks are applied as given
    try:
        ref = _hf_logits(model, ids, attention_mask=mask4, position_ids=position_ids)
    finally:
        model.config._attn_implementation = before
    # jspec: prefill the prefix, then the nodes in scratch rows with the ancestor mask.
    _, out = _jspec_full(cfg, params, prefix)
    rows = ctx + 1 + np.arange(n)
    tree = T.forward(params, cfg, jnp.asarray(nodes), jnp.asarray((ctx + depth)[None]), out.cache,
                     ctx_len=jnp.array([ctx + 1]), cache_rows=jnp.asarray(rows[None]),
                     tree_mask=jnp.asarray(anc[None]))
    ours = np.asarray(T.logits(params, cfg, tree.hidden))
    np.testing.assert_allclose(ours, ref[:, ctx + 1 :], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["qwen3", "llama-scaled"])
def test_taps_are_hf_hidden_states(hf_checkpoints, name):
    path, model = hf_checkpoints(name)
    cfg, params = load_params(path)
    ids = _ids(1, 12, seed=3)
    pos = jnp.arange(12)[None]
    out = T.forward(params, cfg, jnp.asarray(ids), pos, T.KVCache.zeros(cfg, 1, 16), taps=(0, 1))
    with torch.no_grad():
        hs = model(torch.tensor(ids), output_hidden_states=True).hidden_states
    # HF's last entry is post-norm; layer 0's output is hidden_states[1].
    np.testing.assert_allclose(np.asarray(out.taps[0]), hs[1].numpy(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["qwen3", "qwen3-tied", "llama-scaled", "llama-tied"])
def test_export_loads_in_transformers(hf_checkpoints, tmp_path, name):
    path, model = hf_checkpoints(name)
    cfg, params = load_params(path)
    save_params(str(tmp_path), cfg, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True)
    reloaded.eval()
    ids = _ids(1, 16, seed=4)
    np.testing.assert_allclose(_hf_logits(reloaded, ids), _hf_logits(model, ids), atol=1e-6, rtol=0)
    # And back into jspec, bit for bit.
    cfg2, params2 = load_params(str(tmp_path))
    assert cfg2 == cfg
    for a, b in zip(*(map(np.asarray, __import__("jax").tree_util.tree_leaves(p)) for p in (params, params2))):
        np.testing.assert_array_equal(a, b)


def test_bfloat16_load_is_close(hf_checkpoints):
    path, model = hf_checkpoints("qwen3")
    cfg, params = load_params(path, dtype=jnp.bfloat16)
    assert params["layers"][0]["wq"].dtype == jnp.bfloat16
    ids = _ids(1, 16, seed=5)
    ours, _ = _jspec_full(cfg, params, ids)
    ref = _hf_logits(model, ids)
    # bf16 weights: errors of a few percent of the logit scale, but the argmax mostly agrees.
    assert np.abs(ours - ref).max() < 0.1 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.8


def test_sharded_checkpoint_loads(hf_checkpoints, tmp_path):
    path, model = hf_checkpoints("llama-scaled")
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    import os

    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    cfg, params = load_params(str(tmp_path))
    _, ref = load_params(path)
    for a, b in zip(*(__import__("jax").tree_util.tree_leaves(p) for p in (params, ref))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
