"""The MTP drafter: the target's own multi-token-prediction module (`mtp.*` tensors of Qwen3.5 / Qwen3-Next
checkpoints). Its drafts equal a float64 numpy evaluation of the module written here from the architecture
(depth 1 and the chained depth 2, across commits of every accepted count); speculative decoding with it
gives plain decoding's tokens; strict loading names what is missing or misshapen."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jspec
from hybrid_helpers import FAMILIES, checkpoint
from mtp_helpers import drafts_follow_the_reference_across_commits, extended_checkpoint, loss_follows_the_reference
from jspec.drafters import family
from jspec.drafters.mtp import MTP, declarations, layer_config
from jspec.errors import CheckpointError
from jspec.io.hf_hybrid import expected_mtp_tensors
from jspec.verify.sampling import SamplingParams

PROMPTS = [[5, 9, 17, 3, 44, 5, 9, 17, 3], [7, 8, 7, 8, 7, 8], [11, 12, 13, 14, 15, 16, 11, 12, 13, 14, 15]]
NEW = 16


def _mtp_weights(hf: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random `mtp.*` tensors in the official names and shapes for a config.json (float32)."""
    rng = np.random.RandomState(seed)
    d, hq, hkv, dh = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    mat = lambda *shape: (0.2 * rng.randn(*shape)).astype(np.float32)
    norm = lambda n: (0.3 * rng.randn(n)).astype(np.float32)
    p = "mtp.layers.0."
    w = {"mtp.pre_fc_norm_embedding.weight": norm(d), "mtp.pre_fc_norm_hidden.weight": norm(d),
         "mtp.fc.weight": mat(d, 2 * d), "mtp.norm.weight": norm(d),
         p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
         p + "self_attn.q_proj.weight": mat(2 * hq * dh, d), p + "self_attn.k_proj.weight": mat(hkv * dh, d),
         p + "self_attn.v_proj.weight": mat(hkv * dh, d), p + "self_attn.o_proj.weight": mat(d, hq * dh),
         p + "self_attn.q_norm.weight": norm(dh), p + "self_attn.k_norm.weight": norm(dh)}
    if hf.get("num_experts"):  # Qwen3-Next: layer 0's MLP is sparse (decoder_sparse_step 1, no mlp_only_layers)
        fe, fs = hf["moe_intermediate_size"], hf["shared_expert_intermediate_size"]
        w[p + "mlp.gate.weight"] = mat(hf["num_experts"], d)
        for e in range(hf["num_experts"]):
            w.update({f"{p}mlp.experts.{e}.gate_proj.weight": mat(fe, d), f"{p}mlp.experts.{e}.up_proj.weight": mat(fe, d),
                      f"{p}mlp.experts.{e}.down_proj.weight": mat(d, fe)})
        w.update({p + "mlp.shared_expert.gate_proj.weight": mat(fs, d), p + "mlp.shared_expert.up_proj.weight": mat(fs, d),
                  p + "mlp.shared_expert.down_proj.weight": mat(d, fs), p + "mlp.shared_expert_gate.weight": mat(1, d)})
    else:
        f = hf["intermediate_size"]
        w.update({p + "mlp.gate_proj.weight": mat(f, d), p + "mlp.up_proj.weight": mat(f, d),
                  p + "mlp.down_proj.weight": mat(d, f)})
    return w


def _copy(fam: str, dst: str, edit=None) -> str:
    """The tiny transformers checkpoint of `fam` with `mtp.*` tensors added (then edited by `edit`)."""
    return extended_checkpoint(checkpoint(fam)[0], dst, _mtp_weights, edit=edit)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {f: jspec.load_target(_copy(f, str(root / f))) for f in FAMILIES}


# --- the reference: the module in float64 numpy, from the architecture ------------------------------------------


def _zc(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _silu(x):
    return x / (1.0 + np.exp(-x))


class Reference:
    """The MTP module of checkpoint tensors `w` over one sequence of rows (causal attention among them)."""

    def __init__(self, target):
        self.w = {n: a.astype(np.float64) for n, a in load_file(os.path.join(target.path, "model.safetensors")).items()}
        c = target.cfg
        self.c = c
        self.embed = np.asarray(target.params["embed"], np.float64)
        self.head = self.embed if c.tie_word_embeddings else np.asarray(target.params["lm_head"], np.float64)
        rd = int(c.head_dim * c.partial_rotary_factor)
        self.inv_freq = 1.0 / c.rope_theta ** (np.arange(0, rd, 2) / rd)

    def _rope(self, x, pos):  # x [T, H, Dh]: rotate-half on the first rotary dims
        rd = 2 * len(self.inv_freq)
        ang = pos[:, None] * self.inv_freq[None]
        cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
        r = x[..., :rd]
        rot = np.concatenate([-r[..., rd // 2:], r[..., : rd // 2]], -1)
        return np.concatenate([r * cos + rot * sin, x[..., rd:]], -1)

    def _mlp(self, x):
        w, p = self.w, "mtp.layers.0.mlp."
        if p + "gate.weight" not in w:
            return (_silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T
        logits = x @ w[p + "gate.weight"].T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for t in range(len(x)):
            top = np.argsort(-probs[t])[: self.c.num_experts_per_tok]
            weights = probs[t, top] / probs[t, top].sum()
            for e, we in zip(top, weights):
                q = f"{p}experts.{e}."
                hid = _silu(x[t] @ w[q + "gate_proj.weight"].T) * (x[t] @ w[q + "up_proj.weight"].T)
                out[t] += we * (hid @ w[q + "down_proj.weight"].T)
        s = p + "shared_expert."
        shared = (_silu(x @ w[s + "gate_proj.weight"].T) * (x @ w[s + "up_proj.weight"].T)) @ w[s + "down_proj.weight"].T
        return out + shared / (1.0 + np.exp(-(x @ w[p + "shared_expert_gate.weight"].T)))

    def outputs(self, tokens, hidden):
        """o [T, D] (after mtp.norm) of rows t = 0..T-1 at position t: inputs tokens[t] (x_{t+1}), hidden[t]."""
        w, c, eps, p = self.w, self.c, self.c.rms_norm_eps, "mtp.layers.0."
        t_len, hq, hkv, dh = len(tokens), c.num_heads, c.num_kv_heads, c.head_dim
        e = _zc(self.embed[np.asarray(tokens)], w["mtp.pre_fc_norm_embedding.weight"], eps)
        u = np.concatenate([e, _zc(np.asarray(hidden, np.float64), w["mtp.pre_fc_norm_hidden.weight"], eps)], -1)
        u = u @ w["mtp.fc.weight"].T
        x = _zc(u, w[p + "input_layernorm.weight"], eps)
        qg = (x @ w[p + "self_attn.q_proj.weight"].T).reshape(t_len, hq, 2 * dh)
        q, gate = qg[..., :dh], qg[..., dh:].reshape(t_len, hq * dh)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).reshape(t_len, hkv, dh)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(t_len, hkv, dh)
        pos = np.arange(t_len, dtype=np.float64)
        q = self._rope(_zc(q, w[p + "self_attn.q_norm.weight"], eps), pos)
        k = self._rope(_zc(k, w[p + "self_attn.k_norm.weight"], eps), pos)
        attn = np.zeros((t_len, hq, dh))
        for h in range(hq):
            kv = h // (hq // hkv)
            s = q[:, h] @ k[:, kv].T / np.sqrt(dh) + np.triu(np.full((t_len, t_len), -np.inf), 1)
            s = np.exp(s - s.max(-1, keepdims=True))
            attn[:, h] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        h1 = u + (attn.reshape(t_len, hq * dh) / (1.0 + np.exp(-gate))) @ w[p + "self_attn.o_proj.weight"].T
        out = h1 + self._mlp(_zc(h1, w[p + "post_attention_layernorm.weight"], eps))
        return _zc(out, w["mtp.norm.weight"], eps)

    def chain_logp(self, seq, hidden, length, drafts):
        """log q of draft 1 and 2 for committed text seq[:length] (target hidden states `hidden` [>= length - 1,
        D]): row length - 2 reads (h_{length-2}, the anchor); depth 2 reads (its own output, drafts[0])."""
        toks = list(seq[1:length])
        o = self.outputs(toks, hidden[: length - 1])
        o2 = self.outputs(toks + [int(drafts[0])], np.concatenate([hidden[: length - 1], o[-1:]]))
        logits = np.stack([o[-1], o2[-1]]) @ self.head.T
        shifted = logits - logits.max(-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


# --- tests --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fam", FAMILIES)
def test_drafts_equal_the_reference_module_across_commits(targets, fam):
    """init, propose, commit driven by hand on a fixed text (teacher forcing): at every round the served q of
    draft 1 (depth 1) and draft 2 (depth 2, chained on the module's own output) equal the float64 reference,
    after commits of 1, 2 and 3 tokens and for a row whose prompt is shorter than the padded batch."""
    target = targets[fam]
    dr, dparams = jspec.load_drafter("mtp", target, block_size=2)
    assert isinstance(dr, MTP) and dr.layout == "qwen"
    drafts_follow_the_reference_across_commits(target, dr, dparams, Reference(target).chain_logp, fam)


@pytest.mark.parametrize("fam", FAMILIES)
def test_speculative_decoding_equals_plain_decoding(targets, fam):
    target = targets[fam]
    for sampling, verifier, g in [(SamplingParams(0.0), "greedy", 3), (SamplingParams(1.0), "gumbel", 2)]:
        kwargs = dict(max_new_tokens=NEW, sampling=sampling, seeds=[1, 2, 3], eos_ids=[])
        base = jspec.generate(target, PROMPTS, **kwargs)
        res = jspec.generate(target, PROMPTS, drafter="mtp", verifier=verifier, block_size=g, **kwargs)
        assert res.tokens == base.tokens, (fam, verifier)
        assert res.stats["tau"] >= 1.0


def test_checkpoint_round_trip_in_official_names(targets, tmp_path):
    target = targets["qwen3_next"]
    dr, params = jspec.load_drafter("mtp", target)
    fam = family.get_family("mtp")
    fam.save(str(tmp_path), dr, params)
    saved = load_file(str(tmp_path / "model.safetensors"))
    official = {n: a for n, a in load_file(os.path.join(target.path, "model.safetensors")).items()
                if n.startswith("mtp.")}
    assert set(saved) == set(official) and all(np.array_equal(saved[n], official[n]) for n in saved)
    assert family.detect(str(tmp_path)) is fam
    loaded, loaded_params = jspec.load_drafter(str(tmp_path), target, block_size=3)
    assert loaded == dataclasses.replace(dr, block_size=3)
    flat, flat2 = jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(loaded_params)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(flat, flat2, strict=True))
    with pytest.raises(ValueError, match="differs from the target's"):
        jspec.load_drafter(str(tmp_path), targets["qwen3_5"])


def test_a_target_without_mtp_tensors_is_refused_naming_them():
    target = jspec.load_target(checkpoint("qwen3_5")[0])  # transformers writes no mtp.* tensors
    with pytest.raises(CheckpointError) as err:
        jspec.load_drafter("mtp", target)
    msg = str(err.value)
    assert "holds no multi-token-prediction tensors" in msg and "fix:" in msg
    expected = expected_mtp_tensors(layer_config(target.cfg), declarations(layer_config(target.cfg)))
    assert all(name in msg for name in expected)  # every tensor the drafter reads, by name
    assert "mtp.layers.0.self_attn.q_proj.weight" in expected and "mtp.fc.weight" in expected


def test_only_the_shards_holding_mtp_tensors_are_read(targets, tmp_path):
    """A sharded checkpoint (index): the module loads from the shard its index names, and the shards holding
    only the model are never opened (here one is damaged after the target loaded)."""
    src = targets["qwen3_5"].path
    tensors = load_file(os.path.join(src, "model.safetensors"))
    shards = {"model-00001-of-00002.safetensors": {n: a for n, a in tensors.items() if not n.startswith("mtp.")},
              "model-00002-of-00002.safetensors": {n: a for n, a in tensors.items() if n.startswith("mtp.")}}
    dst = tmp_path / "sharded"
    dst.mkdir()
    shutil.copy(os.path.join(src, "config.json"), dst)
    for name, part in shards.items():
        save_file(part, str(dst / name), metadata={"format": "pt"})
    weight_map = {n: name for name, part in shards.items() for n in part}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    target = jspec.load_target(str(dst))
    (dst / "model-00001-of-00002.safetensors").write_bytes(b"damaged")
    _, params = jspec.load_drafter("mtp", target)
    _, want = jspec.load_drafter("mtp", targets["qwen3_5"])
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want), strict=True))


@pytest.mark.parametrize("edit, names", [
    (lambda t: t.update({"mtp.fc.weight": np.zeros((32, 32), np.float32)}),
     ["misshapen tensors", "mtp.fc.weight: checkpoint (32, 32) vs config (32, 64)"]),
    (lambda t: t.pop("mtp.layers.0.self_attn.k_norm.weight"),
     ["missing tensors (1): mtp.layers.0.self_attn.k_norm.weight"]),
    (lambda t: t.update({"mtp.layers.1.input_layernorm.weight": np.zeros(32, np.float32)}),
     ["unexpected tensors (1): mtp.layers.1.input_layernorm.weight"]),
])
def test_bad_mtp_tensors_are_named(tmp_path, edit, names):
    path = _copy("qwen3_5", str(tmp_path / "ckpt"), edit)
    target = jspec.load_target(path)  # the target itself loads: its loader leaves mtp.* to the drafter
    with pytest.raises(CheckpointError) as err:
        jspec.load_drafter("mtp", target)
    assert "the MTP module of checkpoint" in str(err.value)
    for name in names:
        assert name in str(err.value)


def test_unsupported_targets_and_configs_are_refused(targets, tmp_path):
    from jspec.models import transformer
    from jspec.models.config import ModelConfig

    dense = ModelConfig(family="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
    with pytest.raises(ValueError, match="has none: pick another drafter"):
        jspec.load_drafter("mtp", jspec.Target(dense, transformer.init_params(dense, jax.random.key(0))))
    path = str(tmp_path / "two")
    shutil.copytree(targets["qwen3_5"].path, path)
    hf = json.loads(open(os.path.join(path, "config.json")).read())
    hf["mtp_num_hidden_layers"] = 2
    open(os.path.join(path, "config.json"), "w").write(json.dumps(hf))
    with pytest.raises(CheckpointError, match="mtp_num_hidden_layers is 2"):
        jspec.load_drafter("mtp", jspec.load_target(path))
    with pytest.raises(ValueError, match="drafts chains"):
        jspec.load_drafter("mtp", targets["qwen3_5"], tree_budget=4)


def test_training_scores_each_row_on_the_token_after_next(targets):
    """`jspec train mtp`'s loss: row i of one teacher-forced pass reads (h_i, x_{i+1}) and its CE on x_{i+2},
    over the response tokens, equals the float64 reference module's; gradients reach the module."""
    from jspec.drafters import mtp
    from jspec.train.drafter import DrafterLoss

    target = targets["qwen3_5"]
    dr, dparams = jspec.load_drafter("mtp", target)
    ref = Reference(target)
    t = 14

    def rows_logp(tokens, hidden):
        logits = ref.outputs(tokens, hidden) @ ref.head.T
        logp = logits - logits.max(-1, keepdims=True)
        return logp - np.log(np.exp(logp).sum(-1, keepdims=True))

    _, grads, seq, loss_mask, logp = loss_follows_the_reference(target, dr, dparams, rows_logp, DrafterLoss("ce"), t)
    batch = {"tokens": jnp.asarray(seq), "loss_mask": jnp.asarray(loss_mask)}
    assert float(jnp.abs(grads["fc"]).max()) > 0
    assert max(float(jnp.abs(g).max()) for g in jax.tree_util.tree_leaves(grads["layer"])) > 0

    # The rollout loss "edr" over a window covering the whole response (tokens y_j = x_{5+j}) is edr_loss on
    # that rollout with one draft per round, q of y_{j+1} the reference's row 4 + j.
    from jspec.train import drafter as train_drafter
    from jspec.train import losses

    edr, _ = mtp.train_loss(dparams, target.params, target.cfg, dr, DrafterLoss("edr", num_anchors=t - 5), batch,
                            jax.random.key(0))
    _, target_logp = train_drafter.target_pass(target.params, target.cfg, jnp.asarray(seq), ())
    n = t - 5
    q = np.zeros((1, n, 1, target.cfg.vocab_size), np.float32)
    q[0, : n - 1, 0] = logp[4: 4 + n - 1]
    want = losses.edr_loss(jnp.asarray(q), target_logp[:, 4: 4 + n], jnp.asarray(seq[:, 5:]), jnp.ones((1, n)))
    np.testing.assert_allclose(float(edr), float(want), rtol=2e-4)
    assert 1 / 2 <= float(edr) <= 1  # a round commits one or two tokens
