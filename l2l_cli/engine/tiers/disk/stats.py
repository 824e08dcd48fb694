"""The disk tier's I/O counters: this step's, and the run's before it."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class IoStats:
    read_bytes: int = 0
    write_bytes: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    wait_s: float = 0.0  # the compute thread waiting for the disk (exposed)
    eps_wait_s: float = 0.0  # the EPS thread waiting for it (L2L-p's updates: hidden unless the step waits)
    hits: int = 0  # pins served from the cache (read ahead, or still there)
    misses: int = 0  # pins that waited for a read (or a free slot)
    parks: int = 0  # gradients written out to wait for their update on disk
    ahead: int = 0  # reads issued before anyone asked for the layer (read-ahead)
    demand: int = 0  # reads issued because a pin asked for a layer not read ahead

    def add(self, other: IoStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class IoCounts:
    """``step``: the counters since the last ``pop`` (every part of the tier adds to it, under the tier's
    lock); ``totals``: the steps before."""

    def __init__(self) -> None:
        self.step, self.totals = IoStats(), IoStats()

    def pop(self) -> IoStats:
        """This step's counters, added to the totals; the next step starts from zero."""
        st, self.step = self.step, IoStats()
        self.totals.add(st)
        return st

    def run(self) -> IoStats:
        """The whole run's so far."""
        t = IoStats()
        t.add(self.totals)
        t.add(self.step)
        return t
