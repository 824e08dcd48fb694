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
from dataclasses import dataclass

import torch

from l2l_cli.engine.copies import CopyHandle
from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.layer_state import bind_optimizer
from l2l_cli.engine.optim import OptimSettings
from l2l_cli.engine.tiers.disk.format import AlignedBuffer, aligned
from l2l_cli.engine.tiers.disk.layout import MOMENTS, UPDATE_BUFFERS, Piece, cache_slots, moment_bytes
from l2l_cli.engine.tiers.disk.update_buffer import UpdateBuffer, state_pieces


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
        pieces: dict[str, dict[str, list[Piece]]] | None = None,
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
        self.pieces = pieces or {}  # each layer kind's state buffers in the moment parts (moment_layout)
        self.w_send: torch.Tensor | None = None
        self._send = self._lo = None
        if send_dtype != torch.float32:  # page-aligned: format 2 reads the hi plane straight into it
            self._send = AlignedBuffer(aligned(send_dtype.itemsize * n_max), acc)
            self.w_send = self._send.tensor.view(send_dtype)[:n_max]
        if split:
            self._lo = AlignedBuffer(aligned(2 * n_max))
        self.lo = self._lo.tensor.view(torch.int16)[:n_max] if self._lo is not None else None
        # CMP: the device's half gradient lands here and is widened into g on the host
        self.g_recv = acc.host_empty(n_max, send_dtype, link=True) if send_dtype != torch.float32 else None
        self._optimizers: dict[tuple[int, str], torch.optim.Optimizer] = {}
        self.mom: UpdateBuffer | None = None  # the update buffer this slot holds (its layer's m and v)
        self.mv_pins = 0  # pins that use the moments (the update buffer stays while there are any)
        self.layer: int | None = None
        self.valid: set[str] = set()  # parts that hold the layer's current values
        self.pins = 0
        self.busy = False  # the reader is evicting from / reading into this slot
        self.reading: frozenset[str] | None = None  # the parts a busy slot's job reads (None: it evicts)
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
            st = self.state(kind)
            m, v = st.pop("m"), st.pop("v")
            w, g = (self._own[p][:n] for p in "wg")
            self._optimizers[key] = bind_optimizer(layout, w, g, m, v, self.optim, st)
        return self._optimizers[key]

    def state(self, kind: str) -> dict[str, torch.Tensor]:
        """The optimizer's state of a layer of ``kind`` by short name (``m``, ``v``, and 8-bit AdamW's
        absmaxes and small tensors' FP32 moments): views of the update buffer the slot holds."""
        mom = self.mom
        if mom is None:
            raise RuntimeError(f"layer {self.layer}'s moments are not in RAM (updated without them pinned)")
        return mom.state(self.pieces[kind])

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


@dataclass
class Eviction:
    """What a slot held when it was rebound, for the reader to finish before it reads into the slot: the
    previous layer, the device copies still reading the slot, its last write-back, whether its gradient
    is on no disk yet (to park), and the write of a kept gradient to ``kept_grads.eps``."""

    layer: int | None
    copies: list[CopyHandle]
    writing: Future | None
    park: bool
    keeping: Future | None = None


class SlotTable:
    """Every cache slot's state and each transition of it, with its precondition asserted: the only code
    that changes a :class:`CacheSlot`'s or an :class:`UpdateBuffer`'s fields (the reader, the writer, the
    tier and the pool call these under the tier's lock). A slot's life:

    - ``bind``: an unpinned, idle slot takes a layer that no slot holds (the previous one is evicted by the
      reader: its copies, write-back and a gradient to park are handed over in an :class:`Eviction`);
    - ``begin_read`` / ``end_read`` / ``fail_read``: a reader job owns the slot (``busy``) and adds the parts
      it read, or unbinds it;
    - ``pin`` / ``unpin`` / ``copy_after``: users (their moments counted apart); ``attach`` / ``detach``: the
      update buffer;
    - ``fresh``: parts a pin overwrites; ``written_back``: an update queued for the disk (the slot's and the
      update buffer's last write); ``parking``: a gradient queued for the disk; ``hold_grad``: a gradient
      on no disk yet, parked when the slot is rebound; ``keep_grad`` / ``regrad`` / ``end_step``: a gradient
      kept for a redo until the verdict;
    - ``invalidate``: parts no longer current (L2L-p's undo on an unpinned, idle slot)."""

    def __init__(
        self,
        k: int,
        numels: list[int],
        layouts: dict[str, FlatLayout],
        acc: Accelerator,
        send_dtype: torch.dtype,
        optim: OptimSettings,
        split: bool = False,
        pieces: dict[str, dict[str, list[Piece]]] | None = None,
    ):
        """Slots for ``k`` = ``eps.host_cache_layers`` and layers of ``numels`` elements (each layer's), by
        :func:`~.layout.cache_slots`; ``pieces``: each layer kind's state buffers in the moment parts
        (:func:`~.layout.moment_layout`), which size the update buffers (for the largest of each part)."""
        pieces = pieces or state_pieces(layouts, optim)
        self.slots = [
            CacheSlot(n, layouts, acc, send_dtype, optim, split, owner, pieces)
            for n, owner in cache_slots(numels, k)
        ]
        per_kind = [moment_bytes(x) for x in pieces.values()]
        moments = {p: max((b[p] for b in per_kind), default=0) for p in MOMENTS}
        self.moms = [UpdateBuffer(j, moments, acc) for j in range(UPDATE_BUFFERS if self.slots else 0)]
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
        assert s.layer is not None, "a pin of a slot that holds no layer"
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

    # ---- transitions (holding the lock) -------------------------------------------------------------

    def bind(self, s: CacheSlot, i: int, keeping: Future | None = None) -> Eviction:
        """Slot ``s`` holds layer i from now on, a reader job owning it (``busy``); what it held is handed
        back to be evicted (``keeping``: its kept gradient's write, queued by the caller)."""
        assert s.pins == 0 and not s.busy, f"the slot of layer {s.layer} rebound while in use"
        assert self.slot_of(i) is None, f"layer {i} bound to a second slot"
        assert keeping is None or s.g_kept, f"layer {s.layer}'s slot keeps no gradient to write"
        self.detach(s)  # (its moments, if it held them, are on disk or in the write queued)
        old = s.layer
        ev = Eviction(old, s.copies, s.writing, s.g_dirty and old is not None, keeping)
        s.layer, s.valid, s.copies, s.writing, s.g_dirty, s.g_kept = i, set(), [], None, False, False
        s.busy, s.reading = True, None
        return ev

    def begin_read(self, s: CacheSlot, i: int, parts: frozenset[str] = frozenset()) -> None:
        """A reader job owns slot ``s`` (layer i's) until ``end_read`` / ``fail_read``, reading ``parts``."""
        assert s.layer == i and not s.busy, (
            f"a read of layer {i} into a slot holding {s.layer} (busy {s.busy})"
        )
        s.busy, s.reading = True, frozenset(parts)

    def beside_read(self, s: CacheSlot, need: frozenset[str] | set[str]) -> bool:
        """Whether a pin that overwrites ``need`` (a new gradient) may take busy slot ``s`` while its job
        runs: the job reads only the moments, into the update buffer, not the slot's own ``w | g``, and
        evicts nothing (the backward's gradient then lands while the update's moments are read)."""
        r = s.reading
        return s.busy and bool(r) and r <= set(MOMENTS) and set(need) <= {"g"}

    def end_read(self, s: CacheSlot, i: int, parts: frozenset[str] | set[str]) -> None:
        """The job on slot ``s`` read ``parts`` of layer i: they are current."""
        assert s.busy and s.layer == i, f"layer {i}'s slot changed during its job"
        assert not set(parts) & set(MOMENTS) or s.mom is not None, (
            f"layer {i}'s moments read without a buffer"
        )
        s.busy, s.reading = False, None
        s.valid |= set(parts)

    def fail_read(self, s: CacheSlot, i: int) -> None:
        """The job on slot ``s`` failed: the slot holds no layer."""
        assert s.busy and s.layer == i, f"layer {i}'s slot changed during its job"
        s.busy, s.reading = False, None
        self.detach(s)
        s.layer, s.valid = None, set()

    def copy_after(self, s: CacheSlot, handle: CopyHandle) -> None:
        """A device copy still reads slot ``s``: its eviction waits for it."""
        assert s.layer is not None
        s.copies.append(handle)

    def fresh(self, s: CacheSlot, i: int, parts: frozenset[str] | set[str]) -> None:
        """Layer i's ``parts`` are about to be overwritten by the pin's holder: current (a new gradient is
        neither on disk nor kept)."""
        assert s.layer == i, f"layer {i}'s parts made fresh in a slot holding {s.layer}"
        assert not set(parts) & set(MOMENTS) or s.mom is not None, (
            f"layer {i}'s fresh moments without a buffer"
        )
        if "g" in parts:
            s.g_dirty, s.g_kept = False, False
        s.valid |= set(parts)

    def written_back(self, s: CacheSlot, i: int, fut: Future, parts: str) -> None:
        """Layer i's update is queued for the disk (``parts`` of it, read by ``fut``): the slot's last write,
        and the update buffer's if the moments are written; its gradient is applied (no longer one to park),
        and gone unless kept for a redo."""
        assert s.layer == i and s.pins > 0, f"layer {i} written back from a slot not pinned for it"
        s.writing, s.g_dirty = fut, False
        if not s.g_kept:
            s.valid.discard("g")  # applied: what is left in g is no gradient to keep
        if set(parts) & set(MOMENTS):
            assert s.mom is not None, f"layer {i}'s moments written back without a buffer"
            s.mom.writing = fut

    def parking(self, s: CacheSlot, i: int, fut: Future) -> None:
        """Layer i's gradient is queued for the disk from slot ``s`` (after the slot's earlier writes)."""
        assert s.layer == i, f"layer {i}'s gradient parked from a slot holding {s.layer}"
        s.writing, s.g_dirty = fut, False

    def hold_grad(self, s: CacheSlot, i: int) -> None:
        """Layer i's gradient waits in its slot, on no disk: parked if the slot is rebound first."""
        assert s.layer == i and "g" in s.valid, f"layer {i}'s gradient held in a slot holding {s.layer}"
        s.g_dirty = True

    def keep_grad(self, s: CacheSlot, i: int) -> None:
        """(Layer i pinned, updated.) Its gradient stays in the slot for a redo until the verdict."""
        assert s.layer == i and s.pins > 0, f"layer {i}'s gradient kept in a slot not pinned for it"
        s.g_kept = True

    def regrad(self, s: CacheSlot, i: int) -> None:
        """A rollback: layer i's kept gradient is a gradient waiting for its update again."""
        assert s.layer == i
        if s.g_kept:
            s.g_kept, s.g_dirty = False, True

    def end_step(self) -> None:
        """The step's verdict is in: a kept gradient no redo used is no gradient any more."""
        for s in self.slots:
            if s.g_kept:
                s.g_kept = False
                s.valid.discard("g")

    def invalidate(self, s: CacheSlot, i: int, parts: frozenset[str] | set[str]) -> None:
        """Layer i's ``parts`` in slot ``s`` are not its current version any more (nobody uses them)."""
        assert s.layer == i and s.pins == 0 and not s.busy, f"layer {i}'s slot invalidated while in use"
        s.valid -= set(parts)

    @property
    def nbytes(self) -> int:
        """The slots' and the update buffers' bytes (:func:`~.layout.cache_bytes` predicts it)."""
        return sum(s.nbytes for s in self.slots) + sum(b.nbytes for b in self.moms)
