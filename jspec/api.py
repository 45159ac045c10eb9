"""The Python API: load a target, generate from a batch of prompts in one compiled call."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec import parallel
from jspec.decode import ar, spec
from jspec.drafters import Drafter, family
from jspec.io.models import load_model
from jspec.kernels import resolve as resolve_kernels
from jspec.models import quant
from jspec.models.config import ModelConfig
from jspec.verify import rules
from jspec.verify.sampling import SamplingParams


@dataclasses.dataclass
class Target:
    """A target model: static config, parameter pytree, optional tokenizer."""

    cfg: ModelConfig  # or jspec.models.hybrid.HybridConfig
    params: dict
    tokenizer: object | None = None
    path: str | None = None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"target {self.path!r} has no tokenizer.json: pass token ids instead of text")
        return self.tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(list(ids))


BUILTIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin")


def resolve_path(path: str) -> str:
    """'builtin:NAME' -> the shipped model folder jspec/builtin/NAME; other paths unchanged."""
    if not path.startswith("builtin:"):
        return path
    name = path.split(":", 1)[1]
    folder = os.path.join(BUILTIN_DIR, name)
    if not os.path.isdir(folder):
        have = sorted(os.listdir(BUILTIN_DIR)) if os.path.isdir(BUILTIN_DIR) else []
        raise FileNotFoundError(f"no built-in model {name!r}; built-in models: {have or 'none installed'} "
                                "(train them with `jspec train`, see README)")
    return folder


def load_target(path: str, dtype=jnp.float32) -> Target:
    """Load an HF Llama/Qwen3 directory (config.json, safetensors, optional tokenizer.json), or a
    built-in model by name ('builtin:code-target')."""
    path = resolve_path(path)
    cfg, params, tok = load_model(path, dtype)
    return Target(cfg, params, tok, path)


@dataclasses.dataclass
class GenerateResult:
    tokens: list[list[int]]  # generated ids per row (prompt excluded; EOS included when hit)
    logprobs: list[list[float]]  # per generated token (see ar.choose_tokens)
    stats: dict


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, bucket: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad prompts into [B, P] (P a multiple of `bucket`, so similar lengths share a compile)."""
    if len(prompts) == 0:
        raise ValueError("no prompts given: pass at least one prompt")
    lens = np.array([len(p) for p in prompts], np.int32)
    if lens.min() < 1:
        raise ValueError(f"prompt {int(lens.argmin())} is empty: every prompt needs at least one token")
    for i, p in enumerate(prompts):
        bad = [t for t in p if not (0 <= int(t) < vocab_size)]
        if bad:
            raise ValueError(
                f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}; "
                "check that the prompt was tokenized for this model"
            )
    packed = np.zeros((len(prompts), _round_up(int(lens.max()), bucket)), np.int32)
    for i, p in enumerate(prompts):
        packed[i, : len(p)] = np.asarray(p, np.int32)
    return packed, lens


def default_cache_size(max_prompt: int, max_new_tokens: int, bucket: int = 64) -> int:
    return _round_up(max_prompt + max_new_tokens, bucket)


def load_drafter(spec_or_path, target: Target, *, block_size: int = 4, tree_budget: int = 0):
    """A drafter and its parameters, at this draft shape (`Family.with_shape`), from:
    - a registered family's name for parameter-free drafters ("lookup");
    - a checkpoint folder or "builtin:NAME": the one registered family whose `detect` accepts its
      config.json loads it (z-lab DFlash, DeepSpec DSpark, a small HF causal LM sharing the target's
      tokenizer, or any family registered with jspec.drafters.register_family);
    - a Drafter instance (no parameters) or a (Drafter, params) pair, used as given.
    Checkpoint drafters whose block size is fixed by training keep it; tree_budget > 0 drafts trees."""
    if isinstance(spec_or_path, Drafter):
        return spec_or_path, ()
    if isinstance(spec_or_path, tuple):  # (Drafter, params)
        return spec_or_path
    if isinstance(spec_or_path, str) and spec_or_path in family.named():
        fam = family.get_family(spec_or_path)
        return fam.with_shape(fam.lookup(target), block_size, tree_budget), ()
    if isinstance(spec_or_path, str):
        path = resolve_path(spec_or_path)
        if os.path.isdir(path):
            fam = family.detect(path)
            dr, params = fam.load(path, target, target.params["embed"].dtype)
            return fam.with_shape(dr, block_size, tree_budget), params
    raise ValueError(
        f"unknown drafter {spec_or_path!r}: use none, {', '.join(family.named())}, builtin:NAME, or the folder of a "
        "drafter checkpoint (families: " + ", ".join(f for f, fam in family.FAMILIES.items() if fam.detect) + ")"
    )


def generate(
    target: Target,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 64,
    sampling: SamplingParams = SamplingParams(temperature=0.0),
    seeds: Sequence[int] | int = 0,
    cache_size: int | None = None,
    eos_ids: Sequence[int] | None = None,
    drafter=None,
    verifier: str | None = None,
    block_size: int = 4,
    tree_budget: int = 0,
    verify_budget=None,
    kernels: str | None = None,
    mesh=None,
) -> GenerateResult:
    """Generate for a batch of token-id prompts of different lengths, in one compiled call.

    drafter: None (plain autoregressive decoding), "lookup", an HF directory of a small LM with the
    target's tokenizer, a Drafter instance, or a (Drafter, params) pair. verifier: "greedy" (the
    default at temperature 0), "gumbel" (the default otherwise), "speculative" or "block".
    verify_budget: None, "profile" (time the target's verify pass now and build the table), or a
    steps-per-second table (see jspec.decode.spec.SpecConfig.sps): the non-anticipating DSpark budget,
    for drafters that report confidences.
    kernels: "reference", "pallas" or "auto" (jspec.kernels) for the DFlash/DSpark draft layers, the
    target's attention in decode and verify passes (plain decoding too) and a Q4 target's matmuls; None keeps a Drafter
    instance's own setting and the reference attention.
    seeds: one per prompt, or one int from which prompt i takes seed + i. Each row stops at EOS
    (included in its output), at max_new_tokens, or when its buffer of cache_size tokens is full.
    mesh: None (one device), or a jax.sharding.Mesh from jspec.parallel.make_mesh: the target and
    drafter parameters are placed by jspec.parallel's rules (tensor parallel over `model`), the batch
    over `data` x `fsdp` (the number of prompts must divide by it), and the same compiled loop runs
    SPMD over the mesh, on one host or many (every process calls generate with the same arguments;
    each gets the whole result).
    """
    cfg = target.cfg
    if not isinstance(sampling, SamplingParams):
        raise TypeError("sampling must be a jspec SamplingParams")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    packed, lens = pack_prompts(prompts, cfg.vocab_size)
    if cache_size is None:
        cache_size = default_cache_size(packed.shape[1], max_new_tokens)
    longest = int(lens.max())
    if longest >= cache_size or packed.shape[1] > cache_size:
        raise ValueError(
            f"a prompt of {longest} tokens (padded to {packed.shape[1]}) does not fit a cache of {cache_size} rows "
            f"with room for a new token: raise cache_size or shorten the prompt"
        )
    seeds = np.arange(len(prompts), dtype=np.int64) + seeds if isinstance(seeds, int) else np.asarray(seeds)
    if seeds.shape != (len(prompts),):
        raise ValueError(f"got {seeds.size} seeds for {len(prompts)} prompts: pass one seed per prompt or one int")
    eos = tuple(int(e) for e in (cfg.eos_token_ids if eos_ids is None else eos_ids))
    if kernels not in (None, "reference", "pallas", "auto"):
        raise ValueError(f"kernels must be reference, pallas or auto, got {kernels!r}")
    dcfg = ar.DecodeConfig(max_new_tokens=max_new_tokens, cache_size=cache_size, sampling=sampling, eos_ids=eos,
                           attention=kernels or "reference")
    args = (jnp.asarray(packed), jnp.asarray(lens), jnp.asarray(seeds.astype(np.uint32)))
    params, fetch = target.params, jax.device_get
    if kernels is not None and quant.has_q4(params):  # Q4 matmuls: the Pallas kernel or the XLA reference
        params = quant.with_kernel(params, resolve_kernels(kernels))
    if mesh is not None:
        params = parallel.place_target(target, mesh).params
        args = parallel.shard_batch((packed, lens, seeds.astype(np.uint32)), mesh)
        fetch = parallel.to_host

    if drafter is None or drafter == "none":
        if (verifier is not None and not rules.get_rule(verifier).plain_tokens) or tree_budget:
            raise ValueError("plain autoregressive decoding (no drafter) takes no verifier or tree budget")
        start = time.perf_counter()
        state = ar.generate_ar(params, cfg, dcfg, *args)
        tokens, logprobs, length, steps = fetch((state.tokens, state.logprobs, state.length, state.steps))
        wall = time.perf_counter() - start
        rounds = int(steps)
        stats = {"rounds": rounds, "tau": 1.0, "accepted_per_position": []}
    else:
        dr, dparams = prepare_drafter(target, drafter, sampling, verifier, block_size, tree_budget, cache_size)
        sps = _verify_budget(target, dr, verify_budget, len(prompts), cache_size)
        if kernels is not None:
            dr = dr.with_kernels(kernels)
        scfg = spec.SpecConfig(dcfg, _default_verifier(verifier, sampling), sps)
        if mesh is not None:
            dparams = parallel.place_drafter(dr, dparams, mesh)
        start = time.perf_counter()
        state = spec.generate_spec(params, dparams, cfg, dr, scfg, *args)
        tokens, logprobs, length, st = fetch(
            (state.core.tokens, state.core.logprobs, state.core.length, state.stats))
        wall = time.perf_counter() - start
        rounds = int(st.rounds.sum())
        stats = {
            "rounds": rounds,
            "tau": float(st.committed.sum()) / max(rounds, 1),
            "accepted_per_position": st.per_position.sum(0).tolist(),
            "accept_hist": st.hist.sum(0).tolist(),
            "loop_rounds": int(st.loop_rounds),
            "verified": int(st.verified.sum()),
        }
    out_tokens = [tokens[i, lens[i]:length[i]].tolist() for i in range(len(prompts))]
    out_logps = [logprobs[i, lens[i]:length[i]].tolist() for i in range(len(prompts))]
    stats = {"new_tokens": int(sum(len(t) for t in out_tokens)), "wall_s": wall, **stats}
    return GenerateResult(out_tokens, out_logps, stats)


def _verify_budget(target, drafter, verify_budget, batch: int, cache_size: int):
    if verify_budget is None:
        return None
    if not drafter.reports_confidence:
        raise ValueError("a verify budget needs a chain drafter that reports confidences (e.g. DSpark with its "
                         "confidence head, without a tree budget)")
    g = drafter.num_drafts
    if verify_budget == "profile":
        from jspec.decode import profile

        secs = {w: profile.verify_pass_seconds(target.params, target.cfg, batch, w, cache_size // 2,
                                               cache_size + g + 1, repeats=3) for w in spec.width_buckets(g)}
        return profile.sps_table(secs, batch, g)
    table = tuple(float(x) for x in verify_budget)
    if len(table) < batch * g + 1:
        raise ValueError(f"the verify budget table needs batch * g + 1 = {batch * g + 1} entries, got {len(table)}")
    return table


def _default_verifier(verifier: str | None, sampling: SamplingParams) -> str:
    if verifier is None:
        return rules.default_rule(sampling.greedy)
    if rules.get_rule(verifier).greedy_only and not sampling.greedy:
        others = ", ".join(name for name, r in rules.RULES.items() if not r.greedy_only)
        raise ValueError(
            f"the {verifier} verifier is lossless only at temperature 0 (got {sampling.temperature}): "
            f"use --verifier {others} for sampling"
        )
    return verifier


def prepare_drafter(target, drafter, sampling, verifier, block_size, tree_budget, cache_size):
    """The (Drafter, params) pair exactly as `generate` runs it: loaded (`load_drafter`), checked on the
    host against the target, the cache and the verifier (None = the default for `sampling`). The loop
    tells the drafter how to propose (the rule's draft policy, the served sampling) every round.
    ValueError names any problem."""
    for name, value in (("block_size", block_size), ("tree_budget", tree_budget)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if block_size < 1:
        raise ValueError(f"block size must be >= 1 draft token, got {block_size}")
    if tree_budget < 0:
        raise ValueError(f"tree budget must be >= 0 nodes (0 = chain), got {tree_budget}")
    dr, dparams = load_drafter(drafter, target, block_size=block_size, tree_budget=tree_budget)
    verifier = _default_verifier(verifier, sampling)
    if dr.num_drafts >= cache_size:
        raise ValueError(
            f"{dr.num_drafts} drafts per round do not fit a cache of {cache_size} rows: "
            "lower the block size / tree budget or raise the cache size"
        )
    rule = rules.get_rule(verifier)
    if dr.kind == "tree" and rule.chain_only:
        trees = ", ".join(name for name, r in rules.RULES.items() if not r.chain_only)
        raise ValueError(
            f"the {verifier!r} verifier is chain-only and cannot verify a tree (tree budget {dr.num_drafts}): "
            f"use {trees} with trees, or drop the tree budget"
        )
    dr.validate(target.cfg, dparams)
    return dr, dparams
