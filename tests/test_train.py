"""Training: leakage-free blocks, exact resume, sharded steps, self-distillation, bad input."""

from __future__ import annotations

import dataclasses
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
from jspec.drafters import dflash as dfl
from jspec.models import transformer
from jspec.models.config import ModelConfig
from jspec.train import data, drafter, lm
from jspec.train.trainer import TrainConfig, Trainer, TrainingDiverged

CFG = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2,
                  num_kv_heads=1, head_dim=16, qk_norm=True)


@pytest.fixture(scope="module")
def target():
    return jspec.Target(CFG, transformer.init_params(CFG, jax.random.key(0), std=0.3))


def _draft_cfg(anchor_predicts=False):
    return dfl.DFlashConfig(layers=dataclasses.replace(CFG, num_layers=1), target_layer_ids=(0, 1),
                            num_target_layers=3, mask_token_id=63, block_size=4, anchor_predicts=anchor_predicts)


@pytest.mark.parametrize("anchor_predicts", [False, True])
def test_multi_anchor_blocks_do_not_leak(target, anchor_predicts):
    """A block's draft logits do not change when tokens after its anchor change in the context stream,
    and do change when a token before it changes."""
    cfg = _draft_cfg(anchor_predicts)
    params = dfl.init_params(cfg, jax.random.key(1), std=0.3)
    tokens = jax.random.randint(jax.random.key(2), (1, 32), 0, 62)
    anchors = jnp.array([[5, 12, 20]])

    def block_hidden(toks):
        taps, _ = drafter.target_pass(target.params, CFG, toks, cfg.target_layer_ids)
        # The block inputs (anchor tokens) come from the original text; only the context stream varies.
        b, t = toks.shape
        ctx_k, ctx_v = dfl.context_kv(params, cfg, taps, jnp.broadcast_to(jnp.arange(t), (b, t)))
        blocks = dfl.block_inputs(cfg, jnp.take_along_axis(tokens, anchors, axis=1))
        return np.asarray(dfl.draft_blocks(params, cfg, target.params["embed"], ctx_k, ctx_v, anchors, blocks))

    base = block_hidden(tokens)
    after = block_hidden(tokens.at[0, 13:].set((tokens[0, 13:] + 7) % 62))
    np.testing.assert_array_equal(after[:, :2], base[:, :2])  # blocks at 5 and 12 see nothing past 12
    assert np.abs(after[:, 2] - base[:, 2]).max() > 1e-4  # the block at 20 sees positions 13..19
    before = block_hidden(tokens.at[0, 4].set((tokens[0, 4] + 7) % 62))
    assert all(np.abs(before[:, i] - base[:, i]).max() > 1e-4 for i in range(3))


def test_block_labels_follow_the_convention(target):
    for ap in (False, True):
        cfg = _draft_cfg(ap)
        tokens = jnp.arange(20)[None]
        mask = jnp.ones((1, 20))
        _, logp = drafter.target_pass(target.params, CFG, tokens, cfg.target_layer_ids)
        labels, lmask, p_t = drafter.block_targets(cfg.num_drafts, tokens, mask, logp, jnp.array([[3, 17]]), jnp.array([[True, True]]))
        g = cfg.num_drafts
        np.testing.assert_array_equal(labels[0, 0], 4 + np.arange(g))  # draft i is x_{a+1+i}
        np.testing.assert_array_equal(lmask[0, 1], (18 + np.arange(g) < 20).astype(np.float32))
        np.testing.assert_array_equal(p_t[0, 0, 0], logp[0, 3])


def _lm_trainer(run_dir, steps=6, ckpt_every=2):
    tc = TrainConfig(steps=steps, lr=1e-2, warmup_frac=0.1, ckpt_every=ckpt_every, keep=3, log_every=1)
    params = transformer.init_params(CFG, jax.random.key(0))
    return Trainer(lambda p, b: lm.lm_loss(p, CFG, b), params, tc, str(run_dir), fingerprint={"cfg": "tiny"})


def _dataset():
    windows = np.random.default_rng(0).integers(0, 64, size=(40, 17)).astype(np.int32)
    return data.batches(windows, 4, seed=3)


def test_resume_is_exact_and_skips_half_written_steps(tmp_path):
    full = _lm_trainer(tmp_path / "full").run(_dataset(), progress=False)
    first = _lm_trainer(tmp_path / "part")
    first.run(_dataset(), steps=4, progress=False)
    # A later step that was never finished: orbax leaves a temporary folder; it must be ignored.
    os.makedirs(tmp_path / "part" / "checkpoints" / "5.orbax-checkpoint-tmp-1234" / "default")
    (tmp_path / "part" / "checkpoints" / "5.orbax-checkpoint-tmp-1234" / "default" / "junk").write_text("x")
    resumed = _lm_trainer(tmp_path / "part")
    assert resumed.restore_latest() == 4
    state = resumed.run(_dataset(), progress=False)
    for a, b in zip(jax.tree_util.tree_leaves(full.params), jax.tree_util.tree_leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "full" / "metrics.jsonl")]
    again = [json.loads(line)["loss"] for line in open(tmp_path / "part" / "metrics.jsonl")]
    assert losses == again  # same batches, same losses


def test_frozen_parameters_are_arguments_of_the_step_not_constants(target, tmp_path):
    """The frozen target reaches the compiled drafter step as an argument: no constant of its size."""
    from jspec.drafters import family
    from jspec.train import distill
    from jspec.train.drafter import DrafterLoss

    run = {"drafter": {"num_layers": 1, "block_size": 4, "target_layer_ids": [0, 1], "mask_token_id": 63},
           "train": {"seed": 0}}
    dr, params = distill.build_drafter("dflash", run, target)
    recipe = family.get_family("dflash").recipe
    tc = TrainConfig(steps=1, lr=1e-3, warmup_frac=0.0, ckpt_every=1, keep=1, log_every=1)
    trainer = Trainer(lambda p, b, t: recipe.loss(p, t, CFG, dr, DrafterLoss(num_anchors=2), b, jax.random.key(0)),
                      params, tc, str(tmp_path), fingerprint={"test": "frozen"}, frozen=target.params)
    tokens = jnp.ones((1, 16), jnp.int32)
    hlo = trainer._step.lower(trainer.state, {"tokens": tokens, "loss_mask": jnp.ones_like(tokens)},
                              target.params, jnp.zeros((), jnp.int32)).as_text()
    embed = "x".join(map(str, target.params["embed"].shape))
    assert f"tensor<{embed}xf32>" in hlo  # the embedding is there, as an argument ...
    assert not any("constant" in line and f"tensor<{embed}xf32>" in line for line in hlo.splitlines())  # ... only
    state = trainer.run([{"tokens": tokens, "loss_mask": jnp.ones_like(tokens)}], steps=1, progress=False)
    assert np.isfinite(np.asarray(jax.tree_util.tree_leaves(state.params)[0])).all()


def test_a_diverging_run_stops_with_its_step_and_keeps_the_last_good_checkpoint(tmp_path):
    """The loss turns NaN at step 5 (a batch of NaN-making inputs): the run stops there, names step 5, and the
    newest checkpoint is step 4's, and it restores to finite parameters."""
    tc = TrainConfig(steps=8, lr=1e-2, warmup_frac=0.1, ckpt_every=2, keep=3, log_every=1)
    params = transformer.init_params(CFG, jax.random.key(0))

    def loss(p, b):  # windows [B, T + 1]; a window starting with token 63 makes the loss NaN
        value, metrics = lm.lm_loss(p, CFG, b)
        return value * jnp.where(b[0, 0] == 63, jnp.nan, 1.0), metrics

    batches = [np.where(np.asarray(_dataset()[i]) == 63, 62, np.asarray(_dataset()[i])) for i in range(8)]
    batches[4][0, 0] = 63
    trainer = Trainer(loss, params, tc, str(tmp_path), fingerprint={"cfg": "nan"})
    with pytest.raises(TrainingDiverged, match="at step 5 .*checkpoint, step 4, is kept"):
        trainer.run(batches, progress=False)
    again = Trainer(loss, transformer.init_params(CFG, jax.random.key(0)), tc, str(tmp_path), fingerprint={"cfg": "nan"})
    assert again.restore_latest() == 4
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(again.state.params))


def test_bad_training_settings_are_refused(tmp_path, capsys):
    for bad, match in [(dict(lr=float("nan")), "lr=nan"), (dict(steps=0), "need steps"), (dict(steps=2.5), "steps=2.5"),
                       (dict(clip=-1.0), "clip > 0")]:
        with pytest.raises(ValueError, match=match):
            TrainConfig(**bad)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        _lm_trainer(tmp_path / "run").run(_dataset(), steps=0, progress=False)
    from jspec.cli import main

    assert main(["train", "target", "--config", "nope.json", "--out", str(tmp_path / "o"), "--steps", "-5"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err


def test_resume_into_another_configs_directory_is_refused(tmp_path):
    _lm_trainer(tmp_path).run(_dataset(), steps=1, progress=False)
    tc = TrainConfig(steps=6)
    with pytest.raises(ValueError, match="written by another configuration"):
        Trainer(lambda p, b: lm.lm_loss(p, CFG, b), transformer.init_params(CFG, jax.random.key(0)), tc,
                str(tmp_path), fingerprint={"cfg": "other"})


def test_sharded_step_equals_single_device(tmp_path):
    """8 fake CPU devices, a 2 x 4 (data, fsdp) mesh, versus one device: same parameters after 3 steps."""
    script = textwrap.dedent(f"""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax, numpy as np
        from jspec.models import transformer
        from jspec.models.config import ModelConfig
        from jspec import parallel
        from jspec.train import data, lm
        from jspec.train.trainer import TrainConfig, Trainer, TrainingDiverged
        cfg = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True)
        windows = np.random.default_rng(0).integers(0, 64, size=(64, 17)).astype(np.int32)
        ds = data.batches(windows, 8, seed=1)
        tc = TrainConfig(steps=3, lr=1e-2, ckpt_every=100, log_every=1)
        loss = lambda p, b: lm.lm_loss(p, cfg, b)
        single = Trainer(loss, transformer.init_params(cfg, jax.random.key(0)), tc, "{tmp_path}/single", {{"m": 1}})
        single.run(ds, progress=False)
        mesh = parallel.make_mesh(data=2, fsdp=4)
        params = parallel.shard_params(transformer.init_params(cfg, jax.random.key(0)), mesh,
                                       axes=parallel.target_axes(cfg))
        split = lambda p: any(not x.sharding.is_fully_replicated for x in jax.tree_util.tree_leaves(p))
        assert split(params)
        multi = Trainer(loss, params, tc, "{tmp_path}/multi", {{"m": 8}}, sharding=parallel.global_batch(mesh))
        multi.run(ds, progress=False)
        assert split(multi.state.params)
        diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
                   zip(jax.tree_util.tree_leaves(single.state.params), jax.tree_util.tree_leaves(multi.state.params)))
        print("maxdiff", diff)
        assert diff < 1e-5, diff
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "maxdiff" in out.stdout


def test_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.corpus_files(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no files matching"):
        data.corpus_files(str(tmp_path / "empty"))


def test_drafter_taps_must_fit_the_target(target):
    from jspec.train import distill

    cfg = {"drafter": {"num_layers": 1, "block_size": 4, "target_layer_ids": [0, 2], "mask_token_id": 63},
           "train": {"seed": 0}}
    with pytest.raises(ValueError, match="never the last layer"):  # refused before any distillation
        distill.build_drafter("dflash", cfg, target)


def test_self_distillation_dataset_round_trip(target, tmp_path):
    from jspec.train import distill

    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9]]
    path = distill.self_distill(target, prompts, new_tokens=6, batch=1, seed=0, out_path=str(tmp_path / "d.npz"))
    ds_dir = data.build_token_dataset({"train": path}, str(tmp_path / "tfds"))
    examples = data.read_split(ds_dir, "train")
    greedy = jspec.generate(target, [prompts[0]], max_new_tokens=6, eos_ids=[])
    assert list(examples[0]["tokens"]) == prompts[0] + greedy.tokens[0]  # batch 0 is greedy
    arrays = data.padded_examples(examples, 12)
    np.testing.assert_array_equal(arrays["loss_mask"][1], [0] * 5 + [1] * 6 + [0])
