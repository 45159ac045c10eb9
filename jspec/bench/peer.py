"""The peer: Hugging Face transformers' own speculative decoding on the same target, side by side with jspec.

The target is exported with `jspec.io.hf.save_params` (float32) and loaded by
`AutoModelForCausalLM.from_pretrained(dir, local_files_only=True)`; it runs on the CPU with torch set
to `threads` threads. Methods, all greedy, batch 1, on the same prompts and token budget, EOS off:

- `ar`: plain `generate`;
- `assisted`: assisted generation with an early-exit assistant: the target's first layer, final norm and
  LM head (a 1-layer LM sharing the vocabulary; no plain-LM built-in exists), drafting exactly g tokens
  a round (constant schedule, confidence threshold off);
- `prompt_lookup`: `prompt_lookup_num_tokens=g`, n-grams up to 3 (jspec's lookup uses 3).

jspec runs the matching methods on the same prompts: plain AR, `lookup` g and the small-LM drafter
with the same early-exit assistant. Every method is timed as decode only: the full call minus its
prefill (which chooses the first token), on the same prompt, pooled over prompts and repeats. For HF the
prefill is `generate(max_new_tokens=1)`; for jspec it is the loop's set-up jitted apart (jspec.bench.timing).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import jax
import jax.numpy as jnp

import jspec
from jspec.api import Target, default_cache_size, pack_prompts
from jspec.bench import metrics
from jspec.bench.timing import Runner
from jspec.drafters.lm import SmallLM
from jspec.io.hf import save_params

HF_METHODS = ("ar", "assisted", "prompt_lookup")
PAIRS = {"ar": "ar", "assisted": "small_lm", "prompt_lookup": "lookup"}  # HF method -> jspec's matching method


def early_exit_assistant(target: Target, layers: int = 1) -> Target:
    """The target's first `layers` layers with its final norm and LM head: a small LM on the same vocabulary."""
    cfg = dataclasses.replace(target.cfg, num_layers=layers, layer_types=target.cfg.layer_types[:layers])
    stack = target.params["layers"]  # per-layer dicts, or stacked [L, ...] arrays (layer_loop "scan")
    first = jax.tree.map(lambda x: x[:layers], stack) if isinstance(stack, dict) else stack[:layers]
    params = dict(target.params, layers=first)
    return Target(cfg, params, target.tokenizer, None)


def planned_calls(prompts: int, repeats: int) -> int:
    """Progress units `run_peer` reports: one warm-up and one per timed prompt, 3 jspec and 3 HF methods."""
    return 6 + 6 * repeats * prompts


def run_peer(target: Target, prompts: list[list[int]], max_new_tokens: int, block_size: int, repeats: int,
             threads: int, seed: int, tick=lambda label: None) -> dict:
    """Tokens/s of each HF method and jspec's matching method, and jspec's ratio over each HF method.

    Returns {"skipped": reason} when torch / transformers are not installed.
    """
    try:
        import torch
        import transformers
    except ImportError as err:
        return {"skipped": f"the peer needs torch and transformers ({err}); install them with pip install -e '.[test]'"}
    assistant = early_exit_assistant(target)
    packed, _ = pack_prompts(prompts, target.cfg.vocab_size)
    cache_size = default_cache_size(packed.shape[1], max_new_tokens)
    lookup = jspec.load_drafter("lookup", target, block_size=block_size)
    jspec_runs = {
        "ar": Runner("ar", target, 0.0, cache_size),
        "lookup": Runner("lookup", target, 0.0, cache_size, lookup, "greedy"),
        "small_lm": Runner("small_lm", target, 0.0, cache_size,
                           (SmallLM(cfg=assistant.cfg, block_size=block_size), assistant.params), "greedy"),
    }
    log = transformers.logging
    previous = torch.get_num_threads(), log.get_verbosity(), log.is_progress_bar_enabled()
    torch.set_num_threads(threads)
    log.set_verbosity_error()
    log.disable_progress_bar()  # one progress bar: the bench's
    try:
        with tempfile.TemporaryDirectory() as tmp:
            hf = _load_hf(target, assistant, tmp, block_size, transformers)
            calls = {("hf", name): _hf_caller(hf, name, block_size, max_new_tokens, torch, transformers)
                     for name in HF_METHODS}
            calls.update({("jspec", name): _jspec_caller(run, max_new_tokens, seed)
                          for name, run in jspec_runs.items()})
            outputs, times = _measure(calls, prompts, max_new_tokens, repeats, tick)
    finally:
        torch.set_num_threads(previous[0])
        log.set_verbosity(previous[1])
        if previous[2]:
            log.enable_progress_bar()
    rates = {key: metrics.decode_timing(*times[key]) for key in calls}
    reference = outputs[("jspec", "ar")]
    tps = {key: rate["tokens_per_s"] for key, rate in rates.items()}
    return {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "block_size": block_size,
        "repeats": repeats,
        "torch_threads": threads,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "assistant": "early exit: the target's layer 0 + final norm + LM head (1 layer, same vocabulary)",
        "interval": "decode = full call - prefill (HF: generate(max_new_tokens) - generate(max_new_tokens=1); "
                    "jspec: as in the main run), same prompt, greedy, batch 1",
        "hf": {name: _summary(rates[("hf", name)], outputs[("hf", name)], reference) for name in HF_METHODS},
        "jspec": {name: _summary(rates[("jspec", name)], outputs[("jspec", name)], reference) for name in jspec_runs},
        "ratio": {f"jspec_{PAIRS[name]}_over_hf_{name}": tps[("jspec", PAIRS[name])] / tps[("hf", name)]
                  for name in HF_METHODS},
        "best_ratio": max(tps[("jspec", n)] for n in jspec_runs) / max(tps[("hf", n)] for n in HF_METHODS),
    }


def _measure(calls: dict, prompts, max_new_tokens: int, repeats: int, tick):
    """Warm every method up on the first prompt (compiles jspec's functions), then time repeats interleaved
    across methods; the first repeat's outputs are kept. calls[key] = (prefill(prompt) -> seconds,
    full(prompt) -> (seconds, tokens)).

    Returns (outputs by key, (call_s, prefill_s, tokens) by key, each [repeat][prompt])."""
    for key, (prefill, full) in calls.items():
        prefill(prompts[0])
        full(prompts[0])
        tick(f"peer warm-up {key[0]} {key[1]}")
    outputs = {key: [] for key in calls}
    times = {key: ([], [], []) for key in calls}
    for r in range(repeats):
        for key, (prefill, full) in calls.items():
            call_s, prefill_s, tokens = [], [], []
            for p in prompts:
                prefill_s.append(prefill(p))
                elapsed, out = full(p)
                call_s.append(elapsed)
                tokens.append(len(out) - 1)
                if r == 0:
                    outputs[key].append(out)
                tick(f"peer {key[0]} {key[1]}")
            for row, values in zip(times[key], (call_s, prefill_s, tokens)):
                row.append(values)
    return outputs, times


def _summary(rate: dict, outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Rate record plus agreement with jspec's plain greedy output (1.0: identical tokens)."""
    same = sum(a == b for out, ref in zip(outputs, reference) for a, b in zip(out, ref))
    total = sum(len(ref) for ref in reference)
    return {**rate, "agreement_with_jspec_ar": same / total}


def _load_hf(target: Target, assistant: Target, tmp: str, block_size: int, transformers) -> dict:
    models = {}
    for name, model in (("target", target), ("assistant", assistant)):
        path = os.path.join(tmp, name)
        save_params(path, model.cfg, model.params, dtype=jnp.float32)
        models[name] = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    gc = models["assistant"].generation_config
    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = block_size, "constant"
    gc.assistant_confidence_threshold = 0.0  # no early stop: exactly g drafts a round, as jspec's small LM
    return models


def _hf_caller(models: dict, method: str, block_size: int, max_new_tokens: int, torch, transformers):
    """(prefill, full) for one HF method: prefill = `generate` with max_new_tokens=1 (prefill and the first
    token), full = `generate` with max_new_tokens."""
    model = models["target"]
    extra = {"assistant_model": models["assistant"]} if method == "assisted" else {}
    lookup = dict(prompt_lookup_num_tokens=block_size, max_matching_ngram_size=3) if method == "prompt_lookup" else {}

    def run(prompt, n):
        gc = transformers.GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                                           **lookup)
        ids = torch.tensor([prompt], dtype=torch.long)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc, **extra)
            elapsed = time.perf_counter() - t0
        return elapsed, out[0, len(prompt):].tolist()

    return (lambda prompt: run(prompt, 1)[0]), (lambda prompt: run(prompt, max_new_tokens))


def _jspec_caller(runner: Runner, max_new_tokens: int, seed: int):
    """(prefill, full) for one jspec method, timed as in the main run."""
    def full(prompt):
        res = runner.call(prompt, max_new_tokens, seed)
        return res.stats["wall_s"], res.tokens[0]

    return (lambda prompt: runner.prefill_seconds(prompt, max_new_tokens, seed)), full
