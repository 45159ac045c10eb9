"""The files of a training run survive crashes: written whole or not at all, one run per folder.

`atomic_file` and `replace_folder` write to a temporary name in the same folder and `os.replace` it
into place, so a run killed mid-write leaves the previous file (or none), never a truncated one that
every later resume would trip over. `RunLock` is an exclusive lock on the run folder's `.lock` file
(fcntl.flock: the kernel releases it when the process ends, however it ends).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from collections.abc import Callable, Iterator

from jspec.errors import JspecError

try:
    import fcntl
except ImportError:  # not POSIX: runs are not locked
    fcntl = None


class RunFolderBusy(JspecError, ValueError):
    """Another training run holds the run folder (its `.lock` file)."""


def _temp_name(path: str, kind: str) -> str:
    """A hidden name beside `path` that keeps its extension (np.savez appends .npz to names without it)."""
    folder, base = os.path.split(os.path.abspath(path))
    stem, ext = os.path.splitext(base)
    return os.path.join(folder, f".{stem}.{os.getpid()}.{kind}{ext}")


def _fsync_dir(folder: str) -> None:
    with contextlib.suppress(OSError):  # not every file system syncs folders
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_file(path: str, write: Callable[[str], None]) -> str:
    """`write(tmp)` writes the file's content to the path it is given (a temporary file in the same
    folder), which then replaces `path` in one step; returns path. On any failure the temporary file is
    removed and `path` is as it was."""
    tmp = _temp_name(path, "tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    return path


def atomic_text(path: str, text: str) -> str:
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)

    return atomic_file(path, write)


def replace_folder(path: str, write: Callable[[str], None]) -> str:
    """`write(tmp)` fills a temporary folder beside `path` (it does not exist yet), which then takes the
    place of `path` (a previous folder there is removed after the new one is in place); returns path."""
    tmp, old = _temp_name(path, "tmp"), _temp_name(path, "old")
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    try:
        write(tmp)
        if os.path.isdir(path):
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.isdir(old) and not os.path.exists(path):
            os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    return path


class RunLock:
    """An exclusive lock on a run folder: `acquire` takes it or raises RunFolderBusy naming the folder and
    the holder (process id and host). A held lock is released by `release`, by closing, or when the process
    ends. Locks are per lock object: a second RunLock on the same folder is refused even in one process."""

    def __init__(self, run_dir: str):
        self.run_dir = os.path.abspath(run_dir)
        self.path = os.path.join(self.run_dir, ".lock")
        self._file = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> RunLock:
        if self._file is not None or fcntl is None:
            return self
        os.makedirs(self.run_dir, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: held by another open of the file
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise RunFolderBusy(
                f"run folder {self.run_dir!r} is in use by another training run ({holder} holds {self.path}): "
                "two runs in one folder would overwrite each other's checkpoints; wait for that run to end, "
                "or train into another --out folder") from None
        f.seek(0)
        f.truncate()
        f.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            f.close()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def locked(run_dir: str, primary: bool = True) -> Iterator[RunLock | None]:
    """The run folder locked for the `with` block (by the primary process only: the processes of a
    multi-host run share one folder); yields the lock (None on the others)."""
    if not primary:
        yield None
        return
    with RunLock(run_dir) as lock:
        yield lock
