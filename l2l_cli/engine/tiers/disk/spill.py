"""Where the disk tier keeps a speculatively applied gradient that its RAM pool has no room for.

A speculative update (L2L and L2L-p under global clipping) consumes its layer's gradient before the step's
verdict, and a verdict of "clip" redoes the update from the pre-update state (the layer file's other slot)
with that gradient times the clipping factor. Both of the layer file's slots are taken then (the pre-update
state and the new one), so a gradient kept on disk goes to a file of its own: ``kept_grads.eps``, one FP32
area per layer, written behind the compute and read back only by a redo. Nothing in it outlives the step
(a restart never reads it), so it is created sparse, when the first gradient is kept in it.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path

from l2l_cli.engine.tiers.disk.layout import aligned

NAME = "kept_grads.eps"


class KeptGrads:
    """``kept_grads.eps``: layer i's gradient at ``offset(i)`` (``part_bytes`` of its layer file)."""

    def __init__(self, root: Path, part_bytes: list[int]):
        self.path = root / NAME
        self._at = [0]
        for nbytes in part_bytes:
            self._at.append(self._at[-1] + aligned(nbytes))
        self.size = self._at[-1]
        self._made = False
        self.writes: dict[int, Future] = {}  # layer -> its gradient's write (a read of it waits for it)

    def offset(self, i: int) -> int:
        return self._at[i]

    def ensure(self) -> None:
        """The file, at its full size (sparse: blocks are taken as gradients are written)."""
        if self._made:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size != self.size:
                os.ftruncate(fd, self.size)
        finally:
            os.close(fd)
        self._made = True
