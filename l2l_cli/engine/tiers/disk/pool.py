"""The disk tier's gradient pool: gradients kept in RAM instead of on disk, for at most ``eps.grad_ram_layers``
layers at a time (and within ``eps.grad_ram_gb``), whatever the model's depth.

Two kinds of gradient wait for something: one *parked* until its layer's update (a layer held back for the
global clipping factor), and one a speculative update has consumed but a rollback would need again (the
update is redone with the step's clipping factor). On disk, either costs a write of 4 bytes per parameter
(and a read when it is used). The pool keeps the first few of a step's waiting gradients in RAM; the others
go to disk (parked in the layer file's free slot, or kept in :mod:`.spill`'s file), so the RAM it takes is
bounded by a number of layers, not by the depth.

Its buffers are sized for the largest layer and reused: a buffer belongs to a layer while that layer's
gradient waits in it (``live``: parked until its update; ``kept``: for a redo until the step's verdict),
and is free for another layer after. The tier's lock guards all of it.
"""

from __future__ import annotations

import torch

from l2l_cli.engine.tiers.disk.layout import aligned


class GradPool:
    """At most ``capacity`` FP32 gradient buffers in RAM, each for one layer at a time."""

    def __init__(self, budget: int, layers: int, numel: int):
        self.numel = numel  # elements of a buffer: the largest layer's
        self.buf_bytes = aligned(4 * max(1, numel))
        self.capacity = max(0, min(layers, budget // self.buf_bytes))
        self.bufs: list[torch.Tensor] = []
        self.owner: dict[int, int] = {}  # layer -> its buffer (reserved, or holding its gradient)
        self.live: set[int] = set()  # layers whose parked gradient the pool holds (until their update)
        self.kept: set[int] = set()  # layers whose gradient the pool keeps for a redo (until the verdict)

    def reserve(self, i: int, numel: int) -> bool:
        """(Holding the lock.) A buffer for layer i's gradient: its own, a free one, or a new one while the
        pool has fewer than ``capacity``; False when every buffer holds another layer's gradient."""
        if i in self.owner:
            return True
        if numel > self.numel:
            return False
        taken = set(self.owner.values())
        free = [k for k in range(len(self.bufs)) if k not in taken]
        if not free:
            if len(self.bufs) >= self.capacity:
                return False
            self.bufs.append(torch.empty(self.buf_bytes // 4, dtype=torch.float32))
            free = [len(self.bufs) - 1]
        self.owner[i] = free[0]
        return True

    def release(self, i: int) -> None:
        """(Holding the lock.) Layer i's buffer is free again, unless its gradient still waits in it."""
        if i not in self.live and i not in self.kept:
            self.owner.pop(i, None)

    def drop(self, i: int) -> None:
        """(Holding the lock.) Layer i's gradient is applied or replaced: whatever the pool held of it is free."""
        self.live.discard(i)
        self.kept.discard(i)
        self.owner.pop(i, None)

    def end_step(self) -> None:
        """(Holding the lock.) The step's verdict is in: no gradient is kept for a redo any more."""
        self.kept.clear()
        for i in list(self.owner):
            self.release(i)

    def holds(self, i: int) -> bool:
        """(Holding the lock.) Whether layer i has a buffer (reserved or in use)."""
        return i in self.owner

    def put(self, i: int, g: torch.Tensor) -> None:
        """Copy layer i's gradient in (a buffer reserved; the caller marks it ``live``/``kept`` under the lock)."""
        self.bufs[self.owner[i]][: g.numel()].copy_(g)

    def get(self, i: int, g: torch.Tensor) -> None:
        """Copy layer i's gradient out of the pool into ``g``."""
        g.copy_(self.bufs[self.owner[i]][: g.numel()])

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers allocated (they are kept for reuse: this is also the pool's peak)."""
        return sum(b.nbytes for b in self.bufs)

    @property
    def bound(self) -> int:
        """The most bytes the pool ever takes: ``capacity`` buffers of the largest layer."""
        return self.capacity * self.buf_bytes
