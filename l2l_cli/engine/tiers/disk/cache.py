"""The disk tier's host cache: ``eps.host_cache_layers`` page-aligned slots, each holding one layer's state
while it is in use, and the choice of which slot to reuse for the next layer.

Slots are *dedicated* (one layer larger than a block, the embeddings say, and only it) or *shared* (any
layer that fits, sized for a block): :func:`~.layout.cache_slots` is the rule and its argument that no pin
waits forever."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from l2l_cli.engine.device import Accelerator, CopyHandle
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.layer_state import bind_optimizer
from l2l_cli.engine.optim import OptimSettings
from l2l_cli.engine.tiers.disk.format import AlignedBuffer, aligned
from l2l_cli.engine.tiers.disk.layout import cache_slots


class CacheSlot:
    """One layer's state in RAM: [w | m | v | g] page-aligned, sized for ``n_max`` elements (a layer of at
    most that many fits), with one optimizer per layer kind that fits bound to views of it (the optimizer
    runs on the cached copy in place)."""

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
        self.buf = AlignedBuffer(4 * self.part_bytes, acc)
        pb = self.part_bytes
        self.f32 = {
            p: self.buf.tensor[k * pb : (k + 1) * pb].view(torch.float32) for k, p in enumerate("wmvg")
        }
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
        self.optimizers = {
            kind: bind_optimizer(layout, *(self.f32[p][: layout.numel] for p in "wgmv"), optim)
            for kind, layout in layouts.items()
            if layout.numel <= n_max
        }
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

    def mv(self, part: str, nbytes: int) -> memoryview:
        """A buffer to read a file part into or write it from (``h``, ``l``: the planes of format 2)."""
        if part == "h":
            assert self._send is not None
            return self._send.view(0, nbytes)
        if part == "l":
            assert self._lo is not None
            return self._lo.view(0, nbytes)
        return self.buf.view("wmvg".index(part) * self.part_bytes, nbytes)

    def missing(self, parts: frozenset[str] | set[str]) -> frozenset[str]:
        """What of ``parts`` this slot does not hold (format 2: the hi plane is the send copy of a valid
        master, refreshed by whoever changed it before unpinning)."""
        have = self.valid | {"h"} if self.split and "w" in self.valid else self.valid
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

    def pin(self, s: CacheSlot) -> None:
        """One more user of ``s``, and the most recently used slot now."""
        s.pins += 1
        self._clock += 1
        s.used = self._clock

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
        return sum(s.nbytes for s in self.slots)
