"""Affine Q4 group-64 targets: the MLX layout loads strictly, `jspec convert --q4` round-trips through the
documented formula, the Q4 forward equals a float64 transformers model of the dequantized weights, and
speculative decoding of a Q4 target equals plain decoding of the same Q4 model.

The format is read here with the test's own numpy (bit unpacking, scale * code + bias), never through
jspec.models.quant, so the loader is checked against the documentation, not against itself.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jspec
from jspec import cli
from jspec.io.hf import CheckpointError
from jspec.io.models import load_model, save_model
from jspec.models import quant
from jspec.models import target as tm

from hybrid_helpers import make_hf_hybrid, torch_eval

Q = {"group_size": 64, "bits": 4}


# --- the documented format, in plain numpy ------------------------------------------------------


def np_quantize(w: np.ndarray):
    """MLX's documented affine quantization: per 64 inputs bias = min, scale = (max - min) / 15, codes
    rounded, packed 8 per uint32 with the lowest bits first."""
    g = w.astype(np.float32).reshape(w.shape[0], -1, 64)
    lo, hi = g.min(-1), g.max(-1)
    scale = (hi - lo) / 15
    safe = np.where(scale > 0, scale, 1)[..., None]  # a constant group (e.g. the zero padding row): codes 0
    codes = np.clip(np.rint((g - lo[..., None]) / safe), 0, 15).astype(np.uint32).reshape(w.shape)
    words = np.zeros((w.shape[0], w.shape[1] // 8), np.uint32)
    for j in range(8):
        words |= codes[:, j::8] << np.uint32(4 * j)
    return words, scale.astype(np.float32), lo.astype(np.float32)


def np_dequantize(words: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
    """float64 weights [out, in] from the stored tensors."""
    codes = np.stack([(words >> np.uint32(4 * j)) & np.uint32(15) for j in range(8)], axis=-1)
    codes = codes.reshape(words.shape[0], -1).astype(np.float64)
    return (codes.reshape(codes.shape[0], -1, 64) * scales.astype(np.float64)[..., None]
            + biases.astype(np.float64)[..., None]).reshape(codes.shape)


def write_mlx(src: str, dst: str) -> dict[str, np.ndarray]:
    """Quantize the float checkpoint `src` into `dst` as mlx-lm lays it out (every 2-d `.weight` whose
    input dimension is a multiple of 64); returns the float64 dequantized value of every tensor."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, values = {}, {}
    for name, w in tensors.items():
        if name.endswith(".weight") and w.ndim == 2 and w.shape[1] % 64 == 0:
            words, s, b = np_quantize(w)
            base = name[: -len(".weight")]
            out[name], out[base + ".scales"], out[base + ".biases"] = words, s, b
            values[name] = np_dequantize(words, s, b)
        else:
            out[name] = w
            values[name] = w.astype(np.float64)
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, "quantization": Q}, f)
    return values


def torch_logits_f64(src: str, values: dict[str, np.ndarray], ids: np.ndarray, tmp_path) -> np.ndarray:
    """transformers' model of `src`'s config with the dequantized weights `values`, loaded in float64."""
    import torch
    import transformers

    ref = tmp_path / "dequantized-f64"
    os.makedirs(ref, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), ref / "config.json")
    save_file(values, str(ref / "model.safetensors"), metadata={"format": "pt"})
    with torch_eval():
        model = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float64,
                                                                  experts_implementation="eager")
        return model(torch.from_numpy(ids).long()).logits.numpy()


def jspec_logits(cfg, params, ids: np.ndarray) -> np.ndarray:
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, *_ = jax.jit(tm.forward, static_argnums=(1,))(params, cfg, jnp.asarray(ids, jnp.int32), pos,
                                                          tm.init_cache(cfg, b, 32))
    return np.asarray(tm.logits(params, cfg, hidden))


IDS = np.random.default_rng(0).integers(3, 128, (2, 12))


@pytest.fixture(scope="module")
def dense_q4(hf_checkpoints, tmp_path_factory):
    src, model = hf_checkpoints("qwen3")
    dst = str(tmp_path_factory.mktemp("q4") / "mlx")
    return src, dst, model, write_mlx(src, dst)


# --- format and loading -------------------------------------------------------------------------


def test_quantize_matches_the_documented_formula():
    w = np.random.default_rng(1).normal(size=(24, 192)).astype(np.float32)
    q = quant.quantize(w)
    words, s, b = np_quantize(w)
    np.testing.assert_array_equal(np.asarray(q.codes), words)
    np.testing.assert_array_equal(np.asarray(q.scales), s)
    np.testing.assert_array_equal(np.asarray(q.biases), b)
    deq = np_dequantize(words, s, b)
    # float32 scale * code + bias: one rounding with a fused multiply-add, two without, so within one unit
    # in the last place of the operands' magnitude of the float64 value
    got = np.asarray(quant.dequantize(jax.tree_util.tree_map(jnp.asarray, q)))
    assert np.all(np.abs(got - deq) <= np.finfo(np.float32).eps * np.repeat(15 * s + np.abs(b), 64, axis=1))
    # every weight within half a step of its group's grid
    step = np.repeat(s, 64, axis=1)
    assert np.all(np.abs(deq - w) <= step / 2 + 1e-6), np.max(np.abs(deq - w) - step / 2)


def test_mlx_layout_loads_and_matches_float64_transformers(dense_q4, tmp_path):
    src, dst, _, values = dense_q4
    cfg, params, _ = load_model(dst)
    layer = params["layers"][0]
    assert all(quant.is_q4(layer[k]) for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    assert quant.is_q4(params["embed"]) and quant.is_q4(params["lm_head"])
    assert not quant.is_q4(layer["attn_norm"])
    got = jspec_logits(cfg, params, IDS)
    want = torch_logits_f64(src, values, IDS, tmp_path)
    # float32 evaluation of the same weights: within 2e-4 of the float64 reference (logits ~ 5)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    # and the quantization is visible: the float model's logits differ by far more
    float_cfg, float_params, _ = load_model(src)
    assert np.max(np.abs(jspec_logits(float_cfg, float_params, IDS) - want)) > 1e-2


def test_convert_round_trips_through_the_formula(dense_q4, tmp_path):
    src, _, _, _ = dense_q4
    out = tmp_path / "q4"
    assert cli.main(["convert", src, str(out), "--q4"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    tensors, source = load_file(str(out / "model.safetensors")), load_file(os.path.join(src, "model.safetensors"))
    for name, w in source.items():
        if w.ndim == 2:
            base = name[: -len(".weight")]
            assert tensors[name].dtype == np.uint32 and tensors[name].shape == (w.shape[0], w.shape[1] // 8)
            deq = np_dequantize(tensors[name], tensors[base + ".scales"], tensors[base + ".biases"])
            step = np.repeat(tensors[base + ".scales"], 64, axis=1).astype(np.float64)
            assert np.all(np.abs(deq - w) <= step / 2 + 1e-6), name
        else:
            np.testing.assert_array_equal(tensors[name], w)
    # the converted folder loads and equals the documented dequantization of its own tensors
    cfg, params, _ = load_model(str(out))
    base = "model.layers.1.mlp.down_proj."
    deq = np_dequantize(tensors[base + "weight"], tensors[base + "scales"], tensors[base + "biases"])
    np.testing.assert_allclose(np.asarray(quant.dense(params["layers"][1]["w_down"])), deq, rtol=0, atol=1e-6)


def _damage(dense_q4, tmp_path, edit_tensors=None, edit_config=None) -> str:
    _, dst, _, _ = dense_q4
    path = tmp_path / "bad"
    shutil.copytree(dst, path)
    if edit_tensors:
        tensors = load_file(str(path / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(path / "model.safetensors"))
    if edit_config:
        config = json.loads((path / "config.json").read_text())
        edit_config(config)
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


Q_NAME = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("case, edit_tensors, edit_config, message", [
    ("8-bit", None, lambda c: c["quantization"].update(bits=8), "bits"),
    ("group 32", None, lambda c: c["quantization"].update(group_size=32), "group_size"),
    ("other mode", None, lambda c: c["quantization"].update(mode="mxfp4"), "mxfp4"),
    ("per-layer", None, lambda c: c["quantization"].update({Q_NAME: {"bits": 8, "group_size": 64}}), "per-layer"),
    ("gptq", None, lambda c: c.update(quantization=None, quantization_config={"quant_method": "gptq"}), "gptq"),
    ("missing biases", lambda t: t.pop(Q_NAME + ".biases"), None, Q_NAME + ".biases"),
    ("misshapen scales", lambda t: t.update({Q_NAME + ".scales": t[Q_NAME + ".scales"][:, :0]}), None, "misshapen"),
    ("int32 codes", lambda t: t.update({Q_NAME + ".weight": t[Q_NAME + ".weight"].astype(np.int32)}), None,
     "uint32"),
    ("stray scales", lambda t: t.update({"model.norm.scales": np.ones(1, np.float32)}), None, "model.norm.scales"),
])
def test_bad_q4_checkpoints_are_refused_by_name(dense_q4, tmp_path, case, edit_tensors, edit_config, message):
    path = _damage(dense_q4, tmp_path, edit_tensors, edit_config)
    with pytest.raises(CheckpointError, match=message.replace(".", r"\.")):
        load_model(path)


def test_q4_parameters_are_not_saved_as_float(dense_q4, tmp_path):
    cfg, params, _ = load_model(dense_q4[1])
    with pytest.raises(ValueError, match="convert"):
        save_model(str(tmp_path / "out"), cfg, params)


# --- decoding: speculative equals plain decoding of the same Q4 model ---------------------------


PROMPT = [[5, 9, 5, 9, 5, 9, 17], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]]


GREEDY, SAMPLED = jspec.SamplingParams(0.0), jspec.SamplingParams(1.0)
ALL_CASES = ((GREEDY, "greedy", "lookup"), (GREEDY, "greedy", "self"), (SAMPLED, "gumbel", "lookup"),
             (SAMPLED, "gumbel", "self"))


def _generate(target, sampling, **kw):
    return jspec.generate(target, PROMPT, max_new_tokens=20, sampling=sampling, seeds=3, eos_ids=[], **kw)


def _assert_spec_equals_ar(target, cases=ALL_CASES, **kw):
    """Greedy and Gumbel-coupled (T = 1) speculative decoding equal plain decoding of the same Q4 model,
    with the lookup drafter and with the Q4 model drafting for itself ("self": a small-LM drafter from the
    same folder, whose drafts are mostly accepted, so verify passes commit several rows). Returns plain
    decoding's results by sampling."""
    ar = {}
    for sampling, verifier, drafter in cases:
        if sampling not in ar:
            ar[sampling] = _generate(target, sampling, **kw)
        sp = _generate(target, sampling, drafter=target.path if drafter == "self" else drafter, verifier=verifier,
                       block_size=4, **kw)
        assert sp.tokens == ar[sampling].tokens, (sampling, drafter, sp.tokens, ar[sampling].tokens)
        if drafter == "self":
            assert sp.stats["tau"] > 2, sp.stats
    return ar


def test_q4_speculative_equals_plain_decoding(dense_q4):
    _assert_spec_equals_ar(jspec.load_target(dense_q4[1]))


def test_q4_kernel_speculative_equals_plain_decoding(dense_q4):
    """The same with every Q4 matmul in the Pallas kernel (interpreted here): kernels="pallas" sets the
    target's Q4 matrices to it (and its attention to the tree-attention kernel), in both loops: greedy
    with the lookup drafter, Gumbel-coupled with the self-drafting one (each Pallas loop is a long compile,
    the other two pairs run through the XLA matmul above)."""
    target = jspec.load_target(dense_q4[1])
    ar = _assert_spec_equals_ar(target, cases=(ALL_CASES[0], ALL_CASES[3]), kernels="pallas")
    # the kernel and the XLA matmul agree on these greedy tokens (the XLA loop: the test above's program)
    assert ar[GREEDY].tokens == _generate(target, GREEDY).tokens


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_hybrid_q4_loads_matches_float64_and_decodes_exactly(tmp_path, family):
    """Loading, the float64 check, and greedy and Gumbel-coupled self-drafting (verify passes that commit
    the recurrent state after several accepted rows) equal to plain decoding; the lookup drafter on
    hybrid targets is tests/test_hybrid_loop.py's."""
    with torch_eval():
        model = make_hf_hybrid(family, hidden_size=64)
        model.save_pretrained(tmp_path / "float")
    values = write_mlx(str(tmp_path / "float"), str(tmp_path / "q4"))
    cfg, params, _ = load_model(str(tmp_path / "q4"))
    kinds = {k for lp in params["layers"] for k, v in lp.items() if quant.is_q4(v)}
    assert {"w_qkv", "w_z", "w_b", "w_a", "wq", "wo"} <= kinds and "w_out" not in kinds, kinds  # out_proj: 32 inputs
    if family == "qwen3_next":  # experts [E, Fe, D] quantized per expert; e_down's inputs (16) stay float
        assert {"e_gate", "e_up", "router", "s_gate", "shared_gate"} <= kinds and "e_down" not in kinds
    got = jspec_logits(cfg, params, IDS)
    want = torch_logits_f64(str(tmp_path / "float"), values, IDS, tmp_path)
    np.testing.assert_allclose(got, want, atol=5e-4, rtol=0)
    target = jspec.load_target(str(tmp_path / "q4"))
    ar = _assert_spec_equals_ar(target, cases=(ALL_CASES[1], ALL_CASES[3]))
    if family == "qwen3_5":  # the GDN and attention projections through the Pallas kernel (interpreted),
        # in verify passes of several rows: the same greedy tokens as the XLA matmul's plain decoding
        sp = _generate(target, GREEDY, drafter="lookup", verifier="greedy", block_size=4, kernels="pallas")
        assert sp.tokens == ar[GREEDY].tokens


# --- deviceless compile: a Q4 round reads the Q4 bytes -------------------------------------------


def test_bench_aot_q4_rounds_read_the_quantized_weights(tmp_path):
    """`jspec bench --aot h200 --q4` at the tiny shape: every loop reads each Q4 matrix (codes, scales and
    biases: 9/16 byte per bf16 weight) once per round, and the ideal counts those bytes."""
    import subprocess

    from jspec.aot import bench, devices

    from test_aot import REPO, _aot_python

    out = tmp_path / "rows.json"
    env = {**os.environ, **devices.aot_env("h200"), "PYTHONPATH": REPO}
    proc = subprocess.run([_aot_python(), "-m", "jspec.cli", "bench", "--aot", "h200", "--aot-shape", "tiny",
                           "--aot-quick", "--q4", "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Q4 target" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    cfg = bench.shapes()["tiny"]
    embed = cfg.vocab_size * cfg.hidden_size
    q4_bytes = (cfg.num_params - cfg.num_layers * 2 * cfg.hidden_size - 2 * cfg.num_layers * cfg.head_dim
                - cfg.hidden_size - embed) * 9 / 16  # every matrix but the (gathered) embedding, in Q4
    plain = next(r for r in rows if r["loop"] == "ar")
    assert all(r["q4"] for r in rows)
    # the ideal: the Q4 matrices plus the float norms (a few KB)
    assert q4_bytes <= plain["ideal_weights"] <= q4_bytes + 64 * 1024, (plain["ideal_weights"], q4_bytes)
    # plain AR reads each Q4 matrix once per round (measured 1.482 MB against an ideal of 1.480 MB); the
    # speculative rounds read the target's and the (bf16) drafter's weights, each at least once
    assert plain["ideal_weights"] <= plain["bytes"]["weights"] <= 1.1 * plain["ideal_weights"]
    for r in rows:
        assert r["ideal_weights"] <= r["bytes"]["weights"] <= 1.5 * r["ideal_weights"], r["case"]
