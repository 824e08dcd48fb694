"""The relay: device slots that hold the executing layer and the next one, fed from the EPS.

The slots share one flat weight buffer and one flat gradient buffer on the device (and one for a frozen
base), each allocated once: a layer loads at one end of a buffer and the next layer at the other end, so
a buffer needs the largest sum of two layers next to each other in the layer order, not twice the largest
layer (a GPT-2's tied head and its embeddings are never neighbours: the blocks lie between them). Where
copies are done inline (a CPU device, whose "device" buffers are RAM) a gradient has left before the next
is computed, so the gradient buffer is one layer's, the largest. Each end
has one reusable module per layer type whose parameters are views of that end. Loading layer l is a single
host->device copy of the EPS's send buffer; while layer l computes at one end, layer l+1 is copied to the
other (prefetch), so with enough micro-batches per layer the copy is hidden (L2L v2 eqs. 4-6). A pair of
layers that are not neighbours may not fit beside each other (the head, then the embeddings of the next
evaluation batch): that load waits until the layer computing now is done and overwrites it, never a layer in
use. An end remembers which layer and which version of it it holds, so a layer used twice in a row (the last
block around the turn into backward) is not copied again. A tied LM head's tensor is the pre layer's: the
post layer's slot gets it from the pre layer's copy, and gives its gradient back separately
(engine/tied.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from l2l_cli.engine.copies import DONE, AllOf, CopyHandle
from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.eps import EagerParamServer
from l2l_cli.engine.optim import flat_norm
from l2l_cli.models.base import BLOCK, POST, PRE, ModelSpec
from l2l_cli.profiling.timers import PhaseTimer

KINDS = (PRE, BLOCK, POST)
ALIGN = 64  # elements: a layer at either end of a buffer starts 256 B-aligned (fp32), as a fresh buffer does


def aligned(n: int) -> int:
    """``n`` elements rounded up to ``ALIGN``: the room a layer takes at an end of a relay buffer."""
    return -(-n // ALIGN) * ALIGN


def pair_numel(numels: Sequence[int], prefetch: bool) -> int:
    """Elements a relay buffer needs for layers of ``numels`` elements in this order: the largest layer
    (one slot), or with prefetch the largest sum of two neighbours (forward and backward visit the same
    neighbours), at least the largest layer."""
    if not numels:
        return 0
    most = max(numels)
    if not prefetch:
        return most
    return max([most, *(a + b for a, b in pairwise(numels))])


class Slot:
    """One end of the relay's buffers: per layer kind, the views a layer of that kind occupies (from the
    buffer's start at end 0, ending at the buffer's end at end 1) and a module bound to them."""

    def __init__(self, relay: Relay, end: int, spec: ModelSpec, eps: EagerParamServer, dtype: torch.dtype):
        acc = relay.acc

        def span(n: int, total: int) -> slice:
            start = 0 if end == 0 else total - aligned(n)
            return slice(start, start + n)

        self.end = end
        # the kinds this relay loads (a pipeline rank may hold no pre or post layer): only they fit the buffer
        self.spans = {k: span(relay.numel[k], relay.w.numel()) for k in relay.kinds}
        # copies write through ``w_in``: the same storage under a version counter of its own, so reloading a
        # layer does not invalidate a kept graph's saved weights (the layer is back in its slot before that
        # graph's backward: ``Relay.hold``)
        self.w_of = {k: relay.w[s] for k, s in self.spans.items()}
        self.w_in_of = {k: relay.w_in[s] for k, s in self.spans.items()}
        # gradients copied out inline (a CPU device): one buffer from the start serves both ends
        self.g_of = {
            k: relay.g[s if relay.two_grads else slice(0, relay.numel[k])] for k, s in self.spans.items()
        }
        # a frozen base (peft=lora): its weights, dequantized from the EPS's low-bit copy, without gradient
        self.fw_in_of: dict[str, torch.Tensor] = {}
        self.base_layer: int | None = None  # whose frozen base the slot holds (it never changes)
        self.shells: dict[str, nn.Module] = {}
        with acc.meter.part("layer_slots"):
            # the norm of the gradient it sends, in a buffer of its own: one per slot at any depth
            self.norm = torch.zeros(1, dtype=torch.float32, device=acc.device)
            for kind in relay.kinds:
                layout = eps.layouts[kind]
                shell = spec.new_layer(kind, device="meta")
                w, g = self.w_of[kind], self.g_of[kind]
                layout.bind(shell, w[: layout.numel], g[: layout.numel])
                if relay.fw is not None:
                    frozen = eps.frozen_layouts[kind]
                    fw = relay.fw[span(frozen.numel, relay.fw.numel())]
                    frozen.bind(shell, fw)
                    self.fw_in_of[kind] = fw.data
                if kind == POST and eps.ties is not None:  # the tied tensors, after the post layer's own
                    eps.ties.layout.bind(shell, w[layout.numel :], g[layout.numel :])
                self.shells[kind] = spec.materialize(shell, acc.device).to(dtype)
        # its views' kind (the occupant's) until a layer loads: the larger end layer it loads, else a block
        ends = [k for k in (PRE, POST) if k in relay.kinds] or relay.kinds
        self.kind = max(ends, key=lambda k: relay.numel[k])
        self.layer: int | None = None
        self.version: Any = -1
        self.loaded: CopyHandle = DONE  # host->device copy of the weights
        self.grads_out: CopyHandle = DONE  # device->host copy of the gradient
        self.grads_kind = self.kind  # the kind of the layer whose gradient ``grads_out`` reads
        self.released: Any = None  # CUDA event: compute finished with this slot's previous layer

    @property
    def w(self) -> torch.Tensor:
        """The weights of the layer it holds (or last held)."""
        return self.w_of[self.kind]

    @property
    def g(self) -> torch.Tensor:
        """The gradient buffer of the layer it holds (or last held)."""
        return self.g_of[self.kind]

    def forget(self) -> None:
        """Its layer was overwritten (in part) by one loaded at the other end."""
        self.layer, self.version, self.base_layer = None, -1, None


class Relay:
    """``acquire(l, prefetch=next)`` returns the module that runs layer l, and starts copying ``next``."""

    def __init__(
        self,
        acc: Accelerator,
        spec: ModelSpec,
        eps: EagerParamServer,
        dtype: torch.dtype,
        prefetch: bool,
        timer: PhaseTimer,
    ):
        self.acc, self.spec, self.eps, self.timer = acc, spec, eps, timer
        # the EPS's parts the relay works with: the thread that may still be updating a layer, the tier
        # that holds its buffers
        self.worker, self.tier = eps.worker, eps.tier
        self.prefetch = prefetch
        order = [st.kind for st in eps.layers]  # the layers in the order a forward visits them
        self.kinds = [k for k in KINDS if k in order]
        self.numel = {k: eps.device_numel(k) for k in KINDS}
        self.frozen_numel = {k: eps.frozen_layouts[k].numel if k in eps.frozen_layouts else 0 for k in KINDS}
        n = pair_numel([aligned(self.numel[k]) for k in order], prefetch)
        nf = pair_numel([aligned(self.frozen_numel[k]) for k in order], prefetch)
        self.w = acc.empty(n, dtype, part="layer_slots")
        self.w_in = self.w.data
        # a gradient leaving for the host while the next layer's is computed needs its own elements, unless
        # the copy is done at once (a CPU device): then one layer's gradient at a time
        self.two_grads = prefetch and not acc.copies_inline
        most = max((self.numel[k] for k in order), default=0)
        self.g = acc.empty(n if self.two_grads else most, dtype, part="layer_slots")
        self.fw = acc.empty(nf, dtype, part="layer_slots") if nf else None
        self.slots = [Slot(self, end, spec, eps, dtype) for end in range(2 if prefetch else 1)]
        self.current: Slot | None = None
        self.loads = 0  # layers copied to the device (for tests and reports)
        self.waits = 0  # loads that waited for the layer computing now (it did not fit beside it)
        # layer weights in and gradients out over the link while training (eps.transfer_bytes_per_param)
        self.transfer_bytes = 0
        self.training = True
        # each layer's gradient norm lands in a host scalar beside its gradient (pinned where copies are
        # asynchronous); one per layer, reused every step
        self._norm_host = [acc.host_empty(1, link=True) for _ in range(len(eps.layers))]
        self.graph_slots: dict[int, Slot] = {}  # layers whose forward graph is kept -> the slot it references

    @property
    def device_bytes(self) -> int:
        """The relay's device buffers: weights, gradients and a frozen base, for every slot together, and
        each slot's gradient norm."""
        norms = sum(s.norm.nbytes for s in self.slots)
        return norms + sum(t.nbytes for t in (self.w, self.g, self.fw) if t is not None)

    def _overlap(self, a: str, b: str, frozen: bool = True) -> bool:
        """Whether a layer of kind ``a`` at one end and one of kind ``b`` at the other share elements."""
        if aligned(self.numel[a]) + aligned(self.numel[b]) > self.w.numel():
            return True
        fa, fb = aligned(self.frozen_numel[a]), aligned(self.frozen_numel[b])
        return frozen and self.fw is not None and fa + fb > self.fw.numel()

    def _other(self, slot: Slot) -> Slot | None:
        return next((s for s in self.slots if s is not slot), None)

    def keep_graph(self, i: int) -> None:
        """Layer i (current) keeps its forward's autograd graph until its backward: that graph references
        this slot's parameters, so layer i is reloaded into this slot, not another, until
        ``release_graph(i)``."""
        assert self.current is not None and self.current.layer == i
        self.graph_slots[i] = self.current

    def release_graph(self, i: int) -> None:
        self.graph_slots.pop(i, None)

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
        False left for later (a prefetch must not stall the compute it should overlap); so is a layer that
        would overwrite part of the one computing now (two layers that are not neighbours: a blocking load
        runs after that layer is released, ``acquire``)."""
        if not self.worker.wait_device(i, block=False):
            if not block:
                return None
            with self.timer("optimizer"):  # the compute thread waits on the EPS
                self.worker.wait_device(i)
        slot = self._holding(i)
        if slot is not None:
            return slot
        kept_slot = self.graph_slots.get(i)
        if kept_slot is not None:  # a kept graph's layer goes back to the slot its forward ran in
            if kept_slot is self.current and not block:
                return None  # not into the slot computing now; the blocking load follows its release
            slot = kept_slot
        else:
            slot = next((s for s in self.slots if s is not self.current), self.slots[0])
        st = self.eps[i]
        after = slot.released  # the slot's previous layer is done with
        other = self._other(slot)
        if other is not None and other.layer is not None and self._overlap(st.kind, other.kind):
            if other is self.current:
                if not block:
                    return None
                after = other.released  # released by ``acquire`` just now: the latest compute
                self.waits += 1
            other.forget()
        n = st.layout.numel
        w_in = slot.w_in_of[st.kind]
        self.tier.pin(i, "w")  # the disk tier: layer i's weights in RAM (read ahead, usually)
        slot.loaded = self.acc.h2d.copy(w_in[:n], st.send, after=after)
        if self.training:
            self.transfer_bytes += st.send[:n].nbytes
        if self.eps.ties is not None and st.kind == POST:
            self.tier.pin(0, "w")  # the tied tensors are the pre layer's
            ties = self.eps.ties.load(self.acc, w_in[n:], self.eps[0].send, after)
            self.tier.unpin(0, after=AllOf(*ties))
            slot.loaded = AllOf(slot.loaded, *ties)
        self.tier.unpin(i, after=slot.loaded)
        slot.kind = st.kind
        if self.eps.base is not None and slot.base_layer != i:
            slot.base_layer = None
            self.eps.base.load(i, slot.fw_in_of[st.kind])  # copied low-bit, dequantized on the device
            slot.base_layer = i
        slot.layer, slot.version = i, self._version(i)
        self.loads += 1
        return slot

    def acquire(self, i: int, *, prefetch: int | None = None, grads: bool = False) -> nn.Module:
        """The module for layer i, its weights on the device. ``grads``: its gradient buffer is zeroed for a
        backward pass (after the gradients that buffer shares elements with have left for the host)."""
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
            kind = self.spec.kind(i)
            with self.timer("transfer"):
                # the previous occupant's gradient has left (a stream wait on CUDA)
                slot.grads_out.wait_device()
                other = self._other(slot)
                if other is not None and (
                    not self.two_grads or self._overlap(kind, other.grads_kind, frozen=False)
                ):
                    other.grads_out.wait_device()  # so has the other end's, where the two meet
            slot.g_of[kind].zero_()
        return slot.shells[self.spec.kind(i)]

    def send_grads(self, i: int) -> None:
        """Hand layer i's accumulated gradient to the EPS (asynchronously); the slot is free for reuse.
        Before it leaves the device it is summed over the data-parallel ranks there (in the device's type,
        over the default group: NCCL between GPUs) and its L2 norm is taken there, so the host receives a
        reduced gradient and its norm and makes no pass of its own for either."""
        slot = self._holding(i)
        assert slot is not None, f"layer {i} is not on the device"
        st = self.eps[i]
        n = st.layout.numel
        if self.worker.host_busy(i):
            with self.timer("optimizer"):  # its host buffers are still being written (L2L-p)
                self.worker.wait_host(i)
        g = slot.g_of[st.kind]
        tied = self.eps.ties is not None and st.kind == POST
        total = n + (self.eps.ties.numel if tied and self.eps.ties is not None else 0)
        if self.eps.reduce_on_device and total:
            with self.timer("reduce"):  # (NCCL: queued on the device; gloo: the compute thread waits)
                torch_dist.all_reduce(g[:total])
        norm = slot.norm.copy_(flat_norm(g[:n]).view(1)) if n else None
        slot.released = self.acc.record_event()
        slot.grads_kind = st.kind
        with self.timer("transfer"):  # inline on a CPU device; queued on CUDA and the simulator
            self.tier.pin(i, "g", fresh=True)  # a host buffer for it (released by the EPS's job)
            slot.grads_out = st.grad_in = self.acc.d2h.copy(st.recv, g[:n], after=slot.released)
            self.transfer_bytes += g[:n].nbytes
            if norm is not None:
                host = self._norm_host[i]
                st.grad_in = AllOf(st.grad_in, self.acc.d2h.copy(host, norm, after=slot.released))
                slot.grads_out, st.grad_norm = st.grad_in, host[0]  # (the slot's norm is reused after both)
            else:
                st.grad_norm = None
            if tied and self.eps.ties is not None:
                ties = g[n:total]
                self.transfer_bytes += ties.nbytes
                slot.grads_out = AllOf(st.grad_in, self.eps.ties.send_grads(self.acc, ties, slot.released))

    def train(self, mode: bool) -> None:
        self.training = mode
        for s in self.slots:
            for shell in s.shells.values():
                shell.train(mode)
