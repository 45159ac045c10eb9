"""One interface over the target families: dense transformers (Llama / Qwen3) and hybrid recurrent
models (Qwen3-Next / Qwen3.5). The decode loops call only these functions.

Recurrent state is the one difference the loops see: a verify pass keeps the state after each of its
tokens (`keep_states`) and `commit_states` makes the accepted one current; `lengths` tells a pass how
many of each row's tokens may advance the recurrent state (padding and finished rows advance nothing).
For dense models these arguments change nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.models import hybrid, transformer
from jspec.models.attention import KV_CHUNK, move_rows_all_layers, read_rows, write_rows
from jspec.models.layers import rms_norm, zc_rms_norm


def is_hybrid(cfg) -> bool:
    return isinstance(cfg, hybrid.HybridConfig)


def init_cache(cfg, batch: int, size: int, dtype=jnp.float32):
    return (hybrid.HybridCache if is_hybrid(cfg) else transformer.KVCache).zeros(cfg, batch, size, dtype)


def forward(params, cfg, tokens, positions, cache, *, ctx_len=None, cache_rows=None, tree_mask=None, taps=(),
            parent=None, keep_states=False, lengths=None, attention="reference", kv_chunk=KV_CHUNK):
    """(hidden [B, T, D], cache, taps or None, per-position recurrent states or None).

    attention selects the tree-attention kernel of dense targets (jspec.kernels); hybrid targets use
    their reference attention. kv_chunk: dense targets' attention chunk (None = one block over the
    cache, for training passes)."""
    if is_hybrid(cfg):
        out = hybrid.forward(params, cfg, tokens, positions, cache, ctx_len=ctx_len, cache_rows=cache_rows,
                             tree_mask=tree_mask, taps=taps, parent=parent if keep_states else None,
                             keep_states=keep_states, lengths=None if keep_states else lengths)
        return out.hidden, out.cache, out.taps, out.states
    out = transformer.forward(params, cfg, tokens, positions, cache, ctx_len=ctx_len, cache_rows=cache_rows,
                              tree_mask=tree_mask, taps=taps, attention=attention, kv_chunk=kv_chunk)
    return out.hidden, out.cache, out.taps, None


def declarations(cfg):
    """Every parameter's declaration (jspec.models.declare) of a dense or hybrid model."""
    return (hybrid if is_hybrid(cfg) else transformer).declarations(cfg)


def keep_recurrent_state(cache, source):
    """`cache` with the recurrent state (conv windows, GDN states) of `source`; dense caches have none."""
    if not is_hybrid_cache(cache):
        return cache
    return dataclasses.replace(cache, conv=source.conv, ssm=source.ssm)


def is_hybrid_cache(cache) -> bool:
    return isinstance(cache, hybrid.HybridCache)


def logits(params, cfg, hidden):
    return (hybrid.logits if is_hybrid(cfg) else transformer.logits)(params, cfg, hidden)


def final_norm(params, cfg, x):
    """The target's final norm (what its forward applies after the last layer) of last-layer outputs x."""
    return (zc_rms_norm if is_hybrid(cfg) else rms_norm)(x, params["final_norm"], cfg.rms_norm_eps)


def commit_states(cfg, cache, states, index, live):
    """Rows where live [B]: the recurrent state after pass token `index` [B] becomes current; other rows
    keep their state. No-op for dense models."""
    if not is_hybrid(cfg):
        return cache
    new = hybrid.commit_states(cache, states, jnp.maximum(index, 0))
    keep = lambda a, b: jnp.where(live.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
    return dataclasses.replace(cache, conv=tuple(map(keep, new.conv, cache.conv)),
                               ssm=tuple(map(keep, new.ssm, cache.ssm)))


def compact_rows(cache, dst, src, start, span: int):
    """Copy attention K/V rows src -> dst [B, D] (tree path compaction); recurrent state untouched.

    dst is consecutive per row (the path's final rows) and every src lies in the span rows start[b] ..
    start[b] + span - 1 (the tree pass's rows). Dense and hybrid caches hold one [B, Hkv, S, Dh] buffer
    per attention layer; each row reads its span as one block (`attention.read_rows`), picks the path
    from it and writes the path back as one block (`attention.write_rows`): never a gather or scatter
    of single cache rows (see `attention.write_block`)."""
    def move(x):
        first = jnp.clip(start, 0, x.shape[2] - span)  # where read_rows starts each row's block
        pick = (src - first[:, None])[:, None, :, None]  # [B, 1, D, 1] rows within the block
        path = jnp.take_along_axis(read_rows(x, first, span), pick, axis=2)  # [B, Hkv, D, Dh]
        return write_rows(x, jnp.swapaxes(path, 1, 2), dst)

    if getattr(cache, "stacked", False):  # a layer_loop "scan" cache: every layer's rows in one block per row
        move_all = lambda x: move_rows_all_layers(x, dst, src, start, span)  # noqa: E731
        return dataclasses.replace(cache, k=move_all(cache.k), v=move_all(cache.v))
    return dataclasses.replace(cache, k=tuple(map(move, cache.k)), v=tuple(map(move, cache.v)))


def pad_states(states, width: int):
    """Pad per-position states ([B, T, ...] per layer) along the pass axis to `width` (budgeted passes
    of several widths)."""
    if states is None:
        return None
    return jax.tree_util.tree_map(
        lambda x: jnp.pad(x, [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2)), states)
