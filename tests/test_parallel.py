"""Sharding rules, sharded generation and training, and a real two-process jax.distributed run.

Runs with several devices need XLA_FLAGS before jax is imported, so they execute this file as a
script in a fresh interpreter (`python tests/test_parallel.py eight-devices DIR`); the two-process run
goes through launch/multiprocess.py, which is how a user starts one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRAIN_STEPS = 3


def _cfg():
    from jspec.models.config import ModelConfig

    # 4 query heads, 2 KV heads: model = 2 splits both, model = 4 splits only the query heads.
    return ModelConfig(family="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)


def _target():
    import jax

    import jspec
    from jspec.models import transformer

    # float32 with large weights: sharp distributions, so reduction-order noise cannot flip a token.
    return jspec.Target(_cfg(), transformer.init_params(_cfg(), jax.random.key(0), std=0.3))


def _dflash(target):
    import dataclasses

    import jax

    from jspec.drafters import dflash as dfl

    dcfg = dfl.DFlashConfig(layers=dataclasses.replace(target.cfg, num_layers=1), target_layer_ids=(0, 1),
                            num_target_layers=3, mask_token_id=95, block_size=4)
    return dfl.DFlash(cfg=dcfg), dfl.init_params(dcfg, jax.random.key(1), std=0.3)


PROMPTS = [[5, 9, 17, 3, 44, 5, 9, 17, 3], [7, 8, 7, 8, 7, 8], [11, 12, 13, 14, 15, 16, 11, 12, 13], [1, 2, 3]]


def _cases(target):
    """(name, generate keywords) of the runs compared against one device."""
    import jspec

    hot = jspec.SamplingParams(temperature=1.0)
    return {
        "lookup-greedy": dict(drafter="lookup", block_size=3),
        "dflash-gumbel": dict(drafter=_dflash(target), sampling=hot, verifier="gumbel"),
    }


def _windows():
    return np.random.default_rng(0).integers(0, 96, size=(64, 17)).astype(np.int32)


def _trainer(run_dir, params, **kw):
    from jspec.train import lm
    from jspec.train.trainer import TrainConfig, Trainer

    tc = TrainConfig(steps=TRAIN_STEPS, lr=1e-2, warmup_frac=0.3, ckpt_every=2, log_every=1)
    return Trainer(lambda p, b: lm.lm_loss(p, _cfg(), b), params, tc, str(run_dir), {"test": "parallel"}, **kw)


def _examples():
    import grain

    return grain.MapDataset.source(_windows()).shuffle(seed=1).repeat()


# ---------------------------------------------------------------------------------------------------
# One device, in this process: the rules table and the host-side helpers.


def test_rules_table_on_an_abstract_mesh():
    import jax
    from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

    from jspec import parallel
    from jspec.models import transformer

    cfg = _cfg()
    params = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.key(0)))
    mesh = AbstractMesh((2, 2, 4), parallel.MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    axes = parallel.target_axes(cfg)  # from the modules' parameter declarations
    specs = jax.tree_util.tree_map(lambda s: s.spec, parallel.param_shardings(params, mesh, head_dim=cfg.head_dim,
                                                                              axes=axes))
    layers = specs["layers"][1]
    # Matrices [out, in]:
    assert layers["wq"] == P("model", "fsdp")  # 4 query heads over model = 4
    assert layers["wk"] == P(None, "fsdp")  # 2 KV heads do not split 4 ways: replicated
    assert layers["wo"] == P("fsdp", "model")
    assert layers["w_gate"] == P("model", "fsdp") and layers["w_down"] == P("fsdp", "model")
    assert layers["q_norm"] == P(None)
    assert specs["embed"] == P(None, "fsdp")  # vocab replicated by default
    vocab_sharded = parallel.ShardingRules(vocab="model")
    assert parallel.param_shardings(params, mesh, vocab_sharded, axes=axes)["embed"].spec == P("model", "fsdp")
    # A layer's KV cache [B, Hkv, S, Dh] (or a stacked [L, ...] one): batch over (data, fsdp), heads
    # over model when they divide.
    assert parallel.cache_sharding(mesh, (8, 2, 32, 16)).spec == P(("data", "fsdp"), None, None, None)
    assert parallel.cache_sharding(mesh, (8, 4, 32, 16)).spec == P(("data", "fsdp"), "model", None, None)
    assert parallel.cache_sharding(mesh, (3, 8, 4, 32, 16)).spec == P(None, ("data", "fsdp"), "model", None, None)
    # Whole heads only: 2 heads of 16 (32 columns) do not split over model = 4 although 32 % 4 == 0.
    wk_axes = axes["layers"][0]["wk"]
    assert parallel.spec_for((32, 64), wk_axes, mesh, head_dim=16) == P(None, "fsdp")
    assert parallel.spec_for((32, 64), wk_axes, mesh) == P("model", "fsdp")


def test_hybrid_target_axes_come_from_its_declarations():
    import jax
    from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

    from jspec import parallel
    from jspec.models import hybrid

    cfg = hybrid.HybridConfig(
        family="qwen3_next", vocab_size=64, hidden_size=32, num_layers=2,
        layer_types=("linear_attention", "full_attention"), num_heads=4, num_kv_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24)
    params = jax.eval_shape(lambda: hybrid.init_params(cfg, jax.random.key(0)))
    mesh = AbstractMesh((1, 2, 4), parallel.MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    axes = parallel.target_axes(cfg)
    per_leaf = jax.tree_util.tree_map(lambda _: 0, axes, is_leaf=lambda x: isinstance(x, tuple))
    assert jax.tree_util.tree_structure(per_leaf) == jax.tree_util.tree_structure(params)  # every leaf declared
    specs = jax.tree_util.tree_map(lambda s: s.spec, parallel.param_shardings(params, mesh, head_dim=16, axes=axes))
    gdn_layer, attn_layer = specs["layers"]
    assert attn_layer["wq"] == P("model", "fsdp") and attn_layer["wo"] == P("fsdp", "model")
    assert attn_layer["wk"] == P(None, "fsdp")  # 2 KV heads over model = 4: replicated
    # GDN and expert weights: the hidden dimension over fsdp, the rest replicated.
    assert gdn_layer["w_qkv"] == P(None, "fsdp") and gdn_layer["conv"] == P(None, None)
    assert gdn_layer["e_gate"] == P(None, None, "fsdp") and gdn_layer["router"] == P(None, "fsdp")


def test_mesh_arguments_are_checked():
    import jax

    from jspec import parallel

    assert parallel.parse_mesh("data=2, model=4") == {"data": 2, "model": 4}
    with pytest.raises(ValueError, match="AXIS=SIZE"):
        parallel.parse_mesh("tensor=2")
    with pytest.raises(ValueError, match="needs 16 devices"):
        parallel.make_mesh(data=2, model=8)
    mesh = parallel.make_mesh()
    assert dict(mesh.shape) == {"data": jax.device_count(), "fsdp": 1, "model": 1}


def test_initialize_reads_the_environment(monkeypatch):
    from jspec import parallel

    for k in ("JAX_COORDINATOR_ADDRESS", "JSPEC_DISTRIBUTED", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert parallel.initialize() is False  # one machine: nothing to start
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES"):
        parallel.initialize()


def test_host_local_batches_are_the_one_process_batches():
    from jspec import parallel
    from jspec.train import data

    batches = parallel.HostLocalBatches(_examples(), 8, parallel.make_mesh())
    assert batches.rows == list(range(8))  # one process holds every row
    reference = data.batches(_windows(), 8, seed=1)
    for i in (0, 1, 9):  # 9 wraps around the 64 windows
        np.testing.assert_array_equal(batches[i], reference[i])


def test_the_library_does_not_import_the_commands():
    """jspec.api imports jspec.parallel, so the library part imports neither the API nor the commands."""
    import ast

    folder = os.path.join(ROOT, "jspec", "parallel")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py") or name == "__main__.py":
            continue
        tree = ast.parse(open(os.path.join(folder, name)).read())
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        bad = [m for m in imported if m == "jspec" or m.split(".")[:2] in (["jspec", "api"], ["jspec", "cli"],
                                                                          ["jspec", "bench"])]
        assert not bad, (name, bad)


def test_the_multi_host_command_refuses_what_it_does_not_run():
    cmd = [sys.executable, "-m", "jspec.parallel", "--mesh", "data=1", "train", "dflash", "--config", "c.json",
           "--out", "o"]
    out = subprocess.run(cmd, env=_script_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "run `jspec train dflash` on one host" in out.stderr, out.stderr[-2000:]


def test_drafter_training_refuses_a_mesh(capsys):
    from jspec.cli import main

    argv = ["train", "dflash", "--mesh", "data=1", "--config", "c.json", "--target", "t", "--out", "o"]
    assert main(argv) == 2
    assert "drop --mesh from `jspec train dflash`" in capsys.readouterr().err


def test_a_bad_mesh_is_an_error_of_the_command(capsys):
    from jspec.cli import main

    assert main(["generate", "--target", "t", "--prompt-ids", "1", "--mesh", "tensor=2"]) == 2
    assert "AXIS=SIZE" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# Eight fake CPU devices, in a subprocess.


def _eight_devices(out_dir: str) -> None:
    import contextlib
    import io

    import jax
    from jax.sharding import PartitionSpec as P

    import jspec
    from jspec import parallel
    from jspec.cli import main as cli_main
    from jspec.decode import ar
    from jspec.io.hf import save_params
    from jspec.models import transformer
    from jspec.train import data

    assert jax.device_count() == 8
    target = _target()
    mesh = parallel.make_mesh(data=4, model=2)
    results = {}
    for name in ("lookup-greedy", "dflash-gumbel"):
        kw = dict(max_new_tokens=10, seeds=[3, 4, 5, 6], eos_ids=[], **_cases(target)[name])
        single = jspec.generate(target, PROMPTS, **kw)
        sharded = jspec.generate(target, PROMPTS, mesh=mesh, **kw)
        results[name] = {"same_tokens": single.tokens == sharded.tokens, "rounds": [single.stats["rounds"],
                         sharded.stats["rounds"]]}
        if name == "lookup-greedy":
            greedy_reference = single.tokens
    with pytest.raises(ValueError, match="does not split over"):
        jspec.generate(target, PROMPTS[:3], max_new_tokens=2, mesh=mesh)

    # The command: `jspec generate --mesh` (4 query heads over model = 4) prints the one-device tokens.
    model_dir = os.path.join(out_dir, "model")
    save_params(model_dir, target.cfg, target.params)
    printed = {}
    for mesh_args in ([], ["--mesh", "data=1,model=4"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli_main(["generate", "--target", model_dir, *GENERATE, *mesh_args]) == 0
        printed[bool(mesh_args)] = json.loads(out.getvalue())["tokens"]
    results["cli"] = {"same_tokens": printed[True] == printed[False], "tokens": len(printed[False])}

    # Plain greedy decoding, and the layout of the loop's carried state: the cache's batch over data,
    # its KV heads over model (2 heads on model = 2), the token buffer's rows over data.
    placed = parallel.place_target(target, mesh)
    packed, lens = jspec.api.pack_prompts(PROMPTS, target.cfg.vocab_size)
    dcfg = ar.DecodeConfig(max_new_tokens=10, cache_size=32)
    host = (packed, lens, np.arange(4, dtype=np.uint32))
    state = ar.generate_ar(placed.params, target.cfg, dcfg, *parallel.shard_batch(host, mesh))
    # Greedy speculative output is plain greedy output: the one-device lookup run is the reference.
    tokens, length = np.asarray(state.tokens), np.asarray(state.length)
    results["ar-greedy"] = [tokens[i, lens[i]:length[i]].tolist() for i in range(4)] == greedy_reference
    cache_ok = all(k.sharding.is_equivalent_to(parallel.cache_sharding(mesh, k.shape), 4) for k in state.cache.k)
    tokens_ok = state.tokens.sharding.is_equivalent_to(parallel.batch_sharding(mesh, 2), 2)
    wq_spec = placed.params["layers"][0]["wq"].sharding.spec

    # Training: data x fsdp x model = 2 x 2 x 2 against one device.
    def init():  # fresh parameters per trainer: a trainer donates the ones it is given
        return transformer.init_params(target.cfg, jax.random.key(5))

    single = _trainer(os.path.join(out_dir, "single"), init())
    single.run(data.batches(_windows(), 8, seed=1), progress=False)
    mesh3 = parallel.make_mesh(data=2, fsdp=2, model=2)
    params = parallel.shard_params(init(), mesh3, head_dim=16, axes=parallel.target_axes(target.cfg))
    multi = _trainer(os.path.join(out_dir, "multi"), params, sharding=parallel.global_batch(mesh3))
    multi.run(parallel.HostLocalBatches(_examples(), 8, mesh3), progress=False)
    diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(
        jax.tree_util.tree_leaves(single.state.params), jax.tree_util.tree_leaves(multi.state.params)))
    trained_wq = multi.state.params["layers"][0]["wq"].sharding.spec
    results.update(cache_ok=cache_ok, tokens_ok=tokens_ok, wq_ok=wq_spec == P("model", None), train_diff=diff,
                   trained_wq=str(trained_wq), trained_ok=trained_wq == P("model", "fsdp"))
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(results, f)


def _script_env(**extra) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([HERE, ROOT]))
    env.update(extra)
    return env


def test_eight_devices_shard_generation_and_training_exactly(tmp_path):
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    # The limit only guards against a hang: the script takes ~95 s alone and 180-240 s beside the rest of the
    # suite on 2 cores.
    out = subprocess.run([sys.executable, __file__, "eight-devices", str(tmp_path)], env=_script_env(XLA_FLAGS=flags),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    res = json.loads((tmp_path / "result.json").read_text())
    for name in ("lookup-greedy", "dflash-gumbel"):
        assert res[name]["same_tokens"], name
        assert res[name]["rounds"][0] == res[name]["rounds"][1], name
    assert res["ar-greedy"]
    assert res["cli"]["same_tokens"] and res["cli"]["tokens"] == 8, res["cli"]
    assert res["cache_ok"] and res["tokens_ok"]
    assert res["wq_ok"]  # query heads split over model = 2 (fsdp = 1: the hidden axis stays whole)
    assert res["trained_ok"], res["trained_wq"]
    assert res["train_diff"] < 1e-5, res["train_diff"]


# ---------------------------------------------------------------------------------------------------
# Two processes with jax.distributed over 127.0.0.1 (gloo CPU collectives), 2 devices each, running
# the commands a user runs on every host: `python -m jspec.parallel train target ...` (twice: the
# second resumes from the first's checkpoint; jspec.train.lm.pretrain_target with a mesh) and
# `python -m jspec.parallel generate ...`.

TRAIN_MESH = "data=1,fsdp=2,model=2"  # process p holds fsdp row p: every weight is split across processes
GENERATE = ["--prompt-ids", "1,2,3,4,5,1,2,3", "--max-new-tokens", "8", "--temperature", "1", "--seed", "7",
            "--drafter", "lookup", "--verifier", "gumbel", "--json"]


def _train_config(path) -> str:
    config = {
        "model": {"family": "qwen3", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
                  "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "qk_norm": True, "tie_word_embeddings": True},
        "data": {"corpus": "stdlib", "pattern": "concurrent/**/*.py", "seq_len": 16, "batch_size": 8},
        "train": {"steps": TRAIN_STEPS, "lr": 1e-2, "warmup_frac": 0.3, "ckpt_every": 2, "keep": 2, "log_every": 1,
                  "seed": 0},
        "init_std": 0.3,  # sharp distributions: reduction-order noise cannot flip a sampled token
    }
    with open(path, "w") as f:
        json.dump(config, f)
    return str(path)


def _two_processes(out_dir: str) -> None:
    import contextlib
    import io

    import jax

    from jspec.parallel.__main__ import main

    config, run = os.path.join(out_dir, "config.json"), os.path.join(out_dir, "run")
    train = ["--mesh", TRAIN_MESH, "train", "target", "--config", config, "--out", run, "--no-progress"]
    assert main([*train, "--steps", "2"]) == 0  # checkpoint at step 2, then stop
    assert jax.process_count() == 2 and jax.device_count() == 4
    assert main([*train, "--steps", str(TRAIN_STEPS)]) == 0  # restores step 2, trains on
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        # No --mesh: one prompt, so the default is tensor parallel over all four devices of both processes.
        code = main(["generate", "--target", os.path.join(run, "model"), *GENERATE])
    assert code == 0
    if jax.process_index() == 0:  # the others print nothing
        with open(os.path.join(out_dir, "generated.json"), "w") as f:
            f.write(printed.getvalue())


def test_two_processes_train_checkpoint_resume_and_generate(tmp_path):
    import contextlib
    import io

    import jax

    import jspec
    from jspec.cli import main as cli_main
    from jspec.train import lm

    config = _train_config(tmp_path / "config.json")
    cmd = [sys.executable, os.path.join(ROOT, "launch", "multiprocess.py"), "--nproc", "2", "--cpu-devices", "2",
           "--timeout", "200", "--", sys.executable, __file__, "two-processes", str(tmp_path)]
    out = subprocess.run(cmd, env=_script_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, TRAIN_STEPS + 1))  # resumed at 2; process 0 alone logs
    assert sorted(os.listdir(run / "checkpoints")) == ["2", "3"]
    assert sorted(d for d in os.listdir(run) if d.startswith("host")) == ["host0", "host1"]  # host-local corpora

    # One device, one process: the same training run and the same generation.
    reference = lm.pretrain_target(config, str(tmp_path / "single"), progress=False)
    trained, expected = jspec.load_target(str(run / "model")), jspec.load_target(reference)
    diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(
        jax.tree_util.tree_leaves(trained.params), jax.tree_util.tree_leaves(expected.params)))
    assert diff < 1e-5, diff
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli_main(["generate", "--target", str(run / "model"), *GENERATE]) == 0
    single = json.loads(printed.getvalue())
    sharded = json.loads((tmp_path / "generated.json").read_text())
    assert sharded["tokens"] == single["tokens"] and len(single["tokens"]) == 8


if __name__ == "__main__":
    {"eight-devices": _eight_devices, "two-processes": _two_processes}[sys.argv[1]](sys.argv[2])
