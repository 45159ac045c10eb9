"""Parity of jspec's hybrid forward with transformers' Qwen3-Next / Qwen3.5 on tiny random checkpoints.

Passes share a few shapes (batch 2, 48 cache rows; full passes padded to 24 tokens) so that the
suite compiles each family's forward only a handful of times.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers

from hybrid_helpers import (ATOL, FAMILIES, TAPS, checkpoint, full_pass, hf_logits, ids, loaded, prefill, run,
                            torch_eval)
from jspec.io.hf_hybrid import load_hybrid_params, save_hybrid_params


@pytest.mark.parametrize("family", FAMILIES)
def test_full_sequence_logits_and_taps(family):
    _, model = checkpoint(family)
    cfg, params = loaded(family)
    x = ids(2, 24)
    with torch_eval():
        ref = model(torch.tensor(x), output_hidden_states=True)
    assert np.abs(ref.logits.numpy()).max() > 1.0  # a sensitive init: logits far from zero
    ours, taps = full_pass(cfg, params, x)
    np.testing.assert_allclose(ours, ref.logits.numpy(), atol=ATOL, rtol=0)
    for j, layer in enumerate(TAPS):  # HF hidden_states[i + 1] is layer i's output
        np.testing.assert_allclose(taps[j], ref.hidden_states[layer + 1].numpy(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_chunks_match_full_forward(family):
    """Right-padded prefill (rows of 12 and 9 tokens), then 4-token chunks, then single tokens."""
    cfg, params = loaded(family)
    x = ids(2, 24, seed=1)
    full, _ = full_pass(cfg, params, x)
    lengths = np.array([12, 9])
    lg, cache = prefill(cfg, params, x, lengths)
    got = {r: {t: lg[r, t] for t in range(lengths[r])} for r in range(2)}
    length = lengths.copy()
    for chunk in [4, 4, 1, 1, 1]:
        pos = length[:, None] + np.arange(chunk)[None]
        lg, out = run(cfg, params, np.take_along_axis(x, pos, axis=1), pos, cache)
        cache, length = out.cache, length + chunk
        for r in range(2):
            got[r].update({int(p): lg[r, j] for j, p in enumerate(pos[r])})
    for r in range(2):
        for t, v in got[r].items():
            np.testing.assert_allclose(v, full[r, t], atol=ATOL, rtol=0, err_msg=f"row {r} position {t}")
    assert len(got[0]) == 23 and len(got[1]) == 20


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(family):
    """A plain Python loop over jspec's forward == transformers' greedy generate, token for token."""
    _, model = checkpoint(family)
    cfg, params = loaded(family)
    prompt, new = ids(2, 12, seed=2), 16
    with torch_eval():
        ref = model.generate(torch.tensor(prompt), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0).numpy()[:, 12:]
    lg, cache = prefill(cfg, params, prompt, [12, 12])
    tokens = [lg[:, -1].argmax(-1)]
    for step in range(new - 1):
        lg, out = run(cfg, params, tokens[-1][:, None], np.full((2, 1), 12 + step), cache)
        cache = out.cache
        tokens.append(lg[:, 0].argmax(-1))
    ours = np.stack(tokens, axis=1)
    np.testing.assert_array_equal(ours, ref)
    assert len(set(ours.ravel().tolist())) > 4  # not a degenerate repetition


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers(family, tmp_path):
    _, model = checkpoint(family)
    cfg, params = loaded(family)
    save_hybrid_params(str(tmp_path), cfg, params)
    with torch_eval():
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True).eval()
    x = ids(1, 12, seed=4)
    np.testing.assert_allclose(hf_logits(reloaded, x), hf_logits(model, x), atol=1e-6, rtol=0)
    cfg2, params2 = load_hybrid_params(str(tmp_path))
    assert cfg2 == cfg
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
