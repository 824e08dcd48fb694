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
from concurrent.futures import wait as futures_wait
from contextlib import contextmanager
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
from l2l_cli.engine.tiers import TierSettings, make_tier
from l2l_cli.models.base import BLOCK, POST, PRE, ModelSpec
from l2l_cli.profiling.timers import PhaseTimer

_THREAD = threading.local()


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)
    _THREAD.eps_worker = True


def bind_optimizer(
    layout: FlatLayout,
    w: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    optim: OptimSettings,
) -> torch.optim.Optimizer:
    """The host optimizer of one layer, working in place on flat buffers: parameters are views of ``w``
    with ``.grad`` views of ``g``, and the moments are views of ``m`` and ``v``."""
    # AdamW is elementwise: two flat tensors per layer (decayed, not) give the fused kernel long runs.
    # LAMB's trust ratio is per parameter tensor, so it gets a view per tensor.
    split = layout.segments if optim.elementwise else layout.views
    named = []
    grads, ms, vs = dict(split(g)), dict(split(m)), dict(split(v))
    for name, view in split(w):
        p = nn.Parameter(view)
        p.grad = grads[name]
        named.append((name, p))
    optimizer = make_optimizer(param_groups(named, optim.weight_decay), optim)
    for name, p in named:  # the moments live in the flat buffers (checkpointable per layer as 4 tensors)
        optimizer.state[p] = {
            "step": torch.zeros((), dtype=torch.float32),
            "exp_avg": ms[name],
            "exp_avg_sq": vs[name],
        }
    return optimizer


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
        # CMP: the gradient crosses the link in the device's half type and becomes FP32 here, on the host
        # (a conversion on the device would need an FP32 temporary there and twice the link's bytes)
        self.g_recv = acc.host_empty(n, send_dtype) if send_dtype != torch.float32 else None
        self.version = 0  # bumped by every update; the relay reloads a layer whose version moved on
        self.grad_in: CopyHandle = DONE  # the device->host copy of this step's gradient
        self.undo: list[torch.Tensor] | None = None
        self.undo_step = 0.0
        self.optimizer = bind_optimizer(layout, self.w, self.g, self.m, self.v, optim)

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

    def land_grad(self) -> None:
        """The gradient has arrived: widen a half one to FP32 (on the host, off the device)."""
        if self.g_recv is not None:
            self.g.copy_(self.g_recv)

    def update(self, lr: float, grad_mult: torch.Tensor | float | None, bump: bool = True) -> None:
        """Apply this step's gradient (times ``grad_mult``: unscale and clip) to the master. ``bump``: a
        device copy loaded before is stale now (False: it already holds the rows it reads, see
        ``preview_rows``)."""
        if grad_mult is not None:
            self.g.mul_(grad_mult)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        if bump:
            self.version += 1
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
                    [w], [g], [m], [v], [], [step.clone()], fused=True, amsgrad=False, beta1=group["betas"][0],
                    beta2=group["betas"][1], lr=lr, weight_decay=decay if lo < self.layout.n_decay else 0.0,
                    eps=group["eps"], maximize=False,
                )  # fmt: skip
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
            "recv_copy": self.g_recv.nbytes if self.g_recv is not None else 0,
            "undo_log": sum(t.nbytes for t in self.undo) if self.undo is not None else 0,
        }


class EagerParamServer:
    """All layers' host state, the host update, and the CPU activation stash."""

    def __init__(
        self, spec: ModelSpec, optim: OptimSettings, acc: Accelerator, device_dtype: torch.dtype, seed: int,
        dist: DistContext | None = None, eager_reduce: bool = True, tier: TierSettings | None = None,
        timer: PhaseTimer | None = None,
    ):  # fmt: skip
        self.spec, self.acc = spec, acc
        self.dist = dist or DistContext()
        # the EPS's own thread: reduces (and, for L2L-p, updates) each layer while the device computes
        self._worker = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="l2l-eps",
            initializer=_worker_init,
            initargs=(acc.host_threads,),
        )
        self._jobs: list[Future] = []
        self._lock = threading.Lock()
        self.busy_s = 0.0  # time the worker spent this step (reduction and background updates)
        # host update work this step: on the compute thread (exposed), on the EPS thread (overlapped), and
        # the compute thread's waits on the EPS (exposed)
        self._times = {"main_s": 0.0, "eps_s": 0.0, "trailing_s": 0.0, "wait_s": 0.0}
        self.elementwise = optim.elementwise  # an update can be split by element (LAMB's can't)
        # L2L-p's speculation: the step's per-layer norms, the layers updated before the verdict (undo
        # log kept), those held back once global clipping was certain, and the rollbacks so far
        self._bad = False
        self._updated: list[int] = []
        self._held: list[int] = []
        self._norms: dict[int, torch.Tensor] = {}
        self.rollbacks = 0  # steps whose speculative updates were undone (clipping, or a non-finite gradient)
        self.rollback_layers = 0
        self.last_rollback: str | None = None  # why the last step rolled back (None: it did not)
        # background work that still writes a layer: until it is done, the device may not load that layer
        # (device) or nothing else may read or overwrite its host buffers (host)
        self._device_jobs: dict[int, Future] = {}
        self._host_jobs: dict[int, Future] = {}
        self._trailing: tuple[int, float, torch.Tensor | float | None] | None = None  # decided, not applied
        self._stale: set[int] = set()  # layers whose device copy may hold rows updated after it was loaded
        self._raw_norms: dict[int, torch.Tensor] = {}  # L2L: per layer, taken as each gradient landed
        self.realtime: Any = None  # checkpoint.RealtimeWriter: saves each layer right after its update
        self.eager_reduce = eager_reduce
        self._deferred: list[int] = []
        self.layouts = {k: FlatLayout(spec.new_layer(k, "meta")) for k in (PRE, BLOCK, POST)}
        # where the layers' buffers live: host RAM, or files with a few layers cached (eps.tier)
        self.tier = make_tier(tier or TierSettings(), spec, self.layouts, acc, device_dtype, optim, timer)
        # a tied LM head: its tensor lives once, in the pre layer's master (see engine/tied.py)
        tied = spec.tied_params()
        self.layouts = {
            k: FlatLayout(spec.new_layer(k, "meta"), skip=tied if k == POST else ())
            for k in (PRE, BLOCK, POST)
        }  # fmt: skip
        self.ties = TiedWeights(spec, self.layouts[PRE], acc, device_dtype) if tied else None
        self.layers: list[LayerState] = []
        with acc.meter.paused():  # host tier
            for i in range(spec.num_all_layers):
                kind = spec.kind(i)
                st = self.tier.new_layer(i, kind, self.layouts[kind], acc, device_dtype, optim)
                if not self.tier.adopted:  # (a disk tier continuing a run has its state already)
                    with self.tier.holding(i, "wmv", fresh=True, dirty=True):
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

    def _layer_job(self, fn: Any, i: int, *args: Any) -> None:
        """A background job on layer i's gradient; once it is done the tier may move the gradient out."""
        try:
            self._timed(fn, i, *args)
        finally:
            self.tier.release_grad(i)

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
        st.land_grad()
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
            self._jobs.append(self._worker.submit(self._layer_job, self._reduce_and_norm, i))
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
            self._jobs.append(self._worker.submit(self._layer_job, self._reduce_and_norm, i))
        self._deferred = []
        with timer("reduce" if self.dist.enabled else "transfer"):  # the reductions not hidden by backward
            self.wait_background()
        with timer("optimizer"), self._work():
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
        """Reduce and update layer i in the background (Alg. 4, Process 2), speculatively: with global
        clipping the factor is known only once every gradient is in, so layer i is updated as if no
        clipping applied, its pre-update state kept in the undo log; ``finish_async`` rolls it back and
        redoes it with the right factor when the finished norm says clipping applies, and rolls back
        the whole step on a non-finite gradient (SuperOffload's speculation-then-validation)."""
        job = self._worker.submit(
            self._layer_job, self._reduce_and_update, i, lr, scaler.scale, clip, max_norm
        )
        self._jobs.append(job)
        self._device_jobs[i] = self._host_jobs[i] = job

    def _reduce_and_update(self, i: int, lr: float, scale: float, clip: str, max_norm: float) -> None:
        self._reduce(i)
        st = self.layers[i]
        norm = torch.linalg.vector_norm(st.g) / (scale * self.dist.world)
        self._norms[i] = norm
        if self._bad or not bool(torch.isfinite(norm)):
            self._bad = True
            return
        inv = 1.0 / (scale * self.dist.world)
        if clip == "global":
            norms = torch.stack(list(self._norms.values()))
            if self.tier.durable or float(clip_coefficients(norms, clip, max_norm)[0]) < 1.0:
                # the norm so far already exceeds max_grad_norm: clipping is certain, and any update
                # made now would be undone; wait for the factor instead. The disk tier always waits: an
                # update there consumes the gradient it would need to redo one (its undo is the file's
                # other slot, the state before the update, not the gradient)
                self._held.append(i)
                return
            mult = None if inv == 1.0 else inv  # as if the factor were 1; checked in finish_async
        else:
            coef = clip_coefficients(norm[None], clip, max_norm)
            mult = (coef[0] * inv) if coef is not None else (None if inv == 1.0 else inv)
        with self._work():
            st.save_undo(self.acc)
            self.update_layer(i, lr, mult)
        self._updated.append(i)

    def finish_async(
        self, scaler: LossScaler, trailing: tuple[int, float, str, float], defer: bool = False
    ) -> tuple[bool, float]:
        """The end of an L2L-p step: wait for the background updates, take the trailing layer's gradient
        (``trailing`` = (layer, lr, clip, max_norm)), and judge the step on every layer's norm:
        non-finite -> undo every speculative update (the step is skipped); global clipping applies ->
        undo and redo them with the right factor, in forward order on the EPS thread, each layer ready
        before the next forward loads it. The trailing layer's own update is applied here, or with
        ``defer`` held for ``start_step`` (it then runs behind the next forward). Returns (applied, norm)."""
        with self.acc.meter.paused():  # host-tier work on the compute thread
            return self._finish(scaler, trailing, defer)

    def _finish(
        self, scaler: LossScaler, trailing: tuple[int, float, str, float], defer: bool
    ) -> tuple[bool, float]:
        i0 = trailing[0]
        try:
            return self._judge(scaler, trailing, defer)
        finally:
            self.tier.release_grad(i0)  # (the disk tier may move its gradient out now)

    def _judge(
        self, scaler: LossScaler, trailing: tuple[int, float, str, float], defer: bool
    ) -> tuple[bool, float]:
        i0, lr, clip, max_norm = trailing
        self.apply_trailing()  # one no step started after (not in a normal run): apply it first
        self._wait_jobs()
        self._reduce(i0)
        scale = scaler.scale * self.dist.world
        self._norms[i0] = torch.linalg.vector_norm(self.layers[i0].g) / scale
        norms = torch.stack([self._norms[i] for i in sorted(self._norms)])  # in layer order, as Alg. 3
        bad, updated, held = self._bad or not bool(torch.isfinite(norms).all()), self._updated, self._held
        self._bad, self._updated, self._held, self._norms = False, [], [], {}
        self.last_rollback = None
        scaler.update(bad)
        if bad:
            with self._work():
                for i in updated:
                    self._restore(i)
            self._count_rollback(updated, "a non-finite gradient")
            return False, float(torch.linalg.vector_norm(norms))
        coefs = clip_coefficients(norms, clip, max_norm)
        if clip == "global":
            factor = coefs[0]  # type: ignore[index]
            redo = updated if float(factor) < 1.0 else []
            for i in sorted(held + redo):  # forward order: the next forward needs layer 1 first
                job = self._worker.submit(self._timed, self._redo, i, lr, factor, i in redo, 1.0 / scale)
                self._jobs.append(job)
                self._device_jobs[i] = self._host_jobs[i] = job
            if redo:
                total = float(torch.linalg.vector_norm(norms))
                self._count_rollback(
                    redo, f"global gradient norm {total:.4g} > optim.max_grad_norm {max_norm:g}"
                )
        mult = self.grad_mult_for(scale, None if coefs is None else coefs[i0])
        if defer and self.elementwise and self.realtime is None and not self.tier.durable:
            self._trailing = (i0, lr, mult)
        else:
            with self._work():
                self.update_layer(i0, lr, mult)
        if self.realtime is not None or self.tier.durable:  # the step's checkpoint (a real-time one, or the
            self._wait_jobs()  # disk tier's commit) is taken next: every layer must be in
        return True, float(torch.linalg.vector_norm(norms))

    @staticmethod
    def grad_mult_for(scale: float, coef: torch.Tensor | None) -> torch.Tensor | float | None:
        inv = 1.0 / scale
        if coef is None:
            return None if inv == 1.0 else inv
        return coef * inv

    def _restore(self, i: int, announce: bool = True) -> None:
        if self.realtime is not None:
            self.realtime.before_update(i)
        self.layers[i].restore_undo()
        if self.realtime is not None and announce:  # (a redo that follows writes the layer's file itself)
            self.realtime.layer_updated(i, *self.layer_file(i))

    def _redo(self, i: int, lr: float, factor: torch.Tensor, rollback: bool, inv: float) -> None:
        """Layer i with the step's clipping factor: undo its speculative update first (its gradient
        already carries the unscaling then), or update it for the first time (it was held back)."""
        with self._work():
            if rollback:
                self._restore(i, announce=False)
                self.update_layer(i, lr, factor)
            else:
                self.update_layer(i, lr, factor * inv if inv != 1.0 else factor)

    def _count_rollback(self, layers: list[int], why: str) -> None:
        if layers:
            self.rollbacks += 1
            self.rollback_layers += len(layers)
            self.last_rollback = f"{why}: {len(layers)} speculative layer updates undone"

    # ---- the trailing update behind the next forward ------------------------------------------------

    def start_step(self, batch: Any) -> None:
        """A step begins with ``batch``: the last step's held trailing update goes first to the rows this
        batch reads (written to the layer's send copy on the compute thread: the forward needs them now),
        then, whole, to the layer's state on the EPS thread, behind the forward pass. The device never reads
        the other rows in this step; everything else that reads the layer waits for it (``settle``, the
        layer's next gradient)."""
        if self._trailing is None:
            return
        i, lr, mult = self._trailing
        self._trailing = None
        st = self.layers[i]
        rows = self.spec.rows_read(i, batch)
        if rows is None:
            with self._work():
                self.update_layer(i, lr, mult)
            return
        with self._work():
            st.make_send_copy(self.acc)
            st.preview_rows(lr, mult, rows)
            st.version += 1  # the device reloads it: the rows it reads are current
        job = self._worker.submit(self._timed, self._update_behind, i, lr, mult)
        self._jobs.append(job)
        self._host_jobs[i] = job
        self._stale.add(i)

    def _update_behind(self, i: int, lr: float, mult: torch.Tensor | float | None) -> None:
        with self._work(trailing=True):
            if self.realtime is not None:
                self.realtime.before_update(i)
            self.layers[i].update(lr, mult, bump=False)
            if self.realtime is not None:
                self.realtime.layer_updated(i, *self.layer_file(i))

    def apply_trailing(self) -> None:
        """A held trailing update no step has started: apply it whole, here."""
        if self._trailing is not None:
            i, lr, mult = self._trailing
            self._trailing = None
            with self._work():
                self.update_layer(i, lr, mult)

    def settle(self) -> None:
        """Finish every update in flight (held, partial or in the background) before anything outside
        the step reads the EPS: evaluation, checkpoints, exported weights."""
        self.apply_trailing()
        self._wait_jobs()
        for i in self._stale:  # its rows are all current now; a device copy loaded earlier is not
            self.layers[i].version += 1
        self._stale.clear()

    def wait_device(self, i: int, block: bool = True) -> bool:
        """Whether layer i may be loaded onto the device now (its update is in); ``block``: wait for it."""
        job = self._device_jobs.get(i)
        if job is None:
            return True
        if not job.done():
            if not block:
                return False
            self._wait(job)
        del self._device_jobs[i]
        job.result()  # surface a failure of the background update
        return True

    def host_busy(self, i: int) -> bool:
        """Whether background work still writes layer i's host buffers."""
        job = self._host_jobs.get(i)
        return job is not None and not job.done()

    def wait_host(self, i: int) -> None:
        """Before layer i's host buffers are overwritten (its next gradient lands): its update is done."""
        job = self._host_jobs.pop(i, None)
        if job is not None:
            self._wait(job)
            job.result()

    def _wait(self, job: Future) -> None:
        t0 = time.perf_counter()
        futures_wait([job])
        with self._lock:
            self._times["wait_s"] += time.perf_counter() - t0

    def _wait_jobs(self) -> None:
        """The compute thread waits for all background work (the time is exposed optimizer time)."""
        jobs, self._jobs = self._jobs, []
        t0 = time.perf_counter()
        try:
            for job in jobs:
                job.result()
        finally:
            with self._lock:
                self._times["wait_s"] += time.perf_counter() - t0
            self._device_jobs.clear()
            self._host_jobs.clear()

    @contextmanager
    def _work(self, trailing: bool = False) -> Iterator[None]:
        """Host update work: counted in ``optimizer_s``, and in ``exposed_s`` when the compute thread does
        it itself (the EPS thread's share is hidden behind the device's work). The meter is paused: this is
        host-tier work, whichever thread runs it."""
        t0 = time.perf_counter()
        try:
            with self.acc.meter.paused():
                yield
        finally:
            dt = time.perf_counter() - t0
            on_eps = getattr(_THREAD, "eps_worker", False)
            with self._lock:
                self._times[("trailing_s" if trailing else "eps_s") if on_eps else "main_s"] += dt

    def pop_optimizer(self) -> dict[str, float]:
        """Since the last call: ``optimizer_s`` (host update work, any thread), ``optimizer_exposed_s``
        (the compute thread's share: updates it ran itself and its waits on the EPS thread), and the parts:
        ``eps_update_s`` (update work on the EPS thread behind the backward pass), ``trailing_update_s``
        (the trailing layer's, on the EPS thread behind the next forward) and ``optimizer_wait_s``."""
        with self._lock:
            t, self._times = self._times, dict.fromkeys(self._times, 0.0)
        return {
            "optimizer_s": t["main_s"] + t["eps_s"] + t["trailing_s"],
            "optimizer_exposed_s": t["main_s"] + t["wait_s"],
            "eps_update_s": t["eps_s"],
            "trailing_update_s": t["trailing_s"],
            "optimizer_wait_s": t["wait_s"],
        }

    def update_layer(self, i: int, lr: float, grad_mult: torch.Tensor | float | None) -> None:
        if self.realtime is not None:
            self.realtime.before_update(i)  # last step's file of this layer is complete
        with self.tier.holding(i, "wmvg", dirty=True):  # the disk tier writes the new state back
            self.layers[i].update(lr, grad_mult)
        if self.realtime is not None:
            self.realtime.layer_updated(i, *self.layer_file(i))

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        self.tier.close()

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
            with self.tier.holding(i, "wmv"):
                data = tensors_bytes(payload())
            yield name, data

    @torch.no_grad()
    def load_state(self, ckpt: Any, manifest: dict[str, Any]) -> None:
        for st in self.layers:
            t = read_tensors(ckpt, f"layer_{st.index}.safetensors", manifest)
            with self.tier.holding(st.index, "wmv", fresh=True, dirty=True):
                for key, buf in (("w", st.w), ("m", st.m), ("v", st.v)):
                    if key not in t or t[key].shape != buf.shape:
                        raise CheckpointError(f"{ckpt}: layer {st.index} {key} does not match this model")
                    buf.copy_(t[key])
                st.set_step(float(t["step"]))
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
            with self.tier.holding(st.index, "w"):
                named = [
                    (self.spec.hf_name(st.index, n), self.tier.export(t)) for n, t in st.layout.views(st.w)
                ]
            yield from named

    @torch.no_grad()
    def load_hf(self, tensors: Any) -> list[str]:
        """Stream matching tensors into the masters (one tensor at a time); returns names left at init."""
        missing = []
        for st in self.layers:
            with self.tier.holding(st.index, "wmv", dirty=True):
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
        parts.update(self.tier.host_parts())
        if self.ties is not None:
            parts["grads"] = parts.get("grads", 0) + self.ties.g.nbytes
            if self.ties.g_recv is not None:
                parts["recv_copy"] = parts.get("recv_copy", 0) + self.ties.g_recv.nbytes
        parts["cpu_stash"] = self.stash_bytes
        return {k: v for k, v in parts.items() if v}

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for the CPU activation stash (counted in host memory)."""
        buf = self.acc.host_empty(numel, dtype)
        self.stash_bytes += buf.nbytes
        return buf
