"""Damaged files and bad checkpoint values: each is one clear error that names the problem and the file.

A sweep over ways a checkpoint, a tokenizer, a config or a corpus goes bad (NaN / inf weights, integer
tensors, truncated or random files, broken JSON, shards that disagree with their index, binary corpora),
and the `jspec` command's report of them: one `jspec: error:` message and exit code 2, a traceback
only with --debug. Nothing here compiles a model.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jspec
from jspec import cli
from jspec.errors import CheckpointError, ConfigError, CorpusError, JspecError
from jspec.io.drafters import read_config
from jspec.io.hf import check_tensors, load_params
from jspec.io.tokenizer import load_tokenizer
from jspec.train import data
from jspec.train.trainer import TrainingDiverged

ST = "model.safetensors"
INDEX = "model.safetensors.index.json"
NORM = "model.norm.weight"
UP = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture()
def ckpt(hf_checkpoints, tmp_path):
    """A private copy of a tiny real Qwen3 checkpoint (config.json + model.safetensors)."""
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoints("qwen3")[0], dst)
    return dst


def _tensors(d, fn):
    t = load_file(str(d / ST))
    fn(t)
    save_file(t, str(d / ST), metadata={"format": "pt"})


def _set(name, index, value, dtype=None):
    def fn(t):
        if dtype is not None:
            for n in t:
                t[n] = t[n].astype(dtype)
        a = t[name].copy()
        a.reshape(-1)[index] = value
        t[name] = a
    return fn


def _config(d, fn=None, text=None):
    path = d / "config.json"
    if text is not None:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return
    cfg = json.loads(path.read_text())
    out = fn(cfg)  # edits cfg in place, or returns a replacement (a list)
    path.write_text(json.dumps(out if isinstance(out, list) else cfg, indent=2))


def _truncate(d):
    raw = (d / ST).read_bytes()
    (d / ST).write_bytes(raw[: len(raw) // 2])


def _shards(d, first: set[str], index: dict | None, both: set[str] = frozenset()):
    """Split model.safetensors in two shards (names in `first` -> shard 1, the rest -> shard 2, names in
    `both` in each; shard 1's copy of those is NaN); write `index` as the weight map (None: no index)."""
    t = load_file(str(d / ST))
    os.remove(d / ST)
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    one = {n: a for n, a in t.items() if n in first or n in both}
    one.update({n: np.full_like(t[n], np.nan) for n in both})
    two = {n: a for n, a in t.items() if n not in first or n in both}
    save_file(one, str(d / names[0]), metadata={"format": "pt"})
    save_file(two, str(d / names[1]), metadata={"format": "pt"})
    if index is not None:
        wm = {n: names[0] if n in first else names[1] for n in t}
        wm.update(index)
        (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return t, names


def _index_lies(d):
    _shards(d, {UP}, {NORM: "model-00001-of-00002.safetensors"})


def _no_index_duplicate(d):
    _shards(d, {UP}, None, both={NORM})


VALUE_HINTS = ["NaN / inf weights", "check_values=False", "load_params", "JSPEC_SKIP_VALUE_CHECK=1"]

# (id, damage(dir), the strings the message must hold; "{d}" is the checkpoint folder)
CASES = [
    ("nan-weight", lambda d: _tensors(d, _set(NORM, 3, np.nan)), [f"{NORM} (1 NaN, 0 inf of 64 values)", *VALUE_HINTS]),
    ("inf-weight-bf16", lambda d: _tensors(d, _set(UP, 7, np.inf, ml_dtypes.bfloat16)),
     [f"{UP} (0 NaN, 1 inf of 8192 values)", *VALUE_HINTS]),
    ("int-weight", lambda d: _tensors(d, lambda t: t.update({UP: t[UP].astype(np.int32)})),
     ["tensors of the wrong dtype (1)", f"{UP}: int32 (expected float16 / bfloat16 / float32)"]),
    ("float64-weight", lambda d: _tensors(d, lambda t: t.update({NORM: t[NORM].astype(np.float64)})),
     [f"{NORM}: float64 (expected float16 / bfloat16 / float32)"]),
    ("zero-byte-safetensors", lambda d: (d / ST).write_bytes(b""),
     ["{d}/model.safetensors is not a readable safetensors file", "empty (0 bytes)", "download or write it again"]),
    ("truncated-safetensors", _truncate,
     ["{d}/model.safetensors is not a readable safetensors file", "damaged or truncated"]),
    ("random-bytes-safetensors", lambda d: (d / ST).write_bytes(np.random.default_rng(0).bytes(4096)),
     ["{d}/model.safetensors is not a readable safetensors file", "damaged or truncated"]),
    ("config-without-vocab_size", lambda d: _config(d, lambda c: c.pop("vocab_size")),
     ["{d}/config.json: missing required field 'vocab_size'"]),
    ("config-vocab_size-string", lambda d: _config(d, lambda c: c.update(vocab_size="128")),
     ["{d}/config.json: vocab_size='128': must be a positive integer"]),
    ("config-is-a-list", lambda d: _config(d, lambda c: [c]), ["{d}/config.json holds a list", "JSON object"]),
    ("config-invalid-json", lambda d: _config(d, text='{\n  "vocab_size": 128,\n  "hidden_size": 64\n  "x": 1\n}'),
     ["{d}/config.json is not valid JSON: Expecting ',' delimiter at line 4, column 3"]),
    ("config-empty", lambda d: _config(d, text=""), ["{d}/config.json is empty"]),
    ("config-binary", lambda d: _config(d, text=b"\xff\xfe\x00garbage"), ["{d}/config.json is not JSON text"]),
    ("index-without-weight_map", lambda d: (d / INDEX).write_text('{"metadata": {"total_size": 1}}'),
     ["{d}/model.safetensors.index.json has no weight_map"]),
    ("index-invalid-json", lambda d: (d / INDEX).write_text('{"weight_map": {'),
     ["{d}/model.safetensors.index.json is not valid JSON", "line 1, column"]),
    ("index-maps-tensor-to-shard-without-it", _index_lies,
     ["{d}/model.safetensors.index.json maps 1 tensor(s) to {d}/model-00001-of-00002.safetensors, which does not "
      f"hold them: {NORM}"]),
    ("no-index-tensor-in-two-files", _no_index_duplicate,
     [f"tensor '{NORM}' is stored in two files, {{d}}/model-00001-of-00002.safetensors and "
      "{d}/model-00002-of-00002.safetensors"]),
]


@pytest.mark.parametrize("damage, needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_damaged_checkpoint_is_one_clear_error(ckpt, damage, needles):
    damage(ckpt)
    with pytest.raises(CheckpointError) as err:
        load_params(str(ckpt))
    msg = str(err.value)
    assert isinstance(err.value, JspecError) and isinstance(err.value, ValueError)
    assert str(ckpt) in msg
    for needle in needles:
        assert needle.replace("{d}", str(ckpt)) in msg, msg


def test_value_scan_can_be_skipped(ckpt, monkeypatch):
    _tensors(ckpt, _set(NORM, 0, np.nan))
    _, params = load_params(str(ckpt), check_values=False)
    assert np.isnan(np.asarray(params["final_norm"])[0])
    monkeypatch.setenv("JSPEC_SKIP_VALUE_CHECK", "1")
    load_params(str(ckpt))


def test_half_precision_checkpoint_loads(ckpt, hf_checkpoints):
    _tensors(ckpt, lambda t: t.update({n: a.astype(np.float16) for n, a in t.items()}))
    _, params = load_params(str(ckpt))
    _, ref = load_params(hf_checkpoints("qwen3")[0])
    np.testing.assert_allclose(np.asarray(params["final_norm"]), np.asarray(ref["final_norm"]), rtol=1e-3)


def test_index_picks_the_copy_it_names(ckpt, hf_checkpoints):
    # NORM is in both shards (shard 1's copy is NaN); the index names shard 2's, which loads.
    _shards(ckpt, {UP}, {}, both={NORM})
    _, params = load_params(str(ckpt))
    _, ref = load_params(hf_checkpoints("qwen3")[0])
    np.testing.assert_array_equal(np.asarray(params["final_norm"]), np.asarray(ref["final_norm"]))


def test_index_free_shards_load(ckpt, hf_checkpoints):
    _shards(ckpt, {UP, NORM}, None)
    _, params = load_params(str(ckpt))
    _, ref = load_params(hf_checkpoints("qwen3")[0])
    np.testing.assert_array_equal(np.asarray(params["layers"][0]["w_up"]), np.asarray(ref["layers"][0]["w_up"]))


def test_dtype_expectation_is_a_parameter():
    """A quantized format passes the dtypes it stores (uint32 codes) for the names that hold them."""
    found = {"q.weight": np.zeros((4, 1), np.uint32), "q.scales": np.ones((4, 1), np.float32)}
    shapes = {"q.weight": (4, 1), "q.scales": (4, 1)}
    check_tensors(found, shapes, "Q4 checkpoint 'x'", "fix", dtypes={"q.weight": ("uint32",)})
    with pytest.raises(CheckpointError, match=r"q\.weight: uint32 \(expected float16 / bfloat16 / float32\)"):
        check_tensors(found, shapes, "Q4 checkpoint 'x'", "fix")
    with pytest.raises(CheckpointError, match=r"q\.scales: float32 \(expected uint32\)"):
        check_tensors(found, shapes, "Q4 checkpoint 'x'", "fix", dtypes={n: ("uint32",) for n in shapes})
    found["q.scales"][2, 0] = np.inf  # codes are not floats: only the scales are scanned
    with pytest.raises(CheckpointError, match=r"q\.scales \(0 NaN, 1 inf of 4 values\)"):
        check_tensors(found, shapes, "Q4 checkpoint 'x'", "fix", dtypes={"q.weight": ("uint32",)})


def test_hybrid_nan_weight(tmp_path):
    from hybrid_helpers import checkpoint

    from jspec.io.hf_hybrid import load_hybrid_params

    d = tmp_path / "hybrid"
    shutil.copytree(checkpoint("qwen3_5")[0], d)
    name = next(n for n in load_file(str(d / ST)) if n.endswith("linear_attn.A_log"))
    _tensors(d, _set(name, 0, np.nan))
    with pytest.raises(CheckpointError) as err:
        load_hybrid_params(str(d))
    for needle in [str(d), f"{name} (1 NaN", "load_hybrid_params", "JSPEC_SKIP_VALUE_CHECK=1"]:
        assert needle in str(err.value)
    load_hybrid_params(str(d), check_values=False)


# --- other files of a checkpoint, and a corpus ------------------------------------------------------


def test_corrupt_tokenizer_json(ckpt):
    (ckpt / "tokenizer.json").write_text('{"version": "1.0", "truncation": null, "model": {')
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is not a valid tokenizer\.json") as err:
        load_tokenizer(str(ckpt))
    assert str(ckpt / "tokenizer.json") in str(err.value)
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is not a valid tokenizer\.json"):
        jspec.load_target(str(ckpt))


def test_hybrid_config_without_vocab_size(tmp_path):
    from jspec.models.hybrid import load_hybrid_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text", "hidden_size": 32}))
    with pytest.raises(CheckpointError) as err:
        load_hybrid_config(str(tmp_path))
    assert f"{tmp_path}/config.json: missing required fields 'vocab_size'" in str(err.value)


def test_drafter_config_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["DFlashDraftModel"],}')
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON: .* at line 1, column 40") as err:
        read_config(str(tmp_path))
    assert str(tmp_path / "config.json") in str(err.value)


@pytest.mark.parametrize("n_text", [0, 2], ids=["all-binary", "one-binary"])
def test_binary_corpus_is_named(tmp_path, n_text):
    for i in range(n_text):
        (tmp_path / f"t{i}.py").write_text(f"x = {i}\n")
    (tmp_path / "blob.py").write_bytes(b"\x89PNG\r\n\x1a\n\xff\x00" * 10)
    with pytest.raises(CorpusError) as err:
        data.corpus_files(str(tmp_path), "*.py")
    msg = str(err.value)
    assert "1 of " in msg and "are not UTF-8 text: blob.py (byte 0: invalid start byte)" in msg
    assert str(tmp_path) in msg and "t0.py" not in msg


def test_jspec_errors_share_one_base():
    for cls in (CheckpointError, ConfigError, CorpusError, TrainingDiverged):
        assert issubclass(cls, JspecError) and issubclass(cls, ValueError)
    from jspec.io import hf

    assert hf.CheckpointError is CheckpointError  # the old import path names the same class


# --- the jspec command -------------------------------------------------------------------------------


def test_cli_reports_a_damaged_checkpoint_in_one_line(ckpt, capsys):
    (ckpt / ST).write_bytes(b"")
    argv = ["generate", "--target", str(ckpt), "--prompt-ids", "1,2", "--max-new-tokens", "2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jspec: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert f"{ckpt}/model.safetensors is not a readable safetensors file" in err
    with pytest.raises(CheckpointError, match="is not a readable safetensors file"):
        cli.main(["--debug", *argv])


def test_cli_damaged_checkpoint_in_a_process(ckpt):
    """The real command: exit 2 and one message; with --debug, Python's traceback."""
    _tensors(ckpt, _set(NORM, 1, np.nan))
    argv = [sys.executable, "-m", "jspec.cli", "generate", "--target", str(ckpt), "--prompt-ids", "1,2"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("jspec: error: ") and "Traceback" not in out.stderr
    assert "NaN / inf weights" in out.stderr and str(ckpt) in out.stderr
    out = subprocess.run([*argv[:3], "--debug", *argv[3:]], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "Traceback (most recent call last)" in out.stderr and "CheckpointError" in out.stderr


def test_cli_bad_training_config(tmp_path, capsys):
    (tmp_path / "run.json").write_text('{"model": {"vocab_size": 64}\n "train": {}}')
    assert cli.main(["train", "target", "--config", str(tmp_path / "run.json"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"jspec: error: {tmp_path}/run.json is not valid JSON: Expecting ',' delimiter at line 2, column 2" in err


def test_cli_disk_full_is_one_message(monkeypatch, capsys, tmp_path):
    path = str(tmp_path / "model.safetensors")

    def full(args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(cli, "cmd_demo", full)
    assert cli.main(["demo", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"jspec: error: No space left on device: {path} (the disk is full: free some space, or write " \
                  "somewhere else)\n"
    with pytest.raises(OSError):
        cli.main(["--debug", "demo", "--out", str(tmp_path)])
