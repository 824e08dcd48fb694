"""The disk EPS tier's step, run as the tier runs it: a small event simulation of its queues.

Why a simulation: a closed form that hides each layer's I/O behind the compute of the one layer before it
charged seconds of waiting the tier does not have, because with ``eps.host_cache_layers`` slots the reader
runs several layers ahead and the writes fall behind as far as the slots allow. The rules mirrored here are
the tier's own (``engine/tiers/disk``):

- one reader thread reads in the order the layers are used (``readahead.ReadAhead``, ``reader.Reader``),
  into a slot freed by the use ``slots`` uses earlier: once its compute and update are done and its
  write-back is on disk (``SlotTable.victim``; eviction waits for the slot's write, ``Reader._run``);
- the compute uses a layer once its first read is in (the weights); the update (on the EPS thread, one at a
  time) once the compute is done, its late read is in (the moments) and the layer's write of the step before
  is out (``DiskTier.holding``); then its write-back queues on the one writer thread, in order
  (``writeback.WriteBehind``);
- reads and writes run at once and share the disk: each at its own rate alone, at ``shared`` of it while the
  other runs (``Rates.disk_share``, consistent with ``Rates.disk_time``).

The steady step is the last of a few repeated steps (the next step's reads run ahead into this one's end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Use:
    """One layer's turn in a step, in the order the step takes them."""

    compute: float  # seconds the compute holds the layer (its forward, or its recompute + backward)
    read: float  # bytes read before the compute can start (the weights)
    late_read: float = 0.0  # bytes read before the update may start (the moments), after ``read``
    update: float = 0.0  # seconds of the layer's update on the EPS thread, after its compute
    write: float = 0.0  # bytes written back after the update; the slot is free once they are on disk


@dataclass(frozen=True)
class Disk:
    read_bps: float  # bytes/s, reading alone
    write_bps: float  # bytes/s, writing alone
    shared: float  # the share of its own rate each queue keeps while the other runs


def exposed_wait(uses: list[Use], slots: int | None, disk: Disk, steps: int = 6) -> float:
    """Seconds the compute waits for the disk in the last of ``steps`` repeated steps of ``uses``
    (``slots``: the host cache's layers; None: every layer stays cached, no slot is ever waited for)."""
    n = len(uses)
    total = n * steps
    inf = math.inf
    if not total:
        return 0.0

    def use(m: int) -> Use:
        return uses[m % n]

    early_done = [inf] * total
    late_done = [inf if use(m).late_read > 0 else 0.0 for m in range(total)]
    end, release = [inf] * total, [inf] * total
    # the reader's queue, in use order: each use's first read, then its late one
    reads = [(m, late) for m in range(total) for late in (False, True) if not late or use(m).late_read > 0]
    ri, r_cur = 0, None  # next read to start; the one running: [use, late, bytes left]
    w_cur, w_queue = None, []  # the write running: [use, bytes left]; queued: (from, use, bytes)
    ci, busy_until, last_end, waited = 0, 0.0, 0.0, 0.0  # the compute
    ui, eps_free = 0, 0.0  # the next use to update, when the EPS thread is free
    t = 0.0
    warm = steps // 2  # steps left out: the first ones fill the queues and the slots

    def slot_free(m: int) -> bool:
        return slots is None or m < slots or release[m - slots] <= t

    while True:
        moved = True
        while moved:  # start everything that may start now
            moved = False
            if ci < total and busy_until <= t and early_done[ci] <= t:
                if ci >= warm * n:
                    waited += t - last_end
                busy_until = end[ci] = t + use(ci).compute
                last_end, ci, moved = end[ci], ci + 1, True
            while ui < ci and not (use(ui).update or use(ui).late_read or use(ui).write):
                release[ui] = end[ui]  # no update: the slot is free once the compute is done
                ui, moved = ui + 1, True
            # an update: its compute done, its moments in, the EPS free, its write of the step before out
            if ui < ci and max(end[ui], late_done[ui], eps_free, release[ui - n] if ui >= n else 0.0) <= t:
                eps_free = t + use(ui).update
                if use(ui).write > 0:
                    w_queue.append((eps_free, ui, use(ui).write))
                else:
                    release[ui] = eps_free
                ui, moved = ui + 1, True
            if w_cur is None and w_queue and w_queue[0][0] <= t:
                _, m, b = w_queue.pop(0)
                w_cur, moved = [m, b], True
            if r_cur is None and ri < len(reads):
                m, late = reads[ri]
                if late or slot_free(m):
                    r_cur = [m, late, use(m).late_read if late else use(m).read]
                    ri, moved = ri + 1, True
            if r_cur is not None and r_cur[2] <= 0:
                (late_done if r_cur[1] else early_done)[r_cur[0]] = t
                r_cur, moved = None, True
            if w_cur is not None and w_cur[1] <= 0:
                release[w_cur[0]] = t
                w_cur, moved = None, True
        if ci == total and busy_until <= t:
            break  # the last compute is done
        both = r_cur is not None and w_cur is not None
        r_rate = disk.read_bps * (disk.shared if both else 1.0)
        w_rate = disk.write_bps * (disk.shared if both else 1.0)
        r_at = t + r_cur[2] / r_rate if r_cur is not None else inf
        w_at = t + w_cur[1] / w_rate if w_cur is not None else inf
        if min(r_at, w_at) <= t:  # nothing left to move (or a disk that takes no time): done now
            if r_at <= t:
                r_cur[2] = 0.0  # type: ignore[index]
            if w_at <= t:
                w_cur[1] = 0.0  # type: ignore[index]
            continue
        later = [r_at, w_at, busy_until, eps_free, w_queue[0][0] if w_queue else inf]
        if ri < len(reads) and slots is not None and reads[ri][0] >= slots:
            later.append(release[reads[ri][0] - slots])
        nxt = min((x for x in later if x > t), default=inf)
        if nxt == inf:
            raise RuntimeError("the disk tier's simulated queues are stuck")  # (a bug here, not in the input)
        dt = nxt - t
        if r_cur is not None:
            r_cur[2] = 0.0 if r_at <= nxt else r_cur[2] - dt * r_rate
        if w_cur is not None:
            w_cur[1] = 0.0 if w_at <= nxt else w_cur[1] - dt * w_rate
        t = nxt
    return waited / (steps - warm)


def disk_wait(uses: list[Use], slots: int | None, disk: Disk, steps: int = 6) -> float:
    """What the disk adds to the step: the compute's wait with this disk less its wait with one that takes no
    time (the updates alone can hold slots; their exposed time is the optimizer's, counted apart)."""
    instant = Disk(math.inf, math.inf, 1.0)
    return max(0.0, exposed_wait(uses, slots, disk, steps) - exposed_wait(uses, slots, instant, steps))
