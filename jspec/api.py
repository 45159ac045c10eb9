"""The Python API: load a target, generate from a batch of prompts in one compiled call."""

from __future__ import annotations

import dataclasses
import numbers
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec import parallel
from jspec.decode import ar, spec, stop as stop_strings
from jspec.drafters import Drafter, family
from jspec.errors import JspecError
from jspec.io import chat, hub
from jspec.io.models import load_model
from jspec.io.tokenizer import read_tokenizer_settings
from jspec.kernels import resolve as resolve_kernels
from jspec.models import quant
from jspec.models import target as tm
from jspec.models import transformer
from jspec.models.config import ModelConfig
from jspec.verify import rules
from jspec.verify.sampling import SamplingParams


@dataclasses.dataclass
class Target:
    """A target model: static config, parameter pytree, optional tokenizer, and what the checkpoint says
    about chat: its special tokens and chat template (`load_target` reads them).

    special_tokens: transformers' `special_tokens_map` of the checkpoint ({"bos_token": "<s>", "eos_token":
    ..., "pad_token": ...}, from tokenizer_config.json); chat_template: its Jinja chat template, or name ->
    template when it has several (see jspec.io.chat for where each comes from); chat_template_file: the file(s)
    it was read from."""

    cfg: ModelConfig  # or jspec.models.hybrid.HybridConfig
    params: dict
    tokenizer: object | None = None
    path: str | None = None
    special_tokens: dict = dataclasses.field(default_factory=dict)
    chat_template: str | dict | None = None
    chat_template_file: str | None = None

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    def encode(self, text: str) -> list[int]:
        """The ids of plain text, as transformers' `tokenizer(text)["input_ids"]` gives them: BOS (and EOS) only
        where tokenizer.json's post_processor adds them (transformers 5 ignores tokenizer_config.json's
        add_bos_token beside a tokenizer.json; see jspec.io.tokenizer). For a chat, use apply_chat_template."""
        if self.tokenizer is None:
            raise ValueError(f"target {self.path!r} has no tokenizer.json: pass token ids instead of text")
        return self.tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(list(ids))

    def _template(self, chat_template, tools) -> tuple[str, str]:
        """(the Jinja source to render, what errors call it)."""
        if self.chat_template is None and chat_template is None:
            looked = f": looked for {chat.searched_files(self.path)}" if self.path else ""
            raise chat.ChatError(f"the target {self.path!r} has no chat template{looked}; pass chat_template=... (a "
                                 "Jinja template), or use a chat model's checkpoint (instruct / chat variants ship "
                                 "one)")
        named = isinstance(self.chat_template, dict) and chat_template in self.chat_template
        if chat_template is not None and not named:
            return chat_template, "the chat_template argument"
        where = self.chat_template_file or "the target's chat template"
        return chat.choose_template(self.chat_template, chat_template, tools, where), where

    def render_chat(self, messages, add_generation_prompt: bool = True, tools=None, *, documents=None,
                    chat_template: str | None = None, continue_final_message: bool | str = False, **kwargs) -> str:
        """One conversation as text, exactly as transformers' `tokenizer.apply_chat_template(messages,
        tokenize=False, ...)` renders it with this checkpoint's template.

        messages: a list of {"role": ..., "content": ...} dicts (content: text or a list of content blocks; an
        assistant message with "tool_calls" may omit it). add_generation_prompt: end with the opening of an
        assistant turn (the default here, for generation; transformers' default is False). tools: JSON-schema
        dicts of callable tools ({"type": "function", "function": {...}}), for templates that support them
        (a checkpoint's "tool_use" template serves them when it has one). documents: retrieval documents (dicts).
        chat_template: a Jinja template, or the name of one of the checkpoint's templates, to use instead.
        continue_final_message: leave the last message open for the model to continue (True: its content;
        needs add_generation_prompt=False). kwargs: extra template variables (e.g. enable_thinking=False),
        overriding the special tokens (bos_token, eos_token, ...) the template sees.
        Raises jspec.io.chat.ChatError (a ValueError) naming the problem: malformed messages, no template
        (naming the files looked for), or a template that refuses the conversation (its raise_exception)."""
        return self._render([chat.check_conversation(messages)], add_generation_prompt, tools, documents,
                            chat_template, continue_final_message, kwargs)[0]

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None, **kwargs) -> list[int]:
        """One conversation as token ids, ready to be a prompt: `render_chat(messages, add_generation_prompt,
        tools, **kwargs)` encoded as transformers' `apply_chat_template(..., tokenize=True)` encodes it (no
        special tokens added on top of the ones the template writes). Same arguments as render_chat. E.g.
        `jspec.generate(target, [target.apply_chat_template([{"role": "user", "content": "Hi"}])])`.
        A batch of conversations is `chat_prompts`. Needs a tokenizer.json (ValueError otherwise)."""
        text = self.render_chat(messages, add_generation_prompt, tools, **kwargs)
        return chat.encode_chat(self._chat_tokenizer(), text)

    def chat_prompts(self, conversations, add_generation_prompt: bool = True, tools=None, **kwargs) -> list[list[int]]:
        """A batch: a list of conversations (each a list of message dicts) -> one id list per conversation, each
        as `apply_chat_template` gives it (same keyword arguments, shared by every conversation); the result is
        what `jspec.generate(target, prompts)` takes. ChatError naming the conversation and message at fault."""
        tok = self._chat_tokenizer()
        options = {k: kwargs.pop(k) for k in ("documents", "chat_template", "continue_final_message") if k in kwargs}
        texts = self._render(chat.check_conversations(conversations), add_generation_prompt, tools,
                             options.get("documents"), options.get("chat_template"),
                             options.get("continue_final_message", False), kwargs)
        return [chat.encode_chat(tok, t) for t in texts]

    def _chat_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"target {self.path!r} has no tokenizer.json to encode a chat: render_chat gives the "
                             "text; encode it with the model's tokenizer")
        return self.tokenizer

    def _render(self, conversations, add_generation_prompt, tools, documents, chat_template, continue_final_message,
                kwargs) -> list[str]:
        source, where = self._template(chat_template, tools)
        return chat.render_conversations(source, conversations, special_tokens=self.special_tokens,
                                         add_generation_prompt=add_generation_prompt, tools=tools,
                                         documents=documents, continue_final_message=continue_final_message,
                                         where=where, **kwargs)


class RequestError(JspecError, ValueError):
    """A `generate` request cannot run as asked (prompts, lengths, cache, seeds, EOS ids, drafter shape):
    raised on the host, before anything is compiled, naming the value and the fix."""


BUILTIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin")


def resolve_path(path: str) -> str:
    """The model folder a user's spelling stands for:
    - 'builtin:NAME' -> the shipped model folder jspec/builtin/NAME;
    - an existing folder -> itself (so a local folder spelled like a repo id wins); a Hugging Face cache repo
      folder '.../models--org--name' -> its snapshot (refs/main's, or the only one);
    - 'org/name' or 'org/name@revision' -> its snapshot in the local Hugging Face cache (HF_HUB_CACHE /
      HF_HOME), looked up offline: never a download; jspec.io.hub.HubCacheError names the cache and the fix
      (`hf download org/name`) when it is not there;
    - anything else unchanged (the loaders report it)."""
    path = os.fspath(path)
    if not path.startswith("builtin:"):
        return hub.resolve_hub_path(path)
    name = path.split(":", 1)[1]
    folder = os.path.join(BUILTIN_DIR, name)
    if not os.path.isdir(folder):
        have = sorted(os.listdir(BUILTIN_DIR)) if os.path.isdir(BUILTIN_DIR) else []
        raise FileNotFoundError(f"no built-in model {name!r}; built-in models: {have or 'none installed'} "
                                "(train them with `jspec train`, see README)")
    return folder


def load_target(path: str, dtype=jnp.float32, layer_loop: str | None = None) -> Target:
    """Load an HF Llama/Qwen3 directory (config.json, safetensors, optional tokenizer.json,
    tokenizer_config.json, generation_config.json, chat template), a built-in model by name
    ('builtin:code-target'), or a model in the local Hugging Face cache ('org/name', 'org/name@revision',
    '.../models--org--name'; see `resolve_path`). Default EOS ids: config.json's and generation_config.json's.
    layer_loop: how a dense target runs its layers (ModelConfig.layer_loop); default "scan" where jax's
    default backend is a TPU, else "unroll" (hybrid targets keep their own loop)."""
    path = resolve_path(path)
    cfg, params, tok = load_model(path, dtype)
    if isinstance(cfg, ModelConfig):
        loop = layer_loop or ("scan" if jax.default_backend() == "tpu" else "unroll")
        if loop != cfg.layer_loop:
            cfg, params = transformer.with_layer_loop(cfg, params, loop)
    elif layer_loop not in (None, "unroll"):
        raise ValueError(f"layer_loop={layer_loop!r} applies to dense (Llama / Qwen3) targets; {path} is a hybrid one")
    settings = read_tokenizer_settings(path, tok)
    template = chat.load_chat_template(path, settings.config)
    return Target(cfg, params, tok, path, special_tokens=dict(settings.special_tokens),
                  chat_template=None if template is None else template.templates,
                  chat_template_file=None if template is None else template.source)


@dataclasses.dataclass
class GenerateResult:
    tokens: list[list[int]]  # generated ids per row (prompt excluded; EOS included when hit)
    logprobs: list[list[float]]  # per generated token (see ar.choose_tokens)
    stats: dict


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _is_int(t) -> bool:
    """A Python or numpy integer (or a 0-d integer array); bools are not token ids."""
    if isinstance(t, (bool, np.bool_)):
        return False
    if isinstance(t, numbers.Integral):
        return True
    return getattr(t, "ndim", None) == 0 and np.dtype(getattr(t, "dtype", object)).kind in "iu"


def _prompt_ids(i: int, p, vocab_size: int) -> list[int]:
    """Prompt i as a list of Python ints in [0, vocab_size); RequestError naming the problem otherwise."""
    if isinstance(p, (str, bytes)):
        raise RequestError(f"prompt {i} is text ({p[:40]!r}), not token ids: encode it first, "
                           "generate(target, [target.encode(text)])")
    if hasattr(p, "dtype") and hasattr(p, "shape"):  # a numpy / jax array
        a = np.asarray(p)
        if a.ndim != 1:
            raise RequestError(f"prompt {i} is an array of shape {a.shape}: each prompt is a 1-D sequence of token ids")
        if a.size and a.dtype.kind not in "iu":
            raise RequestError(f"prompt {i} holds {a.dtype} values, not integer token ids: {a[:8].tolist()}; pass "
                               "integer ids (they are never rounded or truncated)")
        ids = a.tolist()
    else:
        try:
            ids = list(p)
        except TypeError:
            raise RequestError(f"prompt {i} is {p!r}, not a sequence of token ids: pass a list of prompts, each a "
                               "list of ids, e.g. [[1, 2, 3]]") from None
        bad = [t for t in ids if not _is_int(t)]
        if bad:
            raise RequestError(f"prompt {i} has ids that are not integers: {bad[:8]}; token ids are ints (numpy "
                               "integers are fine; floats and bools are refused, never truncated)")
        ids = [int(t) for t in ids]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}; "
                           "check that the prompt was tokenized for this model")
    return ids


def pack_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, bucket: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad prompts into [B, P] (P a multiple of `bucket`, so similar lengths share a compile).
    prompts: a list of prompts, each a sequence (or 1-D array) of integer token ids in [0, vocab_size)."""
    if isinstance(prompts, (str, bytes)):
        raise RequestError(f"the prompts are text ({prompts[:40]!r}), not token ids: pass a list of encoded prompts, "
                           "generate(target, [target.encode(text)])")
    try:
        prompts = list(prompts)
    except TypeError:
        raise RequestError(f"prompts is {prompts!r}: pass a list of prompts, each a list of token ids, "
                           "e.g. [[1, 2, 3]]") from None
    if len(prompts) == 0:
        raise RequestError("no prompts given: pass at least one prompt")
    if _is_int(prompts[0]):
        raise RequestError(f"the prompts are one flat list of {len(prompts)} token ids ({prompts[:4]}...); generate "
                           "takes a list of prompts: wrap one prompt in a list, e.g. [[1, 2, 3]] ([ids])")
    prompts = [_prompt_ids(i, p, vocab_size) for i, p in enumerate(prompts)]
    lens = np.array([len(p) for p in prompts], np.int32)
    if lens.min() < 1:
        raise RequestError(f"prompt {int(lens.argmin())} is empty: every prompt needs at least one token")
    packed = np.zeros((len(prompts), _round_up(int(lens.max()), bucket)), np.int32)
    for i, p in enumerate(prompts):
        packed[i, : len(p)] = np.asarray(p, np.int32)
    return packed, lens


def default_cache_size(max_prompt: int, max_new_tokens: int, bucket: int = 64) -> int:
    return _round_up(max_prompt + max_new_tokens, bucket)


DEFAULT_BLOCK_SIZE = 4  # draft tokens per round of a drafter that takes any block size, when none is asked for


def load_drafter(spec_or_path, target: Target, *, block_size: int | None = None, tree_budget: int = 0):
    """A drafter and its parameters, at this draft shape (`Family.with_shape`), from:
    - a registered family's name for drafters built from the name alone: "lookup" (parameter-free), "mtp"
      (the target's own multi-token-prediction module, read from the target's checkpoint folder);
    - a checkpoint folder or "builtin:NAME": the one registered family whose `detect` accepts its
      config.json loads it (z-lab DFlash, DeepSpec DSpark, a small HF causal LM sharing the target's
      tokenizer, or any family registered with jspec.drafters.register_family);
    - a Drafter instance (no parameters) or a (Drafter, params) pair, used as given.
    block_size: draft tokens per round of a chain; None = the drafter's own (DEFAULT_BLOCK_SIZE for drafters
    that take any). A checkpoint whose block is fixed by training (DFlash, DSpark) drafts exactly that block,
    and a different block_size is refused (RequestError naming the checkpoint's). tree_budget > 0 drafts trees."""
    if isinstance(spec_or_path, Drafter):
        return spec_or_path, ()
    if isinstance(spec_or_path, tuple):  # (Drafter, params)
        return spec_or_path
    if isinstance(spec_or_path, str) and spec_or_path in family.named():
        fam = family.get_family(spec_or_path)
        found = fam.lookup(target)  # a Drafter, or (Drafter, params) read from the target's checkpoint (MTP)
        dr, params = found if isinstance(found, tuple) else (found, ())
        return _with_shape(fam, dr, block_size, tree_budget, spec_or_path), params
    if isinstance(spec_or_path, str):
        path = resolve_path(spec_or_path)
        if os.path.isdir(path):
            fam = family.detect(path)
            dr, params = fam.load(path, target, target.params["embed"].dtype)
            return _with_shape(fam, dr, block_size, tree_budget, spec_or_path), params
    raise ValueError(
        f"unknown drafter {spec_or_path!r}: use none, {', '.join(family.named())}, builtin:NAME, or the folder of a "
        "drafter checkpoint (families: " + ", ".join(f for f, fam in family.FAMILIES.items() if fam.detect) + ")"
    )


def _with_shape(fam, dr, block_size: int | None, tree_budget: int, name: str):
    """`fam.with_shape`, refusing a block size the family does not draft: with_shape may keep a block fixed by
    training, so an asked-for chain of block_size drafts that comes back with another count was ignored."""
    shaped = fam.with_shape(dr, DEFAULT_BLOCK_SIZE if block_size is None else block_size, tree_budget)
    if block_size is None:
        return shaped
    chain = shaped if not tree_budget else fam.with_shape(dr, block_size, 0)
    g = chain.num_drafts
    trained = getattr(getattr(chain, "cfg", None), "block_size", None)  # DFlash / DSpark: the checkpoint's field
    if trained is not None and block_size in (g, trained):
        return shaped
    if trained is None and block_size == g:  # a family that drafts any block: does its tree use it?
        other = fam.with_shape(dr, block_size + 1, tree_budget) if tree_budget else None
        if other is not None and (other.num_drafts, other.max_depth) == (shaped.num_drafts, shaped.max_depth):
            raise RequestError(f"the drafter {name} shapes its tree of {tree_budget} nodes by the tree budget alone "
                               f"(depth {shaped.max_depth}), so block_size={block_size} would be ignored: drop the "
                               "block size, or drop the tree budget to draft a chain of that many tokens")
        return shaped
    detail = ""
    if trained is not None:
        counts = ", counting the anchor" if trained != g else ""
        detail = (f" (block_size {trained} in its config{counts}): its block attends bidirectionally, so it drafts "
                  "only the block it was trained for")
    raise RequestError(f"the drafter {name} drafts a fixed block of {g} tokens per round{detail}; it cannot draft "
                       f"block_size={block_size}: leave the block size unset (or pass {g}), or use a drafter "
                       "trained for that block")


def generate(
    target: Target,
    prompts: Sequence[Sequence[int]] | None = None,
    *,
    messages: Sequence | None = None,
    max_new_tokens: int = 64,
    sampling: SamplingParams = SamplingParams(temperature=0.0),
    seeds: Sequence[int] | int = 0,
    cache_size: int | None = None,
    eos_ids: Sequence[int] | None = None,
    drafter=None,
    verifier: str | None = None,
    block_size: int | None = None,
    tree_budget: int = 0,
    verify_budget=None,
    kernels: str | None = None,
    mesh=None,
    stop: Sequence[str] | None = None,
    stop_ids: Sequence[int] | None = None,
    on_commit: Callable[[list[list[int]]], None] | None = None,
) -> GenerateResult:
    """Generate for a batch of token-id prompts of different lengths, in one compiled call.

    prompts: token-id prompts, one per row; or messages: one chat conversation per row (each a list of
    {"role", "content"} dicts), rendered through the target's chat template with the generation prompt
    (`Target.chat_prompts`, exactly as transformers' apply_chat_template). Give one of the two.

    drafter: None (plain autoregressive decoding), "lookup", "mtp" (the target checkpoint's own
    multi-token-prediction module: Qwen3.5 / Qwen3-Next), an HF directory of a small LM with the
    target's tokenizer, a Drafter instance, or a (Drafter, params) pair. verifier: "greedy" (the
    default at temperature 0), "gumbel" (the default otherwise), "speculative" or "block".
    verify_budget: None, "profile" (time the target's verify pass now and build the table), or a
    steps-per-second table (see jspec.decode.spec.SpecConfig.sps): the non-anticipating DSpark budget,
    for drafters that report confidences.
    kernels: "reference", "pallas" or "auto" (jspec.kernels) for the DFlash/DSpark draft layers, the
    target's attention in decode and verify passes (plain decoding too) and a Q4 target's matmuls; None keeps a Drafter
    instance's own setting and the reference attention.
    block_size: draft tokens per round of a chain (None: the drafter's own, see `load_drafter`).
    seeds: one per prompt, or one int from which prompt i takes seed + i; each in [0, 2**32).
    max_new_tokens: prompt + max_new_tokens must fit the model's max_position_embeddings (RequestError
    otherwise). cache_size: text rows per prompt (default: longest prompt + max_new_tokens, rounded up);
    at most max_position_embeddings, and a cache the device's memory cannot hold is refused.
    Each row stops at EOS (included in its output), at a stop id or stop string, at max_new_tokens, or when
    its buffer of cache_size tokens is full (an explicit cache_size smaller than prompt + max_new_tokens);
    stats["stopped_by"] says which, per row: "eos", "stop", "max_new_tokens", "cache_full" or
    "context_limit" (the row filled the model's max_position_embeddings). Every bad argument is a
    RequestError (a ValueError) raised before compiling.
    stop_ids: token ids that end a row like EOS (the token is kept in res.tokens), reported as "stop"
    (an id that is also an EOS id reports "eos"). Like eos_ids they are compiled in: another set of ids
    compiles another loop.
    stop: stop strings (needs the target's tokenizer). A row ends at the first generated token whose
    text completes one of them, matched exactly on the device inside the loop, across token boundaries
    and inside a token; only the text generated in this request counts, never the prompt. That token is
    the last of res.tokens[row] (so the row's decoded text may run past the stop string, up to the end of
    that token); the text convention of vLLM, the text cut just before the stop string, is
    `jspec.decode.stop.trim(target.decode(res.tokens[row]), stop)`. Token text is each token's bytes in
    context (jspec.decode.stop.token_bytes: a sentencepiece `▁` is a space, also on the first generated
    token). Other stop strings reuse the compiled loop (their table is a traced input, its rows padded
    to a bucket); at most 256 UTF-8 bytes in all, none empty.
    on_commit: a callable, called on the host once after the prefill and once per round (plain
    decoding: per step) with list[list[int]]: each row's tokens committed then, in order ([] for rows
    that committed nothing, e.g. finished rows), so the concatenation of a row's chunks is
    res.tokens[row]. It runs inside the compiled loop (an ordered host callback, compiled in only when
    given), so the loop waits for it (keep it short, and do not call JAX from it); an exception it raises
    ends the generation and is re-raised here. Another callable reuses the compiled loop. Not available
    with a mesh (refused).
    mesh: None (one device), or a jax.sharding.Mesh from jspec.parallel.make_mesh: the target and
    drafter parameters are placed by jspec.parallel's rules (tensor parallel over `model`), the batch
    over `data` x `fsdp` (the number of prompts must divide by it), and the same compiled loop runs
    SPMD over the mesh, on one host or many (every process calls generate with the same arguments;
    each gets the whole result).
    """
    cfg = target.cfg
    if (prompts is None) == (messages is None):
        raise RequestError("pass prompts (token ids, one list per row) or messages (one chat conversation per row), "
                           f"not {'both' if prompts is not None else 'neither'}")
    if messages is not None:
        try:
            prompts = target.chat_prompts(messages)
        except ValueError as err:  # ChatError: malformed messages, no template, the template's own refusal
            raise RequestError(f"messages: {err}") from err
    if not isinstance(sampling, SamplingParams):
        raise TypeError("sampling must be a jspec SamplingParams")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise RequestError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    packed, lens = pack_prompts(prompts, cfg.vocab_size)
    longest = int(lens.max())
    max_pos = getattr(cfg, "max_position_embeddings", None)
    _check_context(lens, max_new_tokens, max_pos)
    explicit_cache = cache_size is not None
    if cache_size is None:
        cache_size = default_cache_size(packed.shape[1], max_new_tokens)
        if max_pos is not None:  # rows past the model's context can never be used
            cache_size = max(packed.shape[1], min(cache_size, max_pos))
    elif not _is_int(cache_size) or cache_size < 1:
        raise RequestError(f"cache_size must be an integer >= 1 (rows per prompt), got {cache_size!r}: pass e.g. "
                           f"{default_cache_size(packed.shape[1], max_new_tokens)}, or leave it unset")
    cache_size = int(cache_size)
    if explicit_cache and max_pos is not None and cache_size > max(max_pos, packed.shape[1]):
        raise RequestError(f"cache_size {cache_size} is more than the model's max_position_embeddings {max_pos}: no "
                           f"row can use the rows past {max_pos}; pass cache_size <= {max_pos}, or leave it unset")
    if longest >= cache_size or packed.shape[1] > cache_size:
        raise RequestError(
            f"a prompt of {longest} tokens (padded to {packed.shape[1]}) does not fit a cache of {cache_size} rows "
            f"with room for a new token: raise cache_size or shorten the prompt"
        )
    seeds = _check_seeds(seeds, len(prompts))
    if eos_ids is None:
        eos = tuple(int(e) for e in cfg.eos_token_ids)
    else:
        eos = _check_eos(eos_ids, cfg.vocab_size)
    if kernels not in (None, "reference", "pallas", "auto"):
        raise ValueError(f"kernels must be reference, pallas or auto, got {kernels!r}")
    stop_ids = () if stop_ids is None else _check_stop_ids(stop_ids, cfg.vocab_size)
    stop, special_ids = _special_token_stops(target, stop)
    stop_ids = tuple(dict.fromkeys(stop_ids + special_ids))
    stop_table = _stop_table(target, stop)
    _check_on_commit(on_commit, mesh)
    plain = drafter is None or drafter == "none"
    if plain and verifier is not None and not rules.get_rule(verifier).plain_tokens:
        raise RequestError(f"plain autoregressive decoding (no drafter) takes no verifier (got {verifier!r}): "
                           "pass a drafter, or drop the verifier")
    for name, value in (("tree budget", tree_budget), ("block size", block_size), ("verify budget", verify_budget)):
        if plain and value is not None and value is not False and not (_is_int(value) and value == 0):
            raise RequestError(f"plain autoregressive decoding (no drafter) takes no {name} (got {value!r}): "
                               f"pass a drafter, or drop the {name}")
    _check_given_drafter(drafter, block_size, tree_budget)
    _check_cache_memory(target, len(prompts), ar.DecodeConfig(1, cache_size).cache_rows, cache_size, mesh)
    dcfg = ar.DecodeConfig(max_new_tokens=max_new_tokens, cache_size=cache_size, sampling=sampling, eos_ids=eos,
                           attention=kernels or "reference", stop_ids=stop_ids, stop_table=stop_table,
                           on_commit=on_commit)
    args = (jnp.asarray(packed), jnp.asarray(lens), jnp.asarray(seeds.astype(np.uint32)))
    params, fetch = target.params, jax.device_get
    if kernels is not None and quant.has_q4(params):  # Q4 matmuls: the Pallas kernel or the XLA reference
        params = quant.with_kernel(params, resolve_kernels(kernels, q4=True))
    if mesh is not None:
        params = parallel.place_target(target, mesh).params
        args = parallel.shard_batch((packed, lens, seeds.astype(np.uint32)), mesh)
        fetch = parallel.to_host

    if plain:
        start = time.perf_counter()
        state = ar.generate_ar(params, cfg, dcfg, *args)
        tokens, logprobs, length, steps, stop_state = fetch(
            (state.tokens, state.logprobs, state.length, state.steps, state.stop_state))
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
        tokens, logprobs, length, st, stop_state = fetch(
            (state.core.tokens, state.core.logprobs, state.core.length, state.stats, state.core.stop_state))
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
    stats = {"new_tokens": int(sum(len(t) for t in out_tokens)), "wall_s": wall, **stats,
             "stopped_by": stopped_by(tokens, lens, length, max_new_tokens, cache_size, eos, max_pos, stop_ids=stop_ids,
                                      stop_hit=None if stop_state is None else np.asarray(stop_state) < 0)}
    return GenerateResult(out_tokens, out_logps, stats)


STOP_REASONS = ("eos", "stop", "max_new_tokens", "cache_full", "context_limit")


def stopped_by(tokens, prompt_len, length, max_new_tokens: int, cache_size: int, eos_ids, max_pos=None, *,
               stop_ids=(), stop_hit=None) -> list[str]:
    """Why each row stopped (one of STOP_REASONS), from the loop's host-side result: tokens [B, S], the prompt
    lengths [B] and final lengths [B]; stop_hit [B]: rows whose last token completed a stop string (the loop's
    stop_state < 0). EOS wins when the last token is one; then a stop id or stop string ("stop"); then
    max_new_tokens; a row that stopped short of all of them filled its buffer: its cache (cache_full) or the
    model's context (context_limit)."""
    tokens, prompt_len, length = np.asarray(tokens), np.asarray(prompt_len), np.asarray(length)
    eos = {int(e) for e in eos_ids}
    stops = {int(e) for e in stop_ids}
    out = []
    for row in range(len(length)):
        n = int(length[row] - prompt_len[row])
        last = int(tokens[row, length[row] - 1]) if n > 0 else None
        if last in eos:
            out.append("eos")
        elif last in stops or (n > 0 and stop_hit is not None and bool(stop_hit[row])):
            out.append("stop")
        elif n >= max_new_tokens:
            out.append("max_new_tokens")
        elif max_pos is not None and length[row] >= max_pos and max_pos <= cache_size:
            out.append("context_limit")
        else:
            out.append("cache_full")
    return out


def _check_stop_ids(stop_ids, vocab_size: int) -> tuple[int, ...]:
    """Stop ids: integers inside the vocabulary, like EOS ids (duplicates dropped)."""
    ids = _token_ids(stop_ids, "stop_ids", vocab_size, example="[13] (stop strings go in stop=[...])",
                     emit="pass ids the model can emit")
    return tuple(dict.fromkeys(ids))


def _special_token_stops(target: Target, stop) -> tuple[object, tuple[int, ...]]:
    """(the other stop strings, the ids of the special tokens named): a special token (`<|im_end|>`, `</s>`)
    decodes to no text, so a stop string that is one stops on its id instead; one that holds a special
    token's text among other text could never match (RequestError naming the token and the fix)."""
    if stop is None or target.tokenizer is None or isinstance(stop, (str, bytes)):
        return stop, ()
    try:
        stops = list(stop)
    except TypeError:
        return stop, ()
    special = {t.content: i for i, t in target.tokenizer.get_added_tokens_decoder().items() if t.special}
    ids = tuple(special[s] for s in stops if isinstance(s, str) and s in special)
    rest = [s for s in stops if not (isinstance(s, str) and s in special)]
    for s in rest:
        inside = [name for name in special if isinstance(s, str) and name in s]
        if inside:
            raise RequestError(f"stop string {s!r} holds the special token {inside[0]!r}, which decodes to no text, "
                               f"so the string can never be matched: stop on the token alone (stop=[{inside[0]!r}] or "
                               f"stop_ids=[{special[inside[0]]}]) or on the text around it")
    return (rest if rest else None), ids


def _stop_table(target: Target, stop):
    """The stop strings' token table (jspec.decode.stop.build_table), or None without stop strings."""
    if stop is None:
        return None
    try:
        stops = stop_strings.check_stops(stop)
    except ValueError as err:
        raise RequestError(str(err)) from None
    if not stops:
        return None
    if target.tokenizer is None:
        raise RequestError(f"stop strings need the target's tokenizer to read the tokens' text, and target "
                           f"{target.path!r} has none (no tokenizer.json): add its tokenizer.json, or stop on token "
                           "ids with stop_ids=[...]")
    return stop_strings.build_table(target.tokenizer, stops, target.cfg.vocab_size)


def _check_on_commit(on_commit, mesh) -> None:
    if on_commit is None:
        return
    if not callable(on_commit):
        raise RequestError(f"on_commit must be a callable taking each round's committed tokens (list[list[int]]), "
                           f"got {on_commit!r}")
    if mesh is not None:
        raise RequestError("on_commit streaming runs on one device and is not available with a mesh: drop mesh "
                           "to stream, or drop on_commit and read res.tokens")


def _check_given_drafter(drafter, block_size, tree_budget) -> None:
    """A Drafter object (or (Drafter, params) pair) runs as given: refuse a block size / tree budget it does not
    have rather than ignore it."""
    dr = drafter[0] if isinstance(drafter, tuple) and drafter and isinstance(drafter[0], Drafter) else drafter
    if not isinstance(dr, Drafter):
        return
    has = f"{dr.num_drafts}-node tree" if dr.kind == "tree" else f"chain of {dr.num_drafts} drafts"
    asked = None
    if _is_int(block_size) and (dr.kind != "chain" or dr.num_drafts != block_size):
        asked = f"block_size={block_size}"
    elif _is_int(tree_budget) and tree_budget and (dr.kind != "tree" or dr.num_drafts != tree_budget):
        asked = f"tree_budget={tree_budget}"
    if asked:
        raise RequestError(f"the {type(dr).__name__} drafter object drafts a {has} and runs as given, so {asked} "
                           "cannot reshape it: drop that argument, or build the drafter at that shape "
                           "(jspec.drafters.family.family_of(drafter).with_shape(drafter, block_size, tree_budget))")


def _check_context(lens: np.ndarray, max_new_tokens: int, max_pos: int | None) -> None:
    """Refuse a prompt + max_new_tokens beyond the model's max_position_embeddings (naming both numbers)."""
    if max_pos is None:
        return
    row = int(lens.argmax())
    longest = int(lens[row])
    if longest >= max_pos:
        raise RequestError(f"prompt {row} has {longest} tokens, which leaves no room for a new token in the model's "
                           f"max_position_embeddings of {max_pos}: shorten it to at most {max_pos - 1} tokens")
    if longest + max_new_tokens > max_pos:
        raise RequestError(f"prompt {row} ({longest} tokens) + max_new_tokens {max_new_tokens} = "
                           f"{longest + max_new_tokens} positions, more than the model's max_position_embeddings "
                           f"{max_pos}: lower max_new_tokens to at most {max_pos - longest}, or shorten the prompt")


SEED_RANGE = 2**32


def _check_seeds(seeds, batch: int) -> np.ndarray:
    """One uint32 seed per prompt; seeds outside [0, 2**32) are refused, never wrapped."""
    if _is_int(seeds):
        seeds = int(seeds)
        if not 0 <= seeds or seeds + batch - 1 >= SEED_RANGE:
            last = f" (prompt i takes seed + i, up to {seeds + batch - 1})" if batch > 1 else ""
            raise RequestError(f"seed {seeds}{last} is outside [0, 2**32) = [0, {SEED_RANGE}): pass a seed in "
                               f"[0, {SEED_RANGE - batch}]")
        return np.arange(seeds, seeds + batch, dtype=np.int64).astype(np.uint32)
    if isinstance(seeds, (str, bytes)):
        raise RequestError(f"seeds must be integers (one per prompt, or one int), got {seeds!r}")
    if hasattr(seeds, "dtype") and hasattr(seeds, "shape"):
        arr = np.asarray(seeds)
        if arr.size and arr.dtype.kind not in "iu":
            raise RequestError(f"seeds must be integers, got {arr.dtype} values: {arr.reshape(-1)[:8].tolist()}")
        seeds = arr.reshape(-1).tolist() if arr.ndim else [arr.item()]
    try:
        seeds = list(seeds)
    except TypeError:
        raise RequestError(f"seeds must be one int or one integer per prompt, got {seeds!r}") from None
    bad = [s for s in seeds if not _is_int(s)]
    if bad:
        raise RequestError(f"seeds must be integers (never truncated), got {bad[:8]}")
    if len(seeds) != batch:
        raise RequestError(f"got {len(seeds)} seeds for {batch} prompts: pass one seed per prompt or one int")
    out = [int(s) for s in seeds if not 0 <= int(s) < SEED_RANGE]
    if out:
        raise RequestError(f"seeds {out[:8]} are outside [0, 2**32) = [0, {SEED_RANGE}): each seed is a uint32; pass "
                           "seeds in that range (they are never wrapped)")
    return np.asarray([int(s) for s in seeds], np.uint32)


def _check_eos(eos_ids, vocab_size: int) -> tuple[int, ...]:
    """Explicit EOS ids: integers inside the vocabulary (an id the model cannot emit would never stop a row)."""
    return _token_ids(eos_ids, "eos_ids", vocab_size, example="[2], or [] for none",
                      emit="pass ids the model can emit (e.g. tokenizer.token_to_id('</s>')), or [] for none")


def _token_ids(value, name: str, vocab_size: int, *, example: str, emit: str) -> tuple[int, ...]:
    """A list of token ids (a list, tuple or array of integers inside [0, vocab_size)), or a RequestError
    naming `name`, the bad values and the fix."""
    if _is_int(value) or isinstance(value, (str, bytes)):
        raise RequestError(f"{name} must be a list of token ids, got {value!r}: pass e.g. {example}")
    try:
        ids = list(np.asarray(value).reshape(-1).tolist() if hasattr(value, "dtype") else value)
    except TypeError:
        raise RequestError(f"{name} must be a list of token ids, got {value!r}: pass e.g. {example}") from None
    bad = [e for e in ids if not _is_int(e)]
    if bad:
        raise RequestError(f"{name} must be integer token ids, got {bad[:8]}: pass e.g. {example}")
    out = [int(e) for e in ids if not 0 <= int(e) < vocab_size]
    if out:
        raise RequestError(f"{name} {out[:8]} are outside the vocabulary [0, {vocab_size}): no token can ever match "
                           f"them; {emit}")
    return tuple(int(e) for e in ids)


def _memory_bytes(mesh) -> tuple[int, str] | None:
    """(bytes, what) of the memory a cache lives in: the device's (times the mesh's devices), or host RAM
    for CPU devices; None when unknown."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    try:
        stats = devices[0].memory_stats()
    except Exception:  # backends without memory statistics
        stats = None
    if stats and stats.get("bytes_limit"):
        n = len(devices)
        kind = f"{n} x {devices[0].device_kind}" if n > 1 else devices[0].device_kind
        return int(stats["bytes_limit"]) * n, f"{kind} device memory"
    if devices[0].platform == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host RAM"
        except (ValueError, OSError, AttributeError):
            return None
    return None


def _check_cache_memory(target: Target, batch: int, cache_rows: int, cache_size: int, mesh) -> None:
    """Refuse a KV cache (and text buffers) that cannot fit the memory it would be allocated in, with the
    numbers: KV bytes = layers x 2 (K, V) x KV heads x head_dim x itemsize x batch x rows."""
    cfg = target.cfg
    shapes = jax.eval_shape(lambda: tm.init_cache(cfg, batch, cache_rows, target.params["embed"].dtype))
    kv = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(shapes))
    need = kv + batch * cache_size * 8  # + the int32 tokens and float32 log-probs of the text buffer
    have = _memory_bytes(mesh)
    if have is None or need <= have[0]:
        return
    per = ""
    if all(hasattr(cfg, f) for f in ("num_layers", "num_kv_heads", "head_dim")):
        item = np.dtype(target.params["embed"].dtype).itemsize
        per = (f" ({cfg.num_layers} layers x 2 x {cfg.num_kv_heads} KV heads x {cfg.head_dim} head_dim x {item} bytes "
               f"x batch {batch} x {cache_rows} rows)")
    gib = 2**30
    raise RequestError(f"the KV cache needs {need / gib:.1f} GiB{per}, more than the {have[0] / gib:.1f} GiB of "
                       f"{have[1]}: lower max_new_tokens / cache_size ({cache_size} rows per prompt) or the "
                       "batch")


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
        if not _is_int(value) and not (name == "block_size" and value is None):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if block_size is not None and block_size < 1:
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
