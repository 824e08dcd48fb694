"""A layer of the disk tier, as the EPS sees it: a :class:`LayerState` whose buffers are a cache slot's."""

from __future__ import annotations

from typing import Protocol

import torch

from l2l_cli.engine.copies import DONE, CopyHandle
from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.host_passes import HostPasses
from l2l_cli.engine.layer_state import LayerState, _fused_runs
from l2l_cli.engine.tiers.disk.cache import CacheSlot


class LayerHome(Protocol):
    """What a disk layer asks of its tier (the :class:`~l2l_cli.engine.tiers.disk.tier.DiskTier`)."""

    @property
    def latest(self) -> list[int | None]: ...  # each layer's file slot holding its newest version

    def slot_of(self, i: int) -> CacheSlot | None: ...

    def restore(self, st: DiskLayer) -> None: ...

    def reserve_grad(self, i: int) -> bool: ...

    def keep_grad(self, i: int, g: torch.Tensor) -> None: ...


class DiskLayer(LayerState):
    """A layer whose state lives in its file. While the tier has it pinned, ``w``/``g``/``m``/``v`` and
    ``optimizer`` are those of the cache slot it occupies; touching them unpinned is a bug and raises. Its
    update is in place (the undo is the file's other slot), on a gradient widened to FP32 as it arrives
    (a kept gradient is an FP32 one)."""

    cur = 0
    _beside = False
    widened = True

    def __init__(
        self,
        tier: LayerHome,
        index: int,
        kind: str,
        layout: FlatLayout,
        passes: HostPasses,
        one_pass: bool,
        tensor_pass: bool = False,
    ):
        self.tier, self.index, self.kind, self.layout = tier, index, kind, layout
        self.passes = passes
        self.one_pass = one_pass  # the optimizer's update is one host pass (``OptimizerKind.one_pass``)
        self.tensor_pass = tensor_pass  # the optimizer's own pass per tensor (8-bit AdamW)
        self.version = 0
        self.grad_in: CopyHandle = DONE
        self.grad_norm: torch.Tensor | None = None
        self.opt_step = 0.0  # the optimizer's step count for this layer (committed with the layer)
        self.undo: list[torch.Tensor] | None = None
        self.undo_step = 0.0
        self.undo_slot: int | None = None
        self._keep = False  # the next update keeps its gradient (in the tier's pool) for a redo
        self.kept_grad = False  # the pool holds this step's gradient, as the speculative update left it

    def _slot(self) -> CacheSlot:
        s = self.tier.slot_of(self.index)
        if s is None:
            raise RuntimeError(f"layer {self.index} is not in the host cache (touched without a pin)")
        return s

    def _part(self, p: str) -> torch.Tensor:
        f = self._slot().f32
        if p not in f:
            raise RuntimeError(f"layer {self.index}'s {p} is not in RAM (its moments are pinned for updates)")
        return f[p][: self.layout.numel]

    def _state(self) -> dict[str, torch.Tensor]:
        s = self._slot()
        if s.mom is None:
            raise RuntimeError(f"layer {self.index}'s moments are not in RAM (pinned without them)")
        return s.state(self.kind)

    w = property(lambda self: self._part("w"))  # type: ignore[assignment]
    g = property(lambda self: self._part("g"))  # type: ignore[assignment]
    m = property(lambda self: self._state()["m"])  # type: ignore[assignment]
    v = property(lambda self: self._state()["v"])  # type: ignore[assignment]

    @property  # type: ignore[override]
    def extra(self) -> dict[str, torch.Tensor]:
        """The optimizer's state beyond m and v (8-bit AdamW's absmaxes, its small tensors' FP32 moments)."""
        st = self._state()
        return {k: t for k, t in st.items() if k not in ("m", "v")}

    @property  # type: ignore[override]
    def moments(self) -> dict[str, torch.Tensor]:
        return self._state()

    @property  # type: ignore[override]
    def w_send(self) -> torch.Tensor | None:
        s = self._slot()
        return s.w_send[: self.layout.numel] if s.w_send is not None else None

    @property  # type: ignore[override]
    def g_recv(self) -> torch.Tensor | None:
        s = self._slot()
        return s.g_recv[: self.layout.numel] if s.g_recv is not None else None

    @property  # type: ignore[override]
    def sets(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return [(self.w, self.m, self.v)]

    @property  # type: ignore[override]
    def fused(self) -> list[tuple[int, int, dict, dict]] | None:
        """AdamW's runs over the cache slot's buffers (None: a torch optimizer's update)."""
        return _fused_runs(self.optimizer, self.w) if self.one_pass else None

    @property  # type: ignore[override]
    def tensors(self) -> list[tuple[int, int, dict, dict]] | None:
        """8-bit AdamW's tensors over the cache slot's buffers (None: another optimizer)."""
        return _fused_runs(self.optimizer, self.w) if self.tensor_pass else None

    @property
    def update_keeps_grad(self) -> bool:
        return self.one_pass or self.tensor_pass

    def receive_grad(self, widen: bool = True) -> None:
        super().receive_grad(widen=True)

    @property  # type: ignore[override]
    def optimizer(self) -> torch.optim.Optimizer:
        """The cache slot's optimizer for this layer's kind, its step count set to this layer's."""
        opt = self._slot().optimizer(self.kind)
        for state in opt.state.values():
            state["step"].fill_(self.opt_step)
        if self.tensor_pass:
            opt.passes = self.passes  # type: ignore[attr-defined]  (8-bit AdamW: the EPS's host passes)
        return opt

    def update(
        self, lr: float, grad_mult: torch.Tensor | float | None, bump: bool = True, refresh: bool = True
    ) -> None:
        super().update(lr, grad_mult, bump, refresh)
        opt = self._slot().optimizer(self.kind)
        self.opt_step = float(next(iter(opt.state.values()))["step"])
        if self._keep:  # the gradient as the update left it (unscaled), which a redo multiplies by the factor
            self.tier.keep_grad(self.index, self.g)
            self._keep, self.kept_grad = False, True

    def reserve_redo(self) -> bool:
        """Whether a speculative update of this layer could be redone: always, the gradient it consumes is
        kept until the verdict, in the tier's RAM pool if a buffer is free (``eps.grad_ram_layers``), else
        on disk (``kept_grads.eps``)."""
        self._keep = self.tier.reserve_grad(self.index)
        self.kept_grad = False
        return self._keep

    def set_step(self, step: float) -> None:
        self.opt_step = step

    def save_undo(self, acc: Accelerator) -> None:
        """Nothing to copy: the pre-update state stays on disk, in the slot the update does not overwrite."""
        self.undo_slot = self.tier.latest[self.index]
        self.undo_step = self.opt_step

    def restore_undo(self) -> None:
        self.tier.restore(self)
        self.version += 1

    def nbytes(self) -> dict[str, int]:
        return {}  # the cache's bytes are the tier's (``host_parts``)
