"""One layer's training state, and the host optimizer bound to it: what the EPS and every tier share.

A layer's state is one flat FP32 master buffer, its gradient and the optimizer's two moments, all with the
layer kind's :class:`~l2l_cli.engine.flat.FlatLayout`, plus a half-precision send copy under CMP. The host
tier keeps a :class:`LayerState` per layer for the whole run; the disk tier's layers (``DiskLayer``) are
the same state seen through a cache slot. Both bind their optimizers with :func:`bind_optimizer`, so the
update is the same code, bit for bit, whichever tier holds the buffers. This module imports neither the EPS
nor a tier: they import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from l2l_cli.engine.copies import DONE, CopyHandle
from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.optim import OptimSettings, bind_flat, optimizer_runs, set_lr


def state_numel(layout: FlatLayout, optim: OptimSettings) -> dict[str, int]:
    """Entries of each state buffer (by short name) for a layer: the sum over its optimizer runs."""
    runs = [hi - lo for _, lo, hi in optimizer_runs(layout, optim.flat_runs)]
    return {b.short: sum(b.numel(n) for n in runs) for b in optim.kind.state}


def _split(layout: FlatLayout, optim: OptimSettings) -> Any:
    # AdamW (FP32 or 8-bit) takes two flat runs per layer (decayed, not): the fused kernel's long runs, the
    # 8-bit one's blocks. LAMB's trust ratio is per parameter tensor, so it gets a view per tensor.
    return layout.segments if optim.flat_runs else layout.views


def bind_optimizer(
    layout: FlatLayout,
    w: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    optim: OptimSettings,
    extra: Mapping[str, torch.Tensor] | None = None,
) -> torch.optim.Optimizer:
    """The host optimizer of one layer, working in place on flat buffers: parameters are views of ``w``
    with ``.grad`` views of ``g``, and their state views of the flat state buffers, by the kind's
    :class:`~l2l_cli.engine.optim.StateBuffer` short names: the two moments ``m`` and ``v`` (FP32, or 8-bit
    codes: an entry per element) and ``extra`` (8-bit AdamW's absmaxes: one per block of each run). Each
    run takes the next slice of each buffer, its elements' (or its blocks')."""
    split = _split(layout, optim)
    flat = {"m": m, "v": v, **(extra or {})}
    if layout.numel == 0:  # a layer with nothing to train (a frozen base's embeddings): one empty run
        return bind_flat([("decay", w, g, {b.key: flat[b.short][:0] for b in optim.kind.state})], optim)
    grads = dict(split(g))
    runs, at = [], dict.fromkeys(flat, 0)
    for name, view in split(w):
        state = {}
        for b in optim.kind.state:
            k = b.numel(view.numel())
            part = flat[b.short][at[b.short] : at[b.short] + k]
            state[b.key] = part.view(view.shape) if b.per == 1 else part  # moments shaped as the parameter
            at[b.short] += k
        runs.append((name, view, grads[name], state))
    return bind_flat(runs, optim)


class LayerState:
    """One layer's training state in host memory, and the optimizer that updates it. ``m``/``v``: the two
    moments (FP32, or 8-bit codes); ``extra``: any other state by short name (8-bit AdamW's absmaxes)."""

    extra: Mapping[str, torch.Tensor] = MappingProxyType({})

    def __init__(
        self,
        index: int,
        kind: str,
        layout: FlatLayout,
        acc: Accelerator,
        send_dtype: torch.dtype,
        optim: OptimSettings,
    ):
        n = layout.numel
        self.index, self.kind, self.layout = index, kind, layout
        self.w = acc.host_empty(n)  # FP32 master
        self.g = acc.host_empty(n).zero_()  # this step's gradient (copied from the device, reduced)
        sizes = state_numel(layout, optim)
        dtypes = {b.short: getattr(torch, b.dtype) for b in optim.kind.state}
        state = {k: acc.host_empty(sizes[k], dtypes[k]).zero_() for k in sizes}
        self.m, self.v = state.pop("m"), state.pop("v")  # optimizer moments (AdamW / LAMB; 8-bit codes)
        if state:
            self.extra = state  # 8-bit AdamW: each block's absmax
        self.w_send = acc.host_empty(n, send_dtype) if send_dtype != torch.float32 else None
        # CMP: the gradient crosses the link in the device's half type and becomes FP32 here, on the host
        # (a conversion on the device would need an FP32 temporary there and twice the link's bytes)
        self.g_recv = acc.host_empty(n, send_dtype) if send_dtype != torch.float32 else None
        self.version = 0  # bumped by every update; the relay reloads a layer whose version moved on
        self.grad_in: CopyHandle = DONE  # the device->host copy of this step's gradient
        self.undo: list[torch.Tensor] | None = None
        self.undo_step = 0.0
        self.optimizer = bind_optimizer(layout, self.w, self.g, self.m, self.v, optim, self.extra)

    @property
    def moments(self) -> dict[str, torch.Tensor]:
        """The optimizer's flat state by short name (the layer file's keys): m, v and any extra."""
        return {"m": self.m, "v": self.v, **self.extra}

    @property
    def send(self) -> torch.Tensor:
        """What crosses the link to the device: the master, or its half copy under CMP."""
        return self.w if self.w_send is None else self.w_send

    def refresh_send(self) -> None:
        if self.w_send is not None:
            self.w_send.copy_(self.w)

    @property
    def recv(self) -> torch.Tensor:
        """Where the device's gradient lands: the FP32 gradient, or its half receive buffer under CMP."""
        return self.g if self.g_recv is None else self.g_recv

    def receive_grad(self) -> None:
        """The gradient has arrived: widen a half one to FP32 (on the host, off the device)."""
        if self.g_recv is not None:
            self.g.copy_(self.g_recv)

    def update(
        self, lr: float, grad_mult: torch.Tensor | float | None, bump: bool = True, refresh: bool = True
    ) -> None:
        """Apply this step's gradient (times ``grad_mult``: unscale and clip) to the master. ``bump``: a
        device copy loaded before is stale now (False: it already holds the rows it reads, see
        ``preview_rows``). ``refresh``: rewrite the send copy from the master now (False: the device may be
        reading the send copy meanwhile; whoever settles the layer refreshes it)."""
        if grad_mult is not None:
            self.g.mul_(grad_mult)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        if bump:
            self.version += 1
        if refresh:
            self.refresh_send()

    def preview_rows(
        self, lr: float, grad_mult: torch.Tensor | float | None, rows: dict[str, torch.Tensor]
    ) -> None:
        """Write into the send copy what this step's update will make of the rows a batch reads (``rows``:
        parameter -> row indices; every other parameter whole), leaving the state itself alone: the device
        can load them now while ``update`` computes the whole layer behind it. AdamW is elementwise, so a row
        updated alone equals the same row updated with its table, bit for bit. (Why not update the rows in
        place and the rest by range: thousands of row ranges cost more than the whole fused update.)"""
        from torch.optim.adamw import adamw

        assert self.w_send is not None, "preview_rows writes the send copy: make_send_copy() first"
        step = next(iter(self.optimizer.state.values()))["step"]
        group = self.optimizer.param_groups[0]
        decay = max(g["weight_decay"] for g in self.optimizer.param_groups)
        with torch.no_grad():
            for lo, hi, width, idx in self.layout.row_blocks(rows):
                views = [t[lo:hi].view(-1, width) for t in (self.w, self.g, self.m, self.v)]
                w, g, m, v = (t.index_select(0, idx) for t in views)
                if grad_mult is not None:
                    g.mul_(grad_mult)
                adamw(
                    [w],
                    [g],
                    [m],
                    [v],
                    [],
                    [step.clone()],
                    fused=True,
                    amsgrad=False,
                    beta1=group["betas"][0],
                    beta2=group["betas"][1],
                    lr=lr,
                    weight_decay=decay if lo < self.layout.n_decay else 0.0,
                    eps=group["eps"],
                    maximize=False,
                )
                self.w_send[lo:hi].view(-1, width).index_copy_(0, idx, w.to(self.w_send.dtype))

    def make_send_copy(self, acc: Accelerator) -> None:
        """A separate send buffer even in FP32 (what the device loads can then run ahead of the master)."""
        if self.w_send is None:
            self.w_send = acc.host_empty(self.w.numel())
            self.w_send.copy_(self.w)

    def set_step(self, step: float) -> None:
        """The optimizer's step count for this layer (bias correction), as a checkpoint holds it."""
        for state in self.optimizer.state.values():
            state["step"].fill_(step)

    def save_undo(self, acc: Accelerator) -> None:
        """Keep this layer's pre-update state (L2L-p updates before the step is known to be finite)."""
        kept = (self.w, *self.moments.values())
        if self.undo is None:
            self.undo = [acc.host_empty(t.numel(), t.dtype) for t in kept]
        for dst, src in zip(self.undo, kept):
            dst.copy_(src)
        self.undo_step = float(next(iter(self.optimizer.state.values()))["step"])

    def reserve_redo(self) -> bool:
        """Whether a speculative update of this layer could be redone with another factor: here always (the
        gradient stays in its buffer; the disk tier's layers keep it in a RAM pool, if it has room)."""
        return True

    def restore_undo(self) -> None:
        assert self.undo is not None
        for dst, src in zip((self.w, *self.moments.values()), self.undo):
            dst.copy_(src)
        for state in self.optimizer.state.values():
            state["step"].fill_(self.undo_step)
        self.version += 1
        self.refresh_send()

    def nbytes(self) -> dict[str, int]:
        return {
            "master": self.w.nbytes,
            "grads": self.g.nbytes,
            "optimizer_state": sum(t.nbytes for t in self.moments.values()),
            "send_copy": self.w_send.nbytes if self.w_send is not None else 0,
            "recv_copy": self.g_recv.nbytes if self.g_recv is not None else 0,
            "undo_log": sum(t.nbytes for t in self.undo) if self.undo is not None else 0,
        }
