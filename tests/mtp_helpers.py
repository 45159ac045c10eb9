"""Checks shared by the MTP drafter's two layouts (tests/test_mtp.py: Qwen3.5 / Qwen3-Next `mtp.*`;
tests/test_mtp_deepseek.py: DeepSeek-V3's): each test file brings its own float64 reference module."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from jspec.drafters import mtp
from jspec.drafters.base import CommitInfo, DraftContext, PrefillInfo
from jspec.models import target as tm
from jspec.verify.rules import SAMPLE
from jspec.verify.sampling import SamplingParams


def drafts_follow_the_reference_across_commits(target, dr, dparams, chain_logp, label: str) -> None:
    """init, propose, commit driven by hand on a fixed text (teacher forcing), block size 2: at every round
    the served q of draft 1 and draft 2 equal chain_logp(seq, hidden, length, drafts) -> [2, V] (the
    reference), after commits of 1, 2 and 3 tokens, for a row whose prompt is shorter than the padded batch."""
    cfg, params = target.cfg, target.params
    assert dr.num_drafts == 2
    s, p = 40, 9
    seq = np.random.RandomState(1).randint(3, cfg.vocab_size, (2, s)).astype(np.int32)
    lens = np.array([9, 6], np.int32)
    full = tm.forward(params, cfg, jnp.asarray(seq), jnp.broadcast_to(jnp.arange(s), (2, s)),
                      tm.init_cache(cfg, 2, s))[0]
    hidden = np.asarray(full, np.float64)  # the target's final-normed hidden states of the whole text

    prompts = jnp.asarray(np.where(np.arange(p)[None] < lens[:, None], seq[:, :p], 0))
    taps = tm.forward(params, cfg, prompts, jnp.broadcast_to(jnp.arange(p), (2, p)), tm.init_cache(cfg, 2, p),
                      taps=dr.taps, lengths=jnp.asarray(lens))[2]
    state = dr.init(dparams, PrefillInfo(prompts, jnp.asarray(lens), taps, target_params=params, target_cfg=cfg), s)
    propose, commit = jax.jit(dr.propose), jax.jit(dr.commit)
    length = lens + 1  # the prefill's first token is the anchor
    for kept in [np.array([1, 3]), np.array([3, 2]), np.array([2, 1]), np.array([1, 3]), None]:
        ctx = DraftContext(jnp.asarray(seq), jnp.asarray(length), jnp.array([3, 4], jnp.uint32), params,
                           target_cfg=cfg, policy=SAMPLE, sampling=SamplingParams(1.0))
        prop, state = propose(dparams, state, ctx)
        drafts, q = np.asarray(prop.tokens), np.asarray(prop.q_logp)
        for b in range(2):
            want = chain_logp(seq[b], hidden[b], int(length[b]), drafts[b])
            np.testing.assert_allclose(q[b], want, atol=2e-4, err_msg=f"{label} row {b} length {length[b]}")
        if kept is None:
            break
        new = length + kept
        rows = (length - 1)[:, None] + np.arange(3)[None]  # the verify pass's rows: anchor, drafts
        info = CommitInfo(jnp.asarray(seq), jnp.asarray(length), jnp.asarray(new), None,
                          jnp.asarray(np.take_along_axis(hidden, rows[..., None], axis=1), jnp.float32))
        state = commit(dparams, state, info)
        length = new


def loss_follows_the_reference(target, dr, dparams, rows_logp, loss, t: int = 14):
    """`mtp.train_loss` under DrafterLoss `loss` on a fixed text of t tokens (the first 5 masked out): row i
    reads (h_i, x_{i+1}); with loss "ce" it must equal the mean NLL of x_{i+2} under rows_logp(tokens [t - 2],
    hidden [t - 2, D]) -> [t - 2, V] (the reference) over the response. Returns (loss value, grads, seq,
    loss_mask, the reference's log-probs)."""
    seq = np.random.RandomState(4).randint(3, target.cfg.vocab_size, (1, t)).astype(np.int32)
    loss_mask = np.ones((1, t), np.float32)
    loss_mask[:, :5] = 0
    batch = {"tokens": jnp.asarray(seq), "loss_mask": jnp.asarray(loss_mask)}
    fn = lambda p: mtp.train_loss(p, target.params, target.cfg, dr, loss, batch, jax.random.key(0))
    (value, _), grads = jax.value_and_grad(fn, has_aux=True)(dparams)
    hidden = np.asarray(tm.forward(target.params, target.cfg, jnp.asarray(seq), jnp.arange(t)[None],
                                   tm.init_cache(target.cfg, 1, t))[0], np.float64)[0]
    logp = rows_logp(list(seq[0, 1:-1]), hidden[:-2])
    nll = -logp[np.arange(t - 2), seq[0, 2:]]
    np.testing.assert_allclose(float(value), nll[loss_mask[0, 2:] > 0].mean(), rtol=2e-4)
    return value, grads, seq, loss_mask, logp


def extended_checkpoint(src: str, dst: str, weights, config: dict | None = None, edit=None) -> str:
    """A copy of checkpoint folder `src` at `dst` with `config` merged into its config.json and the tensors
    weights(config dict) added (then edited in place by `edit`)."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    hf = {**json.loads(open(path).read()), **(config or {})}
    if config:
        open(path, "w").write(json.dumps(hf))
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    tensors.update(weights(hf))
    if edit:
        edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst
