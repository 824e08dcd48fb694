"""The relay: device slots that hold the executing layer and the next one, fed from the EPS.

Each slot is one flat weight buffer and one flat gradient buffer on the device, sized for the largest
layer, plus one reusable module per layer type whose parameters are views of the slot. Loading layer
l into a slot is a single host->device copy of the EPS's send buffer; while layer l computes from one
slot, layer l+1 is copied into the other (prefetch), so with enough micro-batches per layer the copy is
hidden (L2L v2 eqs. 4-6). A slot remembers which layer and which version of it it holds, so a layer used
twice in a row (the last block around the turn into backward) is not copied again. A tied LM head's tensor
is the pre layer's: the post layer's slot gets it from the pre layer's copy, and gives its gradient back
separately (engine/tied.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from l2l_cli.engine.device import DONE, Accelerator, AllOf, CopyHandle
from l2l_cli.engine.eps import EagerParamServer
from l2l_cli.models.base import BLOCK, POST, PRE, ModelSpec
from l2l_cli.profiling.timers import PhaseTimer


class Slot:
    def __init__(self, acc: Accelerator, spec: ModelSpec, eps: EagerParamServer, dtype: torch.dtype):
        n = eps.max_layer_numel
        self.w = acc.empty(n, dtype, part="layer_slots")
        # what copies write into: the same storage under a version counter of its own, so reloading a
        # layer does not invalidate a kept graph's saved weights (the layer is back in its slot before
        # that graph's backward: ``Relay.hold``)
        self.w_in = self.w.data
        self.g = acc.empty(n, dtype, part="layer_slots")
        # a frozen base (peft=lora): its weights, dequantized from the EPS's low-bit copy, without gradient
        nf = eps.max_frozen_numel
        self.fw = acc.empty(nf, dtype, part="layer_slots") if nf else None
        self.fw_in = self.fw.data if self.fw is not None else None
        self.base_layer: int | None = None  # whose frozen base the slot holds (it never changes)
        self.shells: dict[str, nn.Module] = {}
        with acc.meter.part("layer_slots"):
            for kind in (PRE, BLOCK, POST):
                layout = eps.layouts[kind]
                shell = spec.new_layer(kind, device="meta")
                layout.bind(shell, self.w[: layout.numel], self.g[: layout.numel])
                if self.fw is not None:
                    frozen = eps.frozen_layouts[kind]
                    frozen.bind(shell, self.fw[: frozen.numel])
                if kind == POST and eps.ties is not None:  # the tied tensors, after the post layer's own
                    tied = slice(layout.numel, eps.device_numel(POST))
                    eps.ties.layout.bind(shell, self.w[tied], self.g[tied])
                self.shells[kind] = spec.materialize(shell, acc.device).to(dtype)
        self.layer: int | None = None
        self.version: Any = -1
        self.loaded: CopyHandle = DONE  # host->device copy of the weights
        self.grads_out: CopyHandle = DONE  # device->host copy of the gradient
        self.released: Any = None  # CUDA event: compute finished with this slot's previous layer


class Relay:
    """``acquire(l, prefetch=next)`` returns the module that runs layer l, and starts copying ``next``."""

    def __init__(
        self, acc: Accelerator, spec: ModelSpec, eps: EagerParamServer, dtype: torch.dtype, prefetch: bool,
        timer: PhaseTimer,
    ):  # fmt: skip
        self.acc, self.spec, self.eps, self.timer = acc, spec, eps, timer
        # the EPS's parts the relay works with: the thread that may still be updating a layer, the tier
        # that holds its buffers
        self.worker, self.tier = eps.worker, eps.tier
        self.prefetch = prefetch
        self.slots = [Slot(acc, spec, eps, dtype) for _ in range(2 if prefetch else 1)]
        self.current: Slot | None = None
        self.loads = 0  # layers copied to the device (for tests and reports)
        self.homes: dict[int, Slot] = {}  # layers whose forward graph is kept -> the slot it references

    def hold(self, i: int) -> None:
        """Layer i (current) keeps its forward's autograd graph until its backward: that graph references
        this slot's parameters, so layer i is reloaded into this slot, not another, until ``let_go(i)``."""
        assert self.current is not None and self.current.layer == i
        self.homes[i] = self.current

    def let_go(self, i: int) -> None:
        self.homes.pop(i, None)

    def _version(self, i: int) -> Any:
        """What a slot's copy of layer i depends on: its own master, and the pre layer's for a tied head."""
        if self.eps.ties is not None and self.spec.kind(i) == POST:
            return (self.eps[i].version, self.eps[0].version)
        return self.eps[i].version

    def _holding(self, i: int) -> Slot | None:
        version = self._version(i)
        for s in self.slots:
            if s.layer == i and s.version == version:
                return s
        return None

    def _load(self, i: int, block: bool = True) -> Slot | None:
        """Start copying layer i into a slot other than the one computing now. A layer the EPS is still
        updating (L2L-p: a rolled-back layer redone behind the forward) is waited for, or with ``block``
        False left for later (a prefetch must not stall the compute it should overlap)."""
        if not self.worker.wait_device(i, block=False):
            if not block:
                return None
            with self.timer("optimizer"):  # the compute thread waits on the EPS
                self.worker.wait_device(i)
        slot = self._holding(i)
        if slot is not None:
            return slot
        home = self.homes.get(i)
        if home is not None:  # a kept graph's layer goes back to the slot its forward ran in
            if home is self.current and not block:
                return None  # not into the slot computing now; the blocking load follows its release
            slot = home
        else:
            slot = next((s for s in self.slots if s is not self.current), self.slots[0])
        st = self.eps[i]
        n = st.layout.numel
        self.tier.pin(i, "w")  # the disk tier: layer i's weights in RAM (read ahead, usually)
        slot.loaded = self.acc.h2d.copy(slot.w_in[:n], st.send, after=slot.released)
        if self.eps.ties is not None and st.kind == POST:
            tied = slot.w_in[n : self.eps.device_numel(POST)]
            self.tier.pin(0, "w")  # the tied tensors are the pre layer's
            ties = self.eps.ties.load(self.acc, tied, self.eps[0].send, slot.released)
            self.tier.unpin(0, after=AllOf(*ties))
            slot.loaded = AllOf(slot.loaded, *ties)
        self.tier.unpin(i, after=slot.loaded)
        if self.eps.base is not None and slot.base_layer != i:
            assert slot.fw_in is not None
            slot.base_layer = None
            n_frozen = self.eps.frozen_layouts[st.kind].numel
            self.eps.base.load(i, slot.fw_in[:n_frozen])  # copied low-bit, dequantized on the device
            slot.base_layer = i
        slot.layer, slot.version = i, self._version(i)
        self.loads += 1
        return slot

    def acquire(self, i: int, *, prefetch: int | None = None, grads: bool = False) -> nn.Module:
        """The module for layer i, its weights on the device. ``grads``: its gradient buffer is zeroed for a
        backward pass (after the previous occupant's gradient has left for the host)."""
        if self.current is not None:
            self.current.released = self.acc.record_event()
        self.acc.meter.mark()
        with self.timer("transfer"):
            slot = self._load(i)
            assert slot is not None
            slot.loaded.wait()
        self.current = slot
        if prefetch is not None and self.prefetch:
            with self.timer("transfer"):
                self._load(prefetch, block=False)
        if grads:
            n = self.eps.device_numel(self.spec.kind(i))
            with self.timer("transfer"):
                slot.grads_out.wait_device()  # the previous occupant's gradient has left (a stream wait on CUDA)
            slot.g[:n].zero_()
        return slot.shells[self.spec.kind(i)]

    def send_grads(self, i: int) -> None:
        """Hand layer i's accumulated gradient to the EPS (asynchronously); the slot is free for reuse."""
        slot = self._holding(i)
        assert slot is not None, f"layer {i} is not on the device"
        st = self.eps[i]
        n = st.layout.numel
        if self.worker.host_busy(i):
            with self.timer("optimizer"):  # its host buffers are still being written (L2L-p)
                self.worker.wait_host(i)
        slot.released = self.acc.record_event()
        with self.timer("transfer"):  # inline on a CPU device; queued on CUDA and the simulator
            self.tier.pin(i, "g", fresh=True)  # a host buffer for it (released by the EPS's job)
            slot.grads_out = st.grad_in = self.acc.d2h.copy(st.recv, slot.g[:n], after=slot.released)
            if self.eps.ties is not None and st.kind == POST:
                tied = slot.g[n : self.eps.device_numel(POST)]
                slot.grads_out = AllOf(st.grad_in, self.eps.ties.send_grads(self.acc, tied, slot.released))

    def train(self, mode: bool) -> None:
        for s in self.slots:
            for shell in s.shells.values():
                shell.train(mode)
