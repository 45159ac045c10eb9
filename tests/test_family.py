"""A drafter family defined in this file, registered like the built-in ones, runs through every public entry
point without a change to jspec: loaded from its checkpoint folder, generated with (Python API and CLI),
trained by `jspec train`, measured by `jspec bench`. The built-in families pass the same registry checks."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import conformance
import jspec
from jspec.cli import main as cli_main
from jspec.demo import DEMO_CONFIG, create_demo_model
from jspec.drafters import Drafter, Proposal, family
from jspec.io.hf import CheckpointError

PROMPTS = [[5, 9, 17, 3, 44], [7, 8, 7, 8, 7, 8, 7]]
SMALL = dataclasses.replace(DEMO_CONFIG, hidden_size=64, intermediate_size=128, num_layers=2, head_dim=16,
                            layer_types=())


# --- the family: a learned bigram table drafting a chain ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Bigram(Drafter):
    """Drafts g tokens by following a [V, V] table of next-token logits from the anchor."""

    block_size: int = 3

    @property
    def num_drafts(self) -> int:
        return self.block_size

    def validate(self, target_cfg, dparams) -> None:
        v = target_cfg.vocab_size
        if dparams["table"].shape != (v, v):
            raise ValueError(f"bigram table {dparams['table'].shape} does not fit the target vocabulary {v}")

    def propose(self, dparams, state, ctx):
        prev = jnp.take_along_axis(ctx.tokens, (ctx.length - 1)[:, None], axis=1)[:, 0]

        def step(prev, k):
            token, logp = self.choose(ctx, dparams["table"][prev], ctx.length + k)
            return token, (token, logp)

        _, (tokens, logp) = jax.lax.scan(step, prev, jnp.arange(self.block_size))
        return Proposal(tokens.T, jnp.moveaxis(logp, 0, 1) if ctx.needs_q else None), state


ARCH = "BigramDrafter"


def _save(path, drafter, params, dtype=None):
    os.makedirs(path, exist_ok=True)
    table = np.asarray(params["table"], np.float32 if dtype is None else dtype)
    save_file({"table": table}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": [ARCH], "block_size": drafter.block_size, "vocab_size": table.shape[0]}, f)


def _load(path, target, dtype):
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    v = hf["vocab_size"]
    if set(tensors) != {"table"} or tensors["table"].shape != (v, v):
        raise CheckpointError(f"bigram checkpoint {path!r}: expected one tensor table [{v}, {v}], found "
                              f"{ {k: t.shape for k, t in tensors.items()} }")
    return Bigram(block_size=hf["block_size"]), {"table": jnp.asarray(tensors["table"], dtype)}


def _build(run, target, key):
    v = target.cfg.vocab_size
    return (Bigram(block_size=run["drafter"]["block_size"]),
            {"table": 0.01 * jax.random.normal(key, (v, v), jnp.float32)})


def _loss(params, target_params, target_cfg, drafter, spec, batch, key):
    tokens, mask = batch["tokens"], batch["loss_mask"][:, 1:].astype(jnp.float32)
    logp = jax.nn.log_softmax(params["table"][tokens[:, :-1]], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    hit = (jnp.argmax(logp, -1) == tokens[:, 1:]).astype(jnp.float32)
    n = jnp.maximum(mask.sum(), 1.0)
    return jnp.sum(nll * mask) / n, {"acc": jnp.sum(hit * mask) / n}


def _with_shape(drafter, block_size, tree_budget):
    if tree_budget:
        raise ValueError("the bigram drafter drafts chains: drop the tree budget")
    return dataclasses.replace(drafter, block_size=block_size)


@pytest.fixture(scope="module", autouse=True)
def bigram_family():
    fam = family.register_family(family.Family(
        name="bigram", drafter=Bigram, detect=lambda hf: ARCH in (hf.get("architectures") or []), load=_load,
        save=_save, with_shape=_with_shape, recipe=family.TrainRecipe(build=_build, loss=_loss),
        example=lambda target: _build({"drafter": {"block_size": 3}}, target, jax.random.key(0)),
        summary="a bigram table (defined in a test)"))
    yield fam
    del family.FAMILIES["bigram"]


# --- fixtures ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return create_demo_model(str(tmp_path_factory.mktemp("family_target")), cfg=SMALL)


@pytest.fixture(scope="module")
def target(target_dir):
    return jspec.load_target(target_dir)


@pytest.fixture(scope="module")
def bigram_dir(target, tmp_path_factory):
    """A bigram drafter that knows the target's greedy text for PROMPTS: its table holds the successor of each
    token in that text (so the drafts are often right, and the test sees them accepted)."""
    v = target.cfg.vocab_size
    table = np.zeros((v, v), np.float32)
    for p, out in zip(PROMPTS, jspec.generate(target, PROMPTS, max_new_tokens=24, eos_ids=[]).tokens):
        text = p + out
        for a, b in zip(text[:-1], text[1:]):
            table[a, b] += 8.0
    path = str(tmp_path_factory.mktemp("bigram"))
    _save(path, Bigram(block_size=3), {"table": table})
    return path


# --- the test-file family through the public API and CLI ---------------------------------------------------------


def test_registry_lists_the_family(bigram_dir):
    assert family.detect(bigram_dir).name == "bigram"
    assert "bigram" in family.trainable() and "bigram" not in family.named()
    assert family.family_of(Bigram()).name == "bigram"


@pytest.mark.parametrize("temperature, verifier", [(0.0, "greedy"), (1.0, "gumbel")])
def test_generate_equals_plain_decoding(target, bigram_dir, temperature, verifier):
    kw = dict(max_new_tokens=16, sampling=jspec.SamplingParams(temperature), seeds=[3, 4], eos_ids=[])
    base = jspec.generate(target, PROMPTS, **kw)
    res = jspec.generate(target, PROMPTS, drafter=bigram_dir, verifier=verifier, block_size=4, **kw)
    assert res.tokens == base.tokens
    assert res.stats["tau"] > 1.0  # the table follows the target: some drafts are accepted


def test_cli_generates_and_refuses_a_tree(target_dir, bigram_dir, capsys):
    base = ["generate", "--target", target_dir, "--prompt-ids", "7,8,7,8", "--max-new-tokens", "10", "--json"]
    assert cli_main(base) == 0
    plain = json.loads(capsys.readouterr().out)["tokens"]
    assert cli_main(base + ["--drafter", bigram_dir, "--block-size", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == plain
    assert cli_main(base + ["--drafter", bigram_dir, "--tree-budget", "4"]) == 2
    assert "bigram drafter drafts chains" in capsys.readouterr().err


def test_damaged_checkpoint_is_refused(target, bigram_dir, tmp_path):
    tensors = load_file(os.path.join(bigram_dir, "model.safetensors"))
    _save(str(tmp_path), Bigram(), {"table": tensors["table"][:, :-1]})
    with open(tmp_path / "config.json") as f:
        hf = json.load(f)
    hf["vocab_size"] = SMALL.vocab_size
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="expected one tensor table"):
        jspec.load_drafter(str(tmp_path), target)


def test_trained_for_two_steps_by_jspec_train(target, target_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):  # split_files keeps a held-out share by file: enough files for every split
        (corpus / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x + {j}\n\n" for j in range(12)))
    config = {"drafter": {"block_size": 3},
              "data": {"corpus": str(corpus), "pattern": "*.py", "batch_size": 2},
              "distill": {"num_prompts": 4, "prompt_len": 8, "new_tokens": 8, "batch": 2, "seed": 0},
              "train": {"steps": 2, "lr": 1e-2, "warmup_frac": 0.0, "ckpt_every": 2, "keep": 1, "log_every": 1}}
    (tmp_path / "run.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    assert cli_main(["train", "bigram", "--config", str(tmp_path / "run.json"), "--target", target_dir,
                     "--out", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    assert "trained model written" in capsys.readouterr().out
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(np.isfinite(m["loss"]) for m in metrics)
    dr, params = jspec.load_drafter(str(out / "model"), target, block_size=2)
    assert isinstance(dr, Bigram) and dr.block_size == 2 and params["table"].shape == (SMALL.vocab_size,) * 2
    kw = dict(max_new_tokens=8, eos_ids=[])
    assert jspec.generate(target, PROMPTS, drafter=str(out / "model"), **kw).tokens == \
        jspec.generate(target, PROMPTS, **kw).tokens


def test_measured_by_jspec_bench(target, bigram_dir, tmp_path):
    from jspec.bench.run import BenchConfig, run_bench

    cfg = BenchConfig(drafters=(bigram_dir,), block_sizes=(2, 3), tree_budgets=(0,), temperatures=(0.0,), prompts=1,
                      prompt_len=16, max_new_tokens=8, repeats=1, verify_widths=(1,), peer=False,
                      torch_threads=1, bandwidth_gbs=10.0, out=str(tmp_path), progress=False, command="test")
    report = run_bench(cfg, target=target)
    name = os.path.basename(os.path.normpath(bigram_dir))
    assert [c["label"] for c in report["combos"]] == [f"{name} g=2 greedy T=0", f"{name} g=3 greedy T=0"]
    # The bench's prompts are not the ones the table knows: tau is only bounded, outputs are plain AR's.
    assert all(1.0 <= c["acceptance"]["tau"] <= 4.0 and c["outputs_equal_ar"] for c in report["combos"])


def test_measured_by_the_bench_command(target_dir, bigram_dir, tmp_path, capsys):
    out = tmp_path / "bench"
    assert cli_main(["bench", "--target", target_dir, "--drafters", bigram_dir, "--block-sizes", "2",
                     "--tree-budgets", "0", "--temperatures", "0", "--prompts", "1", "--prompt-len", "16",
                     "--max-new-tokens", "8", "--repeats", "1", "--verify-widths", "1", "--no-peer",
                     "--bandwidth-gbs", "10", "--no-progress", "--out", str(out)]) == 0, capsys.readouterr().err
    report = json.loads((out / "bench.json").read_text())
    name = os.path.basename(os.path.normpath(bigram_dir))
    assert [c["label"] for c in report["combos"]] == [f"{name} g=2 greedy T=0"]
    assert report["combos"][0]["outputs_equal_ar"]


@pytest.mark.parametrize("check", conformance.CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_inherits_the_conformance_checks(target, bigram_family, check, monkeypatch, tmp_path):
    kwargs = {k: v for k, v in (("monkeypatch", monkeypatch), ("tmp_path", tmp_path))
              if k in check.__code__.co_varnames}
    check(target, bigram_family, **kwargs)


# --- every registered family ---------------------------------------------------------------------------------


def test_built_in_families_are_registered_on_import():
    assert {"lookup", "lm", "dflash", "dspark"} <= set(family.FAMILIES)
    assert sorted(family.named()) == ["lookup", "mtp"]
    assert {"dflash", "dspark"} <= set(family.trainable())


def test_no_checkpoint_matches_two_families(target_dir, bigram_dir, tmp_path):
    """Every detect rule accepts its own family's checkpoints and nobody else's."""
    assert family.detect(target_dir).name == "lm"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["SomethingElse"]}))
    with pytest.raises(ValueError, match="no drafter checkpoint jspec knows.*bigram"):
        family.detect(str(tmp_path))
    # A drafter format on a causal-LM config (no architectures field) beats the small-LM fallback.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "dflash_config": {}}))
    assert family.detect(str(tmp_path)).name == "dflash"
