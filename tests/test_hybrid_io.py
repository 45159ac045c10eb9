"""Hybrid checkpoints: strict loading names every mismatch; known extras and the Qwen3.5 prefix load."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hybrid_helpers import checkpoint, loaded
import jspec
from jspec.io.hf import CheckpointError
from jspec.io.hf_hybrid import load_hybrid_params, save_hybrid_params
from jspec.models import hybrid as H


def _copy(family, tmp_path, edit_config=None, edit_tensors=None):
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint(family)[0], dst)
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        tensors = load_file(str(dst / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def _swap_pattern(c):
    c["layer_types"] = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


@pytest.mark.parametrize(
    "family, edit, names",
    [
        # Layer pattern: layers 2 and 3 swapped kinds.
        ("qwen3_next", _swap_pattern,
         ["missing tensors", "model.layers.2.self_attn.q_proj.weight", "model.layers.3.linear_attn.in_proj_qkvz.weight",
          "unexpected tensors", "model.layers.3.self_attn.q_proj.weight", "model.layers.2.linear_attn.conv1d.weight",
          "layer 2: config.json says full_attention, the checkpoint holds linear_attention tensors"]),
        # GDN head counts: 2 value heads instead of 4.
        ("qwen3_next", lambda c: c.update(linear_num_value_heads=2),
         ["misshapen tensors", "model.layers.0.linear_attn.in_proj_qkvz.weight: checkpoint (96, 32) vs config (64, 32)",
          "model.layers.1.linear_attn.in_proj_ba.weight", "model.layers.2.linear_attn.A_log",
          "model.layers.0.linear_attn.out_proj.weight"]),
        # Attention head counts.
        ("qwen3_5", lambda c: c.update(num_attention_heads=2),
         ["model.layers.1.self_attn.q_proj.weight: checkpoint (128, 32) vs config (64, 32)",
          "model.layers.3.self_attn.o_proj.weight"]),
        # Conv kernel.
        ("qwen3_5", lambda c: c.update(linear_conv_kernel_dim=3),
         ["model.layers.0.linear_attn.conv1d.weight: checkpoint (64, 1, 4) vs config (64, 1, 3)",
          "model.layers.2.linear_attn.conv1d.weight"]),
    ],
)
def test_config_that_does_not_match_the_tensors_is_refused(family, edit, names, tmp_path):
    path = _copy(family, tmp_path, edit_config=edit)
    with pytest.raises(CheckpointError) as err:
        load_hybrid_params(path)
    for name in names:
        assert name in str(err.value)


def test_every_bad_tensor_is_named_once(tmp_path):
    def corrupt(t):
        del t["model.layers.1.linear_attn.dt_bias"]
        del t["model.layers.0.mlp.experts.3.up_proj.weight"]
        t["model.layers.0.linear_attn.extra"] = np.zeros(2, np.float32)
        t["model.layers.3.self_attn.k_norm.weight"] = np.zeros(8, np.float32)

    with pytest.raises(CheckpointError) as err:
        load_hybrid_params(_copy("qwen3_next", tmp_path, edit_tensors=corrupt))
    msg = str(err.value)
    assert "missing tensors (2): model.layers.0.mlp.experts.3.up_proj.weight, model.layers.1.linear_attn.dt_bias" in msg
    assert "unexpected tensors (1): model.layers.0.linear_attn.extra" in msg
    assert "misshapen tensors (1): model.layers.3.self_attn.k_norm.weight: checkpoint (8,) vs config (16,)" in msg
    assert "layer pattern" not in msg


def test_mtp_tensors_are_known_extras(tmp_path):
    def add_mtp(t):
        t["mtp.fc.weight"] = np.ones((32, 64), np.float32)
        t["mtp.layers.0.input_layernorm.weight"] = np.ones(32, np.float32)

    _, params = load_hybrid_params(_copy("qwen3_next", tmp_path, edit_tensors=add_mtp))
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(loaded("qwen3_next")[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_multimodal_qwen3_5_checkpoint_with_language_model_prefix(tmp_path):
    """Released Qwen3.5: model_type qwen3_5, text_config nested, `model.language_model.` prefix, a vision tower."""
    def to_vlm_config(c):
        text = {**c, "model_type": "qwen3_5_text"}
        text.pop("architectures")
        c.clear()
        c.update(model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"], text_config=text,
                 vision_config={"depth": 1}, tie_word_embeddings=text["tie_word_embeddings"])

    def to_vlm_tensors(t):
        for name in list(t):
            if name.startswith("model."):
                t["model.language_model." + name[len("model."):]] = t.pop(name)
        t["model.visual.patch_embed.proj.weight"] = np.ones((4, 3), np.float32)

    cfg, params = load_hybrid_params(_copy("qwen3_5", tmp_path, to_vlm_config, to_vlm_tensors))
    ref_cfg, ref_params = loaded("qwen3_5")
    assert cfg == ref_cfg
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_config_round_trip_and_layer_pattern_rules():
    for family in ("qwen3_next", "qwen3_5"):
        cfg, _ = loaded(family)
        assert H.HybridConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
        hash(cfg)
    hf = loaded("qwen3_next")[0].to_hf_dict()
    del hf["layer_types"]
    hf.update(num_hidden_layers=8, full_attention_interval=4, mlp_only_layers=[1], decoder_sparse_step=1)
    cfg = H.HybridConfig.from_hf_dict(hf)
    assert cfg.layer_types == (H.LINEAR,) * 3 + (H.FULL,) + (H.LINEAR,) * 3 + (H.FULL,)
    assert cfg.mlp_types == ("moe", "dense") + ("moe",) * 6
    assert cfg.slots == (0, 1, 2, 0, 3, 4, 5, 1)  # each layer's index into the cache's per-kind tuples
    assert loaded("qwen3_5")[0].slots == (0, 0, 1, 1)
    with pytest.raises(ValueError, match="unsupported architecture.*qwen3_moe"):
        H.HybridConfig.from_hf_dict({**hf, "model_type": "qwen3_moe"})
    with pytest.raises(ValueError, match="must be a multiple of linear_num_key_heads"):
        H.HybridConfig.from_hf_dict({**hf, "linear_num_value_heads": 3})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        H.HybridConfig.from_hf_dict({**hf, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})


def test_num_params_counts_the_checkpoint():
    for family in ("qwen3_next", "qwen3_5"):
        cfg, params = loaded(family)
        assert cfg.num_params == sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    _, model = checkpoint("qwen3_next")
    assert loaded("qwen3_next")[0].num_params == sum(p.numel() for p in model.parameters())


def test_init_params_has_the_loader_layout(tmp_path):
    """Random jspec parameters use the loaded layout and export to a checkpoint that loads back."""
    cfg, params = loaded("qwen3_next")
    fresh = H.init_params(cfg, jax.random.key(0))
    assert jax.tree_util.tree_structure(fresh) == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree_util.tree_leaves(fresh), jax.tree_util.tree_leaves(params)):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert all(float(jnp.abs(lp["in_norm"]).max()) == 0 for lp in fresh["layers"])  # zero-centred: scale 1
    save_hybrid_params(str(tmp_path), cfg, fresh)
    _, back = load_hybrid_params(str(tmp_path))
    for a, b in zip(jax.tree_util.tree_leaves(fresh), jax.tree_util.tree_leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="layer_loop='scan' applies to dense .* targets"):
        jspec.load_target(str(tmp_path), layer_loop="scan")  # a hybrid target has one layer loop


def test_moe_gathered_and_dense_expert_paths_agree():
    """Decoding gathers each token's experts, prefill runs all of them: the same function."""
    cfg, params = loaded("qwen3_next")
    lp = params["layers"][0]
    x = jnp.asarray(np.random.RandomState(0).randn(1, 1, cfg.hidden_size), jnp.float32)
    moe = jax.jit(H._moe, static_argnums=0)
    gathered = moe(cfg, lp, x)  # 1 token x top-2 < 4 experts: gather path
    dense = moe(cfg, lp, jnp.concatenate([x, x, x], axis=1))[:, :1]  # 3 x 2 >= 4: dense path
    assert np.abs(np.asarray(gathered)).max() > 0.1
    np.testing.assert_allclose(np.asarray(gathered), np.asarray(dense), atol=1e-5, rtol=0)
