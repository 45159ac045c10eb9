"""Plain AR decoding of a ~0.5B-parameter float32 target on this CPU against its weight-read bound.

    python -m jspec.benchmarks.cpu_roofline [--layers 20] [--repeats 5] [--no-peer] [--max-width 32]

The target is a random Qwen3-shaped model (Qwen3-0.6B's widths, 20 layers, tied embeddings: 0.47B
parameters, 1.9 GB in float32), far beyond the CPU's caches, so one decode step streams every weight
from memory. Printed, all measured in this one process:
- the read bandwidth of this machine (a jitted sum over a 1 GiB array, and a 1 GiB matrix-vector
  product), and the weight-read bound of one step = weight bytes / the better of the two;
- jspec's plain AR ms/token (the compiled while_loop; decode only: the difference of two generation
  lengths, so prefill and compile cancel) and its ratio to the bound;
- transformers' greedy AR on the same weights (float32, torch on the same cores), the same way, and
  the ratio of the two (same tokens: the first 16 greedy tokens are compared);
- T(n)/T(1), n = 1..max-width: one verify pass over n tokens against one over 1 token (weights as
  arguments, compiled loops of passes, no dispatch cost);
- prompt-lookup speculative decoding at g = 4 and 8 against plain AR (greedy, same prompt; tau and
  the wall-clock ratio of whole generations).
Medians of interleaved repeats; the machine is shared, so read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.decode import ar, profile, spec
from jspec.drafters.lookup import PromptLookup
from jspec.models.config import ModelConfig
from jspec.models.transformer import count_params, init_params
from jspec.verify.sampling import SamplingParams

PROMPT = [17, 4, 99, 250, 31, 8, 17, 4, 99, 250, 31, 8, 5, 6, 7, 3]


def shape(layers: int) -> ModelConfig:
    return ModelConfig(family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_layers=layers, num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True,
                       tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=40960)


def step_weight_bytes(cfg: ModelConfig, params) -> int:
    """Bytes one decode step must read: every layer weight and the LM head (the embedding lookup reads
    one row, but a tied head reads the whole matrix)."""
    layers = sum(x.nbytes for x in jax.tree_util.tree_leaves(params["layers"]))
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return layers + head.nbytes + params["final_norm"].nbytes


def read_bandwidth(repeats: int) -> dict[str, float]:
    """GB/s of two read-bound programs over 1 GiB of float32."""
    n = 1 << 28
    x = jnp.ones((n,), jnp.float32)
    m = x.reshape(1 << 14, 1 << 14)
    v = jnp.ones((1 << 14,), jnp.float32)
    total = jax.jit(jnp.sum)
    gemv = jax.jit(lambda m, v: m @ v)
    out = {"sum": x.nbytes / profile.median_seconds(total, (x,), repeats) / 1e9,
           "gemv": m.nbytes / profile.median_seconds(gemv, (m, v), repeats) / 1e9}
    del x, m
    return out


def interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, run in turn `repeats` times after one untimed call each."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--short", type=int, default=8, help="new tokens of the shorter generation")
    ap.add_argument("--long", type=int, default=40, help="new tokens of the longer generation")
    ap.add_argument("--max-width", type=int, default=32)
    ap.add_argument("--no-peer", action="store_true", help="skip transformers")
    args = ap.parse_args(argv)

    cfg = shape(args.layers)
    params = init_params(cfg, jax.random.key(0), std=0.02)
    weight_bytes = step_weight_bytes(cfg, params)
    bw = read_bandwidth(args.repeats)
    best = max(bw.values())
    bound = weight_bytes / (best * 1e9)
    print(f"target: random Qwen3-shaped, {count_params(params) / 1e9:.3f}B parameters, {cfg.num_layers} layers, "
          f"float32; one step reads {weight_bytes / 1e9:.2f} GB of weights")
    print(f"read bandwidth: sum {bw['sum']:.1f} GB/s, gemv {bw['gemv']:.1f} GB/s -> weight-read bound "
          f"{1e3 * bound:.1f} ms/step")

    prompt = jnp.asarray([PROMPT], jnp.int32)
    plen, seeds = jnp.array([len(PROMPT)], jnp.int32), jnp.array([0], jnp.uint32)
    cache = 128
    dcfgs = {n: ar.DecodeConfig(max_new_tokens=n, cache_size=cache, sampling=SamplingParams(0.0))
             for n in (args.short, args.long)}
    run_ar = {n: (lambda d=d: ar.generate_ar(params, cfg, d, prompt, plen, seeds).tokens.block_until_ready())
              for n, d in dcfgs.items()}
    fns = {f"jspec{n}": f for n, f in run_ar.items()}

    peer = None
    if not args.no_peer:
        peer = _transformers_model(cfg, params)
        ids = peer[1].tensor([PROMPT])

        def hf(n, model=peer[0], ids=ids, torch=peer[1]):
            with torch.no_grad():
                return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0, eos_token_id=None)

        fns.update({f"hf{n}": (lambda n=n: hf(n)) for n in (args.short, args.long)})
    med = interleaved(fns, args.repeats)
    steps = args.long - args.short
    jspec_step = (med[f"jspec{args.long}"] - med[f"jspec{args.short}"]) / steps
    print(f"jspec AR: {1e3 * jspec_step:.1f} ms/token = {jspec_step / bound:.2f}x the bound "
          f"(decode only: ({args.long} - {args.short} new tokens), medians of {args.repeats})")
    if peer is not None:
        hf_step = (med[f"hf{args.long}"] - med[f"hf{args.short}"]) / steps
        ours = np.asarray(run_ar[args.long]())[0, len(PROMPT):len(PROMPT) + 16]
        theirs = hf(16).numpy()[0, len(PROMPT):]
        print(f"transformers AR: {1e3 * hf_step:.1f} ms/token = {hf_step / bound:.2f}x the bound; "
              f"transformers / jspec = {hf_step / jspec_step:.2f}x; first 16 greedy tokens "
              f"{'equal' if np.array_equal(ours, theirs) else 'DIFFER'}")
        del peer

    t = {n: profile.verify_pass_seconds(params, cfg, 1, n - 1, 64, cache, repeats=3, inner=4)
         for n in range(1, args.max_width + 1)}
    print("T(n)/T(1), n = 1.." + str(args.max_width) + ": " + " ".join(f"{t[n] / t[1]:.2f}" for n in t))

    dcfg = dcfgs[args.long]
    base = ar.generate_ar(params, cfg, dcfg, prompt, plen, seeds)
    spec_fns = {"ar": run_ar[args.long]}
    for g in (4, 8):
        drafter = PromptLookup(block_size=g, vocab_size=cfg.vocab_size)
        scfg = spec.SpecConfig(dcfg, "greedy")
        st = spec.generate_spec(params, (), cfg, drafter, scfg, prompt, plen, seeds)
        assert bool(jnp.all(st.core.tokens == base.tokens)), "speculative output differs from plain AR"
        tau = float(st.stats.committed.sum()) / float(st.stats.rounds.sum())
        spec_fns[f"lookup{g}"] = (lambda d=drafter, s=scfg: spec.generate_spec(
            params, (), cfg, d, s, prompt, plen, seeds).core.tokens.block_until_ready())
        print(f"lookup g={g}: tau {tau:.2f}")
    med = interleaved(spec_fns, args.repeats)
    print("lookup speedup over plain AR (whole generation, prefill included): "
          + ", ".join(f"g={g} {med['ar'] / med[f'lookup{g}']:.2f}x" for g in (4, 8)))


def _transformers_model(cfg: ModelConfig, params):
    """The same weights in transformers (float32, CPU, torch on the cores this process may use)."""
    import torch
    import transformers

    from jspec.io.hf import save_params

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    with tempfile.TemporaryDirectory() as d:
        save_params(d, cfg, params)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, local_files_only=True)
    return model.eval(), torch


if __name__ == "__main__":
    main()
