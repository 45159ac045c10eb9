"""A ~0.5B-parameter target in affine Q4 group-64 against the same target in float32, on this CPU.

    python -m jspec.benchmarks.q4_cpu [--layers 20] [--repeats 5] [--max-width 32]

The target is `cpu_roofline`'s random Qwen3-shaped model (0.47B parameters at 20 layers, tied
embeddings); the Q4 form quantizes every matrix, the tied embedding / LM head included
(`quant.quantize_tree`, float32 scales and biases: 1/2 + 8/64 = 0.625 byte per parameter).
Printed, both measured in this one process, side by side:
- bytes one decode step must read (weights, the LM head included) and the optimized HLO's bytes
  accessed of one decode pass (XLA:CPU's cost analysis);
- plain AR ms/token (decode only: the difference of two generation lengths) and its ratio to each
  form's own weight-read bound at the measured read bandwidth;
- T(n)/T(1), n = 1..max-width: one verify pass over n tokens against one over 1 token;
- prompt-lookup speculative decoding at g = 4 and 8 over plain AR of the same form (greedy: the Q4
  output is checked equal to Q4 plain AR).
Medians of interleaved repeats; the machine is shared, so read the ratios.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jspec.benchmarks.cpu_roofline import PROMPT, interleaved, read_bandwidth, shape, step_weight_bytes
from jspec.decode import ar, profile, spec
from jspec.drafters.lookup import PromptLookup
from jspec.models import quant
from jspec.models import target as tm
from jspec.models.transformer import init_params
from jspec.verify.sampling import SamplingParams


def pass_hlo_bytes(params, cfg, cache_size: int) -> float:
    """Bytes accessed by one compiled single-token decode pass (XLA's cost analysis of the optimized HLO)."""
    cache = tm.init_cache(cfg, 1, cache_size, params["embed"].dtype)

    def step(params, cache, tokens, pos):
        hidden, cache, _, _ = tm.forward(params, cfg, tokens, pos, cache)
        return jnp.argmax(tm.logits(params, cfg, hidden), axis=-1), cache

    args = (params, cache, jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), 64, jnp.int32))
    cost = jax.jit(step, donate_argnums=(1,)).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("bytes accessed", float("nan")))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--short", type=int, default=8, help="new tokens of the shorter generation")
    ap.add_argument("--long", type=int, default=40, help="new tokens of the longer generation")
    ap.add_argument("--max-width", type=int, default=32)
    args = ap.parse_args(argv)

    cfg = shape(args.layers)
    forms = {"float32": init_params(cfg, jax.random.key(0), std=0.02)}
    forms["q4"] = quant.quantize_tree(forms["float32"], tm.declarations(cfg))
    bw = max(read_bandwidth(args.repeats).values())
    cache = 128
    weight = {k: step_weight_bytes(cfg, p) for k, p in forms.items()}
    print(f"target: random Qwen3-shaped, {cfg.num_params / 1e9:.3f}B parameters, {cfg.num_layers} layers; "
          f"read bandwidth {bw:.1f} GB/s")
    for k, p in forms.items():
        print(f"  {k:8s} one step reads {weight[k] / 1e9:.3f} GB of weights (bound {1e3 * weight[k] / (bw * 1e9):.1f} "
              f"ms); compiled decode pass accesses {pass_hlo_bytes(p, cfg, cache) / 1e9:.3f} GB")

    prompt = jnp.asarray([PROMPT], jnp.int32)
    plen, seeds = jnp.array([len(PROMPT)], jnp.int32), jnp.array([0], jnp.uint32)
    dcfgs = {n: ar.DecodeConfig(max_new_tokens=n, cache_size=cache, sampling=SamplingParams(0.0))
             for n in (args.short, args.long)}
    run_ar = {(k, n): (lambda p=p, d=d: ar.generate_ar(p, cfg, d, prompt, plen, seeds).tokens.block_until_ready())
              for k, p in forms.items() for n, d in dcfgs.items()}
    med = interleaved(run_ar, args.repeats)
    steps = args.long - args.short
    per_token = {k: (med[k, args.long] - med[k, args.short]) / steps for k in forms}
    for k in forms:
        print(f"AR {k:8s}: {1e3 * per_token[k]:.1f} ms/token = {per_token[k] * bw * 1e9 / weight[k]:.2f}x its "
              f"weight-read bound")
    print(f"AR float32 / q4 = {per_token['float32'] / per_token['q4']:.2f}x")

    for k, p in forms.items():
        t = {n: profile.verify_pass_seconds(p, cfg, 1, n - 1, 64, cache, repeats=3, inner=4)
             for n in range(1, args.max_width + 1)}
        print(f"T(n)/T(1) {k}, n = 1..{args.max_width} (T(1) {1e3 * t[1]:.1f} ms): "
              + " ".join(f"{t[n] / t[1]:.2f}" for n in t))

    dcfg = dcfgs[args.long]
    fns = {}
    for k, p in forms.items():
        base = ar.generate_ar(p, cfg, dcfg, prompt, plen, seeds)
        fns[k, "ar"] = run_ar[k, args.long]
        for g in (4, 8):
            drafter = PromptLookup(block_size=g, vocab_size=cfg.vocab_size)
            scfg = spec.SpecConfig(dcfg, "greedy")
            st = spec.generate_spec(p, (), cfg, drafter, scfg, prompt, plen, seeds)
            assert bool(jnp.all(st.core.tokens == base.tokens)), f"{k}: speculative output differs from plain AR"
            tau = float(st.stats.committed.sum()) / float(st.stats.rounds.sum())
            fns[k, g] = (lambda p=p, d=drafter, s=scfg: spec.generate_spec(
                p, (), cfg, d, s, prompt, plen, seeds).core.tokens.block_until_ready())
            print(f"lookup {k} g={g}: tau {tau:.2f}")
    med = interleaved(fns, args.repeats)
    for k in forms:
        print(f"lookup speedup over plain AR, {k} (whole generation): "
              + ", ".join(f"g={g} {med[k, 'ar'] / med[k, g]:.2f}x" for g in (4, 8)))


if __name__ == "__main__":
    main()
