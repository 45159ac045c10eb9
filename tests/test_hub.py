"""Checkpoints as users have them: the local Hugging Face cache (offline) and generation_config.json.

The cache is built in tmp_path in huggingface_hub's own layout (blobs/, snapshots/<commit>/ symlinks,
refs/<branch>), checked with huggingface_hub's cache functions, and HF_HOME points at it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket

import jax
import numpy as np
import pytest

import jspec
from jspec.errors import CheckpointError
from jspec.io import hub
from jspec.io.models import load_model, save_model
from jspec.models.config import ModelConfig
from jspec.models.transformer import init_params

CFG = ModelConfig(family="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=16, qk_norm=True, eos_token_ids=(2,), bos_token_id=1,
                  max_position_embeddings=256)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny dense checkpoints (different weights) written by jspec: name -> folder."""
    out = {}
    for seed in (0, 1):
        path = str(tmp_path_factory.mktemp(f"model{seed}"))
        save_model(path, CFG, init_params(CFG, jax.random.key(seed), std=0.05))
        out[seed] = path
    return out


def _commit(seed: int) -> str:
    return hashlib.sha1(f"commit {seed}".encode()).hexdigest()


def add_to_cache(cache_dir, repo_id: str, model_dir: str, commit: str, refs=("main",)) -> str:
    """Put model_dir's files into the HF cache as huggingface_hub writes them; returns the snapshot folder."""
    repo = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo, "snapshots", commit)
    os.makedirs(snap)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    for name in sorted(os.listdir(model_dir)):
        with open(os.path.join(model_dir, name), "rb") as f:
            data = f.read()
        blob = hashlib.sha256(data).hexdigest()
        with open(os.path.join(repo, "blobs", blob), "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snap, name))
    for ref in refs:
        os.makedirs(os.path.dirname(os.path.join(repo, "refs", ref)), exist_ok=True)
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)
    return snap


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """HF_HOME in tmp_path (the hub cache is HF_HOME/hub), offline, and no socket may connect."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HUGGINGFACE_CO_STAGING"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError("the cache lookup opened a connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    return cache


def _same_weights(a: jspec.Target, b: jspec.Target) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)))


def test_the_layout_is_huggingface_hubs_own(hf_home, models):
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    snap = add_to_cache(hf_home, "org/tiny", models[0], _commit(0))
    info = scan_cache_dir(hf_home)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert (repo.repo_id, repo.repo_type) == ("org/tiny", "model")
    (rev,) = repo.revisions
    assert rev.commit_hash == _commit(0) and set(rev.refs) == {"main"}
    assert {f.file_name for f in rev.files} == set(os.listdir(models[0]))
    found = try_to_load_from_cache("org/tiny", "config.json", cache_dir=str(hf_home))
    assert found == os.path.join(snap, "config.json")
    assert hub.hub_cache_dir() == str(hf_home)


def test_load_by_repo_id_revision_and_cache_folder(hf_home, models):
    add_to_cache(hf_home, "org/tiny", models[0], _commit(0))
    add_to_cache(hf_home, "org/tiny", models[1], _commit(1), refs=("dev",))
    direct = {s: jspec.load_target(models[s]) for s in (0, 1)}
    by_id = jspec.load_target("org/tiny")
    assert os.path.realpath(by_id.path) == os.path.realpath(os.path.join(hf_home, "models--org--tiny", "snapshots",
                                                                         _commit(0)))
    assert _same_weights(by_id, direct[0]) and by_id.cfg == direct[0].cfg
    assert _same_weights(jspec.load_target("org/tiny@dev"), direct[1])
    assert _same_weights(jspec.load_target(f"org/tiny@{_commit(1)}"), direct[1])
    assert _same_weights(jspec.load_target(f"org/tiny@{_commit(0)}"), direct[0])
    folder = os.path.join(hf_home, "models--org--tiny")
    assert _same_weights(jspec.load_target(folder), direct[0])  # refs/main's snapshot
    assert _same_weights(jspec.load_target(folder + os.sep), direct[0])


def test_hf_hub_cache_wins_over_hf_home(hf_home, models, tmp_path, monkeypatch):
    other = tmp_path / "elsewhere"
    add_to_cache(other, "org/tiny", models[1], _commit(1))
    add_to_cache(hf_home, "org/tiny", models[0], _commit(0))
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert hub.hub_cache_dir() == str(other)
    assert _same_weights(jspec.load_target("org/tiny"), jspec.load_target(models[1]))
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.hub_cache_dir() == str(tmp_path / "xdg" / "huggingface" / "hub")


def test_a_repo_id_not_in_the_cache_names_the_cache_and_the_download(hf_home):
    with pytest.raises(hub.HubCacheError) as err:
        jspec.load_target("org/missing")
    msg = str(err.value)
    assert str(hf_home) in msg and "models--org--missing" in msg
    assert "hf download org/missing" in msg and "huggingface-cli download" in msg and "folder" in msg
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, jspec.errors.JspecError)


def test_an_uncached_revision_lists_the_cached_ones(hf_home, models):
    add_to_cache(hf_home, "org/tiny", models[0], _commit(0))
    with pytest.raises(hub.HubCacheError, match=r"not its revision 'v2'.*cached revisions: main") as err:
        jspec.load_target("org/tiny@v2")
    assert "--revision v2" in str(err.value) and _commit(0) in str(err.value)


def test_two_snapshots_without_refs_are_listed(hf_home, models):
    add_to_cache(hf_home, "org/tiny", models[0], _commit(0), refs=())
    add_to_cache(hf_home, "org/tiny", models[1], _commit(1), refs=())
    folder = os.path.join(hf_home, "models--org--tiny")
    for spec in (folder, "org/tiny"):
        with pytest.raises(hub.HubCacheError, match="2 snapshots and no refs/main") as err:
            jspec.load_target(spec)
        assert _commit(0) in str(err.value) and _commit(1) in str(err.value) and "org/tiny@<commit>" in str(err.value)
    # a commit picks one; so does the snapshot folder itself
    assert _same_weights(jspec.load_target(f"org/tiny@{_commit(1)}"), jspec.load_target(models[1]))
    assert _same_weights(jspec.load_target(os.path.join(folder, "snapshots", _commit(0))), jspec.load_target(models[0]))


def test_the_only_snapshot_serves_without_refs(hf_home, models):
    add_to_cache(hf_home, "org/tiny", models[1], _commit(1), refs=())
    assert _same_weights(jspec.load_target("org/tiny"), jspec.load_target(models[1]))
    assert _same_weights(jspec.load_target(os.path.join(hf_home, "models--org--tiny")), jspec.load_target(models[1]))


def test_refs_main_naming_a_missing_snapshot_is_an_error(hf_home, models):
    add_to_cache(hf_home, "org/tiny", models[0], _commit(0))
    shutil.rmtree(os.path.join(hf_home, "models--org--tiny", "snapshots", _commit(0)))
    os.makedirs(os.path.join(hf_home, "models--org--tiny", "snapshots", _commit(1)))
    with pytest.raises(hub.HubCacheError, match="names commit"):
        jspec.load_target(os.path.join(hf_home, "models--org--tiny"))


def test_a_local_folder_spelled_like_a_repo_id_wins(hf_home, models, tmp_path, monkeypatch):
    add_to_cache(hf_home, "org/tiny", models[0], _commit(0))
    work = tmp_path / "work"
    shutil.copytree(models[1], work / "org" / "tiny")
    monkeypatch.chdir(work)
    target = jspec.load_target("org/tiny")
    assert target.path == "org/tiny" and _same_weights(target, jspec.load_target(models[1]))


def test_other_spellings_pass_through(hf_home):
    assert jspec.api.resolve_path("./org/none") == "./org/none"
    assert jspec.api.resolve_path("/no/such/folder") == "/no/such/folder"
    assert jspec.api.resolve_path("a/b/c") == "a/b/c"
    assert hub.parse_repo_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    assert hub.parse_repo_id("org/name") == ("org/name", None)
    assert hub.parse_repo_id("org--x/name") is None and hub.parse_repo_id("org/../x") is None


def test_a_drafter_by_repo_id(hf_home, models):
    add_to_cache(hf_home, "org/tiny", models[0], _commit(0))
    target = jspec.load_target(models[0])
    drafter, params = jspec.load_drafter("org/tiny", target, block_size=2)
    assert drafter.num_drafts == 2 and _same_weights(jspec.Target(CFG, params), target)


# --- generation_config.json ------------------------------------------------------------------------


def _with_generation_config(src: str, dst, text: str | None) -> str:
    shutil.copytree(src, dst)
    if text is not None:
        (dst / "generation_config.json").write_text(text)
    return str(dst)


@pytest.mark.parametrize("eos, want", [([7, 2, 9, 7], (2, 7, 9)), (5, (2, 5)), (2, (2,)), (None, (2,))])
def test_generation_config_eos_joins_config_eos(models, tmp_path, eos, want):
    path = _with_generation_config(models[0], tmp_path / "m", json.dumps({"eos_token_id": eos, "do_sample": True}))
    target = jspec.load_target(path)
    assert target.cfg.eos_token_ids == want
    assert load_model(path)[0].eos_token_ids == want


def test_no_generation_config_changes_nothing(models, tmp_path):
    path = _with_generation_config(models[0], tmp_path / "m", None)
    assert not os.path.exists(os.path.join(path, "generation_config.json"))
    assert jspec.load_target(path).cfg == CFG


@pytest.mark.parametrize("text, message", [
    ('{"eos_token_id": [2, ', "is not valid JSON"),
    ("", "is empty"),
    ('[1, 2]', "holds a list"),
    ('{"eos_token_id": "</s>"}', "eos_token_id is '</s>'"),
    ('{"eos_token_id": [2, true]}', "must be a token id"),
])
def test_a_damaged_generation_config_is_named(models, tmp_path, text, message):
    path = _with_generation_config(models[0], tmp_path / "m", text)
    with pytest.raises(CheckpointError, match=message) as err:
        jspec.load_target(path)
    assert os.path.join(path, "generation_config.json") in str(err.value)


def test_generation_config_eos_for_q4_and_hybrid_targets(models, tmp_path):
    from jspec.io import q4
    from jspec.models import hybrid

    q4.convert_q4(models[0], str(tmp_path / "q4"))
    (tmp_path / "q4" / "generation_config.json").write_text('{"eos_token_id": [3, 2]}')
    cfg, params, _ = load_model(str(tmp_path / "q4"))
    assert cfg.eos_token_ids == (2, 3)

    hf = dict(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], vocab_size=128, hidden_size=32,
              intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"], eos_token_id=2,
              tie_word_embeddings=True, max_position_embeddings=256)
    hcfg = hybrid.HybridConfig.from_hf_dict(hf)
    save_model(str(tmp_path / "hybrid"), hcfg, hybrid.init_params(hcfg, jax.random.key(0)))
    (tmp_path / "hybrid" / "generation_config.json").write_text('{"eos_token_id": 4}')
    cfg, _, _ = load_model(str(tmp_path / "hybrid"))
    assert isinstance(cfg, hybrid.HybridConfig) and cfg.eos_token_ids == (2, 4)


def test_a_mistyped_folder_is_not_looked_up_as_a_repo_id(hf_home, tmp_path, monkeypatch):
    (tmp_path / "runs" / "code-dflash").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no folder 'runs/code-dfalsh' \(the folder 'runs' exists, and "
                                                r"holds \['code-dflash'\]\): check the path"):
        hub.resolve_hub_path("runs/code-dfalsh")
    with pytest.raises(hub.HubCacheError, match="hf download org/nothing"):  # no such folder: a repo id
        hub.resolve_hub_path("org/nothing")
