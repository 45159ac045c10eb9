"""DLoop: stages drafted while the drafter is confident, verified in one pass. Exactness in the loop
(greedy and Gumbel text equal plain decoding; every rule runs with the stage count a stopping time in
the family's conformance checks, tests/test_conformance.py, and its exactness by enumeration is in
tests/test_verify_chain_exact.py), the gate, the provisional features, and the stage count reported
per row."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters import dflash, dflash2, dspark
from jspec.drafters.base import SAMPLE, DraftContext
from jspec.drafters.dflash import DFlash, DFlashState, write_context
from jspec.drafters.dloop import DLoop
from jspec.verify.sampling import SamplingParams

PROMPTS = [[5, 9, 17, 3, 44, 5, 9], [7, 8, 7, 8, 7, 8, 7, 8, 7], [11, 12, 13, 14]]
NEW = 18


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from conftest import make_hf_model

    path = tmp_path_factory.mktemp("target")
    make_hf_model("qwen3", layers=4, seed=5).save_pretrained(path)
    return jspec.load_target(str(path))


def _run(drafter, layers=2, block=4):
    return {"drafter": {"num_layers": layers, "block_size": block, "mask_token_id": 100, "num_taps": 2,
                        **drafter}, "init_std": 0.3}


@pytest.fixture(scope="module")
def inners(target):
    """A DFlash, a DFlash2 (random convolutions and selector) and a DSpark drafter, 3 drafts a stage."""
    out = {"dflash": dflash._build(_run({}), target, jax.random.key(0))}
    d2, p2 = dflash2._build(_run(dict(selector_rank=8, selector_top_k=4)), target, jax.random.key(1))
    keys = iter(jax.random.split(jax.random.key(2), 64))
    noisy = lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype)
    out["dflash2"] = d2, dict(p2, convs=jax.tree_util.tree_map(noisy, p2["convs"]),
                              selector=dict(p2["selector"], succ=noisy(p2["selector"]["succ"])))
    out["dspark"] = dspark._build(_run(dict(markov_rank=8, markov_head_type="gated"), block=3), target,
                                  jax.random.key(3))
    return out


def _generate(target, drafter, sampling, verifier=None, prompts=PROMPTS):
    return jspec.generate(target, prompts, max_new_tokens=NEW, sampling=sampling, seeds=[3, 4, 5][:len(prompts)],
                          eos_ids=[], drafter=drafter, verifier=verifier)


@pytest.mark.parametrize("name", ["dflash", "dflash2", "dspark"])
def test_text_equals_plain_decoding(target, inners, name):
    """Greedy and Gumbel-coupled text equals plain decoding's with 1..3 stages; the gate at -inf always
    loops (every round verifies S g drafts), at +inf never (one stage). The gate's extremes, which do not
    depend on the backbone or the rule, run over DFlash only, one rule each, and a data-dependent gate over
    the other backbones, both rules (each setting is a compile of its own; DFlash with a data-dependent
    gate, in chains and trees, is the family's conformance example, tests/test_conformance.py)."""
    inner, params = inners[name]
    plain = {t: _generate(target, None, SamplingParams(t)).tokens for t in (0.0, 1.0)}
    runs = ([(3, -1e9, 0.0), (2, 1e9, 1.0)] if name == "dflash"
            else [(3, -3.0, 0.0), (3, -3.0, 1.0)])  # (stages, threshold, temperature)
    for stages, threshold, t in runs:
        res = _generate(target, (DLoop(inner=inner, stages=stages, threshold=threshold), params), SamplingParams(t))
        assert res.tokens == plain[t], (name, stages, threshold, t)
        if threshold < -1e8:
            assert res.stats["verified"] == stages * inner.num_drafts * res.stats["rounds"]
        if threshold > 1e8:
            assert res.stats["verified"] == inner.num_drafts * res.stats["rounds"]


def _state(target, inner, params, batch=1, context=9):
    cfg = inner.cfg
    taps = jax.random.normal(jax.random.key(7), (2, batch, context, target.cfg.hidden_size))
    state = DFlashState.zeros(cfg, batch, 40, jnp.float32)
    state = write_context(params, cfg, state, taps, jnp.zeros((batch,), jnp.int32), jnp.ones((batch, context), bool))
    tokens = jnp.zeros((batch, 40), jnp.int32).at[:, context].set(7)
    ctx = DraftContext(tokens, jnp.full((batch,), context + 1), jnp.arange(batch, dtype=jnp.uint32), target.params,
                       target_cfg=target.cfg, policy=SAMPLE, sampling=SamplingParams(1.0))
    return state, ctx


def test_second_stage_is_the_backbone_on_provisional_features(target, inners):
    """Stage 2 equals the backbone drafting after stage 1's last draft, its context extended by stage
    1's slot states at stage 1's positions; the stage count follows the gate per row."""
    inner, params = inners["dflash"]
    g = inner.num_drafts
    state, ctx = _state(target, inner, params, batch=2)
    prop, state_after = DLoop(inner=inner, stages=2, threshold=-1e9).propose(params, state, ctx)
    first, own, hidden, _ = inner.stage(params, state, ctx)
    np.testing.assert_array_equal(np.asarray(prop.tokens[:, :g]), np.asarray(first.tokens))
    manual = dflash.write_features(params, inner.cfg, state, hidden[:, :g], ctx.length - 1,
                                   jnp.ones((2, g), bool))
    text = ctx.tokens.at[:, ctx.length[0]:ctx.length[0] + g].set(first.tokens)
    second, _, _, _ = inner.stage(params, manual, dataclasses.replace(ctx, tokens=text, length=ctx.length + g,
                                                                     round_start=ctx.length))
    np.testing.assert_array_equal(np.asarray(prop.tokens[:, g:]), np.asarray(second.tokens))
    np.testing.assert_allclose(np.asarray(prop.q_logp[:, g:]), np.asarray(second.q_logp), rtol=1e-6, atol=1e-6)
    assert np.asarray(prop.length).tolist() == [2 * g, 2 * g]
    # The gate between the two: a row whose stage-1 score is below the threshold stops at g.
    score = np.asarray(jnp.sum(own, axis=-1))
    mid = float(np.mean(score))
    assert score[0] != score[1]
    gated, _ = DLoop(inner=inner, stages=2, threshold=mid).propose(params, state, ctx)
    assert np.asarray(gated.length).tolist() == [2 * g if s > mid else g for s in score]
    # The committed context rows (< the anchor) are untouched: provisional rows start at the anchor.
    for a, b in zip(state.k, state_after.k):
        np.testing.assert_array_equal(np.asarray(a)[:, :ctx.length[0] - 1], np.asarray(b)[:, :ctx.length[0] - 1])


def test_a_tree_is_one_ddtree_over_the_drafted_stages(target, inners):
    """With a tree budget every stage drafts its argmax chain, and the tree is DDTree's over the stages'
    per-slot marginals: stage 2's are the backbone's after stage 1's argmax chain, and a row whose gate
    closed gets no node deeper than its first stage."""
    from jspec.drafters import ddtree
    from jspec.verify.rules import GREEDY

    inner, params = inners["dflash"]
    g, budget = inner.num_drafts, 10
    state, ctx = _state(target, inner, params, batch=2)
    # A sharper head (the drafter's logits are the target's head on its states): deep paths outscore siblings.
    ctx = dataclasses.replace(ctx, target_params=dict(ctx.target_params, lm_head=20 * ctx.target_params["lm_head"]))
    greedy = dataclasses.replace(ctx, policy=GREEDY)
    first, own, hidden, m1 = inner.stage(params, state, greedy)
    manual = dflash.write_features(params, inner.cfg, state, hidden[:, :g], ctx.length - 1, jnp.ones((2, g), bool))
    text = ctx.tokens.at[:, ctx.length[0]:ctx.length[0] + g].set(first.tokens)
    _, _, _, m2 = inner.stage(params, manual, dataclasses.replace(greedy, tokens=text, length=ctx.length + g,
                                                                  round_start=ctx.length))
    score = np.asarray(jnp.sum(own, axis=-1))
    mid = float(np.mean(score))
    for threshold, opened in ((-1e9, [True, True]), (mid, [s > mid for s in score])):
        dr = DLoop(inner=inner, stages=2, threshold=threshold, tree_budget=budget)
        assert dr.kind == "tree" and dr.num_drafts == budget and dr.max_depth == min(budget, 2 * g)
        prop, _ = jax.jit(dr.propose)(params, state, ctx)  # ctx's policy (sampling) is overridden: argmax
        assert prop.q_logp is None and prop.length is None
        for b in range(2):
            logq = jnp.concatenate([m1[b], m2[b] if opened[b] else jnp.full_like(m2[b], -jnp.inf)], axis=0)
            want = ddtree.build_tree(jnp.where(jnp.isinf(logq), -jnp.inf, jax.nn.log_softmax(logq, -1)), budget)
            for got, exp in zip((prop.tokens[b], prop.parent[b], prop.depth[b]), want):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(exp))
            assert (int(np.max(prop.depth[b])) > g) == opened[b]
    assert not all(s > mid for s in score) and any(s > mid for s in score)
    from jspec.drafters import family  # --tree-budget N on a DLoop folder: the tree over the stages
    shaped = family.get_family("dloop").with_shape(DLoop(inner=inner, stages=2), None, budget)
    assert shaped == DLoop(inner=inner, stages=2, tree_budget=budget)


def test_trees_equal_plain_decoding(target, inners):
    """A DLoop tree (2 stages, the gate always open) in the loop: greedy and Gumbel-coupled text equal plain
    decoding's; speculative tree verification at T = 1 runs (deterministic children, finite log-probs)."""
    inner, params = inners["dflash"]
    dr = DLoop(inner=inner, stages=2, threshold=-1e9, tree_budget=8)
    sharp = dataclasses.replace(target, params=dict(target.params, lm_head=20 * target.params["lm_head"]))  # deep trees
    for t, verifier in ((0.0, "greedy"), (1.0, "gumbel")):
        res = _generate(sharp, (dr, params), SamplingParams(t), verifier=verifier)
        assert res.tokens == _generate(sharp, None, SamplingParams(t)).tokens, verifier
    res = _generate(sharp, (dr, params), SamplingParams(1.0), verifier="speculative")
    assert [len(t) for t in res.tokens] == [NEW] * len(PROMPTS)
    assert all(np.isfinite(lp).all() for lp in res.logprobs)


def test_bad_inner_drafters_are_refused(target, inners):
    inner, _ = inners["dflash"]
    with pytest.raises(ValueError, match="set DLoop's own tree_budget"):
        DLoop(inner=dataclasses.replace(inner, tree_budget=4))
    with pytest.raises(ValueError, match="tree_budget must be an int >= 0"):
        DLoop(inner=inner, tree_budget=-1)
    with pytest.raises(ValueError, match="stages must be an int >= 1"):
        DLoop(inner=inner, stages=0)
    from jspec.drafters.lookup import PromptLookup

    with pytest.raises(ValueError, match="block drafter"):
        DLoop(inner=PromptLookup())
    assert isinstance(inner, DFlash)


def test_folder_format_and_command_line(target, inners, tmp_path, capsys):
    """A DFlash2 folder with a dloop_config section loads as DLoop (the wrapping family wins detection);
    `jspec generate --loop-stages` wraps a plain folder the same way; both give plain greedy's text."""
    import json

    from jspec.cli import main as cli_main
    from jspec.drafters import family

    inner, params = inners["dflash2"]
    dr = DLoop(inner=inner, stages=3, threshold=-1.5)
    family.get_family("dloop").save(str(tmp_path / "loop"), dr, params)
    assert json.loads((tmp_path / "loop" / "config.json").read_text())["dloop_config"] == {"stages": 3,
                                                                                          "threshold": -1.5}
    loaded, _ = jspec.load_drafter(str(tmp_path / "loop"), target)
    assert loaded == dr
    family.get_family("dflash2").save(str(tmp_path / "plain"), inner, params)
    plain = _generate(target, None, SamplingParams(0.0), prompts=PROMPTS[:1]).tokens[0]
    assert _generate(target, str(tmp_path / "loop"), SamplingParams(0.0), prompts=PROMPTS[:1]).tokens[0] == plain
    args = ["generate", "--target", target.path, "--drafter", str(tmp_path / "plain"), "--prompt-ids",
            ",".join(map(str, PROMPTS[0])), "--max-new-tokens", str(NEW), "--json"]
    assert cli_main(args + ["--loop-stages", "3", "--loop-threshold", "-1.5"]) in (0, None)
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == plain
    assert cli_main(args + ["--loop-threshold", "-1.5"]) == 2
    assert "--loop-threshold gates DLoop stages" in capsys.readouterr().err


def test_loop_aware_training_unrolls_the_inference_stages(target, inners):
    """`jspec train dloop`: stage 2 of an anchor, unrolled in training on the text's token at a + g with the
    provisional features of stage 1, equals the inference path (the context cache written from the
    target's taps before a, then `write_features` of stage 1's slots, then the block at a + g); the loss
    sums the first and last stages and trains the backbone."""
    from jspec.drafters import dloop
    from jspec.drafters.base import GREEDY
    from jspec.train import drafter as train_drafter
    from jspec.train.drafter import DrafterLoss

    inner, params = inners["dflash"]
    dr = DLoop(inner=inner, stages=2, threshold=-2.0)
    g, t = inner.num_drafts, 24
    tokens = jax.random.randint(jax.random.key(3), (1, t), 3, target.cfg.vocab_size)
    taps, _ = train_drafter.target_pass(target.params, target.cfg, tokens, inner.taps)
    anchors = jnp.array([[5, 11]], jnp.int32)
    first, last = dloop.stage_logps(params, target.params, target.cfg, dr, tokens, taps, anchors)
    for j, a in enumerate([5, 11]):
        state = DFlashState.zeros(inner.cfg, 1, 40, jnp.float32)
        state = write_context(params, inner.cfg, state, taps, jnp.zeros((1,), jnp.int32), jnp.arange(t)[None] < a)
        text = jnp.zeros((1, 40), jnp.int32).at[:, :t].set(tokens)
        ctx = DraftContext(text, jnp.array([a + 1]), jnp.zeros((1,), jnp.uint32), target.params,
                           target_cfg=target.cfg, policy=GREEDY)
        hidden = inner.block_hidden(params, state, ctx)
        want1 = jax.nn.log_softmax(inner.logits(params, state, ctx), axis=-1)
        state = dflash.write_features(params, inner.cfg, state, hidden[:, :g], jnp.array([a]), jnp.ones((1, g), bool))
        ctx2 = dataclasses.replace(ctx, length=jnp.array([a + 1 + g]))
        want2 = jax.nn.log_softmax(inner.logits(params, state, ctx2), axis=-1)
        np.testing.assert_allclose(first[0, j], want1[0], atol=2e-5)
        np.testing.assert_allclose(last[0, j], want2[0], atol=2e-5)
    batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens).at[:, :4].set(0)}
    fn = lambda p: dloop.train_loss(p, target.params, target.cfg, dr, DrafterLoss(num_anchors=4), batch,
                                    jax.random.key(1))
    (loss, metrics), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(params)
    assert np.isfinite(loss) and "tau_last" in metrics and float(jnp.abs(grads["fc"]).max()) > 0
    built, _ = jspec.drafters.get_family("dloop").recipe.build(
        {"drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 100, "num_taps": 2, "stages": 3,
                     "threshold": -1.0}, "init_std": 0.3}, target, jax.random.key(0))
    assert built.stages == 3 and built.threshold == -1.0
