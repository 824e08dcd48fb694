"""The activation stash: each layer's input (the previous layer's output), per micro-batch, kept from the
forward pass until that layer is recomputed in backward. On the device (L2L) or in host memory held by
the EPS (``mode.stash=cpu``), which makes the device footprint constant in depth (L2L v2 Table 4)."""

from __future__ import annotations

import torch

from l2l_cli.engine.copies import DONE, CopyHandle
from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.eps import EagerParamServer
from l2l_cli.profiling.timers import PhaseTimer


class DeviceStash:
    def __init__(self, acc: Accelerator, timer: PhaseTimer):
        self.acc, self.timer = acc, timer
        self._store: dict[tuple[int, int], torch.Tensor] = {}

    def put(self, layer: int, ubatch: int, x: torch.Tensor) -> None:
        self.acc.meter.tag(x, "stash")
        self._store[layer, ubatch] = x

    def prefetch(self, layer: int, ubatch: int) -> None:
        return None

    def pop(self, layer: int, ubatch: int) -> torch.Tensor:
        return self._store.pop((layer, ubatch))


class CpuStash:
    """Stash in host memory: ``put`` copies device->host in the background, ``prefetch`` copies back ahead
    of the recompute that needs it, ``pop`` waits for that copy (the wait is exposed transfer time). The host
    buffers are the EPS's (pinned on CUDA hosts) and reused step after step."""

    def __init__(self, acc: Accelerator, eps: EagerParamServer, timer: PhaseTimer):
        self.acc, self.eps, self.timer = acc, eps, timer
        self._host: dict[tuple[int, int], torch.Tensor] = {}  # reusable host buffers (grown on demand)
        self._out: dict[tuple[int, int], tuple[torch.Tensor, torch.Size, CopyHandle]] = {}
        self._back: dict[tuple[int, int], tuple[torch.Tensor, CopyHandle]] = {}

    def put(self, layer: int, ubatch: int, x: torch.Tensor) -> None:
        key = (layer, ubatch)
        buf = self._host.get(key)
        if buf is None or buf.numel() < x.numel() or buf.dtype != x.dtype:
            with self.acc.meter.paused():
                buf = self._host[key] = self.eps.host_buffer(x.numel(), x.dtype)
        view = buf[: x.numel()].view(x.shape)
        with self.timer("transfer"):
            self._out[key] = (view, x.shape, self.acc.d2h.copy(view, x))

    def prefetch(self, layer: int, ubatch: int) -> None:
        key = (layer, ubatch)
        if key in self._back or key not in self._out:
            return
        view, shape, out = self._out.pop(key)
        with self.timer("transfer"):
            x = self.acc.empty(view.numel(), view.dtype, part="stash").view(shape)
            # its trip out must land before it comes back: an event dependency between the copy engines
            # (a stream wait on CUDA), not a host wait per micro-batch
            self._back[key] = (x, self.acc.h2d.copy(x, view, after=out))

    def pop(self, layer: int, ubatch: int) -> torch.Tensor:
        self.prefetch(layer, ubatch)
        x, h = self._back.pop((layer, ubatch))
        with self.timer("transfer"):
            h.wait()
        return x


__all__ = ["DONE", "CpuStash", "DeviceStash"]
