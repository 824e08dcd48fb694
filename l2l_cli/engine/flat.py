"""Flat per-layer buffers: one contiguous tensor holds all of a layer's parameters, in a fixed order.

The eager param-server keeps each layer's master weights, gradients and optimizer moments in flat host
buffers with this layout, and the relay's device slots use the same layout, so moving a layer is a
single copy. Modules never own storage here: ``bind`` makes their parameters views of a flat buffer
("a flexible encoder layer that receives each layer's weights", L2L v2 §2.1).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import nn

from l2l_cli.engine.optim import no_decay


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


class FlatLayout:
    """Where each parameter of a layer type sits in its flat buffer (weight-decayed ones first).

    ``skip``: parameters left out (a tied LM head: the pre layer owns that tensor); ``only``: just these
    (the tied ones, laid out after the layer's own in a device slot)."""

    def __init__(self, module: nn.Module, *, skip: Collection[str] = (), only: Collection[str] | None = None):
        named = [
            (n, p) for n, p in module.named_parameters() if n not in skip and (only is None or n in only)
        ]
        ordered = [x for x in named if not no_decay(x[0])] + [x for x in named if no_decay(x[0])]
        entries, offset = [], 0
        for name, p in ordered:
            entries.append(Entry(name, tuple(p.shape), offset, p.numel()))
            offset += p.numel()
        self.entries: tuple[Entry, ...] = tuple(entries)
        self.numel = offset
        self.n_decay = sum(p.numel() for name, p in ordered if not no_decay(name))  # the decayed prefix

    def segments(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The flat buffer as its two contiguous optimizer groups: weight-decayed, then not."""
        return [
            (n, t) for n, t in (("decay", flat[: self.n_decay]), ("bias", flat[self.n_decay :])) if t.numel()
        ]

    def views(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(name, view of ``flat``) per parameter, in layout order."""
        return [(e.name, flat[e.offset : e.offset + e.numel].view(e.shape)) for e in self.entries]

    @torch.no_grad()
    def pack(self, module: nn.Module, flat: torch.Tensor) -> None:
        """Copy ``module``'s parameters into ``flat`` (any dtype; cast on copy)."""
        params = dict(module.named_parameters())
        for name, view in self.views(flat):
            view.copy_(params[name])

    def row_blocks(self, rows: dict[str, torch.Tensor]) -> list[tuple[int, int, int, torch.Tensor]]:
        """The flat buffer as 2-D blocks of rows and the rows a batch reads from each: ``rows`` names the
        parameters read only in part (embedding tables: row indices, dim 0); the others are read whole (a
        1-D parameter is one row). Adjacent parameters of one row width and one optimizer group share a
        block, so a few gathers cover a whole layer. Returns (start, end, width, sorted unique row indices
        within the block) per block."""
        blocks: list[tuple[int, int, int, list[torch.Tensor]]] = []
        for e in self.entries:
            n_rows = e.shape[0] if len(e.shape) > 1 else 1
            width = e.numel // n_rows
            idx = rows.get(e.name)
            idx = torch.arange(n_rows) if idx is None else idx.reshape(-1).to("cpu", torch.long)
            last = blocks[-1] if blocks else None
            same_group = last is not None and (last[1] <= self.n_decay) == (e.offset < self.n_decay)
            if last is not None and last[1] == e.offset and last[2] == width and same_group:
                base = (e.offset - last[0]) // width
                blocks[-1] = (last[0], e.offset + e.numel, width, [*last[3], idx + base])
            else:
                blocks.append((e.offset, e.offset + e.numel, width, [idx]))
        return [(lo, hi, width, torch.unique(torch.cat(ix))) for lo, hi, width, ix in blocks]

    def bind(self, module: nn.Module, w: torch.Tensor, g: torch.Tensor | None = None) -> nn.Module:
        """Make ``module``'s parameters views of ``w`` (and their ``.grad`` views of ``g``, so autograd
        accumulates every micro-batch's gradient in place, straight into the flat buffer)."""
        grads = dict(self.views(g)) if g is not None else {}
        for name, view in self.views(w):
            owner, _, leaf = name.rpartition(".")
            p = nn.Parameter(view, requires_grad=g is not None)
            if g is not None:
                p.grad = grads[name]
            module.get_submodule(owner)._parameters[leaf] = p
        return module
