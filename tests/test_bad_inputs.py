"""Damaged files and bad checkpoint values: each is one clear error that names the problem and the file.

A sweep over ways a checkpoint, a tokenizer, a config or a corpus goes bad (NaN / inf weights, integer
tensors, truncated or random files, broken JSON, shards that disagree with their index, binary corpora),
and the `jspec` command's report of them: one `jspec: error:` message and exit code 2, a traceback
only with --debug. Then bad `generate` requests (lengths past the model's context, caches, prompts that
are not lists of integer ids, seeds, EOS ids, sampling values, arguments a drafter would ignore): one
RequestError / ValueError before anything compiles; only the `stopped_by` tests at the end compile a loop.
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
from jspec.api import RequestError, stopped_by
from jspec.decode import ar, spec
from jspec.drafters import dflash, family
from jspec.errors import CheckpointError, ConfigError, CorpusError, JspecError
from jspec.io.drafters import read_config
from jspec.io.hf import check_tensors, load_params
from jspec.io.tokenizer import load_tokenizer
from jspec.train import data
from jspec.models import transformer
from jspec.models.config import ModelConfig
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


# --- bad generate requests: one error before compiling, nothing truncated silently -----------------

SMALL = ModelConfig(family="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                    num_kv_heads=2, head_dim=8, qk_norm=True, max_position_embeddings=256)


@pytest.fixture(scope="module")
def small():
    import jax

    return jspec.Target(SMALL, transformer.init_params(SMALL, jax.random.key(0), std=0.3))


def _compiled():
    return ar.generate_ar._cache_size(), spec.generate_spec._cache_size()


# (id, generate's arguments over prompts=[[1, 2, 3]], max_new_tokens=4; the strings the message must hold)
REQUESTS = [
    ("max-new-tokens-past-context", dict(max_new_tokens=10**8),
     ["prompt 0 (3 tokens) + max_new_tokens 100000000 = 100000003 positions", "max_position_embeddings 256",
      "lower max_new_tokens to at most 253"]),
    ("prompt-past-context", dict(prompts=[[1] * 300]),
     ["prompt 0 has 300 tokens", "max_position_embeddings of 256", "shorten it to at most 255 tokens"]),
    ("cache-past-context", dict(cache_size=4096),
     ["cache_size 4096 is more than the model's max_position_embeddings 256", "pass cache_size <= 256"]),
    ("cache-not-an-integer", dict(cache_size=32.5), ["cache_size must be an integer >= 1", "got 32.5", "unset"]),
    ("flat-list-of-ids", dict(prompts=[1, 2, 3]), ["one flat list of 3 token ids", "[[1, 2, 3]]"]),
    ("text-prompts", dict(prompts="def f():"), ["text ('def f():')", "[target.encode(text)]"]),
    ("text-prompt-in-a-list", dict(prompts=["def f():"]), ["prompt 0 is text", "[target.encode(text)]"]),
    ("float-id", dict(prompts=[[1, 3.7]]), ["prompt 0 has ids that are not integers: [3.7]", "never truncated"]),
    ("bool-id", dict(prompts=[[1, True]]), ["not integers: [True]", "bools are refused"]),
    ("float-array-prompt", dict(prompts=[np.array([1.0, 2.0])]), ["prompt 0 holds float64 values", "integer ids"]),
    ("id-outside-vocab", dict(prompts=[[1, 96]]), ["outside the vocabulary [0, 96): [96]", "tokenized for this model"]),
    ("seed-negative", dict(seeds=-1), ["seed -1 is outside [0, 2**32)", "pass a seed in [0, 4294967295]"]),
    ("seed-2**32", dict(seeds=2**32), ["seed 4294967296 is outside [0, 2**32)"]),
    ("seed-plus-row-wraps", dict(prompts=[[1], [2]], seeds=2**32 - 1),
     ["prompt i takes seed + i, up to 4294967296", "pass a seed in [0, 4294967294]"]),
    ("seed-list-outside", dict(seeds=[2**32 + 5]), ["seeds [4294967301] are outside [0, 2**32)", "never wrapped"]),
    ("seed-float", dict(seeds=[1.5]), ["seeds must be integers", "[1.5]"]),
    ("eos-outside-vocab", dict(eos_ids=[96]), ["eos_ids [96] are outside the vocabulary [0, 96)", "[] for none"]),
    ("eos-not-a-list", dict(eos_ids=2), ["eos_ids must be a list of token ids, got 2", "[2]"]),
    ("no-drafter-verifier", dict(verifier="speculative"),
     ["plain autoregressive decoding (no drafter) takes no verifier (got 'speculative')", "pass a drafter"]),
    ("no-drafter-tree-budget", dict(tree_budget=4), ["takes no tree budget (got 4)", "drop the tree budget"]),
    ("no-drafter-block-size", dict(block_size=4), ["takes no block size (got 4)", "drop the block size"]),
    ("no-drafter-verify-budget", dict(verify_budget="profile"), ["takes no verify budget (got 'profile')"]),
]


@pytest.mark.parametrize("kwargs, needles", [c[1:] for c in REQUESTS], ids=[c[0] for c in REQUESTS])
def test_bad_request_is_one_error_before_compiling(small, kwargs, needles):
    args = {"prompts": [[1, 2, 3]], "max_new_tokens": 4, **kwargs}
    before = _compiled()
    with pytest.raises(RequestError) as err:
        jspec.generate(small, args.pop("prompts"), **args)
    assert isinstance(err.value, JspecError) and isinstance(err.value, ValueError)
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    assert _compiled() == before


def test_numpy_ids_and_seeds_are_integers(small):
    """numpy integers pass the checks (ids, seeds, EOS); the refusals above are about values, not types."""
    packed, lens = jspec.api.pack_prompts([np.array([4, 5], np.int64), [np.int32(7)]], 96)
    assert packed[:, :2].tolist() == [[4, 5], [7, 0]] and lens.tolist() == [2, 1]
    assert jspec.api._check_seeds(np.array([0, 2**32 - 1], np.uint64), 2).tolist() == [0, 2**32 - 1]
    assert jspec.api._check_eos([np.int64(95)], 96) == (95,)


def test_cache_beyond_memory_is_refused_with_the_numbers(small, monkeypatch):
    import dataclasses

    wide = jspec.Target(dataclasses.replace(SMALL, max_position_embeddings=2**24), small.params)
    monkeypatch.setattr(jspec.api, "_memory_bytes", lambda mesh: (2**30, "test memory"))
    before = _compiled()
    with pytest.raises(RequestError) as err:
        jspec.generate(wide, [[1, 2]], max_new_tokens=2**23)
    msg = str(err.value)
    for needle in ["the KV cache needs 3.1 GiB", "3 layers x 2 x 2 KV heads x 8 head_dim x 4 bytes x batch 1 x ",
                   "more than the 1.0 GiB of test memory", "lower max_new_tokens / cache_size"]:
        assert needle in msg, msg
    assert _compiled() == before
    assert jspec.api._memory_bytes(None)[0] > 2**20  # the real ceiling here: host RAM (or the device's memory)


@pytest.mark.parametrize("field, value, needle", [
    ("temperature", float("inf"), "finite (not inf or NaN), got inf"),
    ("temperature", float("nan"), "finite (not inf or NaN), got nan"),
    ("temperature", -0.5, "temperature must be a number >= 0 (0 = greedy)"),
    ("temperature", True, "got True"),
    ("temperature", 1e-45, "outside the float32 range"),
    ("top_p", 0.0, "top_p must lie in (0, 1] (1 = off), got 0.0"),
    ("top_p", 1.5, "got 1.5"),
    ("top_p", 1e-40, "below float32's smallest normal number 1.18e-38"),  # flushed to 0: nothing kept
    ("top_p", float("nan"), "got nan"),
    ("top_k", -1, "top_k must be an integer >= 0 (0 = off), got -1"),
    ("top_k", 2.5, "got 2.5"),
    ("top_k", 2**40, "top_k must be below 2**31"),
])
def test_bad_sampling_value_is_named(field, value, needle):
    with pytest.raises(ValueError) as err:
        jspec.SamplingParams(**{field: value})
    assert needle in str(err.value), str(err.value)


def test_numpy_sampling_values_are_plain_numbers():
    p = jspec.SamplingParams(np.float32(0.5), np.int64(3), np.float64(0.25))
    assert p == jspec.SamplingParams(0.5, 3, 0.25) and type(p.top_k) is int and type(p.temperature) is float


@pytest.fixture(scope="module")
def block_drafters(small, tmp_path_factory):
    """Saved DFlash (block_size 4 counting the anchor: 3 drafts) and DSpark (4 drafts) checkpoints."""
    out = {}
    for name in ("dflash", "dspark"):
        fam = family.get_family(name)
        dr, params = fam.example(small)
        out[name] = str(tmp_path_factory.mktemp(name))
        fam.save(out[name], dr, params)
    return out


@pytest.mark.parametrize("name, block, tree, needles", [
    ("dflash", 2, 0, ["drafts a fixed block of 3 tokens per round", "block_size 4 in its config, counting the anchor",
                      "cannot draft block_size=2", "leave the block size unset (or pass 3)"]),
    ("dflash", 8, 0, ["fixed block of 3 tokens", "cannot draft block_size=8"]),
    ("dflash", 2, 6, ["fixed block of 3 tokens", "cannot draft block_size=2"]),
    ("dspark", 3, 0, ["drafts a fixed block of 4 tokens per round (block_size 4 in its config)",
                      "it drafts only the block it was trained for", "cannot draft block_size=3", "(or pass 4)"]),
])
def test_block_size_a_checkpoint_cannot_draft_is_refused(small, block_drafters, name, block, tree, needles):
    before = _compiled()
    with pytest.raises(RequestError) as err:
        jspec.generate(small, [[1, 2, 3]], max_new_tokens=4, drafter=block_drafters[name], block_size=block,
                       tree_budget=tree)
    for needle in [block_drafters[name], *needles]:
        assert needle in str(err.value), str(err.value)
    assert _compiled() == before


def test_block_size_the_checkpoint_drafts_is_accepted(small, block_drafters):
    for name, blocks, g in [("dflash", (None, 3, 4), 3), ("dspark", (None, 4), 4)]:
        for block in blocks:  # unset, the drafts per round, or the config's block_size: the trained block
            assert jspec.load_drafter(block_drafters[name], small, block_size=block)[0].num_drafts == g
    assert jspec.load_drafter("lookup", small, block_size=5)[0].num_drafts == 5  # lookup takes any block


def test_a_drafter_object_is_not_reshaped_silently(small):
    from jspec.drafters.lookup import PromptLookup

    chain = PromptLookup(block_size=3, vocab_size=96)
    before = _compiled()
    for drafter, kw, needle in [(chain, dict(block_size=5), "drafts a chain of 3 drafts and runs as given, so "
                                 "block_size=5 cannot reshape it"),
                                ((chain, ()), dict(tree_budget=6), "so tree_budget=6 cannot reshape it")]:
        with pytest.raises(RequestError) as err:
            jspec.generate(small, [[1, 2, 3]], max_new_tokens=4, drafter=drafter, **kw)
        assert needle in str(err.value) and "with_shape(drafter, block_size, tree_budget)" in str(err.value)
    assert _compiled() == before


def test_stopped_by_names_each_rows_reason():
    tokens = np.array([[1, 2, 7, 2, 0, 0], [1, 5, 6, 7, 0, 0], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])
    prompt_len, length = np.array([2, 1, 4, 4]), np.array([4, 4, 6, 6])
    assert stopped_by(tokens, prompt_len, length, 3, 6, [2]) == ["eos", "max_new_tokens", "cache_full", "cache_full"]
    assert stopped_by(tokens, prompt_len, length, 8, 6, [], max_pos=6)[2:] == ["context_limit"] * 2
    assert stopped_by(tokens, prompt_len, length, 2, 6, [2])[:2] == ["eos", "max_new_tokens"]  # EOS wins at the cap


def test_small_cache_stops_rows_and_says_so(small):
    """An explicit cache smaller than prompt + max_new_tokens stops rows early, in both loops: reported in
    stats["stopped_by"], never silently."""
    prompts = [[5, 9, 17, 3, 44, 5, 9, 17], [7, 8, 7, 8]]
    kw = dict(max_new_tokens=10, cache_size=16, eos_ids=[])
    plain = jspec.generate(small, prompts, **kw)
    fast = jspec.generate(small, prompts, drafter="lookup", block_size=3, **kw)
    assert [len(t) for t in plain.tokens] == [8, 10] and fast.tokens == plain.tokens
    assert plain.stats["stopped_by"] == fast.stats["stopped_by"] == ["cache_full", "max_new_tokens"]


# --- ... and through the jspec command -------------------------------------------------------------


@pytest.mark.parametrize("argv, needles", [
    (["--drafter", "none", "--verifier", "speculative"], ["takes no verifier (got 'speculative')"]),
    (["--tree-budget", "4"], ["takes no tree budget (got 4)"]),
    (["--block-size", "4"], ["takes no block size (got 4)"]),
    (["--verify-budget"], ["takes no verify budget (got 'profile')"]),
    (["--seed", "-1"], ["seeds [-1] are outside [0, 2**32)"]),
    (["--seed", str(2**32)], ["seeds [4294967296] are outside [0, 2**32)"]),
    (["--temperature", "inf"], ["finite (not inf or NaN), got inf"]),
    (["--temperature", "nan"], ["got nan"]),
    (["--top-p", "1.5"], ["top_p must lie in (0, 1]"]),
    (["--top-k", "-1"], ["top_k must be an integer >= 0"]),
    (["--max-new-tokens", str(10**8)], ["max_position_embeddings 256", "lower max_new_tokens to at most 254"]),
    (["--cache-size", "4096"], ["cache_size 4096 is more than the model's max_position_embeddings 256"]),
], ids=["verifier", "tree-budget", "block-size", "verify-budget", "seed-negative", "seed-2**32", "temperature-inf",
        "temperature-nan", "top-p", "top-k", "max-new-tokens", "cache-size"])
def test_cli_bad_request_is_one_line(hf_checkpoints, capsys, argv, needles):
    base = ["generate", "--target", hf_checkpoints("qwen3")[0], "--prompt-ids", "1,2", "--max-new-tokens", "4"]
    capsys.readouterr()  # the checkpoint's own writing progress, on its first use
    before = _compiled()
    assert cli.main(base + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jspec: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    assert _compiled() == before


def test_cli_block_size_with_a_dflash_checkpoint(hf_checkpoints, tmp_path, capsys):
    import jax

    target = jspec.load_target(hf_checkpoints("qwen3")[0])
    cfg = dflash.config_from_run({"num_layers": 1, "block_size": 4, "mask_token_id": 0, "target_layer_ids": [0]},
                                 target.cfg, anchor_predicts=False)
    dflash.save_checkpoint(str(tmp_path), cfg, dflash.init_params(cfg, jax.random.key(0)))
    argv = ["generate", "--target", hf_checkpoints("qwen3")[0], "--prompt-ids", "1,2", "--drafter", str(tmp_path),
            "--block-size", "2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "drafts a fixed block of 3 tokens per round" in err and "leave the block size unset (or pass 3)" in err


def test_cli_non_utf8_prompt(hf_checkpoints):
    """argv bytes that are not UTF-8 reach Python as lone surrogates; the command names the byte."""
    argv = [sys.executable, "-m", "jspec.cli", "generate", "--target", hf_checkpoints("qwen3")[0], "--prompt",
            b"caf\xe9 \xff"]
    out = subprocess.run(argv, capture_output=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    err = out.stderr.decode()
    assert err.startswith("jspec: error: --prompt is not valid UTF-8 text (byte 0xe9 at offset 3: invalid "
                          "continuation byte)") and "--prompt-ids" in err and "Traceback" not in err


def test_cli_warns_when_the_cache_cuts_the_row(hf_checkpoints, capsys):
    argv = ["generate", "--target", hf_checkpoints("qwen3")[0], "--prompt-ids", "1,2,3", "--cache-size", "32",
            "--max-new-tokens", "200"]
    assert cli.main([*argv, "--json"]) == 0
    out = capsys.readouterr()
    res = json.loads(out.out)
    assert len(res["tokens"]) == 29 and res["stats"]["stopped_by"] == ["cache_full"]
    assert out.err == ("jspec: warning: generation stopped after 29 of 200 new tokens: the cache of 32 rows is full "
                       "(a prompt of 3 tokens + --max-new-tokens 200 needs 203): raise --cache-size to at least 203, "
                       "or leave it unset\n")
    assert cli.main(argv) == 0
    assert capsys.readouterr().err.startswith("jspec: warning: generation stopped after 29 of 200 new tokens")


def test_lookup_tree_refuses_a_block_size_it_would_ignore(small):
    """A prompt-lookup tree takes its shape from the tree budget: an explicit block size is refused, not
    ignored."""
    from jspec.api import RequestError

    with pytest.raises(RequestError, match=r"tree budget alone.*block_size=3 would be ignored"):
        jspec.load_drafter("lookup", small, block_size=3, tree_budget=6)
    assert jspec.load_drafter("lookup", small, tree_budget=6)[0].num_drafts == 6
