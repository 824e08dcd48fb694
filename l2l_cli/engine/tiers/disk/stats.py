"""The disk tier's I/O counters: this step's, the run's before it, the training steps' alone, and the bytes
by what they were for (the breakdown ``summary.json`` and ``benchmarks/disk_tier.py`` print)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# what a byte read or written was for (IoStats fields ``read_<what>`` / ``write_<what>``)
READS = {
    "fwd": "weights, a layer's first read in a step (the forward)",
    "bwd": "weights read again (the backward)",
    "state": "weights and moments (an update's read of a layer not in RAM)",
    "moments": "moments alone (an update served by the backward's read of the weights)",
    "grad": "parked or kept gradients read back",
    "undo": "a rolled-back layer's pre-update state",
}
WRITES = {
    "state": "an update's new weights and moments",
    "park": "gradients on disk until their update (parked) or the verdict (kept for a redo)",
}


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
    parks_ram: int = 0  # gradients kept in the RAM pool instead (eps.grad_ram_gb)
    ahead: int = 0  # reads issued before anyone asked for the layer (read-ahead)
    demand: int = 0  # reads issued because a pin asked for a layer not read ahead
    read_fwd: int = 0
    read_bwd: int = 0
    read_state: int = 0
    read_moments: int = 0
    read_grad: int = 0
    read_undo: int = 0
    write_state: int = 0
    write_park: int = 0

    def add(self, other: IoStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def breakdown(self) -> dict[str, int]:
        """Bytes by what they were for: ``read_fwd`` ... ``write_park``."""
        return {f"read_{k}": getattr(self, f"read_{k}") for k in READS} | {
            f"write_{k}": getattr(self, f"write_{k}") for k in WRITES
        }


class IoCounts:
    """``step``: the counters since the last ``pop`` (every part of the tier adds to it, under the tier's
    lock); ``totals``: the steps before; ``setup``: building the state (not a step's); ``train``: the training
    steps' alone, and ``steady`` those after the first (whose reads no plan issued ahead)."""

    def __init__(self) -> None:
        self.step, self.totals, self.setup = IoStats(), IoStats(), IoStats()
        self.train, self.steady = IoStats(), IoStats()
        self.train_steps = 0

    def pop(self, training: bool = True) -> IoStats:
        """This step's counters, added to the totals; the next step starts from zero."""
        st, self.step = self.step, IoStats()
        self.totals.add(st)
        if training:
            self.train_steps += 1
            self.train.add(st)
            if self.train_steps > 1:
                self.steady.add(st)
        return st

    def run(self) -> IoStats:
        """The whole run's so far (building the state included)."""
        t = IoStats()
        t.add(self.setup)
        t.add(self.totals)
        t.add(self.step)
        return t

    def per_step(self) -> tuple[IoStats, int]:
        """The training steps to average over (after the first when there are several) and how many."""
        if self.train_steps > 1:
            return self.steady, self.train_steps - 1
        return self.train, self.train_steps

    def report(self, params: int) -> dict[str, Any]:
        """``eps_disk``'s I/O fields: the run's bytes, seconds and rates, what compute hid, and the bytes per
        parameter per training step (after the first when there are several), in all and by use."""
        t = self.run()
        per, steps = self.per_step()
        io_s = t.read_s + t.write_s
        per_param = params * steps
        return {
            "read_bytes": t.read_bytes,
            "write_bytes": t.write_bytes,
            "read_s": t.read_s,
            "write_s": t.write_s,
            "read_gbps": t.read_bytes / t.read_s / 1e9 if t.read_s else None,
            "write_gbps": t.write_bytes / t.write_s / 1e9 if t.write_s else None,
            "wait_s": t.wait_s,
            "eps_thread_wait_s": t.eps_wait_s,
            "reads_ahead": t.ahead,
            "reads_on_demand": t.demand,
            "cache_hits": t.hits,
            "cache_misses": t.misses,
            "gradients_parked": t.parks,
            "gradients_parked_in_ram": t.parks_ram,
            "hidden_share": max(0.0, min(1.0, 1.0 - t.wait_s / io_s)) if io_s else None,
            "read_bytes_per_param_step": per.read_bytes / per_param if per_param else None,
            "write_bytes_per_param_step": per.write_bytes / per_param if per_param else None,
            "bytes_per_param_step": {k: v / per_param for k, v in per.breakdown().items()}
            if per_param
            else {},
        }
