"""The disk tier's reader thread under unlucky timing (issue 36: a hang in the fault sweep's setup, a slot
demand never served): every demand the reader grants wakes its waiter, and a reader that cannot go on fails
the waiting pins instead of leaving them blocked. The pins run on threads of their own, joined with a
timeout, so a hang fails the test with every thread's stack instead of blocking the suite."""

from __future__ import annotations

import errno
import faulthandler
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from l2l_cli.engine.tiers.disk.format import DiskIo
from l2l_cli.engine.tiers.disk.reader import Reader
from l2l_cli.engine.tiers.disk.tier import DiskTier
from l2l_cli.problems import WriteFailed
from tests.util import built, tiny_cfg

# 5 layers (embeddings, 3 blocks, head) and 3 cache slots: after building the state, 2 layers are on disk only
CFG = ("mode=l2l", "eps.tier=disk", "eps.host_cache_layers=3", "eps.grad_ram_gb=0")


class Pin(threading.Thread):
    """``fn()`` on a thread of its own; :meth:`result` fails the test if it has not returned in time."""

    def __init__(self, fn: Callable[[], Any]):
        super().__init__(name="test-pin", daemon=True)
        self.fn, self.error = fn, None
        self.start()

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as e:  # (raised again on the test's thread)
            self.error = e

    def result(self, timeout: float = 20.0) -> None:
        self.join(timeout)
        if self.is_alive():
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            pytest.fail(f"the pin hung for {timeout:.0f} s (every thread's stack above)")
        if self.error is not None:
            raise self.error


def _until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture
def tier() -> Iterator[DiskTier]:
    with built(tiny_cfg(*CFG)) as runner:
        t = runner.eps.tier
        assert isinstance(t, DiskTier)
        yield t


def _uncached(tier: DiskTier) -> int:
    with tier.cv:
        return next(i for i in range(len(tier.store)) if tier.slot_of(i) is None)


def test_a_demand_granted_between_the_readers_checks_wakes_its_waiter(
    tier: DiskTier, monkeypatch: Any
) -> None:
    """A pin meets the slot its layer is being read ahead into (busy), so it posts a demand and waits. When
    that read-ahead ends, the reader wakes every waiter and then checks its demands again; the waiter can
    run in between, find its demand not served yet and wait again. The reader then grants the demand (the
    slot holds the layer now): that grant must wake the waiter. It did not, so with nothing left to read
    ahead (the last layer's pin while the state is built) the pin waited forever."""
    j = _uncached(tier)
    go = threading.Event()
    real_run, real_next = Reader._run, Reader._next_job

    def held_read_ahead(self: Reader, job: Any) -> None:
        if job.demand is None and job.layer == j:
            assert go.wait(20), "the pin's demand was never posted"
        real_run(self, job)

    def yielding(self: Reader) -> Any:
        self.cv.wait(0.05)  # (the lock released) a waiter woken by the last job runs before this check
        return real_next(self)

    monkeypatch.setattr(tier.plan, "predicted", lambda: [(j, frozenset())])  # the plan: a slot for layer j
    monkeypatch.setattr(Reader, "_run", held_read_ahead)
    monkeypatch.setattr(Reader, "_next_job", yielding)
    with tier.cv:
        tier.cv.notify_all()  # the reader reads the plan: layer j's slot is bound, busy until ``go``
    _until(lambda: (s := tier.slot_of(j)) is not None and s.busy, f"layer {j}'s read-ahead")
    pin = Pin(lambda: tier.pin(j, "g", fresh=True))  # (as the relay does for a gradient): a demand
    try:
        _until(lambda: bool(tier.reader.demands), "the pin's demand")
        go.set()
        pin.result()
    finally:
        monkeypatch.undo()  # (before the tier closes: a wait in the reader's check would swallow its stop)
    tier.unpin(j)


def test_a_reader_that_fails_between_jobs_fails_the_waiting_pins(tier: DiskTier, monkeypatch: Any) -> None:
    """An error in the reader's own choice of its next job (not in a read) ended its thread and left the
    pin waiting forever: the pin raises it, and so does the next one."""
    j = _uncached(tier)

    def broken() -> list[Any]:
        raise RuntimeError("plan broken (injected)")

    monkeypatch.setattr(tier.plan, "predicted", broken)
    for _ in range(2):
        pin = Pin(lambda: tier.pin(j, "w"))
        with pytest.raises(RuntimeError, match="plan broken"):
            pin.result()


def test_a_pin_that_raises_a_failed_write_leaves_its_slot_unpinned(tier: DiskTier, monkeypatch: Any) -> None:
    """A layer's write-back fails (EIO) while a pin of its slot waits for it (a new gradient about to be
    written there, or the next update): the pin raises the failure and gives the slot back, so nothing
    that closes the run down waits for a slot that no one holds."""
    with tier.cv:
        i = next(i for i in range(len(tier.store)) if tier.slot_of(i) is not None)
    real = DiskIo.write

    def failing(self: DiskIo, fd: int, mv: memoryview, offset: int) -> None:
        time.sleep(0.2)  # (still in flight when the pin waits for it)
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(DiskIo, "write", failing)
    with tier.holding(i, "wmv", dirty=True):
        pass  # queues the write-back
    s = tier.slot_of(i)
    assert s is not None and s.writing is not None and not s.writing.done()
    with pytest.raises(WriteFailed):
        tier.pin(i, "g", fresh=True)
    assert s.pins == 0
    monkeypatch.setattr(DiskIo, "write", real)
