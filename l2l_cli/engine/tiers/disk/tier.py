"""The disk tier (``eps.tier=disk``): training state beyond host RAM, behind the :class:`Tier` protocol.

Every layer's FP32 master weights and optimizer moments live in one file per layer (:mod:`.format`,
:mod:`.store`); host RAM holds only ``eps.host_cache_layers`` layers at a time, in a cache of page-aligned
slots (:mod:`.cache`). L2L's schedule is what makes this cheap: layers are used one at a time in a known
order (forward 0..N+1, backward N+1..0, the update), so a reader thread (:mod:`.reader`) reads the layers
about to be used (:mod:`.readahead`) while the current one computes, and a writer thread
(:mod:`.writeback`) writes each updated layer back behind the compute; the host optimizer runs on the
cached copy. After each step the trainer commits: ``commit.json`` names each layer's current slot, so
``trainer.resume`` continues from it with no checkpoint of its own: the disk EPS *is* the checkpoint.

:class:`DiskTier` wires those parts together and serves the pins of the relay and the EPS.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from l2l_cli.engine.copies import CopyHandle
from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.optim import OptimSettings
from l2l_cli.engine.tiers.base import TierSettings
from l2l_cli.engine.tiers.disk.cache import CacheSlot, SlotTable, state_pieces
from l2l_cli.engine.tiers.disk.format import STATE
from l2l_cli.engine.tiers.disk.layer import DiskLayer
from l2l_cli.engine.tiers.disk.layout import MOMENTS
from l2l_cli.engine.tiers.disk.readahead import ReadAhead
from l2l_cli.engine.tiers.disk.reader import Demand, Reader
from l2l_cli.engine.tiers.disk.stats import IoCounts
from l2l_cli.engine.tiers.disk.store import LayerStore
from l2l_cli.engine.tiers.disk.writeback import WriteBehind
from l2l_cli.models.base import ModelSpec
from l2l_cli.profiling.timers import PhaseTimer


class DiskTier:
    """One file per layer on disk; ``cache_layers`` layers in RAM, read ahead and written back in the
    background. See the module doc for the parts and the crash-safety argument."""

    durable = True
    update_in_backward = True  # each layer's update while the backward's read of it is still in RAM

    def __init__(
        self,
        settings: TierSettings,
        spec: ModelSpec,
        layouts: dict[str, FlatLayout],
        acc: Accelerator,
        send_dtype: torch.dtype,
        optim: OptimSettings,
        timer: PhaseTimer | None = None,
    ):
        self.settings, self.acc, self.timer = settings, acc, timer
        # keeping a gradient for a redo costs a write beyond the RAM pool: eps.clip_redo chooses (Speculation)
        self.clip_redo = settings.clip_redo
        self.cv = threading.Condition()  # one lock for every part's state
        self.counts = IoCounts()
        # bf16 CMP: the master as bf16 hi / lo planes on disk (format 2), the forward reads hi alone. fp16's
        # bits are no half of FP32's: its CMP keeps FP32 weights (format 1) and converts them on reading.
        # 8-bit AdamW: the moment parts hold its state buffers, the master FP32 (format 3, see .format)
        fp32 = optim.kind.fp32_moments
        split = send_dtype == torch.bfloat16 and fp32
        pieces = state_pieces(layouts, optim)
        self.store = LayerStore(
            settings, spec, layouts, self.cv, self.counts, split, None if fp32 else pieces
        )
        self.pool = self.store.pool
        self.params = spec.total_params
        self.root = self.store.root
        if settings.resume:
            self.store.load_committed()  # (its format decides the cache's: a format-1 directory stays FP32)
        n = len(self.store)
        with acc.meter.paused():
            k = min(settings.cache_layers, n)  # more slots than layers would never be used
            # dedicated slots for the layers larger than a block, shared ones for the rest
            # (layout.cache_slots)
            numels = [f.numel for f in self.store.files]
            self.cache = SlotTable(k, numels, layouts, acc, send_dtype, optim, self.store.split, pieces)
        self.plan = ReadAhead(n, k, threading.get_ident())
        self.resident_peak = self.cache.nbytes
        self.layers: dict[int, DiskLayer] = {}
        self._main = threading.get_ident()
        if not self.store.resumed:
            self.store.create()
        self.resumed = self.store.resumed
        self.record = self.store.record
        # their threads work for this rank's device (acc.bind_thread: CUDA's current device is per thread)
        self.writer = WriteBehind(self.store, self.cv, self.counts, self.cache, bind=acc.bind_thread)
        self.reader = Reader(
            self.cache, self.plan, self.store, self.writer, self.cv, self.counts, bind=acc.bind_thread
        )
        self.reader.start()

    @property
    def slots(self) -> list[CacheSlot]:
        return self.cache.slots

    @property
    def latest(self) -> list[int | None]:
        return self.store.latest

    def new_layer(
        self,
        index: int,
        kind: str,
        layout: FlatLayout,
        acc: Accelerator,
        send_dtype: torch.dtype,
        optim: OptimSettings,
    ) -> DiskLayer:
        st = DiskLayer(
            self, index, kind, layout, acc.host_passes, optim.kind.one_pass, optim.kind.tensor_pass
        )
        if self.record is not None:
            st.opt_step = float(self.record["layers"][index]["step"])
        self.layers[index] = st
        return st

    def resume_point(self) -> dict[str, Any] | None:
        """The commit record the tier resumed from, if it holds a trainer state to resume with."""
        rec = self.record
        return rec if rec is not None and isinstance(rec.get("trainer"), dict) else None

    # ---- pins (the relay and the EPS) -------------------------------------------------------------------

    def slot_of(self, i: int) -> CacheSlot | None:
        return self.cache.slot_of(i)

    def pin(self, i: int, parts: str = "w", *, fresh: bool = False) -> None:
        """Layer i's ``parts`` in RAM until ``unpin`` (``fresh``: the caller overwrites them; nothing is
        read)."""
        if self.store.split and parts == "w" and not fresh:
            parts = "h"  # the relay sends the device the hi plane (format 2): 2 bytes per parameter read
        need = self._needed(parts, fresh)
        if need & set(MOMENTS):
            raise ValueError(f"pin({i}, {parts!r}): the moments are pinned for an update, with holding()")
        self._pin(i, need, fresh, "relay" if not fresh else None)

    def unpin(self, i: int, after: CopyHandle | None = None) -> None:
        """Done with layer i (``after``: a copy still reading from its buffers; the slot waits for it)."""
        with self.cv:
            s = self.cache.bound_slot(i)
            self.cache.unpin(s)
            if after is not None and not after.done():
                self.cache.copy_after(s, after)
            self.cv.notify_all()

    @contextmanager
    def holding(
        self, i: int, parts: str = "wmv", *, fresh: bool = False, dirty: bool = False
    ) -> Iterator[None]:
        """Layer i's ``parts`` in RAM for the block; ``dirty``: the block changes the state, which is then
        written back (behind the compute) to the slot that does not hold the current version."""
        need = self._needed(parts, fresh)
        s = self._pin(i, need, fresh, "update" if dirty else None)
        ok = False
        try:
            if dirty and s.writing is not None:  # the last write-back still reads these buffers
                self._wait(functools.partial(self.writer.result, s.writing))
            yield
            ok = True
        finally:
            with self.cv:
                if ok and dirty:
                    self.writer.write_back(s, i, setup=fresh and "w" in parts)
                self.cache.unpin(s, need)
                self.cv.notify_all()

    def release_grad(self, i: int) -> None:
        """The EPS is done with layer i's gradient for now: unpin it. One not yet applied (L2L updates after
        the whole backward) waits for its update on disk: written out at once when the cache cannot hold
        every layer (so its slot is free by the time the next layer's gradient needs one), else only if the
        slot is taken before the update."""
        st = self.store
        with self.cv:
            s = self.cache.slot_of(i)
            if s is None or s.pins <= 0:
                return
            numel = st.files[i].numel
            # a layer whose slot no other layer takes (its own, or a cache that holds every layer) keeps
            # its gradient there; any other writes it out (or to the pool) before its slot is reused
            reused = s.owner is None and len(self.cache) < len(st)
            waits = st.grad_live[i] and not st.parked[i] and reused
            to_ram = waits and self.pool.reserve(i, numel)
        self._note_resident()
        if to_ram:  # (still pinned: nobody reuses the slot while the gradient is copied out)
            self.pool.put(i, s.f32["g"][:numel])
        with self.cv:
            self.cache.unpin(s)
            if st.grad_live[i] and not st.parked[i]:
                if to_ram:
                    self.pool.hold(i)
                    st.parked[i] = True  # (in RAM: a read of it copies it back)
                    self.counts.step.parks_ram += 1
                elif reused:
                    self.cache.parking(s, i, self.writer.park(s, i))  # FIFO: after any earlier write
                    st.parked[i] = True  # a read of it waits for the slot's write (eviction does)
                else:
                    self.cache.hold_grad(s, i)
            self.cv.notify_all()

    def export(self, t: torch.Tensor) -> torch.Tensor:
        """A copy that outlives the pin (the slot is reused for other layers)."""
        return t.clone()

    def _needed(self, parts: str | frozenset[str], fresh: bool) -> frozenset[str]:
        """The parts a pin of ``parts`` holds (read unless ``fresh``): see :meth:`LayerStore.expand`."""
        need = frozenset(parts)
        return need if fresh else self.store.expand(need)

    def _pin(self, i: int, need: frozenset[str], fresh: bool, stream: str | None) -> CacheSlot:
        hit = self._pin_cached(i, need, fresh, stream)
        if hit is not None:
            return self._settled(hit, need, fresh)
        d = Demand(i, need, fresh)
        self.reader.ask(d)
        self._wait(lambda: self.reader.wait(d))
        if d.error is not None:
            raise d.error
        assert d.slot is not None
        return self._settled(d.slot, need, fresh)

    def _pin_cached(self, i: int, need: frozenset[str], fresh: bool, stream: str | None) -> CacheSlot | None:
        """Pin layer i if the cache has what is needed (else None: it must be read, or a slot found)."""
        with self.cv:
            if self.reader.closed:
                raise RuntimeError("the disk EPS is closed")
            self.writer.check()  # a failed write stops the step that follows it
            if self.reader.failed is not None:  # a read-ahead's eviction or read failed: raised here
                raise self.reader.failed
            self.plan.follow(i, need, fresh)
            if stream is not None:
                self.plan.note(stream, i, need)
            s = self.cache.slot_of(i)
            moments = not need & set(MOMENTS) or (s is not None and s.mom is not None)
            free = s is not None and (not s.busy or self.cache.beside_read(s, need))
            if s is not None and moments and (not s.missing(need) or (fresh and free)):
                if fresh:
                    new = need - s.valid
                    self.store.make_fresh(s, i, new)
                    self.cache.fresh(s, i, new)
                self.counts.step.hits += 1
                self.cache.pin(s, need)
                self.cv.notify_all()
                return s
            return None

    def _settled(self, s: CacheSlot, need: frozenset[str], fresh: bool) -> CacheSlot:
        """(``s`` pinned.) A slot about to be overwritten (a new gradient) once its last write (a parked
        gradient) is out; if that write failed, the pin is given back (no slot stays pinned by a pin that
        raised) and the failure raises."""
        writing = s.writing
        if fresh and writing is not None:
            try:
                self._wait(functools.partial(self.writer.result, writing))
            except BaseException:
                with self.cv:
                    self.cache.unpin(s, need)
                    self.cv.notify_all()
                raise
        return s

    def _wait(self, fn: Any) -> None:
        """Block in ``fn``; on the compute thread that is exposed disk time (``disk_wait``)."""
        t0 = time.perf_counter()
        if threading.get_ident() != self._main:
            try:
                fn()
            finally:
                with self.cv:
                    self.counts.step.eps_wait_s += time.perf_counter() - t0
            return
        try:
            if self.timer is not None:
                with self.timer("disk_wait"):
                    fn()
            else:
                fn()
        finally:
            with self.cv:
                self.counts.step.wait_s += time.perf_counter() - t0

    # ---- L2L-p's undo, and the trainer's commits ----------------------------------------------------------

    def restore(self, st: DiskLayer) -> None:
        """L2L-p's undo: the pre-update state is on disk, in the slot the update did not overwrite. The
        layer's current version becomes that slot again (no byte moves; the next use reads it), unless the
        cache is using the layer now: then it is read back into the cache. A gradient kept for a redo
        (:meth:`DiskLayer.reserve_redo`) becomes the layer's parked gradient again."""
        i = st.index
        undo = st.undo_slot
        if undo is None:
            raise RuntimeError(f"layer {i} has no pre-update state to restore")
        with self.cv:
            s = self.cache.slot_of(i)
            writing = s.writing if s is not None else None
        if writing is not None:  # the speculative update's write-back still reads the slot's buffers
            self._wait(functools.partial(self.writer.result, writing))
        with self.cv:
            s = self.cache.slot_of(i)
            if s is None or (s.pins == 0 and not s.busy):
                self.store.latest[i] = undo
                if s is not None:
                    self.cache.invalidate(s, i, {*STATE, "h"})
                self._regrad(st)
                st.opt_step = st.undo_step
                return
        with self.holding(i, STATE):
            s = self.cache.bound_slot(i)
            if s.writing is not None:
                self._wait(functools.partial(self.writer.result, s.writing))
            f = self.store.files[i]
            undo = st.undo_slot
            if undo is None:
                raise RuntimeError(f"layer {i} has no pre-update state to restore")

            def read() -> None:
                fd = self.store.io.open(f.path)
                try:
                    self.store.read_state(fd, s, i, undo, ["h", *STATE], "undo")
                finally:
                    os.close(fd)

            self._wait(read)
            with self.cv:
                self.store.latest[i] = undo
                self._regrad(st)
            st.opt_step = st.undo_step
            st.refresh_send()

    def _regrad(self, st: DiskLayer) -> None:
        """(Holding the lock.) A gradient kept for a redo (in the pool, or in ``kept_grads.eps``) is layer i's
        parked gradient again."""
        i = st.index
        if st.kept_grad:
            self.pool.regrad(i)
            s = self.cache.slot_of(i)
            if s is not None:  # still in its slot: a parked gradient there (on eviction: disk)
                self.cache.regrad(s, i)
            self.store.parked[i], self.store.grad_live[i] = True, True
            st.kept_grad = False

    def reserve_grad(self, i: int) -> bool:
        """Where layer i's gradient will be kept for a redo of a speculative update: a buffer of the pool if
        one is free, else ``kept_grads.eps`` on disk (:mod:`.spill`). Always possible: True."""
        with self.cv:
            self.pool.reserve(i, self.store.files[i].numel)
        return True

    def keep_grad(self, i: int, g: torch.Tensor) -> None:
        """(Layer i pinned, its update done, its write-back not yet queued.) Keep its gradient, as the update
        left it, until the verdict: in the pool if it reserved a buffer, else in its cache slot (``g_kept``),
        written to ``kept_grads.eps`` only if the reader reuses the slot before the verdict."""
        with self.cv:
            in_ram = self.pool.holds(i)
        if in_ram:
            self.pool.put(i, g)
        with self.cv:
            if in_ram:
                self.pool.keep(i)
                self.counts.step.parks_ram += 1
            else:
                self.cache.keep_grad(self.cache.bound_slot(i), i)
        self._note_resident()

    def commit(self, step: int, trainer_state: dict[str, Any], ident: dict[str, Any] | None = None) -> None:
        """Make the state after ``step`` the one a restart finds (see :meth:`WriteBehind.commit`)."""
        self.writer.commit(step, trainer_state, ident, self.layers)

    # ---- reporting and shutdown ---------------------------------------------------------------------------

    def host_parts(self) -> dict[str, int]:
        return {"eps_cache": self.cache.nbytes, "eps_grad_pool": self.pool.nbytes}

    def _note_resident(self) -> None:
        """The tier's RAM now (cache slots and the pool's buffers), for ``resident_bytes_peak``."""
        with self.cv:
            self.resident_peak = max(self.resident_peak, self.cache.nbytes + self.pool.nbytes)

    @property
    def resident_bound(self) -> int:
        """The most RAM the tier takes, whatever the depth: its cache slots and the pool's bound."""
        return self.cache.nbytes + self.pool.bound

    def pop_step(self, timer: PhaseTimer, training: bool = True) -> dict[str, float]:
        """This step's disk I/O: background read/write seconds join the phases (``disk_wait``, the exposed
        part, is timed where it happens); bytes go to the step's metrics. A training step's trace of pins
        becomes the read-ahead plan of the next (``training=False``: an evaluation; not a plan)."""
        with self.cv:
            st = self.counts.pop(training)
            self.store.w_seen.clear()
            self.plan.end_step(training)
            # the step's verdict is in (its redos done): no gradient is kept for one any more
            self.pool.end_step()
            for layer in self.layers.values():
                layer.kept_grad = False
            self.cache.end_step()  # a kept gradient no redo used is no gradient any more
            st_ = self.store  # (one rolled back by a skipped step stays parked where it is until replaced)
            st_.kept_on_disk = [k and p for k, p in zip(st_.kept_on_disk, st_.parked)]
            st_.kept.writes = {i: w for i, w in st_.kept.writes.items() if st_.kept_on_disk[i]}
        timer.add("disk_read", st.read_s)
        timer.add("disk_write", st.write_s)
        return {
            "disk_read_bytes": float(st.read_bytes),
            "disk_write_bytes": float(st.write_bytes),
            "disk_reads_ahead": float(st.ahead),
            "disk_reads_on_demand": float(st.demand),
            "disk_cache_hits": float(st.hits),
            "disk_cache_misses": float(st.misses),
        }

    def summary(self) -> dict[str, Any]:
        """summary.json's ``eps_disk``: where, how much, how fast, and how much of it compute hid (once
        every queued write and commit record is on disk: a failure raises here)."""
        self.writer.flush()
        with self.cv:
            io = self.counts.report(self.params)
        return {
            "path": str(self.root),
            "host_cache_layers": len(self.cache),
            "update_buffers": len(self.cache.moms),  # each one layer's moments, for its update
            "direct_io": self.store.io.direct,
            "file_bytes": self.store.file_bytes,
            **io,
            "grad_pool_bytes": self.pool.nbytes,
            "grad_ram_layers": self.pool.capacity,
            # the tier's RAM (cache slots and pool buffers): its peak, and the bound it keeps at any depth
            "resident_bytes_peak": max(self.resident_peak, self.cache.nbytes + self.pool.nbytes),
            "resident_bytes_bound": self.resident_bound,
            "commits": self.writer.commits,
            "last_commit_step": self.writer.last_commit_step,
        }

    def close(self) -> None:
        self.reader.stop()
        try:
            self.writer.close()
        finally:
            self.store.remove_temporary()
