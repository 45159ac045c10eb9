"""The drafter's cost c and the verify-pass cost curve T(n) / T(1) on a small random-weight model.

    python -m jspec.benchmarks.drafter_cost [--context 256] [--max-drafts 16]

c = (one DFlash draft pass over a block) / (one target forward over 1 token), both inside compiled
loops of 32 calls (no dispatch cost), same context length, batch 1. T(n) = one target verify pass
over the anchor plus n drafts. Medians of repeats; CPU figures are ratios, not absolute speeds.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from jspec.decode import profile
from jspec.demo import DEMO_CONFIG
from jspec.drafters import dflash as dfl
from jspec.models.transformer import init_params

INNER = 32


def draft_seconds(params, dparams, cfg: dfl.DFlashConfig, context: int, repeats: int) -> float:
    lc = cfg.layers
    shape = (lc.num_layers, 1, context + cfg.block_size, lc.num_kv_heads, lc.head_dim)
    k = jnp.ones(shape) * 0.01
    anchor_pos = jnp.array([context])

    def step(_, anchor):  # the drafted token feeds the next pass
        h = dfl.draft_block(dparams, cfg, params["embed"], k, k, anchor, anchor_pos)
        return jnp.argmax(h[:, -1] @ params["embed"].T, axis=-1).astype(jnp.int32)

    run = jax.jit(lambda a: jax.lax.fori_loop(0, INNER, step, a))
    return profile.median_seconds(run, (jnp.array([1], jnp.int32),), repeats, INNER)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--max-drafts", type=int, default=16)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    cfg = DEMO_CONFIG
    params = init_params(cfg, jax.random.key(0), std=0.05)
    cache = args.context + args.max_drafts + 1
    t1 = profile.verify_pass_seconds(params, cfg, 1, 0, args.context, cache, args.repeats)  # 1-token forward
    print(f"target {cfg.num_params / 1e6:.2f}M parameters, context {args.context}, batch 1, "
          f"{jax.devices()[0].platform}; one 1-token target forward: {1e3 * t1:.3f} ms")
    for block in (8, 16):
        dcfg = dfl.DFlashConfig(layers=dataclasses.replace(cfg, num_layers=args.draft_layers), target_layer_ids=(1, 2),
                                num_target_layers=cfg.num_layers, mask_token_id=0, block_size=block)
        dparams = dfl.init_params(dcfg, jax.random.key(1))
        d = draft_seconds(params, dparams, dcfg, args.context, args.repeats)
        print(f"DFlash ({args.draft_layers} layers) block {block}: {1e3 * d:.3f} ms per draft pass, c = {d / t1:.2f}")
    print("\nverify pass T(n)/T(1), n = drafts verified beside the anchor:")
    base = profile.verify_pass_seconds(params, cfg, 1, 1, args.context, cache, args.repeats)
    row = []
    for n in range(1, args.max_drafts + 1):
        tn = base if n == 1 else profile.verify_pass_seconds(params, cfg, 1, n, args.context, cache, args.repeats)
        row.append(f"{n}:{tn / base:.2f}")
    print("  " + "  ".join(row))


if __name__ == "__main__":
    main()
