"""The eager param-server (EPS): the only owner of training state in the L2L modes.

Per layer it holds, in host memory, one contiguous FP32 master buffer (pinned when CUDA is present), the
gradient that arrives from the device, the optimizer moments, and a half-precision send copy under CMP;
and the host optimizer that updates that layer. It is built layer by layer straight into these buffers
(random init or streamed from a checkpoint), so no second full copy of the model ever exists: a model
whose training state fits in host RAM trains, however deep. It also holds the CPU activation stash.

The EPS is composed of parts, each in its own module:
- :mod:`~l2l_cli.engine.layer_server`: the layers in their tier (:mod:`~l2l_cli.engine.tiers`), the EPS
  thread (:mod:`~l2l_cli.engine.eps_worker`), a layer's reduction and update;
- here: L2L's update after the backward (Alg. 3), with eager per-layer reduction;
- :mod:`~l2l_cli.engine.speculative`: L2L-p's speculative update during the backward, its undo and redo;
- :mod:`~l2l_cli.engine.trailing`: L2L-p's trailing update behind the next forward;
- :mod:`~l2l_cli.engine.eps_files`: its checkpoint files and the weights in Hugging Face names.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.dist import DistContext
from l2l_cli.engine.layer_server import LayerServer, grad_mult
from l2l_cli.engine.optim import OptimSettings, clip_coefficients
from l2l_cli.engine.precision import LossScaler
from l2l_cli.engine.speculative import Speculation
from l2l_cli.engine.tiers import TierSettings
from l2l_cli.engine.trailing import TrailingUpdate
from l2l_cli.models.base import ModelSpec
from l2l_cli.profiling.timers import PhaseTimer

__all__ = ["EagerParamServer"]


class EagerParamServer(LayerServer):
    """All layers' host state, the host update, and the CPU activation stash."""

    def __init__(
        self, spec: ModelSpec, optim: OptimSettings, acc: Accelerator, device_dtype: torch.dtype, seed: int,
        dist: DistContext | None = None, eager_reduce: bool = True, tier: TierSettings | None = None,
        timer: PhaseTimer | None = None,
    ):  # fmt: skip
        super().__init__(spec, optim, acc, device_dtype, seed, dist, eager_reduce, tier, timer)
        self._raw_norms: dict[int, torch.Tensor] = {}  # L2L: per layer, taken as each gradient landed
        self._deferred: list[int] = []  # L2L with dist.eager_reduce=false: reductions after the backward
        self.trailing = TrailingUpdate(self)
        self.speculation = Speculation(self, self.trailing)
        self.stash_bytes = 0

    # ---- the update (Alg. 3: for l in layers: w_l = optimizer(w_l, g_l)) --------------------------

    def _reduce_and_norm(self, i: int) -> None:
        """L2L's background work per layer: reduce, and take the norm the update will need (a full pass
        over the gradient, done here while the device runs the layers below)."""
        self.reduce(i)
        self._raw_norms[i] = torch.linalg.vector_norm(self.layers[i].g)

    @property
    def updates_in_backward(self) -> bool:
        """L2L on a tier that would otherwise read each layer twice (the disk tier: once for its backward,
        once for its update after the whole backward) updates each layer right after its backward instead,
        speculatively as L2L-p does (:meth:`update_async`, :meth:`finish_async`): the same numbers, fewer
        bytes moved."""
        return self.tier.update_in_backward and self.eager_reduce

    def reduce_async(self, i: int) -> None:
        """Layer i's gradient is on its way to the host: reduce it in the background (L2L: the update
        waits for the whole step; the reduction overlaps the backward of the layers below). With
        ``dist.eager_reduce=false`` the reductions wait until the backward is over (for comparison)."""
        if self.eager_reduce:
            self.worker.submit(self.layer_job, self._reduce_and_norm, i)
        else:
            self._deferred.append(i)

    def wait_background(self) -> None:
        self.worker.wait_background()

    def pop_busy(self) -> float:
        return self.worker.pop_busy()

    def grad_norms(self, scaler: LossScaler) -> torch.Tensor:
        """Unscaled L2 norm of each layer's (rank-averaged) gradient: taken by the EPS thread as each
        gradient landed, or here for any layer it has not seen."""
        raw, self._raw_norms = self._raw_norms, {}
        norms = [raw[st.index] if st.index in raw else torch.linalg.vector_norm(st.g) for st in self.layers]
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
            self.wait_background()

    def grad_mult(self, scaler: LossScaler, coef: torch.Tensor | None) -> torch.Tensor | float | None:
        """The one multiplier that unscales, averages over ranks and clips a gradient (None: as is)."""
        return grad_mult(scaler.scale * self.dist.world, coef)

    # ---- L2L-p: update layer l+1 while the device runs backward on layer l (engine/speculative.py) ----

    def update_async(self, i: int, lr: float, scaler: LossScaler, clip: str, max_norm: float) -> None:
        """Reduce and update layer i in the background, speculatively (see :class:`Speculation`)."""
        self.speculation.update_async(i, lr, scaler, clip, max_norm)

    def finish_async(
        self, scaler: LossScaler, trailing: tuple[int, float, str, float], defer: bool = False
    ) -> tuple[bool, float]:
        """The end of an L2L-p step: judge it, undo or redo the speculative updates (see
        :meth:`Speculation.finish`). Returns (applied, norm)."""
        return self.speculation.finish(scaler, trailing, defer)

    @property
    def rollbacks(self) -> int:
        return self.speculation.rollbacks

    @property
    def rollback_layers(self) -> int:
        return self.speculation.rollback_layers

    @property
    def last_rollback(self) -> str | None:
        return self.speculation.last_rollback

    # ---- the trailing update behind the next forward (engine/trailing.py) ---------------------------

    def start_step(self, batch: Any) -> None:
        """A step begins with ``batch``: the held trailing update goes to the rows it reads first, then
        whole behind the forward (see :meth:`TrailingUpdate.start_step`)."""
        self.trailing.start_step(batch)

    def apply_trailing(self) -> None:
        """A held trailing update no step has started: apply it whole, here."""
        self.trailing.apply()

    @property
    def _trailing(self) -> tuple[int, float, torch.Tensor | float | None] | None:
        """The held trailing update (layer, lr, multiplier), if any."""
        return self.trailing.pending

    @property
    def _worker(self) -> ThreadPoolExecutor:
        """The EPS thread's executor."""
        return self.worker.pool

    # ---- the EPS's background work -------------------------------------------------------------------

    def settle(self) -> None:
        """Finish every update in flight (held, partial or in the background) before anything outside
        the step reads the EPS: evaluation, checkpoints, exported weights."""
        self.apply_trailing()
        self.worker.wait_all()
        self.trailing.settled()

    def wait_device(self, i: int, block: bool = True) -> bool:
        """Whether layer i may be loaded onto the device now (its update is in); ``block``: wait for it."""
        return self.worker.wait_device(i, block)

    def host_busy(self, i: int) -> bool:
        """Whether background work still writes layer i's host buffers."""
        return self.worker.host_busy(i)

    def wait_host(self, i: int) -> None:
        """Before layer i's host buffers are overwritten (its next gradient lands): its update is done."""
        self.worker.wait_host(i)

    def pop_optimizer(self) -> dict[str, float]:
        """Host update time since the last call (see :meth:`EpsWorker.pop_optimizer`)."""
        return self.worker.pop_optimizer()

    # ---- checkpoints and Hugging Face weights (engine/eps_files.py) ----------------------------------

    def state_files(self) -> Iterator[tuple[str, bytes]]:
        return self.files.state_files()

    def load_state(self, ckpt: Any, manifest: dict[str, Any]) -> None:
        self.files.load_state(ckpt, manifest)

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.files.hf_tensors()

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
        buf = self.acc.host_empty(numel, dtype)
        self.stash_bytes += buf.nbytes
        return buf
