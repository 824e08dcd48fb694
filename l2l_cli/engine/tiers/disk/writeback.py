"""The disk tier's writes, behind the compute on one writer thread, in submission order: an updated
layer's state to the file slot the last commit does not name, a gradient parked until its update, and the
commit record (``commit.json``, replaced atomically once the step's writes are on disk).

Failure rule: the first write that fails (a full disk, an I/O error) stops the writer: every job queued
after it refuses to run with that error, so no commit record is written after a failed write and no slot
that the last durable record names is ever overwritten. ``store.committed`` is what the record *on disk*
names: it advances when the record's write has succeeded, not when it is queued. The error reaches the
training step at the first pin, update or commit after it (and :meth:`WriteBehind.close` at the latest)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from l2l_cli.engine.tiers.disk.cache import CacheSlot, SlotTable
from l2l_cli.engine.tiers.disk.format import (
    COMMIT,
    clear_marks,
    crash_point,
    digest,
    record_digest,
    split_master,
    zeros_digest,
)
from l2l_cli.engine.tiers.disk.stats import IoCounts
from l2l_cli.engine.tiers.disk.store import LayerStore
from l2l_cli.problems import writing


class _Stepped(Protocol):
    opt_step: float  # a layer's optimizer step count (committed with it)


class WriteBehind:
    """The writer thread and the commits it has made."""

    def __init__(
        self,
        store: LayerStore,
        cv: threading.Condition,
        counts: IoCounts,
        cache: SlotTable,
        bind: Callable[[], None] = lambda: None,
    ):
        self.store, self.cv, self.counts, self.cache = store, cv, counts, cache
        self.commits = 0
        rec = store.record
        self.last_commit_step: int | None = rec.get("step") if rec is not None else None  # durable
        # the slots the newest *queued* record names (``store.committed``: the newest durable one)
        self.recorded: list[int | None] | None = (
            list(store.committed) if store.committed is not None else None
        )
        self.error: BaseException | None = None  # the first failed write: nothing is written after it
        self._reported = False  # the error was raised to a caller (close() does not raise it again)
        self._jobs: list[Future] = []  # every job not yet known to have succeeded, in submission order
        # bind: the thread's device (acc.bind_thread)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l2l-disk-write", initializer=bind)

    # ---- the writer's failure: sticky, raised to the training step --------------------------------------

    def _submit(self, fn: Any, *args: Any) -> Future:
        """(Holding the lock.) Queue ``fn`` on the writer thread; it refuses to run after a failed job."""
        self.check()
        fut = self._pool.submit(self._guarded, fn, *args)
        self._jobs = [j for j in self._jobs if not (j.done() and j.exception() is None)]
        self._jobs.append(fut)
        return fut

    def _guarded(self, fn: Any, *args: Any) -> None:
        with self.cv:
            err = self.error
        if err is not None:
            raise err
        try:
            fn(*args)
        except BaseException as e:
            with self.cv:
                if self.error is None:
                    self.error = e
                self.cv.notify_all()
            raise

    def check(self) -> None:
        """Raise the writer's failure, if a write has failed."""
        if self.error is not None:
            self._reported = True
            raise self.error

    def result(self, fut: Future) -> None:
        """Wait for a queued write; its failure (or the one that stopped the writer first) raises here."""
        try:
            fut.result()
        except BaseException:
            with self.cv:
                self._reported = True
                if self.error is not None:
                    raise self.error from None
            raise

    def write_back(self, s: CacheSlot, i: int, setup: bool = False) -> None:
        """(Holding the lock.) Queue layer i's new state for the slot of its file that the last commit
        does not name; the state is the newest from now on, on disk once the write is done (``setup``:
        building the state, counted apart from the steps')."""
        assert s.layer == i and s.pins > 0, f"layer {i} written back from a slot not pinned for it"
        st = self.store
        prev = st.latest[i]
        if self.recorded is not None and prev != self.recorded[i]:
            raise RuntimeError(
                f"layer {i} was updated twice between commits; the committed copy would be lost"
            )
        target = 0 if prev is None else 1 - prev
        f = st.files[i]
        parts = f.parts  # (format 1, a new file: its moments are zeros already (fallocate), w alone)
        if prev is None and not f.split:
            parts = "w"
        st.latest[i], st.parked[i], st.grad_live[i] = target, False, False
        st.sums[i][target].clear()  # (known again once the write is done)
        st.pool.applied(i)  # (a gradient kept for a redo stays until the verdict)
        c = self.counts.setup if setup else self.counts.step  # bytes when queued: the step that wrote them
        nbytes = sum(f.nbytes(p) for p in parts)
        c.write_bytes += nbytes
        c.write_state += nbytes
        # the buffers as they are now (the update buffer may pass to another slot before the write runs;
        # a read into it waits for this write, ``UpdateBuffer.writing``)
        views = {p: s.mv(p, f.nbytes(p)) for p in parts}
        split = None
        if f.split:
            assert s.w_send is not None and s.lo is not None
            n = f.numel
            split = (s.f32["w"][:n], s.w_send[:n], s.lo[:n], s.f32["v"][:n])
        fut = self._submit(self._write, i, target, parts, views, split, setup)
        self.cache.written_back(s, i, fut, parts)

    def _writable(self, i: int, target: int) -> None:
        """The one rule a write keeps: never into the slot the durable commit record names for layer i."""
        with self.cv:
            durable = self.store.committed
        if durable is not None and durable[i] == target:
            raise RuntimeError(
                f"layer {i}: a write into slot {target}, which the last durable commit record names"
            )

    def _write(
        self,
        i: int,
        target: int,
        parts: str,
        views: dict[str, memoryview],
        split: tuple[torch.Tensor, ...] | None,
        setup: bool,
    ) -> None:
        """Layer i's ``parts`` from ``views`` into file slot ``target`` (``split``: the FP32 master, its hi
        plane, lo plane and v, whose lo plane and tie marks are made here)."""
        f = self.store.files[i]
        io = self.store.io
        self._writable(i, target)
        t0 = time.perf_counter()
        marks = None
        if split is not None:  # the master's lo plane from the cached FP32 master (hi: the send copy already)
            marks = split_master(*split)
        sums = {p: zeros_digest(f.nbytes(p)) for p in f.parts if p not in parts}  # (a new file's zeros)
        with writing(f.path):  # a full disk: named; the committed slot stays as it was
            fd = io.open(f.path)
            try:
                for k, p in enumerate(parts):
                    mv = views[p]
                    sums[p] = digest(mv)
                    io.write(fd, mv, f.offset(target, p))
                    if k == 0:
                        crash_point("write")  # a torn slot: w written, the moments not yet
                io.sync(fd, f.offset(target, parts[0]), sum(f.nbytes(p) for p in parts))
            finally:
                os.close(fd)
                if marks is not None and split is not None:
                    clear_marks(split[3], marks)
        with self.cv:
            (self.counts.setup if setup else self.counts.step).write_s += time.perf_counter() - t0
            known = self.store.sums[i][target]  # (a gradient parked there before is overwritten now)
            known.clear()
            known.update(sums)

    def park(self, s: CacheSlot, i: int) -> Future:
        """(Holding the lock.) Queue layer i's gradient for the disk (after any earlier write of the slot):
        from the slot holding layer i (its gradient released), or the one the reader is evicting it from."""
        assert s.layer == i or s.busy, f"layer {i}'s gradient parked from a slot holding layer {s.layer}"
        nbytes = self.store.files[i].part_bytes
        self.counts.step.write_bytes += nbytes
        self.counts.step.write_park += nbytes
        return self._submit(self._park, s, i)

    def _park(self, s: CacheSlot, i: int) -> None:
        """Layer i's gradient to disk until its update: into the slot of its file the update will write."""
        f = self.store.files[i]
        io = self.store.io
        t0 = time.perf_counter()
        with writing(f.path):
            fd = io.open(f.path)
            try:
                target = 1 - self.store.newest(i)
                self._writable(i, target)
                with self.cv:
                    self.store.sums[i][target].clear()
                mv = s.mv("g", f.part_bytes)
                sum_g = digest(mv)
                io.write(fd, mv, f.park_offset(target))
                crash_point("park")
                io.sync(fd, f.park_offset(target), f.part_bytes)
            finally:
                os.close(fd)
        with self.cv:
            self.store.sums[i][target]["g"] = sum_g
            self.counts.step.parks += 1
            self.counts.step.write_s += time.perf_counter() - t0

    def keep(self, s: CacheSlot, i: int) -> Future:
        """(Holding the lock.) Queue layer i's applied gradient, kept in slot ``s`` (``g_kept``), for
        ``kept_grads.eps``, where a redo of its speculative update finds it (:mod:`.spill`): the reader
        evicting the slot before the step's verdict queues it (and waits for it before reusing the slot)."""
        assert s.layer == i and s.g_kept, f"layer {i}'s gradient kept from a slot not keeping it"
        nbytes = self.store.files[i].part_bytes
        self.counts.step.write_bytes += nbytes
        self.counts.step.write_park += nbytes
        return self._pool.submit(self._keep, s, i)

    def _keep(self, s: CacheSlot, i: int) -> None:
        kept, io = self.store.kept, self.store.io
        nbytes = self.store.files[i].part_bytes
        t0 = time.perf_counter()
        with writing(kept.path):
            kept.ensure()
            fd = io.open(kept.path)
            try:
                io.write(fd, s.mv("g", nbytes), kept.offset(i))
                crash_point("park")  # (nothing a restart reads: the kill trials' park point covers it too)
            finally:
                os.close(fd)
        with self.cv:
            self.counts.step.parks += 1
            self.counts.step.write_s += time.perf_counter() - t0

    def commit(
        self,
        step: int,
        trainer_state: dict[str, Any],
        ident: dict[str, Any] | None,
        layers: dict[int, _Stepped],
    ) -> None:
        """Make the state after ``step`` the one a restart finds: once the writes queued so far are on
        disk, ``commit.json`` is replaced atomically (write, fsync, rename, fsync the directory). A write
        that has failed since the last commit raises here, before anything names its slot."""
        st = self.store
        with self.cv:
            self.check()
            if any(x is None for x in st.latest):
                raise RuntimeError("commit before every layer was written")
            slots = list(st.latest)
            entries = [{"slot": slots[i], "step": layers[i].opt_step} for i in range(len(st.files))]
            writes = list(self._jobs)  # every write queued before this record (not yet known to succeed)
            record = {
                "format": st.format,
                "step": step,
                "created": time.time(),
                **(ident or {}),
                "layers": entries,
                "trainer": trainer_state,
            }
            self._submit(self._write_record, record, slots, writes)
            self.recorded = slots
            self.commits += 1

    def _write_record(self, record: dict[str, Any], slots: list[int | None], writes: list[Future]) -> None:
        for w in writes:  # (done: queued before this job on the one writer thread)
            if w.exception() is not None:
                raise RuntimeError(f"a write before the commit record of step {record['step']} failed") from (
                    w.exception()
                )
        root, st = self.store.root, self.store
        with self.cv:  # each named slot's checksums, known now that the writes before are done
            for i, e in enumerate(record["layers"]):
                e["sums"] = {p: f"{h:016x}" for p, h in st.sums[i][slots[i]].items() if p != "g"}
        record["checksum"] = record_digest(record)
        t0 = time.perf_counter()
        tmp = root / f".{COMMIT}.tmp"
        with writing(root / COMMIT):  # the record, its rename into place and the directory's fsync
            with open(tmp, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            crash_point("commit")  # the new record written, not yet in place
            os.replace(tmp, root / COMMIT)
            fd = os.open(root, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        with self.cv:
            self.counts.step.write_s += time.perf_counter() - t0
            self.store.committed = slots  # durable now: the next step may overwrite the other slots
            self.last_commit_step = record["step"]

    def flush(self) -> None:
        """Wait for every queued write and record; the first failure raises here."""
        with self.cv:
            jobs = list(self._jobs)
        for j in jobs:
            self.result(j)
        with self.cv:
            self.check()

    def close(self) -> None:
        """Finish every queued write; a failure not yet raised to the training step raises here (every
        outstanding commit is checked, not only the last)."""
        self._pool.shutdown(wait=True)
        with self.cv:
            if self.error is not None and not self._reported:
                self.check()
            failed = [j.exception() for j in self._jobs if j.exception() is not None]
            self._jobs = []
        if failed and not self._reported:
            self._reported = True
            raise failed[0]
