"""Deviceless compiles of the Q4 matmul kernel (jspec.kernels.q4) and its XLA reference at Qwen3-8B shapes.

    python -m jspec.benchmarks.q4_kernel --aot tpu-v5p|h200 [--json OUT] [--rows 1,16,128] [--cases ...]
        [--dtype bfloat16|float32] [--no-reference]

Run it under `jspec.aot.devices.aot_env(CHIP)` (e.g. with .venv-aot/bin/python; the caller or the test
sets the environment). For each projection of Qwen3-8B (q / o 4096 x 4096, k / v 1024 x 4096, gate / up
12288 x 4096, down 4096 x 12288, LM head 151936 x 4096 with a float32 result, as `layers.lm_logits`
asks), bf16 (or --dtype float32), M rows in {1, 16, 128}, it lowers and compiles `q4_matmul` (impl
"tpu" on a TPU, "portable" on the H200) and `quant._reference_matmul` for the compile-only chip and
prints per case: compiled or the error, the Pallas custom calls in the optimized HLO, the HBM bytes
one call moves (`jspec.benchmarks.kernels.entry_bytes`: each top-level kernel of the entry computation
reads its operands and writes its result; a Pallas call counts its operands whole, which is what its
BlockSpecs fetch when M fits one row tile) and the floor: bytes of codes + scales + biases + x +
output, each touched once. Each case is compiled on its own (not in a loop). No device: no times.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp

from jspec.benchmarks.kernels import compiled_row, entry_bytes
from jspec.kernels.q4 import q4_matmul
from jspec.models import quant

# name -> (out, in, preferred_element_type)
SHAPES = {
    "qo_proj": (4096, 4096, None),
    "kv_proj": (1024, 4096, None),
    "gate_up": (12288, 4096, None),
    "down": (4096, 12288, None),
    "lm_head": (151936, 4096, jnp.float32),
}
ROWS = (1, 16, 128)
_PALLAS_CALL = re.compile(r'custom_call_target="(?:tpu_custom_call|__gpu\$xla\.gpu\.triton)"')


def case_args(out: int, inp: int, rows: int, dtype):
    """Abstract (x [rows, in], Q4 [out, in]) in `dtype`."""
    sds = jax.ShapeDtypeStruct
    q = quant.Q4(sds((out, inp // quant.CODES_PER_WORD), jnp.uint32), sds((out, inp // quant.GROUP_SIZE), dtype),
                 sds((out, inp // quant.GROUP_SIZE), dtype))
    return sds((rows, inp), dtype), q


def aot_compile(chip: str, name: str, rows: int, impl: str, dtype=jnp.bfloat16) -> dict:
    """Compile one case for `chip` (this process must run under aot_env(chip)); impl "reference" or the
    kernel's ("tpu" | "portable"). Returns {"bytes", "floor", "custom_calls", "kernels", "top", "temp",
    "seconds", ...}."""
    from jspec.aot import devices

    out, inp, pet = SHAPES[name]
    dev = devices.aot_device(chip)
    args = case_args(out, inp, rows, jnp.dtype(dtype))
    if impl == "reference":
        fn = lambda x, q: quant._reference_matmul(x, q, pet)
    else:
        fn = lambda x, q: q4_matmul(x, q, pet, impl=impl, interpret=False)
    start = time.perf_counter()
    with devices.default_device(dev):
        compiled = jax.jit(fn).lower(*devices.abstract(args, dev)).compile()
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    total, kernels, items = entry_bytes(text)
    nbytes = lambda tree: sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))
    floor = nbytes(args) + nbytes(jax.eval_shape(fn, *args))
    return {"chip": chip, "case": name, "out": out, "in": inp, "rows": rows, "impl": impl,
            "dtype": jnp.dtype(dtype).name, "bytes": total, "floor": floor, "kernels": kernels,
            "custom_calls": len(_PALLAS_CALL.findall(text)), "seconds": round(seconds, 2), "top": items[:5],
            "temp": int(compiled.memory_analysis().temp_size_in_bytes)}


def aot_main(chip: str, rows=ROWS, cases=tuple(SHAPES), reference: bool = True, json_path: str | None = None,
             dtype: str = "bfloat16"):
    """Compile every case (kernel, and the reference unless reference=False) for `chip`, print a line
    per case, optionally write the rows as JSON. A failed compile is reported in its row ("error")."""
    from jspec.aot import devices

    impl = "tpu" if devices.is_tpu(chip) else "portable"
    out = []
    for name in cases:
        for m in rows:
            for which in ((impl, "reference") if reference else (impl,)):
                row = compiled_row(lambda: aot_compile(chip, name, m, which, jnp.dtype(dtype)), chip=chip,
                                   case=name, rows=m, impl=which, dtype=jnp.dtype(dtype).name)
                out.append(row)
                label = f"{chip} {name:8s} {row['dtype']:8s} M={m:<4d} {which:9s}"
                if "error" in row:
                    print(f"{label} FAILED {row['error'][:300]}", flush=True)
                else:
                    print(f"{label} {row['bytes'] / 1e6:9.2f} MB/call = {row['bytes'] / row['floor']:.3f} x the floor "
                          f"{row['floor'] / 1e6:.2f} MB; {row['custom_calls']} Pallas calls, {row['kernels']} kernels, "
                          f"compile {row['seconds']:.1f} s", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aot", metavar="CHIP", required=True,
                    help="compile for CHIP (tpu-v5p, h200, ...) without a device")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated M values")
    ap.add_argument("--cases", default=",".join(SHAPES), help=f"comma-separated subset of {', '.join(SHAPES)}")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="x and scales dtype")
    ap.add_argument("--no-reference", action="store_true", help="compile only the kernel")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    aot_main(args.aot, rows=tuple(int(r) for r in args.rows.split(",")), cases=tuple(args.cases.split(",")),
             reference=not args.no_reference, json_path=args.json, dtype=args.dtype)


if __name__ == "__main__":
    main()
