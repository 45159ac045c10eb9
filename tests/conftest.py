"""Shared fixtures: tiny random Hugging Face checkpoints written with transformers' own save_pretrained."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Test models are tiny, so XLA's compile time dominates the suite; LLVM -O0 cuts the suite's time by
# about a fifth, and XLA:CPU's classic fusion emitters instead of its MLIR ones compile these programs in
# less CPU time again (test_offline_eval + test_spec + test_hybrid_loop on 2 workers: 591 s of CPU against
# 808 s; loops that run long, as the Monte Carlo tests', execute about 14% slower, a smaller share of the
# suite). Subprocesses that tests start inherit the flags.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false").strip()
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The `jspec` command keeps compiled programs in a persistent cache by default; tests that run it in-process
# would switch the cache on for the rest of their worker (and fill the user's ~/.cache). The compile-cache
# tests pass a folder of their own.
os.environ["JSPEC_COMPILE_CACHE"] = "off"

import shutil
import tempfile

import pytest

# The suite shares one persistent compilation cache between its workers, fresh for each run and removed at
# its end: many files compile the same programs (the same tiny target's loops, rules and drafters), and
# every file's programs are freed when it ends (`_release_compiled_code`), so a later file, in any worker,
# loads them instead of compiling them again (the full suite: about 0.5 GB). The controller makes the
# folder before it starts the workers, which inherit its path. The jax option is set in the test processes
# only, so the `jspec` commands that tests start keep their own cache settings.
# JSPEC_TEST_COMPILE_CACHE=off compiles everything.
_CACHE_ENV = "JSPEC_TEST_COMPILE_CACHE_DIR"
_CACHE_KEY = pytest.StashKey[str]()  # the folder, in the process that made it


def pytest_configure(config):
    if os.environ.get("JSPEC_TEST_COMPILE_CACHE", "on").lower() == "off":
        return
    from jspec.platform import enable_compile_cache

    path = os.environ.get(_CACHE_ENV)
    if path is None:  # the controller, or a run without workers: this run's folder
        path = tempfile.mkdtemp(prefix="jspec-test-compile-cache-")
        os.environ[_CACHE_ENV] = path
        config.stash[_CACHE_KEY] = path
    enable_compile_cache(path)


def pytest_unconfigure(config):
    path = config.stash.get(_CACHE_KEY, None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
        del os.environ[_CACHE_ENV]


# `make test` runs the suite in pytest-xdist workers with --dist loadfile: one worker runs a whole test file, so
# its module-scoped fixtures and compiled programs serve all its tests. The files named here are split further,
# by the first part of their test ids (up to the last "-"): the conformance suite (every family x every check,
# by far the longest file) runs as one unit per family, spread over the workers.
SPLIT_BY_ID_PREFIX = ("test_conformance.py",)


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SplitFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            if os.path.basename(scope) in SPLIT_BY_ID_PREFIX and nodeid.endswith("]"):
                return f"{scope}[{nodeid.split('[', 1)[1].rsplit('-', 1)[0]}]"
            return scope

    return SplitFiles(config, log)


def make_hf_model(family: str, *, tie: bool = False, sliding: bool = False, rope_scaling: bool = False, seed: int = 0,
                  vocab: int = 128, layers: int = 2):
    """A tiny random transformers model with a sensitive init (large weights, random norm gains)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
        tie_word_embeddings=tie, max_position_embeddings=256, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if family == "qwen3":
        extra = {}
        if sliding:
            extra = dict(use_sliding_window=True, sliding_window=5, max_window_layers=layers,
                         layer_types=["sliding_attention", "full_attention"] * (layers // 2))
        cfg = transformers.Qwen3Config(rope_theta=10000.0, **common, **extra)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        rope = {"rope_type": "default", "rope_theta": 500000.0}
        if rope_scaling:
            rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        cfg = transformers.LlamaConfig(rope_parameters=rope, **common)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.eval()
    return model


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """Saved checkpoints by name -> (directory, transformers model)."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            family, *flags = name.split("-")
            model = make_hf_model(family, tie="tied" in flags, sliding="sliding" in flags,
                                  rope_scaling="scaled" in flags)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            cache[name] = (str(path), model)
        return cache[name]

    return get


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_code():
    """Free each test file's compiled programs when the file is done.

    XLA's CPU backend maps every compiled program's machine code into memory pages of its own; a
    process that keeps a whole suite's programs alive passes the kernel's limit on memory mappings
    (vm.max_map_count, 65,530 by default), and the next compilation aborts."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
