"""jspec's own errors: every one derives from `JspecError`.

The `jspec` command reports a JspecError (and a ValueError or OSError) as one `jspec: error: ...`
message with exit code 2; `jspec --debug` shows the traceback instead. The classes that existed as
ValueErrors before this base class stay ValueErrors too, so `except ValueError` keeps catching them.

A leaf module: it imports nothing from jspec.
"""

from __future__ import annotations


class JspecError(Exception):
    """Base class of the errors jspec raises about its inputs (files, values, runs)."""


class CheckpointError(JspecError, ValueError):
    """A checkpoint is damaged (config.json, tokenizer.json, index or safetensors file) or does not match
    the configuration it is loaded with."""


class ConfigError(JspecError, ValueError):
    """A configuration file (e.g. a training run's JSON) is damaged or malformed."""


class CorpusError(JspecError, ValueError):
    """A training corpus cannot be used as text (e.g. its files are binary, not UTF-8)."""
