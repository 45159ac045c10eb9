"""Medusa and Hydra: extra prediction heads on the target's last hidden state, drafting chains or static trees.

Both read h, the target's final-normed hidden state at the position just before the anchor (the row whose
LM head produced the anchor). With committed text x_0 .. x_{L-1} (anchor x_{L-1}), h = h_{L-2}, and head k
(k = 0 .. K-1) guesses x_{L+k}, the token k + 1 places after the anchor: head 0 drafts the token right
after it.

**Medusa** (FasterDecoding/Medusa `medusa/model/medusa_model.py`, `MedusaModel` / `ResBlock`): head k is
`medusa_num_layers` residual blocks then a bias-free LM head of its own,

    x <- x + SiLU(W_kj x + b_kj)     (j = 0 .. L-1; W [H, H], b [H])
    logits_k = U_k x                 (U_k [V, H], initialised from the target's LM head)

The official code zero-initialises W (and builds the L blocks of a head from one repeated module, so
its files hold L identical copies); a fresh head with b = 0 is the target's LM head. Every head reads
the same h, so drafts do not depend on each other: the chain's draft k is chosen from head k's served
distribution (`Drafter.choose`), and that distribution is the q of draft k whatever was drawn before
(rule 1 of DRAFTERS2.md). Defaults there: 4 heads, 1 layer.

**Hydra** (zankner/Hydra `hydra/model/hydra_heads/mlp_head.py`, `HydraMLP` with `grounded_heads`; the
config class in `hydra/model/hydra_model.py`): head k also reads the target's embeddings of the tokens
already chosen on its path, the anchor first:

    u = cat[h, E(x_{L-1}), E(d_1), .., E(d_k)]                   ((k + 2) H; d_i = draft i)
    x = R_k u + c_k + SiLU(W_k0 u + b_k0)                         (first block: a linear residual R_k)
    x <- x + SiLU(W_kj x + b_kj)                                   (j = 1 .. L-1)
    logits_k = U_k x + e_k                                         (U_k from the target's LM head, bias e_k)

(official: `ResBlock(hidden, num_condition=k + 1)`, its `res_connection` a Linear; `hydra_lm_head` are
Linears with bias; the embeddings are `base_model.model.embed_tokens` rows). Drafting is sequential:
head k runs once drafts 1 .. k are chosen, so q_k is head k's served distribution given the sampled
prefix, exactly the law of draft k + 1 given the earlier ones.

**Trees.** A static tree is a set of rank paths (the format of Medusa's `medusa_choices`): path
(r_1, .., r_d) is the node whose token is the r_d-th most likely token of head d - 1 (for Hydra: of
head d - 1 run on the path's own ancestors). Siblings are distinct top-k tokens chosen without any
randomness, so the tree is verified with the deterministic-children rule (rule 2: accept x with
probability p(x), else remove x), and no q is needed. `with_shape(block_size, tree_budget)` builds the
N most likely paths of depth <= block_size under a fixed prior in which every head's rank-r guess is
right with probability 2^-(r + 1) (a static stand-in for the acceptance statistics Medusa's released
trees, e.g. `mc_sim_7b_63`, were chosen by); any other tree is `dataclasses.replace(drafter, tree=paths)`.

**State.** Only h: `init` takes the prompt's last row from the last-layer tap (PrefillInfo.taps) after
the target's final norm; `commit` takes CommitInfo.hidden's row new_length - old_length - 1 (the last
committed row: the one that gave the new anchor). Rejected rows never enter it.

**Checkpoints.** A Medusa folder holds config.json (`medusa_num_heads`, `medusa_num_layers`) and the
head tensors in the official names of `medusa_lm_head.pt` (the state dict of the ModuleList of heads):
`{i}.{j}.linear.weight` [H, H], `{i}.{j}.linear.bias` [H], `{i}.{L}.weight` [V, H], in model.safetensors
(or medusa_lm_head.safetensors). vLLM's renaming (vllm `model_executor/models/medusa.py`,
`transformers_utils/configs/medusa.py`: config `num_heads`, `num_hidden_layers`, tensors
`[medusa_heads.]blocks.{i}.layers.{j}.weight`, `.bias` only with `medusa_fc_bias`, `lm_heads.{i}.weight`,
one shared `lm_heads.0.weight` with `original_lm_head`) loads too; jspec saves the official names. A Hydra
folder holds config.json (`hydra_num_heads`, `hydra_num_layers`, `hydra_head_arch` "mlp", `grounded_heads`
true, `hidden_state_offset` 0) and `hydra_mlp.{i}.{j}.linear.{weight,bias}`,
`hydra_mlp.{i}.0.res_connection.{weight,bias}`, `hydra_lm_head.{i}.{weight,bias}` (`hydra_lm_head.pt`).
Loading is strict: every missing, unexpected or misshapen tensor is named.

**Refused.** Medusa-2's typical acceptance (`posterior_threshold` 0.09, `posterior_alpha` 0.3: accept a
draft when the target gives it probability above min(threshold, alpha exp(-entropy))) changes the
output distribution, and jspec's rules are lossless; Hydra++'s `prefix_embeding_layer` (a one-layer
decoder over the base hidden states, `hydra_head_arch` "prefix-mlp"), Hydra's attention heads and
ungrounded heads, a `hidden_state_offset` other than 0, vLLM's `token_map` / truncated vocabulary and
`logit_scale` are not implemented and are refused by name.

**Training** (`jspec train medusa` / `jspec train hydra`): Medusa-1, per-head cross-entropy of the
distilled text on a frozen target; Hydra heads see the data tokens as their path (teacher forcing).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import os
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from jspec.drafters import ddtree
from jspec.drafters.base import CommitInfo, DraftContext, Drafter, PrefillInfo, Proposal
from jspec.drafters.family import Family, TrainRecipe, register_family
from jspec.errors import CheckpointError
from jspec.io.drafters import read_config, write_checkpoint
from jspec.io.hf import assemble, check_tensors, declared_tensors, export_tensors, read_safetensors
from jspec.models import quant
from jspec.models import target as tm
from jspec.models.declare import abstract_tree, declare, init_tree, logical_axes, shapes, unbox
from jspec.models.layers import linear, lm_logits
from jspec.train import drafter as train_drafter
from jspec.verify.sampling import served_logprobs

MEDUSA, HYDRA = "medusa", "hydra"


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
    """kind: "medusa" or "hydra"; num_heads K; num_layers L residual blocks per head (Medusa: >= 0, Hydra:
    >= 1); the target's hidden size H and vocabulary V."""

    kind: str
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int

    def __post_init__(self):
        if self.kind not in (MEDUSA, HYDRA):
            raise ValueError(f"kind {self.kind!r}: use {MEDUSA!r} or {HYDRA!r}")
        least = 1 if self.kind == HYDRA else 0
        if self.num_heads < 1 or self.num_layers < least:
            raise ValueError(f"{self.kind} needs >= 1 head and >= {least} residual layers per head, got "
                             f"{self.num_heads} heads of {self.num_layers} layers")


# --- parameters ------------------------------------------------------------------------------------


def _names(cfg: HeadsConfig, i: int, j: int | None) -> str:
    """The official tensor-name prefix of head i's block j (j None: its LM head)."""
    if cfg.kind == MEDUSA:
        return f"{i}.{cfg.num_layers}." if j is None else f"{i}.{j}."
    return f"hydra_lm_head.{i}." if j is None else f"hydra_mlp.{i}.{j}."


class _Block(nn.Module):
    """One residual block: weight [H, fan_in], bias [H] (`linear`), and for Hydra's first block the linear
    residual res_weight [H, fan_in], res_bias [H] (`res_connection`)."""

    hidden: int
    fan_in: int
    hf: str
    residual: bool
    init_std: float
    param_dtype: Any

    def setup(self):
        decl = functools.partial(declare, self, std=self.init_std, dtype=self.param_dtype)
        h, n = self.hidden, self.fan_in
        in_axis = "embed" if n == h else None
        p = {"weight": decl("weight", (h, n), ("mlp", in_axis), "normal", self.hf + "linear.weight"),
             "bias": decl("bias", (h,), ("mlp",), "normal", self.hf + "linear.bias")}
        if self.residual:
            p["res_weight"] = decl("res_weight", (h, n), ("mlp", None), "normal", self.hf + "res_connection.weight")
            p["res_bias"] = decl("res_bias", (h,), ("mlp",), "normal", self.hf + "res_connection.bias")
        self.p = p

    def declare(self):
        return self.p


class _Head(nn.Module):
    cfg: HeadsConfig
    index: int
    init_std: float
    param_dtype: Any

    def setup(self):
        c, i = self.cfg, self.index
        h, v = c.hidden_size, c.vocab_size
        hydra = c.kind == HYDRA
        self.blocks = [_Block(h, (i + 2) * h if hydra and j == 0 else h, _names(c, i, j), hydra and j == 0,
                              self.init_std, self.param_dtype, name=f"block{j}") for j in range(c.num_layers)]
        decl = functools.partial(declare, self, std=self.init_std, dtype=self.param_dtype)
        head = _names(c, i, None)
        self.lm_head = decl("lm_head", (v, h), ("vocab", "embed"), "normal", head + "weight")
        self.lm_bias = decl("lm_bias", (v,), ("vocab",), "normal", head + "bias") if hydra else None

    def declare(self):
        return [b.declare() for b in self.blocks], self.lm_head, self.lm_bias


class HeadsNet(nn.Module):
    """The K heads' parameters, declared once (`jspec.models.declare`): tree {"i": {"block{j}": {weight, bias
    [, res_weight, res_bias]}, "lm_head" [, "lm_bias"]}}, official tensor names (module docstring). The
    computation is the pure functions below."""

    cfg: HeadsConfig
    init_std: float = 0.02
    param_dtype: Any = jnp.float32

    def setup(self):
        self.heads = [_Head(self.cfg, i, self.init_std, self.param_dtype, name=str(i))
                      for i in range(self.cfg.num_heads)]

    def declare(self):
        return [h.declare() for h in self.heads]


@functools.lru_cache(maxsize=64)
def declarations(cfg: HeadsConfig, dtype=jnp.float32) -> dict:
    """Every parameter's declaration (boxes of ShapeDtypeStructs)."""
    return abstract_tree(HeadsNet(cfg, param_dtype=dtype), HeadsNet.declare)["params"]


def init_params(cfg: HeadsConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random parameters: every tensor normal(std) (tests and the conformance example)."""
    return unbox(init_tree(HeadsNet(cfg, init_std=std, param_dtype=dtype), HeadsNet.declare, key))["params"]


def fresh_params(cfg: HeadsConfig, lm_head: jax.Array, dtype=jnp.float32) -> dict:
    """The official starting point, where every head is the target's LM head: blocks at zero, head matrices
    copied from lm_head [V, H]; Hydra's first-block residual passes h through (identity on the hidden part
    of its input, zero on the embeddings; the official code leaves it at torch's random Linear init)."""
    h = cfg.hidden_size
    params = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, dtype), unbox(declarations(cfg, dtype)))
    for i in range(cfg.num_heads):
        p = params[str(i)]
        p["lm_head"] = jnp.asarray(lm_head, dtype)
        if cfg.kind == HYDRA:
            p["block0"]["res_weight"] = jnp.eye(h, (i + 2) * h, dtype=dtype)
    return params


def _block_stack(p: dict, x: jax.Array, num_layers: int) -> jax.Array:
    for j in range(num_layers):
        b = p[f"block{j}"]
        res = linear(x, b["res_weight"]) + b["res_bias"] if "res_weight" in b else x
        x = res + jax.nn.silu(linear(x, b["weight"]) + b["bias"])
    return x


def head_logits(cfg: HeadsConfig, params: dict, k: int, x: jax.Array) -> jax.Array:
    """Head k's float32 logits [..., V] of its input x [..., D_k] (Medusa: h; Hydra: cat[h, path embeddings])."""
    p = params[str(k)]
    logits = lm_logits(_block_stack(p, x, cfg.num_layers), p["lm_head"])
    return logits if cfg.kind == MEDUSA else logits + p["lm_bias"].astype(jnp.float32)


# --- static trees ----------------------------------------------------------------------------------


def default_tree(budget: int, depth: int) -> tuple[tuple[int, ...], ...]:
    """The `budget` most likely rank paths of depth <= `depth` when rank r of every head is right with
    probability 2^-(r + 1), independently (best first; ties by the paths' order)."""
    if budget < 1 or depth < 1:
        raise ValueError(f"a tree needs a budget >= 1 and a depth >= 1, got {budget} and {depth}")
    heap, out = [(1, (0,))], []
    while heap and len(out) < budget:
        cost, path = heapq.heappop(heap)  # cost = -log2 of the path's prior
        out.append(path)
        heapq.heappush(heap, (cost + 1, path[:-1] + (path[-1] + 1,)))  # next sibling
        if len(path) < depth:
            heapq.heappush(heap, (cost + 1, path + (0,)))  # first child
    return tuple(out)


def canonical_tree(paths, num_heads: int) -> tuple[tuple[int, ...], ...]:
    """Rank paths sorted by (depth, path), checked: non-empty, ranks >= 0, depth <= num_heads, no
    duplicates, every path's parent present."""
    tree = tuple(sorted((tuple(int(r) for r in p) for p in paths), key=lambda p: (len(p), p)))
    have = set(tree)
    problems = []
    if len(have) != len(tree):
        problems.append("it repeats a path")
    for p in tree:
        if not p or min(p) < 0:
            problems.append(f"path {p} is empty or has a negative rank")
        elif len(p) > num_heads:
            problems.append(f"path {p} is deeper than the {num_heads} heads")
        elif len(p) > 1 and p[:-1] not in have:
            problems.append(f"path {p} lacks its parent {p[:-1]}")
    if problems:
        raise ValueError("bad tree of rank paths (Medusa's medusa_choices format: tuples of per-head ranks, each "
                         "path's parent included): " + "; ".join(problems[:5]))
    return tree


@dataclasses.dataclass(frozen=True)
class TreeLayout:
    """Static index arrays of a canonical tree: per node parent (-1: the anchor), depth (>= 1), rank; per
    depth d: `expand[d]` the nodes at depth d - 1 that have children ([-1]: the anchor, d = 1), `path[d]`
    [E, d - 1] their ancestors from depth 1 down to themselves, `nodes[d]` the nodes at depth d, `slot[d]`
    each one's parent's index in expand[d], `top[d]` the top-k width head d - 1 needs."""

    parent: np.ndarray
    depth: np.ndarray
    rank: np.ndarray
    expand: dict
    path: dict
    nodes: dict
    slot: dict
    top: dict


@functools.lru_cache(maxsize=64)
def tree_layout(tree: tuple[tuple[int, ...], ...]) -> TreeLayout:
    """The index arrays of a canonical tree (`canonical_tree`), built once per tree on the host."""
    index = {p: n for n, p in enumerate(tree)}
    parent = np.array([index[p[:-1]] if len(p) > 1 else -1 for p in tree], np.int32)
    depth = np.array([len(p) for p in tree], np.int32)
    rank = np.array([p[-1] for p in tree], np.int32)
    expand, path, nodes, slot, top = {}, {}, {}, {}, {}
    for d in range(1, int(depth.max()) + 1):
        at = np.flatnonzero(depth == d)
        parents = sorted(set(parent[at].tolist()))
        nodes[d], expand[d] = at, np.array(parents, np.int32)
        slot[d] = np.array([parents.index(parent[n]) for n in at], np.int32)
        path[d] = np.array([[index[tree[e][:j + 1]] for j in range(d - 1)] for e in parents], np.int32).reshape(
            len(parents), d - 1)
        top[d] = int(rank[at].max()) + 1
    return TreeLayout(parent, depth, rank, expand, path, nodes, slot, top)


# --- the drafters ----------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HeadsState:
    hidden: jax.Array  # [B, H] the target's final-normed hidden state of the row before each anchor


@dataclasses.dataclass(frozen=True)
class HeadDrafter(Drafter):
    """Shared by Medusa and Hydra. cfg: the heads; target_layers: the target's layer count (its last layer
    is tapped for the prompt's hidden states); block_size: heads used per round (<= K; 0: all K), the
    chain's length; tree: rank paths of a static tree (empty: a chain)."""

    cfg: HeadsConfig | None = None
    target_layers: int = 0
    block_size: int = 0
    tree: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        if self.cfg is not None and self.tree:
            object.__setattr__(self, "tree", canonical_tree(self.tree, self.cfg.num_heads))

    @property
    def kind(self) -> str:  # type: ignore[override]
        return "tree" if self.tree else "chain"

    @property
    def depth(self) -> int:
        k = self.cfg.num_heads
        return min(self.block_size, k) if self.block_size else k

    @property
    def num_drafts(self) -> int:
        return len(self.tree) if self.tree else self.depth

    @property
    def max_depth(self) -> int:
        return max(len(p) for p in self.tree) if self.tree else self.depth

    @property
    def taps(self) -> tuple[int, ...]:
        return (self.target_layers - 1,)

    def validate(self, target_cfg, dparams) -> None:
        name = type(self).__name__
        if self.cfg is None:
            raise ValueError(f"the {name} drafter needs its heads' config: {name}(cfg=HeadsConfig(...), ...)")
        problems = []
        for what, mine, theirs in (("vocabulary", self.cfg.vocab_size, target_cfg.vocab_size),
                                   ("hidden size", self.cfg.hidden_size, target_cfg.hidden_size)):
            if mine != theirs:
                problems.append(f"its heads' {what} is {mine}, the target's {theirs}")
        if self.target_layers != target_cfg.num_layers:
            problems.append(f"it was built for a target of {self.target_layers} layers, this one has "
                            f"{target_cfg.num_layers}")
        if self.tree and max(max(p) for p in self.tree) >= self.cfg.vocab_size:
            problems.append("its tree has ranks beyond the vocabulary")
        if problems:
            raise ValueError(f"the {name} drafter does not fit the target: {'; '.join(problems)}; its heads read "
                             "the target's last hidden state: load them for the model they were trained on "
                             "(jspec.load_drafter(folder, target))")

    def param_axes(self):
        return logical_axes(declarations(self.cfg))

    def init(self, dparams, prefill: PrefillInfo, cache_size: int) -> HeadsState:
        hidden = tm.final_norm(prefill.target_params, prefill.target_cfg, prefill.taps[0])  # [B, P, H]
        last = jnp.take_along_axis(hidden, (prefill.prompt_len - 1)[:, None, None], axis=1)[:, 0]
        return HeadsState(last)

    def commit(self, dparams, state: HeadsState, info: CommitInfo) -> HeadsState:
        row = jnp.clip(info.new_length - info.old_length - 1, 0, info.hidden.shape[1] - 1)
        last = jnp.take_along_axis(info.hidden, row[:, None, None], axis=1)[:, 0]
        return HeadsState(last.astype(state.hidden.dtype))

    def _tree_proposal(self, tokens: jax.Array) -> Proposal:
        lay = tree_layout(self.tree)
        b = tokens.shape[0]
        grid = lambda a: jnp.broadcast_to(jnp.asarray(a), (b, len(a)))
        return Proposal(tokens, None, grid(lay.parent), grid(lay.depth))


@dataclasses.dataclass(frozen=True)
class Medusa(HeadDrafter):
    """Medusa heads (module docstring): every head reads h alone."""

    def propose(self, dparams, state: HeadsState, ctx: DraftContext):
        logits = jnp.stack([head_logits(self.cfg, dparams, k, state.hidden) for k in range(self.max_depth)], 1)
        if not self.tree:
            index = ctx.length[:, None] + jnp.arange(self.depth)[None]  # draft k is written at length + k
            drafts, logp = self.choose(ctx, logits, index)
            return Proposal(drafts, logp if ctx.needs_q else None), state
        lay = tree_layout(self.tree)
        _, top = ddtree.top_k(logits, max(lay.top.values()))  # [B, D, k] each head's best tokens
        return self._tree_proposal(top[:, lay.depth - 1, lay.rank]), state


@dataclasses.dataclass(frozen=True)
class Hydra(HeadDrafter):
    """Hydra heads (module docstring): head k reads h and the embeddings of the anchor and drafts 1 .. k."""

    def propose(self, dparams, state: HeadsState, ctx: DraftContext):
        embed = lambda t: quant.embed_rows(ctx.target_params["embed"], t).astype(state.hidden.dtype)
        anchor = jnp.take_along_axis(ctx.tokens, (ctx.length - 1)[:, None], axis=1)[:, 0]
        if not self.tree:
            parts, drafts, qs = [state.hidden, embed(anchor)], [], []
            for k in range(self.depth):
                token, logp = self.choose(ctx, head_logits(self.cfg, dparams, k, jnp.concatenate(parts, -1)),
                                          ctx.length + k)
                parts.append(embed(token))
                drafts.append(token)
                qs.append(logp)
            q = jnp.stack(qs, 1) if ctx.needs_q else None
            return Proposal(jnp.stack(drafts, 1), q), state
        lay = tree_layout(self.tree)
        b = anchor.shape[0]
        tokens = jnp.zeros((b, len(self.tree)), jnp.int32)
        for d in range(1, self.max_depth + 1):  # head d - 1 on every node at depth d - 1 that has children
            e = len(lay.expand[d])
            parts = [jnp.broadcast_to(x[:, None], (b, e, x.shape[-1])) for x in (state.hidden, embed(anchor))]
            parts += [embed(tokens[:, lay.path[d][:, j]]) for j in range(d - 1)]
            logits = head_logits(self.cfg, dparams, d - 1, jnp.concatenate(parts, -1))  # [B, E, V]
            _, top = ddtree.top_k(logits, lay.top[d])
            tokens = tokens.at[:, lay.nodes[d]].set(top[:, lay.slot[d], lay.rank[lay.nodes[d]]])
        return self._tree_proposal(tokens), state


# --- checkpoints -----------------------------------------------------------------------------------

# Medusa-2's typical acceptance (Medusa `medusa_generate`, vLLM's typical acceptance sampler): lossy
_TYPICAL = ("posterior_threshold", "posterior_alpha", "typical_acceptance_sampler_posterior_threshold",
            "typical_acceptance_sampler_posterior_alpha")


def refuse_typical_acceptance(hf: dict, where: str) -> None:
    """CheckpointError when a config asks for Medusa-2's typical acceptance."""
    found = [k for k in _TYPICAL if hf.get(k) is not None]
    if hf.get("spec_decoding_acceptance_method") == "typical_acceptance_sampler":
        found.append("spec_decoding_acceptance_method")
    if found:
        raise CheckpointError(
            f"{where}: {', '.join(found)} asks for Medusa-2's typical acceptance, which accepts a draft whenever the "
            "target gives it a probability above min(posterior_threshold, posterior_alpha exp(-entropy)): the text "
            "then no longer follows the target's distribution. jspec's verification rules are lossless (greedy, "
            "speculative sampling, Gumbel coupling, tree walks give the target's own output): remove the field and "
            "the heads draft under those rules")


def _read_tensors(path: str, stem: str) -> dict:
    """model.safetensors (or its shards), else the official `{stem}.safetensors`; a torch `{stem}.pt` alone is
    refused with the conversion."""
    standard = [os.path.join(path, f) for f in ("model.safetensors", "model.safetensors.index.json")]
    if not any(os.path.exists(f) for f in standard) and not any(
            n.startswith("model-") and n.endswith(".safetensors") for n in os.listdir(path)):
        own = os.path.join(path, stem + ".safetensors")
        if os.path.exists(own):
            return dict(load_file(own))
        pt = os.path.join(path, stem + ".pt")
        if os.path.exists(pt):
            raise CheckpointError(
                f"{pt} is a torch pickle, which jspec does not read: convert it once with torch and safetensors, "
                f"python -c \"import torch; from safetensors.torch import save_file; "
                f"save_file(torch.load('{pt}'), '{os.path.join(path, 'model.safetensors')}')\"")
    return read_safetensors(path)


def _check_and_assemble(found: dict, cfg: HeadsConfig, dtype, where: str, fix: str) -> dict:
    decl = declarations(cfg)
    expected = declared_tensors(decl)
    check_tensors(found, {n: e[0] for n, e in expected.items()}, where, fix)
    return assemble(found, expected, shapes(decl), dtype)


def _sizes(found: dict, hf: dict, target, head_name: str, where: str) -> tuple[int, int]:
    """(H, V): from head 0's LM head tensor, else the config, else the target."""
    if head_name in found and np.ndim(found[head_name]) == 2:
        v, h = found[head_name].shape
        return int(h), int(v)
    if "hidden_size" in hf and "vocab_size" in hf:
        return int(hf["hidden_size"]), int(hf["vocab_size"])
    if target is not None:
        return target.cfg.hidden_size, target.cfg.vocab_size
    raise CheckpointError(f"{where}: no {head_name} tensor and no hidden_size / vocab_size fields: the heads' sizes "
                          "are unknown; load the folder with its target")


def _count(hf: dict, keys: tuple[str, ...], where: str, least: int) -> int:
    key = next(k for k in keys if k in hf)
    value = hf[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise CheckpointError(f"{where}: {key} is {value!r}; it must be an integer >= {least}")
    return value


def _target_layers(hf: dict, target) -> int:
    return target.cfg.num_layers if target is not None else int(hf.get("num_target_layers", 0))


def _finish(drafter: HeadDrafter, target):
    if target is not None:
        drafter.validate(target.cfg, None)
    return drafter


_VLLM_BLOCK = re.compile(r"^(?:medusa_heads\.)?blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
_VLLM_HEAD = re.compile(r"^(?:medusa_heads\.)?lm_heads\.(\d+)\.weight$")


def _is_medusa(hf: dict) -> bool:
    archs = hf.get("architectures") or ()
    return "medusa_num_heads" in hf or hf.get("model_type") == "medusa" or "MedusaModel" in archs


def _medusa_counts(hf: dict, where: str) -> tuple[int, int]:
    """(K, L): Medusa's `medusa_num_heads` / `medusa_num_layers` (defaults 4 / 1, `MedusaConfig`), else
    vLLM's `num_heads` / `num_hidden_layers` (a Medusa-2 config.json also holds the base model's
    num_hidden_layers, so the medusa_ names come first)."""
    if "medusa_num_heads" in hf or hf.get("model_type") != "medusa":
        heads, layers = ("medusa_num_heads",), ("medusa_num_layers",)
        hf = {"medusa_num_heads": 4, "medusa_num_layers": 1, **hf}
    else:
        heads, layers = ("num_heads",), ("num_hidden_layers",)
        hf = {"num_heads": 5, "num_hidden_layers": 1, **hf}  # vLLM's MedusaConfig defaults
    return _count(hf, heads, where, 1), _count(hf, layers, where, 0)


def _from_vllm(found: dict, hf: dict, k: int, layers: int, where: str) -> dict:
    """vLLM's tensor names read as the official ones (module docstring); implied zero biases filled in."""
    vocab = hf.get("vocab_size")
    truncated = hf.get("truncated_vocab_size")
    if "token_map" in found or (truncated is not None and vocab is not None and truncated < vocab):
        raise CheckpointError(f"{where}: a vLLM Medusa head over a truncated vocabulary (token_map, "
                              f"truncated_vocab_size {truncated}) is not supported: use heads over the full vocabulary")
    if hf.get("logit_scale", 1.0) != 1.0:
        raise CheckpointError(f"{where}: logit_scale {hf['logit_scale']!r} is not supported (jspec's Medusa heads have "
                              "unscaled logits): use a checkpoint without it")
    bias = bool(hf.get("medusa_fc_bias", False))
    out = {}
    for name, t in found.items():
        m, h = _VLLM_BLOCK.match(name), _VLLM_HEAD.match(name)
        if m and (m.group(3) == "weight" or bias):
            out[f"{m.group(1)}.{m.group(2)}.linear.{m.group(3)}"] = t
        elif h:
            out[f"{h.group(1)}.{layers}.weight"] = t
        else:
            out[name] = t  # left under its own name: reported as unexpected
    if hf.get("original_lm_head") and f"0.{layers}.weight" in out:  # one head matrix shared by every head
        out.update({f"{i}.{layers}.weight": out[f"0.{layers}.weight"] for i in range(1, k)})
    if not bias:  # vLLM's blocks have no bias unless medusa_fc_bias
        for i in range(k):
            for j in range(layers):
                w = out.get(f"{i}.{j}.linear.weight")
                if w is not None:
                    out.setdefault(f"{i}.{j}.linear.bias", np.zeros(w.shape[:1], w.dtype))
    return out


def _heads(cls, kind: str, found: dict, hf: dict, path: str, target, dtype, head_name: str, k: int, layers: int,
           fields: tuple[str, str]):
    """(drafter, params) of K heads of L layers read from `found`, checked strictly against the config."""
    h, v = _sizes(found, hf, target, head_name, os.path.join(path, "config.json"))
    cfg = HeadsConfig(kind, k, layers, h, v)
    params = _check_and_assemble(found, cfg, dtype, f"{cls.__name__} checkpoint {path!r}",
                                 f"point at {cls.__name__} heads with {fields[0]} {k} and {fields[1]} {layers}, "
                                 "or correct those fields")
    return _finish(cls(cfg=cfg, target_layers=_target_layers(hf, target)), target), params


def load_medusa(path: str, target, dtype) -> tuple[Medusa, dict]:
    """A Medusa folder (official names or vLLM's), strictly."""
    hf = read_config(path)
    where = os.path.join(path, "config.json")
    refuse_typical_acceptance(hf, where)
    k, layers = _medusa_counts(hf, where)
    found = _read_tensors(path, "medusa_lm_head")
    if any(_VLLM_BLOCK.match(n) or _VLLM_HEAD.match(n) for n in found):
        found = _from_vllm(found, hf, k, layers, where)
    return _heads(Medusa, MEDUSA, found, hf, path, target, dtype, f"0.{layers}.weight", k, layers,
                  ("medusa_num_heads", "medusa_num_layers"))


def save_medusa(path: str, drafter: Medusa, params: dict, dtype=None) -> None:
    c = drafter.cfg
    config = {"medusa_num_heads": c.num_heads, "medusa_num_layers": c.num_layers, "hidden_size": c.hidden_size,
              "vocab_size": c.vocab_size, "num_target_layers": drafter.target_layers}
    write_checkpoint(path, config, export_tensors(params, declared_tensors(declarations(c)), dtype))


def load_hydra(path: str, target, dtype) -> tuple[Hydra, dict]:
    """A Hydra folder (grounded MLP heads, official names), strictly."""
    hf = read_config(path)
    where = os.path.join(path, "config.json")
    refuse_typical_acceptance(hf, where)
    arch = hf.get("hydra_head_arch", "mlp")  # HydraConfig's defaults
    if arch != "mlp":
        what = ("Hydra++'s prefix_embeding_layer (a one-layer decoder over the base hidden states)"
                if arch == "prefix-mlp" else "attention heads")
        raise CheckpointError(f"{where}: hydra_head_arch {arch!r} ({what}) is not supported: jspec runs Hydra's MLP "
                              "heads (hydra_head_arch \"mlp\")")
    if not hf.get("grounded_heads", False):
        raise CheckpointError(f"{where}: grounded_heads is {hf.get('grounded_heads', False)!r}: ungrounded heads read "
                              "the hidden state alone (Medusa's heads, with biased LM heads), which the hydra family "
                              "does not load; Hydra's heads are grounded (grounded_heads true)")
    if hf.get("hidden_state_offset", 0) != 0:
        raise CheckpointError(f"{where}: hidden_state_offset {hf['hidden_state_offset']!r} (heads on an earlier "
                              "layer's output) is not supported: jspec's Hydra heads read the target's final-normed "
                              "hidden state (hidden_state_offset 0)")
    hf = {"hydra_num_heads": 4, "hydra_num_layers": 1, **hf}
    k, layers = _count(hf, ("hydra_num_heads",), where, 1), _count(hf, ("hydra_num_layers",), where, 1)
    found = _read_tensors(path, "hydra_lm_head")
    return _heads(Hydra, HYDRA, found, hf, path, target, dtype, "hydra_lm_head.0.weight", k, layers,
                  ("hydra_num_heads", "hydra_num_layers"))


def save_hydra(path: str, drafter: Hydra, params: dict, dtype=None) -> None:
    c = drafter.cfg
    config = {"hydra_num_heads": c.num_heads, "hydra_num_layers": c.num_layers, "hydra_head_arch": "mlp",
              "grounded_heads": True, "hidden_state_offset": 0, "hidden_size": c.hidden_size,
              "vocab_size": c.vocab_size, "num_target_layers": drafter.target_layers}
    write_checkpoint(path, config, export_tensors(params, declared_tensors(declarations(c)), dtype))


def with_shape(drafter: HeadDrafter, block_size: int, tree_budget: int) -> HeadDrafter:
    """block_size heads per round (at most the checkpoint's K); a tree budget builds `default_tree` of that
    many nodes over those heads."""
    depth = min(max(int(block_size), 1), drafter.cfg.num_heads)
    tree = default_tree(tree_budget, depth) if tree_budget else ()
    return dataclasses.replace(drafter, block_size=depth, tree=tree)


# --- training (Medusa-1: frozen target, per-head cross-entropy) ------------------------------------


def _lm_head(target_params: dict, target_cfg) -> jax.Array:
    return target_params["embed"] if target_cfg.tie_word_embeddings else target_params["lm_head"]


def _builder(kind: str):
    def build(run: dict, target, key) -> tuple[HeadDrafter, dict]:
        """From the run config's drafter section: num_heads (default 4), num_layers (default 1). Every head
        starts as the target's LM head (`fresh_params`, deterministic: the key is not used)."""
        section = run["drafter"]
        c = target.cfg
        cfg = HeadsConfig(kind, int(section.get("num_heads", 4)), int(section.get("num_layers", 1)), c.hidden_size,
                          c.vocab_size)
        dtype = target.params["final_norm"].dtype
        head = np.asarray(jax.device_get(_lm_head(target.params, c)))
        drafter = (Medusa if kind == MEDUSA else Hydra)(cfg=cfg, target_layers=c.num_layers)
        return drafter, fresh_params(cfg, head, dtype)
    return build


def train_logits(params, cfg: HeadsConfig, embed, hidden, tokens, anchors) -> jax.Array:
    """Head logits [B, A, K, V] for anchors [B, A] (positions >= 1) of a text tokens [B, T] with the target's
    final-normed hidden states [B, T, H]: every head reads h at anchor - 1; Hydra's head k reads the data
    tokens anchor .. anchor + k as its path (teacher forcing on the distilled text)."""
    rows = jnp.arange(tokens.shape[0])[:, None]
    h = hidden[rows, jnp.maximum(anchors - 1, 0)]  # [B, A, H]
    if cfg.kind == MEDUSA:
        return jnp.stack([head_logits(cfg, params, k, h) for k in range(cfg.num_heads)], axis=2)
    t = tokens.shape[1]
    path = [quant.embed_rows(embed, tokens[rows, jnp.minimum(anchors + j, t - 1)]).astype(h.dtype)
            for j in range(cfg.num_heads)]
    return jnp.stack([head_logits(cfg, params, k, jnp.concatenate([h] + path[:k + 1], -1))
                      for k in range(cfg.num_heads)], axis=2)


def train_loss(params, target_params, target_cfg, drafter: HeadDrafter, spec, batch: dict, key: jax.Array):
    """The run's distribution loss (default "ce": Medusa-1's per-head cross-entropy on the distilled tokens)
    of heads 0 .. K-1 at sampled anchors, the target frozen."""
    cfg = drafter.cfg
    tokens, loss_mask = batch["tokens"], batch["loss_mask"]
    taps, target_logp = train_drafter.target_pass(target_params, target_cfg, tokens, (target_cfg.num_layers - 1,))
    hidden = tm.final_norm(target_params, target_cfg, taps[0])
    anchors, valid = train_drafter.anchors_for(spec, key, loss_mask)
    valid = valid & (anchors >= 1)  # the hidden state before the anchor must exist
    labels, mask, p_t = train_drafter.block_targets(cfg.num_heads, tokens, loss_mask, target_logp, anchors, valid)
    logits = train_logits(params, cfg, target_params["embed"], hidden, tokens, anchors)
    draft_logp = jax.nn.log_softmax(logits, axis=-1)
    loss = train_drafter.distribution_loss(spec, draft_logp, p_t, labels, mask)
    return loss, train_drafter.metrics(draft_logp, p_t, labels, mask)


def offline_blocks(target_params, target_cfg, drafter: HeadDrafter, dparams, taps, tokens, sampling):
    """The offline evaluator's rounds (`Family.offline`, chains): `train_logits` of the heads used, Hydra's
    teacher-forced on the text's path (the drafts when accepted)."""
    hidden = tm.final_norm(target_params, target_cfg, taps[0])

    def blocks(anchors):
        logits = train_logits(dparams, drafter.cfg, target_params["embed"], hidden, tokens, anchors)
        logits = logits[:, :, :drafter.depth]
        return logits, served_logprobs(logits, sampling)
    return blocks


# --- registration ----------------------------------------------------------------------------------


def _example(kind: str):
    def example(target) -> tuple[HeadDrafter, dict]:
        """Random heads (normal(0.3), so no head is the target's LM head) of 3 heads x 2 layers."""
        c = target.cfg
        cfg = HeadsConfig(kind, 3, 2, c.hidden_size, c.vocab_size)
        params = init_params(cfg, jax.random.key(1), target.params["final_norm"].dtype, std=0.3)
        return (Medusa if kind == MEDUSA else Hydra)(cfg=cfg, target_layers=c.num_layers), params
    return example


register_family(Family(name=MEDUSA, drafter=Medusa, detect=_is_medusa, load=load_medusa, save=save_medusa,
                       with_shape=with_shape, recipe=TrainRecipe(build=_builder(MEDUSA), loss=train_loss),
                       example=_example(MEDUSA), offline=offline_blocks,
                       summary="Medusa heads on the target's last hidden state (config.json with medusa_num_heads)"))
register_family(Family(name=HYDRA, drafter=Hydra, detect=lambda hf: "hydra_num_heads" in hf, load=load_hydra,
                       save=save_hydra, with_shape=with_shape,
                       recipe=TrainRecipe(build=_builder(HYDRA), loss=train_loss),
                       example=_example(HYDRA), offline=offline_blocks,
                       summary="Hydra heads conditioned on the drafted path (config.json with hydra_num_heads)"))
