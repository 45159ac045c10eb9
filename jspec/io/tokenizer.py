"""Tokenizers from `tokenizer.json` (the Hugging Face `tokenizers` format)."""

from __future__ import annotations

import os

from tokenizers import Tokenizer

from jspec.errors import CheckpointError


def load_tokenizer(model_dir: str) -> Tokenizer | None:
    """The directory's tokenizer.json, or None when the checkpoint ships none (ids-only use); a damaged
    one is a CheckpointError naming it."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # the tokenizers library raises a bare Exception for an unreadable file
        raise CheckpointError(f"{path} is not a valid tokenizer.json (the Hugging Face tokenizers format): {err}; "
                              "the file is damaged or truncated: download it again") from err
