"""A pipeline stage as torch's engine runs it: the module of its layers (``StageModule``), and torch's
``PipelineStage`` timing each chunk (``TimedStage``) on the rank's ``Timeline``.

Side inputs are rebuilt per stage from the batch, not sent with the activations: every rank of a pipeline
reads the same data shard, and torch's schedules hand every stage the same keyword arguments cut into the
same micro-batches, so the attention mask (and the labels, and the micro-batch index that seeds dropout)
reach each stage without crossing the network. Only hidden states travel between ranks.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from l2l_cli.data.batches import Batch
from l2l_cli.models.base import POST, ModelSpec
from l2l_cli.modes.base import RunnerBase


def _ubatch(ids: torch.Tensor | None, tt: torch.Tensor | None, mask: torch.Tensor, labels: Any) -> Batch:
    none = mask.new_empty(0)
    return Batch(ids if ids is not None else none, tt if tt is not None else none, mask,
                 labels if labels is not None else none)  # fmt: skip


class StageModule(nn.Module):
    """The layers of one stage. Its forward takes the stage's input (token ids and segment ids for the first
    stage, hidden states otherwise) and, as keyword arguments cut into the same micro-batches on every
    stage, the attention mask, the micro-batch index (dropout seeding) and, training, the labels; the last
    stage returns the micro-batch's loss (training) or its logits."""

    def __init__(self, spec: ModelSpec, index: list[int], layers: list[nn.Module], runner: RunnerBase):
        super().__init__()
        self.spec, self.index = spec, index
        self.layers = nn.ModuleList(layers)
        self.runner = runner  # dropout seeding and the precision (a plain object, not a submodule)

    def forward(
        self, *x: torch.Tensor, mask: torch.Tensor, ubatch: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        runner, spec = self.runner, self.spec
        u = int(ubatch[0])
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
    """When this rank computed during the schedule: (start, end) of every forward and backward chunk."""

    def __init__(self) -> None:
        self.chunks: list[tuple[str, float, float]] = []

    def add(self, kind: str, t0: float) -> None:
        self.chunks.append((kind, t0, time.perf_counter()))

    def pop(self, t0: float, t1: float) -> dict[str, float]:
        """This step's times: compute by kind, idle (before the first chunk and after the last: the
        pipeline's fill and drain), wait (between chunks: blocked on a neighbour)."""
        chunks, self.chunks = self.chunks, []
        out = {"forward": 0.0, "backward": 0.0}
        for kind, a, b in chunks:
            out[kind] += b - a
        compute = out["forward"] + out["backward"]
        idle = (chunks[0][1] - t0) + (t1 - chunks[-1][2]) if chunks else t1 - t0
        out.update(pipeline=t1 - t0, compute=compute, idle=idle, wait=max(0.0, t1 - t0 - compute - idle))
        return out


class TimedStage(PipelineStage):
    """torch's ``PipelineStage``, timing each chunk's compute, and telling the runner when the stage's
    last micro-batch is through backward (torch's REDUCE_GRAD point) so its reduction can start."""

    def __init__(self, *args: Any, timeline: Timeline, grads_ready: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.timeline, self.grads_ready = timeline, grads_ready

    def forward_one_chunk(self, *args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return super().forward_one_chunk(*args, **kw)
        finally:
            self.timeline.add("forward", t0)

    def backward_one_chunk(self, *args: Any, **kw: Any) -> None:
        t0 = time.perf_counter()
        try:
            super().backward_one_chunk(*args, **kw)
        finally:
            self.timeline.add("backward", t0)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        super().perform_reduce_grad(grad_scale_factor)
        if self.has_backward:
            self.grads_ready(self.stage_index)
