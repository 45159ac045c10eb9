"""Speculative decoding in one compiled `lax.while_loop`: propose -> verify pass -> accept -> commit.

Per round and row (DESIGN.md, "One round"): the drafter proposes a chain [g] or a tree [N] below the
pending anchor (the last committed token, whose target K/V is not cached yet); the target runs
[anchor, proposals] in one pass at positions length - 1 + depth (causal for chains, ancestor-only
for trees), writing K/V into rows length - 1 ...; a pure verification rule returns the accepted count
n and a correction-or-bonus token; the anchor and the n accepted rows become target history (a tree's
accepted path is first compacted into consecutive rows), the correction/bonus becomes the next anchor.
Rows past the committed length are never read: the mask only admits rows < length - 1 plus the
current pass's own rows.

The cache holds cache_size + verify-width rows so a verify pass never writes outside it; the text
buffer holds cache_size tokens and a row stops when it is full.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.decode import ar
from jspec.drafters.base import CommitInfo, DraftContext, Drafter, PrefillInfo
from jspec.models import target as tm
from jspec.models.config import ModelConfig
from jspec.verify import budget
from jspec.verify.rules import get_rule
from jspec.verify.sampling import log_softmax_at, served_logprobs


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """decode: the shared decoding settings; verifier: a registered rule's name (jspec.verify.rules).

    sps: the non-anticipating verification budget (chains whose drafter reports confidences, e.g.
    DSpark): sps[m] = profiled verify rounds per second with m draft tokens verified across the batch
    (jspec.verify.budget). Each round then verifies only the chosen prefix of each row, and the verify
    pass runs at the smallest width bucket (1, 2, 4, ..., g drafts) that covers the longest chosen
    prefix: its cost shrinks with the budget, while rows with shorter prefixes stay padded to the bucket
    (their extra rows are ignored by the rule and never committed).
    """

    decode: ar.DecodeConfig
    verifier: str
    sps: tuple[float, ...] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecStats:
    """On-device counters, per row; a round counts for a row only while the row is live."""

    rounds: jax.Array  # [B]
    committed: jax.Array  # [B] tokens kept by rounds (the prefill's first token excluded)
    accepted: jax.Array  # [B] accepted drafts (before EOS / budget truncation)
    hist: jax.Array  # [B, D + 1] rounds by accepted count n
    per_position: jax.Array  # [B, D] rounds whose draft at depth i + 1 was accepted
    verified: jax.Array  # [B] drafts the target verified (less than rounds x g under a verify budget)
    loop_rounds: jax.Array  # [] iterations of the while_loop

    @classmethod
    def zeros(cls, b: int, d: int) -> "SpecStats":
        z = jnp.zeros((b,), jnp.int32)
        return cls(z, z, z, jnp.zeros((b, d + 1), jnp.int32), jnp.zeros((b, d), jnp.int32), z,
                   jnp.zeros((), jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    core: ar.ARState  # text buffer, lengths, seeds, done flags, target cache
    draft: object  # the drafter's state pytree
    stats: SpecStats


def ancestor_mask(parent: jax.Array) -> jax.Array:
    """[B, N+1, N+1] bool over [anchor, nodes]: row i sees itself and its ancestors (anchor = index 0)."""
    b, n = parent.shape
    anc = jnp.broadcast_to(jnp.eye(n + 1, dtype=bool), (b, n + 1, n + 1))
    rows = jnp.arange(b)

    def add(i, anc):  # parents precede children, so row parent+1 is complete when row i+1 is built
        par = parent[:, i] + 1
        return anc.at[:, i + 1].set(anc[:, i + 1] | anc[rows, par])

    return jax.lax.fori_loop(0, n, add, anc)


def width_buckets(g: int) -> tuple[int, ...]:
    """Draft counts a budgeted verify pass may run at: powers of two below g, and g."""
    return tuple(sorted({1 << i for i in range(g.bit_length()) if (1 << i) < g} | {g}))


def _verify_pass(params, cfg, drafter, scfg, core, vt):
    """Target forward over vt [B, w+1] = [anchor, drafts] at positions length - 1 + i; keeps the
    recurrent state after every token (hybrid targets) for the commit."""
    positions = core.length[:, None] - 1 + jnp.arange(vt.shape[1])[None]
    hidden, cache, taps, states = tm.forward(params, cfg, vt, positions, core.cache, taps=drafter.taps,
                                             keep_states=True, attention=scfg.decode.attention)
    return tm.logits(params, cfg, hidden), hidden, cache, taps, states


def _verify_chain(params, cfg, drafter, scfg, core, prop, anchor):
    g = drafter.num_drafts
    b = anchor.shape[0]
    vt = jnp.concatenate([anchor[:, None], prop.tokens], axis=1)
    lengths = prop.length  # drafts proposed per row (a drafter that decides while drafting), or None
    if scfg.sps is not None and prop.confidence is not None:
        live_conf = jnp.where(core.done[:, None], 0.0, prop.confidence)  # finished rows take no budget
        chosen = budget.choose_verify_lengths(live_conf, jnp.asarray(scfg.sps, jnp.float32))
        lengths = chosen if lengths is None else jnp.minimum(chosen, lengths)
    if lengths is not None:
        buckets = width_buckets(g)

        def at_width(w):
            def run(cache):
                logits, hidden, cache, taps, states = _verify_pass(
                    params, cfg, drafter, scfg, dataclasses.replace(core, cache=cache), vt[:, : w + 1])
                pad = g - w  # rows past the bucket: never read, since every row's length <= w
                logits = jnp.pad(logits, ((0, 0), (0, pad), (0, 0)))
                hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
                taps = None if taps is None else jnp.pad(taps, ((0, 0), (0, 0), (0, pad), (0, 0)))
                return logits, hidden, cache, taps, tm.pad_states(states, g + 1)
            return run

        branch = jnp.searchsorted(jnp.asarray(buckets), jnp.max(lengths))
        logits, hidden, cache, taps, states = jax.lax.switch(branch, [at_width(w) for w in buckets], core.cache)
    else:
        logits, hidden, cache, taps, states = _verify_pass(params, cfg, drafter, scfg, core, vt)
    logp = served_logprobs(logits, scfg.decode.sampling)
    res = get_rule(scfg.verifier).verify_chain(logp, prop.tokens, prop.q_logp, core.seeds, core.length, lengths)
    i = jnp.arange(g + 1)[None]
    drafts = jnp.concatenate([prop.tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = jnp.where(i < res.n[:, None], drafts, res.token[:, None])
    emitted_logp = (log_softmax_at(logits, emitted) if scfg.decode.sampling.greedy
                    else jnp.take_along_axis(logp, emitted[..., None], axis=-1)[..., 0])
    verified = jnp.full((b,), g, jnp.int32) if lengths is None else lengths
    state_index = jnp.arange(g + 1)[None].repeat(b, 0)  # pass token i carries the state after draft i
    return res.n, emitted, emitted_logp, cache, taps, hidden, verified, states, state_index


def _verify_tree(params, cfg, drafter, scfg, core, prop, anchor):
    n_nodes, depth_max = drafter.num_drafts, drafter.max_depth
    b = anchor.shape[0]
    rows = jnp.arange(b)[:, None]
    vt = jnp.concatenate([anchor[:, None], prop.tokens], axis=1)
    depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), prop.depth], axis=1)
    positions = core.length[:, None] - 1 + depth
    cache_rows = core.length[:, None] - 1 + jnp.arange(n_nodes + 1)[None]
    pass_parent = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), prop.parent + 1], axis=1)
    hidden, cache, taps, states = tm.forward(params, cfg, vt, positions, core.cache, ctx_len=core.length - 1,
                                             cache_rows=cache_rows, tree_mask=ancestor_mask(prop.parent),
                                             taps=drafter.taps, parent=pass_parent, keep_states=True,
                                             attention=scfg.decode.attention)
    # Logits node-major ([N+1, B, V], from the transposed hidden states): the rules walk the tree one
    # node at a time, reading that node's row of every batch row, which is then one contiguous block.
    # Batch-major, XLA:TPU relaid the served [B, N+1, V] log-probabilities out once more for the walk.
    logits = jnp.swapaxes(tm.logits(params, cfg, jnp.swapaxes(hidden, 0, 1)), 0, 1)
    logp = served_logprobs(logits, scfg.decode.sampling)
    res = get_rule(scfg.verifier).verify_tree(logp, prop.tokens, prop.parent, prop.depth, prop.q_logp, core.seeds,
                                              core.length, drafter.tree_children)
    path = res.path[:, :depth_max]  # accepted nodes by depth, -1 past n
    j = jnp.arange(depth_max)[None]
    on_path = j < res.n[:, None]
    safe_path = jnp.where(on_path, path, 0)
    emitted = jnp.concatenate([jnp.where(on_path, prop.tokens[rows, safe_path], 0), jnp.zeros((b, 1), jnp.int32)], 1)
    emitted = jnp.where(jnp.arange(depth_max + 1)[None] == res.n[:, None], res.token[:, None], emitted)
    # Verify row whose distribution chose emitted token j: the anchor's for j = 0, else the parent node's.
    src_row = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), safe_path + 1], axis=1)
    emitted_logp = (log_softmax_at(logits[rows, src_row], emitted) if scfg.decode.sampling.greedy
                    else logp[rows, src_row, emitted])
    # Compact the accepted path: node path[j] (row length + path[j]) moves to row length + j.
    dst = core.length[:, None] + j
    src = jnp.where(on_path, core.length[:, None] + safe_path, dst)
    cache = tm.compact_rows(cache, dst, src, core.length, n_nodes)  # every src is a node row
    taps = None if taps is None else taps[:, rows, src_row]
    # Pass token carrying the state after emitted-order position j: the anchor, then the path nodes.
    return (res.n, emitted, emitted_logp, cache, taps, hidden[rows, src_row], jnp.full((b,), n_nodes, jnp.int32),
            states, src_row)


def spec_round(params, dparams, cfg: ModelConfig, drafter: Drafter, scfg: SpecConfig, state: SpecState) -> SpecState:
    core = state.core
    ctx = DraftContext(core.tokens, core.length, core.seeds, params, target_cfg=cfg,
                       policy=get_rule(scfg.verifier).draft_policy, sampling=scfg.decode.sampling,
                       target_cache=core.cache)
    prop, dstate = drafter.propose(dparams, state.draft, ctx)
    anchor = jnp.take_along_axis(core.tokens, (core.length - 1)[:, None], axis=1)[:, 0]
    verify = _verify_tree if drafter.kind == "tree" else _verify_chain
    n, emitted, emitted_logp, cache, taps, hidden, verified, states, state_index = verify(
        params, cfg, drafter, scfg, core, prop, anchor)

    live = ~core.done
    new_core, kept = ar.append_tokens(dataclasses.replace(core, cache=cache), emitted, emitted_logp, n + 1,
                                      scfg.decode)
    # The committed history ends at the last kept token before the new anchor: kept - 1 in emitted order.
    idx = jnp.take_along_axis(state_index, jnp.maximum(kept - 1, 0)[:, None], axis=1)[:, 0]
    new_core = dataclasses.replace(new_core, cache=tm.commit_states(cfg, new_core.cache, states, idx, kept > 0))
    new_core = dataclasses.replace(new_core, steps=core.steps + 1)
    dstate = drafter.commit(dparams, dstate, CommitInfo(new_core.tokens, core.length, new_core.length, taps, hidden))

    s = state.stats
    d = s.per_position.shape[1]
    livei = live.astype(jnp.int32)
    stats = SpecStats(
        rounds=s.rounds + livei,
        committed=s.committed + kept,
        accepted=s.accepted + livei * n,
        hist=s.hist + livei[:, None] * jax.nn.one_hot(n, d + 1, dtype=jnp.int32),
        per_position=s.per_position + livei[:, None] * (jnp.arange(d)[None] < n[:, None]).astype(jnp.int32),
        verified=s.verified + livei * verified,
        loop_rounds=s.loop_rounds + 1,
    )
    return SpecState(new_core, dstate, stats)


def start(params, dparams, cfg: ModelConfig, drafter: Drafter, dcfg: ar.DecodeConfig, prompts, prompt_len,
          seeds) -> SpecState:
    """The loop's set-up, before its first round: the target's prefill of the prompts (right-padded
    [B, P]) with the drafter's taps, into a cache with room for a verify pass past the text, then the
    drafter's init. Benchmarks time exactly this as the set-up cost."""
    width = drafter.num_drafts + 1
    dcfg = dataclasses.replace(dcfg, scratch_rows=width)
    core, taps = ar.prefill(params, cfg, dcfg, prompts, prompt_len, seeds, taps=drafter.taps)
    # The drafter's context caches get the target's aligned row count (ar.CACHE_ROW_ALIGN): for an
    # unaligned one (a [B, S, Hkv * Dh] DFlash cache of 4096 + 33 rows) XLA:TPU's default layout puts the
    # batch inside the rows, unlike the layout the loop's kernels read, and the loop's caches are relaid
    # at the program's end: a second copy of them in temp memory.
    dstate = drafter.init(dparams, PrefillInfo(prompts, prompt_len, taps, target_params=params, target_cfg=cfg),
                          dcfg.cache_rows)
    return SpecState(core, dstate, SpecStats.zeros(prompts.shape[0], drafter.max_depth))


def _generate(params, dparams, cfg: ModelConfig, drafter: Drafter, scfg: SpecConfig, request: ar.Request, prompts,
              prompt_len, seeds):
    scfg = dataclasses.replace(scfg, decode=scfg.decode.with_request(request))
    state = start(params, dparams, cfg, drafter, scfg.decode, prompts, prompt_len, seeds)
    return jax.lax.while_loop(lambda s: ~jnp.all(s.core.done),
                              lambda s: spec_round(params, dparams, cfg, drafter, scfg, s), state)


generate_spec = ar.RequestJit(_generate, 4, static_argnums=(2, 3, 4))
"""generate_spec(params, dparams, cfg, drafter, scfg, prompts [B, P], prompt_len [B], seeds [B]) -> SpecState;
one compilation per (shapes, drafter, rule, greedy), whatever max_new_tokens and the sampling values."""
