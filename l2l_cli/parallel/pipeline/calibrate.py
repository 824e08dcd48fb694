"""``hardware=measure``: what a message and a schedule action cost on the pipeline's own group and
backend, measured once, where a runner is built (:func:`link_costs`; the summary only reports them).

The per-action cost (``hardware.pipe_action_us``): torch's breadth-first schedule over stand-in stages
that compute nothing but keep the device busy as a chunk does (a spinning GPU kernel on CUDA, timed by the
stage's CUDA events as real chunks are; the core elsewhere) and send messages of the run's size. The cost
is what the pre-run model charges: the per-action seconds at which the dependency-ordered simulation of
this very schedule (``plan.simulate``, on the chunks' measured durations and the measured exchange of that
size) takes as long as the step did (``plan.fit_action``), fitted per step and the median over the steps
taken: a chunk's call into the schedule and autograd, a posted send or recv, the schedule's bookkeeping,
one constant. One suffices: the simulation charges it to each chunk, send and recv alike, and this
schedule's mix of them is the modular placements'; the contiguous ones post about one message per chunk
instead of two (``benchmarks/pipeline_bubble.py``'s rows check it). Measurement code, apart from the
product stage (``stage.py``)."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import ScheduleLoopedBFS

from l2l_cli.engine.device import keep_busy, synchronize
from l2l_cli.parallel.pipeline.bubble import LinkCosts
from l2l_cli.parallel.pipeline.groups import Groups
from l2l_cli.parallel.pipeline.plan import StagePlan, fit_action, table_cost
from l2l_cli.parallel.pipeline.settings import PipelineSettings
from l2l_cli.parallel.pipeline.stage import TimedStage, Timeline

STAGES_PER_RANK = 2  # the calibration's modular pipeline: 2 stages per rank (S = 2P), breadth-first
UBATCHES = 8
HIDDEN = 4  # floats per message where no size is given: near-zero bytes
STEPS = 24  # timed steps (the first is not counted): a fit per step, their median
BUSY_S = 0.005  # each stand-in chunk keeps its device busy this long, as a real layer's chunk does: the
# action's cost under load, not on an idle core


class StandIn(nn.Module):
    """A stage with no compute (one scalar weight), with the inputs, outputs and messages of a real one, that
    keeps its device busy ``busy_s`` per chunk the way a real chunk does (``keep_busy``: a GPU kernel on
    CUDA, which the timeline's CUDA events time; the host's core elsewhere, which its clock times)."""

    def __init__(self, first: bool, last: bool, hidden: int, busy_s: float = 0.0):
        super().__init__()
        self.first, self.last, self.hidden, self.busy_s = first, last, hidden, busy_s
        self.w = nn.Parameter(torch.ones(()))
        self.ubatch = 0

    def forward(
        self, *x: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.first:
            h = self.w * x[0].new_ones((*x[0].shape, self.hidden), dtype=torch.float32)
        else:
            h = x[0] * self.w
        keep_busy(x[0].device, self.busy_s)  # on the device, as a real chunk: the stage's events time it
        return h.mean() if self.last else h


def time_exchange(
    group: Any, host: Any, device: torch.device, peers: tuple[int, int], nbytes: float, repeats: int = 15
) -> float:
    """One exchange's seconds on ``group`` (``nbytes`` to ``peers[1]``, as many from ``peers[0]``; global
    ranks; ``host``: a gloo group over the same ranks for the barriers; ``None``: the default group):
    the median of ``repeats`` after one warm-up (an inflated latency would hide the actions in the fit).
    Collective over the group."""
    n = max(1, int(nbytes) // 4)
    out, into = torch.zeros(n, device=device), torch.empty(n, device=device)
    times = []
    for _ in range(repeats + 1):
        dist.barrier(group=host)
        t0 = time.perf_counter()
        # posted together: two unbatched p2p ops to one peer run in order on NCCL's stream, and a send
        # above NCCL's buffer waits for the peer's recv, queued behind that peer's own send: a deadlock
        ops = [dist.P2POp(dist.isend, out, peers[1], group), dist.P2POp(dist.irecv, into, peers[0], group)]
        for r in dist.batch_isend_irecv(ops):
            r.wait()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


# messages per side of the wake probe: the wake is a tail (some messages only), so a mean over many
# (docs/benchmarks.md, "The pipeline's constants")
WAKE_REPS = 100
WAKE_BUSY_S = 0.01  # the sender computes this long after posting its send; the recv comes a quarter in


def _compute(seconds: float) -> None:
    """Keep this rank's core busy with torch compute (a chunk's kind: the GIL released), ``seconds``."""
    a = torch.full((128, 128), 1.0 / 128)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = a @ a


def wake_seconds(group: Any, host: Any, device: torch.device, hidden: int, reps: int = WAKE_REPS) -> float:
    """How much later a message arrives when its sender computes than when it idles
    (``hardware.pipe_wake_us``): pipeline rank 0 posts a send, then computes (or sleeps) 10 ms; rank 1
    posts the recv 2.5 ms in and times it; the difference of the means. gloo moves a message on a thread of
    the sender's process, which waits for a core the chunk holds (an OS scheduler slice, milliseconds, on
    some of the messages); on CUDA the copies run beside compute: 0 (and NCCL's point-to-point ops go in
    batches only: the L2L stages' rule). Collective over the pipeline."""
    if device.type == "cuda" or dist.get_backend(group) != "gloo":
        return 0.0
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    buf = torch.zeros(hidden, device=device)
    times: dict[bool, list[float]] = {False: [], True: []}
    for k in range(2 * reps + 2):
        busy = k % 2 == 1
        dist.barrier(group=host)
        if rank == 0:
            work = dist.isend(buf, dst=ranks[1], group=group)
            if busy:
                _compute(WAKE_BUSY_S)
            else:
                time.sleep(WAKE_BUSY_S)
            work.wait()
        elif rank == 1:
            time.sleep(WAKE_BUSY_S / 4)
            t0 = time.perf_counter()
            dist.irecv(buf, src=ranks[0], group=group).wait()
            if k >= 2:  # the first of each: warm-up
                times[busy].append(time.perf_counter() - t0)
    out = torch.zeros(1, dtype=torch.float64)
    if rank == 1:
        out[0] = max(0.0, statistics.mean(times[True]) - statistics.mean(times[False]))
    dist.all_reduce(out, group=host)  # rank 1's value on every rank
    return float(out[0]) if P > 1 else 0.0


def action_seconds(
    group: Any,
    host: Any,
    device: torch.device,
    backend: str,
    steps: int = STEPS,
    busy_s: float = BUSY_S,
    nbytes: float = 4 * HIDDEN,
) -> tuple[float, float]:
    """(Seconds one schedule action costs beyond its compute and its messages' latency, the message wake
    of :func:`wake_seconds`), on ``group``'s
    backend (``backend``; ``host``: a gloo group over the same ranks, for the barriers): per timed step,
    the action cost at which the simulation of the step's schedule, on the chunks each rank timed that
    step, takes the step's time; the median over the steps. Messages of ``nbytes`` (the run's hidden
    state), their exchange timed beside: what their copies cost the ranks' cores beyond that (gloo copies
    on the rank's own core) lands in the action, as it does in the run; the wake is measured first and
    simulated in the fit, so the action does not absorb it. Collective over the pipeline."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    hidden = max(1, int(nbytes) // 4)  # the run's message size: its copies cost the ranks' cores (gloo)
    latency_s = time_exchange(group, host, device, (ranks[(rank - 1) % P], ranks[(rank + 1) % P]), 4 * hidden)
    wake_s = wake_seconds(group, host, device, hidden)
    keep_busy(device, 0.0)  # (CUDA: the spin's rate timed now, outside any chunk)
    plan = StagePlan(STAGES_PER_RANK * P, P, "modular", 1)
    S, n, rows = plan.num_stages, UBATCHES, 1
    timeline = Timeline(cuda=device.type == "cuda")

    def meta(shape: tuple[int, ...], dtype: torch.dtype, grad: bool) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device="meta")
        return t.requires_grad_(grad) if dtype.is_floating_point else t

    stages = []
    for s in plan.stages_of(rank):
        ids = meta((rows, 1), torch.long, False)
        inputs = (ids, ids) if s == 0 else (meta((rows, 1, hidden), torch.float32, True),)
        out = meta((), torch.float32, True) if s == S - 1 else meta((rows, 1, hidden), torch.float32, True)
        stages.append(
            TimedStage(
                StandIn(s == 0, s == S - 1, hidden, busy_s).to(device),
                s,
                S,
                device,
                input_args=inputs,
                output_args=out,
                group=group,
                timeline=timeline,
                grads_ready=lambda _: None,
                own_recvs=backend == "gloo",
            )
        )
    sched = ScheduleLoopedBFS(stages, n, loss_fn=lambda out, target: out, scale_grads=False)
    ids = torch.zeros((n * rows, 1), dtype=torch.long, device=device)
    args = (ids, ids) if 0 in plan.stages_of(rank) else ()
    per_chunk = n * plan.stages_per_rank
    mine = torch.zeros(
        (steps - 1, P, 3), dtype=torch.float64
    )  # per step: pipeline s, forward, backward chunk
    for k in range(steps):
        dist.barrier(group=host)
        t0 = time.perf_counter()
        sched.step(*args, target=ids, losses=[], return_outputs=False, mask=ids, labels=ids)
        dist.barrier(group=host)
        c = timeline.pop(t0, time.perf_counter())
        if k > 0:
            mine[k - 1, rank] = torch.tensor(
                [c["pipeline"], c["forward"] / per_chunk, c["backward"] / per_chunk]
            )
    dist.all_reduce(mine, group=host)  # every rank's steps, on every rank
    orders = plan.orders(n, "ScheduleLoopedBFS", True)
    fits = []
    for step in mine.tolist():
        table = {s: (step[r][1], step[r][2]) for r in range(P) for s in plan.stages_of(r)}
        fits.append(fit_action(orders, table_cost(table), latency_s, max(x[0] for x in step), wake_s=wake_s))
    return statistics.median(fits), wake_s


def link_costs(
    s: PipelineSettings,
    groups: Groups,
    peers: tuple[int, int],
    backend: str,
    device: torch.device,
    nbytes: float,
) -> LinkCosts:
    """What the bubble model charges a message and a schedule action: with ``hardware=measure`` timed here
    on the pipeline's own group (``groups.pp``; ``groups.pp_host`` for the barriers) with messages of
    ``nbytes``: one exchange between this rank's neighbours (``peers``: the previous and the next rank,
    global) and :func:`action_seconds`; else the ``hardware`` preset's, unsure where its figures describe
    another transport than ``backend`` (``hardware.pipe_link``). On a CPU device the exchange is timed
    either way (16 of them, milliseconds): the model's own message between processes on CPUs (gloo), which
    no preset's network describes. Collective over the pipeline when anything is timed: the runner calls
    it once, as it is built."""
    exchange = None
    if s.measure_p2p or device.type == "cpu":
        exchange = time_exchange(groups.pp, groups.pp_host, device, peers, nbytes)
    if not s.measure_p2p:
        costs = LinkCosts.preset(s, backend)
        if exchange is None:
            return costs
        return replace(costs, exchange_measured_s=exchange, exchange_from="timed at build")
    action, wake = action_seconds(groups.pp, groups.pp_host, device, backend, nbytes=nbytes)
    return LinkCosts(action, wake, "measured", exchange)
