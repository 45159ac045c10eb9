"""Training runs that fail say so, and their files survive crashes: run configs checked whole before
anything runs, drafters checked against the target before distillation, atomic run files, a damaged
newest checkpoint set aside for the previous one, metrics logged once across resumes, one clear error
for a full disk, and one run per folder."""

from __future__ import annotations

import dataclasses
import errno
import glob
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.cli import main as cli_main
from jspec.drafters import Drafter, Proposal, family
from jspec.errors import CheckpointError, ConfigError, JspecError
from jspec.models import transformer
from jspec.train import distill, lm, runfiles
from jspec.train.trainer import CheckpointWriteError, RunFolderBusy, TrainConfig, Trainer
from test_train import CFG, _dataset, _lm_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def target():
    return jspec.Target(CFG, transformer.init_params(CFG, jax.random.key(0), std=0.3))


def _write(path, config) -> str:
    path.write_text(json.dumps(config))
    return str(path)


def _corpus(root):
    root.mkdir()
    for i in range(6):  # enough files for a train / validation split by file
        (root / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(30)))
    return str(root)


def _target_config(corpus, **train):
    return {"model": {"family": "qwen3", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
                      "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16, "qk_norm": True,
                      "tie_word_embeddings": True},
            "data": {"corpus": corpus, "pattern": "*.py", "seq_len": 16, "batch_size": 2},
            "train": {"steps": 2, "lr": 1e-2, "warmup_frac": 0.0, "ckpt_every": 2, "keep": 1, "log_every": 1,
                      **train}}


def _drafter_config(corpus="stdlib", **drafter):
    return {"drafter": {"num_layers": 1, "block_size": 4, "target_layer_ids": [0, 1], "mask_token_id": 63,
                        **drafter},
            "data": {"corpus": corpus, "pattern": "*.py", "batch_size": 2},
            "distill": {"num_prompts": 4, "prompt_len": 8, "new_tokens": 8, "batch": 2},
            "train": {"steps": 2, "lr": 1e-2, "ckpt_every": 2, "keep": 1, "log_every": 1}}


def _same_params(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- 1. run configs: unknown and missing keys at every level, before anything runs ---------------------------------


def test_target_config_with_unknown_or_missing_keys_is_refused_before_anything_runs(tmp_path, capsys):
    config = _target_config(str(tmp_path / "corpus"))
    config["train"]["lerning_rate"] = config["train"].pop("lr")
    del config["data"]["seq_len"]
    config["model"]["num_layer"] = config["model"].pop("num_layers")
    config["init_sdt"] = 0.02
    path = _write(tmp_path / "run.json", config)
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as err:
        lm.pretrain_target(path, str(out), progress=False)
    msg = str(err.value)
    assert msg.startswith(f"training config {path}: ")
    assert "unknown key 'train.lerning_rate' (the train section takes steps, lr," in msg
    assert "unknown key 'model.num_layer' (did you mean 'model.num_layers'?" in msg
    assert "missing required key 'model.num_layers'" in msg and "missing required key 'data.seq_len'" in msg
    assert "unknown key 'init_sdt' (did you mean 'init_std'?" in msg
    assert not out.exists()  # refused before the corpus, the tokenizer or the run folder
    # The CLI: one message, exit code 2.
    assert cli_main(["train", "target", "--config", path, "--out", str(out), "--no-progress"]) == 2
    cli_err = capsys.readouterr().err
    assert cli_err.startswith("jspec: error: training config") and "train.lerning_rate" in cli_err
    assert "Traceback" not in cli_err


def test_target_config_values_and_sections_are_checked_naming_the_file(tmp_path):
    base = _target_config(str(tmp_path))
    for change, match in [
        (lambda c: c.update(train=[1, 2]), r"'train' must be an object of settings"),
        (lambda c: c["data"].update(batch_size="8"), r"data.batch_size must be an integer >= 1, got '8'"),
        (lambda c: c["train"].update(lr=-1.0), r"need steps, .* lr > 0"),
        (lambda c: c.update(init_std=float("nan")), r"init_std must be a finite number > 0, got nan"),
        (lambda c: c.update(reserved_tokens="<|mask|>"), r"reserved_tokens must be a list of distinct, non-empty"),
        (lambda c: c["data"].update(corpus=[]), r"data.corpus must be a source or a list of sources"),
        (lambda c: c["data"].update(corpus=["stdlib", 3]), r"data.corpus must be a source or a list of sources"),
        (lambda c: c.update(reserved_tokens=["<|endoftext|>"]), r"other than <\|endoftext\|> \(always id 0\)"),
        (lambda c: c["model"].update(eos_token_ids=[0]), r"unknown key 'model.eos_token_ids'"),
        (lambda c: c["model"].update(num_kv_heads=3), r"must be a multiple of num_key_value_heads"),
    ]:
        config = json.loads(json.dumps(base))
        change(config)
        path = _write(tmp_path / "run.json", config)
        with pytest.raises(ConfigError, match=f"^training config {path}: .*{match}"):
            lm.load_run_config(path, "target")


def test_drafter_config_fixed_sections_are_checked_before_the_target_loads(tmp_path):
    config = _drafter_config()
    config["distil"] = config.pop("distill")
    config["data"]["seq_len"] = 16  # a target run's setting: a drafter run does not read it
    path = _write(tmp_path / "run.json", config)
    with pytest.raises(ConfigError) as err:  # the target folder does not exist: the config is refused first
        distill.train_drafter("dflash", path, str(tmp_path / "no-target"), str(tmp_path / "out"), progress=False)
    msg = str(err.value)
    assert msg.startswith(f"training config {path}: ")
    assert "unknown key 'distil' (did you mean 'distill'?" in msg and "missing required key 'distill'" in msg
    assert "unknown key 'data.seq_len'" in msg
    assert not (tmp_path / "out").exists()


def test_drafter_section_keys_are_the_recipes(target, tmp_path):
    path = str(tmp_path / "run.json")
    # A misspelt required key: missing, with the spelling that was meant.
    config = _drafter_config()
    config["drafter"]["num_layer"] = config["drafter"].pop("num_layers")
    with pytest.raises(ConfigError, match=rf"^training config {path}: missing required key 'drafter.num_layers' "
                                          r"\(the dflash recipe needs it\); did you mean drafter.num_layers for "
                                          r"drafter.num_layer\?"):
        distill.build_drafter("dflash", config, target, path)
    # A key no part of the run reads (a typo of an optional key; a setting of another family).
    for extra, hint in [({"num_anchor": 8}, "did you mean drafter.num_anchors for drafter.num_anchor"),
                        ({"markov_rank": 8}, "it read block_size, gamma, loss, mask_token_id")]:
        with pytest.raises(ConfigError, match=rf"^training config {path}: unknown key 'drafter.{next(iter(extra))}' "
                                              r"\(the dflash recipe does not read it"):
            distill.build_drafter("dflash", _drafter_config(**extra), target, path)
        with pytest.raises(ConfigError, match=hint):
            distill.build_drafter("dflash", _drafter_config(**extra), target, path)
    # The loss settings the run itself reads.
    with pytest.raises(ConfigError, match=r"drafter.loss 'kl_div' is no loss of this drafter: use one of ce, "):
        distill.build_drafter("dflash", _drafter_config(loss="kl_div"), target, path)
    # A family's own objective is its default and one more name it accepts; another family's is refused.
    assert distill.drafter_loss({}, own="dspark").name == "dspark"
    with pytest.raises(ConfigError, match=r"drafter.loss 'ttt' is no loss of this drafter: use one of dspark, ce, "):
        distill.build_drafter("dspark", _drafter_config(loss="ttt"), target, path)
    with pytest.raises(ConfigError, match=r"drafter.num_anchors must be an integer >= 1, got 0"):
        distill.build_drafter("dflash", _drafter_config(num_anchors=0), target, path)
    # The DSpark recipe reads its own keys too.
    dr, _ = distill.build_drafter("dspark", _drafter_config(markov_rank=8, block_size=3), target, path)
    assert dr.spark.markov_rank == 8


# --- 2. drafters are checked against the target before distillation ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Table(Drafter):
    """A test family whose recipe builds without checking the target (its `validate` does the checking)."""

    block_size: int = 2

    @property
    def num_drafts(self) -> int:
        return self.block_size

    def validate(self, target_cfg, dparams) -> None:
        v = target_cfg.vocab_size
        if dparams["table"].shape != (v, v):
            raise ValueError(f"table {dparams['table'].shape} does not fit the target vocabulary {v}")

    def propose(self, dparams, state, ctx):
        tokens = jnp.zeros((ctx.tokens.shape[0], self.block_size), jnp.int32)
        return Proposal(tokens, None), state


@pytest.fixture()
def table_family():
    def build(run, target, key):
        v = run["drafter"]["vocab_size"]  # trusts the config: a wrong vocabulary builds fine
        return Table(block_size=run["drafter"].get("block_size", 2)), {"table": jnp.zeros((v, v))}

    fam = family.register_family(family.Family(
        name="table_test", drafter=Table, recipe=family.TrainRecipe(build=build, loss=lambda *a: (0.0, {}))))
    yield fam
    del family.FAMILIES["table_test"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from jspec.io.hf import save_params

    folder = str(tmp_path_factory.mktemp("bad_runs_target"))
    save_params(folder, CFG, transformer.init_params(CFG, jax.random.key(0), std=0.3))
    return folder


def test_a_drafter_that_does_not_fit_the_target_is_refused_before_distillation(target, target_dir, tmp_path,
                                                                                 table_family):
    path = _write(tmp_path / "run.json", {**_drafter_config(), "drafter": {"vocab_size": CFG.vocab_size + 1}})
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=rf"^training config {path}: the table_test drafter it describes does not "
                                          r"fit the target \(table \(65, 65\) does not fit the target vocabulary 64\)"):
        distill.train_drafter("table_test", path, target_dir, str(out), progress=False)
    assert not (out / "distilled.npz").exists() and not (out / "tfds").exists()
    # Without a file, build_drafter raises the drafter's own ValueError, as generation does.
    with pytest.raises(ValueError, match="does not fit the target vocabulary 64"):
        distill.build_drafter("table_test", {"drafter": {"vocab_size": 65}}, target)
    dr, params = distill.build_drafter("table_test", {"drafter": {"vocab_size": 64}}, target)
    assert params["table"].shape == (64, 64)


def test_a_builtin_drafter_outside_the_target_names_the_file(target_dir, tmp_path):
    for drafter, match in [({"mask_token_id": 64}, r"mask_token_id 64 is outside the target vocabulary \[0, 64\)"),
                           ({"target_layer_ids": [0, 2]}, r"target_layer_ids \[0, 2\] include \[2\]")]:
        path = _write(tmp_path / "run.json", _drafter_config(**drafter))
        with pytest.raises(ConfigError, match=rf"^training config {path}: drafter does not fit the target: .*{match}"):
            distill.train_drafter("dflash", path, target_dir, str(tmp_path / "out"), progress=False)
        assert not (tmp_path / "out" / "distilled.npz").exists()


# --- 3. run files: atomic writes ----------------------------------------------------------------------------------


def test_atomic_files_and_folders_are_whole_or_untouched(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("old")

    def crash(tmp):
        with open(tmp, "w") as f:
            f.write('{"half": ')
        raise KeyboardInterrupt  # killed mid-write

    with pytest.raises(KeyboardInterrupt):
        runfiles.atomic_file(str(path), crash)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["tokenizer.json"]
    runfiles.atomic_text(str(path), "new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["tokenizer.json"]

    model = tmp_path / "model"
    runfiles.replace_folder(str(model), lambda d: (os.makedirs(d), open(os.path.join(d, "a"), "w").write("1")))

    def crash_folder(d):
        os.makedirs(d)
        open(os.path.join(d, "a"), "w").write("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        runfiles.replace_folder(str(model), crash_folder)
    assert (model / "a").read_text() == "1" and sorted(os.listdir(tmp_path)) == ["model", "tokenizer.json"]


def test_distilled_data_is_written_whole(target, tmp_path, monkeypatch):
    out = str(tmp_path / "distilled.npz")
    real = np.savez

    def killed(f, **arrays):
        real(f, **arrays)
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", killed)
    with pytest.raises(KeyboardInterrupt):
        distill.self_distill(target, [[1, 2, 3]], new_tokens=2, batch=1, seed=0, out_path=out)
    assert os.listdir(tmp_path) == []  # no distilled.npz for the resume to trust, no temporary file left
    monkeypatch.setattr(np, "savez", real)
    assert distill.self_distill(target, [[1, 2, 3]], new_tokens=2, batch=1, seed=0, out_path=out) == out
    assert os.listdir(tmp_path) == ["distilled.npz"] and np.load(out)["tokens"].shape == (1, 5)


def test_target_run_survives_a_crash_while_saving_its_tokenizer(tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    path = _write(tmp_path / "run.json", _target_config(_corpus(tmp_path / "corpus")))
    out = tmp_path / "out"
    real = Tokenizer.save

    def killed(self, name, *args, **kwargs):
        with open(name, "w") as f:
            f.write('{"version": "1.0", "trunc')
        raise KeyboardInterrupt

    monkeypatch.setattr(Tokenizer, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        lm.pretrain_target(path, str(out), progress=False)
    assert not (out / "tokenizer.json").exists() and not glob.glob(str(out / ".tokenizer*"))
    monkeypatch.setattr(Tokenizer, "save", real)
    model = lm.pretrain_target(path, str(out), progress=False)  # the resumed command starts cleanly
    assert sorted(os.listdir(model)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert not [n for n in os.listdir(out) if n.startswith(".model")]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    # A tokenizer damaged by other means is named.
    (out / "tokenizer.json").write_text('{"version": ')
    with pytest.raises(CheckpointError, match=f"{out}/tokenizer.json is not a valid tokenizer.json"):
        lm.pretrain_target(path, str(out), progress=False)


# --- 3. checkpoints: a damaged newest one, duplicate metrics, a full disk --------------------------------------------


def _damage(step_dir):
    """Cut the files of a checkpoint's state short (a crash, a bad disk)."""
    for name in glob.glob(os.path.join(step_dir, "default", "**", "*"), recursive=True):
        if os.path.isfile(name) and os.path.getsize(name) > 200:
            with open(name, "r+b") as f:
                f.truncate(100)


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    full = _lm_trainer(tmp_path / "full").run(_dataset(), progress=False)
    _lm_trainer(tmp_path / "run").run(_dataset(), progress=False)  # checkpoints 2, 4, 6
    _damage(tmp_path / "run" / "checkpoints" / "6")
    resumed = _lm_trainer(tmp_path / "run")
    with pytest.warns(RuntimeWarning, match=r"checkpoint of step 6 in .* cannot be restored \(.+\); it was moved to "
                                            r".*damaged-checkpoints/6-.*; trying the previous checkpoint"):
        assert resumed.restore_latest() == 4
    assert len(os.listdir(tmp_path / "run" / "damaged-checkpoints")) == 1
    state = resumed.run(_dataset(), progress=False)  # steps 5, 6 again: the same parameters as the full run
    _same_params(full.params, state.params)
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["2", "4", "6"]
    # Every checkpoint damaged: one error naming the folder and each step.
    for step in ("2", "4", "6"):
        _damage(tmp_path / "run" / "checkpoints" / step)
    again = _lm_trainer(tmp_path / "run")
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointError, match=r"no checkpoint of run folder .* can be "
                                                                            r"restored: step 6 \(.*; step 4 .*; step 2"):
        again.restore_latest()
    again.close()


def test_metrics_log_each_step_once_after_a_resume(tmp_path):
    full = _lm_trainer(tmp_path / "full")
    full.run(_dataset(), progress=False)

    class Killed(Exception):
        pass

    class DiesAtStep6:  # the process dies during step 6: steps 1-5 logged, the newest checkpoint is step 4's
        def __getitem__(self, i):
            if i == 5:
                raise Killed
            return _dataset()[i]

    with pytest.raises(Killed):
        _lm_trainer(tmp_path / "run").run(DiesAtStep6(), progress=False)
    log = tmp_path / "run" / "metrics.jsonl"
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4, 5]
    with open(log, "a") as f:
        f.write('{"loss": 1.0, "st')  # and its last line was cut short
    resumed = _lm_trainer(tmp_path / "run")
    assert resumed.restore_latest() == 4
    resumed.run(_dataset(), progress=False)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    expected = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6]
    assert [m["loss"] for m in lines] == [m["loss"] for m in expected]


def test_a_full_disk_at_a_checkpoint_is_one_error_and_the_previous_checkpoint_resumes(tmp_path, monkeypatch):
    trainer = _lm_trainer(tmp_path)
    real = trainer.manager.save

    def save(step, *args, **kwargs):
        if step == 4:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "checkpoints" / "4"))
        return real(step, *args, **kwargs)

    monkeypatch.setattr(trainer.manager, "save", save)
    with pytest.raises(CheckpointWriteError) as err:
        trainer.run(_dataset(), progress=False)
    msg = str(err.value)
    assert msg == (f"no space left on the device of run folder {str(tmp_path)!r}: the checkpoint of step 4 was not "
                   "written (the previous checkpoint, step 2, is intact); free some space (or lower train.keep) "
                   "and run the same command again to resume")
    assert isinstance(err.value, JspecError)
    # The error as orbax wraps it (a bare Exception raised from the OSError) reads the same.
    wrapped = _lm_trainer(tmp_path)
    assert wrapped.restore_latest() == 2

    def wrapped_save(step, *args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise Exception("Error writing to tensorstore") from e

    monkeypatch.setattr(wrapped.manager, "save", wrapped_save)
    with pytest.raises(CheckpointWriteError, match="checkpoint of step 4 was not written .*step 2, is intact"):
        wrapped.run(_dataset(), progress=False)
    resumed = _lm_trainer(tmp_path)
    assert resumed.restore_latest() == 2
    resumed.close()


# --- 3. one run per folder ------------------------------------------------------------------------------------------


def test_a_second_run_into_a_busy_folder_is_refused(tmp_path):
    first = _lm_trainer(tmp_path)  # holds the folder from its creation to the end of its run
    with pytest.raises(RunFolderBusy, match=rf"run folder {str(tmp_path)!r} is in use by another training run "
                                            rf"\(process {os.getpid()} on .* holds {tmp_path}/.lock\)"):
        _lm_trainer(tmp_path)
    first.run(_dataset(), steps=2, progress=False)
    second = _lm_trainer(tmp_path)  # released at the end of the run
    assert second.restore_latest() == 2
    second.close()
    # A whole `jspec train` run holds its folder before it reads the corpus; a drafter run before it loads the target.
    with runfiles.RunLock(str(tmp_path / "busy")):
        path = _write(tmp_path / "target.json", _target_config(str(tmp_path / "no-corpus")))
        with pytest.raises(RunFolderBusy, match="busy"):
            lm.pretrain_target(path, str(tmp_path / "busy"), progress=False)
        path = _write(tmp_path / "drafter.json", _drafter_config())
        with pytest.raises(RunFolderBusy, match="busy"):
            distill.train_drafter("dflash", path, str(tmp_path / "no-target"), str(tmp_path / "busy"), progress=False)


def test_another_process_holding_the_folder_is_named(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        from jspec.train import runfiles
        with runfiles.RunLock({str(tmp_path)!r}):
            print("locked", flush=True)
            sys.stdin.readline()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(RunFolderBusy, match=rf"in use by another training run \(process {child.pid} on "):
            Trainer(lambda p, b: (jnp.sum(p), {}), jnp.zeros(()), TrainConfig(steps=1), str(tmp_path), {"x": 1})
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    trainer = Trainer(lambda p, b: (jnp.sum(p), {}), jnp.zeros(()), TrainConfig(steps=1), str(tmp_path), {"x": 1})
    trainer.close()  # the child's exit released the folder
