"""The ground floor: what every part of l2l uses to report bad input. It imports nothing of the package.

A part (a model family, a task kind, a tier, a mode, a parallel strategy, a logger) checks its own keys and
returns :class:`Problem`\\ s; ``config/validate.py`` runs every part's checks and the cross-group rules,
and the CLI prints each problem as one line and exits 2 (:class:`ConfigError`).
"""

from __future__ import annotations

from dataclasses import dataclass
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
    """Binary units, 3 significant digits."""
    for unit, k in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{n / k:.3g} {unit}"
    return f"{int(n)} B"
