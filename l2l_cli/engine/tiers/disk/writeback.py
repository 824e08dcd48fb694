"""The disk tier's writes, behind the compute on one writer thread, in submission order: an updated
layer's state to the file slot the last commit does not name, a gradient parked until its update, and the
commit record (``commit.json``, replaced atomically once the step's writes are on disk)."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from l2l_cli.engine.tiers.disk.cache import CacheSlot
from l2l_cli.engine.tiers.disk.format import (
    COMMIT,
    FORMAT,
    FORMAT_SPLIT,
    clear_marks,
    crash_point,
    split_master,
)
from l2l_cli.engine.tiers.disk.stats import IoCounts
from l2l_cli.engine.tiers.disk.store import LayerStore
from l2l_cli.problems import writing


class _Stepped(Protocol):
    opt_step: float  # a layer's optimizer step count (committed with it)


class WriteBehind:
    """The writer thread and the commits it has made."""

    def __init__(self, store: LayerStore, cv: threading.Condition, counts: IoCounts):
        self.store, self.cv, self.counts = store, cv, counts
        self.commits = 0
        rec = store.record
        self.last_commit_step: int | None = rec.get("step") if rec is not None else None
        self._commit_job: Future | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l2l-disk-write")

    def write_back(self, s: CacheSlot, i: int, setup: bool = False) -> None:
        """(Holding the lock.) Queue layer i's new state for the slot of its file that the last commit
        does not name; the state is the newest from now on, on disk once the write is done (``setup``:
        building the state, counted apart from the steps')."""
        st = self.store
        prev = st.latest[i]
        if st.committed is not None and prev != st.committed[i]:
            raise RuntimeError(
                f"layer {i} was updated twice between commits; the committed copy would be lost"
            )
        target = 0 if prev is None else 1 - prev
        f = st.files[i]
        parts = f.parts  # (format 1, a new file: its moments are zeros already (fallocate), w alone)
        if prev is None and not f.split:
            parts = "w"
        st.latest[i], st.parked[i], st.grad_live[i], s.g_dirty = target, False, False, False
        st.pool.live.discard(i)
        st.pool.release(i)  # (a gradient kept for a redo stays until the verdict)
        s.valid.discard("g")  # applied: what is left in g is no gradient to keep
        c = self.counts.setup if setup else self.counts.step  # bytes when queued: the step that wrote them
        nbytes = sum(f.nbytes(p) for p in parts)
        c.write_bytes += nbytes
        c.write_state += nbytes
        s.writing = self._pool.submit(self._write, s, i, target, parts, setup)

    def _write(self, s: CacheSlot, i: int, target: int, parts: str, setup: bool) -> None:
        f = self.store.files[i]
        io = self.store.io
        t0 = time.perf_counter()
        marks = None
        if f.split:  # the master's lo plane from the cached FP32 master (hi: the send copy already)
            assert s.w_send is not None and s.lo is not None
            n = f.numel
            marks = split_master(s.f32["w"][:n], s.w_send[:n], s.lo[:n], s.f32["v"][:n])
        with writing(f.path):  # a full disk: named; the committed slot stays as it was
            fd = io.open(f.path)
            try:
                for k, p in enumerate(parts):
                    io.write(fd, s.mv(p, f.nbytes(p)), f.offset(target, p))
                    if k == 0:
                        crash_point("write")  # a torn slot: w written, the moments not yet
                io.sync(fd, f.offset(target, parts[0]), sum(f.nbytes(p) for p in parts))
            finally:
                os.close(fd)
                if marks is not None:
                    clear_marks(s.f32["v"][: f.numel], marks)
        with self.cv:
            (self.counts.setup if setup else self.counts.step).write_s += time.perf_counter() - t0

    def park(self, s: CacheSlot, i: int) -> Future:
        """(Holding the lock.) Queue layer i's gradient for the disk (after any earlier write of the slot)."""
        nbytes = self.store.files[i].part_bytes
        self.counts.step.write_bytes += nbytes
        self.counts.step.write_park += nbytes
        return self._pool.submit(self._park, s, i)

    def _park(self, s: CacheSlot, i: int) -> None:
        """Layer i's gradient to disk until its update: into the slot of its file the update will write."""
        f = self.store.files[i]
        io = self.store.io
        t0 = time.perf_counter()
        with writing(f.path):
            fd = io.open(f.path)
            try:
                target = 1 - self.store.newest(i)
                io.write(fd, s.mv("g", f.part_bytes), f.park_offset(target))
                crash_point("park")
                io.sync(fd, f.park_offset(target), f.part_bytes)
            finally:
                os.close(fd)
        with self.cv:
            self.counts.step.parks += 1
            self.counts.step.write_s += time.perf_counter() - t0

    def keep(self, s: CacheSlot, i: int) -> Future:
        """(Holding the lock.) Queue layer i's applied gradient for ``kept_grads.eps``, where a redo of its
        speculative update finds it (:mod:`.spill`); the slot's next write-back queues after it."""
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
        self, step: int, trainer_state: dict[str, Any], ident: dict[str, Any] | None,
        layers: dict[int, _Stepped],
    ) -> None:  # fmt: skip
        """Make the state after ``step`` the one a restart finds: once the writes queued so far are on
        disk, ``commit.json`` is replaced atomically (write, fsync, rename, fsync the directory)."""
        if self._commit_job is not None and self._commit_job.done():
            job, self._commit_job = self._commit_job, None
            job.result()  # a failed commit surfaces here (once)
        st = self.store
        with self.cv:
            if any(x is None for x in st.latest):
                raise RuntimeError("commit before every layer was written")
            st.committed = list(st.latest)
            entries = [{"slot": st.latest[i], "step": layers[i].opt_step} for i in range(len(st.files))]
        record = {"format": FORMAT_SPLIT if st.split else FORMAT, "step": step, "created": time.time(), **(ident or {}), "layers": entries,
                  "trainer": trainer_state}  # fmt: skip
        self._commit_job = self._pool.submit(self._write_record, record)
        self.commits += 1
        self.last_commit_step = step

    def _write_record(self, record: dict[str, Any]) -> None:
        root = self.store.root
        t0 = time.perf_counter()
        tmp = root / f".{COMMIT}.tmp"
        with writing(root / COMMIT), open(tmp, "w") as f:
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

    def close(self) -> None:
        """Finish every queued write; a failed last commit raises here."""
        self._pool.shutdown(wait=True)
        if self._commit_job is not None:
            job, self._commit_job = self._commit_job, None
            job.result()
