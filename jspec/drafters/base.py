"""The drafter protocol.

A drafter is a frozen (hashable) dataclass: its fields are static configuration, its parameters and
state are pytrees passed explicitly. Per round the loop calls

    proposal, state = drafter.propose(dparams, state, ctx)     # ctx: DraftContext
    ... target verify pass, verification rule ...
    state = drafter.commit(dparams, state, commit)             # commit: CommitInfo

and, once after the target's prefill, `state = drafter.init(dparams, prefill)`.

A new drafter is one module with a `Drafter` subclass and its `Family` registration
(jspec.drafters.family: checkpoint detection, loading, saving, draft shape, training recipe).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jspec.models.config import ModelConfig
from jspec.verify import noise
from jspec.verify.rules import GREEDY, GUMBEL, SAMPLE  # how a drafter proposes: fixed by the verification rule
from jspec.verify.sampling import SamplingParams, Served, first_argmax, gumbel_argmax, served_logprobs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Proposal:
    """Drafted tokens for one round.

    chain: tokens [B, g]; q_logp [B, g, V] (the served q that produced token i) or None.
    tree:  tokens [B, N]; parent [B, N] (-1 = child of the anchor, else an earlier node);
           depth [B, N] (>= 1); q_logp [B, N + 1, V] (row 0: the anchor's children, row i + 1:
           node i's children) or None.
    """

    tokens: jax.Array
    q_logp: jax.Array | None = None
    parent: jax.Array | None = None
    depth: jax.Array | None = None
    confidence: jax.Array | None = None  # chain [B, g]: P(draft k accepted | drafts < k accepted), if known
    length: jax.Array | None = None  # chain [B]: drafts proposed per row, decided while drafting (a stopping
    # time: never by reading a draft it admits); later slots are padding, never verified. None: all g


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillInfo:
    prompts: jax.Array  # [B, P] right-padded
    prompt_len: jax.Array  # [B]
    taps: jax.Array | None  # [n_taps, B, P, D] target taps over the prompt (when the drafter asks)
    target_params: Any = dataclasses.field(default=None, kw_only=True)  # the frozen target's parameters, as in
    # DraftContext (drafters that embed the prompt with the target's embedding, e.g. MTP)
    target_cfg: Any = dataclasses.field(default=None, kw_only=True, metadata=dict(static=True))  # its config


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftContext:
    """What the loop tells a drafter each round: the committed text, a read-only view of the target, and
    how to propose (the rule's draft policy and the served sampling transform, shared with the target)."""

    tokens: jax.Array  # [B, S] committed text; the anchor (pending token) is at length - 1
    length: jax.Array  # [B]
    seeds: jax.Array  # [B]
    target_params: Any  # the frozen target's parameters (drafters that share its embedding / head)
    target_cfg: Any = dataclasses.field(kw_only=True, metadata=dict(static=True))  # the target's config
    policy: str = dataclasses.field(default=GREEDY, kw_only=True, metadata=dict(static=True))  # from the rule:
    # GREEDY (argmax drafts), SAMPLE (drafts drawn from q, which the proposal must carry) or GUMBEL
    sampling: Served = dataclasses.field(default=SamplingParams(0.0), kw_only=True)  # the served transform
    # (traced values; a SamplingParams given here is converted)
    target_cache: Any = dataclasses.field(default=None, kw_only=True)  # the target's cache before this
    # round's verify pass: read it in place, never write it
    round_start: jax.Array | None = dataclasses.field(default=None, kw_only=True)  # [B] the round's first
    # draft index when a drafter drafts past `length` in stages (DLoop); None: length. Keys its own noise.
    noise_stream: int = dataclasses.field(default=0, kw_only=True, metadata=dict(static=True))  # a sampling
    # drafter that draws the same index more than once in a round (a re-drafting pass: D-Loop, DEdit) draws
    # each pass from its own stream, so a redraw is independent of the draw it replaces

    def __post_init__(self):
        if isinstance(self.sampling, SamplingParams):
            self.sampling = self.sampling.traced()

    @property
    def noise_start(self) -> jax.Array:
        """The index a sampling drafter's noise is folded by (`draft_noise`): the round's first draft."""
        return self.length if self.round_start is None else self.round_start

    @property
    def needs_q(self) -> bool:
        """Must the proposal carry the q it was drawn from (the rule reads it)?"""
        return self.policy == SAMPLE


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CommitInfo:
    """What the round committed, per row. Positions old_length - 1 .. new_length - 2 became target
    history (the old anchor and the accepted drafts); the token at new_length - 1 is the new anchor."""

    tokens: jax.Array  # [B, S] after the commit
    old_length: jax.Array  # [B]
    new_length: jax.Array  # [B]
    taps: jax.Array | None  # [n_taps, B, T, D] target taps of the verify rows, compacted to committed order
    hidden: jax.Array | None = None  # [B, T, D] the target's final-normed hidden states of the same rows
    # (row j: after emitted-order token j; what MTP / Medusa / EAGLE-style heads read)


@dataclasses.dataclass(frozen=True)
class Drafter(abc.ABC):
    """Base class: static configuration of a drafter. Subclasses set `kind` and implement the hooks."""

    kind: ClassVar[str] = "chain"  # "chain" | "tree"
    # For trees: are siblings i.i.d. draws from q ("iid") or fixed choices ("deterministic")?
    tree_children: ClassVar[str] = "deterministic"

    @property
    @abc.abstractmethod
    def num_drafts(self) -> int:
        """g for a chain, N (the tree budget) for a tree."""

    @property
    def max_depth(self) -> int:
        return self.num_drafts

    @property
    def taps(self) -> tuple[int, ...]:
        """Target layers whose outputs the drafter needs (prefill and verify pass)."""
        return ()

    @property
    def reports_confidence(self) -> bool:
        """Does `propose` fill Proposal.confidence (what a verify budget reads)?"""
        return False

    def with_kernels(self, kernels: str) -> "Drafter":
        """This drafter with its hot path on `kernels` ("reference" | "pallas" | "auto", jspec.kernels);
        a drafter without kernels returns itself."""
        return self

    def validate(self, target_cfg: ModelConfig, dparams: Any) -> None:
        """Host-side checks against the target (vocabulary, taps); raise ValueError naming the fix."""

    def param_axes(self) -> Any:
        """Logical axes of the drafter's parameters from its module declarations (a tree like the
        parameters, tuples at the leaves; None when it declares none). Sharding reads them."""
        return None

    def init(self, dparams: Any, prefill: PrefillInfo, cache_size: int) -> Any:
        return ()

    @abc.abstractmethod
    def propose(self, dparams: Any, state: Any, ctx: DraftContext) -> tuple[Proposal, Any]:
        """Draft for every row (rows that are done may draft anything)."""

    def commit(self, dparams: Any, state: Any, info: CommitInfo) -> Any:
        return state

    # Helper shared by drafters that hold a distribution: choose a token the way the rule's policy says.
    @staticmethod
    def choose(ctx: DraftContext, logits: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Token [...] for logits [B, ..., V] drafted at absolute indices [B, ...] and the served
        log-probs [..., V] it was drawn from (ctx.seeds broadcast over the trailing dims; the round's
        first draft is at index ctx.length)."""
        logp = served_logprobs(logits, ctx.sampling)
        vocab = logits.shape[-1]
        if ctx.policy == GREEDY:
            token = first_argmax(logits)
        elif ctx.policy == GUMBEL:  # the target's own noise: coupling makes agreement likely
            token = gumbel_argmax(logp, noise.gumbel(ctx.seeds, index, noise.GUMBEL, vocab))
        else:
            token = gumbel_argmax(logp, draft_noise(ctx.seeds, index, ctx.noise_start, vocab, ctx.noise_stream))
        return token, logp


@dataclasses.dataclass(frozen=True)
class Wrapper(Drafter):
    """A drafter that runs another drafter's network its own way (DLoop's stages, D-Loop's and DEdit's
    extra passes): the taps, parameters, checks, state and commit are the inner drafter's."""

    inner: Drafter | None = None

    @property
    def taps(self) -> tuple[int, ...]:
        return self.inner.taps

    def with_kernels(self, kernels: str) -> "Wrapper":
        return dataclasses.replace(self, inner=self.inner.with_kernels(kernels))

    def validate(self, target_cfg: ModelConfig, dparams: Any) -> None:
        self.inner.validate(target_cfg, dparams)

    def param_axes(self) -> Any:
        return self.inner.param_axes()

    def init(self, dparams: Any, prefill: PrefillInfo, cache_size: int) -> Any:
        return self.inner.init(dparams, prefill, cache_size)

    def commit(self, dparams: Any, state: Any, info: CommitInfo) -> Any:
        return self.inner.commit(dparams, state, info)


def draft_noise(seeds: jax.Array, index: jax.Array, round_start: jax.Array, vocab: int, stream: int = 0) -> jax.Array:
    """A sampling drafter's own Gumbel noise [..., V] at absolute indices, fresh in every round.

    Keyed by (seed, index, DRAFT) and folded by the offset index - round_start. Block verification
    reads drafts past the accepted prefix, so the drafts it discards are correlated with the text it
    commits; redrawing those indices next round with the same noise would bias the output. Two rounds
    never start at the same index, so the offset makes each round's draws new. stream > 0 (static) folds
    the key once more: the draws of a second pass over the same indices, independent of the first's.
    """
    index = jnp.asarray(index)
    extra = index.ndim - jnp.ndim(seeds)
    seeds_b = jnp.broadcast_to(jnp.reshape(seeds, jnp.shape(seeds) + (1,) * extra), index.shape)
    start_b = jnp.broadcast_to(jnp.reshape(round_start, jnp.shape(round_start) + (1,) * extra), index.shape)

    def one(s, i, r):
        key = jax.random.fold_in(noise.position_key(s, i, noise.DRAFT), jnp.asarray(i - r, jnp.uint32))
        if stream:
            key = jax.random.fold_in(key, stream)
        return jax.random.gumbel(key, (vocab,), jnp.float32)

    fn = one
    for _ in range(index.ndim):
        fn = jax.vmap(fn)
    return fn(seeds_b, index, start_b)


def point_mass_logp(tokens: jax.Array, vocab: int) -> jax.Array:
    """q for deterministic proposals: log one-hot [..., V] (0 at the token, -inf elsewhere)."""
    return jnp.where(jax.nn.one_hot(tokens, vocab, dtype=jnp.bool_), 0.0, -jnp.inf)
