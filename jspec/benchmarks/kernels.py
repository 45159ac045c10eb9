"""Kernel vs reference time: the fused DFlash draft layer and tree attention.

    python -m jspec.benchmarks.kernels [--context 512] [--repeats 5] [--dtype float32] [--shape demo|qwen3-8b]

Each figure is the median wall time of one call inside a compiled loop of INNER calls (no dispatch
cost), batch 1, on the default backend. On CPU the Pallas kernels run in interpret mode (each grid
step becomes a loop iteration of XLA ops, plus simulated memory with --tpu-interpret), so CPU
figures say nothing about kernel speed on TPU / GPU: they only show the cost of interpreting.
On TPU the Mosaic kernels and on GPU the portable (Triton-lowered) kernels run compiled.

    python -m jspec.benchmarks.kernels --aot tpu-v5p [--dtype bfloat16] [--json out.json]

compiles both kernels and their jnp references for a real chip without one (run under
`jspec.aot.devices.aot_env(chip)`, e.g. with .venv-aot/bin/python) at Qwen3-8B / DFlash-b16 shape
(hidden 4096, 32 / 8 heads x 128, MLP 12288, block 16, context 4096, tree of 33 nodes, batch 1) and
prints the HBM bytes one call moves, read from the optimized HLO of a loop around the call
(`jspec.aot.hlo_bytes`: each top-level kernel's operands read + results written; a Pallas call counts
its whole operands, which at a full context is what its BlockSpecs fetch too: every weight block
once, every context tile once). No device: no times. With --jax-ops a TPU run also compiles JAX's own
`ragged_paged_attention` on the chain verify pass it fits (`jax_ragged_case`), for comparison.
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
    lp = jax.tree_util.tree_map(lambda x: x.astype(dtype),
                                transformer.init_params(cfg, keys[0], std=0.05)["layers"][0])
    kv = (1, context + 64, cfg.num_kv_heads * cfg.head_dim)  # rows of the drafter's context cache
    return (jax.random.normal(keys[1], (1, 1, block, cfg.hidden_size), dtype), lp,
            jax.random.normal(keys[2], kv, dtype), jax.random.normal(keys[3], kv, dtype))


def tree_inputs(cfg, nodes: int, context: int, dtype):
    keys = jax.random.split(jax.random.key(1), 6)
    hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    kv = (1, hkv, context + 64, dh)  # heads-major, as the target's KV cache
    parent = jnp.arange(nodes) - 1  # a chain: every node sees all earlier ones
    mask = (jnp.arange(nodes)[None, :] <= jnp.arange(nodes)[:, None])[None]
    return (jax.random.normal(keys[0], (1, nodes, hq, dh), dtype), jax.random.normal(keys[1], kv, dtype),
            jax.random.normal(keys[2], kv, dtype), jax.random.normal(keys[3], (1, nodes, hkv, dh), dtype),
            jax.random.normal(keys[4], (1, nodes, hkv, dh), dtype), (context + parent + 1)[None].astype(jnp.int32),
            jnp.array([context], jnp.int32), pack_bits(mask))


AOT_CFG = dict(family="qwen3", vocab_size=128, hidden_size=4096, intermediate_size=12288, num_layers=1,
               num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True)
AOT_BLOCK, AOT_CONTEXT, AOT_NODES = 16, 4096, 33


def aot_case(kernel: str, impl: str, dtype, *, context: int = AOT_CONTEXT, batch: int = 1):
    """(fn, abstract args) of one call at Qwen3-8B / DFlash-b16 shape: kernel "draft" | "tree",
    impl "reference" | "tpu" | "portable", or for "tree" on a TPU "jax-ragged" (`jax_ragged_case`)."""
    from jspec.models.config import ModelConfig

    cfg = ModelConfig(**AOT_CFG)
    sds = jax.ShapeDtypeStruct
    i32 = lambda *shape: sds(shape, jnp.int32)
    if kernel == "draft":
        lp = jax.tree_util.tree_map(lambda shape: sds(shape, dtype), transformer.layer_shapes(cfg),
                                    is_leaf=lambda x: isinstance(x, tuple))
        ctx = sds((batch, context, cfg.num_kv_heads * cfg.head_dim), dtype)  # the drafter's context cache
        args = (sds((batch, 1, AOT_BLOCK, cfg.hidden_size), dtype), lp, ctx, ctx, i32(batch, 1), i32())
        if impl == "reference":
            call = lambda *a: ref_draft_layer(*a, cfg)
        else:
            call = lambda *a: draft_layer(*a, cfg, impl=impl, interpret=False)
    elif kernel == "tree" and impl == "jax-ragged":
        return jax_ragged_case(cfg, dtype, context, batch)
    elif kernel == "tree":
        t, hq, hkv, dh = AOT_NODES, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cache = sds((batch, hkv, context, dh), dtype)  # heads-major, as the target's KV cache
        args = (sds((batch, t, hq, dh), dtype), cache, cache, sds((batch, t, hkv, dh), dtype),
                sds((batch, t, hkv, dh), dtype), i32(batch, t), i32(batch), i32(batch, t, -(-t // 32)), i32())
        if impl == "reference":
            call = ref_tree_attention
        else:
            call = lambda *a: tree_attention(*a, impl=impl, interpret=False)
    else:
        raise ValueError(f"unknown kernel {kernel!r}: draft or tree")
    return call, args


RAGGED_PAGE = 16  # rows per page of the paged cache below


def jax_ragged_case(cfg, dtype, context: int, batch: int):
    """JAX's own TPU kernel for mixed prefill / decode, `ragged_paged_attention`, on the pass it fits: a
    chain verify pass, AOT_NODES query rows with a causal mask, their K/V already written after
    `context` committed rows. Its cache layout is not jspec's: pages [P, page, 2 * Hkv, Dh] with K and
    V heads interleaved (jspec: [B, Hkv, S, Dh] each), a page table per sequence, and no ancestor mask
    (tree passes). Block sizes are given (the kernel looks them up by the default device's TPU
    version, which a compile-only chip is not): all query rows in one block, so the context is read
    once, and 16 pages (256 rows) per KV block."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    t, hq, hkv, dh = AOT_NODES, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pages = -(-(context + t) // RAGGED_PAGE)
    sds = jax.ShapeDtypeStruct
    args = (sds((batch * t, hq, dh), dtype), sds((batch * pages, RAGGED_PAGE, 2 * hkv, dh), dtype),
            sds((batch,), jnp.int32), sds((batch, pages), jnp.int32), sds((batch + 1,), jnp.int32),
            sds((1,), jnp.int32))

    def call(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
        return ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=dh ** -0.5,
                                      num_kv_pages_per_block=16, num_queries_per_block=1 << (t - 1).bit_length(),
                                      vmem_limit_bytes=64 << 20)

    return call, args


_FREE_OPS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "copy-done", "slice-done",
             "after-all"}


def entry_bytes(hlo_text: str) -> tuple[float, int, list]:
    """(bytes, kernels, [(bytes, opcode, name)]) of the optimized entry computation: every top-level
    instruction but the free ones reads its operands whole and writes its result (buffers outside
    device memory, TPU VMEM / SMEM, count zero); slices (and async slice-start) read only what they
    write. An upper bound where a fusion or kernel reads only part of an operand; at a full context the
    kernels measured here read all of theirs."""
    from jspec.aot import hlo_bytes

    module = hlo_bytes.parse_module(hlo_text)
    comp = module.computations[module.entry]
    total, kernels, items = 0.0, 0, []
    for name in comp.order:
        ins = comp.instrs[name]
        if ins.opcode in _FREE_OPS:
            continue
        moved = hlo_bytes.hbm_bytes(ins.shape) + sum(hlo_bytes.hbm_bytes(comp.instrs[o].shape) for o in ins.operands)
        if ins.opcode in ("slice", "slice-start", "dynamic-slice"):  # reads only the slice it writes
            # slice-start's result is ((operand), destination, context): the destination may be VMEM
            out = ins.shape[1] if ins.opcode == "slice-start" and isinstance(ins.shape, list) else ins.shape
            moved = out.nbytes + hlo_bytes.hbm_bytes(out)
        elif ins.opcode == "copy-start":  # result (destination, source, context): a prefetch into VMEM reads only
            src = hlo_bytes.hbm_bytes(comp.instrs[ins.operands[0]].shape)
            moved = src + hlo_bytes.hbm_bytes(ins.shape[0] if isinstance(ins.shape, list) else ins.shape)
        total += moved
        kernels += 1
        items.append((moved, ins.opcode, name))
    return total, kernels, sorted(items, reverse=True)


def aot_compile(chip: str, kernel: str, impl: str, dtype, **shape) -> dict:
    """Compile one case for `chip` without a device (this process must run under aot_env(chip)):
    {"bytes": HBM bytes of one call (`entry_bytes`: every top-level kernel of the optimized entry
    computation, operands read + results written), "top": its five largest kernels, "floor": bytes of the call's inputs and
    output (each read / written once: the least any implementation moves), "kernels": launches,
    "custom_calls": Pallas kernels in the HLO, "temp": XLA's temp bytes, "seconds": compile time}.
    The call is compiled on its own, not inside a loop: in a loop XLA may keep a single layer's
    loop-invariant weights in VMEM across iterations, which a real multi-layer decode loop cannot."""
    import re
    import time

    from jspec.aot import devices

    dev = devices.aot_device(chip)
    fn, args = aot_case(kernel, impl, dtype, **shape)
    start = time.perf_counter()
    with devices.default_device(dev):
        compiled = jax.jit(fn).lower(*devices.abstract(args, dev)).compile()
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    total, kernels, items = entry_bytes(text)
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))
    floor = nbytes(args) + nbytes(jax.eval_shape(fn, *args))
    return {"chip": chip, "kernel": kernel, "impl": impl, "dtype": jnp.dtype(dtype).name, "bytes": total,
            "floor": floor, "kernels": kernels, "seconds": round(seconds, 2), "top": items[:5],
            "custom_calls": len(re.findall(r'custom_call_target="(?:tpu_custom_call|__gpu\$xla\.gpu\.triton)"', text)),
            "temp": int(compiled.memory_analysis().temp_size_in_bytes)}


def aot_main(chip: str, dtypes, kernels=("draft", "tree"), reference: bool = True, json_path: str | None = None,
             jax_ops: bool = False):
    """Compile each kernel (and its reference) for `chip`; print bytes per call; optionally write JSON.
    jax_ops: on a TPU, also JAX's own `ragged_paged_attention` on the chain verify pass it fits
    (`jax_ragged_case`). A failed compile is reported in its row ("error") and does not stop the others."""
    import json

    from jspec.aot import devices

    impl = "tpu" if devices.is_tpu(chip) else "portable"
    rows = []
    for dtype in dtypes:
        for kernel in kernels:
            extra = ("jax-ragged",) if jax_ops and kernel == "tree" and devices.is_tpu(chip) else ()
            for which in ((impl, "reference") if reference else (impl,)) + extra:
                row = compiled_row(lambda: aot_compile(chip, kernel, which, jnp.dtype(dtype)), chip=chip,
                                   kernel=kernel, impl=which, dtype=jnp.dtype(dtype).name)
                rows.append(row)
                if "error" in row:
                    print(f"{chip} {kernel:5s} {row['dtype']:8s} {which:9s} FAILED {row['error'][:300]}", flush=True)
                else:
                    print(f"{chip} {kernel:5s} {row['dtype']:8s} {which:9s} {row['bytes'] / 1e6:9.2f} MB/call "
                          f"({row['bytes'] / row['floor']:.3f} x the {row['floor'] / 1e6:.2f} MB of inputs + output; "
                          f"{row['kernels']:.0f} kernels, compile {row['seconds']:.1f} s)", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def compiled_row(compile_case, **case) -> dict:
    """`compile_case()`'s row, or the case's fields with the compile error ("error") when it fails, so
    that one failed compile is reported in its row and does not stop the others."""
    try:
        return compile_case()
    except Exception as e:  # noqa: BLE001 - reported per case
        return {**case, "error": f"{type(e).__name__}: {str(e)[:2000]}"}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--shape", default="demo", choices=["demo", "qwen3-8b"],
                    help="layer shape: the demo model's, or Qwen3-8B's with DFlash-b16 blocks and a 33-node tree "
                         "(the --aot shape; for an accelerator)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tpu-interpret", action="store_true", help="on CPU, also time pltpu.InterpretParams()")
    ap.add_argument("--aot", metavar="CHIP", help="compile for CHIP (tpu-v5e, tpu-v5p, tpu-v6e, h200) without a "
                    "device and print bytes per call, kernel vs reference, at Qwen3-8B shape")
    ap.add_argument("--aot-dtypes", default=None, help="comma-separated dtypes for --aot (default: --dtype)")
    ap.add_argument("--no-reference", action="store_true", help="with --aot, compile only the kernels")
    ap.add_argument("--json", default=None, help="with --aot, write the rows here")
    ap.add_argument("--jax-ops", action="store_true", help="with --aot on a TPU, also compile JAX's own "
                    "ragged_paged_attention on the chain verify pass (query rows with a causal mask)")
    args = ap.parse_args(argv)
    if args.aot:
        dtypes = (args.aot_dtypes or args.dtype).split(",")
        aot_main(args.aot, dtypes, reference=not args.no_reference, json_path=args.json, jax_ops=args.jax_ops)
        return
    dtype = jnp.dtype(args.dtype)
    if args.shape == "qwen3-8b":
        from jspec.models.config import ModelConfig

        cfg, blocks, trees = ModelConfig(**AOT_CFG), (AOT_BLOCK,), (AOT_NODES,)
    else:
        cfg, blocks, trees = DEMO_CONFIG, (8, 16), (16, 64)
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
    # Weights, caches and masks are arguments of the timed loop (never constants folded into it).
    for block in blocks:
        inputs = draft_inputs(cfg, block, args.context, dtype)
        ref_fn = jax.jit(lambda h, lp, kc, vc: ref_draft_layer(h, lp, kc, vc, anchor, window, cfg))
        ref = seconds(ref_fn, inputs, args.repeats)
        row = [f"reference {1e3 * ref:8.3f} ms"]
        for name, impl_, interp in variants:
            fn = jax.jit(lambda h, lp, kc, vc, impl_=impl_, interp=interp: draft_layer(
                h, lp, kc, vc, anchor, window, cfg, impl=impl_, interpret=interp))
            t = seconds(fn, inputs, args.repeats)
            row.append(f"{name} {1e3 * t:8.3f} ms ({t / ref:.2f}x, {_max_diff(fn(*inputs), ref_fn(*inputs))})")
        print(f"draft layer, block {block:3d}: " + " | ".join(row), flush=True)
    for nodes in trees:
        inputs = tree_inputs(cfg, nodes, args.context, dtype)
        ref_fn = jax.jit(lambda *a: ref_tree_attention(*a, window))
        ref = seconds(ref_fn, inputs, args.repeats)
        row = [f"reference {1e3 * ref:8.3f} ms"]
        for name, impl_, interp in variants:
            fn = jax.jit(lambda *a, impl_=impl_, interp=interp: tree_attention(*a, window, impl=impl_,
                                                                               interpret=interp))
            t = seconds(fn, inputs, args.repeats)
            row.append(f"{name} {1e3 * t:8.3f} ms ({t / ref:.2f}x, {_max_diff(fn(*inputs), ref_fn(*inputs))})")
        print(f"tree attention, {nodes:3d} nodes: " + " | ".join(row), flush=True)


def _max_diff(out, ref) -> str:
    """Largest |kernel - reference| over the output, relative to the reference's largest magnitude."""
    out, ref = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
    return f"max |diff| {float(jnp.max(jnp.abs(out - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30)):.1e} rel"


if __name__ == "__main__":
    main()
