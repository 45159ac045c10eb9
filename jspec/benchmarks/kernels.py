"""Kernel vs reference time: the fused DFlash draft layer and tree attention.

    python -m jspec.benchmarks.kernels [--context 512] [--repeats 5] [--dtype float32]

Each figure is the median wall time of one call inside a compiled loop of INNER calls (no dispatch
cost), batch 1, on the default backend. On CPU the Pallas kernels run in interpret mode (each grid
step becomes a loop iteration of XLA ops, plus simulated memory with --tpu-interpret), so CPU
figures say nothing about kernel speed on TPU / GPU: they only show the cost of interpreting.
On TPU the Mosaic kernels and on GPU the portable (Triton-lowered) kernels run compiled.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from jspec.decode.profile import median_seconds
from jspec.demo import DEMO_CONFIG
from jspec.kernels import draft_layer, pack_bits, pallas_setup, ref_draft_layer, ref_tree_attention, tree_attention
from jspec.models import transformer

INNER = 8


def seconds(fn, args, repeats: int) -> float:
    """Median seconds per call of fn(*args) over `repeats` timings of an INNER-call loop."""
    def body(_, carry):  # the output feeds the next call, so no call is hoisted or skipped
        out = fn(*carry)
        return (carry[0] + 1e-9 * jnp.sum(out).astype(carry[0].dtype),) + carry[1:]

    run = jax.jit(lambda *a: jax.lax.fori_loop(0, INNER, body, a)[0])
    return median_seconds(run, args, repeats, INNER)


def draft_inputs(cfg, block: int, context: int, dtype):
    keys = jax.random.split(jax.random.key(0), 4)
    lp = jax.tree_util.tree_map(lambda x: x[0].astype(dtype),
                                transformer.init_params(cfg, keys[0], std=0.05)["layers"])
    kv = (1, context + 64, cfg.num_kv_heads, cfg.head_dim)
    return (jax.random.normal(keys[1], (1, 1, block, cfg.hidden_size), dtype), lp,
            jax.random.normal(keys[2], kv, dtype), jax.random.normal(keys[3], kv, dtype))


def tree_inputs(cfg, nodes: int, context: int, dtype):
    keys = jax.random.split(jax.random.key(1), 6)
    hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    kv = (1, context + 64, hkv, dh)
    parent = jnp.arange(nodes) - 1  # a chain: every node sees all earlier ones
    mask = (jnp.arange(nodes)[None, :] <= jnp.arange(nodes)[:, None])[None]
    return (jax.random.normal(keys[0], (1, nodes, hq, dh), dtype), jax.random.normal(keys[1], kv, dtype),
            jax.random.normal(keys[2], kv, dtype), jax.random.normal(keys[3], (1, nodes, hkv, dh), dtype),
            jax.random.normal(keys[4], (1, nodes, hkv, dh), dtype), (context + parent + 1)[None].astype(jnp.int32),
            jnp.array([context], jnp.int32), pack_bits(mask))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tpu-interpret", action="store_true", help="on CPU, also time pltpu.InterpretParams()")
    args = ap.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    cfg = DEMO_CONFIG
    backend = jax.default_backend()
    impl, interpret = pallas_setup(None, None)
    variants = [(f"pallas ({impl}{', interpreted' if interpret else ''})", impl, interpret)]
    if backend == "cpu":
        variants.append(("pallas (portable, interpreted)", "portable", True))
        if args.tpu_interpret:
            variants.append(("pallas (tpu, TPU-interpret)", "tpu", pltpu.InterpretParams()))
    print(f"{backend} ({jax.devices()[0].device_kind}), {args.dtype}, batch 1, context {args.context}, layer "
          f"d={cfg.hidden_size} heads {cfg.num_heads}/{cfg.num_kv_heads} Dh={cfg.head_dim} F={cfg.intermediate_size}")
    if interpret:
        print("note: Pallas kernels run in interpret mode here; their times measure the interpreter, not the kernel")
    anchor, window = jnp.array([[args.context]], jnp.int32), jnp.int32(0)
    for block in (8, 16):
        h, lp, kc, vc = draft_inputs(cfg, block, args.context, dtype)
        ref = seconds(lambda h: ref_draft_layer(h, lp, kc, vc, anchor, window, cfg), (h,), args.repeats)
        row = [f"reference {1e3 * ref:8.3f} ms"]
        for name, impl_, interp in variants:
            t = seconds(lambda h: draft_layer(h, lp, kc, vc, anchor, window, cfg, impl=impl_, interpret=interp),
                        (h,), args.repeats)
            row.append(f"{name} {1e3 * t:8.3f} ms ({t / ref:.1f}x)")
        print(f"draft layer, block {block:3d}: " + " | ".join(row))
    for nodes in (16, 64):
        q, *rest = tree_inputs(cfg, nodes, args.context, dtype)
        ref = seconds(lambda q: ref_tree_attention(q, *rest, window), (q,), args.repeats)
        row = [f"reference {1e3 * ref:8.3f} ms"]
        for name, impl_, interp in variants:
            t = seconds(lambda q: tree_attention(q, *rest, window, impl=impl_, interpret=interp), (q,), args.repeats)
            row.append(f"{name} {1e3 * t:8.3f} ms ({t / ref:.1f}x)")
        print(f"tree attention, {nodes:3d} nodes: " + " | ".join(row))


if __name__ == "__main__":
    main()
