"""The disk tier's update buffer: one layer's optimizer state while it is updated, its two moment parts
[m | v] laid out as the layer files' (:func:`~.layout.moment_layout`: FP32 moments, or 8-bit AdamW's
codes, absmaxes and small tensors' FP32 moments), and the typed views the optimizer is bound to."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.optim import OptimSettings, optimizer_runs
from l2l_cli.engine.tiers.disk.format import AlignedBuffer
from l2l_cli.engine.tiers.disk.layout import MOMENTS, Piece, moment_layout


def state_pieces(layouts: dict[str, FlatLayout], optim: OptimSettings) -> dict[str, dict[str, list[Piece]]]:
    """Each layer kind's optimizer state in the moment parts (:func:`~.layout.moment_layout` over the kind's
    optimizer runs)."""
    return {
        kind: moment_layout([hi - lo for _, lo, hi in optimizer_runs(lay, optim.flat_runs)], optim.kind.state)
        for kind, lay in layouts.items()
    }


class UpdateBuffer:
    """One layer's moments [m | v], page-aligned, for the layers of ``moments`` (each moment part's bytes, the
    largest layer's: FP32 moments, or the optimizer's state buffers, :func:`~.layout.moment_layout`); held by
    the slot of the layer being updated (``holder``) while its update and write-back use it."""

    def __init__(self, index: int, moments: dict[str, int], acc: Accelerator):
        self.index = index
        self.part_bytes = dict(moments)
        self._at = {p: sum(moments[q] for q in MOMENTS[:k]) for k, p in enumerate(MOMENTS)}
        self.buf = AlignedBuffer(sum(moments.values()), acc)
        # the parts as FP32 (format 2's master join reads v's sign bits; a new layer's moments are zeroed)
        self.f32 = {
            p: self.buf.tensor[self._at[p] : self._at[p] + moments[p]].view(torch.float32) for p in MOMENTS
        }
        self.holder: Any = None  # the cache slot holding it (a ``cache.CacheSlot``), or None
        self.writing: Future | None = None  # the last write-back that reads it (a read into it waits)

    def view(self, part: str, nbytes: int) -> memoryview:
        return self.buf.view(self._at[part], nbytes)

    def state(self, pieces: dict[str, list[Piece]]) -> dict[str, torch.Tensor]:
        """The optimizer's state buffers by short name, as views of the moment parts laid out as
        ``pieces``."""
        t = self.buf.tensor
        out = {}
        for p, xs in pieces.items():
            for short, dtype, off, k in xs:
                dt = getattr(torch, dtype)
                a = self._at[p] + off
                out[short] = t[a : a + k * dt.itemsize].view(dt)
        return out

    @property
    def nbytes(self) -> int:
        return self.buf.tensor.nbytes
