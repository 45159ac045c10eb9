"""D-Loop and DEdit (jspec.drafters.refine): exactness of the q they report by exact enumeration on a tiny
vocabulary (with the hidden draws of discarded passes enumerated too, and controls showing the pass-1
rows would not do), the rows of each pass against a direct evaluation, greedy and Gumbel equality with
plain decoding in the loop, every rule running, the checkpoint section, and training."""

from __future__ import annotations

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters import dflash, refine
from jspec.drafters.base import draft_noise
from jspec.drafters.refine import DEdit, PrefixLoop
from jspec.io.hf import CheckpointError
from jspec.train.drafter import DrafterLoss
from jspec.verify import exact, rules
from jspec.verify.chain import block_chain_from_coins, speculative_chain_from_coins
from jspec.verify.sampling import SamplingParams
from test_dflash_config import target  # noqa: F401 (the shared fixture)
from test_dloop import _state

COIN_RULES = {"speculative": speculative_chain_from_coins, "block": block_chain_from_coins}
TOL = 1e-6


# --- exactness by enumeration (V = 3) ----------------------------------------------------------------


def _dirichlet(rng, *shape):
    return rng.dirichlet(np.full(shape[-1], 0.7), size=shape[:-1])


def _error(outputs, tables, g):
    completed = exact.completed_distribution(outputs, tables, g + 1)
    return np.abs(completed - exact.target_joint(tables, g + 1)).max()


def _prefix_loop_proposals(rng, vocab, g, boundaries, rows_of_pass_one=False):
    """Every D-Loop proposal of a toy drafter: pass m's row for slot k depends on the drafts it reveals
    (y_1 .. y_{j_m}); slot k is drawn by the pass after the last boundary below it. Returns drafts, their
    probabilities and the rows reported (or, for the control, pass 1's rows)."""
    ends = (0,) + boundaries
    rows = [_dirichlet(rng, vocab ** j, g, vocab) for j in ends]  # rows[m][code(y_1..y_jm), k]
    drafts = np.array(list(itertools.product(range(vocab), repeat=g)))
    prob, reported = np.ones(len(drafts)), np.zeros((len(drafts), g, vocab))
    for i, y in enumerate(drafts):
        for k in range(g):
            m = sum(j <= k for j in boundaries)
            row = rows[m][exact.code(y[:ends[m]], vocab), k]
            prob[i] *= row[y[k]]
            reported[i, k] = rows[0][0, k] if rows_of_pass_one else row
    return drafts, prob, np.log(reported)


def _dedit_proposals(rng, vocab, g, passes, rows_of_pass_one=False):
    """Every DEdit proposal with its hidden earlier passes: pass 1 drafts y^0 ~ rows_0, edit pass e draws
    y^e slot-wise from rows_e(y^{e-1}); the proposal is y^E with rows_E(y^{E-1}) (one entry per history)."""
    first = _dirichlet(rng, g, vocab)
    edits = [_dirichlet(rng, vocab ** g, g, vocab) for _ in range(passes)]
    seqs = list(itertools.product(range(vocab), repeat=g))
    drafts, prob, reported = [], [], []
    for history in itertools.product(seqs, repeat=passes + 1):
        p = np.prod([first[k, history[0][k]] for k in range(g)])
        for e in range(passes):
            row = edits[e][exact.code(history[e], vocab)]
            p *= np.prod([row[k, history[e + 1][k]] for k in range(g)])
        drafts.append(history[-1])
        prob.append(p)
        reported.append(first if rows_of_pass_one else edits[-1][exact.code(history[-2], vocab)])
    return np.array(drafts), np.array(prob), np.log(np.array(reported))


@pytest.mark.parametrize("rule", sorted(COIN_RULES))
@pytest.mark.parametrize("g, boundaries", [(2, (1,)), (3, (1,)), (3, (2,)), (3, (1, 2))])
def test_prefix_loop_reports_an_exact_q(rule, g, boundaries):
    """Verified with the rows D-Loop reports (pass-1 rows for kept drafts, the regenerating pass's rows
    after a boundary), the output completed by the target has the target's joint distribution, exactly;
    reporting pass 1's rows for the regenerated drafts is not exact (the control)."""
    rng = np.random.default_rng([g, *boundaries])
    for family in ("dirichlet", "sparse"):
        tables = exact.random_tables(rng, 3, g + 1, family)
        drafts, prob, rows = _prefix_loop_proposals(rng, 3, g, boundaries)
        assert abs(prob.sum() - 1) < 1e-9
        assert _error(exact.proposal_outputs(COIN_RULES[rule], tables, drafts, prob, rows), tables, g) < TOL
    drafts, prob, rows = _prefix_loop_proposals(np.random.default_rng(1), 3, g, boundaries, rows_of_pass_one=True)
    tables = exact.random_tables(np.random.default_rng(2), 3, g + 1, "dirichlet")
    assert _error(exact.proposal_outputs(COIN_RULES[rule], tables, drafts, prob, rows), tables, g) > 1e-3


@pytest.mark.parametrize("rule", sorted(COIN_RULES))
@pytest.mark.parametrize("g, passes", [(2, 1), (3, 1), (2, 2)])
def test_dedit_reports_an_exact_q(rule, g, passes):
    """DEdit's proposal is a mixture over the earlier passes' drafts; verified with the last pass's rows
    given the previous pass's drafts (one enumeration entry per hidden history), the output is exact, and
    with pass 1's rows it is not."""
    rng = np.random.default_rng([g, passes, 7])
    for family in ("dirichlet", "sparse"):
        tables = exact.random_tables(rng, 3, g + 1, family)
        drafts, prob, rows = _dedit_proposals(rng, 3, g, passes)
        assert abs(prob.sum() - 1) < 1e-9
        assert _error(exact.proposal_outputs(COIN_RULES[rule], tables, drafts, prob, rows), tables, g) < TOL
    drafts, prob, rows = _dedit_proposals(np.random.default_rng(3), 3, g, passes, rows_of_pass_one=True)
    tables = exact.random_tables(np.random.default_rng(4), 3, g + 1, "dirichlet")
    assert _error(exact.proposal_outputs(COIN_RULES[rule], tables, drafts, prob, rows), tables, g) > 1e-3


def test_each_pass_draws_from_its_own_noise_stream():
    seeds, index, start = jnp.arange(2, dtype=jnp.uint32), jnp.array([[5, 6], [9, 10]]), jnp.array([5, 9])
    base = draft_noise(seeds, index, start, 16)
    assert np.array_equal(base, draft_noise(seeds, index, start, 16, 0))  # stream 0 is the single-pass noise
    one, two = draft_noise(seeds, index, start, 16, 1), draft_noise(seeds, index, start, 16, 2)
    assert not np.allclose(base, one) and not np.allclose(one, two)


# --- the passes in the model ------------------------------------------------------------------------

BLOCK = 5  # 4 drafts


@pytest.fixture(scope="module")
def backbone(target):
    run = {"drafter": {"num_layers": 2, "block_size": BLOCK, "mask_token_id": 100, "num_taps": 2}, "init_std": 0.3}
    return dflash._build(run, target, jax.random.key(0))


def _served_rows(cfg, params, state, ctx, drafts, revealed):
    """A pass's served log-probs computed directly: the DFlash block over [anchor, y_1 .. y_j, mask ..]."""
    anchor = ctx.tokens[:, 9]
    inputs = jnp.concatenate([anchor[:, None], jnp.where(jnp.arange(1, BLOCK) <= revealed, drafts,
                                                        cfg.mask_token_id)], axis=1)
    hidden = dflash.draft_block(params, cfg, ctx.target_params["embed"], state.k, state.v,
                                anchor, ctx.length - 1, block_tokens=inputs)
    return jax.nn.log_softmax(dflash.draft_logits(ctx.target_params, ctx.target_cfg, cfg, hidden[:, 1:]), axis=-1)


def test_prefix_loop_rows_are_the_passes_that_drew_each_draft(target, backbone):
    inner, params = backbone
    dr = PrefixLoop(inner=inner, boundaries=(1, 3))
    state, ctx = _state(target, inner, params, batch=2)
    prop, _ = dr.propose(params, state, ctx)
    y, q = prop.tokens, prop.q_logp
    np.testing.assert_allclose(q[:, :1], _served_rows(inner.cfg, params, state, ctx, y, 0)[:, :1], atol=1e-5)
    np.testing.assert_allclose(q[:, 1:3], _served_rows(inner.cfg, params, state, ctx, y, 1)[:, 1:3], atol=1e-5)
    np.testing.assert_allclose(q[:, 3:], _served_rows(inner.cfg, params, state, ctx, y, 3)[:, 3:], atol=1e-5)
    # Pass 1 alone is DFlash's own proposal, noise included.
    plain, _ = inner.propose(params, state, ctx)
    assert np.array_equal(prop.tokens[:, :1], plain.tokens[:, :1])


def test_dedit_rows_are_the_last_pass_given_the_previous_drafts(target, backbone):
    inner, params = backbone
    state, ctx = _state(target, inner, params, batch=2)
    one, _ = DEdit(inner=inner, edit_passes=1).propose(params, state, ctx)
    two, _ = DEdit(inner=inner, edit_passes=2).propose(params, state, ctx)
    first, _ = inner.propose(params, state, ctx)
    np.testing.assert_allclose(one.q_logp, _served_rows(inner.cfg, params, state, ctx,
                                                        first.tokens, BLOCK), atol=1e-5)
    np.testing.assert_allclose(two.q_logp, _served_rows(inner.cfg, params, state, ctx, one.tokens, BLOCK),
                               atol=1e-5)
    assert not np.array_equal(one.tokens, first.tokens)  # the edit pass redraws (own noise, new rows)


PROMPTS = [[5, 9, 17, 3, 44, 5, 9], [7, 8, 7, 8, 7, 8, 7, 8, 7], [11, 12, 13, 14]]


@pytest.mark.parametrize("make", [lambda i: PrefixLoop(inner=i, boundaries=(1, 2)), lambda i: DEdit(inner=i, edit_passes=2)],
                         ids=["d-loop", "dedit"])
def test_in_the_loop(target, backbone, make):
    """Greedy and Gumbel-coupled text equal plain decoding's; every registered rule runs with finite
    log-probs."""
    inner, params = backbone
    dr = make(inner)
    kw = dict(max_new_tokens=14, seeds=[3, 4, 5], eos_ids=[])
    for temperature, verifier in ((0.0, "greedy"), (1.0, "gumbel")):
        plain = jspec.generate(target, PROMPTS, sampling=SamplingParams(temperature), **kw)
        spec = jspec.generate(target, PROMPTS, sampling=SamplingParams(temperature), drafter=(dr, params),
                              verifier=verifier, **kw)
        assert spec.stats["rounds"] > 0 and spec.tokens == plain.tokens, verifier
    for name, rule in rules.RULES.items():
        res = jspec.generate(target, PROMPTS, sampling=SamplingParams(0.0 if rule.greedy_only else 1.0),
                             drafter=(dr, params), verifier=name, **kw)
        assert [len(t) for t in res.tokens] == [14] * 3 and all(np.isfinite(lp).all() for lp in res.logprobs), name


# --- settings, checkpoints, training ----------------------------------------------------------------


def test_bad_settings_are_refused(backbone, target):
    inner, _ = backbone
    for bad in ((), (0,), (4,), (2, 1), (1, 1), (1.5,)):
        with pytest.raises(ValueError, match="boundaries must be increasing ints in 1 .. 3"):
            PrefixLoop(inner=inner, boundaries=bad)
    with pytest.raises(ValueError, match="edit_passes must be an int >= 1"):
        DEdit(inner=inner, edit_passes=0)
    with pytest.raises(ValueError, match="without a tree budget"):
        DEdit(inner=dflash.with_shape(inner, 0, 6))
    from jspec.drafters import dflash2
    d2, _ = dflash2._example(target)
    with pytest.raises(ValueError, match="plain DFlash block drafter, not DFlash2"):
        PrefixLoop(inner=d2)


def test_checkpoint_section(target, backbone, tmp_path):
    inner, params = backbone
    dr = PrefixLoop(inner=inner, boundaries=(1, 3))
    path = str(tmp_path / "d")
    jspec.drafters.get_family("d-loop").save(path, dr, params)
    hf = json.load(open(f"{path}/config.json"))
    assert hf["d_loop_config"] == {"boundaries": [1, 3]}
    loaded, _ = jspec.drafters.family.detect(path).load(path, target, jnp.float32)
    assert loaded == dr
    for bad, match in (({"boundaries": [1], "x": 1}, "must hold exactly"), ({"boundaries": [5]}, "boundaries must be")):
        json.dump(dict(hf, d_loop_config=bad), open(f"{path}/config.json", "w"))
        with pytest.raises(CheckpointError, match=match):
            jspec.drafters.get_family("d-loop").load(path, target, jnp.float32)


@pytest.mark.parametrize("family", ["d-loop", "dedit"])
def test_training_reaches_the_backbone(target, family):
    fam = jspec.drafters.get_family(family)
    run = {"drafter": {"num_layers": 1, "block_size": BLOCK, "mask_token_id": 100, "num_taps": 2,
                       **({"boundaries": [2]} if family == "d-loop" else {"edit_passes": 1})}, "init_std": 0.3}
    drafter, params = fam.recipe.build(run, target, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 3, target.cfg.vocab_size)
    batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens).at[:, :4].set(0)}
    loss_fn = lambda p: fam.recipe.loss(p, target.params, target.cfg, drafter, DrafterLoss(num_anchors=4), batch,
                                        jax.random.key(2))
    (loss, _), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    assert np.isfinite(loss) and float(jnp.abs(grads["fc"]).max()) > 0
    with pytest.raises(ValueError, match="only slot-wise losses"):
        fam.recipe.loss(params, target.params, target.cfg, drafter, DrafterLoss(name="bv", num_anchors=4), batch,
                        jax.random.key(2))


def test_command_line(target, backbone, tmp_path, capsys):
    """`jspec generate --redraft-after` / `--edit-passes` wrap a DFlash folder; greedy text is plain greedy's;
    the re-drafting flags exclude each other."""
    from jspec.cli import main as cli_main

    inner, params = backbone
    jspec.drafters.get_family("dflash").save(str(tmp_path / "plain"), inner, params)
    plain = jspec.generate(target, PROMPTS[:1], max_new_tokens=12, eos_ids=[]).tokens[0]
    args = ["generate", "--target", target.path, "--drafter", str(tmp_path / "plain"), "--prompt-ids",
            ",".join(map(str, PROMPTS[0])), "--max-new-tokens", "12", "--json"]
    for extra in (["--redraft-after", "1,3"], ["--edit-passes", "2"]):
        assert cli_main(args + extra) in (0, None)
        assert json.loads(capsys.readouterr().out)["tokens"] == plain, extra
    assert cli_main(args + ["--edit-passes", "1", "--loop-stages", "2"]) == 2
    assert "--loop-stages and --edit-passes each re-draft the block" in capsys.readouterr().err
    assert cli_main(args + ["--redraft-after", "1;2"]) == 2
    assert "--redraft-after takes comma-separated ints" in capsys.readouterr().err
