"""Verification rules side by side: exact expected accepted drafts, and per-call cost on CPU.

    python -m jspec.benchmarks.verify_cost [--repeats 50]

Table 1: expected accepted draft tokens per round, computed exactly (jspec.verify.exact: every draft
and every coin integrated; no sampling) on three fixed (p, q) families from the tests:
  sun-toy    V=2, g=2, p = (1/3, 2/3), q = (2/3, 1/3) at both positions (Sun et al. 2024);
  dirichlet  V=5, g=3, context-dependent flat-Dirichlet p and q (seed 0);
  served     V=5, g=3, random logits through served_logprobs (target T=0.8, top-k 4, top-p 0.9;
             drafter T=1.3, top-k 3, top-p 0.95; seed 1), so both sides zero part of the vocabulary.
Chain rules verify g drafts. Greedy rows score the drafter's argmax proposals against the target's
argmax (both sides at temperature 0 on the same tables), so they are 0 or whole numbers. Tree rows use 2g nodes: two root children, each continued by a chain to depth g
(i.i.d. children from q for "sampling"; for "sampling_deterministic", the drafter's top-2 at the root
and its argmax below, DDTree style).

Table 2: one call of each rule for one row at g = 16 (trees: N = 16 nodes), V = 32768, float32, on
this machine's CPU: median of repeated timed calls after compilation, all rules measured
interleaved in one run, reported as a ratio to greedy_chain (absolute times belong to accelerators).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.verify import chain, exact, tree
from jspec.verify.sampling import SamplingParams, served_logprobs

TREE_DEPTH_TWO_BRANCHES = {2: [-1, -1, 0, 1], 3: [-1, -1, 0, 1, 2, 3]}


def families() -> dict[str, tuple[exact.Tables, int]]:
    return {
        "sun-toy": (exact.constant_tables([1 / 3, 2 / 3], [2 / 3, 1 / 3], depth=3), 2),
        "dirichlet": (exact.random_tables(np.random.default_rng(0), 5, 4, "dirichlet"), 3),
        "served": (exact.random_tables(np.random.default_rng(1), 5, 4, "served"), 3),
    }


def _greedy_chain_accepted(tables: exact.Tables, g: int) -> int:
    """greedy_chain on the drafter's own argmax draft (both sides at temperature 0)."""
    vocab, draft = tables.vocab, []
    for k in range(g):
        draft.append(int(np.argmax(tables.logq[k][exact.code(draft, vocab)])))
    rows = np.stack([tables.logp[k][exact.code(draft[:k], vocab)] for k in range(g + 1)])
    return int(chain.greedy_chain(jnp.asarray(rows), jnp.asarray(draft, jnp.int32)).n)


def _greedy_tree_accepted(tables: exact.Tables, parent, tokens) -> int:
    _, _, rows, _ = exact.enumerate_tree_drafts(tables, parent, tokens)
    depth = [len(p) for p in exact.tree_paths(parent)]
    res = tree.greedy_tree(jnp.asarray(rows[0]), jnp.asarray(tokens, jnp.int32), jnp.asarray(parent, jnp.int32),
                           jnp.asarray(depth, jnp.int32))
    return int(res.n)


def _ddtree_tokens(tables: exact.Tables, parent) -> list[int]:
    """Top-2 drafter tokens at the root, then the drafter's argmax along each branch."""
    vocab, paths, tokens = tables.vocab, exact.tree_paths(parent), []
    for i, pa in enumerate(parent):
        prefix = [tokens[j] for j in paths[i][:-1]]
        ranked = np.argsort(-tables.logq[len(prefix)][exact.code(prefix, vocab)], kind="stable")
        tokens.append(int(ranked[i] if pa < 0 else ranked[0]))
    return tokens


def expected_accepted_table() -> list[tuple[str, list[float]]]:
    fams = families()
    rows: dict[str, list[float]] = {}
    for tables, g in fams.values():
        parent = TREE_DEPTH_TWO_BRANCHES[g]
        results = {
            "greedy_chain (T=0)": _greedy_chain_accepted(tables, g),
            "speculative_chain": exact.expected_accepted(exact.chain_outputs(chain.speculative_chain_from_coins, tables, g)),
            "block_chain": exact.expected_accepted(exact.chain_outputs(chain.block_chain_from_coins, tables, g)),
            "gumbel_chain": exact.expected_accepted(exact.gumbel_chain_outputs(tables, g)),
            "greedy_tree (T=0, 2g nodes)": _greedy_tree_accepted(tables, parent, _ddtree_tokens(tables, parent)),
            "sampling_tree iid (2g nodes)": exact.expected_accepted(
                exact.tree_outputs(tree.sampling_tree_from_coins, tables, parent, children="iid")),
            "sampling_tree deterministic (2g nodes)": exact.expected_accepted(
                exact.tree_outputs(tree.sampling_tree_from_coins, tables, parent, _ddtree_tokens(tables, parent),
                                   children="deterministic")),
        }
        for name, value in results.items():
            rows.setdefault(name, []).append(value)
    return list(rows.items())


def _inputs(g: int, vocab: int, n_nodes: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=1.0)
    target = served_logprobs(jnp.asarray(rng.normal(0, 2, (g + 1, vocab)), jnp.float32), params)
    draft_logp = served_logprobs(jnp.asarray(rng.normal(0, 2, (g, vocab)), jnp.float32), params)
    draft = jax.random.categorical(jax.random.key(seed), draft_logp).astype(jnp.int32)
    parent = np.array([-1, -1] + [i - 2 for i in range(2, n_nodes)], np.int32)  # two chains
    depth = np.zeros(n_nodes, np.int32)
    for i, pa in enumerate(parent):
        depth[i] = 1 if pa < 0 else depth[pa] + 1
    tree_target = served_logprobs(jnp.asarray(rng.normal(0, 2, (n_nodes + 1, vocab)), jnp.float32), params)
    tree_q = served_logprobs(jnp.asarray(rng.normal(0, 2, (n_nodes + 1, vocab)), jnp.float32), params)
    tokens = jnp.asarray(rng.integers(0, vocab, n_nodes), jnp.int32)
    return target, draft, draft_logp, tree_target, tokens, jnp.asarray(parent), jnp.asarray(depth), tree_q


def cost_table(g: int = 16, vocab: int = 32768, repeats: int = 50) -> list[tuple[str, float, float]]:
    target, draft, draft_logp, tt, tokens, parent, depth, tq = _inputs(g, vocab, g)
    seed, pos0 = jnp.int32(3), jnp.int32(100)
    calls = {
        "greedy_chain": (jax.jit(chain.greedy_chain), (target, draft)),
        "speculative_chain": (jax.jit(chain.speculative_chain), (target, draft, draft_logp, seed, pos0)),
        "block_chain": (jax.jit(chain.block_chain), (target, draft, draft_logp, seed, pos0)),
        "gumbel_chain": (jax.jit(chain.gumbel_chain), (target, draft, seed, pos0)),
        "greedy_tree": (jax.jit(tree.greedy_tree), (tt, tokens, parent, depth)),
        "gumbel_tree": (jax.jit(tree.gumbel_tree), (tt, tokens, parent, depth, seed, pos0)),
        "sampling_tree iid": (jax.jit(tree.sampling_tree), (tt, tokens, parent, depth, tq, seed, pos0)),
        "sampling_tree deterministic": (jax.jit(tree.sampling_tree_deterministic), (tt, tokens, parent, depth, seed, pos0)),
    }
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))  # compile
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["greedy_chain"])
    return [(name, statistics.median(t) / base, statistics.median(t) * 1e3) for name, t in times.items()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per rule (median reported)")
    args = parser.parse_args(argv)

    names = list(families())
    print("Expected accepted draft tokens per round (exact enumeration)")
    print(f"| rule | {' | '.join(names)} |")
    print("|---|" + "---:|" * len(names))
    for rule, values in expected_accepted_table():
        print(f"| {rule} | {' | '.join(f'{v:.4f}' for v in values)} |")
    print("sun-toy reference: token-wise 10/9 = 1.1111, block 11/9 = 1.2222")
    print()
    print(f"Cost of one call, g = 16 (trees N = 16), V = 32768, float32, {jax.devices()[0].platform.upper()}, "
          f"median of {args.repeats} interleaved calls after compile")
    print("| rule | ratio to greedy_chain | median ms (this machine) |")
    print("|---|---:|---:|")
    for name, ratio, ms in cost_table(repeats=args.repeats):
        print(f"| {name} | {ratio:.2f} | {ms:.3f} |")


if __name__ == "__main__":
    main()
