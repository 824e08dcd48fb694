"""What crosses between a pipeline's ranks: each micro-batch's hidden state (forward) and its gradient
(backward) between adjacent stages, posted as soon as computed and received as they arrive (L2L stages;
torch's schedules post their own), and the last stage's logits and loss to every rank of the pipeline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

Posted = tuple[torch.Tensor, Any]  # a message's buffer and its request


class _Batch:
    """The requests of one ``batch_isend_irecv``: NCCL returns one for the whole batch, gloo one per op."""

    def __init__(self, works: list[Any], n: int, k: int):
        self.works = [works[k]] if len(works) == n else works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class Inbox:
    """One stage's receives over one pass (n micro-batches from one peer): the first posted at once, each
    next one with the stage's send of the micro-batch before it (:meth:`StageMessages.send`), or, where
    the stage runs every micro-batch through a layer before it sends (several layers), one ahead of the
    one just taken. ``inbox[u]``: micro-batch u's message, for :meth:`StageMessages.arrived`."""

    def __init__(self, msgs: StageMessages, shape: tuple[int, ...], stage: int, n: int, backward: bool):
        self.msgs, self.shape, self.stage, self.n, self.backward = msgs, shape, stage, n, backward
        self.peer = msgs.rank_of(stage - 1 if not backward else stage + 1)
        self.posted: dict[int, Posted] = {}  # posted and not taken yet (a taken buffer is the caller's)
        self.next = 0  # the next micro-batch to post
        self.carried = False  # a send took one of these receives along

    def __getitem__(self, u: int) -> tuple[Inbox, int]:
        return self, u

    def next_op(self) -> tuple[Any, int] | None:
        """The next receive not posted yet (its op and micro-batch), its buffer made."""
        u = self.next
        if u >= self.n:
            return None
        self.next += 1
        buf = torch.empty(self.shape, dtype=torch.float32, device=self.msgs.device)
        tag = self.msgs.tag(self.stage, u, self.backward)
        return dist.P2POp(dist.irecv, buf, self.peer, self.msgs.group, tag), u


class StageMessages:
    """Hidden states and their gradients between the ranks of adjacent stages, in FP32 on ``group`` (the
    run's backend: NCCL between GPUs, gloo on CPU); ``rank_of(stage)``: the global rank running a stage in
    this pipeline. A message's tag names the receiving stage, the direction and the micro-batch.

    Every message goes in a ``batch_isend_irecv``, a micro-batch's send with the stage's next receive: on
    NCCL, sends and receives between two ranks run in the order posted on one stream, and a send larger than
    NCCL's buffer waits for its receive; posted one by one, they are safe only while both ranks' orders
    mirror each other, which nothing enforces. In one batch they cannot wait on each other.

    ``all_ahead`` (gloo): a stage's receives are all posted at once, in one batch, as the stage starts. gloo
    matches messages by tag and moves one only once both ends are posted: received one ahead, a sender's
    messages wait for the receiver's compute, and its next stage waits for them (:meth:`wait_sends`), which
    took the overlap of the modular placement's stages (measured bubble 0.37 against 0.16, issue 53)."""

    def __init__(
        self,
        group: Any,
        device: torch.device,
        num_ubatches: int,
        rank_of: Callable[[int], int],
        all_ahead: bool = False,
    ) -> None:
        self.group, self.device, self.num_ubatches, self.rank_of = group, device, num_ubatches, rank_of
        self.all_ahead = all_ahead
        self.sends: list[Posted] = []
        self.inboxes: dict[tuple[int, bool], Inbox] = {}  # each stage's receives of the pass under way
        self.blocked_s = 0.0  # host seconds blocked on a message (a receive, the sends' completion)

    def tag(self, stage: int, u: int, backward: bool) -> int:
        """A message's tag: the receiving stage, the direction and the micro-batch."""
        return ((2 * stage + int(backward)) * self.num_ubatches + u) % (2**31)

    def _post(self, ops: list[tuple[Any, Inbox | None, int]]) -> None:
        """One batch: (op, the inbox of a receive or None for a send, micro-batch)."""
        works = dist.batch_isend_irecv([op for op, _, _ in ops])
        for k, (op, inbox, u) in enumerate(ops):
            req = _Batch(works, len(ops), k)
            if inbox is None:
                self.sends.append((op.tensor, req))
            else:
                inbox.posted[u] = (op.tensor, req)

    def recv(self, shape: tuple[int, ...], stage: int, n: int, backward: bool) -> Inbox:
        """The receives of ``stage``'s n micro-batches (from the stage below in forward, above in backward),
        the first posted now (all of them with ``all_ahead``); ``inbox[u]`` is waited for one at a time
        (:meth:`arrived`)."""
        inbox = self.inboxes[(stage, backward)] = Inbox(self, shape, stage, n, backward)
        ops = []
        while (op := inbox.next_op()) is not None:
            ops.append((op[0], inbox, op[1]))
            if not self.all_ahead:
                break
        if ops:
            self._post(ops)
        return inbox

    def send(self, x: torch.Tensor, stage: int, u: int, backward: bool) -> None:
        """Post micro-batch ``u``'s tensor from ``stage`` to the next stage's rank (the previous one's in
        backward), in one batch with the stage's next receive, if one is still to post;
        :meth:`wait_sends` waits for every send posted."""
        peer = self.rank_of(stage + 1 if not backward else stage - 1)
        t = x.detach().float().contiguous()
        tag = self.tag(stage + (1 if not backward else -1), u, backward)
        ops: list[tuple[Any, Inbox | None, int]] = [
            (dist.P2POp(dist.isend, t, peer, self.group, tag), None, u)
        ]
        inbox = self.inboxes.get((stage, backward))
        nxt = inbox.next_op() if inbox is not None else None
        if nxt is not None:
            assert inbox is not None
            inbox.carried = True
            ops.append((nxt[0], inbox, nxt[1]))
        self._post(ops)

    def arrived(self, req: tuple[Inbox, int], dtype: torch.dtype) -> torch.Tensor:
        """Micro-batch u's message once it is in, in ``dtype``. Where no send carried the stage's receives
        (it sends after its last layer, or not at all), the next one is posted now, ahead."""
        inbox, u = req
        ops = []
        while inbox.next <= u:  # not posted yet: now, in one batch (with the one after it)
            op = inbox.next_op()
            assert op is not None
            ops.append((op[0], inbox, op[1]))
        if not inbox.carried and u >= 1 and (ahead := inbox.next_op()) is not None:
            ops.append((ahead[0], inbox, ahead[1]))
        if ops:
            self._post(ops)
        buf, handle = inbox.posted.pop(u)
        t0 = time.perf_counter()
        handle.wait()
        self.blocked_s += time.perf_counter() - t0
        return buf.to(dtype)

    def wait_sends(self) -> None:
        t0 = time.perf_counter()
        for _, h in self.sends:
            h.wait()
        self.sends = []
        self.blocked_s += time.perf_counter() - t0

    def pop_blocked(self) -> float:
        """Host seconds blocked on messages since the last call: on a CPU device (gloo) what the rank
        waited for its neighbours; on CUDA a wait is queued on the stream and this counts the host's only."""
        out, self.blocked_s = self.blocked_s, 0.0
        return out


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
