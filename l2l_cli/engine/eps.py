"""The eager param-server (EPS): the only owner of training state in the L2L modes.

Per layer it holds, in host memory, one contiguous FP32 master buffer (pinned when CUDA is present), the
gradient that arrives from the device, the optimizer moments, and a half-precision send copy under CMP;
and the host optimizer that updates that layer. It is built layer by layer straight into these buffers
(random init or streamed from a checkpoint), so no second full copy of the model ever exists: a model
whose training state fits in host RAM trains, however deep. It also holds the CPU activation stash.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from l2l_cli.checkpoint import CheckpointError, read_tensors, tensors_bytes
from l2l_cli.engine.device import DONE, Accelerator, CopyHandle
from l2l_cli.engine.dist import DistContext
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.optim import OptimSettings, clip_coefficients, make_optimizer, param_groups, set_lr
from l2l_cli.engine.precision import LossScaler
from l2l_cli.engine.tied import TiedWeights
from l2l_cli.models.base import BLOCK, POST, PRE, ModelSpec
from l2l_cli.profiling.timers import PhaseTimer


class LayerState:
    """One layer's training state in host memory, and the optimizer that updates it."""

    def __init__(
        self, index: int, kind: str, layout: FlatLayout, acc: Accelerator, send_dtype: torch.dtype,
        optim: OptimSettings,
    ):  # fmt: skip
        n = layout.numel
        self.index, self.kind, self.layout = index, kind, layout
        self.w = acc.host_empty(n)  # FP32 master
        self.g = acc.host_empty(n).zero_()  # this step's gradient (copied from the device, reduced)
        self.m = acc.host_empty(n).zero_()  # optimizer moments (AdamW / LAMB)
        self.v = acc.host_empty(n).zero_()
        self.w_send = acc.host_empty(n, send_dtype) if send_dtype != torch.float32 else None
        self.version = 0  # bumped by every update; the relay reloads a layer whose version moved on
        self.grad_in: CopyHandle = DONE  # the device->host copy of this step's gradient
        self.undo: list[torch.Tensor] | None = None
        self.undo_step = 0.0
        # AdamW is elementwise: two flat tensors per layer (decayed, not) give the fused kernel long runs.
        # LAMB's trust ratio is per parameter tensor, so it gets a view per tensor.
        split = layout.segments if optim.name == "adamw" else layout.views
        named = []
        grads, ms, vs = dict(split(self.g)), dict(split(self.m)), dict(split(self.v))
        for name, view in split(self.w):
            p = nn.Parameter(view)
            p.grad = grads[name]
            named.append((name, p))
        self.optimizer = make_optimizer(param_groups(named, optim.weight_decay), optim)
        for name, p in named:  # the moments live in the flat buffers (checkpointable per layer as 4 tensors)
            self.optimizer.state[p] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": ms[name],
                "exp_avg_sq": vs[name],
            }

    @property
    def send(self) -> torch.Tensor:
        """What crosses the link to the device: the master, or its half copy under CMP."""
        return self.w if self.w_send is None else self.w_send

    def refresh_send(self) -> None:
        if self.w_send is not None:
            self.w_send.copy_(self.w)

    def update(self, lr: float, grad_mult: torch.Tensor | float | None) -> None:
        """Apply this step's gradient (times ``grad_mult``: unscale and clip) to the master."""
        if grad_mult is not None:
            self.g.mul_(grad_mult)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.version += 1
        self.refresh_send()

    def save_undo(self, acc: Accelerator) -> None:
        """Keep this layer's pre-update state (L2L-p updates before the step is known to be finite)."""
        if self.undo is None:
            self.undo = [acc.host_empty(self.w.numel()) for _ in range(3)]
        for dst, src in zip(self.undo, (self.w, self.m, self.v)):
            dst.copy_(src)
        self.undo_step = float(next(iter(self.optimizer.state.values()))["step"])

    def restore_undo(self) -> None:
        assert self.undo is not None
        for dst, src in zip((self.w, self.m, self.v), self.undo):
            dst.copy_(src)
        for state in self.optimizer.state.values():
            state["step"].fill_(self.undo_step)
        self.version += 1
        self.refresh_send()

    def nbytes(self) -> dict[str, int]:
        return {
            "master": self.w.nbytes,
            "grads": self.g.nbytes,
            "optimizer_state": self.m.nbytes + self.v.nbytes,
            "send_copy": self.w_send.nbytes if self.w_send is not None else 0,
            "undo_log": sum(t.nbytes for t in self.undo) if self.undo is not None else 0,
        }


class EagerParamServer:
    """All layers' host state, the host update, and the CPU activation stash."""

    def __init__(
        self, spec: ModelSpec, optim: OptimSettings, acc: Accelerator, device_dtype: torch.dtype, seed: int,
        dist: DistContext | None = None, eager_reduce: bool = True,
    ):  # fmt: skip
        self.spec, self.acc = spec, acc
        self.dist = dist or DistContext()
        # the EPS's own thread: reduces (and, for L2L-p, updates) each layer while the device computes
        self._worker = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="l2l-eps",
            initializer=torch.set_num_threads,
            initargs=(acc.host_threads,),
        )
        self._jobs: list[Future] = []
        self._lock = threading.Lock()
        self.busy_s = 0.0  # time the worker spent this step (reduction and background updates)
        self._bad = False
        self._updated: list[int] = []
        self._norms: dict[int, torch.Tensor] = {}
        self._raw_norms: dict[int, torch.Tensor] = {}  # L2L: per layer, taken as each gradient landed
        self.realtime: Any = None  # checkpoint.RealtimeWriter: saves each layer right after its update
        self.eager_reduce = eager_reduce
        self._deferred: list[int] = []
        # a tied LM head: its tensor lives once, in the pre layer's master (see engine/tied.py)
        tied = spec.tied_params()
        self.layouts = {
            k: FlatLayout(spec.new_layer(k, "meta"), skip=tied if k == POST else ())
            for k in (PRE, BLOCK, POST)
        }  # fmt: skip
        self.ties = TiedWeights(spec, self.layouts[PRE], acc) if tied else None
        self.layers: list[LayerState] = []
        with acc.meter.paused():  # host tier
            for i in range(spec.num_all_layers):
                kind = spec.kind(i)
                st = LayerState(i, kind, self.layouts[kind], acc, device_dtype, optim)
                st.layout.pack(spec.build_layer(i, seed), st.w)  # one layer's module at a time
                st.refresh_send()
                self.layers.append(st)
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

    # ---- the update (Alg. 3: for l in layers: w_l = optimizer(w_l, g_l)) --------------------------

    # ---- the EPS's background work: eager ("parallel") reduction and, for L2L-p, the update ---------

    def _timed(self, fn: Any, *args: Any) -> None:
        t0 = time.perf_counter()
        try:
            fn(*args)
        finally:
            with self._lock:
                self.busy_s += time.perf_counter() - t0

    def _reduce(self, i: int) -> None:
        """Wait for layer i's gradient to land, then sum it over the data-parallel ranks."""
        st = self.layers[i]
        st.grad_in.wait()
        if i == 0 and self.ties is not None:  # a tied LM head: add the head's use before anything reads g
            self.ties.add_into(st.g)
        if self.dist.enabled:
            torch_dist.all_reduce(st.g, group=self.dist.eps_group)

    def _reduce_and_norm(self, i: int) -> None:
        """L2L's background work per layer: reduce, and take the norm the update will need (a full pass
        over the gradient, done here while the device runs the layers below)."""
        self._reduce(i)
        self._raw_norms[i] = torch.linalg.vector_norm(self.layers[i].g)

    def reduce_async(self, i: int) -> None:
        """Layer i's gradient is on its way to the host: reduce it in the background (L2L: the update
        waits for the whole step; the reduction overlaps the backward of the layers below). With
        ``dist.eager_reduce=false`` the reductions wait until the backward is over (for comparison)."""
        if self.eager_reduce:
            self._jobs.append(self._worker.submit(self._timed, self._reduce_and_norm, i))
        else:
            self._deferred.append(i)

    def wait_background(self) -> None:
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.result()

    def pop_busy(self) -> float:
        with self._lock:
            busy, self.busy_s = self.busy_s, 0.0
        return busy

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
        for i in self._deferred:
            self._jobs.append(self._worker.submit(self._timed, self._reduce_and_norm, i))
        self._deferred = []
        with timer("reduce" if self.dist.enabled else "transfer"):  # the reductions not hidden by backward
            self.wait_background()
        with timer("optimizer"), self.acc.meter.paused():
            norms = self.grad_norms(scaler)
            finite = bool(torch.isfinite(norms).all())
            scaler.update(not finite)
            if finite:
                coefs = clip_coefficients(norms, clip, max_norm)
                for i in range(len(self.layers)):
                    self.update_layer(i, lr, self.grad_mult(scaler, None if coefs is None else coefs[i]))
        return finite, float(torch.linalg.vector_norm(norms))

    # ---- L2L-p: update layer l+1 while the device runs backward on layer l --------------------------

    def update_async(self, i: int, lr: float, scaler: LossScaler, clip: str, max_norm: float) -> None:
        """Reduce and update layer i in the background (Alg. 4, Process 2). Per-layer decisions only:
        clipping by the layer's own norm; a non-finite gradient marks the step bad, and the layers already
        updated this step are restored from their undo copies at the end (see ``finish_async``)."""
        self._jobs.append(
            self._worker.submit(self._timed, self._reduce_and_update, i, lr, scaler.scale, clip, max_norm)
        )

    def _reduce_and_update(
        self, i: int, lr: float, scale: float, clip: str, max_norm: float, last: bool = False
    ) -> None:
        """Reduce, check and update layer i. Unless it is the ``last`` of the step (every other verdict is
        in by then), its pre-update state goes to the undo log first."""
        self._reduce(i)
        st = self.layers[i]
        norm = torch.linalg.vector_norm(st.g) / (scale * self.dist.world)
        self._norms[i] = norm
        if self._bad or not bool(torch.isfinite(norm)):
            self._bad = True
            return
        coef = clip_coefficients(norm[None], clip, max_norm)
        inv = 1.0 / (scale * self.dist.world)
        if not last:
            st.save_undo(self.acc)
        self.update_layer(i, lr, (coef[0] * inv) if coef is not None else (None if inv == 1.0 else inv))
        if not last:
            self._updated.append(i)

    def finish_async(self, scaler: LossScaler, trailing: tuple[int, float, str, float]) -> tuple[bool, float]:
        """The trailing update: wait for the background updates, then update the last layer, ``trailing`` =
        (layer, lr, clip, max_norm), here with every core (nothing is left for it to hide behind); roll the
        whole step back if any layer's gradient was non-finite. Returns (applied, gradient norm)."""
        self.wait_background()
        i, lr, clip, max_norm = trailing
        self._timed(self._reduce_and_update, i, lr, scaler.scale, clip, max_norm, True)
        bad, updated, norms = self._bad, self._updated, self._norms
        self._bad, self._updated, self._norms = False, [], {}
        if bad:
            for i in updated:
                if self.realtime is not None:
                    self.realtime.before_update(i)
                self.layers[i].restore_undo()
                if self.realtime is not None:
                    self.realtime.layer_updated(i, *self.layer_file(i))
        scaler.update(bad)
        total = torch.linalg.vector_norm(torch.stack(list(norms.values()))) if norms else torch.tensor(0.0)
        return not bad, float(total)

    def update_layer(self, i: int, lr: float, grad_mult: torch.Tensor | float | None) -> None:
        if self.realtime is not None:
            self.realtime.before_update(i)  # last step's file of this layer is complete
        self.layers[i].update(lr, grad_mult)
        if self.realtime is not None:
            self.realtime.layer_updated(i, *self.layer_file(i))

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    # ---- checkpoints: one file per layer (w, m, v, step), the same for full and real-time ones --------

    def layer_file(self, i: int) -> tuple[str, Any]:
        """(file name, a function giving its tensors): views of the live buffers, taken when called."""
        st = self.layers[i]

        def payload() -> dict[str, torch.Tensor]:
            step = next(iter(st.optimizer.state.values()))["step"]
            return {"w": st.w, "m": st.m, "v": st.v, "step": step.reshape(())}

        return f"layer_{i}.safetensors", payload

    def state_files(self) -> Iterator[tuple[str, bytes]]:
        for i in range(len(self.layers)):
            name, payload = self.layer_file(i)
            yield name, tensors_bytes(payload())

    @torch.no_grad()
    def load_state(self, ckpt: Any, manifest: dict[str, Any]) -> None:
        for st in self.layers:
            t = read_tensors(ckpt, f"layer_{st.index}.safetensors", manifest)
            for key, buf in (("w", st.w), ("m", st.m), ("v", st.v)):
                if key not in t or t[key].shape != buf.shape:
                    raise CheckpointError(f"{ckpt}: layer {st.index} {key} does not match this model")
                buf.copy_(t[key])
            for state in st.optimizer.state.values():
                state["step"].fill_(float(t["step"]))
            st.version += 1
            st.refresh_send()

    def grad_mult(self, scaler: LossScaler, coef: torch.Tensor | None) -> torch.Tensor | float | None:
        """The one multiplier that unscales, averages over ranks and clips a gradient (None: as is)."""
        inv = 1.0 / (scaler.scale * self.dist.world)
        if coef is None:
            return None if inv == 1.0 else inv
        return coef * inv

    # ---- checkpoints in Hugging Face names ---------------------------------------------------------

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for st in self.layers:
            for name, view in st.layout.views(st.w):
                yield self.spec.hf_name(st.index, name), view

    @torch.no_grad()
    def load_hf(self, tensors: Any) -> list[str]:
        """Stream matching tensors into the masters (one tensor at a time); returns names left at init."""
        missing = []
        for st in self.layers:
            for name, view in st.layout.views(st.w):
                full = self.spec.hf_name(st.index, name)
                t = self.spec.lookup_hf(tensors, full)
                if t is None:
                    missing.append(full)
                else:
                    view.copy_(t.reshape(view.shape))
            st.version += 1
            st.refresh_send()
        return missing

    def host_parts(self) -> dict[str, int]:
        parts: dict[str, int] = {}
        for st in self.layers:
            for k, v in st.nbytes().items():
                parts[k] = parts.get(k, 0) + v
        if self.ties is not None:
            parts["grads"] += self.ties.g.nbytes
        parts["cpu_stash"] = self.stash_bytes
        return {k: v for k, v in parts.items() if v}

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for the CPU activation stash (counted in host memory)."""
        buf = self.acc.host_empty(numel, dtype)
        self.stash_bytes += buf.nbytes
        return buf
