"""DFlash's optional config fields, read as the official loader reads them, and their effect.

The reference below is a float64 numpy DFlash forward written from the documented architecture and
mask (absolute positions: context keys before the anchor; inside the block, causal layers see earlier
slots only and a window W hides slots W or more apart). The drafter is loaded from config.json files
written here with the official field names, then compared with the reference.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters.base import DraftContext
from jspec.drafters.dflash import DFlash, DFlashState, config_from_hf, draft_logits, init_params, load_checkpoint
from jspec.drafters.dflash import save_checkpoint, write_context
from jspec.io.hf import CheckpointError
from jspec.verify.sampling import SamplingParams

BLOCK, LAYERS, CONTEXT = 6, 2, 9  # 9 committed positions; the anchor sits at position 9


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from conftest import make_hf_model

    path = tmp_path_factory.mktemp("target")
    make_hf_model("qwen3", layers=4, seed=5).save_pretrained(path)
    return jspec.load_target(str(path))


def hf_config(target, **changes) -> dict:
    """A z-lab DFlash config.json for the tiny target (2 draft layers); `changes` override fields
    (a value of None deletes the field); `dflash_config` entries are merged."""
    c = target.cfg
    hf = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": c.vocab_size,
          "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": LAYERS,
          "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
          "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "max_position_embeddings": 256,
          "block_size": BLOCK, "num_target_layers": c.num_layers,
          "dflash_config": {"mask_token_id": 100, "target_layer_ids": [0, 2]}}
    hf["dflash_config"].update(changes.pop("dflash_config", {}))
    for k, v in changes.items():
        if v is None:
            hf.pop(k, None)
        else:
            hf[k] = v
    return hf


def sliding(window: int, types=("sliding_attention", "full_attention")) -> dict:
    return dict(layer_types=list(types), sliding_window=window, use_sliding_window=True)


# --- the reference -----------------------------------------------------------------------------------


def _rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(x, pos, theta):
    """Rotate-half RoPE of x [T, H, Dh] at positions pos [T]."""
    dh = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, dh, 2) / dh)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    rot = np.concatenate([-x[..., dh // 2:], x[..., :dh // 2]], -1)
    return x * cos + rot * sin


def reference_logits(hf: dict, params, target, taps, anchor_token: int) -> np.ndarray:
    """Draft logits [B - 1, V] of one block anchored at CONTEXT, the context = taps [n, CONTEXT, H]."""
    f64 = lambda x: np.asarray(x, np.float64)
    dc = hf["dflash_config"]
    eps, theta = hf["rms_norm_eps"], hf["rope_theta"]
    hq, hkv, dh = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    types = hf.get("layer_types") or ["full_attention"] * LAYERS
    causal = [hf["is_causal"]] * LAYERS if "is_causal" in hf else [t == "sliding_attention" for t in types]
    windows = [hf["sliding_window"] if t == "sliding_attention" else 0 for t in types]
    embed = f64(target.params["embed"])
    ctx = _rms(np.concatenate(list(f64(taps)), -1) @ f64(params["fc"]).T, f64(params["hidden_norm"]), eps)
    block = [anchor_token] + [dc["mask_token_id"]] * (BLOCK - 1)
    h = embed[block] * dc.get("input_embedding_scale", 1.0)
    qpos = CONTEXT + np.arange(BLOCK)
    kpos = np.concatenate([np.arange(CONTEXT), qpos])
    for lp, is_causal, w in zip(params["layers"], causal, windows):
        lp = {k: f64(v) for k, v in lp.items()}
        x = _rms(h, lp["attn_norm"], eps)
        q = _rope(_rms((x @ lp["wq"].T).reshape(BLOCK, hq, dh), lp["q_norm"], eps), qpos, theta)
        kv_in = np.concatenate([ctx, x])
        k = _rope(_rms((kv_in @ lp["wk"].T).reshape(-1, hkv, dh), lp["k_norm"], eps), kpos, theta)
        v = (kv_in @ lp["wv"].T).reshape(-1, hkv, dh)
        diff = qpos[:, None] - kpos[None, :]  # query position - key position
        visible = (diff >= 0) if is_causal else np.ones_like(diff, bool)
        visible[:, :CONTEXT] = True  # context keys all precede the anchor
        if w:
            visible &= diff < w
            if not is_causal:
                visible &= -diff < w
        k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dh)
        s = np.where(visible[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        h = h + np.einsum("hqk,khd->qhd", p, v).reshape(BLOCK, -1) @ lp["wo"].T
        x = _rms(h, lp["mlp_norm"], eps)
        gate, up = x @ lp["w_gate"].T, x @ lp["w_up"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ lp["w_down"].T
    h = _rms(h, f64(params["norm"]), eps)[1:]
    head = f64(target.params.get("lm_head", target.params["embed"]))
    logits = h @ head.T * dc.get("output_multiplier", 1.0)
    cap = dc.get("final_logit_softcapping")
    return cap * np.tanh(logits / cap) if cap else logits


def drafter_logits(target, drafter: DFlash, params, taps, anchor_token: int) -> np.ndarray:
    cfg = drafter.cfg
    state = DFlashState.zeros(cfg, 1, 32, jnp.float32)
    state = write_context(params, cfg, state, taps[:, None], jnp.zeros((1,), jnp.int32),
                          jnp.ones((1, CONTEXT), bool))
    tokens = jnp.zeros((1, 32), jnp.int32).at[0, CONTEXT].set(anchor_token)
    ctx = DraftContext(tokens, jnp.array([CONTEXT + 1]), jnp.zeros((1,), jnp.uint32), target.params,
                       target_cfg=target.cfg)
    return np.asarray(drafter.logits(params, state, ctx))[0]


CASES = {
    "full, no is_causal": {},
    "sliding W < B, no is_causal (causal)": sliding(3),
    "sliding W < B, is_causal false": dict(sliding(3), is_causal=False),
    "is_causal true": dict(is_causal=True),
    "sliding, is_causal true": dict(sliding(4, ("sliding_attention",) * 2), is_causal=True),
    "knobs": dict(dflash_config=dict(input_embedding_scale=1.7, output_multiplier=0.4,
                                     final_logit_softcapping=2.5)),
}


@pytest.mark.parametrize("changes", CASES.values(), ids=CASES.keys())
def test_logits_equal_the_reference(target, changes):
    hf = hf_config(target, **json.loads(json.dumps(changes)))
    cfg = config_from_hf(hf)
    params = init_params(cfg, jax.random.key(1), std=0.3)
    taps = jax.random.normal(jax.random.key(2), (2, CONTEXT, target.cfg.hidden_size))
    got = drafter_logits(target, DFlash(cfg=cfg), params, taps, anchor_token=7)
    want = reference_logits(hf, params, target, taps, anchor_token=7)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def _effect(target, base: dict, changed: dict) -> float:
    """Largest change of the draft logits between two configs (same parameters)."""
    out = []
    for changes in (base, changed):
        cfg = config_from_hf(hf_config(target, **changes))
        params = init_params(cfg, jax.random.key(1), std=0.3)
        taps = jax.random.normal(jax.random.key(2), (2, CONTEXT, target.cfg.hidden_size))
        out.append(drafter_logits(target, DFlash(cfg=cfg), params, taps, anchor_token=7))
    return float(np.abs(out[0] - out[1]).max())


@pytest.mark.parametrize("base, changed", [
    ({}, dict(is_causal=True)),
    (dict(sliding(64), is_causal=False), dict(sliding(3), is_causal=False)),  # the window inside the block
    (dict(sliding(3), is_causal=False), sliding(3)),  # is_causal absent: sliding layers turn causal
    ({}, dict(dflash_config=dict(input_embedding_scale=1.7))),
    ({}, dict(dflash_config=dict(output_multiplier=0.4))),
    ({}, dict(dflash_config=dict(final_logit_softcapping=2.5))),
], ids=["is_causal", "window in block", "is_causal absent", "input_embedding_scale", "output_multiplier",
        "final_logit_softcapping"])
def test_each_field_changes_the_drafts(target, base, changed):
    assert _effect(target, base, changed) > 1e-3


def test_a_window_beyond_the_block_changes_nothing_inside_it(target):
    """W >= B with a context shorter than W: the window hides nothing, causal or not."""
    assert _effect(target, dict(is_causal=False), dict(sliding(64), is_causal=False)) == 0.0


def test_softcap_bounds_and_multiplier_scales(target):
    cfg = config_from_hf(hf_config(target))
    hidden = jax.random.normal(jax.random.key(3), (2, 5, target.cfg.hidden_size)) * 30
    plain = np.asarray(draft_logits(target.params, target.cfg, cfg, hidden))
    knobs = config_from_hf(hf_config(target, dflash_config=dict(output_multiplier=0.5, final_logit_softcapping=3.0)))
    capped = np.asarray(draft_logits(target.params, target.cfg, knobs, hidden))
    assert np.abs(plain).max() > 10 and np.abs(capped).max() <= 3.0  # tanh rounds to 1 in float32
    np.testing.assert_allclose(capped, 3.0 * np.tanh(plain * 0.5 / 3.0), rtol=1e-5, atol=1e-5)


# --- how fields are read --------------------------------------------------------------------------------


def test_block_size_precedence(target):
    assert config_from_hf(hf_config(target, block_size=None, dflash_config=dict(block_size=8))).block_size == 8
    assert config_from_hf(hf_config(target, dflash_config=dict(block_size=BLOCK))).block_size == BLOCK
    assert config_from_hf(hf_config(target, block_size=None)).block_size == 16  # the official default
    with pytest.raises(CheckpointError, match=r"block_size is 6 at the top level but 8 in dflash_config"):
        config_from_hf(hf_config(target, dflash_config=dict(block_size=8)))


def test_is_causal_rules(target):
    assert config_from_hf(hf_config(target)).layer_causal == (False, False)
    assert config_from_hf(hf_config(target, **sliding(3))).layer_causal == (True, False)
    assert config_from_hf(hf_config(target, **sliding(3), is_causal=False)).layer_causal == (False, False)
    assert config_from_hf(hf_config(target, is_causal=True)).layer_causal == (True, True)
    with pytest.raises(CheckpointError, match="is_causal must be true or false"):
        config_from_hf(hf_config(target, is_causal="yes"))


@pytest.mark.parametrize("changes, needles", [
    (dict(architectures=["DFlash2DraftModel"]), ["DFlash2", "would draft from another model", "dflash2 family"]),
    (dict(dflash_config=dict(selector_rank=256, selector_top_k=16)), ["DFlash2", "selector_rank", "selector_top_k"]),
    (dict(dflash_config=dict(projector_type="domino", emb_dim=256)), ["Domino", "projector_type"]),
    (dict(dflash_config=dict(is_causal=True)), ["settings jspec does not implement: ['is_causal']"]),
    (dict(dflash_config=dict(output_multiplier=0.5), output_multiplier=0.25),
     ["output_multiplier is 0.25 at the top level but 0.5 in dflash_config"]),
    (dict(dflash_config=dict(output_multiplier=-1.0)), ["output_multiplier -1.0 must be a finite number > 0"]),
    (dict(dflash_config=dict(final_logit_softcapping=float("nan"))), ["final_logit_softcapping nan"]),
    (dict(dflash_config=dict(mask_token_id=None)), ["lacks required fields ['mask_token_id']"]),
])
def test_unsupported_or_contradictory_configs_are_refused(target, changes, needles):
    hf = hf_config(target, **changes)
    hf["dflash_config"] = {k: v for k, v in hf["dflash_config"].items() if v is not None}
    with pytest.raises(CheckpointError) as err:
        config_from_hf(hf)
    for needle in needles:
        assert needle in str(err.value)


def test_top_level_settings_are_read_when_dflash_config_lacks_them(target):
    hf = hf_config(target, output_multiplier=0.25, input_embedding_scale=2.0)
    cfg = config_from_hf(hf)
    assert (cfg.output_multiplier, cfg.input_embedding_scale) == (0.25, 2.0)


@pytest.mark.parametrize("changes", [
    dict(sliding(3), is_causal=False),
    dict(sliding(4, ("sliding_attention",) * 2)),
    dict(is_causal=True, dflash_config=dict(input_embedding_scale=1.5, output_multiplier=0.3,
                                            final_logit_softcapping=20.0)),
], ids=["bidirectional sliding", "causal sliding", "causal full, knobs"])
def test_round_trip_keeps_every_setting(target, tmp_path, changes):
    cfg = config_from_hf(hf_config(target, **changes))
    params = init_params(cfg, jax.random.key(4))
    save_checkpoint(str(tmp_path), cfg, params)
    cfg2, _ = load_checkpoint(str(tmp_path))
    assert cfg2 == cfg
    written = json.loads((tmp_path / "config.json").read_text())
    assert written.get("is_causal") == changes.get("is_causal")


def test_mixed_causal_layers_cannot_be_saved(target, tmp_path):
    import dataclasses

    cfg = dataclasses.replace(config_from_hf(hf_config(target)), causal=(False, True))
    with pytest.raises(ValueError, match="cannot be written in the DFlash format"):
        save_checkpoint(str(tmp_path), cfg, init_params(cfg, jax.random.key(4)))


# --- in the loop --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def knob_drafter(target, tmp_path_factory):
    """A causal sliding drafter (W 3 < block 6) with every logit knob, saved in the official format."""
    path = tmp_path_factory.mktemp("knobs")
    cfg = config_from_hf(hf_config(target, **sliding(3), dflash_config=dict(
        input_embedding_scale=1.3, output_multiplier=0.7, final_logit_softcapping=6.0)))
    save_checkpoint(str(path), cfg, init_params(cfg, jax.random.key(9), std=0.2))
    return str(path)


@pytest.mark.parametrize("temperature, verifier", [(0.0, "greedy"), (1.0, "gumbel")])
def test_speculative_output_with_every_knob(target, knob_drafter, temperature, verifier):
    """Greedy and Gumbel-coupled speculative text equals plain decoding's, drafted through every knob."""
    prompts = [[5, 9, 17, 3, 44, 5, 9], [7, 8, 7, 8, 7, 8, 7, 8, 7]]
    kw = dict(max_new_tokens=16, sampling=SamplingParams(temperature), seeds=3)
    plain = jspec.generate(target, prompts, **kw)
    spec = jspec.generate(target, prompts, drafter=knob_drafter, verifier=verifier, **kw)
    assert spec.stats["rounds"] > 0
    assert spec.tokens == plain.tokens


@pytest.mark.parametrize("loss", ["edr", "edr_block"])
def test_the_rollout_losses_train_a_block_drafter(target, loss):
    """A run config's "edr" / "edr_block" loss anchors DFlash blocks at every position of a response window
    and trains through them (finite value, gradients reach the drafter; its value on the window is the
    rollout's EDR: tests/test_offline_eval.py)."""
    from jspec.drafters import dflash
    from jspec.train.distill import drafter_loss

    run = {"drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 100, "num_taps": 2}, "init_std": 0.3}
    drafter, params = dflash._build(run, target, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 3, target.cfg.vocab_size)
    batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens).at[:, :4].set(0)}
    spec = drafter_loss({"loss": loss, "num_anchors": 12})
    fn = lambda p: dflash.train_loss(p, target.params, target.cfg, drafter, spec, batch, jax.random.key(2))
    (value, _), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(params)
    assert 1 / 4 <= float(value) <= 1  # rounds per committed token: at least one round per block of 4
    assert float(jnp.abs(grads["fc"]).max()) > 0


def test_a_dspark_run_selects_any_loss(target):
    """DSpark's own objective ("dspark": 0.1 CE + 0.9 L1 + the confidence BCE) is the CE and TV run losses
    combined, 0.1 L_ce + 1.8 L_tv, without a confidence head (same anchors, weights and blocks); with one,
    every run loss adds its BCE and trains the head."""
    from jspec.drafters import dspark
    from jspec.train import losses
    from jspec.train.distill import drafter_loss

    run = {"drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 100, "num_taps": 2, "markov_rank": 8},
           "init_std": 0.3}
    drafter, params = dspark._build(run, target, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 3, target.cfg.vocab_size)
    batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens).at[:, :4].set(0)}

    def value(dr, name, p=params):
        spec = drafter_loss({"loss": name, "num_anchors": 8}, own=dspark.OWN_LOSS)
        return dspark.train_loss(p, target.params, target.cfg, dr, spec, batch, jax.random.key(2))[0]

    headless = dataclasses.replace(drafter, spark=dataclasses.replace(drafter.spark, confidence_head=False))
    own, ce, tv = (float(value(headless, n)) for n in ("dspark", "ce", "tv"))
    np.testing.assert_allclose(own, 0.1 * ce + 1.8 * tv, rtol=1e-5)
    assert drafter.spark.confidence_head  # the BCE term: what the head adds to any run loss
    own_h, ce_h, tv_h = (float(value(drafter, n)) for n in ("dspark", "ce", "tv"))
    bce = ce_h - ce
    assert bce > 0
    np.testing.assert_allclose(tv_h - tv, bce, rtol=1e-4)
    np.testing.assert_allclose(own_h, 0.1 * ce + 1.8 * tv + bce, rtol=1e-5)
    # The recipe's gradient reaches the network (one loss), and every run loss's value and gradient on the drafts
    # and the confidences are finite and not all zero (one compile per loss of the loss part alone).
    v, grads = jax.jit(jax.value_and_grad(lambda p: value(drafter, "kl", p)))(params)
    assert np.isfinite(float(v)) and float(jnp.abs(grads["fc"]).max()) > 0
    b, a, g, vocab = 2, 8, 4, target.cfg.vocab_size
    keys = jax.random.split(jax.random.key(3), 4)
    draft_logp = jax.nn.log_softmax(jax.random.normal(keys[0], (b, a, g, vocab)), axis=-1)
    p_t = jax.nn.log_softmax(2 * jax.random.normal(keys[1], (b, a, g, vocab)), axis=-1)
    labels = jax.random.randint(keys[2], (b, a, g), 0, vocab)
    conf = jax.nn.sigmoid(jax.random.normal(keys[3], (b, a, g)))
    mask = jnp.ones((b, a, g)).at[0, :, 3:].set(0.0)
    for name in (dspark.OWN_LOSS,) + tuple(losses.LOSSES):
        spec = drafter_loss({"loss": name, "num_anchors": a}, own=dspark.OWN_LOSS)
        v, (g_logp, g_conf) = jax.jit(jax.value_and_grad(lambda x, c: dspark.run_loss(spec, x, p_t, labels, mask, c),
                                                         argnums=(0, 1)))(draft_logp, conf)
        assert np.isfinite(float(v)), name
        for gr in (g_logp, g_conf):  # the drafts and the confidence head are both trained
            assert np.isfinite(np.asarray(gr)).all() and float(jnp.abs(gr).max()) > 0, name
