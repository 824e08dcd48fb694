"""The disk tier's reader thread: it serves pins that missed the cache (demands) first, then reads ahead
what the plan (:mod:`.readahead`) says comes next, evicting a slot's previous layer when it needs the slot
(waiting for its device copies and write-back, parking a gradient that is on no disk yet)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from l2l_cli.engine.tiers.disk.cache import CacheSlot, Eviction, SlotTable
from l2l_cli.engine.tiers.disk.format import STATE
from l2l_cli.engine.tiers.disk.layout import MOMENTS, UPDATE_BUFFERS
from l2l_cli.engine.tiers.disk.readahead import ReadAhead
from l2l_cli.engine.tiers.disk.stats import IoCounts
from l2l_cli.engine.tiers.disk.store import LayerStore
from l2l_cli.engine.tiers.disk.update_buffer import UpdateBuffer
from l2l_cli.engine.tiers.disk.writeback import WriteBehind


@dataclass
class Demand:
    """A pin waiting for the reader: layer, parts, ``fresh`` (nothing to read: a slot to overwrite)."""

    layer: int
    need: frozenset[str]
    fresh: bool
    slot: CacheSlot | None = None
    done: bool = False
    error: BaseException | None = None


@dataclass
class _Job:
    slot: CacheSlot
    layer: int
    parts: frozenset[str]
    demand: Demand | None = None
    evict: Eviction | None = None  # what the slot held before (the job finishes it first)
    writing: Future | None = None  # the slot's write still in flight (the same layer's): read after it
    mom_writing: Future | None = None  # the update buffer taken: the write-back still reading it


class _NoBuffer(Exception):
    """Every update buffer is in use (a job that needs one waits)."""


class Reader:
    """The reader thread and the demands it serves (all of its state is guarded by the tier's lock)."""

    def __init__(
        self,
        cache: SlotTable,
        plan: ReadAhead,
        store: LayerStore,
        writer: WriteBehind,
        cv: threading.Condition,
        counts: IoCounts,
        bind: Callable[[], None] = lambda: None,
    ):
        self.cache, self.plan, self.store, self.writer = cache, plan, store, writer
        self.cv, self.counts, self.bind = cv, counts, bind  # bind: the thread's device (acc.bind_thread)
        self.demands: list[Demand] = []
        self.failed: BaseException | None = (
            None  # a read-ahead failed: read-ahead stops, the next pin raises it
        )
        self.closed = False
        self._ended: BaseException | None = None  # why the reader thread ended (closed, or it failed)
        self._thread = threading.Thread(target=self._loop, name="l2l-disk-read", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        self._thread.join(timeout=60)

    def ask(self, d: Demand) -> None:
        """Queue a pin the cache could not serve (``wait`` for it to be served, or to fail). A reader that
        has ended (closed, or failed between jobs) fails it at once."""
        with self.cv:
            self.counts.step.misses += 1
            if self._ended is not None:
                d.error, d.done = self._ended, True
                return
            self.demands.append(d)
            self.cv.notify_all()

    def wait(self, d: Demand) -> None:
        """Until the reader has served ``d`` or failed it. Every change to ``d`` is made under the lock and
        notified; the timed wait re-checks that the reader thread still runs, so a reader that ended some
        other way fails the pin instead of blocking it forever."""
        with self.cv:
            while not d.done:
                self.cv.wait(timeout=1.0)
                if not d.done and not self._thread.is_alive():
                    d.error, d.done = RuntimeError("the disk EPS's reader thread has ended"), True

    def _bind(self, s: CacheSlot, i: int, parts: frozenset[str], demand: Demand | None) -> _Job:
        """(Holding the lock.) Slot ``s`` for layer i from now on: its previous layer is evicted by the
        job."""
        old = s.layer
        keeping = None
        if s.g_kept and old is not None:  # reused before the verdict: the kept gradient to kept_grads.eps
            keeping = self.writer.keep(s, old)
            self.store.kept_on_disk[old] = True
            self.store.kept.writes[old] = keeping
        return _Job(s, i, parts, demand, self.cache.bind(s, i, keeping))

    def _take_moments(self, s: CacheSlot, parts: frozenset[str], keep: set[int]) -> UpdateBuffer | None:
        """(Holding the lock.) For a job on slot ``s`` that reads or overwrites ``parts``: the update buffer
        it takes for the moments (``s``'s own: None), or raises _NoBuffer when the moments are wanted and
        every buffer is in use (``keep``: layers whose buffer is not taken, needed sooner)."""
        if not set(parts) & set(MOMENTS) or s.mom is not None:
            return None
        b = self.cache.free_buffer(s, keep)
        if b is None:
            raise _NoBuffer
        return b

    def _without_moments(self, parts: frozenset[str]) -> frozenset[str]:
        """``parts`` less the moments, and under format 2 less the master too (it is joined with v)."""
        return parts - set(MOMENTS) - ({"w"} if self.store.split else set())

    def _job(
        self, s: CacheSlot, i: int, parts: frozenset[str], demand: Demand | None, b: UpdateBuffer | None
    ) -> _Job:
        """(Holding the lock.) A job reading ``parts`` of layer i into its slot ``s``, ``b`` the update
        buffer it takes (read into after the write-back that still reads it)."""
        self.cache.begin_read(s, i, parts)
        mom_writing = None
        if b is not None:
            self.cache.attach(s, b)
            mom_writing = b.writing
        return _Job(s, i, parts, demand, writing=s.writing, mom_writing=mom_writing)

    def _next_job(self) -> _Job | None:
        want = self.plan.predicted() if self.failed is None else []
        later = {j: k for k, (j, _) in enumerate(want)}
        for d in list(self.demands):
            s = self.cache.slot_of(d.layer)
            if s is not None:
                if s.busy:
                    continue
                missing = frozenset() if d.fresh else s.missing(d.need)
                try:
                    b = self._take_moments(s, d.need, set())
                except _NoBuffer:
                    continue  # every update buffer in use: wait for an unpin
                if not missing and b is None:
                    self._serve_pin(d, s)
                    continue
                return self._job(s, d.layer, missing, d, b)
            v = self.cache.victim(set(), later, d.layer, self.store.files[d.layer].numel)
            if v is None:
                continue  # every slot pinned: wait for an unpin
            if set(d.need) & set(MOMENTS) and v.mom is None and self.cache.free_buffer(v) is None:
                continue
            job = self._bind(v, d.layer, frozenset() if d.fresh else d.need, d)
            return self._with_moments(job, d.need, set())
        # only the next updates' moments are read ahead: a later one's would take the buffer the next one
        # needs, and be read again after it
        nxt = set(self.plan.updates[:UPDATE_BUFFERS])
        for k, (j, parts) in enumerate(want):
            parts = self.store.readable(j, parts)
            if j not in nxt:
                parts = self._without_moments(parts)
            sooner = {x for x, _ in want[:k]}
            s = self.cache.slot_of(j)
            if s is not None:
                missing = s.missing(parts)
                if missing and not s.busy:
                    try:
                        b = self._take_moments(s, missing, sooner)
                    except _NoBuffer:  # the rest now, the moments once a buffer is free
                        missing = self._without_moments(missing)
                        b = None
                    if missing:
                        return self._job(s, j, missing, None, b)
                continue
            avoid, after = {x for x, _ in want[: k + 1]}, {x: p for x, p in later.items() if p > k}
            v = self.cache.victim(avoid, after, j, self.store.files[j].numel)
            if v is None:
                continue  # (no shared slot for a later one either; a later layer's own slot may be free)
            if set(parts) & set(MOMENTS) and self.cache.free_buffer(v, sooner) is None and v.mom is None:
                parts = self._without_moments(parts)  # (the moments once a buffer is free)
            job = self._bind(v, j, parts, None)
            return self._with_moments(job, parts, sooner)
        return None

    def _with_moments(self, job: _Job, need: frozenset[str], keep: set[int]) -> _Job:
        """(Holding the lock.) A job of a newly bound slot: the update buffer its moments need, if any."""
        if set(need) & set(MOMENTS):
            b = self.cache.free_buffer(job.slot, keep)
            assert b is not None, "an update buffer checked free was taken"
            self.cache.attach(job.slot, b)
            job.mom_writing = b.writing
        return job

    def _serve_pin(self, d: Demand, s: CacheSlot) -> None:
        """(Holding the lock.) Serve ``d`` with ``s`` and wake its waiter: a grant can come from the check
        of the demands right after a job ended, when the waiter woken by that job's end has already found
        its demand not served and waits again."""
        assert s.layer == d.layer and not s.busy, f"layer {d.layer} granted a slot holding {s.layer}"
        if d.fresh:
            new = d.need - s.valid
            self.store.make_fresh(s, d.layer, new)
            self.cache.fresh(s, d.layer, new)
        self.cache.pin(s, d.need)
        d.slot, d.done = s, True
        self.demands.remove(d)
        self.cv.notify_all()

    def _end(self, why: BaseException) -> None:
        """(Holding the lock.) The reader stops: every waiting demand, and every later one, fails with
        ``why``; read-ahead stops and the next pin raises it."""
        self._ended = why
        if self.failed is None and not self.closed:
            self.failed = why
        for d in self.demands:
            d.error, d.done = why, True
        self.demands.clear()
        self.cv.notify_all()

    def _loop(self) -> None:
        try:
            self.bind()
            self._serve()
        except BaseException as e:  # a bug in choosing the next job: the pins raise it, none waits forever
            with self.cv:
                self._end(e)

    def _serve(self) -> None:
        while True:
            with self.cv:
                job = None
                while job is None:
                    if self.closed:
                        self._end(RuntimeError("the disk EPS is closed"))
                        return
                    job = self._next_job()
                    if job is None:
                        self.cv.wait()
            err: BaseException | None = None
            try:
                self._run(job)
            except BaseException as e:
                err = e
            with self.cv:
                s = job.slot
                if err is not None:
                    self.cache.fail_read(s, job.layer)
                    if job.demand is not None:
                        job.demand.error, job.demand.done = err, True
                        self.demands.remove(job.demand)
                    else:
                        self.failed = err  # read-ahead stops; the next pin raises the error
                else:
                    self.cache.end_read(s, job.layer, job.parts)
                    if job.demand is not None:
                        self._serve_pin(job.demand, s)
                self.cv.notify_all()

    def _run(self, job: _Job) -> None:
        """Evict the slot's previous layer (wait for its device copies and write-back; park a gradient that
        is on no disk yet), then read the wanted parts of the new one."""
        s, i = job.slot, job.layer
        if job.evict is not None:
            ev = job.evict
            old, copies, writing, park, keeping = ev.layer, ev.copies, ev.writing, ev.park, ev.keeping
            for h in copies:
                while not h.done():
                    time.sleep(5e-5)
            if writing is not None:
                self.writer.result(writing)
            if keeping is not None:
                keeping.result()
            if park and old is not None:
                with self.cv:
                    parking = self.writer.park(s, old)
                self.writer.result(parking)
                with self.cv:
                    self.store.parked[old] = True
        if job.writing is not None:  # a read into buffers a write-back still reads would tear both
            self.writer.result(job.writing)
        if job.mom_writing is not None:  # (the update buffer taken: its last write-back reads it)
            self.writer.result(job.mom_writing)
        if not job.parts:
            return
        with self.cv:
            if job.demand is None:
                self.counts.step.ahead += 1
            else:
                self.counts.step.demand += 1
        st = self.store
        if "g" in job.parts and not st.parked[i]:
            raise RuntimeError(f"layer {i}'s gradient is neither in RAM nor parked on disk")
        f = st.files[i]
        state = [p for p in ("h", *STATE) if p in job.parts]
        with self.cv:  # what the reads are for (the byte breakdown)
            what = "state" if "w" in state and len(state) > 1 else "moments"
            if state in (["w"], ["h"]):
                what = st.weights_read(i)
            in_ram = "g" in job.parts and i in st.pool.live
        fd = st.io.open(f.path)
        try:
            if state:
                st.read_state(fd, s, i, st.newest(i), state, what)
            if "g" in job.parts:
                if in_ram:
                    st.pool.get(i, s.f32["g"][: f.numel])
                elif st.kept_on_disk[i]:  # a kept gradient, back for a redo (its own file: see .spill)
                    with self.cv:
                        written = st.kept.writes.get(i)
                    if written is not None:  # (the slot may still hold the layer: no eviction waited for it)
                        written.result()
                    kfd = st.io.open(st.kept.path)
                    try:
                        st.read(kfd, s.mv("g", f.part_bytes), st.kept.offset(i), "grad")
                    finally:
                        os.close(kfd)
                else:
                    st.read_part(fd, s.mv("g", f.part_bytes), i, 1 - st.newest(i), "g", "grad")
        finally:
            os.close(fd)
