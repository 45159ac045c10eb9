"""Committing a hybrid (Gated DeltaNet) target after a verify pass: per-position states vs replay.

    python -m jspec.benchmarks.hybrid_commit [--drafts 16] [--accepted 7]

Per-position states (what jspec does): the verify pass over [anchor, g drafts] keeps the recurrent
state after every token and the commit gathers one. Replay: the verify pass keeps nothing, and after
verification the accepted n + 1 tokens are run again from the pre-round state. Both timed inside
compiled loops of 16 calls on a small random Qwen3-Next-shaped model (batch 1); medians of repeats.
Also prints the per-row memory of both strategies for a Qwen3-Next-80B-shaped GDN layer.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jspec.decode.profile import median_seconds
from jspec.models import hybrid

INNER = 16
SMALL = hybrid.HybridConfig(
    family="qwen3_next", vocab_size=4096, hidden_size=256, num_layers=4,
    layer_types=("linear_attention",) * 3 + ("full_attention",), num_heads=4, num_kv_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, intermediate_size=768, tie_word_embeddings=True,
)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", type=int, default=16)
    ap.add_argument("--accepted", type=int, default=7)
    ap.add_argument("--context", type=int, default=128)
    args = ap.parse_args(argv)
    cfg, t, n = SMALL, args.drafts + 1, args.accepted
    params = hybrid.init_params(cfg, jax.random.key(0), std=0.05)
    cache = hybrid.HybridCache.zeros(cfg, 1, args.context + t + 1)
    pos = args.context + jnp.arange(t)[None]

    def per_position(_, carry):
        cache, tok = carry
        out = hybrid.forward(params, cfg, tok, pos, cache, keep_states=True)
        cache = hybrid.commit_states(out.cache, out.states, jnp.array([n]))
        return cache, jnp.argmax(hybrid.logits(params, cfg, out.hidden), -1).astype(jnp.int32)

    def replay(_, carry):
        cache, tok = carry
        # Verify without keeping states (lengths 0: the state is not advanced), then replay the accepted
        # tokens from the pre-round state; both token by token, like the per-position pass.
        out = hybrid.forward(params, cfg, tok, pos, cache, lengths=jnp.array([0]), gdn_impl="recurrent")
        again = hybrid.forward(params, cfg, tok[:, : n + 1], pos[:, : n + 1], out.cache, gdn_impl="recurrent")
        return again.cache, jnp.argmax(hybrid.logits(params, cfg, out.hidden), -1).astype(jnp.int32)

    tok = jnp.zeros((1, t), jnp.int32)
    a = median_seconds(jax.jit(lambda c, x: jax.lax.fori_loop(0, INNER, per_position, (c, x))[1]), (cache, tok),
                       calls=INNER)
    b = median_seconds(jax.jit(lambda c, x: jax.lax.fori_loop(0, INNER, replay, (c, x))[1]), (cache, tok), calls=INNER)
    print(f"small Qwen3-Next-shaped model (d {cfg.hidden_size}, 3 GDN + 1 attention layers), verify pass of "
          f"1 + {args.drafts} tokens, {n} accepted, batch 1, {jax.devices()[0].platform}")
    print(f"per-position states: {1e3 * a:.3f} ms per round;  replay: {1e3 * b:.3f} ms per round;  "
          f"replay / per-position = {b / a:.2f}")
    hk, hv, dk, dv, k = 16, 32, 128, 128, 4
    conv_dim = 2 * hk * dk + hv * dv
    state = hv * dk * dv * 4 + (k - 1) * conv_dim * 2
    print(f"Qwen3-Next-80B GDN layer at block 16: per-position {16 * state:,} B per row; replay inputs "
          f"{16 * (conv_dim + 2 * hv) * 4:,} B per row (q, k, v, g, beta in float32)")


if __name__ == "__main__":
    main()
