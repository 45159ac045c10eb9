"""Bad input fails early with one clear error that names the problem."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jspec
from jspec.decode import ar
from jspec.io.hf import CheckpointError, load_params


@pytest.fixture()
def ckpt_copy(hf_checkpoints, tmp_path):
    src, _ = hf_checkpoints("qwen3")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path, fn):
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_unexpected_and_misshapen_tensors_all_named(ckpt_copy):
    def corrupt(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        del t["model.norm.weight"]
        t["model.layers.0.self_attn.extra.weight"] = np.zeros((2, 2), np.float32)
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)

    _edit_tensors(ckpt_copy, corrupt)
    with pytest.raises(CheckpointError) as err:
        load_params(str(ckpt_copy))
    msg = str(err.value)
    for name in ["model.layers.1.mlp.up_proj.weight", "model.norm.weight", "model.layers.0.self_attn.extra.weight",
                 "model.layers.0.self_attn.k_proj.weight: checkpoint (16, 64) vs config (32, 64)"]:
        assert name in msg
    assert "missing tensors (2)" in msg and "unexpected tensors (1)" in msg and "misshapen tensors (1)" in msg


def test_unsupported_architecture_is_named(ckpt_copy):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*gpt2.*GPT2LMHeadModel"):
        jspec.load_target(str(ckpt_copy))


def test_no_weights_file(ckpt_copy):
    os.remove(ckpt_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_params(str(ckpt_copy))


@pytest.fixture(scope="module")
def target(hf_checkpoints):
    return jspec.load_target(hf_checkpoints("qwen3")[0])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompts=[list(range(3, 70))], cache_size=64), "does not fit a cache of 64 rows"),
        (dict(sampling=("temperature", -0.5)), "temperature must be a number >= 0"),
        (dict(sampling=("top_p", 0.0)), r"top_p must lie in \(0, 1\]"),
        (dict(sampling=("top_p", 1.5)), r"top_p must lie in \(0, 1\]"),
        (dict(sampling=("top_k", -1)), "top_k must be an integer >= 0"),
        (dict(prompts=[[1, 2, 128]]), r"outside the vocabulary \[0, 128\): \[128\]"),
        (dict(prompts=[[1, -4]]), r"outside the vocabulary .*\[-4\]"),
        (dict(prompts=[[]]), "prompt 0 is empty"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(seeds=[1, 2, 3]), "got 3 seeds for 1 prompts"),
    ],
)
def test_bad_generate_input_fails_before_compiling(target, kwargs, match):
    before = ar.generate_ar._cache_size()
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        if "sampling" in args:
            field, value = args.pop("sampling")
            args["sampling"] = jspec.SamplingParams(**{field: value})
        jspec.generate(target, args.pop("prompts"), **args)
    assert ar.generate_ar._cache_size() == before
