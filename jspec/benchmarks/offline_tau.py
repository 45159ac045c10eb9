"""The offline round evaluator (jspec.train.evaluate) against the compiled loop's measured tau.

    python -m jspec.benchmarks.offline_tau [--prompts 128] [--new-tokens 128] [--drafter builtin:code-dflash]

Prompts are cut from held-out standard-library files (as jspec.benchmarks.tau_table); EOS is off, so
every row commits new_tokens - 1 tokens after the prefill's. Per rule (greedy at T = 0, speculative
sampling and block verification at T = 1) the loop runs once (tau = committed tokens / rounds, pooled),
and the evaluator computes, without a decode loop:
- "own texts": E[rounds | text] on the loop's own texts (exact given the text). The loop's rounds
  differ from it only by the loop's coins: z = (loop - offline) / sqrt(sum Var[rounds | text]).
  Greedy: the rounds must be equal.
- "rollouts" (T = 1): E[rounds | text] on independent target rollouts (plain decoding at T = 1,
  other seeds), the offline use case; its mean over rollouts is the loop's expected rounds. The
  standard error (se) of loop - offline combines both sides' row-to-row spread; "alpha chain" is the
  acceptance-rate approximation prod alpha (speculative only) on the same rollouts.

Measured with code-dflash (7 drafts), 128 new tokens, on the shared 2-core CPU: 128 prompts (the
default, 280 s): greedy rounds equal; T = 1 loop - offline on rollouts +0.64% (speculative, se 0.90%)
and +1.46% (block, se 1.03%), own texts z = -0.79 and -0.90. 512 prompts (--seed 1, 794 s): +0.11%
(se 0.42%) and +0.14% (se 0.48%), z = +0.27 and -1.73.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import jspec
from jspec.benchmarks.tau_table import held_out_prompts
from jspec.train import evaluate
from jspec.verify.sampling import SamplingParams


def _loop(target, prompts, new_tokens, sampling, verifier, drafter, seed):
    return jspec.generate(target, prompts, max_new_tokens=new_tokens, sampling=sampling, seeds=seed, eos_ids=[],
                          drafter=drafter, verifier=verifier)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="builtin:code-target")
    ap.add_argument("--drafter", default="builtin:code-dflash")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    target = jspec.load_target(args.target)
    drafter, dparams = jspec.load_drafter(args.drafter, target)
    prompts = held_out_prompts(target, args.prompts, args.prompt_len)
    n = len(prompts)
    committed = n * (args.new_tokens - 1)
    hot, t1 = SamplingParams(0.0), SamplingParams(1.0)
    print(f"{n} held-out prompts x {args.new_tokens} new tokens, {args.target} + {args.drafter} "
          f"({drafter.num_drafts} drafts per round), EOS off")
    print("| rule | texts | loop tau | offline tau | loop - offline | check |")
    print("| --- | --- | --- | --- | --- | --- |")

    res = _loop(target, prompts, args.new_tokens, hot, "greedy", (drafter, dparams), args.seed)
    stats = evaluate.rollout_stats(target, drafter, dparams, prompts, res.tokens, hot)
    rounds = int(evaluate.greedy_rounds(stats).sum())
    loop_tau = res.stats["tau"]
    print(f"| greedy | own | {loop_tau:.4f} | {committed / rounds:.4f} | {res.stats['rounds'] - rounds} rounds | "
          f"{'equal' if rounds == res.stats['rounds'] else 'DIFFERENT'} |")

    # Independent target rollouts at T = 1 (plain decoding, seeds after the loops' ones).
    ar = jspec.generate(target, prompts, max_new_tokens=args.new_tokens, sampling=t1, seeds=args.seed + 2 * n,
                        eos_ids=[])
    rollout_stats = evaluate.rollout_stats(target, drafter, dparams, prompts, ar.tokens, t1)
    for rule, seed in (("speculative", args.seed), ("block", args.seed + n)):
        res = _loop(target, prompts, args.new_tokens, t1, rule, (drafter, dparams), seed)
        loop_rounds, loop_tau = res.stats["rounds"], res.stats["tau"]
        own = evaluate.offline_tau(rule, evaluate.rollout_stats(target, drafter, dparams, prompts, res.tokens, t1))
        sd = float(np.sqrt(own["variance"].sum()))
        z = (loop_rounds - own["rounds"].sum()) / sd
        print(f"| {rule} | own | {loop_tau:.4f} | {own['tau']:.4f} | {_rel(loop_tau, own['tau'])} | "
              f"z = {z:+.2f} |")
        # Row-to-row variance of the loop's rounds: spread of E[rounds | text] plus the coins' variance.
        loop_var = n * (np.var(own["rounds"], ddof=1) + own["variance"].mean())
        off = evaluate.offline_tau(rule, rollout_stats)
        off_var = n * np.var(off["rounds"], ddof=1)
        se = np.sqrt(loop_var + off_var) / off["rounds"].sum()  # relative se of the rounds' ratio
        print(f"| {rule} | rollouts | {loop_tau:.4f} | {off['tau']:.4f} | {_rel(loop_tau, off['tau'])} | "
              f"se {100 * se:.2f}% |")
        if rule == "speculative":
            approx = evaluate.offline_tau(rule, rollout_stats, given_text=False)
            print(f"| speculative, alpha chain | rollouts | {loop_tau:.4f} | {approx['tau']:.4f} | "
                  f"{_rel(loop_tau, approx['tau'])} | approximation |")
    print(f"{time.perf_counter() - start:.0f} s")


def _rel(measured: float, offline: float) -> str:
    return f"{100 * (measured - offline) / offline:+.2f}%"


if __name__ == "__main__":
    main()
