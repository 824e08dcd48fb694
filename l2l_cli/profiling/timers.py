"""Phase timers: exclusive wall-clock time per phase of a step (nested phases pause their parent)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class PhaseTimer:
    """``with timer("forward"): ...`` accumulates seconds in ``forward``; a phase entered inside another
    stops the outer clock until it ends, so the phases of a step add up to (at most) its wall time.

    ``sync`` (CUDA with profile.sync_timers: the compute stream's wait) is called at every boundary so
    kernel time lands in the phase that launched it; without it, asynchronous GPU work is charged to
    whichever phase waits for it. Copies on the copy streams are never waited for by ``sync``: a phase
    is charged only the part of a copy it waits for (the exposed transfer).
    """

    def __init__(self, sync: Callable[[], None] | None = None):
        self.sync = sync
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [phase, start]

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        now = self._now()
        if self._stack:
            top = self._stack[-1]
            self.totals[top[0]] += now - top[1]
        self._stack.append([phase, now])
        try:
            yield
        finally:
            now = self._now()
            name, start = self._stack.pop()
            self.totals[name] += now - start
            if self._stack:
                self._stack[-1][1] = now

    def _now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        self.totals[phase] += seconds

    def pop(self) -> dict[str, float]:
        """This step's totals, then start afresh."""
        out = dict(self.totals)
        self.totals.clear()
        return out
