"""Training objectives side by side: the built-in DFlash fine-tuned with each loss, then held-out tau.

    python -m jspec.benchmarks.objectives [--steps 60] [--losses ce,kl,tv,lk_hybrid,bv,edr,dpace,opd]
                                          [--out /tmp/jspec-objectives] [--prompts 16] [--new-tokens 96]

Every run starts from the same checkpoint (builtin:code-dflash, trained with CE), takes the same number
of steps over the same self-distilled sequences (distilled once, shared by every run) with the same
anchors' random stream, and differs only in `drafter.loss`. tau = committed tokens per round on prompts
cut from held-out files (the validation split no model was trained on), pooled; greedy verification at
T = 0 and speculative sampling at T = 1. The row "start" is the checkpoint before fine-tuning.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import jspec
from jspec.benchmarks.tau_table import held_out_prompts
from jspec.api import resolve_path
from jspec.train import distill, lm
from jspec.verify.sampling import SamplingParams



def _tau(target, drafter, prompts, new_tokens) -> list[float]:
    out = []
    for sampling, verifier in ((SamplingParams(0.0), "greedy"), (SamplingParams(1.0), "speculative")):
        res = jspec.generate(target, prompts, max_new_tokens=new_tokens, sampling=sampling, seeds=0, eos_ids=[],
                             drafter=drafter, verifier=verifier)
        out.append(res.stats["tau"])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--losses", default="ce,kl,tv,lk_hybrid,bv,edr,dpace,opd")
    ap.add_argument("--out", default="/tmp/jspec-objectives")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--distill-prompts", type=int, default=512)
    ap.add_argument("--lr", type=float, default=5e-4)
    args = ap.parse_args(argv)
    with open(lm.resolve_config("builtin:code-dflash")) as f:
        base = json.load(f)
    base["distill"]["num_prompts"] = args.distill_prompts
    base["train"].update(steps=args.steps, lr=args.lr, ckpt_every=args.steps, log_every=max(1, args.steps // 4))
    target_dir = resolve_path("builtin:code-target")
    init = resolve_path("builtin:code-dflash")
    target = jspec.load_target(target_dir)
    prompts = held_out_prompts(target, args.prompts, 48)
    os.makedirs(args.out, exist_ok=True)
    rows = [("start (code-dflash)", _tau(target, init, prompts, args.new_tokens))]
    print(f"| {rows[0][0]} | {rows[0][1][0]:.2f} | {rows[0][1][1]:.2f} |", flush=True)
    shared = None
    for loss in args.losses.split(","):
        run_dir = os.path.join(args.out, loss)
        os.makedirs(run_dir, exist_ok=True)
        cfg = json.loads(json.dumps(base))
        cfg["drafter"]["loss"] = loss
        cfg_path = os.path.join(run_dir, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
        npz = os.path.join(run_dir, "distilled.npz")
        if shared is not None and not os.path.exists(npz):
            shutil.copy(shared, npz)
        model = distill.train_drafter("dflash", cfg_path, target_dir, run_dir, progress=False, init=init)
        shared = shared or npz
        rows.append((loss, _tau(target, model, prompts, args.new_tokens)))
        print(f"| {loss} | {rows[-1][1][0]:.2f} | {rows[-1][1][1]:.2f} |", flush=True)
    print(f"\n{len(prompts)} held-out prompts x {args.new_tokens} new tokens; {args.steps} fine-tuning steps from "
          f"builtin:code-dflash per loss (lr {args.lr}, {args.distill_prompts} distilled sequences)")
    print("| loss | tau greedy | tau T=1 (speculative) |")
    print("| --- | --- | --- |")
    for name, (g, s) in rows:
        print(f"| {name} | {g:.2f} | {s:.2f} |")


if __name__ == "__main__":
    main()
