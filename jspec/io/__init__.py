"""Checkpoint and tokenizer I/O (Hugging Face formats)."""
