"""The ground floor: what every part of l2l uses to report bad input. It imports nothing of the package.

A part (a model family, a task kind, a tier, a mode, a parallel strategy, a logger) checks its own keys and
returns :class:`Problem`\\ s; ``config/validate.py`` runs every part's checks and the cross-group rules,
and the CLI prints each problem as one line and exits 2 (:class:`ConfigError`).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Problem:
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


class ConfigError(Exception):
    """Bad user input: reported as one line per problem, exit code 2, no traceback."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


def one_of(p: list[Problem], key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        p.append(Problem(key, f"got {value!r}; allowed: {', '.join(allowed)}"))


def at_least(p: list[Problem], key: str, value: Any, lo: float, what: str = "") -> None:
    if value is None or value < lo:
        p.append(Problem(key, f"got {value!r}; must be >= {lo}{what}"))


def positive(p: list[Problem], key: str, value: Any) -> None:
    if value <= 0:
        p.append(Problem(key, f"got {value}; must be > 0"))


def divisors(n: int) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, ds[:12])) + (", ..." if len(ds) > 12 else "")


def fmt_bytes(n: float) -> str:
    """Binary units, 3 significant digits, never 4 digits before the point (1000 MiB is 0.977 GiB, not
    "1e+03 MiB")."""
    units = (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
    for i, (unit, k) in enumerate(units):
        if abs(n) >= k or (abs(n) >= 999.5 * k / 1024 and i + 1 < len(units)):
            return f"{n / k:.3g} {unit}"
    return f"{int(n)} B" if abs(n) < 999.5 else f"{n / 1024:.3g} KiB"


# ---- a failed write: one line naming the path (and, for a full disk, the free space) --------------------

# "<path part>[@n]": the n-th write there, and every one after it, is refused (the tests' faults)
_FAULT = os.environ.get("L2L_FAULT_ENOSPC", "")  # with ENOSPC (a full disk)
_FAULT_EIO = os.environ.get("L2L_FAULT_EIO", "")  # with EIO (a failing disk, a lost network mount)
_fault_seen = [0]


class WriteFailed(OSError):
    """A write the OS refused (an I/O error): the run stops (exit 1) naming the path; what was committed
    before (checkpoints, the disk EPS's commit record) stays usable."""

    def __init__(self, path: Path | str, err: int = errno.EIO, why: str = ""):
        self.path = Path(path)
        super().__init__(err, f"write failed: {why or os.strerror(err)} writing {self.path}")

    def __str__(self) -> str:
        return self.strerror or "write failed"


class DiskFull(WriteFailed):
    """A write refused for lack of space (ENOSPC): the run stops (exit 1) naming where, and how much is
    free there; what was committed before (checkpoints, the disk EPS's commit record) stays usable."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        free = free_bytes(self.path)
        where = f"{fmt_bytes(free)} free there" if free is not None else "free space unknown"
        OSError.__init__(self, errno.ENOSPC, f"disk full: no space left writing {self.path} ({where})")

    def __str__(self) -> str:
        return self.strerror or "disk full"


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s file system (its nearest existing folder)."""
    base = Path(path)
    while not base.exists() and base != base.parent:
        base = base.parent
    try:
        st = os.statvfs(base)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


@contextmanager
def writing(path: Path | str) -> Iterator[None]:
    """Around a write to ``path``: ENOSPC becomes :class:`DiskFull` naming the path (the OS's error names
    no file for a write() on an open descriptor), EIO :class:`WriteFailed`. ``L2L_FAULT_ENOSPC`` and
    ``L2L_FAULT_EIO`` (``<part>[@n]``) inject them on the n-th write whose path contains <part> (default
    the first) and every later one, for the fault tests."""
    for fault, err in ((_FAULT, errno.ENOSPC), (_FAULT_EIO, errno.EIO)):
        if fault:
            part, _, nth = fault.partition("@")
            if part in str(path):
                _fault_seen[0] += 1
                if _fault_seen[0] >= int(nth or 1):
                    cause = OSError(err, f"injected by L2L_FAULT_{errno.errorcode[err]}")
                    raise (DiskFull(path) if err == errno.ENOSPC else WriteFailed(path, err)) from cause
    try:
        yield
    except OSError as e:
        if e.errno == errno.ENOSPC and not isinstance(e, DiskFull):
            raise DiskFull(path) from e
        if e.errno == errno.EIO and not isinstance(e, WriteFailed):
            raise WriteFailed(path, e.errno) from e
        raise
