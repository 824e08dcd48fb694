"""One writer per directory: a run holds an exclusive lock on its run dir and on its disk EPS directory
for as long as it runs, so two runs (or a run and its own resume started twice) never write one commit
record or one checkpoint folder at once.

The lock is ``fcntl.flock`` on ``<dir>/.l2l.lock``: the kernel releases it when the process exits, however
it exits (SIGKILL included), so a crashed run never leaves a stale lock behind. The file holds the
holder's pid, host and start time, which the refusal names. It is opened without following a symbolic
link (a link planted in a shared folder such as ``/dev/shm`` would have its target truncated).

``l2l train`` takes its run dir's lock before Hydra writes anything there; the session then finds it
:func:`held` by its own process (or, for the ranks ``dist.nproc`` starts, by their parent) and keeps it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

LOCK_NAME = ".l2l.lock"


_HELD: dict[Path, DirLock] = {}  # resolved directory -> the lock this process holds on it


class LockError(Exception):
    """A directory this run cannot own (bad input for this run: exit 2, one line ``key: detail``)."""

    def __init__(self, key: str, path: Path, detail: str):
        self.key, self.path, self.detail = key, path, detail
        super().__init__(f"{key}: {detail}")


class DirectoryInUse(LockError):
    """Another live process holds the directory's lock."""

    def __init__(self, key: str, path: Path, holder: dict[str, Any]):
        self.holder = holder
        since = holder.get("started")
        when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if since else ""
        who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{when}"
        super().__init__(
            key,
            path,
            f"{path} is in use by another l2l run ({who}); wait for it to end, or use another directory",
        )


class DirLock:
    """An exclusive lock on a directory, held until :meth:`release` or the process's end."""

    def __init__(self, path: Path, key: str):
        self.path, self.key = Path(path), key
        self._fd: int | None = None

    def acquire(self) -> DirLock:
        """Take the lock, or raise :class:`LockError` (:class:`DirectoryInUse`: another live run holds it;
        a symbolic link or an unwritable directory: named). A lock the parent process holds (the ranks
        ``dist.nproc`` starts under the ``l2l train`` that took their run dir) counts as this run's."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise self._refusal(e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            if holder.get("pid") == os.getppid() and holder.get("host") == socket.gethostname():
                return self  # the parent's lock: held for this run as long as the parent lives
            raise DirectoryInUse(self.key, self.path, holder) from None
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        self._fd = fd
        _HELD[self.path.resolve()] = self
        return self

    def _refusal(self, e: OSError) -> LockError:
        if e.errno == errno.ELOOP:
            return LockError(
                self.key,
                self.path,
                f"{self.path / LOCK_NAME} is a symbolic link; l2l does not "
                "write through one (remove it, or use another directory)",
            )
        return LockError(
            self.key, self.path, f"{self.path} cannot be written ({e.strerror}); use a writable directory"
        )

    def release(self) -> None:
        if self._fd is not None:
            if _HELD.get(self.path.resolve()) is self:
                del _HELD[self.path.resolve()]
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def held(path: Path) -> DirLock | None:
    """The lock this process already holds on ``path`` (``l2l train`` took it before Hydra started)."""
    return _HELD.get(Path(path).resolve())


def check_free(path: Path, key: str) -> None:
    """Raise :class:`DirectoryInUse` when a live process holds ``path``'s lock; writes nothing (the lock
    file is opened read-only, when it exists)."""
    try:
        fd = os.open(Path(path) / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return  # no lock file (or one that cannot be opened): acquiring it will say why
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise DirectoryInUse(key, Path(path), _read_holder(fd)) from None
    finally:
        os.close(fd)


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}
