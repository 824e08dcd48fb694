"""The eager param-server (EPS): the only owner of training state in the L2L modes.

Per layer it holds, in its tier (host RAM, or files with a few layers cached: :mod:`~l2l_cli.engine.tiers`),
one contiguous FP32 master buffer (pinned when CUDA is present), the gradient that arrives from the device,
the optimizer moments, and a half-precision send copy under CMP; and the host optimizer that updates that
layer. It is built layer by layer straight into these buffers (random init or streamed from a checkpoint),
so no second full copy of the model ever exists: a model whose training state fits in host RAM trains,
however deep. It also holds the CPU activation stash.

What it does to a layer: reduce its gradient over the ranks (:meth:`EagerParamServer.reduce`) and update it
(:meth:`EagerParamServer.update_layer`: ``LayerState.update``, the optimizer's step); and Alg. 3's update of
every layer after the backward (:meth:`EagerParamServer.step`). Its parts are public attributes, built here
and called directly by whoever needs them: ``worker`` (:mod:`~l2l_cli.engine.eps_worker`, the EPS thread),
``tier``, ``files`` (:mod:`~l2l_cli.engine.eps_files`, its checkpoint and HF I/O). The schedules that update
in the backward are built beside it by the runner and take it as their layer store:
:mod:`~l2l_cli.engine.speculative` (L2L-p's speculative update, its undo and redo) and
:mod:`~l2l_cli.engine.trailing` (the trailing update behind the next forward). The EPS imports neither.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist

from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.dist import DistContext
from l2l_cli.engine.eps_files import EpsFiles
from l2l_cli.engine.eps_worker import EpsWorker
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.frozen import FrozenBase
from l2l_cli.engine.layer_state import LayerState
from l2l_cli.engine.optim import OptimSettings, clip_coefficients, flat_norm
from l2l_cli.engine.precision import LossScaler
from l2l_cli.engine.tied import TiedWeights
from l2l_cli.engine.tiers import TierSettings, make_tier
from l2l_cli.models.base import BLOCK, POST, PRE, ModelSpec
from l2l_cli.models.lora import lora_of
from l2l_cli.profiling.timers import PhaseTimer

__all__ = ["EagerParamServer", "grad_mult"]

KINDS = (PRE, BLOCK, POST)


def grad_mult(scale: float, coef: torch.Tensor | None) -> torch.Tensor | float | None:
    """The one multiplier that unscales (``scale``: the loss scale times the ranks averaged over) and clips
    (``coef``) a gradient (None: as is)."""
    inv = 1.0 / scale
    if coef is None:
        return None if inv == 1.0 else inv
    return coef * inv


class EagerParamServer:
    """All layers' host state (built straight into its tier, layer by layer), the EPS thread, a layer's
    reduction and update, Alg. 3's update after the backward, and the CPU activation stash."""

    def __init__(
        self,
        spec: ModelSpec,
        optim: OptimSettings,
        acc: Accelerator,
        device_dtype: torch.dtype,
        seed: int,
        dist: DistContext | None = None,
        eager_reduce: bool = True,
        tier: TierSettings | None = None,
        timer: PhaseTimer | None = None,
    ):
        self.spec, self.acc = spec, acc
        self.dist = dist or DistContext()
        # the EPS's own thread: reduces (and, for L2L-p, updates) each layer while the device computes
        self.worker = EpsWorker(acc)
        self.elementwise = optim.elementwise  # an update can be split by element (LAMB's can't)
        self.realtime: Any = None  # checkpoint.RealtimeWriter: saves each layer right after its update
        self.eager_reduce = eager_reduce
        # data parallel: each layer's gradient is summed over the ranks on the device, by the relay, before
        # it leaves (the default group: NCCL between GPUs), unless the ranks' EPS group is not the default
        # group's ranks (a pipeline's data-parallel replicas) or the reduction waits for the backward's end
        # (dist.eager_reduce=false, for comparison): then here, on the host, over the EPS's gloo group
        self.reduce_on_device = self.dist.enabled and self.dist.device_reduce and eager_reduce
        self.passes = acc.host_passes
        lora = lora_of(spec)
        # adapters on a frozen base (peft=lora): the EPS's state is the trainable tensors only; the base
        # is held apart, once, in its own precision (engine/frozen.py), and never updated
        trainable = {k: spec.trainable_names(k) for k in KINDS} if lora else None  # type: ignore[attr-defined]
        self.layouts = {
            k: FlatLayout(spec.new_layer(k, "meta"), only=trainable[k] if trainable else None) for k in KINDS
        }
        # a tied LM head: its tensor lives once, in the pre layer's master (see engine/tied.py); with
        # adapters it is a frozen base tensor, kept once by the frozen base
        tied = spec.tied_params() if not lora else {}
        if not lora:
            self.layouts = {
                k: FlatLayout(spec.new_layer(k, "meta"), skip=tied if k == POST else ()) for k in KINDS
            }
        self.ties = TiedWeights(spec, self.layouts[PRE], acc, device_dtype) if tied else None
        # where the layers' buffers live: host RAM, or files with a few layers cached (eps.tier); built from
        # the layouts the layers use (a tied head's tensor is the pre layer's: not in the post layer's file)
        self.tier = make_tier(tier or TierSettings(), spec, self.layouts, acc, device_dtype, optim, timer)
        self.base: FrozenBase | None = None
        self.frozen_layouts: dict[str, FlatLayout] = {}
        if lora and trainable is not None:
            self.frozen_layouts = {k: FlatLayout(spec.new_layer(k, "meta"), skip=trainable[k]) for k in KINDS}
            where = tier.path if tier is not None and tier.path else None  # a base on disk: under eps.path
            root = Path(where) / "frozen_base" if where else None
            self.base = FrozenBase(spec, self.frozen_layouts, lora, root, seed, link=acc.link)
        self.layers: list[LayerState] = []
        self.files = EpsFiles(spec, self.layers, self.tier)
        with acc.meter.paused():  # host tier
            for i in range(spec.num_all_layers):
                kind = spec.kind(i)
                st = self.tier.new_layer(i, kind, self.layouts[kind], acc, device_dtype, optim)
                if not self.tier.resumed or self.base is not None:  # (a disk tier continuing a run has its
                    layer = spec.build_layer(i, seed)  # state already) one layer's module at a time
                    if self.base is not None:
                        self.base.put(i, layer)
                if not self.tier.resumed:
                    with self.tier.holding(i, "wmv", fresh=True, dirty=True):
                        st.layout.pack(layer, st.w)
                        st.refresh_send()
                self.layers.append(st)
        self._raw_norms: dict[int, torch.Tensor] = {}  # L2L: per layer, taken as each gradient landed
        self._deferred: list[int] = []  # L2L with dist.eager_reduce=false: reductions after the backward
        self.stash_bytes = 0

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerState:
        return self.layers[i]

    def device_numel(self, kind: str) -> int:
        """Elements of a layer of ``kind`` in a device slot: its own, and the post layer's tied ones."""
        extra = self.ties.numel if self.ties is not None and kind == POST else 0
        return self.layouts[kind].numel + extra

    @property
    def max_layer_numel(self) -> int:
        return max(self.device_numel(k) for k in self.layouts)

    @property
    def max_frozen_numel(self) -> int:
        """Elements of the largest layer's frozen base (0: no frozen base)."""
        return max((lay.numel for lay in self.frozen_layouts.values()), default=0)

    def layer_job(self, fn: Any, i: int, *args: Any) -> None:
        """A background job on layer i's gradient; once it is done the tier may move the gradient out."""
        try:
            self.worker.timed(fn, i, *args)
        finally:
            self.tier.release_grad(i)

    def reduce(self, i: int) -> None:
        """Wait for layer i's gradient to land (summed over the ranks on the device, its norm taken there:
        ``Relay.send_grads``); a tied head's share is added here, and where the device did not reduce,
        the ranks' sum is taken here (on the FP32 buffer)."""
        st = self.layers[i]
        st.grad_in.wait()
        tied = i == 0 and self.ties is not None
        on_host = self.dist.enabled and not self.reduce_on_device
        st.receive_grad(widen=tied or on_host)
        if tied and self.ties is not None:  # a tied LM head: add the head's use before anything reads g
            self.ties.add_into(st.g)
            n = self.ties.numel
            self.passes.count("tied_add", n * (12 + (2 + 4 if self.ties.g_recv is not None else 0)))
            st.grad_norm = None  # (the device's norm is of the embeddings' use alone)
        if on_host:
            torch_dist.all_reduce(st.g, group=self.dist.eps_group)
            self.passes.count("reduce", st.g.nbytes * 2)
            st.grad_norm = None  # (the device's norm is of this rank's share alone)

    def layer_norm(self, i: int) -> torch.Tensor:
        """Layer i's (rank-summed, still scaled) gradient norm: the device's, or one pass here."""
        st = self.layers[i]
        if st.grad_norm is not None:
            return st.grad_norm.clone()
        g = st.grad
        self.passes.count("norm", g.nbytes)
        return flat_norm(g)

    def update_layer(self, i: int, lr: float, grad_mult: torch.Tensor | float | None) -> None:
        if self.realtime is not None:
            self.realtime.before_update(i)  # last step's file of this layer is complete
        with self.tier.holding(i, "wmvg", dirty=True):  # the disk tier writes the new state back
            self.layers[i].update(lr, grad_mult)
        if self.realtime is not None:
            self.realtime.layer_updated(i, *self.files.layer_file(i))

    def update_master(self, i: int, lr: float, grad_mult: torch.Tensor | float | None) -> None:
        """Layer i's update of the master only, behind the forward (the trailing update): the device may
        be copying the send copy meanwhile; whoever settles the layer refreshes it."""
        if self.realtime is not None:
            self.realtime.before_update(i)
        self.layers[i].update(lr, grad_mult, bump=False, refresh=False)
        if self.realtime is not None:
            self.realtime.layer_updated(i, *self.files.layer_file(i))

    def restore_layer(self, i: int, announce: bool = True) -> None:
        """Layer i back to its state before a speculative update (its undo log); ``announce``: a real-time
        checkpoint writes the restored layer (False: an update follows that writes it)."""
        if self.realtime is not None:
            self.realtime.before_update(i)
        self.layers[i].restore_undo()
        if self.realtime is not None and announce:
            self.realtime.layer_updated(i, *self.files.layer_file(i))

    @property
    def checkpoints_each_step(self) -> bool:
        """A checkpoint of the EPS follows each step (a real-time one, or a durable tier's commit): every
        layer's update must be in by the step's end."""
        return self.realtime is not None or self.tier.durable

    def close(self) -> None:
        self.worker.shutdown()
        self.tier.close()
        if self.base is not None:
            self.base.close()

    # ---- the update (Alg. 3: for l in layers: w_l = optimizer(w_l, g_l)) --------------------------

    def _reduce_and_norm(self, i: int) -> None:
        """L2L's background work per layer: reduce, and take the norm the update will need (a full pass
        over the gradient, done here while the device runs the layers below)."""
        self.reduce(i)
        self._raw_norms[i] = self.layer_norm(i)

    def reduce_async(self, i: int) -> None:
        """Layer i's gradient is on its way to the host: reduce it in the background (L2L: the update
        waits for the whole step; the reduction overlaps the backward of the layers below). With
        ``dist.eager_reduce=false`` the reductions wait until the backward is over (for comparison)."""
        if self.eager_reduce:
            self.worker.submit(self.layer_job, self._reduce_and_norm, i)
        else:
            self._deferred.append(i)

    def grad_norms(self, scaler: LossScaler) -> torch.Tensor:
        """Unscaled L2 norm of each layer's (rank-averaged) gradient: taken by the EPS thread as each
        gradient landed, or here for any layer it has not seen."""
        raw, self._raw_norms = self._raw_norms, {}
        norms = [raw[st.index] if st.index in raw else self.layer_norm(st.index) for st in self.layers]
        return torch.stack(norms) / (scaler.scale * self.dist.world)

    def step(
        self, lr: float, scaler: LossScaler, clip: str, max_norm: float, timer: PhaseTimer
    ) -> tuple[bool, float]:
        """Alg. 3's update: once every layer's gradient is reduced, skip the step on a non-finite one,
        clip (globally or per layer), update every layer."""
        self.gather_grads(timer)
        with timer("optimizer"), self.worker.work():
            norms = self.grad_norms(scaler)
            finite = bool(torch.isfinite(norms).all())
            scaler.update(not finite)
            if finite:
                coefs = clip_coefficients(norms, clip, max_norm)
                for i in range(len(self.layers)):
                    self.update_layer(i, lr, self.grad_mult(scaler, None if coefs is None else coefs[i]))
        return finite, float(torch.linalg.vector_norm(norms))

    def gather_grads(self, timer: PhaseTimer) -> None:
        """Every layer's gradient in and reduced (the deferred reductions started now), before an update."""
        for i in self._deferred:
            self.worker.submit(self.layer_job, self._reduce_and_norm, i)
        self._deferred = []
        with timer("reduce" if self.dist.enabled else "transfer"):  # the reductions not hidden by backward
            self.worker.wait_background()

    def grad_mult(self, scaler: LossScaler, coef: torch.Tensor | None) -> torch.Tensor | float | None:
        """The one multiplier that unscales, averages over ranks and clips a gradient (None: as is)."""
        return grad_mult(scaler.scale * self.dist.world, coef)

    # ---- checkpoints and Hugging Face weights (engine/eps_files.py) ----------------------------------

    def load_hf(self, tensors: Any) -> list[str]:
        """Stream matching tensors into the masters (one tensor at a time), and a frozen base's into it;
        returns names left at init."""
        missing = self.files.load_hf(tensors)
        if self.base is not None:
            missing += self.base.load_hf(tensors)
        return missing

    def full_layers(self) -> Iterator[tuple[int, torch.nn.Module]]:
        """(index, a CPU fp32 module of layer i: frozen base and trained tensors) per layer."""
        for st in self.layers:
            layer = self.spec.new_layer(st.kind, "cpu")
            params = dict(layer.named_parameters())
            with torch.no_grad(), self.tier.holding(st.index, "w"):
                for name, view in st.layout.views(st.w):
                    params[name].copy_(view)
            if self.base is not None:
                with torch.no_grad():
                    for name, t in self.base.tensors(st.index):
                        params[name].copy_(t)
            yield st.index, layer

    # ---- what the host's passes moved (summary.json's ``eps``) ----------------------------------------

    def traffic_section(
        self, transfer_bytes: int, since: tuple[dict[str, int], dict[str, float], int] | None, steps: int
    ) -> dict[str, Any]:
        """summary.json's ``eps`` over ``steps`` training steps, counted ``since`` (the host passes' bytes
        and seconds and the link's bytes before the first of them): the host's passes per trained
        parameter per step, by purpose, the update's GB/s, the link's bytes apart, which update ran."""
        passes = self.passes
        nbytes, seconds = passes.snapshot()
        b0, s0, t0 = since if since is not None else ({}, {}, 0)
        nbytes = {k: v - b0.get(k, 0) for k, v in nbytes.items() if v - b0.get(k, 0)}
        upd_s = seconds.get("update", 0.0) - s0.get("update", 0.0)
        params = sum(st.layout.numel for st in self.layers)
        per = max(1, params) * max(1, steps)
        return {
            "update_kernel": passes.kernel,
            "host_threads": passes.threads,
            "host_traffic_bytes_per_param": sum(nbytes.values()) / per,
            "host_traffic_by_pass": {k: v / per for k, v in sorted(nbytes.items())},
            "transfer_bytes_per_param": (transfer_bytes - t0) / per,
            "update_gbps": nbytes.get("update", 0) / upd_s / 1e9 if upd_s > 0 else None,
            "trained_params": params,
        }

    # ---- host memory ---------------------------------------------------------------------------------

    def host_parts(self) -> dict[str, int]:
        parts: dict[str, int] = {}
        for st in self.layers:
            for k, v in st.nbytes().items():
                parts[k] = parts.get(k, 0) + v
        parts.update(self.tier.host_parts())
        if self.ties is not None:
            parts["grads"] = parts.get("grads", 0) + self.ties.g.nbytes
            if self.ties.g_recv is not None:
                parts["recv_copy"] = parts.get("recv_copy", 0) + self.ties.g_recv.nbytes
        parts["cpu_stash"] = self.stash_bytes
        if self.base is not None:
            parts["frozen_base"] = self.base.host_bytes()
        return {k: v for k, v in parts.items() if v}

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for the CPU activation stash (counted in host memory)."""
        buf = self.acc.host_empty(numel, dtype, link=True)
        self.stash_bytes += buf.nbytes
        return buf
