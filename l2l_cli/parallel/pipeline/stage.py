"""A pipeline stage as torch's engine runs it: the module of its layers (``StageModule``), and torch's
``PipelineStage`` timing each chunk (``TimedStage``) on the rank's ``Timeline``.

Side inputs are rebuilt per stage from the batch, not sent with the activations: every rank of a pipeline
reads the same data shard, and torch's schedules hand every stage the same keyword arguments cut into the
same micro-batches, so the attention mask (and the labels) reach each stage without crossing the network.
The micro-batch index that seeds dropout is the schedule's own chunk id, set on the module before each
forward (no tensor read back on the host per micro-batch). Only hidden states travel between ranks.

On CUDA a chunk's compute is timed with CUDA events (kernels run after the host returns); they are read
once per step, after the schedule's end, so timing adds no host wait per micro-batch.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from l2l_cli.data.batches import Batch
from l2l_cli.engine.device import timing_event
from l2l_cli.models.base import POST, ModelSpec
from l2l_cli.modes.base import RunnerBase


def _ubatch(ids: torch.Tensor | None, tt: torch.Tensor | None, mask: torch.Tensor, labels: Any) -> Batch:
    none = mask.new_empty(0)
    return Batch(
        ids if ids is not None else none,
        tt if tt is not None else none,
        mask,
        labels if labels is not None else none,
    )


class StageModule(nn.Module):
    """The layers of one stage. Its forward takes the stage's input (token ids and segment ids for the first
    stage, hidden states otherwise) and, as keyword arguments cut into the same micro-batches on every
    stage, the attention mask and, training, the labels; the last stage returns the micro-batch's loss
    (training) or its logits. ``ubatch``: the micro-batch the next forward runs (dropout seeding), set by
    :class:`TimedStage` from the schedule's chunk id."""

    def __init__(self, spec: ModelSpec, index: list[int], layers: list[nn.Module], runner: RunnerBase):
        super().__init__()
        self.spec, self.index = spec, index
        self.layers = nn.ModuleList(layers)
        self.runner = runner  # dropout seeding and the precision (a plain object, not a submodule)
        self.ubatch = 0

    def forward(
        self, *x: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        runner, spec, u = self.runner, self.spec, self.ubatch
        first = self.index[0] == 0
        ub = _ubatch(x[0] if first else None, x[1] if first else None, mask, labels)
        h = None if first else x[0]
        side = None
        with runner.precision.autocast():
            for i, layer in zip(self.index, self.layers):
                if self.training:
                    runner.seed_dropout(i, u)  # the masks one process draws for (step, layer, micro-batch)
                if spec.kind(i) == POST:
                    if labels is None:
                        return spec.head_logits(layer, h).float()
                    loss, _ = spec.run_head(layer, h, ub)
                    return loss.float()
                if side is None and h is not None:  # the mask in the hidden states' dtype, as one process
                    side = spec.side_inputs(ub, h.dtype)
                h = spec.run_layer(layer, i, h, ub, side)
        assert h is not None
        return h.float()  # FP32 on the wire whatever the precision: the next stage's buffers are FP32


class Timeline:
    """When this rank computed during the schedule: (start, end) of every forward and backward chunk, on
    the host clock; on CUDA also a pair of events per chunk, whose elapsed time is its compute."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.chunks: list[tuple[str, float, float]] = []
        self.events: list[tuple[Any, Any]] = []
        self.recv_waits: list[tuple[float, float]] = []  # blocked on a neighbour's message (own recvs, gloo)
        # (stage, kind) -> [host seconds, chunks] over the run: each stage's mean chunk (hardware=measure)
        self.by_stage: dict[tuple[int, str], list[float]] = {}

    def start(self) -> tuple[float, Any]:
        ev = None
        if self.cuda:
            ev = timing_event()
            ev.record()  # on the current stream: the one the chunk's kernels are queued on
        return time.perf_counter(), ev

    def add(self, kind: str, t0: float, ev: Any = None, stage: int = -1) -> None:
        t1 = time.perf_counter()
        self.chunks.append((kind, t0, t1))
        acc = self.by_stage.setdefault((stage, kind), [0.0, 0.0])
        acc[0], acc[1] = acc[0] + t1 - t0, acc[1] + 1
        if ev is not None:
            end = timing_event()
            end.record()
            self.events.append((ev, end))

    def _durations(self) -> list[float]:
        """Each chunk's compute: the host interval, or on CUDA its events' (one wait, for the last)."""
        events, self.events = self.events, []
        if not events or len(events) != len(self.chunks):
            return [b - a for _, a, b in self.chunks]
        events[-1][1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in events]

    def pop(self, t0: float, t1: float) -> dict[str, float]:
        """This step's times: compute by kind, idle (before the first chunk and after the last: the
        pipeline's fill and drain), wait (between chunks: blocked on a neighbour)."""
        durations = self._durations()
        chunks, self.chunks = self.chunks, []
        waits, self.recv_waits = self.recv_waits, []
        out = {"forward": 0.0, "backward": 0.0}
        for (kind, _, _), d in zip(chunks, durations):
            out[kind] += d
        compute = out["forward"] + out["backward"]
        idle = (chunks[0][1] - t0) + (t1 - chunks[-1][2]) if chunks else t1 - t0
        wait = max(0.0, t1 - t0 - compute - idle)
        recv_wait = sum(b - a for a, b in waits if chunks and a >= chunks[0][1])  # the fill's wait is idle
        # between chunks: blocked on a message (recv_wait, where the stage times its recvs), and the rest:
        # the schedule's own work per action (posting sends and recvs, its bookkeeping, Python)
        out.update(
            pipeline=t1 - t0,
            compute=compute,
            idle=idle,
            wait=wait,
            recv_wait=min(recv_wait, wait),
            overhead=max(0.0, wait - recv_wait),
            chunks=float(len(chunks)),
        )
        return out


class RecvsAhead:
    """gloo: every receive of a rank's training step posted at once, at the first its schedule asks for, in
    the order the schedule would post them (``order``: (kind, stage, micro-batch), read off the schedule,
    ``StagePlan.orders``). gloo moves a message only once both ends are posted; posted just before the
    chunk that reads it, every message waited for its sender's core (it was computing its next chunk) and
    the modular placement's many messages idled its ranks (issue 53; the L2L stages' ``all_ahead``). Its
    messages carry no tags, so they match by order per peer: the order stays the schedule's, only sooner.
    Each chunk has its own receive buffers, free until that chunk reads them."""

    def __init__(self, order: list[tuple[str, int, int]]):
        self.order = order
        self.stages: dict[int, TimedStage] = {}
        self.posted = False

    def start_step(self) -> None:
        self.posted = False

    def post_all(self) -> None:
        """(At the step's first receive.) Every receive of the step, in order."""
        self.posted = True
        for kind, s, u in self.order:
            st = self.stages[s]
            get = PipelineStage.get_fwd_recv_ops if kind == "forward" else PipelineStage.get_bwd_recv_ops
            ops = get(st, u)
            if ops:
                st._recvs[(kind, u)] = [dist.irecv(op.tensor, op.peer, op.group, op.tag) for op in ops]


class TimedStage(PipelineStage):
    """torch's ``PipelineStage``, timing each chunk's compute, and telling the runner when the stage's
    last micro-batch is through backward (torch's REDUCE_GRAD point) so its reduction can start."""

    def __init__(
        self,
        *args: Any,
        timeline: Timeline,
        grads_ready: Any,
        own_recvs: bool = False,
        ahead: RecvsAhead | None = None,
        **kw: Any,
    ):
        super().__init__(*args, **kw)
        self.timeline, self.grads_ready = timeline, grads_ready
        self.ahead = ahead  # own_recvs: the rank's receives all posted at the step's first (training)
        if ahead is not None:
            ahead.stages[self.stage_index] = self
        # gloo: the stage posts its recvs itself where the schedule would, and waits for them just before the
        # chunk that reads them, timed (the schedule's wait is the same, untimed). Not on NCCL, whose
        # schedules fuse a recv with sends in one batch to avoid deadlock.
        self.own_recvs = own_recvs
        self._recvs: dict[tuple[str, int], list[Any]] = {}

    def _post(self, kind: str, chunk: int, ops: list[Any]) -> list[Any]:
        if not self.own_recvs or not ops:
            return ops
        if self.ahead is not None:
            if not self.ahead.posted:
                self.ahead.post_all()
            return []
        self._recvs[(kind, chunk)] = [dist.irecv(op.tensor, op.peer, op.group, op.tag) for op in ops]
        return []  # nothing left for the schedule to post or wait on

    def _wait(self, kind: str, chunk: int) -> None:
        works = self._recvs.pop((kind, chunk), None)
        if works:
            t0 = time.perf_counter()
            for w in works:
                w.wait()
            self.timeline.recv_waits.append((t0, time.perf_counter()))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[Any]:
        return self._post("forward", fwd_chunk_id, super().get_fwd_recv_ops(fwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[Any]:
        return self._post("backward", bwd_chunk_id, super().get_bwd_recv_ops(bwd_chunk_id))

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kw: Any) -> Any:
        self.submod.ubatch = fwd_chunk_id  # the micro-batch index, from the schedule (no host sync)
        self._wait("forward", fwd_chunk_id)
        t0, ev = self.timeline.start()
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kw)
        finally:
            self.timeline.add("forward", t0, ev, self.stage_index)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kw: Any) -> None:
        self._wait("backward", bwd_chunk_id)
        t0, ev = self.timeline.start()
        try:
            super().backward_one_chunk(bwd_chunk_id, *args, **kw)
        finally:
            self.timeline.add("backward", t0, ev, self.stage_index)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        super().perform_reduce_grad(grad_scale_factor)
        if self.has_backward:
            self.grads_ready(self.stage_index)
