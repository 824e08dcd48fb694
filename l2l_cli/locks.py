"""One writer per directory: a run holds an exclusive lock on its run dir and on its disk EPS directory
for as long as it runs, so two runs (or a run and its own resume started twice) never write one commit
record or one checkpoint folder at once.

The lock is ``fcntl.flock`` on ``<dir>/.l2l.lock``: the kernel releases it when the process exits, however
it exits (SIGKILL included), so a crashed run never leaves a stale lock behind. The file holds the
holder's pid, host and start time, which the refusal names.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

LOCK_NAME = ".l2l.lock"


class DirectoryInUse(Exception):
    """Another live process holds the directory's lock (bad input for this run: exit 2, one line)."""

    def __init__(self, key: str, path: Path, holder: dict[str, Any]):
        self.key, self.path, self.holder = key, path, holder
        since = holder.get("started")
        when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if since else ""
        who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{when}"
        self.detail = (
            f"{path} is in use by another l2l run ({who}); wait for it to end, or use another directory"
        )
        super().__init__(f"{key}: {self.detail}")


class DirLock:
    """An exclusive lock on a directory, held until :meth:`release` or the process's end."""

    def __init__(self, path: Path, key: str):
        self.path, self.key = Path(path), key
        self._fd: int | None = None

    def acquire(self) -> DirLock:
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise DirectoryInUse(self.key, self.path, holder) from None
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}
