"""Tokenizers from `tokenizer.json` (the Hugging Face `tokenizers` format), with the settings of
`tokenizer_config.json` that change what transformers encodes or what chat templates see.

Encoding matches transformers 5.x's `AutoTokenizer` on the same folder (`tokenizer(text)["input_ids"]`):
- BOS / EOS around plain text come from tokenizer.json's post_processor alone. transformers drops
  tokenizer_config.json's `add_bos_token` / `add_eos_token` whenever a tokenizer.json is present (Llama-style
  checkpoints whose post_processor adds `<s>` get it; a post_processor without BOS, or none, gives none,
  whatever add_bos_token says), so jspec does too: the flag is read (`TokenizerSettings.add_bos_token`)
  but never changes the ids;
- the named special tokens of tokenizer_config.json (bos/eos/unk/sep/pad/cls/mask, model-specific `*_token`
  entries, extra / additional special tokens) become special added tokens when tokenizer.json does not
  list them, as transformers adds them (only tokens already in the vocabulary: their ids never change);
- `split_special_tokens: true` encodes special tokens as plain text, as transformers does.
"""

from __future__ import annotations

import dataclasses
import os

from tokenizers import AddedToken, Tokenizer

from jspec.errors import CheckpointError
from jspec.io.files import read_json_object

TOKENIZER_CONFIG = "tokenizer_config.json"
# legacy: read only when tokenizer_config.json lacks added_tokens_decoder (as transformers reads it)
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES), in its order
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


@dataclasses.dataclass(frozen=True)
class TokenizerSettings:
    """What tokenizer_config.json (and a legacy special_tokens_map.json) says beside tokenizer.json.

    special_tokens: transformers' `tokenizer.special_tokens_map`: "bos_token", "eos_token", "pad_token", ... (and
    model-specific "*_token" names) -> the token's text; these are the variables chat templates see.
    extra_special_tokens: the additional special tokens' texts. token_flags: text -> the AddedToken flags the
    file gives it. config: the whole tokenizer_config.json ({} when absent; its "chat_template" is read by
    jspec.io.chat). add_bos_token / add_eos_token: the file's flags (None when absent), informational: with a
    tokenizer.json transformers ignores them (see the module docstring). path: the file read, or None."""

    special_tokens: dict = dataclasses.field(default_factory=dict)
    extra_special_tokens: tuple[str, ...] = ()
    token_flags: dict = dataclasses.field(default_factory=dict)
    split_special_tokens: bool = False
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    config: dict = dataclasses.field(default_factory=dict)
    path: str | None = None


def _token_text(value, where: str, key: str, flags: dict) -> str | None:
    """A special token entry's text: a string, or an AddedToken object {"content": ..., "lstrip": ...}."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        flags[value["content"]] = {k: bool(value[k]) for k in _ADDED_TOKEN_FLAGS if k in value}
        return value["content"]
    raise CheckpointError(f"{where}: {key} is {value!r}; a special token is a string or an AddedToken object "
                          '({"content": "<s>", ...}): the file is damaged')


def _is_token_entry(value) -> bool:
    return isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("content"), str))


def read_tokenizer_settings(model_dir: str, tokenizer: Tokenizer | None = None) -> TokenizerSettings:
    """The folder's tokenizer_config.json settings (TokenizerSettings() when it has none); a damaged file is a
    CheckpointError naming it. `tokenizer`: its tokenizer.json, whose padding gives the pad token when the
    config names none (as transformers takes it)."""
    path = os.path.join(model_dir, TOKENIZER_CONFIG)
    if not os.path.exists(path):
        cfg, path = {}, None
    else:
        cfg = read_json_object(path)
    where = path or os.path.join(model_dir, TOKENIZER_CONFIG)
    flags: dict = {}
    entries = {k: v for k, v in cfg.items() if k in NAMED_SPECIAL_TOKENS}
    entries.update({k: v for k, v in cfg.items()  # model-specific special tokens: any other "*_token" text
                    if k.endswith("_token") and k not in NAMED_SPECIAL_TOKENS and _is_token_entry(v)})
    extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
    if isinstance(extra, dict):  # named extra tokens are model-specific special tokens
        entries.update(extra)
        extra = []
    map_path = os.path.join(model_dir, SPECIAL_TOKENS_MAP)
    if "added_tokens_decoder" not in cfg and os.path.exists(map_path):
        legacy = read_json_object(map_path)
        for key, value in legacy.items():
            if key in ("additional_special_tokens", "extra_special_tokens") and isinstance(value, list):
                extra = list(extra) + [t for t in value if t not in extra]
            elif key in ("additional_special_tokens", "extra_special_tokens") and isinstance(value, dict):
                entries.update(value)
            elif key.endswith("_token"):
                entries[key] = value
        where = f"{where} / {map_path}"
    if not isinstance(extra, (list, tuple)):
        raise CheckpointError(f"{where}: extra_special_tokens is {extra!r}; expected a list of tokens")
    special = {}
    for key, value in entries.items():
        text = _token_text(value, where, key, flags)
        if text is not None:
            special[key] = text
    if "pad_token" not in special and tokenizer is not None and tokenizer.padding:
        special["pad_token"] = tokenizer.padding["pad_token"]
    named = [k for k in NAMED_SPECIAL_TOKENS if k in special] + [k for k in special if k not in NAMED_SPECIAL_TOKENS]
    extras = tuple(t for t in (_token_text(v, where, "extra_special_tokens", flags) for v in extra) if t is not None)
    flag = lambda k: None if cfg.get(k) is None else bool(cfg[k])  # noqa: E731
    return TokenizerSettings(special_tokens={k: special[k] for k in named}, extra_special_tokens=extras,
                             token_flags=flags, split_special_tokens=bool(cfg.get("split_special_tokens", False)),
                             add_bos_token=flag("add_bos_token"), add_eos_token=flag("add_eos_token"), config=cfg,
                             path=path)


def apply_tokenizer_settings(tokenizer: Tokenizer, settings: TokenizerSettings) -> Tokenizer:
    """Make `tokenizer` encode as transformers does with these settings (see the module docstring): the named
    and extra special tokens that tokenizer.json does not list become special added tokens (when the vocabulary
    has them), and split_special_tokens is honoured. Changes and returns `tokenizer`."""
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    new = []
    for text in [*settings.special_tokens.values(), *settings.extra_special_tokens]:
        if text in added or tokenizer.token_to_id(text) is None:
            continue
        flags = {"special": True, **settings.token_flags.get(text, {})}
        new.append(AddedToken(text, **flags))
        added.add(text)
    if new:
        tokenizer.add_special_tokens(new)
    tokenizer.encode_special_tokens = settings.split_special_tokens
    return tokenizer


def load_tokenizer(model_dir: str) -> Tokenizer | None:
    """The directory's tokenizer.json, or None when the checkpoint ships none (ids-only use), with its
    tokenizer_config.json applied (`apply_tokenizer_settings`); a damaged file is a CheckpointError naming it."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    try:
        tok = Tokenizer.from_file(path)
    except Exception as err:  # the tokenizers library raises a bare Exception for an unreadable file
        raise CheckpointError(f"{path} is not a valid tokenizer.json (the Hugging Face tokenizers format): {err}; "
                              "the file is damaged or truncated: download it again") from err
    return apply_tokenizer_settings(tok, read_tokenizer_settings(model_dir, tok))
