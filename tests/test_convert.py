"""Training runs to the official formats and back: `jspec convert RUN_DIR OUT [--step N]` and `jspec train
--init`. Tiny runs (a 2-layer target, 1-layer DFlash / DSpark drafters, 3 steps, checkpoints at steps 2 and 3)
as tests/test_bad_runs.py trains them."""

from __future__ import annotations

import glob
import json
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jspec
from jspec.cli import main as cli_main
from jspec.errors import CheckpointError, ConfigError
from jspec.train import distill, export, lm
from jspec.train.trainer import Trainer

PROMPTS = [[5, 6, 7, 8], [40, 41, 9]]
DRAFTER = {"dflash": {}, "dspark": {"markov_rank": 8, "markov_head_type": "rnn"}}


MASK = "<|mask|>"  # the target runs reserve it (id 1); the drafters draft from it


def _write(path, config) -> str:
    path.write_text(json.dumps(config))
    return str(path)


def _target_config(corpus, **train):
    return {"model": {"family": "qwen3", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
                      "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16, "qk_norm": True,
                      "tie_word_embeddings": True},
            "data": {"corpus": corpus, "pattern": "*.py", "seq_len": 16, "batch_size": 2},
            "train": {"steps": 3, "lr": 1e-2, "warmup_frac": 0.0, "ckpt_every": 2, "keep": 3, "log_every": 1,
                      **train},
            "init_std": 0.3, "reserved_tokens": [MASK]}


def _drafter_config(corpus, name, **drafter):
    return {"drafter": {"num_layers": 1, "block_size": 4, "target_layer_ids": [0], "mask_token_id": 1,
                        **DRAFTER[name], **drafter},
            "data": {"corpus": corpus, "pattern": "*.py", "batch_size": 2},
            "distill": {"num_prompts": 4, "prompt_len": 8, "new_tokens": 8, "batch": 2},
            "train": {"steps": 3, "lr": 1e-2, "ckpt_every": 2, "keep": 3, "log_every": 1},
            "init_std": 0.3}


def _leaves(tree) -> dict:
    return export._named_leaves(tree)


def _assert_same(a, b):
    a, b = _leaves(a), _leaves(b)
    assert sorted(a) == sorted(b)
    for n in a:
        assert np.asarray(a[n]).dtype == np.asarray(b[n]).dtype, n
        np.testing.assert_array_equal(np.asarray(a[n]), np.asarray(b[n]), err_msg=n)


def _differ(a, b) -> bool:
    a, b = _leaves(a), _leaves(b)
    return any(not np.array_equal(np.asarray(a[n]), np.asarray(b[n])) for n in a)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    (root / "corpus").mkdir()
    for i in range(6):  # enough files for a train / validation split by file
        (root / "corpus" / f"m{i}.py").write_text(  # each file also writes the mask token's text once
            f"# {MASK} marks a hole\n" + "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(30)))
    return root


@pytest.fixture(scope="module")
def target_run(work):
    """A target run of 3 steps (checkpoints 2 and 3); its model folder (step 3) is the drafters' target."""
    path = _write(work / "target.json", _target_config(str(work / "corpus")))
    run = work / "target-run"
    lm.pretrain_target(path, str(run), progress=False)
    return path, str(run)


@pytest.fixture(scope="module")
def target(target_run):
    return jspec.load_target(os.path.join(target_run[1], "model"))


@pytest.fixture(scope="module")
def drafter_runs(work, target_run):
    runs = {}

    def get(name):
        if name not in runs:
            path = _write(work / f"{name}.json", _drafter_config(str(work / "corpus"), name))
            run = work / f"{name}-run"
            distill.train_drafter(name, path, os.path.join(target_run[1], "model"), str(run), progress=False)
            runs[name] = path, str(run)
        return runs[name]

    return get


@pytest.fixture
def initial_params(monkeypatch):
    """The trainable parameters every Trainer starts its run with (before its first step), in order."""
    seen = []
    real = Trainer.run

    def run(self, *args, **kwargs):
        seen.append(jax.tree_util.tree_map(lambda x: np.array(x, copy=True), self.state.params))  # not donated
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "run", run)
    return seen


# --- the target: Hugging Face format ----------------------------------------------------------------------------


def test_the_target_tokenizer_reserves_the_mask_token_that_no_text_becomes(target_run):
    from tokenizers import Tokenizer

    _, run = target_run
    tok = Tokenizer.from_file(os.path.join(run, "model", "tokenizer.json"))
    assert tok.token_to_id(export.EOT) == 0 and tok.token_to_id(MASK) == 1
    assert tok.encode(f"x = '{MASK}'").ids.count(1) == 1  # the saved tokenizer reads the token as HF's do
    # Every corpus file writes the mask token's text; the training windows hold it as plain text, never as id 1.
    (ds_dir,) = glob.glob(os.path.join(run, "tfds", "text_corpus", "*"))
    literal = lm.tokenized_windows(tok, ds_dir, "train", 16, literal_specials=True)
    assert 1 not in literal and MASK in tok.decode(literal.ravel().tolist())
    assert 1 in lm.tokenized_windows(tok, ds_dir, "train", 16)  # the default reads it as the special token
    assert not tok.encode_special_tokens  # the setting is restored
    # A run whose tokenizer does not reserve what the config names is refused, naming both.
    with pytest.raises(CheckpointError, match=r"does not reserve \['<\|pad\|>'\] at ids 1..1"):
        lm.check_reserved(tok, ("<|pad|>",), "x")


def test_a_corpus_of_several_folders_keeps_each_folders_split(tmp_path):
    from jspec.train import data

    names = [f"m{i}.py" for i in range(200)]
    held = [n for n in names if data.is_validation(n)][:2]
    assert len(held) == 2  # 5% of 200 names hash into the validation split
    files = held + [n for n in names if n not in held][:6]
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        for n in files:
            (tmp_path / folder / n).write_text(f"# {folder}/{n}\n" + "x = 1\n" * 3)
    pattern = "*.py"
    sources = lm.corpus_sources([str(tmp_path / "a"), str(tmp_path / "b")])
    assert sources == [("a", str(tmp_path / "a")), ("b", str(tmp_path / "b"))]
    both = data.split_sources(sources, pattern)
    alone = data.split_files(str(tmp_path / "a"), data.corpus_files(str(tmp_path / "a"), pattern))
    assert [p for n, p in both["validation"] if n.startswith("a/")] == alone["validation"]  # beside b, as alone
    assert sorted(n for n, _ in both["validation"]) == sorted(f"{f}/{h}" for f in "ab" for h in held)
    assert len(both["train"]) == 12
    assert [n for n, _ in data.split_sources(str(tmp_path / "a"), pattern)["validation"]] == sorted(held)  # one folder
    ds = data.build_corpus(sources, str(tmp_path / "tfds"), pattern)
    rows = data.read_split(ds, "validation")
    assert sorted(r["path"] for r in rows) == sorted(n for n, _ in both["validation"])
    assert all(r["text"].startswith(f"# {r['path']}\n") for r in rows)
    # The named sources, and a folder listed twice.
    assert lm.corpus_sources(["stdlib", "site-packages"]) == [("stdlib", data.stdlib_dir()),
                                                            ("site-packages", data.site_packages_dir())]
    with pytest.raises(ConfigError, match="names a source twice"):
        lm.corpus_sources([str(tmp_path / "a"), str(tmp_path / "a")])


def test_a_target_run_exports_its_step_2_checkpoint_in_hf_format(target_run, tmp_path, capsys):
    _, run = target_run
    out = tmp_path / "step2"
    assert cli_main(["convert", run, str(out), "--step", "2"]) == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert f"wrote {out}: the target model of step 2 of run {run} in Hugging Face" in said
    assert "steps 2, 3" in said
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert export.EOT == lm.EOT
    restored = export.restore_run(run, step=2)
    exported = jspec.load_target(str(out))
    assert exported.cfg == restored.cfg
    _assert_same(exported.params, restored.params)
    assert exported.tokenizer.get_vocab() == restored.tokenizer.get_vocab()
    kw = dict(max_new_tokens=12, eos_ids=[])  # greedy
    assert jspec.generate(exported, PROMPTS, **kw).tokens == \
        jspec.generate(jspec.Target(restored.cfg, restored.params), PROMPTS, **kw).tokens
    # Step 2 is not the end of the run; without --step the newest checkpoint is the run's own model folder.
    final = jspec.load_target(os.path.join(run, "model"))
    assert _differ(exported.params, final.params)
    assert cli_main(["convert", run, str(tmp_path / "newest")]) == 0
    assert "of step 3 of run" in capsys.readouterr().out
    assert load_file(str(tmp_path / "newest" / "model.safetensors")).keys() == \
        load_file(os.path.join(run, "model", "model.safetensors")).keys()
    _assert_same(jspec.load_target(str(tmp_path / "newest")).params, final.params)
    # --dtype bfloat16 stores 16-bit tensors.
    assert cli_main(["convert", run, str(tmp_path / "bf16"), "--step", "2", "--dtype", "bfloat16"]) == 0
    assert {str(t.dtype) for t in load_file(str(tmp_path / "bf16" / "model.safetensors")).values()} == {"bfloat16"}


def test_the_exported_target_loads_in_transformers(target_run, tmp_path):
    import torch
    import transformers

    out = tmp_path / "hf"
    export.export_run(target_run[1], str(out), step=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    ids = np.array([PROMPTS[0] * 3])
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    from jspec.models import transformer

    t = jspec.load_target(str(out))
    n = ids.shape[1]
    fwd = transformer.forward(t.params, t.cfg, ids, np.arange(n)[None], transformer.KVCache.zeros(t.cfg, 1, n),
                              kv_chunk=None)
    got = np.asarray(transformer.logits(t.params, t.cfg, fwd.hidden))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)


def test_a_target_run_starts_from_an_hf_checkpoint(target_run, work, tmp_path, initial_params, capsys):
    config_path, run = target_run
    start = tmp_path / "start"
    export.export_run(run, str(start), step=2)
    new = tmp_path / "new"
    assert cli_main(["train", "target", "--config", config_path, "--out", str(new), "--init", str(start),
                     "--steps", "2"]) == 0, capsys.readouterr().err
    assert f"starting from the parameters of {start}" in capsys.readouterr().err
    _assert_same(initial_params[0], jspec.load_target(str(start)).params)  # the file's, bit for bit
    # The init checkpoint's tokenizer is the run's, and the init path is no part of the run's fingerprint.
    assert lm.load_run_tokenizer(str(new / "tokenizer.json")).get_vocab() == \
        lm.load_run_tokenizer(str(start / "tokenizer.json")).get_vocab()
    assert json.loads((new / "run_config.json").read_text()) == json.loads(
        open(os.path.join(run, "run_config.json")).read())
    # Resuming the run (it has a checkpoint now) ignores --init, saying so.
    assert cli_main(["train", "target", "--config", config_path, "--out", str(new), "--init", str(start),
                     "--steps", "3", "--no-progress"]) == 0
    said = capsys.readouterr().err
    assert "has checkpoints (step 2 the newest): the run resumes from them and ignores the init checkpoint" in said
    assert len(initial_params) == 2 and _differ(initial_params[1], initial_params[0])  # step 2's, not the file's
    _assert_same(initial_params[1], export.restore_run(str(new), step=2).params)


def test_a_target_init_that_does_not_fit_the_run_config_is_refused_naming_each_field(target_run, work, tmp_path):
    start = tmp_path / "start"
    export.export_run(target_run[1], str(start), step=2)
    config = _target_config(str(work / "corpus"), init=str(start))  # the config's train.init
    config["model"].update(num_layers=3, intermediate_size=96)
    path = _write(tmp_path / "run.json", config)
    with pytest.raises(CheckpointError) as err:
        lm.pretrain_target(path, str(tmp_path / "out"), progress=False)
    msg = str(err.value)
    assert msg.startswith(f"init checkpoint {str(start)!r} does not match the run config's model section:")
    assert "model.num_layers: checkpoint 2, run config 3" in msg
    assert "model.intermediate_size: checkpoint 64, run config 96" in msg
    assert "tensor layers.0.w_up: checkpoint (64, 32), run config (96, 32)" in msg
    assert "tensor layers.2.wq: missing" in msg
    assert not (tmp_path / "out" / "tokenizer.json").exists() and not (tmp_path / "out" / "tfds").exists()
    for bad, match in [(7, "train.init must be the path of a checkpoint folder"),
                       (str(tmp_path / "nope"), "no init checkpoint folder")]:
        config = _target_config(str(work / "corpus"), init=bad)
        with pytest.raises((ConfigError, FileNotFoundError), match=match):
            lm.pretrain_target(_write(tmp_path / "run.json", config), str(tmp_path / "out2"), progress=False)


# --- drafters: z-lab DFlash, DeepSpec DSpark --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_a_drafter_run_round_trips_through_its_official_format(name, drafter_runs, target, tmp_path,
                                                               initial_params, capsys):
    config_path, run = drafter_runs(name)
    out = tmp_path / "step2"
    assert cli_main(["convert", run, str(out), "--step", "2"]) == 0, capsys.readouterr().err
    assert f"the {name} model of step 2" in capsys.readouterr().out
    restored = export.restore_run(run, step=2)
    dr, params = jspec.load_drafter(str(out), target)
    assert type(dr) is type(restored.drafter)
    _assert_same(params, restored.params)  # DSpark: the frozen embedding and head come from the target
    assert _differ(params, jspec.load_drafter(os.path.join(run, "model"), target)[1])  # not step 3's
    kw = dict(max_new_tokens=16, eos_ids=[])  # greedy
    a = jspec.generate(target, PROMPTS, drafter=str(out), **kw)
    b = jspec.generate(target, PROMPTS, drafter=(restored.drafter, restored.params), **kw)
    assert a.tokens == b.tokens
    # Greedy tokens are the target's whatever the drafter: its drafts show in the acceptance, round by round.
    assert a.stats["rounds"] == b.stats["rounds"]
    assert a.stats["accepted_per_position"] == b.stats["accepted_per_position"]
    # And back: a new run starts from the exported folder, bit for bit (the first run's distilled data is
    # copied in, so the new run skips distillation).
    new = tmp_path / "new"
    new.mkdir()
    shutil.copy(os.path.join(run, "distilled.npz"), new / "distilled.npz")
    initial_params.clear()
    assert cli_main(["train", name, "--config", config_path, "--target", restored.target_path, "--out", str(new),
                     "--init", str(out), "--steps", "1", "--no-progress"]) == 0, capsys.readouterr().err
    frozen = set(distill.family.get_family(name).recipe.frozen)
    _assert_same(initial_params[0], {k: v for k, v in params.items() if k not in frozen})
    assert json.loads((new / "run_config.json").read_text()) == json.loads(
        open(os.path.join(run, "run_config.json")).read())


def test_a_resumed_drafter_run_ignores_init_and_says_so(drafter_runs, target, tmp_path, initial_params, caplog):
    config_path, run = drafter_runs("dflash")
    start = tmp_path / "start"
    export.export_run(run, str(start), step=2)
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    config = json.loads(open(config_path).read())
    config["train"]["init"] = str(start)  # the config key; the run's fingerprint does not hold it
    path = _write(tmp_path / "run.json", config)
    initial_params.clear()
    distill.train_drafter("dflash", path, os.path.join(os.path.dirname(run), "target-run", "model"), str(copy),
                          steps=3, progress=False)
    warned = [r for r in caplog.records if r.name == "jspec.train.distill" and r.levelname == "WARNING"]
    assert len(warned) == 1 and "has checkpoints (step 3 the newest): the run resumes from them and ignores the " \
        "init checkpoint" in warned[0].getMessage()  # a library call: a log record, for the program's logging
    _assert_same(initial_params[0], export.restore_run(run, step=3).params)


def test_a_drafter_init_that_does_not_fit_is_refused_before_distillation(drafter_runs, work, tmp_path):
    _, run = drafter_runs("dflash")
    start = tmp_path / "start"
    export.export_run(run, str(start), step=2)
    target_dir = os.path.join(str(work), "target-run", "model")
    path = _write(tmp_path / "run.json", _drafter_config(str(work / "corpus"), "dflash", num_layers=2, block_size=5))
    with pytest.raises(CheckpointError) as err:
        distill.train_drafter("dflash", path, target_dir, str(tmp_path / "out"), progress=False, init=str(start))
    msg = str(err.value)
    assert msg.startswith(f"init checkpoint {str(start)!r} does not match the run config's dflash drafter:")
    assert "drafter.cfg.layers.num_layers: checkpoint 1, run config 2" in msg
    assert "drafter.cfg.block_size: checkpoint 4, run config 5" in msg
    assert "tensor layers.1.wq: missing" in msg
    assert not (tmp_path / "out" / "distilled.npz").exists()
    # A checkpoint of another family.
    path = _write(tmp_path / "spark.json", _drafter_config(str(work / "corpus"), "dspark"))
    with pytest.raises(CheckpointError, match=r"is a dflash checkpoint .*`jspec train dspark --init` starts from a "
                                              r"dspark checkpoint"):
        distill.train_drafter("dspark", path, target_dir, str(tmp_path / "out"), progress=False, init=str(start))


def test_a_wrapping_family_starts_from_its_backbones_checkpoint(drafter_runs, work, tmp_path, initial_params):
    """`jspec train d-loop --init DFLASH_DIR`: a D-Loop fine-tune starts from a trained DFlash checkpoint, bit for
    bit; a checkpoint of a family it does not wrap is refused naming both."""
    _, run = drafter_runs("dflash")
    start = tmp_path / "start"
    export.export_run(run, str(start), step=2)
    target_dir = os.path.join(str(work), "target-run", "model")
    new = tmp_path / "new"
    new.mkdir()
    shutil.copy(os.path.join(run, "distilled.npz"), new / "distilled.npz")  # skips distillation
    path = _write(tmp_path / "dloop.json", _drafter_config(str(work / "corpus"), "dflash", boundaries=[2]))
    initial_params.clear()
    distill.train_drafter("d-loop", path, target_dir, str(new), steps=1, progress=False, init=str(start))
    _assert_same(initial_params[0], export.restore_run(run, step=2).params)
    _, spark = drafter_runs("dspark")
    other = tmp_path / "spark"
    export.export_run(spark, str(other), step=2)
    with pytest.raises(CheckpointError, match=r"is a dspark checkpoint .*starts from a d-loop checkpoint or of the "
                                              r"dflash drafter it wraps"):
        distill.train_drafter("d-loop", path, target_dir, str(tmp_path / "out"), progress=False, init=str(other))


# --- what convert refuses, and what it survives ---------------------------------------------------------------


def test_convert_errors_name_the_fix(drafter_runs, target_run, tmp_path, capsys):
    _, run = drafter_runs("dflash")

    def fails(*argv):
        assert cli_main(["convert", *argv]) == 2
        return capsys.readouterr().err

    assert "has no checkpoint of step 7: its checkpoints are steps 2, 3" in fails(run, str(tmp_path / "o"), "--step",
                                                                                 "7")
    model = os.path.join(run, "model")
    err = fails(model, str(tmp_path / "o"))
    assert "is already a checkpoint, in the dflash format" in err and "nothing to convert" in err
    assert "already a checkpoint, in the Hugging Face format" in fails(os.path.join(target_run[1], "model"),
                                                                      str(tmp_path / "o"))
    assert "is a training run folder, and --q4 quantizes a float model folder" in fails(target_run[1],
                                                                                       str(tmp_path / "o"), "--q4")
    assert "no training run folder" in fails(str(tmp_path), str(tmp_path / "o"))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert "holds files that are not a model checkpoint" in fails(run, str(tmp_path / "busy"))
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    assert "would hold the run itself" in fails(run, os.path.dirname(run))
    assert not (tmp_path / "o").exists()
    # A drafter run whose target is gone: its shapes (and DSpark's frozen copies) came from it.
    copy = tmp_path / "moved"
    shutil.copytree(run, copy)
    fingerprint = json.loads((copy / "run_config.json").read_text())
    fingerprint["target"] = str(tmp_path / "gone")
    (copy / "run_config.json").write_text(json.dumps(fingerprint))
    err = fails(str(copy), str(tmp_path / "o"))
    assert f"{str(tmp_path / 'gone')!r} (recorded in its run_config.json), no longer exists" in err


def test_an_interrupted_run_with_a_damaged_newest_checkpoint_exports_the_one_before(drafter_runs, target,
                                                                                    tmp_path):
    _, run = drafter_runs("dspark")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "model")  # interrupted: no model folder
    for name in glob.glob(str(copy / "checkpoints" / "3" / "default" / "**" / "*"), recursive=True):
        if os.path.isfile(name) and os.path.getsize(name) > 200:
            with open(name, "r+b") as f:
                f.truncate(100)
    with pytest.warns(RuntimeWarning, match="checkpoint of step 3 .* cannot be restored"):
        ckpt = export.export_run(str(copy), str(tmp_path / "out"))
    assert ckpt.step == 2 and export.checkpoint_steps(str(copy)) == [2, 3]  # the run folder is left as it was
    _assert_same(jspec.load_drafter(str(tmp_path / "out"), target)[1], export.restore_run(run, step=2).params)
    with pytest.raises(CheckpointError, match="checkpoint of step 3 in .* cannot be restored"):
        export.restore_run(str(copy), step=3)


# --- validation tau during training ------------------------------------------------------------------------------


def test_validation_tau_is_the_loops_greedy_tau_on_held_out_prompts(work, target_run, target, tmp_path):
    """train.eval_every: val_tau in metrics.jsonl at every eval step, from the offline evaluator; at the
    last step it equals the compiled loop's greedy tau with the exported drafter on the same prompts."""
    config = _drafter_config(str(work / "corpus"), "dflash")
    config["train"].update(steps=4, ckpt_every=4, log_every=3, eval_every=2, eval_prompts=3)
    path = _write(tmp_path / "eval.json", config)
    run = tmp_path / "eval-run"
    model = distill.train_drafter("dflash", path, os.path.join(target_run[1], "model"), str(run), progress=False)
    lines = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [m["step"] for m in lines] == [2, 3, 4]  # log_every 3, plus the evaluation steps
    val = {m["step"]: m["val_tau"] for m in lines if "val_tau" in m}
    assert sorted(val) == [2, 4]
    ds_dir, _ = lm.prepare_text({"data": config["data"]}, str(run))
    prompts = distill.corpus_prompts(target, ds_dir, "validation", 3, 8, 0)
    rounds = sum(jspec.generate(target, [p], max_new_tokens=8, eos_ids=[], drafter=model,
                                verifier="greedy").stats["rounds"] for p in prompts)
    assert val[4] == pytest.approx(3 * 7 / rounds)  # 7 tokens per text after the prefill's first
    target_config = _target_config(str(work / "corpus"), eval_every=2)
    with pytest.raises(ConfigError, match="a target run has no drafter"):
        lm.load_run_config(_write(tmp_path / "t.json", target_config), "target")


def test_a_drafter_run_shares_another_runs_distilled_sequences(drafter_runs, target_run, work, tmp_path):
    """`--distilled RUN_DIR`: a DSpark run of the same target, data and distill sections takes DFlash's
    sequences byte for byte (no corpus is built, nothing is distilled); any difference is refused by name."""
    _, run = drafter_runs("dflash")
    target_dir = os.path.join(target_run[1], "model")
    identity = json.loads(open(os.path.join(run, "distilled.json")).read())
    assert set(identity) == {"target_sha256", "data", "distill"} and "batch_size" not in identity["data"]
    path = _write(tmp_path / "spark.json", _drafter_config(str(work / "corpus"), "dspark"))
    out = tmp_path / "spark"
    assert cli_main(["train", "dspark", "--config", path, "--target", target_dir, "--out", str(out),
                     "--distilled", run, "--steps", "1", "--no-progress"]) == 0
    for name in ("distilled.npz", "distilled.json"):
        assert (out / name).read_bytes() == open(os.path.join(run, name), "rb").read()
    assert not (out / "tfds" / "text_corpus").exists()  # the corpus was never read
    # Another distill section, another target: refused before anything is written.
    other = _drafter_config(str(work / "corpus"), "dspark")
    other["distill"]["new_tokens"] = 6
    with pytest.raises(ConfigError, match="distilled with another distill section than this run's"):
        distill.train_drafter("dspark", _write(tmp_path / "o.json", other), target_dir, str(tmp_path / "o"),
                              progress=False, distilled=run)
    assert not (tmp_path / "o" / "distilled.npz").exists()
    other_target = tmp_path / "t2"
    shutil.copytree(target_dir, other_target)
    weights = load_file(str(other_target / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1
    save_file(weights, str(other_target / "model.safetensors"))
    with pytest.raises(ConfigError, match="distilled with another target than this run's"):
        distill.train_drafter("dspark", path, str(other_target), str(tmp_path / "t"), progress=False, distilled=run)
    with pytest.raises(ConfigError, match="no distilled.npz there"):
        distill.train_drafter("dspark", path, target_dir, str(tmp_path / "x"), progress=False,
                              distilled=str(tmp_path))
