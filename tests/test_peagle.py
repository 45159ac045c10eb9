"""The P-EAGLE drafter (jspec.drafters.peagle). Its served q of all K drafts equals a float64 numpy evaluation of
the architecture written here (committed rows causal at depth 0; rows at depth > 0 reading fc(mask_hidden) and
mask_token_id, seeing the committed context and the earlier parallel rows), across commits, from official-format
files; q is 0 outside the draft vocabulary and q_i does not depend on the earlier drafts; strict loading names bad
files; saving writes SpecForge's names back; EAGLE-3 folders still detect as eagle3."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import jspec
from jspec.drafters import family
from jspec.drafters.base import CommitInfo, DraftContext
from jspec.drafters.peagle import PEagle
from jspec.errors import CheckpointError
from jspec.verify.rules import GREEDY, SAMPLE
from jspec.verify.sampling import SamplingParams

from test_eagle3 import (DRAFT_V, FFN, HEAD_DIM, HEADS, KV_HEADS, TAPS, TARGET, H, _full_taps, _prefill, _rms,  # noqa: F401
                         _write, target)  # target: the shared fixture
from test_eagle3 import _weights as eagle3_weights

MASK_ID = 95
K = 4  # drafts per pass


def _hf_config(**edits) -> dict:
    """A P-EAGLE config.json as SpecForge writes one, plus the mask token id."""
    hf = {"architectures": ["PEagleDraftModel"], "model_type": "llama", "hidden_act": "silu",
          "hidden_size": H, "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
          "head_dim": HEAD_DIM, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "max_position_embeddings": 2048, "tie_word_embeddings": False, "vocab_size": TARGET.vocab_size,
          "draft_vocab_size": DRAFT_V, "target_hidden_size": TARGET.hidden_size, "norm_before_residual": False,
          "eagle_config": {"eagle_aux_hidden_state_layer_ids": TAPS}, "mask_token_id": MASK_ID}
    hf.update(edits)
    return {k: v for k, v in hf.items() if v is not None}


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors under SpecForge's names (EAGLE-3's with the layer as `layers.0.*`, plus `mask_hidden`)."""
    w = eagle3_weights(seed, prefix="layers.0.")
    w["mask_hidden"] = np.random.RandomState(seed + 100).randn(1, 1, 3 * TARGET.hidden_size).astype(np.float32)
    return w


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    w = _weights()
    return _write(tmp_path_factory.mktemp("peagle") / "official", _hf_config(), w), w


# --- the reference: float64 numpy, from the architecture -----------------------------------------------------------


class Reference:
    """P-EAGLE's one layer over explicit rows: each row has a token, a hidden state g, a position and the set of
    rows whose keys it sees (itself included)."""

    def __init__(self, w: dict):
        self.w = {n: np.asarray(a, np.float64) for n, a in w.items() if n not in ("d2t", "t2d")}
        self.ids = np.arange(DRAFT_V) + w["d2t"]
        self.inv_freq = 1.0 / 10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)

    def _rope(self, x, pos):
        ang = pos * self.inv_freq
        cos, sin = np.cos(np.concatenate([ang, ang])), np.sin(np.concatenate([ang, ang]))
        half = HEAD_DIM // 2
        return x * cos + np.concatenate([-x[:, half:], x[:, :half]], -1) * sin

    def fuse(self, x):  # [..., 3 Ht] -> [..., H]
        return x @ self.w["fc.weight"].T

    def run(self, tokens, gs, positions, visible):
        w, p = self.w, "layers.0."
        xs = [np.concatenate([_rms(w["embed_tokens.weight"][t], w[p + "input_layernorm.weight"]),
                              _rms(g, w[p + "hidden_norm.weight"])]) for t, g in zip(tokens, gs)]
        qs = [self._rope((w[p + "self_attn.q_proj.weight"] @ x).reshape(HEADS, HEAD_DIM), s)
              for x, s in zip(xs, positions)]
        ks = [self._rope((w[p + "self_attn.k_proj.weight"] @ x).reshape(KV_HEADS, HEAD_DIM), s)
              for x, s in zip(xs, positions)]
        vs = [(w[p + "self_attn.v_proj.weight"] @ x).reshape(KV_HEADS, HEAD_DIM) for x in xs]
        outs = []
        for r, g in enumerate(gs):
            k, v = np.stack([ks[j] for j in visible[r]]), np.stack([vs[j] for j in visible[r]])
            attn = np.zeros((HEADS, HEAD_DIM))
            for hd in range(HEADS):
                kv = hd // (HEADS // KV_HEADS)
                s = k[:, kv] @ qs[r][hd] / np.sqrt(HEAD_DIM)
                s = np.exp(s - s.max())
                attn[hd] = (s / s.sum()) @ v[:, kv]
            h = g + w[p + "self_attn.o_proj.weight"] @ attn.reshape(-1)
            m = _rms(h, w[p + "post_attention_layernorm.weight"])
            gate = w[p + "mlp.gate_proj.weight"] @ m
            silu = gate / (1 + np.exp(-gate))
            outs.append(h + w[p + "mlp.down_proj.weight"] @ (silu * (w[p + "mlp.up_proj.weight"] @ m)))
        return outs

    def logq(self, a):
        logits = self.w["lm_head.weight"] @ _rms(a, self.w["norm.weight"])
        logits = logits - logits.max()
        out = np.full(TARGET.vocab_size, -np.inf)
        out[self.ids] = logits - np.log(np.exp(logits).sum())
        return out

    def pass_logq(self, seq, taps, length, k):
        """log q [k, V] of the k drafts after committed text seq[:length] (taps [3, >= length - 1, Ht]): committed
        rows t = 0 .. L-2 (token seq[t+1], fc of the taps, causal); parallel rows d = 1 .. k-1 at position
        L - 2 + d (mask token, fc(mask_hidden)) seeing every committed row and parallel rows 1 .. d."""
        n = length - 1
        g = self.fuse(np.concatenate(list(taps[:, :n]), -1))
        gm = self.fuse(self.w["mask_hidden"].reshape(-1))
        tokens = list(seq[1:length]) + [MASK_ID] * (k - 1)
        gs = list(g) + [gm] * (k - 1)
        positions = list(range(n)) + [n - 1 + d for d in range(1, k)]
        visible = [list(range(t + 1)) for t in range(n)] + [list(range(n + d)) for d in range(1, k)]
        outs = self.run(tokens, gs, positions, visible)
        return np.stack([self.logq(a) for a in outs[n - 1:]])


# --- tests -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [SAMPLE, GREEDY])
def test_drafts_equal_the_reference_across_commits(target, official, policy):
    """init, propose, commit driven by hand on a fixed text: at every round the served q of all K drafts equals the
    float64 reference (after commits of 1 to 4 tokens, for a row whose prompt is shorter than the padded batch);
    q is 0 exactly off the draft vocabulary; each draft lies in the draft vocabulary (greedy: the argmax of its
    own row's q)."""
    path, w = official
    dr, dparams = jspec.load_drafter(path, target, block_size=K)
    assert isinstance(dr, PEagle) and dr.mask_token_id == MASK_ID and dr.taps == tuple(TAPS) and dr.num_drafts == K
    ref = Reference(w)
    seq = np.random.RandomState(1).randint(3, TARGET.vocab_size - 1, (2, 40)).astype(np.int32)
    lens = np.array([9, 6], np.int32)
    taps = _full_taps(target, seq, dr.taps)
    state = _prefill(target, dr, dparams, seq, lens, 9, 40)
    propose, commit = jax.jit(dr.propose), jax.jit(dr.commit)
    length = lens + 1
    off_vocab = ~np.asarray(w["t2d"])
    for kept in [np.array([1, 4]), np.array([4, 2]), np.array([2, 1]), None]:
        ctx = DraftContext(jnp.asarray(seq), jnp.asarray(length), jnp.array([3, 4], jnp.uint32), target.params,
                           target_cfg=target.cfg, policy=policy, sampling=SamplingParams(1.0))
        prop, state = propose(dparams, state, ctx)
        drafts = np.asarray(prop.tokens)
        assert drafts.shape == (2, K)
        for b in range(2):
            want = ref.pass_logq(seq[b], taps[:, b], int(length[b]), K)
            assert not off_vocab[drafts[b]].any()
            if policy == GREEDY:
                np.testing.assert_array_equal(drafts[b], np.argmax(want, axis=-1))
                continue
            q = np.asarray(prop.q_logp)[b]
            assert (np.isneginf(q) == off_vocab[None]).all()
            np.testing.assert_allclose(np.where(off_vocab, 0, q), np.where(off_vocab, 0, want), atol=2e-4,
                                       err_msg=f"row {b} length {length[b]}")
        if kept is None:
            break
        new = length + kept
        rows = (length - 1)[:, None] + np.arange(K + 1)[None]
        commit_taps = np.take_along_axis(taps, np.minimum(rows, 39)[None, :, :, None], axis=2)
        state = commit(dparams, state, CommitInfo(jnp.asarray(seq), jnp.asarray(length), jnp.asarray(new),
                                                  jnp.asarray(commit_taps, jnp.float32)))
        length = new


def test_official_files_round_trip_and_detection(target, official, tmp_path):
    """Saving writes SpecForge's names (layers.0.*, mask_hidden) and values back; the saved folder detects as
    peagle and reloads to the same drafter; an EAGLE-3 folder still detects as eagle3."""
    path, w = official
    dr, params = jspec.load_drafter(path, target)
    fam = family.get_family("peagle")
    assert family.detect(path) is fam
    fam.save(str(tmp_path / "saved"), dr, params)
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert set(saved) == set(w) and all(np.array_equal(saved[n], w[n]) for n in w)
    hf = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert hf["architectures"] == ["PEagleDraftModel"] and hf["mask_token_id"] == MASK_ID
    assert family.detect(str(tmp_path / "saved")) is fam
    dr2, params2 = jspec.load_drafter(str(tmp_path / "saved"), target)
    assert dr2 == dr and all(np.array_equal(np.asarray(params[n]), np.asarray(params2[n])) for n in params)
    eagle = {n: a for n, a in w.items() if n != "mask_hidden"}
    e3 = _hf_config(architectures=["LlamaForCausalLMEagle3"], mask_token_id=None)
    assert family.detect(_write(tmp_path / "eagle3", e3, eagle)) is family.get_family("eagle3")


@pytest.mark.parametrize("edit, names", [
    (lambda w, hf: w.pop("mask_hidden"), ["missing tensors (1): mask_hidden"]),
    (lambda w, hf: w.update(mask_hidden=np.zeros((1, 1, 3 * H), np.float32)), ["mask_hidden"]),
    (lambda w, hf: hf.pop("mask_token_id"), ["no mask_token_id", "add the id used in training"]),
    (lambda w, hf: hf.update(num_hidden_layers=4), ["num_hidden_layers is 4", "one-layer"]),
    (lambda w, hf: hf.update(norm_before_residual=True), ["norm_before_residual: True"]),
    (lambda w, hf: w.pop("layers.0.self_attn.k_proj.weight"), ["midlayer.self_attn.k_proj.weight"]),
])
def test_bad_checkpoints_are_refused_naming_the_problem(target, tmp_path, edit, names):
    w, hf = _weights(), _hf_config()
    edit(w, hf)
    with pytest.raises(CheckpointError) as err:
        jspec.load_drafter(_write(tmp_path / "bad", hf, w), target)
    for name in names:
        assert name in str(err.value)


def test_trees_are_refused(target, official):
    with pytest.raises(ValueError, match="drafts a chain"):
        jspec.load_drafter(official[0], target, block_size=3, tree_budget=8)


def test_training_rows_equal_the_inference_reference(target, official):
    """The training pass (all rows at once under the P-EAGLE mask, some rollouts cut short) gives every kept row
    (t, d) the q of draft d + 1 that inference gives after committed text x_0 .. x_{t+1}: the float64 reference
    with length t + 2."""
    from jspec.drafters import peagle

    path, w = official
    dr, dparams = jspec.load_drafter(path, target, block_size=K)
    ref = Reference(w)
    seq = np.random.RandomState(3).randint(3, TARGET.vocab_size - 1, (2, 10)).astype(np.int32)
    taps = _full_taps(target, seq, dr.taps)
    keep = peagle.sample_keep(jax.random.key(5), 2, 10, depths=K)
    keep = keep.at[:, 0, 3].set(True)  # one full rollout, whatever the draw
    logq = np.asarray(jax.jit(peagle.cod_logq, static_argnums=(1, 2))(
        dparams, dr.cfg, MASK_ID, dparams["embed"], jnp.asarray(taps, jnp.float32), jnp.asarray(seq), keep))
    keep = np.asarray(keep)
    assert keep[0].all() and (keep[1:] <= keep[:-1]).all() and not keep.all()
    drafted = ~np.asarray(w["t2d"])
    for b in range(2):
        for t in range(9):
            want = ref.pass_logq(seq[b], taps[:, b], t + 2, K)
            for d in np.flatnonzero(keep[:, b, t]):
                got = np.full(TARGET.vocab_size, -np.inf)
                got[ref.ids] = logq[d, b, t]
                np.testing.assert_allclose(np.where(drafted, 0, got), np.where(drafted, 0, want[d]), atol=2e-4,
                                           err_msg=f"row {b} anchor {t} depth {d}")


def test_keep_fractions_and_the_training_loss(target, official):
    """Depth d keeps about max(0.7^d, 0.2) of the positions, nested in depth d - 1; the recipe's loss is finite
    with finite gradients for every trained tensor, mask_hidden included."""
    from jspec.drafters import peagle

    keep = np.asarray(peagle.sample_keep(jax.random.key(0), 4, 4096))
    np.testing.assert_allclose(keep.mean(axis=(1, 2)), peagle.keep_fractions(), atol=0.02)
    assert (keep[1:] <= keep[:-1]).all()
    dr, dparams = jspec.load_drafter(official[0], target, block_size=K)
    recipe = family.get_family("peagle").recipe
    tokens = jnp.asarray(np.random.RandomState(4).randint(3, TARGET.vocab_size, (2, 16)), jnp.int32)
    batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens)}
    trained = {n: a for n, a in dparams.items() if n != "d2t"}
    loss_fn = lambda p: recipe.loss({**p, "d2t": dparams["d2t"]}, target.params, target.cfg, dr, None, batch,
                                    jax.random.key(1))
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trained)
    assert np.isfinite(float(loss)) and float(loss) > 0 and set(metrics) >= {f"acc_{d}" for d in range(8)}
    assert all(np.isfinite(np.asarray(g)).all() for g in grads.values())
    assert np.abs(np.asarray(grads["mask_hidden"])).sum() > 0


def test_the_recipe_builds_and_its_loss_trains(target):
    fam = family.get_family("peagle")
    assert "peagle" in family.trainable() and fam.recipe.frozen == ("d2t",)
    dr, params = fam.recipe.build({"drafter": {"block_size": 3, "mask_token_id": 2}, "init_std": 0.1}, target,
                                  jax.random.key(1))
    assert isinstance(dr, PEagle) and dr.mask_token_id == 2 and dr.block_size == 3
    assert params["mask_hidden"].shape == (1, 1, 3 * TARGET.hidden_size)
    assert fam.recipe.own_loss == "cod"
    with pytest.raises(ValueError, match="drafter.loss 'kl': P-EAGLE trains with its conditional-on-depth"):
        fam.recipe.build({"drafter": {"loss": "kl"}}, target, jax.random.key(1))
    tokens = jnp.asarray(np.random.RandomState(6).randint(3, TARGET.vocab_size, (2, 20)), jnp.int32)
    batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens).at[:, :4].set(0)}
    trainable = {k: v for k, v in params.items() if k != "d2t"}

    def loss(p):
        return fam.recipe.loss({**p, "d2t": params["d2t"]}, target.params, target.cfg, dr, None, batch,
                               jax.random.key(0))

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (first, _), grads = step(trainable)
    for _ in range(5):  # a few steps of gradient descent lower the loss
        trainable = jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, trainable, grads)
        (last, _), grads = step(trainable)
    assert np.isfinite(float(first)) and float(last) < float(first)
