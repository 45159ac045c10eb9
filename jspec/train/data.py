"""Text corpora as TFDS datasets (array_record, no TensorFlow) and grain pipelines of packed sequences.

A corpus is one or more folders of text files (e.g. the Python standard library's source and the sources
of the installed packages). The split is by file: a file's validation membership is a hash of its path
relative to its folder, so it never changes when files or other folders are added. Sequences are packed:
documents are tokenized, joined with the end-of-text token and cut into fixed-length windows; a grain
MapDataset shuffles them with a fixed seed and batches them, and batch i is a pure function of (seed, i),
which is what makes resuming exact.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig

import grain
import numpy as np
import tensorflow_datasets as tfds

from jspec.errors import CorpusError

VALIDATION_FRACTION = 0.05


def stdlib_dir() -> str:
    """The interpreter's standard-library source folder: a real code corpus on every machine."""
    return sysconfig.get_paths()["stdlib"]


def site_packages_dir() -> str:
    """The interpreter's site-packages folder: the sources of the installed packages (test folders are
    skipped by `corpus_files`, as in the standard library)."""
    return sysconfig.get_paths()["purelib"]


def corpus_files(root: str, pattern: str = "**/*.py", exclude: tuple[str, ...] = ("test", "site-packages",
                                                                                       "idlelib", "lib2to3", "encodings")) -> list[str]:
    """Sorted files under root matching pattern, skipping paths with an excluded component."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"corpus folder {root!r} does not exist: pass a folder of text files")
    files = []
    for path in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
        parts = os.path.relpath(path, root).split(os.sep)
        if not any(p.startswith(e) for p in parts[:-1] for e in exclude) and os.path.isfile(path):
            files.append(path)
    if not files:
        raise ValueError(f"corpus folder {root!r} has no files matching {pattern!r}: nothing to train on")
    check_text_files(root, files, pattern)
    return files


def check_text_files(root: str, files: list[str], pattern: str) -> None:
    """CorpusError naming the files that are not UTF-8 text (binary files would train on garbage)."""
    bad = []
    for path in files:
        with open(path, "rb") as f:
            raw = f.read()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as err:
            bad.append(f"{os.path.relpath(path, root)} (byte {err.start}: {err.reason})")
    if bad:
        raise CorpusError(
            f"corpus folder {root!r}: {len(bad)} of {len(files)} files matching {pattern!r} are not UTF-8 text: "
            f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; jspec trains on text files: choose a pattern "
            "that matches only text, or remove the binary files")


def is_validation(rel_path: str, fraction: float = VALIDATION_FRACTION) -> bool:
    h = int(hashlib.sha256(rel_path.encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


def split_files(root: str, files: list[str]) -> dict[str, list[str]]:
    out = {"train": [], "validation": []}
    for f in files:
        out["validation" if is_validation(os.path.relpath(f, root)) else "train"].append(f)
    if not out["train"] or not out["validation"]:
        raise ValueError(f"corpus {root!r} has {len(files)} files: too few for a train/validation split by file")
    return out


def split_sources(sources, pattern: str = "**/*.py") -> dict[str, list[tuple[str, str]]]:
    """(name, path) of every file of every source (label, folder), split by file: each file by its path
    relative to its own folder (`is_validation`), so a folder's split is the same alone or beside others.
    The name is that relative path, prefixed with the source's label when there are several sources."""
    sources = _as_sources(sources)
    out = {"train": [], "validation": []}
    for label, root in sources:
        for path in corpus_files(root, pattern):
            rel = os.path.relpath(path, root)
            name = f"{label}/{rel}" if len(sources) > 1 else rel
            out["validation" if is_validation(rel) else "train"].append((name, path))
    if not out["train"] or not out["validation"]:
        folders = ", ".join(repr(root) for _, root in sources)
        raise ValueError(f"corpus {folders} has {len(out['train']) + len(out['validation'])} files: too few for a "
                         "train/validation split by file")
    return out


def _as_sources(sources) -> list[tuple[str, str]]:
    """A folder, or (label, folder) pairs with distinct labels."""
    if isinstance(sources, str):
        return [(os.path.basename(os.path.normpath(sources)) or sources, sources)]
    sources = [tuple(s) for s in sources]
    labels = [label for label, _ in sources]
    if not sources or len(set(labels)) != len(labels):
        raise ValueError(f"corpus sources need distinct labels, got {labels}")
    return sources


class TextCorpus(tfds.core.GeneratorBasedBuilder):
    """Local text files of one or more folders -> {'path', 'text'} examples, split by file into train /
    validation (`split_sources`)."""

    VERSION = tfds.core.Version("1.0.0")

    def __init__(self, *, sources=None, pattern: str = "**/*.py", **kwargs):
        self._sources = sources
        self._pattern = pattern
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Text files of local folders, split by file.",
            features=tfds.features.FeaturesDict({"path": tfds.features.Text(), "text": tfds.features.Text()}),
        )

    def _split_generators(self, dl_manager):
        splits = split_sources(self._sources, self._pattern)
        return {name: self._generate_examples(entries) for name, entries in splits.items()}

    def _generate_examples(self, entries):
        for name, path in entries:
            with open(path, encoding="utf-8") as f:  # checked to be UTF-8 by corpus_files
                yield name, {"path": name, "text": f.read()}


def build_corpus(sources, data_dir: str, pattern: str = "**/*.py") -> str:
    """Prepare the corpus (a folder, or (label, folder) pairs) as an array_record TFDS dataset under data_dir;
    returns its directory."""
    builder = TextCorpus(sources=_as_sources(sources), pattern=pattern, data_dir=data_dir, file_format="array_record")
    _prepare(builder)
    return builder.data_dir


def read_split(dataset_dir: str, split: str) -> list[dict]:
    """All examples of a prepared split, in the dataset's order."""
    source = tfds.builder_from_directory(dataset_dir).as_data_source(split=split)
    out = []
    for i in range(len(source)):
        ex = source[i]
        out.append({k: (v.decode() if isinstance(v, bytes) else v) for k, v in ex.items()})
    return out


def pack_tokens(docs: list[list[int]], seq_len: int, eos_id: int) -> np.ndarray:
    """Join documents with EOS and cut into [N, seq_len + 1] windows (input + next-token label)."""
    stream = np.concatenate([np.asarray(d + [eos_id], np.int32) for d in docs])
    n = (len(stream) - 1) // seq_len
    if n < 1:
        raise ValueError(f"corpus has {len(stream)} tokens: not enough for one sequence of {seq_len + 1}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None]
    return stream[idx]


def batches(windows: np.ndarray, batch_size: int, seed: int) -> grain.MapDataset:
    """Shuffled (fixed seed), repeated, batched windows; element i is batch i (random access)."""
    if len(windows) < batch_size:
        raise ValueError(f"{len(windows)} sequences are fewer than one batch of {batch_size}")
    ds = grain.MapDataset.source(windows).shuffle(seed=seed).repeat()
    return ds.batch(batch_size, drop_remainder=True)


class TokenSequences(tfds.core.GeneratorBasedBuilder):
    """Token sequences (e.g. prompts with the target's own responses) from .npz files with arrays
    `tokens` [N, T] int32, `length` [N] and `prompt_len` [N]; one split per file."""

    VERSION = tfds.core.Version("1.0.0")

    def __init__(self, *, splits: dict[str, str] | None = None, **kwargs):
        self._splits = splits or {}
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Token sequences with their prompt lengths.",
            features=tfds.features.FeaturesDict({
                "tokens": tfds.features.Tensor(shape=(None,), dtype=np.int32),
                "prompt_len": tfds.features.Scalar(dtype=np.int32),
            }),
        )

    def _split_generators(self, dl_manager):
        return {name: self._generate_examples(path) for name, path in self._splits.items()}

    def _generate_examples(self, path):
        arrays = np.load(path)
        for i, (toks, n, p) in enumerate(zip(arrays["tokens"], arrays["length"], arrays["prompt_len"])):
            yield i, {"tokens": toks[:n].astype(np.int32), "prompt_len": np.int32(p)}


def build_token_dataset(splits: dict[str, str], data_dir: str) -> str:
    builder = TokenSequences(splits=splits, data_dir=data_dir, file_format="array_record")
    _prepare(builder)
    return builder.data_dir


def _prepare(builder) -> None:
    """download_and_prepare, with TFDS's own printed lines and progress bars shown only at `--verbose`
    (jspec.logs); one line of jspec's own says what was built."""
    import contextlib
    import io
    import logging

    from tensorflow_datasets.core.utils import tqdm_utils

    from jspec import logs

    if logs.verbose():
        builder.download_and_prepare()
        return
    shown = tqdm_utils._active
    tfds.display_progress_bar(False)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            builder.download_and_prepare()
    finally:
        tfds.display_progress_bar(shown)
    logging.getLogger(__name__).info("dataset %s: %s", builder.name, builder.data_dir)


def padded_examples(examples: list[dict], seq_len: int) -> dict[str, np.ndarray]:
    """tokens [N, seq_len] (cut or zero-padded) and loss_mask [N, seq_len] (1 on response tokens)."""
    n = len(examples)
    tokens = np.zeros((n, seq_len), np.int32)
    mask = np.zeros((n, seq_len), np.float32)
    for i, ex in enumerate(examples):
        t = np.asarray(ex["tokens"])[:seq_len]
        tokens[i, : len(t)] = t
        mask[i, int(ex["prompt_len"]) : len(t)] = 1.0
    return {"tokens": tokens, "loss_mask": mask}


def dict_batches(arrays: dict[str, np.ndarray], batch_size: int, seed: int) -> grain.MapDataset:
    """Like `batches` for a dict of equal-length arrays; element i is batch i with its step index."""
    n = len(next(iter(arrays.values())))
    if n < batch_size:
        raise ValueError(f"{n} sequences are fewer than one batch of {batch_size}")
    ds = grain.MapDataset.range(n).shuffle(seed=seed).repeat().map(lambda i: {k: v[i] for k, v in arrays.items()})
    return ds.batch(batch_size, drop_remainder=True)
