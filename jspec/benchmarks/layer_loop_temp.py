"""Unrolled layers or a layer scan: temp memory and code size of a decode loop on a compile-only chip.

    .venv-aot/bin/python -m jspec.benchmarks.layer_loop_temp [--chip tpu-v5p] [--layers 36] [--tokens 33]

The measurement behind ModelConfig.layer_loop: on XLA:CPU and XLA:GPU a `lax.scan` over stacked weights
copies each sliced matrix before its matmul, so jspec unrolls its decoder layers there over per-layer
weights ("unroll"). XLA:TPU slices inside its matmul fusions instead, and there the unrolled loop pays
in temp memory: the compiler keeps a slot per tuple-shaped value and per reduction scalar
(jspec.aot.temp), and an unrolled program has one set per layer; TPU targets scan ("scan"). This
stand-alone probe compiles the same decode loop both ways at Qwen3-8B's layer shape
(bf16, batch 1, a 4096-row cache, T new tokens a round, plain causal attention over the cache, argmax of
the last row's logits) and prints memory_analysis() with the temp split into data, tuple tables and
slots outside the temp block, the copies of at least 1 MB in the program, and the HBM bytes a round
moves (jspec.aot.hlo_bytes: the scan's nested loop counted once per layer):

  unroll  per-layer weight and cache arrays, a Python loop over them (jspec's CPU / GPU layout);
  scan    stacked [L, ...] weights and caches, `lax.scan` over the layer index, the caches in the carry
          and each layer's new K/V rows written in place (dynamic-update-slice).

TPU chips only: XLA:GPU's copies of sliced weights are fusions, not copy instructions, and show in the
bytes a round moves (`jspec bench --aot h200`), not in this table. Needs the deviceless compilers
(`make .venv-aot/.done`); no device, no times.
"""

from __future__ import annotations

import argparse

from jspec.aot import devices

# Qwen3-8B
D, F, HQ, HKV, DH, V = 4096, 12288, 32, 8, 128, 151936
SHAPES = {"attn_norm": (D,), "wq": (HQ * DH, D), "wk": (HKV * DH, D), "wv": (HKV * DH, D), "q_norm": (DH,),
          "k_norm": (DH,), "wo": (D, HQ * DH), "mlp_norm": (D,), "w_gate": (F, D), "w_up": (F, D), "w_down": (D, F)}


def program(layout: str, layers: int, tokens: int, cache_rows: int):
    """The decode loop and its abstract arguments (params, caches, token, rounds)."""
    import jax
    import jax.numpy as jnp

    dt = jnp.bfloat16

    def rms(x, w):
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)).astype(dt) * w

    def layer(h, lp, write, row0):
        """One Qwen3 layer; write(k, v) stores the new rows and returns this layer's K/V caches."""
        b, t = h.shape[:2]
        x = rms(h, lp["attn_norm"])
        q = rms((x @ lp["wq"].T).reshape(b, t, HQ, DH), lp["q_norm"])
        k = rms((x @ lp["wk"].T).reshape(b, t, HKV, DH), lp["k_norm"]).transpose(0, 2, 1, 3)
        v = (x @ lp["wv"].T).reshape(b, t, HKV, DH).transpose(0, 2, 1, 3)
        kc, vc = write(k, v)
        s = jnp.einsum("btgrd,bgsd->bgrts", q.reshape(b, t, HKV, HQ // HKV, DH), kc,
                       preferred_element_type=jnp.float32)
        s = jnp.where(jnp.arange(cache_rows)[None, :] <= (row0 + jnp.arange(t))[:, None], s, -jnp.inf)
        o = jnp.einsum("bgrts,bgsd->btgrd", jax.nn.softmax(s, -1).astype(dt), vc).reshape(b, t, HQ * DH)
        h = h + o @ lp["wo"].T
        x = rms(h, lp["mlp_norm"])
        return h + (jax.nn.silu(x @ lp["w_gate"].T) * (x @ lp["w_up"].T)) @ lp["w_down"].T

    def put(cache, rows, index):
        return jax.lax.dynamic_update_slice(cache, rows.astype(dt), index)

    def forward(params, cache, tokens_in, row0):
        h = params["embed"][tokens_in]
        if layout == "unroll":
            ks, vs = [], []
            for lp, kc, vc in zip(params["layers"], *cache, strict=True):
                def write(k, v, kc=kc, vc=vc):
                    ks.append(put(kc, k, (0, 0, row0, 0)))
                    vs.append(put(vc, v, (0, 0, row0, 0)))
                    return ks[-1], vs[-1]
                h = jax.lax.optimization_barrier(layer(h, lp, write, row0))
            cache = (ks, vs)
        else:
            def body(carry, i):
                h, kall, vall = carry
                lp = jax.tree.map(lambda a: a[i], params["layers"])
                new = {}

                def write(k, v):
                    new["k"] = put(kall, k[None], (i, 0, 0, row0, 0))
                    new["v"] = put(vall, v[None], (i, 0, 0, row0, 0))
                    return new["k"][i], new["v"][i]

                h = layer(h, lp, write, row0)
                return (h, new["k"], new["v"]), None

            (h, kall, vall), _ = jax.lax.scan(body, (h, *cache), jnp.arange(layers))
            cache = (kall, vall)
        logits = (rms(h[:, -1], 1.0) @ params["lm_head"].T).astype(jnp.float32)
        return jnp.argmax(logits, -1).astype(jnp.int32), cache

    def loop(params, cache, token, rounds):
        def body(state):
            i, token, cache = state
            token, cache = forward(params, cache, jnp.broadcast_to(token[:, None], (1, tokens)), 64 + i * tokens)
            return i + 1, token, cache

        _, token, cache = jax.lax.while_loop(lambda s: s[0] < rounds, body, (0, token, cache))
        return token, cache

    sds = lambda shape, dtype=dt: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    cache_shape = (1, HKV, cache_rows, DH)
    if layout == "unroll":
        stack = [{n: sds(s) for n, s in SHAPES.items()} for _ in range(layers)]
        cache = ([sds(cache_shape)] * layers, [sds(cache_shape)] * layers)
    else:
        stack = {n: sds((layers, *s)) for n, s in SHAPES.items()}
        cache = (sds((layers, *cache_shape)), sds((layers, *cache_shape)))
    params = {"embed": sds((V, D)), "lm_head": sds((V, D)), "layers": stack}
    return loop, (params, cache, sds((1,), jnp.int32), sds((), jnp.int32))


def measure(chip: str, layout: str, layers: int, tokens: int, cache_rows: int) -> dict:
    import jax

    from jspec.aot import hlo_bytes, temp

    dev = devices.aot_device(chip)
    loop, args = program(layout, layers, tokens, cache_rows)
    with jax.default_device(dev):
        lowered = jax.jit(loop, donate_argnums=(1,)).lower(*devices.abstract(args, dev))
        compiled, split = temp.compile_and_split(lowered)
    text = compiled.as_text()
    module = hlo_bytes.parse_module(text)
    big_copies = sum(ins.opcode == "copy" and hlo_bytes.hbm_bytes(ins.shape) >= 1 << 20
                     for comp in module.computations.values() for ins in comp.instrs.values())
    return {"layout": layout, **split, "code": compiled.memory_analysis().generated_code_size_in_bytes,
            "big_copies": big_copies, "round": hlo_bytes.decode_loop_bytes(text).total}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chip", default="tpu-v5p", choices=[c for c in devices.CHIPS if devices.is_tpu(c)])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--tokens", type=int, default=33, help="new tokens a round (33: a 32-node tree's verify pass)")
    ap.add_argument("--cache-rows", type=int, default=4096)
    args = ap.parse_args(argv)
    print(f"{args.chip}, Qwen3-8B layer shape, {args.layers} layers, batch 1, {args.tokens} tokens a round, "
          f"{args.cache_rows}-row bf16 cache")
    print(f"{'layout':8} {'temp MB':>8} {'data':>7} {'tables':>7} {'outside':>8} {'code MB':>8} "
          f"{'copies >= 1 MB':>15} {'GB/round':>9}")
    mb = lambda x: x / 1e6  # noqa: E731
    for layout in ("unroll", "scan"):
        r = measure(args.chip, layout, args.layers, args.tokens, args.cache_rows)
        print(f"{layout:8} {mb(r['temp']):8.1f} {mb(r['data']):7.1f} {mb(r['tables']):7.1f} {mb(r['outside']):8.1f} "
              f"{mb(r['code']):8.1f} {r['big_copies']:15d} {r['round'] / 1e9:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
