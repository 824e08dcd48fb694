"""What crosses between a pipeline's ranks: each micro-batch's hidden state (forward) and its gradient
(backward) between adjacent stages, posted as soon as computed and received as they arrive (L2L stages;
torch's schedules post their own), and the last stage's logits and loss to every rank of the pipeline."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

Posted = tuple[torch.Tensor, Any]  # a message's buffer and its request


class StageMessages:
    """Hidden states and their gradients between the ranks of adjacent stages, in FP32 on ``group`` (the
    run's backend: NCCL between GPUs, gloo on CPU); ``rank_of(stage)``: the global rank running a stage in
    this pipeline. A message's tag names the receiving stage, the direction and the micro-batch."""

    def __init__(
        self, group: Any, device: torch.device, num_ubatches: int, rank_of: Callable[[int], int]
    ) -> None:
        self.group, self.device, self.num_ubatches, self.rank_of = group, device, num_ubatches, rank_of
        self.sends: list[Posted] = []

    def tag(self, stage: int, u: int, backward: bool) -> int:
        """A message's tag: the receiving stage, the direction and the micro-batch."""
        return ((2 * stage + int(backward)) * self.num_ubatches + u) % (2**31)

    def recv(self, shape: tuple[int, ...], stage: int, n: int, backward: bool) -> list[Posted]:
        """Post the receives of ``stage``'s n micro-batches (from the stage below in forward, above in
        backward): (buffer, request) per micro-batch, waited for one at a time (:meth:`arrived`)."""
        peer = self.rank_of(stage - 1 if not backward else stage + 1)
        out = []
        for u in range(n):
            buf = torch.empty(shape, dtype=torch.float32, device=self.device)
            out.append((buf, dist.irecv(buf, src=peer, group=self.group, tag=self.tag(stage, u, backward))))
        return out

    def send(self, x: torch.Tensor, stage: int, u: int, backward: bool) -> None:
        """Post micro-batch ``u``'s tensor from ``stage`` to the next stage's rank (the previous one's in
        backward); :meth:`wait_sends` waits for every send posted."""
        peer = self.rank_of(stage + 1 if not backward else stage - 1)
        t = x.detach().float().contiguous()
        tag = self.tag(stage + (1 if not backward else -1), u, backward)
        self.sends.append((t, dist.isend(t, dst=peer, group=self.group, tag=tag)))

    @staticmethod
    def arrived(req: Posted, dtype: torch.dtype) -> torch.Tensor:
        """A posted receive's tensor once it is in, in ``dtype``."""
        buf, handle = req
        handle.wait()
        return buf.to(dtype)

    def wait_sends(self) -> None:
        for _, h in self.sends:
            h.wait()
        self.sends = []


def from_last_stage(t: torch.Tensor, src: int, group: Any) -> torch.Tensor:
    """``t`` as the last stage's rank (global ``src``) has it, on every rank of the pipeline (``group``:
    its host group): the step's loss."""
    dist.broadcast(t, src=src, group=group)
    return t


def logits_from_last_stage(logits: torch.Tensor | None, src: int, group: Any) -> torch.Tensor:
    """The logits the last stage's rank computed (``logits``, float on the host; None on the other ranks)
    on every rank of the pipeline: their shape first, (rows, labels) for a classifier, (rows, sequence,
    vocabulary) for a language model, then the values."""
    shape = torch.zeros(3, dtype=torch.long)
    if logits is not None:
        shape[: logits.dim()] = torch.tensor(logits.shape)
    dist.broadcast(shape, src=src, group=group)
    out = logits if logits is not None else torch.empty([int(d) for d in shape if d > 0])
    dist.broadcast(out, src=src, group=group)
    return out
