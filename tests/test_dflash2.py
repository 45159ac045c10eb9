"""DFlash2: the convolution layers and the pair selector against a float64 numpy reference written
from the documented architecture, the q it reports against the law of its draws, the official format,
training, and exactness in the loop (the conformance suite covers the registered example too)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from scipy import stats

import jspec
from jspec.drafters import dflash, dflash2
from jspec.drafters.base import GREEDY, SAMPLE, DraftContext
from jspec.drafters.dflash import DFlashState, write_context
from jspec.io.hf import CheckpointError
from jspec.train.drafter import DrafterLoss
from jspec.verify.sampling import SamplingParams
from test_dflash_config import CONTEXT, _rms, _rope, hf_config, sliding, target  # noqa: F401 (target: the shared fixture)

BLOCK, K, GROUP, RANK, TOP = 6, 2, 16, 8, 4


def hf2(target, **changes) -> dict:
    """A DFlash2 config.json (block_size in dflash_config, as released); changes as `hf_config`."""
    own = changes.pop("dflash_config", {})
    hf = hf_config(target, **changes)
    hf["architectures"] = ["DFlash2DraftModel"]
    hf["dflash_config"].update(dict(conv_kernel_size=K, conv_group_size=GROUP, selector_rank=RANK, selector_top_k=TOP,
                                    block_size=hf.pop("block_size")), **own)
    return hf


def random_params(cfg, seed=1):
    """Every parameter random, the convolutions and the successor codebook included."""
    params = dflash2.init_params(cfg, jax.random.key(seed), std=0.3)
    keys = iter(jax.random.split(jax.random.key(seed + 100), 64))
    noisy = lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype)
    return dict(params, convs=jax.tree_util.tree_map(noisy, params["convs"]),
                selector=jax.tree_util.tree_map(noisy, params["selector"]))


# --- the reference ---------------------------------------------------------------------------------


def _conv(x, d, base):
    """Conv(x; d, b)[t, c] = sum_o (b[o, c] + d[t, o, c // GROUP]) x[t - o, c]: x [W, H], d [W, K, G]."""
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for o in range(base.shape[0]):
            if t - o >= 0:
                out[t] += (base[o] + np.repeat(d[t, o], GROUP)) * x[t - o]
    return out


def reference_hidden(hf, params, target, taps, anchor_token):
    """Final-normed hidden states [B, H] of one block anchored at CONTEXT (float64)."""
    f64 = lambda x: np.asarray(x, np.float64)
    dc = hf["dflash_config"]
    eps, theta = hf["rms_norm_eps"], hf["rope_theta"]
    hq, hkv, dh = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    types = hf.get("layer_types") or ["full_attention"] * 2
    causal = [hf["is_causal"]] * 2 if "is_causal" in hf else [t == "sliding_attention" for t in types]
    windows = [hf["sliding_window"] if t == "sliding_attention" else 0 for t in types]
    ctx = _rms(np.concatenate(list(f64(taps)), -1) @ f64(params["fc"]).T, f64(params["hidden_norm"]), eps)
    h = f64(target.params["embed"])[[anchor_token] + [dc["mask_token_id"]] * (BLOCK - 1)]
    qpos = CONTEXT + np.arange(BLOCK)
    kpos = np.concatenate([np.arange(CONTEXT), qpos])

    def attention(x, lp, is_causal, w):
        q = _rope(_rms((x @ lp["wq"].T).reshape(BLOCK, hq, dh), lp["q_norm"], eps), qpos, theta)
        kv_in = np.concatenate([ctx, x])
        k = _rope(_rms((kv_in @ lp["wk"].T).reshape(-1, hkv, dh), lp["k_norm"], eps), kpos, theta)
        v = (kv_in @ lp["wv"].T).reshape(-1, hkv, dh)
        diff = qpos[:, None] - kpos[None, :]
        visible = (diff >= 0) | (not is_causal)
        visible[:, :CONTEXT] = True
        if w:
            visible &= (diff < w) & ((-diff < w) | is_causal)
        k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
        s = np.where(visible[None], np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dh), -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.einsum("hqk,khd->qhd", p, v).reshape(BLOCK, -1) @ lp["wo"].T

    def mlp(x, lp):
        gate = x @ lp["w_gate"].T
        return (gate / (1 + np.exp(-gate)) * (x @ lp["w_up"].T)) @ lp["w_down"].T

    for lp, cp, is_causal, w in zip(params["layers"], params["convs"], causal, windows):
        lp, cp = ({k: f64(v) for k, v in d.items()} for d in (lp, cp))
        x = _rms(h, lp["attn_norm"], eps)
        d = (x @ cp["attention_proj"].T).reshape(BLOCK, 2, K, -1)
        h = h + _conv(attention(_conv(x, d[:, 0], cp["attention_base"][0]), lp, is_causal, w), d[:, 1],
                      cp["attention_base"][1])
        x = _rms(h, lp["mlp_norm"], eps)
        d = (x @ cp["mlp_proj"].T).reshape(BLOCK, 2, K, -1)
        h = h + _conv(mlp(_conv(x, d[:, 0], cp["mlp_base"][0]), lp), d[:, 1], cp["mlp_base"][1])
    return _rms(h, f64(params["norm"]), eps)


def reference_scores(params, hidden_t, logits_t, prev):
    """(candidate ids [k], S [k]) of one slot: the top-k of its logits and the pair scores given prev."""
    sel = {k: np.asarray(v, np.float64) for k, v in params["selector"].items()}
    ids = np.argsort(-logits_t, kind="stable")[:TOP]
    factors = sel["hidden"] @ hidden_t
    return ids, logits_t[ids] + (sel["pred"][prev] * factors) @ sel["succ"][ids].T


# --- fixtures -------------------------------------------------------------------------------------------


def setup(target, cfg, params, batch=1, seed0=0):
    taps = jax.random.normal(jax.random.key(2), (2, CONTEXT, target.cfg.hidden_size))
    state = DFlashState.zeros(cfg.backbone, batch, 32, jnp.float32)
    state = write_context(params, cfg.backbone, state, jnp.broadcast_to(taps[:, None], (2, batch, CONTEXT, taps.shape[-1])),
                          jnp.zeros((batch,), jnp.int32), jnp.ones((batch, CONTEXT), bool))
    tokens = jnp.zeros((batch, 32), jnp.int32).at[:, CONTEXT].set(7)
    seeds = jnp.arange(seed0, seed0 + batch, dtype=jnp.uint32)
    return taps, state, tokens, seeds


def context(target, tokens, seeds, policy, temperature):
    return DraftContext(tokens, jnp.full((tokens.shape[0],), CONTEXT + 1), seeds, target.params,
                        target_cfg=target.cfg, policy=policy, sampling=SamplingParams(temperature))


CASES = {"full": {}, "causal sliding W < B": sliding(3), "bidirectional, knobs": dict(
    sliding(4), is_causal=False, dflash_config=dict(output_multiplier=0.6, final_logit_softcapping=4.0))}


@pytest.mark.parametrize("changes", CASES.values(), ids=CASES.keys())
def test_slots_and_selector_equal_the_reference(target, changes):
    hf = hf2(target, **json.loads(json.dumps(changes)))
    cfg = dflash2.config_from_hf(hf)
    params = random_params(cfg)
    drafter = dflash2.DFlash2(dflash2=cfg)
    taps, state, tokens, seeds = setup(target, cfg, params)
    ctx = context(target, tokens, seeds, SAMPLE, 0.8)
    _, hidden, logits, _ = drafter.slot_states(params, state, ctx)
    want = reference_hidden(hf, params, target, taps, anchor_token=7)
    np.testing.assert_allclose(np.asarray(hidden)[0], want[1:], rtol=2e-4, atol=2e-4 * np.abs(want).max())
    head = np.asarray(target.params.get("lm_head", target.params["embed"]), np.float64)
    dc = hf["dflash_config"]
    ref_logits = want[1:] @ head.T * dc.get("output_multiplier", 1.0)
    if dc.get("final_logit_softcapping"):
        ref_logits = dc["final_logit_softcapping"] * np.tanh(ref_logits / dc["final_logit_softcapping"])
    np.testing.assert_allclose(np.asarray(logits)[0], ref_logits, rtol=2e-4, atol=2e-4 * np.abs(ref_logits).max())
    # Sampled: each slot's reported q is softmax(S / T) over its candidates given the token drafted before it.
    proposal, _ = drafter.propose(params, state, ctx)
    drafts, q = np.asarray(proposal.tokens)[0], np.asarray(proposal.q_logp)[0]
    prev = 7
    for t in range(BLOCK - 1):
        ids, s = reference_scores(params, want[1 + t], ref_logits[t], prev)
        logq = s / 0.8 - np.log(np.sum(np.exp(s / 0.8 - (s / 0.8).max()))) - (s / 0.8).max()
        np.testing.assert_allclose(q[t, ids], logq, rtol=1e-4, atol=1e-4)
        assert np.isneginf(np.delete(q[t], ids)).all() and drafts[t] in ids
        prev = drafts[t]
    # Greedy: argmax of the pair scores along its own path.
    greedy, _ = drafter.propose(params, state, context(target, tokens, seeds, GREEDY, 0.0))
    prev = 7
    for t, tok in enumerate(np.asarray(greedy.tokens)[0]):
        ids, s = reference_scores(params, want[1 + t], ref_logits[t], prev)
        assert tok == ids[np.argmax(s)]
        prev = tok


def test_reported_q_is_the_law_of_the_draws(target):
    """N = 3000 rows drafting the same block with different seeds. The joint law of the first two drafts
    is q_1(x) q_2(y | x) from the reported rows; a G-test over the 16 pairs (df 15) at failure
    probability 1e-6 (threshold chi2.isf(1e-6, 15) = 49.6). The rows also agree with each other: q_1 is
    one row, q_2 depends only on the first draft."""
    cfg = dflash2.config_from_hf(hf2(target))
    params = random_params(cfg, seed=3)
    params = dict(params, selector=dict(params["selector"], succ=params["selector"]["succ"] * 0.2))  # a spread q
    n = 3000
    _, state, tokens, seeds = setup(target, cfg, params, batch=n, seed0=11)
    proposal, _ = jax.jit(lambda p, s, c: dflash2.DFlash2(dflash2=cfg).propose(p, s, c))(
        params, state, context(target, tokens, seeds, SAMPLE, 1.0))
    drafts, q = np.asarray(proposal.tokens), np.exp(np.asarray(proposal.q_logp, np.float64))
    np.testing.assert_allclose(q[:, 0], np.broadcast_to(q[0, 0], q[:, 0].shape), atol=1e-6)
    first = np.flatnonzero(q[0, 0] > 0)
    expected, observed = [], []
    for x in first:
        rows = np.flatnonzero(drafts[:, 0] == x)
        q2 = q[rows[0], 1] if len(rows) else None
        if q2 is not None:
            np.testing.assert_allclose(q[rows, 1], np.broadcast_to(q2, (len(rows), q2.shape[0])), atol=1e-6)
        for y in np.flatnonzero(q2 > 0) if q2 is not None else []:
            expected.append(n * q[0, 0, x] * q2[y])
            observed.append(np.sum(drafts[rows, 1] == y))
    assert sum(observed) == n and min(expected) > 5  # every draw lands on a pair with expected mass
    observed, expected = np.array(observed, float), np.array(expected)
    g = 2 * np.sum(observed[observed > 0] * np.log(observed[observed > 0] / expected[observed > 0]))
    assert g < stats.chi2.isf(1e-6, len(expected) - 1), g


def test_official_init_drafts_as_the_backbone(target):
    """Identity base kernels, zero projections and successor codebook: a DFlash2 drafter made from a
    DFlash one (`from_dflash`) has its slots and drafts."""
    backbone = dflash.config_from_hf(hf_config(target))
    cfg, params = dflash2.from_dflash(backbone, dflash.init_params(backbone, jax.random.key(4), std=0.3),
                                      jax.random.key(5), selector_rank=RANK, selector_top_k=TOP)
    assert cfg == dflash2.config_from_hf(hf2(target))
    _, state, tokens, seeds = setup(target, cfg, params)
    ctx = context(target, tokens, seeds, GREEDY, 0.0)
    backbone = dflash.DFlash(cfg=cfg.backbone)
    np.testing.assert_allclose(np.asarray(dflash2.DFlash2(dflash2=cfg).logits(params, state, ctx)),
                               np.asarray(backbone.logits(params, state, ctx)), rtol=1e-5, atol=1e-5)
    a, _ = dflash2.DFlash2(dflash2=cfg).propose(params, state, ctx)
    b, _ = backbone.propose(params, state, ctx)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


# --- format ---------------------------------------------------------------------------------------------


def test_official_names_round_trip(target, tmp_path):
    cfg = dflash2.config_from_hf(hf2(target, **sliding(3), is_causal=False))
    params = random_params(cfg)
    dflash2.save_checkpoint(str(tmp_path), cfg, params)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["DFlash2DraftModel"] and hf["is_causal"] is False
    assert {k: hf["dflash_config"][k] for k in dflash2.DFLASH2_KEYS} == dict(
        conv_kernel_size=K, conv_group_size=GROUP, selector_rank=RANK, selector_top_k=TOP)
    assert hf["dflash_config"]["block_size"] == BLOCK and "block_size" not in hf
    t = load_file(str(tmp_path / "model.safetensors"))
    h, v = target.cfg.hidden_size, target.cfg.vocab_size
    assert t["layers.1.attention_conv.base_kernel"].shape == (2, K, h)
    assert t["layers.0.mlp_conv.kernel_projection.weight"].shape == (2 * K * h // GROUP, h)
    assert t["candidate_selector.hidden_projection.weight"].shape == (RANK, h)
    assert t["candidate_selector.predecessor_codebook"].shape == t["candidate_selector.successor_codebook"].shape == (v, RANK)
    cfg2, params2 = dflash2.load_checkpoint(str(tmp_path))
    assert cfg2 == cfg
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    drafter, _ = jspec.load_drafter(str(tmp_path), target)
    assert isinstance(drafter, dflash2.DFlash2)
    with pytest.raises(CheckpointError, match="dflash2 family"):
        dflash.load_checkpoint(str(tmp_path))


def test_dflash2_config_errors(target, tmp_path):
    hf = hf2(target)
    del hf["dflash_config"]["selector_top_k"]
    with pytest.raises(CheckpointError, match=r"lacks the DFlash2 settings \['selector_top_k'\]"):
        dflash2.config_from_hf(hf)
    with pytest.raises(CheckpointError, match="conv_group_size 48 must divide the hidden size 64"):
        dflash2.config_from_hf(hf2(target, dflash_config=dict(conv_group_size=48)))
    assert dflash2.with_shape(dflash2.DFlash2(dflash2=dflash2.config_from_hf(hf2(target))), BLOCK, 8).kind == "tree"
    cfg = dflash2.config_from_hf(hf2(target))
    params = dflash2.init_params(cfg, jax.random.key(0))
    dflash2.save_checkpoint(str(tmp_path), cfg, params)
    t = load_file(str(tmp_path / "model.safetensors"))
    from safetensors.numpy import save_file

    del t["layers.1.mlp_conv.base_kernel"]
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.1.mlp_conv.base_kernel"):
        dflash2.load_checkpoint(str(tmp_path))


# --- training and the loop -------------------------------------------------------------------------------


def test_selector_training_inserts_the_truth():
    unary, ids = jnp.array([[3.0, 2.0, 1.0]]), jnp.array([[5, 6, 7]])
    logits = jnp.zeros((1, 10)).at[0, 9].set(-1.5)
    u, i = dflash2.with_truth(unary, ids, logits, jnp.array([9]))
    assert i.tolist() == [[5, 6, 9]] and u.tolist() == [[3.0, 2.0, -1.5]]
    u, i = dflash2.with_truth(unary, ids, logits, jnp.array([6]))
    assert i.tolist() == [[5, 6, 7]] and u.tolist() == [[3.0, 2.0, 1.0]]
    scores = jnp.array([[0.0, 1.0, 2.0]])
    want = -jax.nn.log_softmax(scores)[0, 1]
    np.testing.assert_allclose(dflash2.selector_loss(scores, ids, jnp.array([6]), jnp.ones((1,))), want, rtol=1e-6)


def test_train_loss_reaches_every_parameter(target):
    run = {"drafter": {"num_layers": 2, "block_size": BLOCK, "mask_token_id": 100, "num_taps": 2,
                       "selector_rank": RANK, "selector_top_k": TOP}, "init_std": 0.3}
    drafter, params = dflash2._build(run, target, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 3, target.cfg.vocab_size)
    batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens).at[:, :4].set(0)}
    spec = DrafterLoss(num_anchors=4)
    loss_fn = lambda p: dflash2.train_loss(p, target.params, target.cfg, drafter, spec, batch, jax.random.key(2))
    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    assert np.isfinite(loss) and float(metrics["selector_ce"]) > 0
    # From the official init the convolutions' projections and the successor codebook get gradients too.
    for path in (("convs", 0, "attention_proj"), ("convs", 1, "mlp_proj"), ("selector", "succ"), ("fc",)):
        g = grads
        for k in path:
            g = g[k]
        assert float(jnp.abs(g).max()) > 0, path


@pytest.fixture(scope="module")
def drafter_dir(target, tmp_path_factory):
    path = tmp_path_factory.mktemp("dflash2")
    cfg = dflash2.config_from_hf(hf2(target, **sliding(3)))
    dflash2.save_checkpoint(str(path), cfg, random_params(cfg, seed=8))
    return str(path)


@pytest.mark.parametrize("temperature, verifier", [(0.0, "greedy"), (1.0, "gumbel"), (0.7, "gumbel")])
def test_speculative_text_equals_plain_decoding(target, drafter_dir, temperature, verifier):
    prompts = [[5, 9, 17, 3, 44, 5, 9], [7, 8, 7, 8, 7, 8, 7, 8, 7]]
    kw = dict(max_new_tokens=16, sampling=SamplingParams(temperature), seeds=5)
    plain = jspec.generate(target, prompts, **kw)
    spec = jspec.generate(target, prompts, drafter=drafter_dir, verifier=verifier, **kw)
    assert spec.stats["rounds"] > 0 and spec.tokens == plain.tokens


def test_tree_is_the_best_paths_along_the_selector(target):
    """With a tree budget the nodes are the `budget` best paths by summed selector log-probs (each slot's
    candidates given the path's previous token), found by enumerating every path; parents come first."""
    import itertools

    drafter, params = dflash2._example(target)
    k, g = drafter.dflash2.selector_top_k, drafter.num_drafts
    tree = dflash2.with_shape(drafter, 0, 10)
    b, context = 2, 9
    taps = jax.random.normal(jax.random.key(7), (len(tree.taps), b, context, target.cfg.hidden_size))
    state = DFlashState.zeros(tree.cfg, b, 40, jnp.float32)
    state = write_context(params, tree.cfg, state, taps, jnp.zeros((b,), jnp.int32), jnp.ones((b, context), bool))
    tokens = jnp.zeros((b, 40), jnp.int32).at[:, context].set(jnp.array([7, 30]))
    ctx = DraftContext(tokens, jnp.full((b,), context + 1), jnp.arange(b, dtype=jnp.uint32), target.params,
                       target_cfg=target.cfg, policy=GREEDY)
    prop, _ = tree.propose(params, state, ctx)
    anchor, hidden, logits, _ = tree.slot_states(params, state, ctx)
    unary, ids, factors = dflash2.candidates(params, tree.dflash2, logits, hidden)
    for row in range(b):
        scored = {}
        for d in range(1, g + 1):
            for path in itertools.product(range(k), repeat=d):
                prev, total, toks = int(anchor[row]), 0.0, []
                for t, j in enumerate(path):
                    s = dflash2.pair_scores(params, unary[row, t], ids[row, t], factors[row, t], jnp.int32(prev))
                    total += float(jax.nn.log_softmax(s)[j])
                    prev = int(ids[row, t, j])
                    toks.append(prev)
                scored[tuple(toks)] = total
        best = sorted(scored.values(), reverse=True)[:10]
        got, par = [], np.asarray(prop.parent[row])
        for i in range(10):
            path, n = [], i
            while n >= 0:
                path.insert(0, int(prop.tokens[row, n]))
                assert par[n] < n
                n = par[n]
            got.append(scored[tuple(path)])
        np.testing.assert_allclose(sorted(got, reverse=True), best, atol=1e-5)
        assert np.array_equal(np.asarray(prop.depth[row]), [_depth_of(par, i) for i in range(10)])


def _depth_of(parent, i):
    n = 0
    while i >= 0:
        i, n = parent[i], n + 1
    return n
