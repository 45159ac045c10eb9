"""Medusa and Hydra heads (jspec.drafters.heads). Folders written here in the official tensor names (and vLLM's
Medusa renaming) load strictly and round-trip; missing and unexpected tensors are named; Medusa-2's lossy
typical acceptance and the Hydra variants jspec does not run are refused by name. The drafts' served q (chains)
and the tree tokens equal a float64 numpy evaluation of the heads written here from the architecture, across
commits of every accepted count; speculative decoding with loaded heads gives plain decoding's tokens; the
training recipe starts every head at the target's LM head and lowers its loss. The conformance suite
(tests/test_conformance.py) runs the shared checks on both families' random examples."""

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
from jspec.drafters.heads import HYDRA, MEDUSA, Hydra, Medusa, default_tree, head_logits
from jspec.errors import CheckpointError
from jspec.models import target as tm
from jspec.models import transformer
from jspec.models.config import ModelConfig
from jspec.train.distill import build_drafter
from jspec.train.drafter import DrafterLoss
from jspec.verify.rules import SAMPLE
from jspec.verify.sampling import SamplingParams

CFG = ModelConfig(family="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, qk_norm=True)
K, L = 3, 2  # heads, residual layers per head
PROMPTS = [[5, 9, 17, 3, 44, 5, 9, 17], [7, 8, 7, 8, 7, 8], [11, 12, 13, 14, 11, 12, 13]]


@pytest.fixture(scope="module")
def target():
    return jspec.Target(CFG, transformer.init_params(CFG, jax.random.key(0), std=0.3))


def official_tensors(kind: str, seed: int = 0, k: int = K, layers: int = L) -> dict[str, np.ndarray]:
    """Random head tensors in the official names and shapes (float32)."""
    rng = np.random.RandomState(seed)
    h, v = CFG.hidden_size, CFG.vocab_size
    mat = lambda *shape: (0.3 * rng.randn(*shape)).astype(np.float32)
    w = {}
    for i in range(k):
        if kind == MEDUSA:
            for j in range(layers):
                w.update({f"{i}.{j}.linear.weight": mat(h, h), f"{i}.{j}.linear.bias": mat(h)})
            w[f"{i}.{layers}.weight"] = mat(v, h)
        else:
            p = f"hydra_mlp.{i}."
            w.update({p + "0.linear.weight": mat(h, (i + 2) * h), p + "0.linear.bias": mat(h),
                      p + "0.res_connection.weight": mat(h, (i + 2) * h), p + "0.res_connection.bias": mat(h)})
            for j in range(1, layers):
                w.update({f"{p}{j}.linear.weight": mat(h, h), f"{p}{j}.linear.bias": mat(h)})
            w.update({f"hydra_lm_head.{i}.weight": mat(v, h), f"hydra_lm_head.{i}.bias": mat(v)})
    return w


def official_config(kind: str, k: int = K, layers: int = L) -> dict:
    """config.json as the official code writes it (no sizes: they come from the tensors)."""
    if kind == MEDUSA:
        return {"medusa_num_heads": k, "medusa_num_layers": layers, "base_model_name_or_path": "tiny"}
    return {"hydra_num_heads": k, "hydra_num_layers": layers, "hydra_head_arch": "mlp", "grounded_heads": True,
            "hidden_state_offset": 0, "base_model_name_or_path": "tiny"}


def write(path, config: dict, tensors: dict, filename: str = "model.safetensors") -> str:
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, filename), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


# --- the reference: the heads in float64 numpy, from the architecture ----------------------------------------------


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


class Reference:
    """Head k of official tensors `w`: Medusa on h; Hydra on cat[h, E(anchor), E(d_1), .., E(d_k)]."""

    def __init__(self, kind: str, w: dict, target):
        self.kind, self.w = kind, {n: a.astype(np.float64) for n, a in w.items()}
        self.embed = np.asarray(target.params["embed"], np.float64)

    def logits(self, k: int, h, path=()):
        w = self.w
        if self.kind == MEDUSA:
            x = h
            for j in range(L):
                x = x + _silu(x @ w[f"{k}.{j}.linear.weight"].T + w[f"{k}.{j}.linear.bias"])
            return x @ w[f"{k}.{L}.weight"].T
        p = f"hydra_mlp.{k}."
        u = np.concatenate([h] + [self.embed[t] for t in path])
        assert len(path) == k + 1  # the anchor and drafts 1 .. k
        x = u @ w[p + "0.res_connection.weight"].T + w[p + "0.res_connection.bias"] + _silu(
            u @ w[p + "0.linear.weight"].T + w[p + "0.linear.bias"])
        for j in range(1, L):
            x = x + _silu(x @ w[f"{p}{j}.linear.weight"].T + w[f"{p}{j}.linear.bias"])
        return x @ w[f"hydra_lm_head.{k}.weight"].T + w[f"hydra_lm_head.{k}.bias"]

    def chain_logp(self, h, anchor, drafts):
        """log q [K, V] of each draft: Medusa's heads on h alone, Hydra's given the drafts before it."""
        return np.stack([_log_softmax(self.logits(k, h, (anchor, *drafts[:k]))) for k in range(len(drafts))])

    def tree_tokens(self, h, anchor, tree):
        """The token of every rank path: the rank-r token of head d - 1 (Hydra: on the path's ancestors)."""
        tokens = {}
        for p in tree:
            ancestors = tuple(tokens[p[:j]] for j in range(1, len(p)))
            tokens[p] = int(np.argsort(-self.logits(len(p) - 1, h, (anchor, *ancestors)), kind="stable")[p[-1]])
        return [tokens[p] for p in tree]


# --- tests -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [MEDUSA, HYDRA])
def test_drafts_equal_the_float64_reference_across_commits(target, kind, tmp_path):
    """init, propose, commit driven by hand on a fixed text (teacher forcing): each round's chain q and tree
    tokens equal the reference on the target's hidden state at length - 2 (the row that gave the anchor), after
    commits of 1, 2, 3 and 4 tokens and for a row whose prompt is shorter than the padded batch."""
    w = official_tensors(kind)
    dr, dparams = jspec.load_drafter(write(tmp_path / kind, official_config(kind), w), target)
    assert isinstance(dr, Medusa if kind == MEDUSA else Hydra) and dr.kind == "chain" and dr.num_drafts == K
    tree_dr = dataclasses.replace(dr, tree=default_tree(7, K))
    ref = Reference(kind, w, target)
    cfg, params = target.cfg, target.params
    rng = np.random.RandomState(1)
    s, p = 40, 9
    seq = rng.randint(3, cfg.vocab_size, (2, s)).astype(np.int32)
    lens = np.array([9, 6], np.int32)
    hidden = np.asarray(tm.forward(params, cfg, jnp.asarray(seq), jnp.broadcast_to(jnp.arange(s), (2, s)),
                                   tm.init_cache(cfg, 2, s))[0], np.float64)  # final-normed, the whole text
    prompts = jnp.asarray(np.where(np.arange(p)[None] < lens[:, None], seq[:, :p], 0))
    taps = tm.forward(params, cfg, prompts, jnp.broadcast_to(jnp.arange(p), (2, p)), tm.init_cache(cfg, 2, p),
                      taps=dr.taps, lengths=jnp.asarray(lens))[2]
    state = dr.init(dparams, PrefillInfo(prompts, jnp.asarray(lens), taps, target_params=params, target_cfg=cfg), s)
    propose, propose_tree, commit = jax.jit(dr.propose), jax.jit(tree_dr.propose), jax.jit(dr.commit)
    length = lens + 1  # the prefill's first token is the anchor
    for kept in [np.array([1, 3]), np.array([4, 2]), np.array([2, 1]), None]:
        ctx = DraftContext(jnp.asarray(seq), jnp.asarray(length), jnp.array([3, 4], jnp.uint32), params,
                           target_cfg=cfg, policy=SAMPLE, sampling=SamplingParams(1.0))
        prop, _ = propose(dparams, state, ctx)
        tree, _ = propose_tree(dparams, state, ctx)
        drafts, q = np.asarray(prop.tokens), np.asarray(prop.q_logp)
        for b in range(2):
            h, anchor = hidden[b, length[b] - 2], int(seq[b, length[b] - 1])
            np.testing.assert_allclose(q[b], ref.chain_logp(h, anchor, [int(t) for t in drafts[b]]), atol=2e-4,
                                       err_msg=f"{kind} row {b} length {length[b]}")
            assert np.asarray(tree.tokens[b]).tolist() == ref.tree_tokens(h, anchor, tree_dr.tree), (kind, b)
        if kept is None:
            break
        new = length + kept
        rows = (length - 1)[:, None] + np.arange(K + 1)[None]  # the verify pass's rows: anchor, drafts
        info = CommitInfo(jnp.asarray(seq), jnp.asarray(length), jnp.asarray(new), None,
                          jnp.asarray(np.take_along_axis(hidden, rows[..., None], axis=1), jnp.float32))
        state = commit(dparams, state, info)
        length = new
    lay = tree_dr.tree
    assert np.asarray(tree.depth[0]).tolist() == [len(p) for p in lay]
    assert np.asarray(tree.parent[0]).tolist() == [lay.index(p[:-1]) if len(p) > 1 else -1 for p in lay]
    assert tree.q_logp is None and tree_dr.tree_children == "deterministic"


@pytest.mark.parametrize("kind, filename", [(MEDUSA, "medusa_lm_head.safetensors"), (HYDRA, "model.safetensors")])
def test_official_checkpoints_load_strictly_and_round_trip(target, kind, filename, tmp_path):
    w = official_tensors(kind)
    src = write(tmp_path / "src", official_config(kind), w, filename)
    fam = family.get_family(kind)
    assert family.detect(src) is fam
    dr, params = jspec.load_drafter(src, target)
    assert (dr.cfg.num_heads, dr.cfg.num_layers, dr.cfg.hidden_size, dr.cfg.vocab_size) == (K, L, 32, 96)
    fam.save(str(tmp_path / "dst"), dr, params)
    saved = load_file(str(tmp_path / "dst" / "model.safetensors"))
    assert set(saved) == set(w) and all(np.array_equal(saved[n], w[n]) for n in w)  # the official names
    again, params2 = jspec.load_drafter(str(tmp_path / "dst"), target, block_size=2)
    assert again == dataclasses.replace(dr, block_size=2) and again.num_drafts == 2
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params2), strict=True))


@pytest.mark.parametrize("prefix, fc_bias, shared_head", [("", False, False), ("medusa_heads.", True, True)])
def test_the_vllm_medusa_variant_loads(target, tmp_path, prefix, fc_bias, shared_head):
    w = official_tensors(MEDUSA)
    renamed = {}
    for i in range(K):
        for j in range(L):
            renamed[f"{prefix}blocks.{i}.layers.{j}.weight"] = w[f"{i}.{j}.linear.weight"]
            if fc_bias:
                renamed[f"{prefix}blocks.{i}.layers.{j}.bias"] = w[f"{i}.{j}.linear.bias"]
        if not shared_head or i == 0:
            renamed[f"{prefix}lm_heads.{i}.weight"] = w[f"{i}.{L}.weight"]
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": K, "num_hidden_layers": L,
              "hidden_size": 32, "vocab_size": 96, "truncated_vocab_size": 96, "medusa_fc_bias": fc_bias,
              "original_lm_head": shared_head}
    dr, params = jspec.load_drafter(write(tmp_path / "vllm", config, renamed), target)
    assert isinstance(dr, Medusa) and dr.cfg.num_layers == L
    for i in range(K):
        head = params[str(i)]
        np.testing.assert_array_equal(head["lm_head"], w[f"{0 if shared_head else i}.{L}.weight"])
        for j in range(L):
            np.testing.assert_array_equal(head[f"block{j}"]["weight"], w[f"{i}.{j}.linear.weight"])
            want = w[f"{i}.{j}.linear.bias"] if fc_bias else np.zeros(32, np.float32)
            np.testing.assert_array_equal(head[f"block{j}"]["bias"], want)


@pytest.mark.parametrize("kind, edit, names", [
    (MEDUSA, lambda t: t.pop("1.0.linear.bias"), ["missing tensors (1): 1.0.linear.bias"]),
    (MEDUSA, lambda t: t.update({"3.0.linear.weight": np.zeros((32, 32), np.float32)}),
     ["unexpected tensors (1): 3.0.linear.weight"]),
    (MEDUSA, lambda t: t.update({"0.0.linear.weight": np.zeros((32, 16), np.float32)}),
     ["misshapen tensors", "0.0.linear.weight: checkpoint (32, 16) vs config (32, 32)"]),
    (HYDRA, lambda t: t.pop("hydra_mlp.2.0.res_connection.weight"),
     ["missing tensors (1): hydra_mlp.2.0.res_connection.weight"]),
    (HYDRA, lambda t: t.update({"prefix_embeding_layer.norm.weight": np.zeros(32, np.float32)}),
     ["unexpected tensors (1): prefix_embeding_layer.norm.weight"]),
])
def test_bad_tensors_are_named(target, tmp_path, kind, edit, names):
    w = official_tensors(kind)
    edit(w)
    with pytest.raises(CheckpointError) as err:
        jspec.load_drafter(write(tmp_path / "bad", official_config(kind), w), target)
    assert "fix:" in str(err.value)
    for name in names:
        assert name in str(err.value)


@pytest.mark.parametrize("kind", [MEDUSA, HYDRA])
@pytest.mark.parametrize("field, value", [("posterior_threshold", 0.09), ("posterior_alpha", 0.3)])
def test_typical_acceptance_is_refused(target, tmp_path, kind, field, value):
    path = write(tmp_path / "typical", {**official_config(kind), field: value}, official_tensors(kind))
    with pytest.raises(CheckpointError, match=f"{field} asks for Medusa-2's typical acceptance.*lossless"):
        jspec.load_drafter(path, target)


@pytest.mark.parametrize("edit, message", [
    ({"hydra_head_arch": "prefix-mlp"}, "prefix_embeding_layer"),
    ({"hydra_head_arch": "cross-attn"}, "attention heads"),
    ({"grounded_heads": False}, "ungrounded heads"),
    ({"hidden_state_offset": 2}, "hidden_state_offset 2"),
    ({"hydra_num_layers": 0}, "hydra_num_layers is 0"),
])
def test_hydra_variants_jspec_does_not_run_are_refused(target, tmp_path, edit, message):
    path = write(tmp_path / "hydra", {**official_config(HYDRA), **edit}, official_tensors(HYDRA))
    with pytest.raises(CheckpointError, match=message):
        jspec.load_drafter(path, target)


def test_torch_files_and_wrong_targets_are_refused_with_the_fix(target, tmp_path):
    path = tmp_path / "pt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(official_config(MEDUSA)))
    (path / "medusa_lm_head.pt").write_bytes(b"torch pickle")
    with pytest.raises(CheckpointError, match="torch pickle.*safetensors.torch import save_file"):
        jspec.load_drafter(str(path), target)
    other = dataclasses.replace(CFG, hidden_size=48, num_heads=6)
    big = jspec.Target(other, transformer.init_params(other, jax.random.key(0)))
    with pytest.raises(ValueError, match="hidden size is 32, the target's 48"):
        jspec.load_drafter(write(tmp_path / "ok", official_config(MEDUSA), official_tensors(MEDUSA)), big)


def test_speculative_decoding_with_loaded_heads_equals_plain_decoding(target, tmp_path):
    """Greedy through a Medusa tree and Gumbel-coupled sampling through a Hydra chain, from official folders."""
    runs = [(MEDUSA, SamplingParams(0.0), "greedy", dict(tree_budget=6)),
            (HYDRA, SamplingParams(1.0), "gumbel", dict(block_size=3))]
    for kind, sampling, verifier, shape in runs:
        path = write(tmp_path / kind, official_config(kind), official_tensors(kind))
        kwargs = dict(max_new_tokens=12, sampling=sampling, seeds=[1, 2, 3], eos_ids=[], cache_size=64)
        base = jspec.generate(target, PROMPTS, **kwargs)
        res = jspec.generate(target, PROMPTS, drafter=path, verifier=verifier, **shape, **kwargs)
        assert res.tokens == base.tokens, kind
        assert res.stats["tau"] >= 1.0


def test_shapes_and_trees(target):
    dr, _ = family.get_family(MEDUSA).example(target)
    fam = family.get_family(MEDUSA)
    assert fam.with_shape(dr, 8, 0).num_drafts == 3  # at most one draft per head
    tree = fam.with_shape(dr, 2, 5)
    assert tree.kind == "tree" and tree.max_depth == 2 and tree.tree == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert default_tree(4, 3) == ((0,), (0, 0), (1,), (0, 0, 0))  # best first; ties by path order
    assert dataclasses.replace(dr, tree=[(1,), (0,), (0, 0)]).tree == ((0,), (1,), (0, 0))
    with pytest.raises(ValueError, match=r"path \(1, 0\) lacks its parent \(1,\)"):
        dataclasses.replace(dr, tree=[(0,), (1, 0)])
    with pytest.raises(ValueError, match="deeper than the 3 heads"):
        dataclasses.replace(dr, tree=[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)])


@pytest.mark.parametrize("kind", [MEDUSA, HYDRA])
def test_training_starts_at_the_lm_head_and_lowers_the_loss(target, kind):
    with pytest.raises(ValueError, match="'drafter.num_head'"):  # a misspelt key is named
        build_drafter(kind, {"drafter": {"num_head": 2}}, target)
    recipe = family.get_family(kind).recipe
    dr, params = build_drafter(kind, {"drafter": {"num_heads": 2, "num_layers": 1, "loss": "ce"}}, target)
    assert dr.cfg.num_heads == 2 and dr.num_drafts == 2
    h = jax.random.normal(jax.random.key(1), (5, 32))
    want = tm.logits(target.params, target.cfg, h)
    for k in range(2):  # every fresh head is the target's LM head on h (Hydra: whatever its path)
        x = h if kind == MEDUSA else jnp.concatenate([h] + [jnp.ones_like(h)] * (k + 1), -1)
        np.testing.assert_allclose(head_logits(dr.cfg, params, k, x), want, atol=1e-5)
    rng = np.random.RandomState(0)
    batch = {"tokens": jnp.asarray(rng.randint(3, 96, (2, 24)), jnp.int32), "loss_mask": jnp.ones((2, 24), jnp.int32)}
    spec = DrafterLoss(num_anchors=8)
    loss = jax.jit(lambda p: recipe.loss(p, target.params, target.cfg, dr, spec, batch, jax.random.key(2))[0])
    grad = jax.jit(jax.grad(lambda p: loss(p)))
    first = float(loss(params))
    for _ in range(5):
        params = jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grad(params))
    assert float(loss(params)) < first - 0.1
