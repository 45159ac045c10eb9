"""Checkpoints where users have them: the local Hugging Face cache, offline.

`resolve_hub_path(spec)` turns what a user types into a model folder:
- an existing local folder (or file) is itself, whatever its spelling, so a folder named like a repo
  id (`org/name`) wins over the cache;
- a cache repo folder `.../models--org--name` is its snapshot: the one `refs/main` names, else the
  only one (several snapshots without `refs/main` are an error that lists them);
- a repo id `org/name` or `org/name@revision` (a branch, tag or commit hash) is looked up in the local
  cache with huggingface_hub's own cache lookup (`snapshot_download(..., local_files_only=True)`), which
  never opens a connection; the cache folder is found from `HF_HUB_CACHE` / `HF_HOME` by
  huggingface_hub's rules (`hub_cache_dir`). jspec never downloads: a repo id that is not cached is a
  `HubCacheError` naming the cache folder it looked in and the command that downloads it;
- anything else is returned unchanged (the loaders report a missing folder).
"""

from __future__ import annotations

import os
import re

from jspec.errors import JspecError

REPO_PREFIX = "models--"  # huggingface_hub's cache folder of a model repo: models--{org}--{name}
DEFAULT_REVISION = "main"
# `org/name`, optionally `@revision`: exactly one slash in the id (a path like ./x, /x or a/b/c is a path)
_REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9_.][\w.-]*)(?:@(?P<revision>[^\s@]+))?")


class HubCacheError(JspecError, FileNotFoundError):
    """A Hugging Face repo id or cache folder does not lead to a cached snapshot (never downloaded, another
    revision, several snapshots to choose from, an incomplete download); the message names where jspec
    looked and the fix."""


def _is_true(value: str | None) -> bool:
    return value is not None and value.upper() in {"1", "ON", "YES", "TRUE"}


def hub_cache_dir(environ=None) -> str:
    """The Hugging Face hub cache folder, by huggingface_hub's rules, read from the environment now (not at
    import): HF_HUB_CACHE, else the legacy HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, where HF_HOME defaults to
    $XDG_CACHE_HOME/huggingface, itself defaulting to ~/.cache/huggingface (~ and $VARS expanded)."""
    env = os.environ if environ is None else environ
    expand = lambda p: os.path.expandvars(os.path.expanduser(p))  # noqa: E731
    xdg = env.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    home = expand(env.get("HF_HOME", os.path.join(xdg, "huggingface")))
    legacy = env.get("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub"))
    if _is_true(env.get("HUGGINGFACE_CO_STAGING")):  # huggingface_hub's staging mode keeps a cache of its own
        legacy = os.path.join(os.path.expanduser("~"), ".cache", "huggingface_staging", "hub")
    return expand(env.get("HF_HUB_CACHE", legacy))


def parse_repo_id(spec: str) -> tuple[str, str | None] | None:
    """(repo_id, revision or None) when `spec` is spelled `org/name` or `org/name@revision`; None otherwise."""
    m = _REPO_ID.fullmatch(spec)
    if m is None:
        return None
    repo, revision = m.group("repo"), m.group("revision")
    if "--" in repo or ".." in repo or repo.endswith(".git"):  # names the Hub refuses
        return None
    if revision is not None and (".." in revision.split("/") or revision.startswith("/")):
        return None
    return repo, revision


def repo_cache_folder(repo_id: str, cache_dir: str | None = None) -> str:
    """Where huggingface_hub caches a model repo: {cache}/models--{org}--{name}."""
    return os.path.join(hub_cache_dir() if cache_dir is None else cache_dir, REPO_PREFIX + repo_id.replace("/", "--"))


def is_cache_repo_folder(path: str) -> bool:
    """Is `path` a cache repo folder (models--org--name holding snapshots/), not a model folder itself?"""
    name = os.path.basename(os.path.normpath(path))
    return (name.startswith(REPO_PREFIX) and os.path.isdir(os.path.join(path, "snapshots"))
            and not os.path.exists(os.path.join(path, "config.json")))


def _snapshots(folder: str) -> list[str]:
    snaps = os.path.join(folder, "snapshots")
    try:
        return sorted(s for s in os.listdir(snaps) if os.path.isdir(os.path.join(snaps, s)))
    except OSError:
        return []


def _refs(folder: str) -> dict[str, str]:
    """Cached revision names (branches, tags, refs/pr/N) -> the commit hash each names."""
    root, out = os.path.join(folder, "refs"), {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            full = os.path.join(dirpath, f)
            try:
                with open(full, encoding="utf-8") as fh:
                    out[os.path.relpath(full, root).replace(os.sep, "/")] = fh.read().strip()
            except (OSError, UnicodeDecodeError):
                continue
    return dict(sorted(out.items()))


def _choices(folder: str) -> str:
    snaps, refs = _snapshots(folder), _refs(folder)
    names = "; ".join(f"{os.path.join(folder, 'snapshots', s)}"
                      + (f" ({', '.join(r for r, h in refs.items() if h == s)})" if s in refs.values() else "")
                      for s in snaps)
    return names or "none"


def resolve_cache_folder(folder: str) -> str:
    """The snapshot a cache repo folder (.../models--org--name) stands for: the commit `refs/main` names, else
    the only snapshot; HubCacheError listing the snapshots when there are several (or none)."""
    snaps = _snapshots(folder)
    main = os.path.join(folder, "refs", DEFAULT_REVISION)
    if os.path.isfile(main):
        with open(main, encoding="utf-8") as f:
            commit = f.read().strip()
        snap = os.path.join(folder, "snapshots", commit)
        if os.path.isdir(snap):
            return snap
        raise HubCacheError(f"{main} names commit {commit!r}, but {snap} does not exist (an interrupted download or "
                            f"a pruned cache); snapshots there: {_choices(folder)}: download the repo again, or pass "
                            "one of the snapshot folders")
    if len(snaps) == 1:
        return os.path.join(folder, "snapshots", snaps[0])
    if not snaps:
        raise HubCacheError(f"{folder} is a Hugging Face cache folder with no snapshot in {folder}/snapshots (the "
                            "download did not finish): download the repo again, or pass a model folder")
    repo = os.path.basename(os.path.normpath(folder))[len(REPO_PREFIX):].replace("--", "/")
    raise HubCacheError(f"{folder} holds {len(snaps)} snapshots and no refs/main to choose one: {_choices(folder)}; "
                        f"pass one snapshot folder, or the repo id with its commit ({repo}@<commit>)")


def resolve_repo_id(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """The snapshot folder of `repo_id` at `revision` (None: main) in the local HF cache, found by
    huggingface_hub's cache lookup with local_files_only=True (no network, ever); HubCacheError naming the
    cache folder and the fix when it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        from huggingface_hub.errors import IncompleteSnapshotError
    except ImportError:  # older huggingface_hub: no completeness check, so nothing of the kind is raised

        class IncompleteSnapshotError(Exception):
            pass

    cache_dir = hub_cache_dir() if cache_dir is None else cache_dir
    folder = repo_cache_folder(repo_id, cache_dir)
    spec = repo_id if revision is None else f"{repo_id}@{revision}"
    args = repo_id if revision is None else f"{repo_id} --revision {revision}"
    download = f"`hf download {args}` (or `huggingface-cli download {args}`)"
    if not os.path.isdir(folder):
        raise HubCacheError(
            f"{spec!r} is not a local folder, and the Hugging Face cache has no {os.path.basename(folder)} (looked "
            f"in {cache_dir}, set by HF_HUB_CACHE or HF_HOME): download it once with {download}, point HF_HOME / "
            "HF_HUB_CACHE at the cache that holds it, or pass the model's folder; jspec never downloads")
    try:
        snap = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True, token=False)
    except IncompleteSnapshotError as err:
        raise HubCacheError(f"the cached snapshot of {spec!r} in {folder} is incomplete: {err}; complete it with "
                            f"{download}") from None
    except LocalEntryNotFoundError:
        if revision is None:  # no refs/main: the only snapshot, or a clear choice
            return resolve_cache_folder(folder)
        raise HubCacheError(f"the Hugging Face cache holds {repo_id} ({folder}) but not its revision {revision!r}: "
                            f"cached revisions: {', '.join(_refs(folder)) or 'none'}; snapshots: {_choices(folder)}; "
                            f"download that revision with {download}, or pass a cached one") from None
    return str(snap)


def resolve_hub_path(spec: str) -> str:
    """A model folder for `spec` (see the module docstring): local paths first, then a cache repo folder's
    snapshot, then a repo id in the local HF cache; other strings come back unchanged."""
    if os.path.exists(spec):
        return resolve_cache_folder(spec) if is_cache_repo_folder(spec) else spec
    parsed = parse_repo_id(spec)
    if parsed is None:
        return spec
    parent = parsed[0].split("/", 1)[0]
    if os.path.isdir(parent) and not os.path.isdir(repo_cache_folder(parsed[0])):
        # `runs/dflash` with `runs/` on disk and no such repo cached: a mistyped folder, not a repo id
        raise FileNotFoundError(f"no folder {spec!r} (the folder {parent!r} exists, and holds "
                                f"{sorted(os.listdir(parent))[:8]}): check the path")
    return resolve_repo_id(*parsed)
