"""jspec.aot: the HLO byte walker (exact counts on hand-made loops), its classes on a model loop, and
deviceless TPU / H200 compiles of the real loops through `jspec bench --aot` in the AOT interpreter."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jspec.aot import devices, hlo_bytes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _walk(fn, *shapes, weight_min=1, donate=()):
    text = jax.jit(fn, donate_argnums=donate).lower(*shapes).compile().as_text()
    return hlo_bytes.decode_loop_bytes(text, weight_min_bytes=weight_min, trace=True)


def test_walker_exact_bytes_of_a_matmul_loop():
    # Per round: x[8,256] @ w[256,512] -> tanh -> @ w.T: two GEMMs read w (512 KiB each) and the
    # activations; the tanh reads and writes [8,512]; the counter add reads 2 and writes 1 scalar.
    def f(w, x):
        def body(c):
            i, x = c
            return i + 1, jnp.tanh(x @ w) @ w.T
        return jax.lax.while_loop(lambda c: c[0] < 5, body, (0, x))

    r = _walk(f, jax.ShapeDtypeStruct((256, 512), jnp.float32), jax.ShapeDtypeStruct((8, 256), jnp.float32))
    w, x, h = 256 * 512 * 4, 8 * 256 * 4, 8 * 512 * 4
    assert r.weights == 2 * w
    assert r.other == (x + h) + (h + h) + (h + x) + 12
    assert r.kv_reads == 0 and r.cache_writes == 0
    assert r.total == r.weights + r.other
    assert r.kernels == 4 and not r.unknown_trips


def test_walker_in_place_update_slices_and_trip_count():
    # An inner fori_loop of 3 trips: a dynamic-update-slice of one [2,128] row block into a carried
    # rank-4 cache (written in place: only the update counts) and a dynamic-slice of one weight row.
    def g(cache, upd, w):
        def body(c):
            i, cache, acc = c

            def inner(j, st):
                cache, acc = st
                cache = jax.lax.dynamic_update_slice(cache, upd[None, None], (j, 0, i, 0))
                return cache, acc + jax.lax.dynamic_slice(w, (j, 0), (1, 128))[0]

            cache, acc = jax.lax.fori_loop(0, 3, inner, (cache, acc))
            return i + 1, cache, acc
        return jax.lax.while_loop(lambda c: c[0] < 7, body, (0, cache, jnp.zeros((128,), jnp.float32)))

    r = _walk(g, jax.ShapeDtypeStruct((3, 2, 64, 128), jnp.float32), jax.ShapeDtypeStruct((2, 128), jnp.float32),
              jax.ShapeDtypeStruct((3, 128), jnp.float32), weight_min=1536, donate=(0,))
    assert not r.unknown_trips
    assert r.weights == 3 * 128 * 4  # one row of w per trip, not the whole of w
    assert r.cache_writes == 3 * 2 * 128 * 4  # the update, not the [3,2,64,128] cache
    assert r.kv_reads == 0
    assert r.other > 3 * 2 * 128 * 4  # the update read, the accumulator, counters


def test_classes_on_a_model_decode_loop():
    from jspec.decode import ar
    from jspec.models.config import ModelConfig
    from jspec.models.transformer import init_params

    cfg = ModelConfig(family="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e4,
                      tie_word_embeddings=False, qk_norm=True, eos_token_ids=(), max_position_embeddings=4096)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    dcfg = ar.DecodeConfig(max_new_tokens=200, cache_size=256)
    args = (jax.ShapeDtypeStruct((1, 16), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.uint32))
    text = ar.generate_ar.lower(params, cfg, dcfg, *args).compile().as_text()
    r = hlo_bytes.decode_loop_bytes(text, weight_min_bytes=16384)
    matrices = sum(math.prod(x.shape) * 4 for x in jax.tree_util.tree_leaves(params) if x.ndim >= 2)
    embed = cfg.vocab_size * cfg.hidden_size * 4
    # Every matrix but the (gathered) embedding is read once per step.
    assert matrices - embed <= r.weights <= matrices - embed + 8192
    cache = 2 * cfg.num_layers * 256 * cfg.num_kv_heads * cfg.head_dim * 4
    assert r.kv_reads >= cache  # at least one pass over the whole cache (no valid-length cut-off here)
    assert 0 < r.cache_writes <= 4 * cache
    assert not r.unknown_trips  # the layer scan's trip count is known


def test_devices_contracts(monkeypatch):
    assert set(devices.CHIPS) == {"tpu-v5e", "tpu-v5p", "tpu-v6e", "h200"}
    assert devices.aot_env("tpu-v6e")["TPU_ACCELERATOR_TYPE"] == "v5litepod-1"
    assert devices.aot_env("h200")["XLA_FLAGS"] == "--xla_gpu_autotune_level=0"
    with pytest.raises(ValueError, match="unknown AOT chip 'v5p'"):
        devices.aot_env("v5p")
    assert "core_count: 132" in devices.h200_target_config()
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="libtpu==0.0.42.1"):
        devices.check_plugin("tpu-v5p")
    with pytest.raises(RuntimeError, match="jax-cuda12-plugin==0.10.2"):
        devices.check_plugin("h200")


def _aot_python() -> str:
    path = os.environ.get("JSPEC_AOT_PYTHON") or os.path.join(REPO, ".venv-aot", "bin", "python")
    if not os.path.exists(path):
        pytest.fail(f"no AOT interpreter at {path}: run `make .venv-aot/.done` (make test does) or set "
                    f"JSPEC_AOT_PYTHON to a Python with libtpu and jax-cuda12-plugin installed")
    return path


# About 40 s (TPU) and 20 s (H200) on 2 idle cores: three compiles each.
@pytest.mark.parametrize("chip", [pytest.param("tpu-v5p", marks=pytest.mark.slow), "h200"])
def test_bench_aot_real_loops_at_a_small_shape(chip, tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, **devices.aot_env(chip), "PYTHONPATH": REPO}
    proc = subprocess.run([_aot_python(), "-m", "jspec.cli", "bench", "--aot", chip, "--aot-shape", "tiny",
                           "--aot-quick", "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for label in ("chain B1 4k greedy", "tree B1 4k greedy", "ar B1 4k greedy"):
        assert label in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["chain B1 4k greedy", "tree B1 4k greedy", "ar B1 4k greedy"]
    for r in rows:
        b = r["bytes"]
        assert b["weights"] > 0 and b["kv_reads"] > 0 and b["cache_writes"] > 0 and b["other"] > 0
        assert b["total"] == pytest.approx(b["weights"] + b["kv_reads"] + b["cache_writes"] + b["other"])
        assert r["ideal"] == r["ideal_weights"] + r["ideal_kv"] + r["ideal_writes"] > 0
        assert r["ratio"] == pytest.approx(r["ideal"] / b["total"])
        assert r["kernels"] > 0 and r["memory"]["temp"] > 0 and r["cache_bytes"] > 0
        assert r["pass"] == all(r["checks"].values())
    spec, tree, plain = rows
    # The speculative rounds also read the drafter's weights; a tree verifies more rows than a chain.
    assert spec["ideal_weights"] > plain["ideal_weights"]
    assert tree["ideal_writes"] > spec["ideal_writes"]
