"""One layer's training state, and the host optimizer bound to it: what the EPS and every tier share.

A layer's state is one flat FP32 master buffer, its gradient and the optimizer's two moments, all with the
layer kind's :class:`~l2l_cli.engine.flat.FlatLayout`, plus a half-precision send copy under CMP. The host
tier keeps a :class:`LayerState` per layer for the whole run; the disk tier's layers (``DiskLayer``) are
the same state seen through a cache slot. Both bind their optimizers with :func:`bind_optimizer`, so the
update is the same code, bit for bit, whichever tier holds the buffers. This module imports neither the EPS
nor a tier: they import it.

AdamW's update is one host pass (:mod:`~l2l_cli.engine.host_passes`): the received gradient read in the
type it crossed the link in (a half one is never widened into the FP32 buffer), the unscale/clip factor
folded in (skipped at 1), the state read and written once, the device's half copy written from the new
master while it is in cache; the gradient is left as it arrived. L2L-p's undo is a second state set: a
speculative update writes beside the state it reads and flips to it, a rollback flips back, a redo reads
the old set and the kept gradient again (no copy of w, m, v). 8-bit AdamW is one pass per parameter tensor
too (its own ``update``: the gradient as it arrived, the factor, the send copy; an undo is a copy of the
state). LAMB runs as a torch optimizer over the same buffers, in the passes it needs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from l2l_cli.engine.copies import DONE, CopyHandle
from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.host_passes import AdamwStep, HostPasses
from l2l_cli.engine.optim import OptimSettings, bind_flat, optimizer_runs, set_lr


def state_numel(layout: FlatLayout, optim: OptimSettings) -> dict[str, int]:
    """Entries of each state buffer (by short name) for a layer: the sum over its optimizer runs."""
    runs = [hi - lo for _, lo, hi in optimizer_runs(layout, optim.flat_runs)]
    return {b.short: sum(b.numel(n) for n in runs) for b in optim.kind.state}


def _split(layout: FlatLayout, optim: OptimSettings) -> Any:
    # AdamW takes two flat runs per layer (decayed, not): the fused kernel's long runs. LAMB's trust ratio
    # is per parameter tensor, and 8-bit AdamW quantizes each tensor in its own blocks: a view per tensor.
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
    codes: an entry per element of the tensors that keep 8-bit moments) and ``extra`` (8-bit AdamW's
    absmaxes, one per block of each such tensor, and the FP32 moments of its small tensors). Each run takes
    the next slice of each buffer it holds, its elements' (or its blocks')."""
    split = _split(layout, optim)
    flat = {"m": m, "v": v, **(extra or {})}
    if layout.numel == 0:  # a layer with nothing to train (a frozen base's embeddings): one empty run
        empty = {b.key: flat[b.short][:0] for b in optim.kind.state if b.holds(0)}
        return bind_flat([("decay", w, g, empty)], optim)
    grads = dict(split(g))
    runs, at = [], dict.fromkeys(flat, 0)
    for name, view in split(w):
        state = {}
        for b in optim.kind.state:
            if not b.holds(view.numel()):
                continue
            k = b.numel(view.numel())
            part = flat[b.short][at[b.short] : at[b.short] + k]
            state[b.key] = part.view(view.shape) if b.per == 1 else part  # moments shaped as the parameter
            at[b.short] += k
        runs.append((name, view, grads[name], state))
    return bind_flat(runs, optim)


class LayerState:
    """One layer's training state in host memory, and the optimizer that updates it. ``m``/``v``: the two
    moments (FP32, or 8-bit codes); ``extra``: any other state by short name (8-bit AdamW's absmaxes and
    its small tensors' FP32 moments).
    ``w``, ``m`` and ``v`` are the current state set's (L2L-p keeps a second one for its undo)."""

    extra: Mapping[str, torch.Tensor] = MappingProxyType({})
    tensors: list[tuple[int, int, dict, dict]] | None = None  # 8-bit AdamW's tensors (see __init__)

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
        half = send_dtype != torch.float32  # CMP: half copies cross the link; else the master and gradient
        w = acc.host_empty(n, link=not half)  # FP32 master
        self.g = acc.host_empty(n, link=not half).zero_()  # this step's gradient (from the device, reduced)
        sizes = state_numel(layout, optim)
        dtypes = {b.short: getattr(torch, b.dtype) for b in optim.kind.state}
        state = {k: acc.host_empty(sizes[k], dtypes[k]).zero_() for k in sizes}
        m, v = state.pop("m"), state.pop("v")  # optimizer moments (AdamW / LAMB; 8-bit codes)
        # the state sets: [0] always; [1] once L2L-p keeps an undo (``save_undo``); ``cur`` is the live one
        self.sets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = [(w, m, v)]
        self.cur = 0
        if state:
            self.extra = state  # 8-bit AdamW: each block's absmax, the small tensors' FP32 moments
        self.w_send = acc.host_empty(n, send_dtype, link=True) if half else None
        # CMP: the gradient crosses the link in the device's half type; the update reads it as it is (a
        # conversion on the device would need an FP32 temporary there and twice the link's bytes)
        self.g_recv = acc.host_empty(n, send_dtype, link=True) if half else None
        self.widened = False  # this step's half gradient was widened into ``g`` (a tied head added to it)
        self.version = 0  # bumped by every update; the relay reloads a layer whose version moved on
        self.grad_in: CopyHandle = DONE  # the device->host copy of this step's gradient
        self.grad_norm: torch.Tensor | None = None  # its L2 norm, taken on the device before it left
        self.undo: list[torch.Tensor] | None = None  # a torch optimizer's undo log (copies)
        self.undo_step = 0.0
        self._beside = False  # the next update writes beside the live state set (an undo is kept)
        self.passes: HostPasses = acc.host_passes
        self.optimizer = bind_optimizer(layout, w, self.g, m, v, optim, self.extra)
        # AdamW in one pass (``HostPasses.adamw``): each run's (start, end, param group); the torch
        # optimizer then only keeps the step counts and hyper-parameters (checkpoints read them)
        self.fused = _fused_runs(self.optimizer, w) if optim.kind.one_pass else None
        # 8-bit AdamW: each tensor's (start, end, param group, state), updated by the optimizer's own pass
        self.tensors = _fused_runs(self.optimizer, w) if optim.kind.tensor_pass else None
        if self.tensors is not None:
            self.optimizer.passes = self.passes  # type: ignore[attr-defined]

    w = property(lambda self: self.sets[self.cur][0])
    m = property(lambda self: self.sets[self.cur][1])
    v = property(lambda self: self.sets[self.cur][2])

    @property
    def update_keeps_grad(self) -> bool:
        """Whether ``update`` leaves the gradient as it arrived (AdamW in one pass, 8-bit AdamW: a redo
        re-reads it with another factor); a torch optimizer's update scales it in place."""
        return self.fused is not None or self.tensors is not None

    @property
    def moments(self) -> dict[str, torch.Tensor]:
        """The optimizer's flat state by short name (the layer file's keys): m, v and any extra."""
        return {"m": self.m, "v": self.v, **self.extra}

    @property
    def send(self) -> torch.Tensor:
        """What crosses the link to the device: the master, or its half copy under CMP."""
        return self.w if self.w_send is None else self.w_send

    def refresh_send(self) -> None:
        """The send copy rewritten from the master (a pass: read 4 B, write the copy's)."""
        if self.w_send is not None:
            n = self.w.numel()
            self.passes.convert(self.w, self.w_send)
            self.passes.count("refresh", n * (4 + self.w_send.element_size()))

    @property
    def recv(self) -> torch.Tensor:
        """Where the device's gradient lands: the FP32 gradient, or its half receive buffer under CMP."""
        return self.g if self.g_recv is None else self.g_recv

    def receive_grad(self, widen: bool = False) -> None:
        """The gradient has arrived. A half one stays as it is for a one-pass update, unless ``widen`` (it
        is summed with another on the host: a tied head) or the update is a torch optimizer's: then it
        is widened into the FP32 buffer here."""
        self.widened = False
        if self.g_recv is not None and (widen or not self.update_keeps_grad):
            self.passes.convert(self.g_recv, self.g)
            self.passes.count("widen", self.g.numel() * (self.g_recv.element_size() + 4))
            self.widened = True

    @property
    def grad(self) -> torch.Tensor:
        """This step's gradient as the update reads it: the half one as it arrived, or the FP32 buffer."""
        return self.g if self.g_recv is None or self.widened else self.g_recv

    def update(
        self, lr: float, grad_mult: torch.Tensor | float | None, bump: bool = True, refresh: bool = True
    ) -> None:
        """Apply this step's gradient (times ``grad_mult``: unscale and clip) to the master. ``bump``: a
        device copy loaded before is stale now (False: it already holds the rows it reads, see
        ``preview_rows``). ``refresh``: rewrite the send copy from the master now (False: the device may be
        reading the send copy meanwhile; whoever settles the layer refreshes it)."""
        if self.fused is not None:
            self._update_fused(lr, grad_mult, refresh)
        elif self.tensors is not None:
            self._update_tensors(lr, grad_mult, refresh)
        else:
            self._update_torch(lr, grad_mult, refresh)
        if bump:
            self.version += 1

    def _update_fused(self, lr: float, grad_mult: torch.Tensor | float | None, refresh: bool) -> None:
        """AdamW in one pass per run: the gradient as it arrived, the state read from the live set and
        written to it (or, with an undo kept, to the other set, which becomes the live one), the send copy
        from the new master."""
        assert self.fused is not None
        src = self.sets[self.cur]
        beside, self._beside = self._beside, False
        dst = self.sets[1 - self.cur] if beside else src
        send = self.w_send if refresh else None
        g = self.grad
        mult = None if grad_mult is None else float(grad_mult)
        t0 = time.perf_counter()
        for lo, hi, group, state in self.fused:
            state["step"] += 1
            hp = AdamwStep(
                lr,
                group["betas"][0],
                group["betas"][1],
                group["eps"],
                group["weight_decay"],
                float(state["step"]),
            )
            self.passes.adamw(
                g[lo:hi],
                tuple(t[lo:hi] for t in src),  # type: ignore[arg-type]
                tuple(t[lo:hi] for t in dst),  # type: ignore[arg-type]
                None if send is None else send[lo:hi],
                mult,
                hp,
            )
        if beside:
            self.cur = 1 - self.cur
        n = self.layout.numel
        nbytes = n * (g.element_size() + 24 + (send.element_size() if send is not None else 0))
        self.passes.count("update", nbytes, time.perf_counter() - t0)

    def _update_tensors(self, lr: float, grad_mult: torch.Tensor | float | None, refresh: bool) -> None:
        """8-bit AdamW in one pass per parameter tensor (the optimizer's ``update``): the gradient as it
        arrived times the factor, the state in place, the send copy from the new master. Counted as what
        the pass reads and writes: gradient, master (8 B), each moment's entries read and written."""
        assert self.tensors is not None
        send = self.w_send if refresh else None
        g = self.grad
        mult = None if grad_mult is None else float(grad_mult)
        w = self.w
        t0 = time.perf_counter()
        opt = self.optimizer  # (once: a disk layer's sets the step counts it reads)
        for lo, hi, group, state in self.tensors:
            if hi == lo:
                continue
            state["step"] += 1
            b1, b2 = group["betas"]
            hp = AdamwStep(lr, b1, b2, group["eps"], group["weight_decay"], float(state["step"]))
            part = None if send is None else send[lo:hi]
            opt.update(w[lo:hi], g[lo:hi], state, hp, mult, part)  # type: ignore[attr-defined]
        state_bytes = sum(t.nbytes for t in self.moments.values())
        sent = send.nbytes if send is not None else 0
        self.passes.count(
            "update", g.nbytes + 2 * w.nbytes + 2 * state_bytes + sent, time.perf_counter() - t0
        )

    def _update_torch(self, lr: float, grad_mult: torch.Tensor | float | None, refresh: bool) -> None:
        """A torch optimizer's update (LAMB): the gradient scaled in place, the step, the
        send copy rewritten; counted as the passes they make (the step's own as 28 B/param)."""
        n = self.layout.numel
        t0 = time.perf_counter()
        if grad_mult is not None:
            self.g.mul_(grad_mult)
            self.passes.count("scale", n * 8)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        state_bytes = sum(t.element_size() for t in self.moments.values())
        self.passes.count("update", n * (4 + 4 + 4 + 2 * state_bytes), time.perf_counter() - t0)
        if refresh:
            self.refresh_send()

    def preview_rows(
        self, lr: float, grad_mult: torch.Tensor | float | None, rows: dict[str, torch.Tensor]
    ) -> None:
        """Write into the send copy what this step's update will make of the rows a batch reads (``rows``:
        parameter -> row indices; every other parameter whole), leaving the state itself alone: the device
        can load them now while ``update`` computes the whole layer behind it. AdamW is elementwise, so a row
        updated alone equals the same row updated with its table, bit for bit. On the native kernels each
        row is read where it lies, on the EPS's threads; rows the whole update leaves to torch's kernel
        (a run's last few elements), and every row without the kernels, are gathered and updated by
        torch's. (Why not update the rows in place and the rest by range: thousands of row ranges cost
        more than the whole fused update.)"""
        assert self.w_send is not None, "preview_rows writes the send copy: make_send_copy() first"
        step = float(next(iter(self.optimizer.state.values()))["step"])
        group = self.optimizer.param_groups[0]
        decay = max(g["weight_decay"] for g in self.optimizer.param_groups)
        native = self.fused is not None and self.passes.kernel == "native"
        runs = self.fused or []
        starts = torch.tensor([r[0] for r in runs], dtype=torch.long)
        mult = None if grad_mult is None else float(grad_mult)
        g, send = self.grad, self.w_send
        read = gathered = 0
        for lo, hi, width, idx in self.layout.row_blocks(rows):
            if not native:
                gathered += self._preview_torch(lo, hi, width, idx, lr, grad_mult, step, group, decay)
                continue
            which = torch.searchsorted(starts, lo + idx * width, right=True) - 1
            for k in which.unique().tolist():
                rlo, rhi, run_group, state = runs[k]
                sel = idx[which == k]
                alone = lo + (sel + 1) * width <= rhi - (rhi - rlo) % self.passes.vec
                after = float(state["step"]) + 1  # (the whole update counts its step first)
                hp = AdamwStep(lr, *run_group["betas"], run_group["eps"], run_group["weight_decay"], after)
                part = sel[alone].contiguous()
                state_part = (self.w[lo:hi], self.m[lo:hi], self.v[lo:hi])
                self.passes.adamw_rows(g[lo:hi], state_part, send[lo:hi], width, part, mult, hp)
                read += part.numel() * width
                if not bool(alone.all()):
                    rest = sel[~alone]
                    gathered += self._preview_torch(lo, hi, width, rest, lr, grad_mult, step, group, decay)
        # rows read where they lie (gradient, state, the send copy's rows written); gathered rows (gradient
        # and state gathered, their update as torch's, the send copy's rows written)
        self.passes.count("preview", read * (g.element_size() + 12 + send.element_size()))
        self.passes.count("preview", gathered * (g.element_size() + 12 + 28 + 4 + send.element_size()))

    def _preview_torch(
        self,
        lo: int,
        hi: int,
        width: int,
        idx: torch.Tensor,
        lr: float,
        grad_mult: torch.Tensor | float | None,
        step: float,
        group: dict,
        decay: float,
    ) -> int:
        """Rows ``idx`` of the block [lo, hi) (rows of ``width``) gathered, updated by torch's fused AdamW
        and written into the send copy; returns the elements touched."""
        from torch.optim.adamw import adamw

        assert self.w_send is not None
        with torch.no_grad():
            views = [t[lo:hi].view(-1, width) for t in (self.w, self.grad, self.m, self.v)]
            w, g, m, v = (t.index_select(0, idx) for t in views)
            g = g.float()
            if grad_mult is not None:
                g.mul_(grad_mult)
            adamw(
                [w],
                [g],
                [m],
                [v],
                [],
                [torch.tensor(step)],
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
        return idx.numel() * width

    def make_send_copy(self, acc: Accelerator) -> None:
        """A separate send buffer even in FP32 (what the device loads can then run ahead of the master)."""
        if self.w_send is None:
            self.w_send = acc.host_empty(self.w.numel(), link=True)
            self.w_send.copy_(self.w)

    def set_step(self, step: float) -> None:
        """The optimizer's step count for this layer (bias correction), as a checkpoint holds it."""
        for state in self.optimizer.state.values():
            state["step"].fill_(step)

    def save_undo(self, acc: Accelerator) -> None:
        """Keep this layer's pre-update state (L2L-p updates before the step is known to be finite): the
        next update writes beside it (a second state set, made once), or for a torch optimizer, a copy."""
        self.undo_step = float(next(iter(self.optimizer.state.values()))["step"])
        if self.fused is not None:
            if len(self.sets) == 1:
                w, m, v = self.sets[0]
                sent = self.w_send is None  # (FP32: the master itself crosses the link)
                self.sets.append(
                    (
                        acc.host_empty(w.numel(), link=sent),
                        acc.host_empty(m.numel()),
                        acc.host_empty(v.numel()),
                    )
                )
            self._beside = True
            return
        kept = (self.w, *self.moments.values())
        if self.undo is None:
            self.undo = [acc.host_empty(t.numel(), t.dtype) for t in kept]
        for dst, src in zip(self.undo, kept):
            dst.copy_(src)
        self.passes.count("undo", 2 * sum(t.nbytes for t in kept))

    def reserve_redo(self) -> bool:
        """Whether a speculative update of this layer could be redone with another factor: here always (the
        gradient stays in its buffer; the disk tier's layers keep it in a RAM pool, if it has room)."""
        return True

    def restore_undo(self) -> None:
        """Back to the state before the speculative update: the other state set (a switch), or the copies."""
        if self.fused is not None:
            self._beside = False
            self.cur = 1 - self.cur
        else:
            assert self.undo is not None
            for dst, src in zip((self.w, *self.moments.values()), self.undo):
                dst.copy_(src)
            self.passes.count("undo", 2 * sum(t.nbytes for t in self.undo))
        for state in self.optimizer.state.values():
            state["step"].fill_(self.undo_step)
        self.version += 1
        self.refresh_send()

    def nbytes(self) -> dict[str, int]:
        second = sum(t.nbytes for t in self.sets[1]) if len(self.sets) > 1 else 0
        return {
            "master": self.w.nbytes,
            "grads": self.g.nbytes,
            "optimizer_state": sum(t.nbytes for t in self.moments.values()),
            "send_copy": self.w_send.nbytes if self.w_send is not None else 0,
            "recv_copy": self.g_recv.nbytes if self.g_recv is not None else 0,
            "undo_log": second + (sum(t.nbytes for t in self.undo) if self.undo is not None else 0),
        }


def _fused_runs(optimizer: torch.optim.Optimizer, w: torch.Tensor) -> list[tuple[int, int, dict, dict]]:
    """(start, end, param group, state) of each AdamW run bound over ``w`` (views of it)."""
    base, size = w.data_ptr(), w.element_size()
    runs = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            lo = (p.data_ptr() - base) // size if p.numel() else 0
            runs.append((lo, lo + p.numel(), group, optimizer.state[p]))
    return sorted(runs, key=lambda r: r[0])
