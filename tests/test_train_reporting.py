"""What a training run reports: tokens_per_s without the compile step, optional TensorBoard scalars, and
reporting settings a resume may change."""

from __future__ import annotations

import json
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.errors import ConfigError
from jspec.train.trainer import TrainConfig, Trainer


class Batches:
    """batch i: 4 x 8 'tokens' (inputs of a least-squares problem), a pure function of i."""

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        x = rng.normal(size=(4, 8)).astype(np.float32)
        return {"x": x, "y": x @ np.arange(8, dtype=np.float32)}


def _loss(params, batch):
    err = batch["x"] @ params["w"] - batch["y"]
    return jnp.mean(err ** 2), {"acc": -jnp.mean(jnp.abs(err))}


def _trainer(run_dir, **train):
    tc = TrainConfig(**{"steps": 4, "lr": 1e-2, "ckpt_every": 4, "log_every": 1, **train})
    return Trainer(_loss, {"w": jnp.zeros(8)}, tc, str(run_dir), fingerprint={"config": {"train": train}})


def _metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_tokens_per_s_leaves_out_the_compiling_step(tmp_path):
    _trainer(tmp_path).run(Batches(), progress=False)
    lines = _metrics(tmp_path)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert "tokens_per_s" not in lines[0]  # only the first step ran: it compiled, so no rate yet
    assert all(m["tokens_per_s"] > 0 for m in lines[1:])


def _scalars(folder):
    """(tag, step, value) of every scalar in TensorBoard event files, read from the record format itself:
    u64 length, u32 crc, an Event proto, u32 crc."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def test_tensorboard_scalars_equal_the_metrics_file(tmp_path):
    _trainer(tmp_path, tensorboard=True).run(Batches(), progress=False)
    board = _scalars(tmp_path / "tensorboard")
    for m in _metrics(tmp_path):
        for key in ("loss", "acc", "grad_norm"):
            (value,) = [v for tag, step, v in board if tag == f"train/{key}" and step == m["step"]]
            assert value == pytest.approx(m[key], rel=1e-6)


def test_tensorboard_must_be_a_flag(tmp_path):
    with pytest.raises(ValueError, match="tensorboard='yes' \\(true or false\\)"):
        TrainConfig(tensorboard="yes")


def test_a_resume_may_switch_reporting_settings(tmp_path):
    trainer = _trainer(tmp_path, steps=4)
    trainer.run(Batches(), steps=2, progress=False)
    trainer.close()
    resumed = _trainer(tmp_path, steps=4, tensorboard=True, log_every=2)
    assert resumed.restore_latest() == 2
    resumed.run(Batches(), progress=False)
    assert [m["step"] for m in _metrics(tmp_path)] == [1, 2, 4]
    assert [s for tag, s, _ in _scalars(tmp_path / "tensorboard") if tag == "train/loss"] == [4]
    resumed.close()
    with pytest.raises(ValueError, match="another configuration"):
        _trainer(tmp_path, steps=4, lr=2e-2)


def test_missing_tensorboardx_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboardx(name, *args, **kwargs):
        if name.startswith("tensorboardX"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboardx)
    with pytest.raises(ConfigError, match="pip install 'jspec\\[tensorboard\\]'"):
        _trainer(tmp_path, tensorboard=True).run(Batches(), progress=False)
