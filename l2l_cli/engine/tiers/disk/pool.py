"""The disk tier's gradient pool: gradients kept in RAM instead of on disk, for at most
``eps.grad_ram_layers`` layers at a time (and within ``eps.grad_ram_gb``), whatever the model's depth.

Two kinds of gradient wait for something: one *parked* until its layer's update (a layer held back for the
global clipping factor), and one a speculative update has consumed but a rollback would need again (the
update is redone with the step's clipping factor). On disk, either costs a write of 4 bytes per parameter
(and a read when it is used). The pool keeps the first few of a step's waiting gradients in RAM; the others
go to disk (parked in the layer file's free slot, or kept in :mod:`.spill`'s file), so the RAM it takes is
bounded by a number of layers, not by the depth.

Its buffers are sized for the layers whose gradients they hold and reused: a buffer belongs to a layer
while that layer's gradient waits in it (``live``: parked until its update; ``kept``: for a redo until the
step's verdict), and is free for another layer (as large or smaller) after. The buffers together never take
more than the model's ``capacity`` largest layers' gradients (``bound``), whatever the depth. The tier's lock
guards all of it.
"""

from __future__ import annotations

import torch

from l2l_cli.engine.tiers.disk.layout import aligned, pool_capacity


def pool_bound(numels: list[int], capacity: int) -> int:
    """The most bytes the pool takes: the gradients of the ``capacity`` largest layers of ``numels``."""
    return sum(aligned(4 * n) for n in sorted(numels, reverse=True)[: max(0, capacity)])


class GradPool:
    """At most ``capacity`` FP32 gradient buffers in RAM, each for one layer at a time, ``bound`` bytes in
    all."""

    def __init__(self, budget: int, layers: int, numels: list[int]):
        numel = max(numels, default=1)
        self.numel = numel  # elements of the largest layer's gradient
        # how many layers' gradients: eps.grad_ram_layers, within eps.grad_ram_gb (of the largest layer's)
        self.capacity = pool_capacity(numels, layers, budget)
        self.bound = pool_bound(numels, self.capacity)
        self.bufs: list[torch.Tensor] = []
        self.owner: dict[int, int] = {}  # layer -> its buffer (reserved, or holding its gradient)
        self.live: set[int] = set()  # layers whose parked gradient the pool holds (until their update)
        self.kept: set[int] = set()  # layers whose gradient the pool keeps for a redo (until the verdict)

    def reserve(self, i: int, numel: int) -> bool:
        """(Holding the lock.) A buffer for layer i's gradient: its own, the smallest free one large enough,
        or a new one of its size while the pool has fewer than ``capacity`` and stays within ``bound`` (a
        free one too small is given up for it); False when there is none (its gradient waits on disk)."""
        if i in self.owner:
            return True
        if numel > self.numel:
            return False
        taken = set(self.owner.values())
        free = [k for k in range(len(self.bufs)) if k not in taken]
        fits = [k for k in free if self.bufs[k].numel() >= numel]
        if fits:
            self.owner[i] = min(fits, key=lambda k: self.bufs[k].numel())
            return True
        size = aligned(4 * max(1, numel))
        small = [k for k in free if self.nbytes - self.bufs[k].nbytes + size <= self.bound]
        if len(self.bufs) < self.capacity and self.nbytes + size <= self.bound:
            self.bufs.append(torch.empty(size // 4, dtype=torch.float32))
            k = len(self.bufs) - 1
        elif small:  # a free buffer too small for it: replaced by one of its size
            k = small[0]
            self.bufs[k] = torch.empty(0)  # (the old one is given back before the new one is taken)
            self.bufs[k] = torch.empty(size // 4, dtype=torch.float32)
        else:
            return False
        self.owner[i] = k
        return True

    def release(self, i: int) -> None:
        """(Holding the lock.) Layer i's buffer is free again, unless its gradient still waits in it."""
        if i not in self.live and i not in self.kept:
            self.owner.pop(i, None)

    def drop(self, i: int) -> None:
        """(Holding the lock.) Layer i's gradient is applied or replaced: whatever the pool held of it is
        free."""
        self.live.discard(i)
        self.kept.discard(i)
        self.owner.pop(i, None)

    def hold(self, i: int) -> None:
        """(Holding the lock; its gradient copied in.) Layer i's gradient waits in its buffer until its
        update (``live``)."""
        assert i in self.owner and i not in self.kept, f"layer {i}'s gradient held without its buffer"
        self.live.add(i)

    def keep(self, i: int) -> None:
        """(Holding the lock; its gradient copied in.) Layer i's applied gradient stays in its buffer for a
        redo until the verdict (``kept``)."""
        assert i in self.owner, f"layer {i}'s gradient kept without its buffer"
        self.kept.add(i)

    def regrad(self, i: int) -> None:
        """(Holding the lock.) A rollback: layer i's kept gradient waits for its update again."""
        if i in self.kept:
            self.kept.discard(i)
            self.live.add(i)

    def applied(self, i: int) -> None:
        """(Holding the lock.) Layer i's update is in: its waiting gradient is no longer (a kept one stays
        until the verdict); its buffer is free unless it keeps one."""
        self.live.discard(i)
        self.release(i)

    def end_step(self) -> None:
        """(Holding the lock.) The step's verdict is in: no gradient is kept for a redo any more."""
        self.kept.clear()
        for i in list(self.owner):
            self.release(i)

    def holds(self, i: int) -> bool:
        """(Holding the lock.) Whether layer i has a buffer (reserved or in use)."""
        return i in self.owner

    def put(self, i: int, g: torch.Tensor) -> None:
        """Copy layer i's gradient in (a buffer reserved; the caller marks it ``live``/``kept`` under the
        lock)."""
        self.bufs[self.owner[i]][: g.numel()].copy_(g)

    def get(self, i: int, g: torch.Tensor) -> None:
        """Copy layer i's gradient out of the pool into ``g``."""
        g.copy_(self.bufs[self.owner[i]][: g.numel()])

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers allocated (kept for reuse; never more than ``bound``)."""
        return sum(b.nbytes for b in self.bufs)
