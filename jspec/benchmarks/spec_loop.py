"""Speculative vs plain autoregressive decoding on a small random-weight model, side by side.

    python -m jspec.benchmarks.spec_loop [--new-tokens 128] [--repeats 5]

For each drafter it prints tau (committed tokens per round, pooled), the wall speedup of the whole
compiled generation over plain AR (same weights, prompt, cache machinery, one process; prefill
included in both), the time per round, and the verify pass and drafter proposal timed separately
inside compiled loops of 64 calls on the same shapes (no dispatch cost); loop overhead = round - (verify + draft), as a share of the round.
All times are medians of repeats. The weights are random: acceptance reflects that (a random model
falls into loops that prompt lookup predicts well); "self" drafts with the target itself, an upper
bound on acceptance at the full cost of a target-sized drafter.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from jspec.decode import ar, spec
from jspec.decode.profile import median_seconds
from jspec.demo import DEMO_CONFIG
from jspec.drafters.base import DraftContext
from jspec.drafters.lm import SmallLM
from jspec.drafters.lookup import PromptLookup
from jspec.models import transformer
from jspec.models.transformer import init_params
from jspec.verify.sampling import SamplingParams


INNER = 64  # component timings run INNER times inside one compiled fori_loop, so no dispatch cost is counted


def _in_loop(step):
    """A jitted f(weights, carry) running `carry = step(weights, carry)` INNER times; time it and divide
    by INNER. The weights are arguments, so they are not folded into the program as constants."""
    return jax.jit(lambda w, c: jax.lax.fori_loop(0, INNER, lambda i, x: step(w, x), c))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    cfg = DEMO_CONFIG
    params = init_params(cfg, jax.random.key(0), std=0.05)
    small_cfg = dataclasses.replace(cfg, num_layers=1, layer_types=())
    small_params = init_params(small_cfg, jax.random.key(1), std=0.05)
    sampling = SamplingParams(0.0)
    dcfg = ar.DecodeConfig(max_new_tokens=args.new_tokens, cache_size=256, sampling=sampling)
    prompt = jnp.asarray([[17, 4, 99, 250, 31, 8, 17, 4, 99, 250, 31, 8, 5, 6, 7, 3]], jnp.int32)
    plen, seeds = jnp.array([16], jnp.int32), jnp.array([0], jnp.uint32)

    ar_time = median_seconds(lambda: ar.generate_ar(params, cfg, dcfg, prompt, plen, seeds).tokens, repeats=args.repeats)
    ar_out = ar.generate_ar(params, cfg, dcfg, prompt, plen, seeds)
    print(f"target: {cfg.num_params / 1e6:.2f}M parameters (random weights), batch 1, {args.new_tokens} new tokens, "
          f"greedy, {jax.devices()[0].platform}; medians of {args.repeats}")
    print(f"plain AR: {1e3 * ar_time:.1f} ms total, {1e3 * ar_time / args.new_tokens:.3f} ms/token\n")
    header = f"{'drafter':22s} {'tau':>5s} {'speedup':>8s} {'round ms':>9s} {'verify ms':>10s} {'draft ms':>9s} {'overhead':>9s}"
    print(header)
    print("-" * len(header))

    drafters = [
        ("lookup g=4", PromptLookup(block_size=4, vocab_size=cfg.vocab_size), ()),
        ("lookup g=8", PromptLookup(block_size=8, vocab_size=cfg.vocab_size), ()),
        ("lookup tree N=8", PromptLookup(tree_budget=8, branches=2, vocab_size=cfg.vocab_size), ()),
        ("small LM (1 layer) g=4", SmallLM(cfg=small_cfg, block_size=4), small_params),
        ("self g=4 (upper bound)", SmallLM(cfg=cfg, block_size=4), params),
    ]
    for name, drafter, dparams in drafters:
        scfg = spec.SpecConfig(dcfg, "greedy")
        run = lambda: spec.generate_spec(params, dparams, cfg, drafter, scfg, prompt, plen, seeds)
        total = median_seconds(lambda: run().core.tokens, repeats=args.repeats)
        st = run()
        assert bool(jnp.all(st.core.tokens == ar_out.tokens)), f"{name}: output differs from plain AR"
        rounds = int(st.stats.loop_rounds)
        tau = float(st.stats.committed.sum()) / float(st.stats.rounds.sum())

        # Components on the state the loop starts from (its own set-up, spec.start), jitted separately.
        width = drafter.num_drafts + 1
        setup = jax.jit(spec.start, static_argnums=(2, 3, 4))
        first = setup(params, dparams, cfg, drafter, dcfg, prompt, plen, seeds)
        core, dstate = first.core, first.draft
        prefill_t = median_seconds(lambda: setup(params, dparams, cfg, drafter, dcfg, prompt, plen, seeds).core.tokens,
                                   repeats=args.repeats)
        ctx = DraftContext(core.tokens, core.length, core.seeds, params, target_cfg=cfg, sampling=dcfg.sampling)

        def draft_step(w, carry):  # the drafted tokens feed the next call, so nothing is optimised away
            dstate, acc = carry
            dp, tp = w
            c = dataclasses.replace(ctx, seeds=ctx.seeds + acc[:1], target_params=tp)
            prop, dstate = drafter.propose(dp, dstate, c)
            return dstate, acc + prop.tokens[:, 0].astype(jnp.uint32)

        draft_loop = _in_loop(draft_step)
        draft_t = median_seconds(lambda: draft_loop((dparams, params), (dstate, jnp.zeros((1,), jnp.uint32)))[1],
                                 repeats=args.repeats) / INNER
        vt = jnp.zeros((1, width), jnp.int32)
        pos = core.length[:, None] - 1 + jnp.arange(width)[None]
        mask = jnp.broadcast_to(jnp.eye(width, dtype=bool), (1, width, width)) if drafter.kind == "tree" else None

        def verify_step(w, carry):  # each pass verifies the previous pass's argmax tokens
            cache, tokens = carry
            out = transformer.forward(w, cfg, tokens, pos, cache, ctx_len=core.length - 1, cache_rows=pos,
                                      tree_mask=mask)
            return out.cache, jnp.argmax(transformer.logits(w, cfg, out.hidden), axis=-1).astype(jnp.int32)

        verify_loop = _in_loop(verify_step)
        verify_t = median_seconds(lambda: verify_loop(params, (core.cache, vt))[1], repeats=args.repeats) / INNER
        round_t = (total - prefill_t) / rounds
        overhead = (round_t - verify_t - draft_t) / round_t
        print(f"{name:22s} {tau:5.2f} {ar_time / total:7.2f}x {1e3 * round_t:9.3f} {1e3 * verify_t:10.3f} "
              f"{1e3 * draft_t:9.3f} {100 * overhead:8.1f}%")


if __name__ == "__main__":
    main()
