"""The disk tier's gradient pool: gradients kept in RAM, within ``eps.grad_ram_gb``, instead of on disk.

Two kinds of gradient wait for something: one *parked* until its layer's update (L2L's update after the
backward; a layer held back for the global clipping factor), and one a speculative update has consumed but
a rollback would need again (the update is redone with the step's clipping factor). On disk, the first
costs a write and a read of 4 bytes per parameter and the second is not possible at all (the tier would
have to hold every update for the norm, parking every gradient). A gradient the pool holds costs no disk
byte; one that does not fit goes to disk as before (parked) or is not speculated on (held).

Buffers are per layer, allocated the first time a layer needs one and kept for the run (the RSS of a run is
reached in its first step, and stays). The tier's lock guards ``live`` and ``used``.
"""

from __future__ import annotations

import torch


class GradPool:
    """Per-layer FP32 gradient buffers in RAM, up to ``budget`` bytes in all."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self.bufs: dict[int, torch.Tensor] = {}
        self.live: set[int] = set()  # layers whose gradient the pool holds now

    def reserve(self, i: int, numel: int) -> bool:
        """(Holding the lock.) A buffer for layer i's gradient, if the budget has room (or it has one)."""
        if i in self.bufs:
            return True
        if self.used + 4 * numel > self.budget:
            return False
        self.bufs[i] = torch.empty(numel, dtype=torch.float32)
        self.used += 4 * numel
        return True

    def put(self, i: int, g: torch.Tensor) -> None:
        """Copy layer i's gradient in (a buffer reserved; the caller marks it ``live`` under the lock)."""
        self.bufs[i][: g.numel()].copy_(g)

    def get(self, i: int, g: torch.Tensor) -> None:
        """Copy layer i's kept gradient into ``g``."""
        g.copy_(self.bufs[i][: g.numel()])

    @property
    def nbytes(self) -> int:
        return self.used
