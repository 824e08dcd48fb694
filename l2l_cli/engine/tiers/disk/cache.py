"""The disk tier's host cache: ``eps.host_cache_layers`` page-aligned slots, each holding one layer's weights
and gradient while it is in use, ``UPDATE_BUFFERS`` update buffers holding a layer's moments while it is
updated, and the choice of which slot to reuse for the next layer.

Slots are *dedicated* (one layer larger than a block, the embeddings say, and only it) or *shared* (any
layer that fits, sized for a block): :func:`~.layout.cache_slots` is the rule and its argument that no pin
waits forever. The forward and backward read only a layer's weights, so a slot holds [w | g] (8 bytes per
parameter, not 16); the moments are read for the update alone (they are read then anyway), into an update
buffer that the slot of the layer being updated holds (``mom``) until another layer's update takes it, once
the write-back that reads it is done. Updates run one at a time (the EPS thread, or the compute thread
while the EPS thread waits), so one buffer serves them (:data:`~.layout.UPDATE_BUFFERS`)."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from l2l_cli.engine.device import Accelerator, CopyHandle
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.layer_state import bind_optimizer
from l2l_cli.engine.optim import OptimSettings
from l2l_cli.engine.tiers.disk.format import AlignedBuffer, aligned
from l2l_cli.engine.tiers.disk.layout import MOMENTS, UPDATE_BUFFERS, cache_slots


class UpdateBuffer:
    """One layer's FP32 moments [m | v], page-aligned, for layers of at most ``n_max`` elements; held by
    the slot of the layer being updated (``holder``) while its update and write-back use it."""

    def __init__(self, index: int, n_max: int, acc: Accelerator):
        self.index, self.numel = index, n_max
        self.part_bytes = aligned(4 * n_max)
        self.buf = AlignedBuffer(len(MOMENTS) * self.part_bytes, acc)
        pb = self.part_bytes
        self.f32 = {
            p: self.buf.tensor[k * pb : (k + 1) * pb].view(torch.float32) for k, p in enumerate(MOMENTS)
        }
        self.holder: CacheSlot | None = None
        self.writing: Future | None = None  # the last write-back that reads it (a read into it waits)

    def view(self, part: str, nbytes: int) -> memoryview:
        return self.buf.view(MOMENTS.index(part) * self.part_bytes, nbytes)

    @property
    def nbytes(self) -> int:
        return self.buf.tensor.nbytes


class CacheSlot:
    """One layer's weights and gradient in RAM: [w | g] page-aligned, sized for ``n_max`` elements (a layer
    of at most that many fits); its moments are in the update buffer it holds (``mom``) while the layer is
    updated. One optimizer per layer kind that fits and update buffer is bound to views of them (the
    optimizer runs on the cached copy in place)."""

    def __init__(
        self,
        n_max: int,
        layouts: dict[str, FlatLayout],
        acc: Accelerator,
        send_dtype: torch.dtype,
        optim: OptimSettings,
        split: bool = False,
        owner: int | None = None,
    ):
        self.numel = n_max  # the largest layer this slot can hold
        self.owner = owner  # the one layer a dedicated slot holds (None: shared)
        self.split = split  # format 2: the send copy is the file's hi plane, ``lo`` its lo plane
        self.part_bytes = aligned(4 * n_max)
        self.buf = AlignedBuffer(2 * self.part_bytes, acc)
        pb = self.part_bytes
        self._own = {
            p: self.buf.tensor[k * pb : (k + 1) * pb].view(torch.float32) for k, p in enumerate("wg")
        }
        self.layouts, self.optim = layouts, optim
        self.w_send: torch.Tensor | None = None
        self._send = self._lo = None
        if send_dtype != torch.float32:  # page-aligned: format 2 reads the hi plane straight into it
            self._send = AlignedBuffer(aligned(send_dtype.itemsize * n_max), acc)
            self.w_send = self._send.tensor.view(send_dtype)[:n_max]
        if split:
            self._lo = AlignedBuffer(aligned(2 * n_max))
        self.lo = self._lo.tensor.view(torch.int16)[:n_max] if self._lo is not None else None
        # CMP: the device's half gradient lands here and is widened into g on the host
        self.g_recv = acc.host_empty(n_max, send_dtype) if send_dtype != torch.float32 else None
        self._optimizers: dict[tuple[int, str], torch.optim.Optimizer] = {}
        self.mom: UpdateBuffer | None = None  # the update buffer this slot holds (its layer's m and v)
        self.mv_pins = 0  # pins that use the moments (the update buffer stays while there are any)
        self.layer: int | None = None
        self.valid: set[str] = set()  # parts that hold the layer's current values
        self.pins = 0
        self.busy = False  # the reader is evicting from / reading into this slot
        self.copies: list[CopyHandle] = []  # device copies still reading from this slot
        self.writing: Future | None = None  # the write-back of the layer's last update
        self.g_dirty = False  # g holds a gradient that is on no disk yet (parked on eviction)
        # g holds the gradient a speculative update consumed, kept for a redo until the step's verdict
        # (written to kept_grads.eps only if the slot is reused before the verdict)
        self.g_kept = False
        self.used = 0

    @property
    def f32(self) -> dict[str, torch.Tensor]:
        """The FP32 parts in RAM now: ``w`` and ``g``, and ``m``, ``v`` while the slot holds an update
        buffer."""
        return self._own if self.mom is None else {**self._own, **self.mom.f32}

    def optimizer(self, kind: str) -> torch.optim.Optimizer:
        """The optimizer of a layer of ``kind`` in this slot, on its weights and gradient and the moments of
        the update buffer it holds (bound on first use for each buffer)."""
        mom = self.mom
        if mom is None:
            raise RuntimeError(f"layer {self.layer}'s moments are not in RAM (updated without them pinned)")
        key = (mom.index, kind)
        if key not in self._optimizers:
            layout = self.layouts[kind]
            n = layout.numel
            f = self.f32
            self._optimizers[key] = bind_optimizer(layout, *(f[p][:n] for p in "wgmv"), self.optim)
        return self._optimizers[key]

    def mv(self, part: str, nbytes: int) -> memoryview:
        """A buffer to read a file part into or write it from (``h``, ``l``: the planes of format 2; ``m``,
        ``v``: the update buffer the slot holds)."""
        if part == "h":
            assert self._send is not None
            return self._send.view(0, nbytes)
        if part == "l":
            assert self._lo is not None
            return self._lo.view(0, nbytes)
        if part in MOMENTS:
            if self.mom is None:
                raise RuntimeError(f"layer {self.layer}'s moments read or written without an update buffer")
            return self.mom.view(part, nbytes)
        return self.buf.view("wg".index(part) * self.part_bytes, nbytes)

    def missing(self, parts: frozenset[str] | set[str]) -> frozenset[str]:
        """What of ``parts`` this slot does not hold (format 2: the hi plane is the send copy of a valid
        master, refreshed by whoever changed it before unpinning)."""
        have = self.valid | {"h"} if self.split and "w" in self.valid else self.valid
        if self.mom is None:
            have = have - set(MOMENTS)
        return frozenset(parts) - have

    @property
    def nbytes(self) -> int:
        bufs = (self.buf.tensor, self.w_send, self.g_recv, self.lo)
        return sum(t.nbytes for t in bufs if t is not None)


class SlotCache:
    """The slots, which layer each holds, and which one to reuse (the tier's lock guards all of it)."""

    def __init__(
        self,
        k: int,
        numels: list[int],
        layouts: dict[str, FlatLayout],
        acc: Accelerator,
        send_dtype: torch.dtype,
        optim: OptimSettings,
        split: bool = False,
    ):
        """Slots for ``k`` = ``eps.host_cache_layers`` and layers of ``numels`` elements (each layer's), by
        :func:`~.layout.cache_slots`."""
        self.slots = [
            CacheSlot(n, layouts, acc, send_dtype, optim, split, owner) for n, owner in cache_slots(numels, k)
        ]
        largest = max((s.numel for s in self.slots), default=0)
        self.moms = [UpdateBuffer(j, largest, acc) for j in range(UPDATE_BUFFERS if self.slots else 0)]
        self._clock = 0

    def __len__(self) -> int:
        return len(self.slots)

    def slot_of(self, i: int) -> CacheSlot | None:
        for s in self.slots:
            if s.layer == i:
                return s
        return None

    def bound_slot(self, i: int) -> CacheSlot:
        s = self.slot_of(i)
        if s is None:
            raise RuntimeError(f"layer {i} is not in the host cache")
        return s

    def pin(self, s: CacheSlot, need: frozenset[str] | set[str] = frozenset()) -> None:
        """One more user of ``s`` (of its parts ``need``), and the most recently used slot now."""
        assert not (set(need) & set(MOMENTS)) or s.mom is not None, f"layer {s.layer} pinned without moments"
        s.pins += 1
        if set(need) & set(MOMENTS):
            s.mv_pins += 1
        self._clock += 1
        s.used = self._clock

    def unpin(self, s: CacheSlot, need: frozenset[str] | set[str] = frozenset()) -> None:
        """One user of ``s`` (of its parts ``need``) fewer."""
        assert s.pins > 0, f"layer {s.layer} unpinned more often than pinned"
        s.pins -= 1
        if set(need) & set(MOMENTS):
            assert s.mv_pins > 0
            s.mv_pins -= 1

    def free_buffer(self, s: CacheSlot, keep: set[int] | frozenset[int] = frozenset()) -> UpdateBuffer | None:
        """An update buffer slot ``s`` may take for its layer's moments: its own, a free one, else one whose
        holder is not using it (no pin of its moments, no read into it, its layer not in ``keep``: needed
        soon); None when every buffer is in use."""
        if s.mom is not None:
            return s.mom
        free = [b for b in self.moms if b.holder is None]
        if free:
            return free[0]
        idle = [
            b
            for b in self.moms
            if b.holder is not None
            and b.holder.mv_pins == 0
            and not b.holder.busy
            and b.holder.layer not in keep
        ]
        return min(idle, key=lambda b: b.holder.used if b.holder is not None else 0) if idle else None

    def attach(self, s: CacheSlot, b: UpdateBuffer) -> None:
        """Slot ``s`` holds update buffer ``b`` from now on; its previous holder's moments are gone from RAM
        (a read into ``b`` waits for ``b.writing`` first)."""
        if s.mom is b:
            return
        assert s.mom is None, f"layer {s.layer}'s slot holds two update buffers"
        old = b.holder
        if old is not None:
            assert old.mv_pins == 0 and not old.busy, f"layer {old.layer}'s moments taken while in use"
            self.detach(old)
        b.holder, s.mom = s, b

    def detach(self, s: CacheSlot) -> None:
        """Slot ``s`` gives its update buffer back (its moments are no longer in RAM)."""
        b = s.mom
        if b is None:
            return
        assert s.mv_pins == 0, f"layer {s.layer}'s update buffer given back while pinned"
        if s.split and "w" in s.valid:  # format 2: the master is joined with v's tie marks, so it goes
            s.valid |= {"h"}  # with the moments (the send copy, its hi plane, stays current)
            s.valid.discard("w")
        s.valid -= set(MOMENTS)
        b.holder, s.mom = None, None

    def may_hold(self, s: CacheSlot, i: int, numel: int) -> bool:
        """Whether slot ``s`` may hold layer i (of ``numel`` elements): its dedicated slot, or a shared one
        large enough."""
        return s.owner == i if s.owner is not None else s.numel >= numel

    def victim(self, avoid: set[int], later: dict[int, int], i: int, numel: int) -> CacheSlot | None:
        """An unpinned slot to reuse for layer i of ``numel`` elements, among those it may take (its own
        dedicated slot, or a shared one large enough): empty,
        else one nobody will use soon (least recently used, clean before one whose gradient must be parked,
        one whose write-back is done first), else the one needed last; of two alike, the smaller (a larger
        slot stays for the larger layers only it can hold)."""
        free = [
            s
            for s in self.slots
            if s.pins == 0 and not s.busy and s.layer not in avoid and self.may_hold(s, i, numel)
        ]
        if not free:
            return None

        def cost(s: CacheSlot) -> tuple[float, ...]:
            # a slot whose write-back is still going would hold the reader up (its reads and the writes are
            # on their own queues, so a read never waits behind a write it does not need to)
            writing = int(s.writing is not None and not s.writing.done())
            if s.layer is None:
                return (0, s.numel, writing, 0.0)
            if s.layer not in later:
                return (1 + int(s.g_dirty or s.g_kept), s.numel, writing, float(s.used))
            return (3, writing, -float(later[s.layer]), s.numel)

        return min(free, key=cost)

    @property
    def nbytes(self) -> int:
        """The slots' and the update buffers' bytes (:func:`~.layout.cache_bytes` predicts it)."""
        return sum(s.nbytes for s in self.slots) + sum(b.nbytes for b in self.moms)
