"""`jspec bench --aot CHIP --shape qwen3-8b`: HBM bytes per decode round of the real compiled loops.

For every combination of batch, context, verifier and chain / tree, the speculative loop
(`jspec.decode.spec.generate_spec`, a DFlash drafter of the target's shape, prepared by
`jspec.api.prepare_drafter`) and the plain AR loop (`jspec.decode.ar.generate_ar`) are compiled for a
compile-only chip (jspec.aot.devices) with abstract inputs (`jax.eval_shape` of random init: nothing
is allocated), and the optimized HLO of the decode loop's while body is walked (jspec.aot.hlo_bytes).

Ideal bytes per round = one read of every target weight except the embedding table (a round gathers
only the few rows of its input tokens; with tied embeddings the table is the LM head and counts) + one
read of every drafter weight + the drafter's read of the target's shared LM head (DFlash computes its
draft logits with it: a read the drafter needs, on top of the target's own logits) + the valid K/V
(context rows x layers x 2 x kv_heads x head_dim x itemsize x batch, target and drafter context
caches) + the K/V rows the round writes (verify width rows of the target, as many drafter context
rows as it commits). roofline fraction = ideal / actual. The compiled cache covers `context` committed
rows, so the ideal is the round at a full cache, the most expensive one. Weight bytes in the measured
columns are reads of the loop state that comes from the program's weight arguments (`params`,
`dparams`); other loop-invariant buffers count as `other`.

Targets (the `pass` column): fraction >= 0.85 at batch 1 / 4k and >= 0.75 at 32k or batch 8;
device memory besides weights and K/V caches (temp + outputs - caches) <= 10% of the caches; and at
batch 8 / 32k the whole program (arguments + outputs + temp - aliased) fits the chip's HBM.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import sys
import time

from jspec.aot import devices

BATCHES = (1, 8)
CONTEXTS = (4096, 32768)
VERIFIERS = ("greedy", "top-p")
TREE_BUDGET = 32
BLOCK = 16
PROMPT_LEN = 64  # prefill width of the compiled program; the loop's cost does not depend on it
QUICK = {"batches": (1,), "contexts": (4096,), "verifiers": ("greedy",)}
WEIGHT_ARGS = ("params", "dparams")  # the compiled loops' weight arguments (target, drafter)


def shapes() -> dict:
    """Target shapes by name: the bench's published shapes plus `tiny`, a 2-layer model for tests."""
    from jspec.bench.roofline import SHAPES
    from jspec.models.config import ModelConfig

    tiny = ModelConfig(family="qwen3", vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4,
                       num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=False, qk_norm=True, eos_token_ids=(1,), max_position_embeddings=40960)
    return {**SHAPES, "tiny": tiny}


@dataclasses.dataclass(frozen=True)
class Case:
    loop: str  # "spec" | "ar"
    batch: int
    context: int
    verifier: str  # "greedy" | "top-p"
    tree: int  # 0 = chain, else the DDTree budget

    @property
    def label(self) -> str:
        kind = "ar" if self.loop == "ar" else ("tree" if self.tree else "chain")
        return f"{kind} B{self.batch} {self.context // 1024}k {self.verifier}"

    @property
    def target_ratio(self) -> float:
        return 0.85 if self.batch == 1 and self.context <= 4096 else 0.75


def cases(batches=BATCHES, contexts=CONTEXTS, verifiers=VERIFIERS, tree_budget=TREE_BUDGET) -> list[Case]:
    out = []
    for b, c, v in itertools.product(batches, contexts, verifiers):
        out += [Case("spec", b, c, v, 0), Case("spec", b, c, v, tree_budget), Case("ar", b, c, v, 0)]
    return out


def _sampling(verifier: str):
    from jspec.verify.sampling import SamplingParams

    if verifier == "greedy":
        return SamplingParams(temperature=0.0), "greedy"
    if verifier == "top-p":
        return SamplingParams(temperature=1.0, top_p=0.9), "speculative"
    raise ValueError(f"unknown AOT verifier {verifier!r}: choose greedy or top-p")


def dflash_config(cfg, block: int = BLOCK, layers: int = 5):
    """A DFlash drafter shaped like z-lab's for this target: 5 draft layers with the target's width,
    taps at the default 5 target layers, the anchor counted in the block."""
    from jspec.drafters.dflash import DFlashConfig, default_target_layer_ids

    n_taps = min(5, max(cfg.num_layers - 1, 1))
    ids = default_target_layer_ids(n_taps, cfg.num_layers) if cfg.num_layers >= 5 else tuple(range(n_taps))
    return DFlashConfig(layers=dataclasses.replace(cfg, num_layers=layers, layer_types=()), target_layer_ids=ids,
                        num_target_layers=cfg.num_layers, mask_token_id=cfg.vocab_size - 1, block_size=block)


def _nbytes(tree) -> int:
    import jax

    return int(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


def kv_row_bytes(cfg, itemsize: int) -> int:
    """K and V bytes of one cache row (one position), all layers, one batch row."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def default_layer_loop(chip: str) -> str:
    """The target's layer loop for `chip` (ModelConfig.layer_loop): "scan" on TPU, "unroll" on GPU."""
    return "scan" if devices.is_tpu(chip) else "unroll"


def compile_case(chip: str, shape: str, case: Case, kernels: str = "reference", q4: bool = False,
                 layer_loop: str | None = None):
    """Compile `case` for `chip`; returns (compiled, info) where info has the analytic sizes. q4: the
    target's matrices (embedding and LM head included) in affine Q4 group-64 form, multiplied by the
    Q4 matmul that `kernels` names (jspec.models.quant). layer_loop: the target's (default: the chip's,
    `default_layer_loop`)."""
    import jax

    from jspec.aot import temp

    dev = devices.aot_device(chip)
    with jax.default_device(dev):
        program = case_program(shape, case, kernels, q4, layer_loop=layer_loop or default_layer_loop(chip))
        lowered = program.loop.lower(*devices.abstract(program.args, dev))
        start = time.perf_counter()
        # the temp split tells the data from the compiler's per-operation slots (jspec.aot.temp)
        compiled, split = temp.compile_and_split(lowered)
    return compiled, {**program.info, "compile_s": time.perf_counter() - start, "temp_split": split}


@functools.lru_cache(maxsize=2)
def _random_weights(init, cfg, seed: int, index: int, dtype):
    """init(cfg, key, dtype=dtype) on the default device, key from (seed, index); the last two are kept
    (the cases of a run share the target's and the drafter's weights)."""
    import jax

    key = jax.random.fold_in(jax.random.key(seed), index)
    return jax.jit(lambda k: init(cfg, k, dtype=dtype))(key)


@dataclasses.dataclass
class Program:
    """One case's decode loop: `loop(*args)` runs it (`args` = weights, static configs, then the
    prompts, prompt lengths and seeds, in the loop's order); `info` holds the analytic sizes that
    `ideal_bytes` and `score` read."""

    loop: object
    args: tuple
    info: dict


def case_program(shape: str, case: Case, kernels: str = "reference", q4: bool = False, seed: int | None = None,
                 prompt_len: int = PROMPT_LEN, layer_loop: str = "unroll") -> Program:
    """The loop of `case` at `shape` (bf16 weights, prompts of `prompt_len` tokens, a cache of
    `case.context` rows, the target's layers run as `layer_loop`: ModelConfig.layer_loop). Abstract
    weights and inputs (`jax.eval_shape`: nothing allocated) unless `seed` is given: then random weights
    and prompts from it, on the default device, to run for real (the last two models' weights are kept
    for the next case)."""
    import jax
    import jax.numpy as jnp

    from jspec.api import Target, prepare_drafter
    from jspec.decode import ar, spec
    from jspec.drafters import dflash
    from jspec.models.transformer import init_params

    cfg = shapes()[shape]
    dtype = jnp.bfloat16

    def make(init, config, index):  # weights of one model: abstract, or random from (seed, index)
        if seed is None:
            return jax.eval_shape(lambda: init(config, jax.random.key(index), dtype=dtype))
        return _random_weights(init, config, seed, index, dtype)

    params = make(init_params, cfg, 0)
    if q4:
        from jspec.models import quant
        from jspec.models import target as tm

        params = quant.with_kernel(quant.quantize_tree(params, tm.declarations(cfg)), kernels)
    if layer_loop == "scan":  # stacked after quantizing: the declarations are per layer
        from jspec.models.transformer import stack_layers

        cfg = dataclasses.replace(cfg, layer_loop=layer_loop)
        params = stack_layers(params) if seed is not None else jax.eval_shape(stack_layers, params)
    sampling, verifier = _sampling(case.verifier)
    b = case.batch
    cache_size = case.context
    dcfg = ar.DecodeConfig(max_new_tokens=cache_size - prompt_len, cache_size=cache_size, sampling=sampling,
                           eos_ids=tuple(cfg.eos_token_ids), attention=kernels)
    inputs = (jax.ShapeDtypeStruct((b, prompt_len), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
              jax.ShapeDtypeStruct((b,), jnp.uint32))
    if seed is not None:
        inputs = (jax.random.randint(jax.random.key(seed), (b, prompt_len), 0, cfg.vocab_size, jnp.int32),
                  jnp.full((b,), prompt_len, jnp.int32), jnp.arange(b, dtype=jnp.uint32))
    row = kv_row_bytes(cfg, 2)
    smallest = min(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params) if x.ndim >= 2)
    embed = _nbytes(params["embed"])
    head = embed if cfg.tie_word_embeddings else _nbytes(params["lm_head"])
    info = {"weights_target": _nbytes(params), "weights_drafter": 0, "embed_bytes": embed, "head_bytes": head,
            "tied_head": bool(cfg.tie_word_embeddings), "drafter_head_bytes": 0, "kv_row_bytes": row,
            "weight_min_bytes": min(1 << 20, smallest // 2), "weight_args": list(WEIGHT_ARGS),
            "layer_loop": layer_loop}
    if case.loop == "ar":
        program = Program(ar.generate_ar, (params, cfg, dcfg, *inputs), info)
        width, d_rows, d_row = 1, 0, 0
        cache_bytes = b * dcfg.cache_rows * row
    else:
        dc = dflash_config(cfg)
        dparams = make(dflash.init_params, dc, 1)
        target = Target(cfg, params, None, f"random:{shape}")
        dr, dparams = prepare_drafter(target, (dflash.DFlash(cfg=dc, kernels=kernels, tree_budget=case.tree), dparams),
                                      sampling, verifier, BLOCK, case.tree, cache_size)
        program = Program(spec.generate_spec, (params, dparams, cfg, dr, spec.SpecConfig(dcfg, verifier), *inputs),
                          info)
        width = dr.num_drafts + 1
        d_row = kv_row_bytes(dc.layers, 2)
        d_rows = dr.max_depth + 1  # the drafter commits at most the accepted path and the anchor
        info["weights_drafter"] = _nbytes(dparams)
        # DFlash turns its draft slots into logits with the target's (shared) LM head: one more
        # read of the head per round, which the drafter needs.
        info["drafter_head_bytes"] = head
        cache_bytes = b * dataclasses.replace(dcfg, scratch_rows=width).cache_rows * (row + d_row)
    info.update(width=width, cache_bytes=cache_bytes, kv_ideal=b * case.context * (row + d_row),
                writes_ideal=b * (width * row + d_rows * d_row))
    return program


def ideal_bytes(info: dict) -> dict:
    """The least a round can move, by part (bytes): `weights` = every target weight once except the
    embedding table (a round gathers only a few of its rows; with tied embeddings the table is the LM
    head and is read whole) + every drafter weight once; `drafter_head` = the drafter's own read of the
    target's shared LM head (logits of the draft slots); `kv` = the valid K/V of the target's and the
    drafter's context caches; `writes` = the K/V rows the round writes."""
    target = info["weights_target"] - (0 if info.get("tied_head") else info.get("embed_bytes", 0))
    parts = {"weights": target + info["weights_drafter"], "drafter_head": info.get("drafter_head_bytes", 0),
             "kv": info["kv_ideal"], "writes": info["writes_ideal"]}
    parts["total"] = sum(parts.values())
    return parts


def score(chip: str, shape: str, case: Case, text: str, mem: dict, info: dict, trace: bool = False) -> dict:
    """One table row from a compiled program's optimized HLO text, its memory stats and `info`."""
    from jspec.aot import hlo_bytes

    # Weight buffers: the loop state elements that come from the program's weight arguments (`params`,
    # `dparams`); without those names, anything as large as the smallest weight matrix (halved for
    # layout padding slack), capped at 1 MiB.
    loop = hlo_bytes.decode_loop_bytes(text, weight_min_bytes=info["weight_min_bytes"], trace=trace,
                                       weight_args=tuple(info.get("weight_args") or ()) or None)
    ideal_parts = ideal_bytes(info)
    ideal = ideal_parts["total"]
    ratio = ideal / loop.total if loop.total else 0.0
    overhead = mem["temp"] + mem["output"] - info["cache_bytes"]
    peak = mem["argument"] + mem["output"] + mem["temp"] - mem["alias"]
    hbm = devices.HBM_BYTES[chip]
    checks = {"ratio": ratio >= case.target_ratio, "temp": overhead <= 0.10 * info["cache_bytes"]}
    if case.batch == max(BATCHES) and case.context == max(CONTEXTS):
        checks["fits"] = peak <= hbm
    row = {
        "chip": chip, "shape": shape, "case": case.label, **dataclasses.asdict(case),
        "bytes": loop.as_dict(), "ideal": ideal, "ideal_weights": ideal_parts["weights"],
        "ideal_drafter_head": ideal_parts["drafter_head"], "ideal_kv": ideal_parts["kv"],
        "ideal_writes": ideal_parts["writes"], "ratio": ratio,
        "target_ratio": case.target_ratio, "kernels": loop.kernels, "memory": mem,
        "cache_bytes": info["cache_bytes"], "overhead_bytes": overhead, "peak_bytes": peak, "hbm_bytes": hbm,
        "round_bound_s": loop.total / devices.HBM_BANDWIDTH[chip], "checks": checks, "pass": all(checks.values()),
        "compile_s": info["compile_s"], "layer_loop": info.get("layer_loop", "unroll"),
    }
    if "temp_split" in info:  # absent when rescored from a dump that predates it
        row["temp_split"] = info["temp_split"]
    if trace:
        row["top"] = top_consumers(loop)
    return row


def top_consumers(loop, n: int = 5, column: int = 3) -> list[dict]:
    """The `n` largest consumers of `other` bytes per round (activations, copies of weight or cache
    slices, logits, masks: what the ideal does not have) in a traced walk (`trace=True`), kernels
    grouped by their op_name metadata (the jax operation they come from; the same op in every layer is
    one group: numeric path components read as `*`), else by kernel name without its numeric suffix.
    Each: op_name, `other` bytes and all bytes per round, kernels, executions per round, and the
    group's largest kernel. `column` picks another class to rank by (the `other` key then holds it):
    0 weights, 1 kv_reads, 2 cache_writes, 3 other."""
    import re

    agg: dict[str, dict] = {}
    for name, op, nbytes, times in loop.items:
        kernel = name.split("/")[-1]
        op_name = loop.op_names.get(name, "")
        op_name = re.sub(r"/\d+(?=/)", "/*", op_name)  # the same operation in every layer: one group
        key = op_name or re.sub(r"\.\d+$", "", kernel)
        a = agg.setdefault(key, {"op_name": op_name, "opcode": op, "other": 0.0, "bytes": 0.0, "kernels": {},
                                 "executions": 0.0})
        extra = loop.class_bytes.get(name, (0.0,) * 4)[column] * times
        a["other"] += extra
        a["bytes"] += nbytes * times
        a["kernels"][kernel] = a["kernels"].get(kernel, 0.0) + extra
        a["executions"] += times
    ranked = sorted(agg.values(), key=lambda a: -a["other"])[:n]
    return [{**a, "kernel": max(a["kernels"], key=a["kernels"].get), "kernels": len(a["kernels"])} for a in ranked]


def _slug(case: Case) -> str:
    return case.label.replace(" ", "-")


def measure(chip: str, shape: str, case: Case, kernels: str = "reference", dump_dir: str | None = None,
            q4: bool = False, layer_loop: str | None = None) -> dict:
    """One table row: bytes per round by class, ideal bytes, fraction, kernels, memory, pass/fail. With
    `dump_dir` (or $JSPEC_AOT_DUMP), the optimized HLO and the sizes are saved there, to be scored
    again without compiling (`python -m jspec.aot.bench --rescore DIR`)."""
    import gzip
    import os

    from jspec.aot import hlo_bytes

    compiled, info = compile_case(chip, shape, case, kernels, q4, layer_loop)
    text = compiled.as_text()
    mem = hlo_bytes.memory_stats(compiled)
    dump_dir = dump_dir or os.environ.get("JSPEC_AOT_DUMP")
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        stem = os.path.join(dump_dir, f"{chip}_{shape}{'_q4' if q4 else ''}_{_slug(case)}")
        with gzip.open(stem + ".hlo.gz", "wt") as f:
            f.write(text)
        with open(stem + ".json", "w") as f:
            json.dump({"chip": chip, "shape": shape, "case": dataclasses.asdict(case), "info": info, "memory": mem},
                      f, indent=1)
    return score(chip, shape, case, text, mem, info, trace=True)


def rescore(dump_dir: str, chip: str | None = None) -> list[dict]:
    """Rows scored again from a dump directory written by `measure` (cases in table order)."""
    import glob
    import gzip

    found = []
    for path in glob.glob(f"{dump_dir}/*.json"):
        with open(path) as f:
            meta = json.load(f)
        if chip and meta["chip"] != chip:
            continue
        with gzip.open(path[: -len(".json")] + ".hlo.gz", "rt") as f:
            text = f.read()
        case = Case(**meta["case"])
        found.append(score(meta["chip"], meta["shape"], case, text, meta["memory"], meta["info"], trace=True))
    order = {c: i for i, c in enumerate(cases())}
    return sorted(found, key=lambda r: (r["chip"], order.get(Case(r["loop"], r["batch"], r["context"], r["verifier"],
                                                                    r["tree"]), 1 << 30)))


LEGEND = ("ideal = target weights without the embedding table (only gathered) + drafter weights + the "
          "drafter's read of the target's shared LM head (its draft logits) + valid K/V of the target's and "
          "drafter's caches + K/V rows written; ratio = ideal / actual")


def temp_split_text(split: dict) -> str:
    """A row's temp split (jspec.aot.temp.breakdown) in MB: data, and the compiler's per-operation slots."""
    mb = lambda x: f"{x / 1e6:.1f}"  # noqa: E731
    return (f"{mb(split['temp'])} MB = {mb(split['data'])} data + {mb(split['tables'])} in tuple tables "
            f"({split['tuple_values']} tuple-shaped values) + {mb(split['outside'])} outside the temp block "
            f"({split['thread_local']} reduction scalars, {split['constants']} constants)")


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def table(rows: list[dict]) -> str:
    """The text table: one line per row, bytes in GB (1e9) per round."""
    head = ("case", "weights", "kv_read", "writes", "other", "actual", "ideal", "ratio", "kernels", "temp", "output",
            "cache", "peak", "pass")
    lines = [head]
    for r in rows:
        by = r["bytes"]
        failed = [k for k, ok in r["checks"].items() if not ok]
        lines.append((r["case"], _gb(by["weights"]), _gb(by["kv_reads"]), _gb(by["cache_writes"]), _gb(by["other"]),
                      _gb(by["total"]), _gb(r["ideal"]), f"{r['ratio']:.3f}", f"{r['kernels']:.0f}",
                      _gb(r["memory"]["temp"]), _gb(r["memory"]["output"]), _gb(r["cache_bytes"]),
                      _gb(r["peak_bytes"]), "pass" if r["pass"] else "FAIL " + ",".join(failed)))
    widths = [max(len(str(l[i])) for l in lines) for i in range(len(head))]
    out = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(l, widths)))
           for l in lines]
    return "\n".join(out)


def run(chip: str, shape: str, selected: list[Case], json_path: str | None = None, kernels: str = "reference",
        out=sys.stdout, q4: bool = False, layer_loop: str | None = None) -> list[dict]:
    """Measure every case, print the table (and each row as it completes, to stderr), write JSON."""
    devices.check_chip(chip)
    if shape not in shapes():
        raise ValueError(f"unknown shape {shape!r} for --aot: choose one of {', '.join(shapes())}")
    rows = []
    for case in selected:
        row = measure(chip, shape, case, kernels, q4=q4, layer_loop=layer_loop)
        row["q4"] = q4
        rows.append(row)
        print(f"[{chip}] {case.label}: {_gb(row['bytes']['total'])} GB/round, ratio {row['ratio']:.3f}, "
              f"compiled in {row['compile_s']:.0f} s", file=sys.stderr, flush=True)
    unknown = sorted({t for r in rows for t in r["bytes"]["unknown_trips"]})
    print(f"\n{chip} ({devices.aot_device(chip).device_kind}), shape {shape}, "
          f"{'Q4 target (bf16 scales, activations), bf16 drafter' if q4 else 'bf16'}, target layer loop "
          f"{layer_loop or default_layer_loop(chip)}; bytes per decode round in GB; "
          f"kernels = launches per round; temp/output/cache/peak = device memory (GB)", file=out)
    print(LEGEND, file=out)
    print(table(rows), file=out)
    if unknown:
        print(f"note: {len(unknown)} inner loops with a data-dependent trip count were counted once "
              f"(listed under bytes.unknown_trips in the JSON)", file=out)
    for r in rows:
        if not r["checks"]["temp"] and "temp_split" in r:
            print(f"temp of {r['case']}: {temp_split_text(r['temp_split'])}", file=out)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"chip": chip, "shape": shape, "rows": rows}, f, indent=1)
        print(f"wrote {json_path}", file=sys.stderr)
    return rows


def top_table(rows: list[dict], n: int = 3, failing_only: bool = True) -> str:
    """The `n` largest consumers of `other` bytes of each (failing) row: GB per round, op_name, kernels."""
    out = []
    for r in rows:
        if failing_only and r["pass"]:
            continue
        out.append(f"{r['case']}:")
        for t in r.get("top", [])[:n]:
            out.append(f"  {t['other'] / 1e9:7.2f} GB  {t['op_name'] or t['kernel']}  ({t['kernels']} {t['opcode']} "
                       f"kernels, {t['executions']:.0f} runs/round, e.g. {t['kernel']})")
    return "\n".join(out)


def main(argv=None) -> int:
    """`python -m jspec.aot.bench --rescore DIR`: the table again from the HLO saved by `measure`
    (JSPEC_AOT_DUMP=DIR), with the top byte consumers of the failing rows; no compiler needed."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("--rescore", required=True, help="a directory written by measure(dump_dir=...)")
    ap.add_argument("--chip", choices=devices.CHIPS)
    ap.add_argument("--json", help="write the rows to this JSON file")
    ap.add_argument("--top", type=int, default=3, help="byte consumers listed per failing row")
    args = ap.parse_args(argv)
    rows = rescore(args.rescore, args.chip)
    if not rows:
        print(f"no dumped cases in {args.rescore}", file=sys.stderr)
        return 1
    for chip in sorted({r["chip"] for r in rows}):
        mine = [r for r in rows if r["chip"] == chip]
        print(f"\n{chip}, shape {mine[0]['shape']}, bf16; bytes per decode round in GB; kernels = launches per "
              f"round; temp/output/cache/peak = device memory (GB)")
        print(LEGEND)
        print(table(mine))
        if args.top:
            print(f"\ntop {args.top} consumers of `other` bytes (beyond weights, K/V reads and cache writes) of the "
                  f"failing rows, GB per round:")
            print(top_table(mine, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
