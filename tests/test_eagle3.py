"""The EAGLE-3 drafter (jspec.drafters.eagle3). Its drafts equal a float64 numpy evaluation of the layer written
here from the architecture (chained drafts, across commits, from official-format files in both tensor namings); q
is 0 outside the draft vocabulary; its EAGLE-2 trees are the top-scoring candidates of the same reference; strict
loading names every bad tensor, map and config switch; saving writes the official names back."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jspec
from jspec.drafters import family
from jspec.drafters.base import CommitInfo, DraftContext, PrefillInfo
from jspec.drafters.eagle3 import Eagle3, Eagle3Config, layer_config
from jspec.errors import CheckpointError
from jspec.train.drafter import DrafterLoss
from jspec.models import target as tm
from jspec.models import transformer
from jspec.models.config import ModelConfig
from jspec.verify.rules import GREEDY, SAMPLE
from jspec.verify.sampling import SamplingParams

TARGET = ModelConfig(family="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=8, qk_norm=True)
H, HEADS, KV_HEADS, HEAD_DIM, FFN, DRAFT_V = 24, 4, 2, 8, 48, 40  # the draft layer: narrower than the target
TAPS = [0, 2, 1]  # layer outputs, in the order fc reads them
PROMPTS = [[5, 9, 17, 3, 44, 5, 9, 17, 3], [7, 8, 7, 8, 7, 8], [11, 12, 13, 14, 15, 16, 11, 12, 13, 14, 15]]


def _hf_config(**edits) -> dict:
    """An EAGLE-3 config.json as SpecForge writes one (taps in eagle_config, as layer outputs)."""
    hf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
          "hidden_size": H, "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
          "head_dim": HEAD_DIM, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "max_position_embeddings": 2048, "tie_word_embeddings": False, "vocab_size": TARGET.vocab_size,
          "draft_vocab_size": DRAFT_V, "target_hidden_size": TARGET.hidden_size,
          "eagle_config": {"eagle_aux_hidden_state_layer_ids": TAPS}}
    hf.update(edits)
    return {k: v for k, v in hf.items() if v is not None}


def _weights(seed: int = 0, prefix: str = "midlayer.") -> dict[str, np.ndarray]:
    """Random tensors under the official names and shapes (float32; d2t int64, t2d bool)."""
    rng = np.random.RandomState(seed)
    mat = lambda *shape: (0.25 * rng.randn(*shape)).astype(np.float32)
    norm = lambda n: (1.0 + 0.3 * rng.randn(n)).astype(np.float32)
    ids = np.sort(rng.choice(TARGET.vocab_size, DRAFT_V, replace=False))
    t2d = np.zeros(TARGET.vocab_size, bool)
    t2d[ids] = True
    p = prefix
    return {"fc.weight": mat(H, 3 * TARGET.hidden_size), "norm.weight": norm(H), "lm_head.weight": mat(DRAFT_V, H),
            "embed_tokens.weight": mat(TARGET.vocab_size, H), "d2t": (ids - np.arange(DRAFT_V)).astype(np.int64),
            "t2d": t2d, p + "hidden_norm.weight": norm(H), p + "input_layernorm.weight": norm(H),
            p + "post_attention_layernorm.weight": norm(H),
            p + "self_attn.q_proj.weight": mat(HEADS * HEAD_DIM, 2 * H),
            p + "self_attn.k_proj.weight": mat(KV_HEADS * HEAD_DIM, 2 * H),
            p + "self_attn.v_proj.weight": mat(KV_HEADS * HEAD_DIM, 2 * H),
            p + "self_attn.o_proj.weight": mat(H, HEADS * HEAD_DIM), p + "mlp.gate_proj.weight": mat(FFN, H),
            p + "mlp.up_proj.weight": mat(FFN, H), p + "mlp.down_proj.weight": mat(H, FFN)}


def _write(path, hf: dict, tensors: dict) -> str:
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    return str(path)


@pytest.fixture(scope="module")
def target():
    return jspec.Target(TARGET, transformer.init_params(TARGET, jax.random.key(0), std=0.3))


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    """An official-format checkpoint folder (SpecForge names) and its tensors."""
    w = _weights()
    return _write(tmp_path_factory.mktemp("eagle3") / "official", _hf_config(), w), w


# --- the reference: the layer in float64 numpy, from the architecture ------------------------------------------


def _rms(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x):
    return x / (1.0 + np.exp(-x))


class Reference:
    """EAGLE-3 over one sequence of rows, from the official tensors `w`: row t (position t) reads the token after
    it and a hidden state g (fc of the taps on committed rows, the previous row's layer output on drafted ones),
    and attends causally over rows 0 .. t."""

    def __init__(self, w: dict):
        self.w = {n: np.asarray(a, np.float64) for n, a in w.items() if n not in ("d2t", "t2d")}
        self.ids = np.arange(DRAFT_V) + w["d2t"]  # the target id of each draft id
        self.inv_freq = 1.0 / 10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)

    def _rope(self, x, pos):  # x [Hx, Dh] at one position: rotate-half
        ang = pos * self.inv_freq
        cos, sin = np.cos(np.concatenate([ang, ang])), np.sin(np.concatenate([ang, ang]))
        half = HEAD_DIM // 2
        return x * cos + np.concatenate([-x[:, half:], x[:, :half]], -1) * sin

    def fuse(self, taps):  # taps [3, T, Ht] -> g [T, H]
        return np.concatenate(list(taps), -1) @ self.w["fc.weight"].T

    def run(self, tokens, g_committed):
        """Pre-norm outputs a [T, H] of rows t = 0..T-1 with inputs tokens[t]; rows t < len(g_committed) take
        g_committed[t], later rows the previous row's output."""
        w, p = self.w, "midlayer."
        keys, vals, outs = [], [], []
        for t, token in enumerate(tokens):
            g = g_committed[t] if t < len(g_committed) else outs[-1]
            x = np.concatenate([_rms(w["embed_tokens.weight"][token], w[p + "input_layernorm.weight"]),
                                _rms(g, w[p + "hidden_norm.weight"])])
            q = self._rope((w[p + "self_attn.q_proj.weight"] @ x).reshape(HEADS, HEAD_DIM), t)
            keys.append(self._rope((w[p + "self_attn.k_proj.weight"] @ x).reshape(KV_HEADS, HEAD_DIM), t))
            vals.append((w[p + "self_attn.v_proj.weight"] @ x).reshape(KV_HEADS, HEAD_DIM))
            k, v = np.stack(keys), np.stack(vals)  # [t + 1, Hkv, Dh]
            attn = np.zeros((HEADS, HEAD_DIM))
            for hd in range(HEADS):
                kv = hd // (HEADS // KV_HEADS)
                s = k[:, kv] @ q[hd] / np.sqrt(HEAD_DIM)
                s = np.exp(s - s.max())
                attn[hd] = (s / s.sum()) @ v[:, kv]
            h = g + w[p + "self_attn.o_proj.weight"] @ attn.reshape(-1)
            m = _rms(h, w[p + "post_attention_layernorm.weight"])
            outs.append(h + w[p + "mlp.down_proj.weight"] @ (_silu(w[p + "mlp.gate_proj.weight"] @ m)
                                                               * (w[p + "mlp.up_proj.weight"] @ m)))
        return np.stack(outs)

    def logq(self, a):
        """log q [V] over the target ids of one output a: log-softmax of lm_head(norm(a)), -inf off the draft
        vocabulary."""
        logits = self.w["lm_head.weight"] @ _rms(a, self.w["norm.weight"])
        logits = logits - logits.max()
        out = np.full(TARGET.vocab_size, -np.inf)
        out[self.ids] = logits - np.log(np.exp(logits).sum())
        return out

    def chain_logq(self, seq, g, length, drafts):
        """log q [len(drafts) + 1, V] of each draft depth after committed text seq[:length] (g [>= length - 1, H]
        the fused taps): depth 1 from row length - 2 (the anchor's input), depth k + 1 from the row fed drafts[k-1]."""
        tokens = list(seq[1:length]) + [int(d) for d in drafts]
        a = self.run(tokens, g[: length - 1])
        return np.stack([self.logq(x) for x in a[length - 2:]])


def _draft_to_target_paths(tokens, parent):
    """The tree's nodes as tuples of target ids from the anchor."""
    paths = []
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.append(int(tokens[j]))
            j = int(parent[j])
        paths.append(tuple(reversed(path)))
    return paths


def eagle2_tree(ref: Reference, seq, g, length, k: int, depth: int, budget: int):
    """The EAGLE-2 tree (as paths) from float64 scores: the K best first drafts; per depth each frontier path's K
    best children scored by cumulative log q, the K best of them the next frontier; keep the `budget` best."""
    root = ref.chain_logq(seq, g, length, [])[0]
    best = lambda lq: [int(t) for t in np.argsort(-lq, kind="stable")[:k]]
    cands = [((t,), root[t]) for t in best(root)]
    front = list(cands)
    for _ in range(1, depth):
        children = []
        for path, score in front:
            lq = ref.chain_logq(seq, g, length, path)[-1]
            children += [(path + (t,), score + lq[t]) for t in best(lq)]
        cands += children
        front = sorted(children, key=lambda c: -c[1])[:k]
    return {path for path, _ in sorted(cands, key=lambda c: -c[1])[:budget]}


# --- tests --------------------------------------------------------------------------------------------------------


def _text(seed=1, batch=2, s=40):
    return np.random.RandomState(seed).randint(3, TARGET.vocab_size, (batch, s)).astype(np.int32)


def _full_taps(target, seq, taps):
    b, s = seq.shape
    out = tm.forward(target.params, target.cfg, jnp.asarray(seq), jnp.broadcast_to(jnp.arange(s), (b, s)),
                     tm.init_cache(target.cfg, b, s), taps=taps)[2]
    return np.asarray(out, np.float64)  # [3, B, S, Ht]


def _prefill(target, dr, dparams, seq, lens, p, cache):
    prompts = jnp.asarray(np.where(np.arange(p)[None] < lens[:, None], seq[:, :p], 0))
    b = len(lens)
    taps = tm.forward(target.params, target.cfg, prompts, jnp.broadcast_to(jnp.arange(p), (b, p)),
                      tm.init_cache(target.cfg, b, p), taps=dr.taps)[2]
    info = PrefillInfo(prompts, jnp.asarray(lens), taps, target_params=target.params, target_cfg=target.cfg)
    return dr.init(dparams, info, cache)


def test_drafts_equal_the_reference_across_commits(target, official):
    """init, propose, commit driven by hand on a fixed text (teacher forcing): at every round the served q of all
    three chained drafts equals the float64 reference, after commits of 1 to 4 tokens and for a row whose prompt
    is shorter than the padded batch; q is 0 (log -inf) exactly off the draft vocabulary."""
    path, w = official
    dr, dparams = jspec.load_drafter(path, target, block_size=3)
    assert isinstance(dr, Eagle3) and dr.taps == tuple(TAPS) and dr.cfg.own_embedding and dr.num_drafts == 3
    ref = Reference(w)
    seq, lens, s = _text(), np.array([9, 6], np.int32), 40
    taps = _full_taps(target, seq, dr.taps)
    g = np.stack([ref.fuse(taps[:, b]) for b in range(2)])
    state = _prefill(target, dr, dparams, seq, lens, 9, s)
    propose, commit = jax.jit(dr.propose), jax.jit(dr.commit)
    length = lens + 1  # the prefill's first token is the anchor
    off_vocab = ~np.asarray(w["t2d"])
    for kept in [np.array([1, 4]), np.array([4, 2]), np.array([2, 1]), np.array([3, 3]), None]:
        ctx = DraftContext(jnp.asarray(seq), jnp.asarray(length), jnp.array([3, 4], jnp.uint32), target.params,
                           target_cfg=target.cfg, policy=SAMPLE, sampling=SamplingParams(1.0))
        prop, state = propose(dparams, state, ctx)
        drafts, q = np.asarray(prop.tokens), np.asarray(prop.q_logp)
        for b in range(2):
            want = ref.chain_logq(seq[b], g[b], int(length[b]), drafts[b, :2])
            assert (np.isneginf(q[b]) == off_vocab[None]).all() and (np.isneginf(want) == off_vocab[None]).all()
            np.testing.assert_allclose(np.where(off_vocab, 0, q[b]), np.where(off_vocab, 0, want), atol=2e-4,
                                       err_msg=f"row {b} length {length[b]}")
            assert not off_vocab[drafts[b]].any()  # every draft is a target id of the draft vocabulary
        if kept is None:
            break
        new = length + kept
        rows = (length - 1)[:, None] + np.arange(4)[None]  # the verify pass's rows: anchor, drafts
        commit_taps = np.take_along_axis(taps, rows[None, :, :, None], axis=2)
        state = commit(dparams, state, CommitInfo(jnp.asarray(seq), jnp.asarray(length), jnp.asarray(new),
                                                  jnp.asarray(commit_taps, jnp.float32)))
        length = new


def test_tree_is_the_eagle2_selection_of_the_reference(target, official):
    """The EAGLE-2 tree (K 3, depth 3, 8 nodes) equals the float64 reference's selection, as a set of paths; its
    nodes are topologically ordered with consistent depths and distinct siblings."""
    path, w = official
    dr, dparams = jspec.load_drafter(path, target, block_size=3, tree_budget=8)
    dr = dataclasses.replace(dr, top_k=3)
    assert dr.kind == "tree" and dr.branching == 3 and dr.max_depth == 3
    ref = Reference(w)
    seq, lens = _text(seed=2), np.array([9, 7], np.int32)
    taps = _full_taps(target, seq, dr.taps)
    state = _prefill(target, dr, dparams, seq, lens, 9, 40)
    length = lens + 1
    ctx = DraftContext(jnp.asarray(seq), jnp.asarray(length), jnp.array([3, 4], jnp.uint32), target.params,
                       target_cfg=target.cfg, policy=GREEDY)
    prop, _ = jax.jit(dr.propose)(dparams, state, ctx)
    tokens, parent, depth = (np.asarray(x) for x in (prop.tokens, prop.parent, prop.depth))
    assert prop.q_logp is None and tokens.shape == (2, 8)
    for b in range(2):
        par = parent[b]
        assert all(-1 <= par[i] < i for i in range(8))
        assert all(depth[b, i] == (1 if par[i] < 0 else depth[b, par[i]] + 1) for i in range(8))
        siblings = [tuple(tokens[b, par == p]) for p in set(par.tolist())]
        assert all(len(set(s)) == len(s) for s in siblings)
        g = ref.fuse(taps[:, b])
        want = eagle2_tree(ref, seq[b], g, int(length[b]), k=3, depth=3, budget=8)
        assert set(_draft_to_target_paths(tokens[b], par)) == want


def test_official_files_load_strictly_in_both_namings_and_round_trip(target, official, tmp_path):
    path, w = official
    dr, params = jspec.load_drafter(path, target)
    # vLLM's naming (layers.0.*) and its tap field (layer inputs, top-level) load the same drafter.
    vllm = {("layers.0." + n[len("midlayer."):] if n.startswith("midlayer.") else n): a for n, a in w.items()}
    hf = _hf_config(architectures=["Eagle3LlamaForCausalLM"], eagle_config=None,
                    eagle_aux_hidden_state_layer_ids=[i + 1 for i in TAPS])
    dr2, params2 = jspec.load_drafter(_write(tmp_path / "vllm", hf, vllm), target)
    assert dr2 == dr
    leaves = lambda p: jax.tree_util.tree_leaves(p)
    same = lambda p, q: all(np.array_equal(np.asarray(a), np.asarray(b))
                            for a, b in zip(leaves(p), leaves(q), strict=True))
    assert same(params, params2)
    # Saving writes the official names and values back; the folder is detected and reloads to the same drafter.
    fam = family.get_family("eagle3")
    fam.save(str(tmp_path / "saved"), dr, params)
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert set(saved) == set(w) and all(np.array_equal(saved[n], w[n]) for n in w)
    assert saved["d2t"].dtype == np.int64 and saved["t2d"].dtype == np.bool_
    hf_saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert hf_saved["architectures"] == ["LlamaForCausalLMEagle3"] and hf_saved["draft_vocab_size"] == DRAFT_V
    assert hf_saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == TAPS
    assert family.detect(str(tmp_path / "saved")) is fam
    dr3, params3 = jspec.load_drafter(str(tmp_path / "saved"), target)
    assert dr3 == dr and same(params, params3)
    # Without tap fields the taps default to SpecForge's [1, N/2 - 1, N - 4] for the target's depth.
    dr4, _ = jspec.load_drafter(_write(tmp_path / "bare", _hf_config(eagle_config=None), w), target)
    assert dr4.taps == (1, 1, 0)
    # Without embed_tokens the drafter embeds with the target's (which needs the target's width).
    no_embed = {n: a for n, a in w.items() if n != "embed_tokens.weight"}
    with pytest.raises(ValueError, match="cannot embed with the target's embedding"):
        jspec.load_drafter(_write(tmp_path / "narrow", _hf_config(), no_embed), target)


@pytest.mark.parametrize("edit, names", [
    (lambda w, hf: w.update({"fc.weight": np.zeros((H, 2 * H), np.float32)}),
     ["misshapen tensors", "fc.weight: checkpoint (24, 48) vs config (24, 96)"]),
    (lambda w, hf: w.pop("midlayer.self_attn.k_proj.weight"),
     ["missing tensors (1): midlayer.self_attn.k_proj.weight"]),
    (lambda w, hf: w.update({"midlayer.self_attn.q_norm.weight": np.ones(8, np.float32)}),
     ["unexpected tensors (1): midlayer.self_attn.q_norm.weight"]),
    (lambda w, hf: w.pop("d2t"), ["missing tensors (1): d2t"]),
    (lambda w, hf: w.update({"t2d": w["t2d"].astype(np.float32)}), ["t2d: float32 (expected bool)"]),
    (lambda w, hf: w.update({"layers.0.norm_x.weight": np.ones(H, np.float32)}), ["under both 'midlayer.'"]),
    (lambda w, hf: w["t2d"].__setitem__(np.flatnonzero(~w["t2d"])[0], True), ["t2d marks 41 target ids"]),
    (lambda w, hf: w["d2t"].__setitem__(-1, 10 ** 4), ["outside the target vocabulary"]),
    (lambda w, hf: hf.update(fc_norm=True), ["fc_norm: True", "does not implement"]),
    (lambda w, hf: hf.update(num_hidden_layers=2), ["one decoder layer"]),
    (lambda w, hf: hf.pop("draft_vocab_size"), ["lacks required fields ['draft_vocab_size']"]),
    (lambda w, hf: hf.update(eagle_aux_hidden_state_layer_ids=[1, 2, 3]), ["name different layers"]),
])
def test_bad_checkpoints_are_refused_naming_the_problem(target, tmp_path, edit, names):
    w, hf = _weights(), _hf_config()
    edit(w, hf)
    path = _write(tmp_path / "bad", hf, w)
    with pytest.raises(CheckpointError) as err:
        jspec.load_drafter(path, target)
    for name in names:
        assert name in str(err.value)


def test_detect_is_strict():
    detect = family.get_family("eagle3").detect
    assert detect(_hf_config()) and detect(_hf_config(architectures=["Eagle3LlamaForCausalLM"]))
    assert not detect({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert not detect({"model_type": "llama", "draft_vocab_size": 10})


def test_refuses_a_target_it_does_not_fit(target, official):
    dr, params = jspec.load_drafter(official[0], target)
    other = ModelConfig(family="qwen3", vocab_size=96, hidden_size=48, intermediate_size=64, num_layers=3,
                        num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
    with pytest.raises(ValueError) as err:
        dr.validate(other, params)
    assert "target_hidden_size 32 != the target's hidden size 48" in str(err.value)
    assert "taps [0, 2, 1] include [2]" in str(err.value)
    cfg = Eagle3Config(layer=layer_config(TARGET), draft_vocab_size=10, target_hidden_size=32, taps=(0, 1, 2))
    with pytest.raises(ValueError, match="draft shape"):
        Eagle3(cfg=cfg, block_size=0).validate(TARGET, None)


def test_speculative_decoding_equals_plain_decoding(target, official):
    """The official-format drafter (own embedding, narrower layer) as a chain under greedy verification and as an
    EAGLE-2 tree under Gumbel coupling: the target's own tokens."""
    kw = dict(max_new_tokens=12, seeds=[1, 2, 3], eos_ids=[], cache_size=64)
    for sampling, verifier, shape in [(SamplingParams(0.0), "greedy", dict(block_size=3)),
                                      (SamplingParams(1.0), "gumbel", dict(block_size=3, tree_budget=6))]:
        base = jspec.generate(target, PROMPTS, sampling=sampling, **kw)
        res = jspec.generate(target, PROMPTS, drafter=official[0], verifier=verifier, sampling=sampling, **shape, **kw)
        assert res.tokens == base.tokens, verifier
        assert res.stats["tau"] >= 1.0


# --- training ---------------------------------------------------------------------------------------------------


def test_training_time_test_steps_equal_the_chained_reference(target, official):
    """Step i of the training-time test at row t is the chain drafted after committed text x_0..x_{t+1} with the
    data tokens x_{t+2}..x_{t+1+i} as drafts: its log q equals the float64 reference's depth i + 1."""
    from jspec.drafters.eagle3 import fuse, ttt_logq

    path, w = official
    dr, dparams = jspec.load_drafter(path, target)
    ref = Reference(w)
    seq = _text(seed=3, batch=1, s=16)
    taps = _full_taps(target, seq, dr.taps)
    steps = 4
    logq = np.asarray(jax.jit(lambda p, tp, tk: ttt_logq(p, dr.cfg, p["embed"], tp, tk, steps))(
        dparams, jnp.asarray(taps, jnp.float32), jnp.asarray(seq)))
    assert logq.shape == (steps, 1, 16, DRAFT_V)
    ids = np.arange(DRAFT_V) + w["d2t"]
    g = ref.fuse(taps[:, 0])
    np.testing.assert_allclose(np.asarray(fuse(dparams, jnp.asarray(taps, jnp.float32)))[0], g, atol=1e-4)
    for t in (0, 5, 11):
        want = ref.chain_logq(seq[0], g, t + 2, seq[0, t + 2: t + 1 + steps])
        for i in range(steps):
            np.testing.assert_allclose(logq[i, 0, t], want[i, ids], atol=2e-4, err_msg=f"step {i} row {t}")


def test_the_recipe_builds_and_its_loss_trains(target):
    fam = family.get_family("eagle3")
    assert "eagle3" in family.trainable() and fam.recipe.frozen == ("d2t",)
    dr, params = fam.recipe.build({"drafter": {"block_size": 3}, "init_std": 0.1}, target, jax.random.key(1))
    assert dr.taps == (1, 1, 0) and dr.cfg.draft_vocab_size == TARGET.vocab_size and dr.block_size == 3
    with pytest.raises(ValueError, match="whole vocabulary"):
        fam.recipe.build({"drafter": {"draft_vocab_size": 10}}, target, jax.random.key(1))
    tokens = jnp.asarray(_text(seed=4, batch=2, s=20))
    batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens).at[:, :4].set(0)}
    trainable = {k: v for k, v in params.items() if k != "d2t"}

    def loss(p):
        return fam.recipe.loss({**p, "d2t": params["d2t"]}, target.params, target.cfg, dr, DrafterLoss("ttt"), batch,
                               jax.random.key(0))

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (first, metrics), grads = step(trainable)
    assert np.isfinite(float(first)) and {"acc", "acc_0", "acc_6"} <= set(metrics)
    for g in jax.tree_util.tree_leaves(grads):
        assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0
    for _ in range(5):  # a few steps of gradient descent lower the loss
        trainable = jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, trainable, grads)
        (last, _), grads = step(trainable)
    assert float(last) < float(first)


def test_every_run_loss_scores_the_unrolled_steps_as_blocks(target, official):
    """A run loss other than "ttt" reads step i at row a - 1 as slot i of the round anchored at a, over the draft
    vocabulary: its CE equals a loop over the anchors written here (labels x_{a+1+i} mapped through d2t, the
    target's row restricted to the draft vocabulary, a block ending at its first token outside it); every loss
    of jspec.train.losses gives a finite value and gradient."""
    from jspec.drafters.eagle3 import TTT_STEPS, _block_loss, ttt_logq
    from jspec.train import drafter as train_drafter
    from jspec.train import losses

    path, w = official
    dr, dparams = jspec.load_drafter(path, target)
    fam = family.get_family("eagle3")
    tokens = jnp.asarray(_text(seed=5, batch=2, s=24))
    loss_mask = jnp.ones_like(tokens).at[:, :6].set(0)
    batch, key = {"tokens": tokens, "loss_mask": loss_mask}, jax.random.key(3)
    spec = DrafterLoss("ce", num_anchors=6, gamma=2.0)
    got, metrics = fam.recipe.loss(dparams, target.params, target.cfg, dr, spec, batch, key)

    taps, target_logp = train_drafter.target_pass(target.params, target.cfg, tokens, dr.taps)
    embed = dparams["embed"] if dr.cfg.own_embedding else target.params["embed"]
    logq = np.asarray(ttt_logq(dparams, dr.cfg, embed, taps, tokens), np.float64)
    target_logp = np.asarray(target_logp, np.float64)
    anchors, valid = (np.asarray(x) for x in train_drafter.sample_anchors(key, loss_mask, spec.num_anchors))
    ids = list(np.arange(DRAFT_V) + w["d2t"])
    seq, lm = np.asarray(tokens), np.asarray(loss_mask)
    num = den = 0.0
    for b in range(2):
        for j in range(spec.num_anchors):
            a = int(anchors[b, j])
            if not valid[b, j] or a < 1:
                continue
            for i in range(TTT_STEPS):
                pos = a + 1 + i
                if pos >= seq.shape[1] or not lm[b, pos] or seq[b, pos] not in ids:
                    break  # the block ends here
                weight = np.exp(-i / spec.gamma)
                num += weight * -logq[i, b, a - 1, ids.index(seq[b, pos])]
                den += weight
    assert den > 0
    np.testing.assert_allclose(float(got), num / den, rtol=1e-4)
    assert {"acc", "alpha", "tau"} <= set(metrics)

    # The gradient reaches every parameter through the unrolled steps (one loss: the steps do not depend on
    # it), and every loss's value and gradient on the steps' log-probs are finite and not all zero (one
    # compile per loss of the block part alone: the recipe's `_block_loss`).
    trainable = {k: v for k, v in dparams.items() if k != "d2t"}
    grad_fn = jax.jit(jax.value_and_grad(lambda p: fam.recipe.loss(
        {**p, "d2t": dparams["d2t"]}, target.params, target.cfg, dr, DrafterLoss("kl", num_anchors=6), batch, key),
        has_aux=True))
    (value, _), grads = grad_fn(trainable)
    assert np.isfinite(float(value)) and set(grads) == set(trainable)
    for g in jax.tree_util.tree_leaves(grads):
        assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0
    ids_j = jnp.asarray(ids, jnp.int32)
    in_draft = jnp.zeros((target.cfg.vocab_size,), bool).at[ids_j].set(True)
    logq_j = jnp.asarray(logq, jnp.float32)
    for name in losses.LOSSES:
        value, g = jax.jit(jax.value_and_grad(lambda lq, s=DrafterLoss(name, num_anchors=6): _block_loss(
            lq, ids_j, in_draft, s, tokens, loss_mask, jnp.asarray(target_logp, jnp.float32), key)[0]))(logq_j)
        assert np.isfinite(float(value)), name
        assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0, name
