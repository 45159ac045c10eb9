"""Tokenizers from `tokenizer.json` (the Hugging Face `tokenizers` format)."""

from __future__ import annotations

import os

from tokenizers import Tokenizer


def load_tokenizer(model_dir: str) -> Tokenizer | None:
    """The directory's tokenizer.json, or None when the checkpoint ships none (ids-only use)."""
    path = os.path.join(model_dir, "tokenizer.json")
    return Tokenizer.from_file(path) if os.path.exists(path) else None
