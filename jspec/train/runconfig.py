"""The run configs of `jspec train` (JSON files): every key of every section checked before anything runs.

A target run's config has the sections model (ModelConfig fields), data, train (TrainConfig fields) and an
optional init_std and reserved_tokens (special tokens the tokenizer reserves after <|endoftext|>, e.g.
["<|mask|>"] for the mask token of DFlash-style drafters: ids 1, 2, ... that the corpus never produces); a
drafter run's has drafter (the family recipe's settings), data, distill, train and an optional init_std.
The train section of both may also name an official checkpoint to start from ("init": PATH, as `jspec
train --init PATH`). An unknown key (a typo such as "lerning_rate") or a missing required one is a
ConfigError naming the file and every such key with its section, before a corpus is read or a model built.
The drafter section's keys are the recipe's: which ones it reads is known only once it has built the
drafter, so `jspec.train.distill.build_drafter` checks them (with `ReadKeys`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math

from jspec.errors import ConfigError
from jspec.models.config import ModelConfig
from jspec.train.trainer import TrainConfig


def _fields(cls, skip=()) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(required, optional) field names of a dataclass."""
    fields = [f for f in dataclasses.fields(cls) if f.name not in skip]
    required = tuple(f.name for f in fields if f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    return required, tuple(f.name for f in fields if f.name not in required)


# The model's end-of-text id is the tokenizer's, set by the run: not a config key.
_MODEL = _fields(ModelConfig, skip=("eos_token_ids",))
# train.init: the official checkpoint a new run starts from (jspec.train.export), not a TrainConfig field.
_TRAIN = (_fields(TrainConfig)[0], _fields(TrainConfig)[1] + ("init",))

# kind -> section ("" = the top level) -> (required keys, optional keys); None: the section's keys are checked
# elsewhere (the drafter recipe's).
SCHEMAS: dict[str, dict[str, tuple[tuple[str, ...], tuple[str, ...]] | None]] = {
    "target": {
        "": (("model", "data", "train"), ("init_std", "reserved_tokens")),
        "model": _MODEL,
        "data": (("corpus", "seq_len", "batch_size"), ("pattern",)),
        "train": _TRAIN,
    },
    "drafter": {
        "": (("drafter", "data", "distill", "train"), ("init_std",)),
        "drafter": None,
        "data": (("corpus", "batch_size"), ("pattern",)),
        "distill": (("num_prompts", "prompt_len", "new_tokens", "batch"), ("seed",)),
        "train": _TRAIN,
    },
}

_POSITIVE_INTS = {"data": ("seq_len", "batch_size"), "distill": ("num_prompts", "prompt_len", "new_tokens", "batch"),
                  "model": ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                            "num_kv_heads", "head_dim")}
_STRINGS = {"data": ("pattern",), "model": ("family",)}


def _name(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def key_problems(given, required, optional, section: str = "") -> list[str]:
    """Unknown and missing keys of one section (each with its section, close spellings suggested)."""
    known = tuple(required) + tuple(optional)
    where = f"the {section} section" if section else "the top level"
    problems = []
    for key in sorted(set(given) - set(known)):
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"did you mean {_name(section, close[0])!r}? " if close else ""
        problems.append(f"unknown key {_name(section, key)!r} ({hint}{where} takes {', '.join(known)})")
    missing = [k for k in required if k not in given]
    if missing:
        problems.append(f"missing required key{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(repr(_name(section, k)) for k in missing)}")
    return problems


def check_run_config(cfg: dict, path: str, kind: str) -> None:
    """ConfigError naming `path` and every problem: unknown or missing keys at each level, sections that
    are not objects, values of the wrong type, and the train / model sections' own checks."""
    schema = SCHEMAS[kind]
    problems = key_problems(cfg, *schema[""])
    for section, keys in schema.items():
        if not section or section not in cfg:
            continue
        if not isinstance(cfg[section], dict):
            problems.append(f"{section!r} must be an object of settings ({{\"name\": value, ...}}), got "
                            f"{type(cfg[section]).__name__}")
        elif keys is not None:
            problems += key_problems(cfg[section], *keys, section=section)
    if problems:
        raise ConfigError(f"training config {path}: " + "; ".join(problems))
    for section, names in _POSITIVE_INTS.items():
        for n in names:
            v = cfg.get(section, {}).get(n)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                problems.append(f"{section}.{n} must be an integer >= 1, got {v!r}")
    for section, names in _STRINGS.items():
        for n in names:
            v = cfg.get(section, {}).get(n)
            if v is not None and not isinstance(v, str):
                problems.append(f"{section}.{n} must be a string, got {v!r}")
    corpus = cfg.get("data", {}).get("corpus")
    if corpus is not None and not (isinstance(corpus, str) and corpus or isinstance(corpus, list) and corpus
                                   and all(isinstance(c, str) and c for c in corpus)):
        problems.append("data.corpus must be a source or a list of sources (\"stdlib\", \"site-packages\" or a "
                        f"folder), got {corpus!r}")
    seed = cfg.get("distill", {}).get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        problems.append(f"distill.seed must be an integer >= 0, got {seed!r}")
    if kind == "target" and any(k in cfg.get("train", {}) for k in ("eval_every", "eval_prompts")):
        problems.append("train.eval_every / eval_prompts report a drafter's validation tau, and a target run has "
                        "no drafter: drop them")
    init = cfg.get("train", {}).get("init")
    if init is not None and (not isinstance(init, str) or not init):
        problems.append(f"train.init must be the path of a checkpoint folder (a string), got {init!r}")
    reserved = cfg.get("reserved_tokens", [])
    if (not isinstance(reserved, list) or not all(isinstance(t, str) and t for t in reserved)
            or len(set(reserved)) != len(reserved) or "<|endoftext|>" in reserved):
        problems.append("reserved_tokens must be a list of distinct, non-empty token strings other than "
                        f"<|endoftext|> (always id 0), e.g. [\"<|mask|>\"], got {reserved!r}")
    std = cfg.get("init_std", 0.02)
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not math.isfinite(std) or std <= 0:
        problems.append(f"init_std must be a finite number > 0, got {std!r}")
    if problems:
        raise ConfigError(f"training config {path}: " + "; ".join(problems))
    try:
        TrainConfig(**{k: v for k, v in cfg["train"].items() if k != "init"})
        if "model" in schema:
            ModelConfig(**cfg["model"])
    except (TypeError, ValueError) as err:
        raise ConfigError(f"training config {path}: {err}") from None


class ReadKeys(dict):
    """A config section that records the keys its reader looks up (`read`) and those it needed but did
    not find (`absent`: looked up with [] or `in`). Iterating or copying it counts as reading every key."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read: set = set()
        self.absent: set = set()

    def __getitem__(self, key):
        self.read.add(key)
        if not super().__contains__(key):
            self.absent.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        found = super().__contains__(key)
        if not found:
            self.absent.add(key)
        return found

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def unread(self) -> set:
        """The keys nobody has looked up (yet)."""
        return set(super().keys()) - self.read

    def _all(self):
        self.read.update(super().keys())

    def __iter__(self):
        self._all()
        return super().__iter__()

    def keys(self):
        self._all()
        return super().keys()

    def items(self):
        self._all()
        return super().items()

    def values(self):
        self._all()
        return super().values()

    def copy(self):
        self._all()
        return dict(self)

    def pop(self, key, *default):
        self.read.add(key)
        return super().pop(key, *default)

    def setdefault(self, key, default=None):
        self.read.add(key)
        return super().setdefault(key, default)
