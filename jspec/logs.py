"""Log output: jspec's modules log through `logging` (the "jspec" logger tree); the command line sets how
much of it, and of its libraries' chatter, reaches stderr.

    quiet    warnings and errors only (no progress bars)
    normal   jspec's own progress and notes; of the libraries' logs only errors (the default)
    verbose  everything: jspec's debug lines, and the INFO logs of orbax, TFDS, grain and JAX (e.g. the
             persistent compilation cache's hits)

A program using jspec as a library configures logging itself; `configure` is what `jspec` calls.
"""

from __future__ import annotations

import logging
import sys

QUIET, NORMAL, VERBOSE = -1, 0, 1

# Loggers of the libraries jspec drives: orbax and grain log through absl.
LIBRARY_LOGGERS = ("absl", "orbax", "tensorflow_datasets", "grain", "jax", "etils")

_level = NORMAL


class _Format(logging.Formatter):
    """`jspec: warning: message` for warnings and errors (the CLI's error style); plain messages otherwise."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.WARNING:
            return f"jspec: {record.levelname.lower()}: {message}"
        return message


class _Stream(logging.StreamHandler):
    """A handler writing to `stream`, or to whatever sys.stderr is when a record is emitted (so a replaced
    sys.stderr, e.g. a test's capture, is honoured)."""

    def __init__(self, stream=None):
        super().__init__(stream if stream is not None else sys.stderr)
        self._fixed = stream

    @property
    def stream(self):
        return self._fixed if self._fixed is not None else sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def configure(level: int = NORMAL, stream=None) -> None:
    """Send the "jspec" loggers to `stream` (stderr) at the given level (QUIET, NORMAL or VERBOSE), and set
    the libraries' loggers to INFO at VERBOSE, else ERROR (their warnings, such as orbax's notes on
    read-only checkpoint folders, are chatter to a jspec user)."""
    global _level
    _level = level
    root = logging.getLogger("jspec")
    for handler in list(root.handlers):
        if getattr(handler, "_jspec", False):
            root.removeHandler(handler)
    handler = _Stream(stream)
    handler.setFormatter(_Format())
    handler._jspec = True
    root.addHandler(handler)
    root.propagate = False
    root.setLevel({QUIET: logging.WARNING, NORMAL: logging.INFO, VERBOSE: logging.DEBUG}[level])
    library = logging.INFO if level == VERBOSE else logging.ERROR
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(library)
    if level == VERBOSE and not logging.getLogger().handlers:  # the libraries' INFO lines need a handler
        library_handler = _Stream(stream)
        library_handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
        logging.getLogger().addHandler(library_handler)


def snapshot() -> tuple:
    """The logging state `configure` changes, for `restore` (a program that runs the command line in-process,
    `jspec.cli.main([...])`, gets its own settings back)."""
    names = ("jspec", "", *LIBRARY_LOGGERS)
    return (_level, {n: (logging.getLogger(n).level, list(logging.getLogger(n).handlers),
                         logging.getLogger(n).propagate) for n in names})


def restore(state: tuple) -> None:
    global _level
    _level, loggers = state
    for name, (level, handlers, propagate) in loggers.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.handlers[:] = handlers
        logger.propagate = propagate


def verbose() -> bool:
    return _level >= VERBOSE


def progress_enabled() -> bool:
    """Progress bars show unless the command line asked for --quiet."""
    return _level > QUIET
