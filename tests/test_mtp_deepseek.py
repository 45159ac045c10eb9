"""The MTP drafter in DeepSeek-V3's layout (`jspec.drafters.nextn`): `enorm`, `hnorm`, `eh_proj`, `shared_head.*`,
`embed_tokens` and a decoder layer after a dense target's own (`model.layers.{L}.*`, config.json's
`num_nextn_predict_layers`). Checkpoints are written here under the official names; the drafts equal a float64
numpy evaluation of the module written from the architecture (depth 1, and depth 2 chained on the pre-norm
output) across commits; speculative decoding with it gives plain decoding's tokens; loading is strict and
names the file's tensors; a DeepSeek-V3 (MLA + MoE) module is refused by name."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mtp_helpers import drafts_follow_the_reference_across_commits, extended_checkpoint, loss_follows_the_reference
from safetensors.numpy import load_file

import jspec
from jspec.drafters import family, mtp
from jspec.drafters.base import DraftContext
from jspec.errors import CheckpointError
from jspec.verify.rules import SAMPLE
from jspec.verify.sampling import SamplingParams

FAMILIES = ("qwen3", "llama-tied")
PROMPTS = [[5, 9, 17, 3, 44, 5, 9, 17, 3], [7, 8, 7, 8, 7, 8], [11, 12, 13, 14, 15, 16, 11, 12, 13, 14, 15]]


def _nextn_weights(hf: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random DeepSeek-layout MTP tensors, official names, after the model's own layers (float32)."""
    rng = np.random.RandomState(seed)
    d, v, f = hf["hidden_size"], hf["vocab_size"], hf["intermediate_size"]
    hq, hkv, dh = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    mat = lambda *shape: (0.2 * rng.randn(*shape)).astype(np.float32)
    norm = lambda n: (1.0 + 0.3 * rng.randn(n)).astype(np.float32)
    p = f"model.layers.{hf['num_hidden_layers']}."
    w = {p + "enorm.weight": norm(d), p + "hnorm.weight": norm(d), p + "eh_proj.weight": mat(d, 2 * d),
         p + "shared_head.norm.weight": norm(d), p + "shared_head.head.weight": mat(v, d),
         p + "embed_tokens.weight": mat(v, d),
         p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
         p + "self_attn.q_proj.weight": mat(hq * dh, d), p + "self_attn.k_proj.weight": mat(hkv * dh, d),
         p + "self_attn.v_proj.weight": mat(hkv * dh, d), p + "self_attn.o_proj.weight": mat(d, hq * dh),
         p + "mlp.gate_proj.weight": mat(f, d), p + "mlp.up_proj.weight": mat(f, d),
         p + "mlp.down_proj.weight": mat(d, f)}
    if hf["model_type"] == "qwen3":
        w.update({p + "self_attn.q_norm.weight": norm(dh), p + "self_attn.k_norm.weight": norm(dh)})
    return w


def _copy(src: str, dst: str, edit=None) -> str:
    """The transformers checkpoint `src` with a DeepSeek-layout MTP layer added (then edited by `edit`)."""
    return extended_checkpoint(src, dst, _nextn_weights, {"num_nextn_predict_layers": 1}, edit)


@pytest.fixture(scope="module")
def targets(hf_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("nextn")
    return {f: jspec.load_target(_copy(hf_checkpoints(f)[0], str(root / f))) for f in FAMILIES}


# --- the reference: the module in float64 numpy, from the architecture ------------------------------------------


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x):
    return x / (1.0 + np.exp(-x))


class Reference:
    """The DeepSeek-layout module of target checkpoint `target` over one sequence of rows (causal)."""

    def __init__(self, target):
        c = target.cfg
        p = f"model.layers.{c.num_layers}."
        self.w = {n[len(p):]: a.astype(np.float64)
                  for n, a in load_file(os.path.join(target.path, "model.safetensors")).items() if n.startswith(p)}
        self.c = c
        self.inv_freq = 1.0 / c.rope_theta ** (np.arange(0, c.head_dim, 2) / c.head_dim)

    def _rope(self, x, pos):  # x [T, H, Dh], rotate-half
        ang = pos[:, None] * self.inv_freq[None]
        cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
        half = x.shape[-1] // 2
        return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin

    def outputs(self, tokens, hidden):
        """o [T, D] (the residual stream after the layer, before shared_head.norm) of rows t = 0..T-1 at
        position t: inputs tokens[t] (x_{t+1}) and hidden[t]."""
        w, c, eps = self.w, self.c, self.c.rms_norm_eps
        t_len, hq, hkv, dh = len(tokens), c.num_heads, c.num_kv_heads, c.head_dim
        e = _rms(w["embed_tokens.weight"][np.asarray(tokens)], w["enorm.weight"], eps)
        u = np.concatenate([e, _rms(np.asarray(hidden, np.float64), w["hnorm.weight"], eps)], -1)
        u = u @ w["eh_proj.weight"].T
        x = _rms(u, w["input_layernorm.weight"], eps)
        q = (x @ w["self_attn.q_proj.weight"].T).reshape(t_len, hq, dh)
        k = (x @ w["self_attn.k_proj.weight"].T).reshape(t_len, hkv, dh)
        v = (x @ w["self_attn.v_proj.weight"].T).reshape(t_len, hkv, dh)
        if "self_attn.q_norm.weight" in w:
            q, k = _rms(q, w["self_attn.q_norm.weight"], eps), _rms(k, w["self_attn.k_norm.weight"], eps)
        pos = np.arange(t_len, dtype=np.float64)
        q, k = self._rope(q, pos), self._rope(k, pos)
        attn = np.zeros((t_len, hq, dh))
        for h in range(hq):
            kv = h // (hq // hkv)
            s = q[:, h] @ k[:, kv].T / np.sqrt(dh) + np.triu(np.full((t_len, t_len), -np.inf), 1)
            s = np.exp(s - s.max(-1, keepdims=True))
            attn[:, h] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        h1 = u + attn.reshape(t_len, hq * dh) @ w["self_attn.o_proj.weight"].T
        x = _rms(h1, w["post_attention_layernorm.weight"], eps)
        mlp = (_silu(x @ w["mlp.gate_proj.weight"].T) * (x @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
        return h1 + mlp

    def logp(self, o):
        logits = _rms(o, self.w["shared_head.norm.weight"], self.c.rms_norm_eps) @ self.w["shared_head.head.weight"].T
        shifted = logits - logits.max(-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

    def chain_logp(self, seq, hidden, length, drafts):
        """log q of drafts 1 and 2 for committed text seq[:length]: row length - 2 reads (h_{length-2}, the
        anchor); depth 2 reads (depth 1's pre-norm output, drafts[0])."""
        toks = list(seq[1:length])
        o = self.outputs(toks, hidden[: length - 1])
        o2 = self.outputs(toks + [int(drafts[0])], np.concatenate([hidden[: length - 1], o[-1:]]))
        return self.logp(np.stack([o[-1], o2[-1]]))


# --- tests --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fam", FAMILIES)
def test_drafts_equal_the_reference_module_across_commits(targets, fam):
    """init, propose, commit driven by hand on a fixed text: at every round the served q of draft 1 and of draft 2
    (chained on the module's own pre-norm output) equal the float64 reference, after commits of 1, 2 and 3
    tokens and for a row whose prompt is shorter than the padded batch."""
    target = targets[fam]
    dr, dparams = jspec.load_drafter("mtp", target, block_size=2)
    assert isinstance(dr, mtp.MTP) and dr.layout == "deepseek"
    drafts_follow_the_reference_across_commits(target, dr, dparams, Reference(target).chain_logp, fam)


@pytest.mark.parametrize("fam", FAMILIES)
def test_speculative_decoding_equals_plain_decoding(targets, fam):
    target = targets[fam]
    for sampling, verifier, g in [(SamplingParams(0.0), "greedy", 3), (SamplingParams(1.0), "gumbel", 2)]:
        kwargs = dict(max_new_tokens=16, sampling=sampling, seeds=[1, 2, 3], eos_ids=[])
        base = jspec.generate(target, PROMPTS, **kwargs)
        res = jspec.generate(target, PROMPTS, drafter="mtp", verifier=verifier, block_size=g, **kwargs)
        assert res.tokens == base.tokens, (fam, verifier)


def test_the_target_leaves_its_module_to_the_drafter(targets, hf_checkpoints, tmp_path):
    """The target loads as the plain checkpoint does; a layer past num_nextn_predict_layers stays unexpected."""
    plain = jspec.load_target(hf_checkpoints("qwen3")[0])
    for a, b in zip(jax.tree_util.tree_leaves(targets["qwen3"].params), jax.tree_util.tree_leaves(plain.params),
                    strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    extra = lambda t: t.update({"model.layers.3.enorm.weight": np.ones(64, np.float32)})
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(1\): model.layers.3.enorm.weight"):
        jspec.load_target(_copy(hf_checkpoints("qwen3")[0], str(tmp_path / "extra"), extra))


def test_checkpoint_round_trip_in_official_names(targets, tmp_path):
    """Saved as SGLang's standalone NextN folder: the target's model.layers.2.* tensors as model.layers.0.*,
    detected as an MTP drafter, loaded back to the same drafter and parameters."""
    target = targets["qwen3"]
    dr, params = jspec.load_drafter("mtp", target)
    fam = family.get_family("mtp")
    fam.save(str(tmp_path), dr, params)
    saved = load_file(str(tmp_path / "model.safetensors"))
    own = {n.replace("model.layers.2.", "model.layers.0."): a
           for n, a in load_file(os.path.join(target.path, "model.safetensors")).items()
           if n.startswith("model.layers.2.")}
    assert set(saved) == set(own) and all(np.array_equal(saved[n], own[n]) for n in saved)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3ForCausalLMNextN"] and hf["num_nextn_predict_layers"] == 1
    assert hf["num_hidden_layers"] == 1 and hf["num_target_layers"] == 2
    assert family.detect(str(tmp_path)) is fam
    loaded, loaded_params = jspec.load_drafter(str(tmp_path), target, block_size=3)
    assert loaded == dataclasses.replace(dr, block_size=3)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(loaded_params), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="layer differs from the target's"):
        jspec.load_drafter(str(tmp_path), targets["llama-tied"])


@pytest.mark.parametrize("edit, names", [
    (lambda t: t.update({"model.layers.2.eh_proj.weight": np.zeros((64, 64), np.float32)}),
     ["misshapen tensors", "model.layers.2.eh_proj.weight: checkpoint (64, 64) vs config (64, 128)"]),
    (lambda t: t.pop("model.layers.2.shared_head.norm.weight"),
     ["missing tensors (1): model.layers.2.shared_head.norm.weight"]),
    (lambda t: t.update({"model.layers.2.mlp.gate.weight": np.zeros((8, 64), np.float32)}),
     ["unexpected tensors (1): model.layers.2.mlp.gate.weight"]),
])
def test_bad_module_tensors_are_named_as_the_file_names_them(hf_checkpoints, tmp_path, edit, names):
    target = jspec.load_target(_copy(hf_checkpoints("qwen3")[0], str(tmp_path / "ckpt"), edit))
    with pytest.raises(CheckpointError) as err:
        jspec.load_drafter("mtp", target)
    assert "DeepSeek-layout MTP module of checkpoint" in str(err.value)
    for name in names:
        assert name in str(err.value)


def test_deepseek_v3_modules_and_other_counts_are_refused(targets, hf_checkpoints, tmp_path):
    ds = tmp_path / "r1-nextn"
    ds.mkdir()
    (ds / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLMNextN"], "model_type": "deepseek_v3", "num_nextn_predict_layers": 1,
        "num_hidden_layers": 1, "hidden_size": 7168, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "n_routed_experts": 256, "vocab_size": 129280}))
    with pytest.raises(CheckpointError, match="Multi-head Latent Attention with a DeepSeekMoE MLP"):
        jspec.load_drafter(str(ds), targets["qwen3"])
    path = _copy(hf_checkpoints("qwen3")[0], str(tmp_path / "two"))
    hf = json.loads(open(os.path.join(path, "config.json")).read())
    hf["num_nextn_predict_layers"] = 2
    open(os.path.join(path, "config.json"), "w").write(json.dumps(hf))
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers is 2"):
        jspec.load_drafter("mtp", jspec.load_target(path))
    with pytest.raises(ValueError, match="has none: pick another drafter"):
        jspec.load_drafter("mtp", jspec.load_target(hf_checkpoints("qwen3")[0]))


def test_training_scores_each_row_on_the_token_after_next(targets):
    """`jspec train mtp` with "layout": "deepseek": the embedding and head start as the target's and are the
    recipe's frozen copies; row i's CE on x_{i+2} equals the float64 reference's; gradients reach eh_proj and
    the layer."""
    from jspec.train.drafter import DrafterLoss

    target = targets["llama-tied"]
    recipe = family.get_family("mtp").recipe
    built, init = recipe.build({"drafter": {"layout": "deepseek", "block_size": 3}}, target, jax.random.key(0))
    assert built.layout == "deepseek" and built.block_size == 3 and set(recipe.frozen) <= set(init)
    assert init["embed"] is target.params["embed"] and init["head"] is target.params["embed"]  # tied

    dr, dparams = jspec.load_drafter("mtp", target)
    ref = Reference(target)
    rows_logp = lambda tokens, hidden: ref.logp(ref.outputs(tokens, hidden))
    _, grads, *_ = loss_follows_the_reference(target, dr, dparams, rows_logp, DrafterLoss("ce"))
    assert float(jnp.abs(grads["eh_proj"]).max()) > 0
    assert max(float(jnp.abs(g).max()) for g in jax.tree_util.tree_leaves(grads["layer"])) > 0


def test_offline_rows_are_the_proposals_q(targets):
    """The offline evaluator's rows (`Family.offline`) along a text continued with the drafter's own sampled
    drafts are the q its proposal reported, over the whole vocabulary (T = 0.8, top-p 0.95; 2 prompts)."""
    from jspec.decode import ar, spec
    from jspec.train import evaluate

    target = targets["qwen3"]
    drafter, dparams = jspec.load_drafter("mtp", target, block_size=3)
    sampling = SamplingParams(0.8, top_p=0.95)
    prompts = jnp.asarray([p[:6] for p in PROMPTS[:2]], jnp.int32)
    dcfg = ar.DecodeConfig(max_new_tokens=8, cache_size=32, sampling=sampling)

    @jax.jit
    def first_round(prompts, seeds):
        state = spec.start(target.params, dparams, target.cfg, drafter, dcfg, prompts, jnp.full((2,), 6), seeds)
        core = state.core
        ctx = DraftContext(core.tokens, core.length, core.seeds, target.params, target_cfg=target.cfg,
                           policy=SAMPLE, sampling=sampling, target_cache=core.cache)
        return core.tokens, drafter.propose(dparams, state.draft, ctx)[0]

    tokens, prop = first_round(prompts, jnp.asarray([5, 6], jnp.uint32))
    text = jnp.concatenate([tokens[:, :7], prop.tokens], axis=1)  # prompt, the prefill's token, the drafts
    _, rounds = evaluate.text_rows(target.params, target.cfg, drafter, dparams, text, sampling.traced())
    logq = np.asarray(rounds(jnp.full((2, 1), 6))[1])[:, 0]
    want = np.asarray(prop.q_logp)
    np.testing.assert_array_equal(np.isinf(logq), np.isinf(want))
    np.testing.assert_allclose(np.exp(logq), np.exp(want), atol=2e-3)
