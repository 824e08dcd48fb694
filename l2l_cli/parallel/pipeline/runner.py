"""Pipeline parallelism with layered gradient accumulation (layered-GA paper §3-§4, Figures 1-3), on torch's
own pipeline engine (``torch.distributed.pipelining``: ``PipelineStage`` and its schedules).

``dist.nproc=N dist.pipeline=P``: the ranks form N/P pipelines of P ranks (data parallel across them). The
model's transformer layers are cut into stages of ``dist.layers_per_stage`` layers (the embeddings go
with the first stage, the head with the last) and placed

- ``modular`` (the paper's §4): stage s on pipeline rank s mod P, so a micro-batch reaches the last rank
  after P-1 stages instead of L(1-1/P) layers and the bubble shrinks by L/P;
- ``contiguous``: the usual blocks of L/P layers, one stage per rank.

``dist.schedule``: ``breadth_first`` is torch's ``ScheduleLoopedBFS``: each rank runs every micro-batch
through one of its stages before the next (layered gradient accumulation across ranks, Figure 3's
modular pipeline); ``interleaved_1f1b`` (``ScheduleInterleaved1F1B``), and ``gpipe`` / ``1f1b``, which
take one stage per rank. ``mode`` names what each stage runs: Alg. 2 (``baseline_ag``), the stage's
layers, gradients and optimizer state resident on the rank's device (this runner); an EPS mode runs L2L
stages (``l2l_stages.py``).

Side inputs are rebuilt per stage from the batch (stage.py); only hidden states travel between ranks.

Data parallel across pipelines: as soon as a stage's last micro-batch finishes backward (torch's
REDUCE_GRAD action), its gradient starts an asynchronous reduction on the data-parallel group (a group of
its own, on the run's backend, like the EPS's eager per-layer reduction), overlapping the backward of the stages below it.
``dist.partition_state``: the reduction is a reduce-scatter, each data-parallel rank updates its shard of
every stage with the optimizer state of that shard only, and an all-gather brings the updated weights back.

Measured, per rank and step: compute (forward and backward chunks), idle (the pipeline's fill and drain:
before a rank's first chunk and after its last), wait (blocked on a neighbour between chunks), and the
bubble = 1 - compute / pipeline time, next to appendix C's prediction (§2.4 and §4).
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import ScheduleLoopedBFS

from l2l_cli.checkpoint import ModuleState, module_state_files
from l2l_cli.data.batches import Batch
from l2l_cli.engine.dist import DistContext
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.optim import clip_coefficients
from l2l_cli.models.base import BLOCK, POST, PRE
from l2l_cli.modes.base import RunnerArgs, RunnerBase, StepReport
from l2l_cli.modes.registry import ModeSpec
from l2l_cli.parallel.pipeline.calibrate import action_seconds, time_exchange
from l2l_cli.parallel.pipeline.plan import (
    Op,
    StagePlan,
    count,
    exchange_seconds,
    hidden_bytes,
    split_by_weight,
    table_cost,
)
from l2l_cli.parallel.pipeline.settings import SCHEDULES, PipelineSettings, schedule_class, torch_problem
from l2l_cli.parallel.pipeline.stage import TimedStage, Timeline
from l2l_cli.parallel.pipeline.state import Shard, StageState

MAX_SCHEDULES = 8  # one per padded batch shape (torch fixes shapes at a schedule's first step), LRU


def layout(ctx: DistContext, s: PipelineSettings) -> DistContext:
    """Ranks [d·P, (d+1)·P) form pipeline d and share data shard d; the first pipeline evaluates."""
    P = s.pipeline
    return replace(
        ctx, data_rank=ctx.rank // P, data_world=max(1, ctx.world // P), eval_ranks=tuple(range(P))
    )


def pipeline_position(ctx: DistContext, P: int) -> tuple[int, int, int]:
    """This rank's place: (its pipeline rank, its pipeline's index = data-parallel rank, the pipelines)."""
    if ctx.world % P:
        raise RuntimeError(f"dist.pipeline={P} does not divide the {ctx.world} ranks launched")
    return ctx.rank % P, ctx.rank // P, ctx.world // P


@dataclass(frozen=True)
class Groups:
    """This rank's process groups: ``pp`` carries the hidden states between pipeline ranks (the run's
    backend: NCCL between GPUs, whose send/recv take device tensors; gloo on CPU); ``dp`` the data-parallel
    reduction; ``pp_host`` the pipeline's small host-side collectives (the loss, the norms, logits, the
    gathered checkpoint): gloo, the same group as ``pp`` where that is gloo."""

    pp: Any
    dp: Any
    pp_host: Any


def pipeline_groups(
    P: int, world: int, pp_rank: int, dp_rank: int, backend: str, dp_backend: str | None = None
) -> Groups:
    """This rank's groups: pipelines are consecutive ranks, data-parallel groups share a pipeline rank;
    every rank creates every group, in the same order, as torch.distributed requires. ``dp_backend``: the
    data-parallel group's when it differs (an EPS reduces host buffers, on gloo)."""
    pp = dp = host = None
    for d in range(world // P):
        ranks = [d * P + i for i in range(P)]
        g = dist.new_group(ranks, backend=backend)
        h = g if backend == "gloo" else dist.new_group(ranks, backend="gloo")
        pp, host = (g, h) if d == dp_rank else (pp, host)
    for i in range(P):
        g = dist.new_group([d * P + i for d in range(world // P)], backend=dp_backend or backend)
        dp = g if i == pp_rank else dp
    return Groups(pp, dp, host)


def exchange_s(
    s: PipelineSettings, groups: tuple[Any, Any], peers: tuple[int, int], nbytes: float, device: torch.device
) -> tuple[float, str]:
    """Seconds of one exchange between pipeline neighbours (a hidden state out, one in) and where the number
    comes from: with ``hardware=measure`` timed here on the pipeline's own group (each rank sends ``nbytes``
    to the next rank and receives as many from the previous; the median of 15), else the ``hardware``
    preset's latency plus the bytes over its network. Collective over the pipeline (``groups``: the
    messages' group and its host group; ``peers``: the previous and the next rank, global)."""
    if not s.measure_p2p:
        return exchange_seconds(nbytes, s.p2p_latency_s, s.p2p_bytes_per_s), "hardware"
    return time_exchange(groups[0], groups[1], device, peers, nbytes), "measured"


def action_s(
    s: PipelineSettings, groups: tuple[Any, Any], backend: str, device: torch.device, nbytes: float
) -> tuple[float, float, str]:
    """Seconds one schedule action costs beyond compute and bytes, the seconds a message waits for its
    computing sender's core, and where the numbers come from: with ``hardware=measure`` timed once on the
    pipeline's own group with messages of ``nbytes`` (``calibrate.action_seconds``), else the preset's
    ``hardware.pipe_action_us`` and ``hardware.pipe_wake_us``. Collective over the pipeline."""
    if not s.measure_p2p:
        return s.action_s, s.wake_s, "hardware"
    return (*action_seconds(groups[0], groups[1], device, backend, nbytes=nbytes), "measured")


def bubble_section(
    plan: StagePlan, n: int, ranks: list[dict[str, Any]], orders: list[list[Op]],
    weights: Callable[[int], dict[int, float]], exchange: tuple[float, str], action: tuple[float, float, str],
    nbytes: float, load_s: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """summary.json's predicted bubbles: the paper's (messages free), and the pre-run model: the
    dependency-ordered simulation (``plan.simulate``) of each pipeline rank's actions (``orders``, read off
    the schedule), its chunks lasting the rank's measured forward and backward seconds split over its
    stages (or layers) by ``weights(pipeline rank)``, ``action`` (seconds per action, the message wake,
    where they came from), ``exchange`` per message (and where it came from) and ``load_s`` per relay move (L2L stages)."""
    by: dict[int, list[dict[str, Any]]] = {}
    for r in ranks:
        if r.get("compute_s"):
            by.setdefault(r["pipeline_rank"], []).append(r)
    table: dict[int, tuple[float, float]] = {}
    for p, rs in by.items():  # data-parallel copies of a pipeline rank: their mean
        fwd = statistics.mean(r.get("forward_s", r["compute_s"] / 3) for r in rs)
        table |= split_by_weight((fwd, statistics.mean(r["compute_s"] for r in rs) - fwd), weights(p), n)
    model = (
        plan.bubble_simulated(orders, table_cost(table, load_s), action[0], exchange[0], action[1])
        if len(by) == plan.pipeline else plan.bubble_fraction(n)
    )  # fmt: skip
    actions = [count(o) for o in orders]
    return {
        "bubble_predicted": model, "bubble_predicted_from": "simulated schedule" if len(by) == plan.pipeline else "paper",
        "bubble_predicted_paper": plan.bubble_fraction(n),
        "bubble_overhead_predicted": plan.bubble_overhead(n),
        "messages_per_rank": plan.messages_per_rank(n), "message_bytes": nbytes,
        "exchange_s": exchange[0], "exchange_from": exchange[1],
        "actions_per_rank": [a.total for a in actions], "action_s": action[0], "action_from": action[2],
        "wake_s": action[1],
        "chunks_per_rank": [a.chunks for a in actions], "relay_moves_per_rank": [a.loads for a in actions],
        "relay_move_s": load_s,
    }  # fmt: skip


class PipelineRunner(RunnerBase):
    """One rank of a pipeline: its stages, torch's schedule over them, and the update of its layers."""

    def __init__(self, args: RunnerArgs, mode: ModeSpec):
        super().__init__(args)
        s: PipelineSettings = args.parallel
        self.pipe, self.stage_mode = s, mode
        P, world = s.pipeline, self.dist.world
        self.pp_rank, self.dp_rank, self.dp_world = pipeline_position(self.dist, P)
        if (why := torch_problem()) is not None:
            raise RuntimeError(why)
        groups = pipeline_groups(P, world, self.pp_rank, self.dp_rank, self.dist.backend)
        self.pp_group, self.dp_group, self.pp_host = groups.pp, groups.dp, groups.pp_host
        self.plan = StagePlan(self.spec.num_layers, P, s.placement, s.layers_per_stage)
        self.head = self.spec.num_layers + 1
        self.last_rank = self.dp_rank * P + self.plan.rank_of(self.plan.num_stages - 1)  # global rank
        self.layouts = {k: FlatLayout(self.spec.new_layer(k, "meta")) for k in (PRE, BLOCK, POST)}
        shard = Shard(self.dp_rank, self.dp_world, s.partition_state)
        self.stages = {
            st: StageState(self, self.plan.layers(st), self.layouts, shard)
            for st in self.plan.stages_of(self.pp_rank)
        }
        self.timeline = Timeline(cuda=self.acc.device.type == "cuda")
        self._schedules: OrderedDict[tuple[bool, int, int], Any] = OrderedDict()
        self._full: dict[str, dict[str, Any]] | None = None  # collect()'s weights and moments (rank 0)
        self._collected_at = -1
        self.totals: dict[str, float] = {}
        self.timed_steps = 0
        self.first_step = True
        self._first: dict[str, float] = {}
        self.message_bytes = 0.0  # one micro-batch's hidden state on the wire (the last step's)

    # ---- schedules: one per padded shape -----------------------------------------------------------

    def _meta(self, shape: tuple[int, ...], dtype: torch.dtype, grad: bool) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device="meta")
        return t.requires_grad_(grad) if dtype.is_floating_point else t

    def schedule(self, rows: int, seq: int, train: bool) -> Any:
        """torch's schedule over this rank's stages for micro-batches of ``rows`` x ``seq`` (torch fixes the
        shapes of a schedule's buffers at its first step; batches are length-bucketed, so keep a few)."""
        key = (train, rows, seq)
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        mods = {s: st.module for s, st in self.stages.items()}
        sched = self._build(mods, rows, seq, train, self.timeline, self._loss if train else None)
        self._schedules[key] = sched
        while len(self._schedules) > MAX_SCHEDULES:
            self._schedules.popitem(last=False)
        return sched

    def _build(
        self,
        modules: dict[int, torch.nn.Module],
        rows: int,
        seq: int,
        train: bool,
        timeline: Timeline,
        loss: Any,
    ) -> Any:
        """torch's schedule of the configured kind over ``modules`` (this rank's stages, by index)."""
        H, S = self.spec.hidden_size, self.plan.num_stages
        stages = []
        for s, module in modules.items():
            if s == 0:
                inputs: tuple[torch.Tensor, ...] = (
                    self._meta((rows, seq), torch.long, False),
                    self._meta((rows, seq), torch.long, False),
                )
            else:
                inputs = (self._meta((rows, seq, H), torch.float32, train),)
            if s < S - 1:
                out = self._meta((rows, seq, H), torch.float32, train)
            elif train:
                out = self._meta((), torch.float32, True)
            else:
                out = self._meta(self.spec.logits_shape(rows, seq), torch.float32, False)
            stages.append(
                TimedStage(
                    module,
                    s,
                    S,
                    self.acc.device,
                    input_args=inputs,
                    output_args=out,
                    group=self.pp_group,
                    timeline=timeline,
                    grads_ready=self._grads_ready if loss == self._loss else lambda _: None,
                    own_recvs=self.dist.backend == "gloo",
                )
            )
        n = self.num_ubatches if train else 1
        if train:
            cls, many = schedule_class(self.pipe.schedule), SCHEDULES[self.pipe.schedule][1]
        else:  # evaluation: forward only, one micro-batch, through every stage in order
            cls, many = ScheduleLoopedBFS, True
        return cls(stages if many else stages[0], n, loss_fn=loss, scale_grads=False)

    def _loss(self, loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """What the last stage's backward starts from: the micro-batch's share of the minibatch's loss,
        scaled. ``target``: the micro-batch's rows of the step's multipliers (on the host, each row its
        micro-batch's 1 / ``loss_divisors``: Alg. 2's 1 / #ubatches when every micro-batch counts alike)."""
        return self.precision.scaler.scale_loss(loss * float(target[0]))

    def _grads_ready(self, stage: int) -> None:
        if self.dp_world > 1:
            self.stages[stage].start_reduce(self.dp_group)

    # ---- Alg. 2 per stage, the micro-batches pipelined by torch's schedule --------------------------

    def step(self, minibatch: Batch) -> StepReport:
        t_start, lr = time.perf_counter(), self.lr()
        self._full, self._collected_at = None, -1
        div = self.loss_divisors(minibatch)  # the loss: one mean over the global minibatch's terms
        mb = self.to_device(minibatch)
        n = self.num_ubatches
        rows = len(mb) // n
        # per row, its micro-batch's loss multiplier: torch cuts the target as it cuts the labels
        mult = torch.tensor([1.0 / d for d in div for _ in range(rows)], dtype=torch.float64)
        sched = self.schedule(rows, mb.seq_len, train=True)
        self.message_bytes = hidden_bytes(rows, mb.seq_len, self.spec.hidden_size)
        # side inputs by keyword: torch cuts them into the same micro-batches for every stage
        kwargs = {"mask": mb.attention_mask, "labels": mb.labels}
        args = (mb.input_ids, mb.token_type_ids) if 0 in self.stages else ()
        losses: list[torch.Tensor] = []
        # the pipeline's window opens and closes together on its ranks: a rank's wait for the first
        # micro-batch (fill) and for the others to finish (drain) is its bubble, not its neighbour's update
        dist.barrier(group=self.pp_host)
        t0 = time.perf_counter()
        with self.acc.meter.part("activations"):
            sched.step(*args, target=mult, losses=losses, return_outputs=False, **kwargs)
        dist.barrier(group=self.pp_host)
        t1 = time.perf_counter()
        times = self.timeline.pop(t0, t1)
        loss = self._pipeline_loss(losses)
        with self.timer("reduce"):
            for st in self.stages.values():
                st.wait_reduce()
        with self.timer("optimizer"):
            applied, norm = self.update(lr)
        self.timer.add("forward", times["forward"])
        self.timer.add("backward", times["backward"])
        self.timer.add("bubble", times["idle"] + times["wait"])
        report = self.finish(loss, len(minibatch), t_start, lr, skipped=not applied, grad_norm=norm)
        times["step"] = report.step_time_s
        self._account(times)
        report.extra = {
            "pipe_compute_s": times["compute"], "pipe_wait_s": times["wait"], "pipe_idle_s": times["idle"],
            "pipe_bubble": (times["pipeline"] - times["compute"]) / times["pipeline"],
        }  # fmt: skip
        return report

    def _pipeline_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The minibatch's mean loss, from the last stage's rank to every rank of the pipeline."""
        t = torch.zeros((), dtype=torch.float32)
        if losses:
            t = torch.stack([x.detach().float() for x in losses]).sum().cpu() / self.precision.scaler.scale
        dist.broadcast(t, src=self.last_rank, group=self.pp_host)
        return t

    def update(self, lr: float) -> tuple[bool, float]:
        """Alg. 2's update of this rank's layers: one verdict for the whole model (every rank takes the
        same norms), then clip, unscale and average over the data-parallel ranks, and step."""
        scaler, D = self.precision.scaler, self.dp_world
        sq = torch.zeros(self.spec.num_all_layers, dtype=torch.float64, device=self.acc.device)
        for st in self.stages.values():
            st.add_sq_norms(sq)  # on the stages' device: a host tensor cannot take a device norm in place
        sq = sq.cpu()  # the host group's (gloo)
        partitioned = any(st.partitioned for st in self.stages.values())
        # shards: over every rank (on the EPS's gloo group over all of them where the default is NCCL)
        every = None if self.dist.backend == "gloo" else self.dist.eps_group
        dist.all_reduce(sq, group=every if partitioned else self.pp_host)
        norms = (sq.sqrt() / (scaler.scale * D)).float()
        finite = bool(torch.isfinite(norms).all())
        scaler.update(not finite)
        if finite:
            coefs = clip_coefficients(norms, self.clip, self.settings.max_grad_norm)
            inv = 1.0 / (scaler.scale * D)
            mults = {
                i: (float(coefs[i]) * inv if coefs is not None else (None if inv == 1.0 else inv))
                for i in range(self.spec.num_all_layers)
            }
            with self.acc.meter.part("optimizer_state"):
                for st in self.stages.values():
                    st.apply(lr, mults)
            for st in self.stages.values():
                st.gather_weights(self.dp_group)
        for st in self.stages.values():
            st.zero_grads()
        return finite, float(torch.linalg.vector_norm(norms))

    # ---- measurements ---------------------------------------------------------------------------------

    def _account(self, times: dict[str, float]) -> None:
        """Steady state: the first step (schedule set-up, the first shape's warm-up) is left out, unless
        it is the only one."""
        if self.first_step:
            self.first_step = False
            self._first = times
            return
        for k, v in times.items():
            self.totals[k] = self.totals.get(k, 0.0) + v
        self.timed_steps += 1

    def rank_stats(self) -> dict[str, Any]:
        n = self.timed_steps
        totals = self.totals if n else self._first
        n = max(n, 1)
        mean = {k: v / n for k, v in totals.items()}
        pipe = mean.get("pipeline", 0.0)
        return {
            "rank": self.dist.rank, "pipeline_rank": self.pp_rank, "data_rank": self.dp_rank,
            "stages": sorted(self.stages), "layers": [i for s in sorted(self.stages) for i in self.plan.layers(s)],
            "compute_s": mean.get("compute", 0.0), "forward_s": mean.get("forward", 0.0),
            "backward_s": mean.get("backward", 0.0), "wait_s": mean.get("wait", 0.0),
            "idle_s": mean.get("idle", 0.0), "recv_wait_s": mean.get("recv_wait", 0.0),
            "overhead_s": mean.get("overhead", 0.0), "chunks": mean.get("chunks", 0.0), "pipeline_s": pipe, "step_s": mean.get("step", 0.0),
            "bubble": (pipe - mean.get("compute", 0.0)) / pipe if pipe > 0 else None,
            "steps_timed": self.timed_steps,
            # each stage's mean forward + backward chunk over the run: how the rank's compute splits
            "stage_chunks": {str(st): sum(v[0] / max(v[1], 1) for (i, _), v in self.timeline.by_stage.items() if i == st)
                             or 1.0 for st in sorted(self.stages)},
        }  # fmt: skip

    def exchange(self) -> tuple[float, str]:
        """One exchange's seconds between this rank's pipeline neighbours (collective over the pipeline)."""
        P, base = self.pipe.pipeline, self.dp_rank * self.pipe.pipeline
        peers = (base + (self.pp_rank - 1) % P, base + (self.pp_rank + 1) % P)
        return exchange_s(
            self.pipe, (self.pp_group, self.pp_host), peers, self.message_bytes, self.acc.device
        )

    def sections(self) -> dict[str, dict[str, Any]]:
        """summary.json's ``pipeline``: the layout, each rank's times, the bubble measured and predicted."""
        ranks = [None] * self.dist.world
        dist.all_gather_object(ranks, self.rank_stats())
        bubbles = [r["bubble"] for r in ranks if r["bubble"] is not None]
        s, plan, n = self.pipe, self.plan, self.num_ubatches
        cls, many = SCHEDULES[s.schedule]
        orders = plan.orders(n, cls, many)
        # a rank's compute over its stages: as their measured mean chunks (all ranks', gathered above)
        chunks = {int(k): v for r in ranks for k, v in r["stage_chunks"].items()}
        groups = (self.pp_group, self.pp_host)
        action = action_s(s, groups, self.dist.backend, self.acc.device, self.message_bytes)
        return {
            "pipeline": {
                "pipeline": s.pipeline, "data_parallel": self.dp_world, "placement": s.placement,
                "schedule": s.schedule, "torch_schedule": cls, "stage_mode": self.stage_mode.name,
                "num_stages": plan.num_stages, "layers_per_stage": plan.block_size,
                "stages_per_rank": plan.stages_per_rank, "num_ubatches": n, "partition_state": s.partition_state,
                "side_inputs": "rebuilt per stage from the batch (mask, labels, micro-batch index as keyword "
                               "arguments); only hidden states cross ranks",
                "bubble_measured": sum(bubbles) / len(bubbles) if bubbles else None,
                **bubble_section(plan, n, ranks, orders, lambda p: {k: chunks[k] for k in plan.stages_of(p)},
                                 self.exchange(), action, self.message_bytes),
                "ranks": ranks,
            }
        }  # fmt: skip

    # ---- evaluation: the first pipeline predicts together -------------------------------------------

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        """Logits of a batch, forward only through the pipeline; every rank of it gets them."""
        b = self.to_device(batch)
        sched = self.schedule(len(b), b.seq_len, train=False)
        for st in self.stages.values():
            st.module.eval()
        by_stage = {k: list(v) for k, v in self.timeline.by_stage.items()}
        try:
            args = (b.input_ids, b.token_type_ids) if 0 in self.stages else ()
            kwargs = {"mask": b.attention_mask}
            with self.acc.meter.part("activations"):
                out = sched.step(*args, return_outputs=True, **kwargs)
            self.timeline.chunks.clear()
            self.timeline.recv_waits.clear()
            self.timeline.by_stage = by_stage  # training chunks only
        finally:
            for st in self.stages.values():
                st.module.train()
        # the logits' shape first: (rows, labels) for a classifier, (rows, sequence, vocabulary) for an LM
        shape = torch.zeros(3, dtype=torch.long)
        if out is not None:
            shape[: out.dim()] = torch.tensor(out.shape)
        dist.broadcast(shape, src=self.last_rank, group=self.pp_host)
        dims = [int(d) for d in shape if d > 0]
        logits = out.float().cpu() if out is not None else torch.empty(dims)
        dist.broadcast(logits, src=self.last_rank, group=self.pp_host)
        return logits

    # ---- checkpoints and weights: Hugging Face names, gathered on rank 0 ----------------------------

    def collect(self) -> None:
        """Collective: rank 0 gets every stage's weights and moments (the partitioned moments first
        gathered over the data-parallel group), by Hugging Face name: the baselines' checkpoint layout,
        so a run resumes with any pipeline degree or placement (resharding on load), or none."""
        if self._collected_at == self.step_count:  # every rank decides alike
            return
        mine: dict[str, dict[str, Any]] = {"weights": {}, "moments": {}}
        for st in self.stages.values():
            m, v = st.full_moments(self.dp_group)
            steps = st.steps_taken()
            for (name, w), (_, exp_avg), (_, exp_avg_sq) in zip(st.named(st.w), st.named(m), st.named(v)):
                mine["weights"][name] = w.detach().cpu().clone()
                if steps > 0:  # as the baselines: moments once the optimizer has stepped
                    mine["moments"][name] = {
                        "exp_avg": exp_avg.detach().cpu().clone(),
                        "exp_avg_sq": exp_avg_sq.detach().cpu().clone(),
                        "step": steps,
                    }
        self._collected_at = self.step_count
        if self.dp_rank != 0:
            return
        parts: list[Any] | None = [None] * self.pipe.pipeline if self.dist.rank == 0 else None
        dist.gather_object(mine, parts, dst=0, group=self.pp_host)
        if parts is not None:
            self._full = {"weights": {}, "moments": {}}
            for part in parts:
                self._full["weights"] |= part["weights"]
                self._full["moments"] |= part["moments"]

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight by HF name after ``collect`` (rank 0); this rank's own otherwise."""
        if self._full is not None:
            yield from self._full["weights"].items()
            return
        for st in self.stages.values():
            yield from st.named(st.w)

    def state_files(self) -> Iterator[tuple[str, bytes]]:
        assert self._full is not None, "collect() first"
        yield from module_state_files(self._full["weights"], self._full["moments"])

    def load_state(self, ckpt: Path, manifest: dict[str, Any]) -> None:
        """Every rank reads the checkpoint and takes its own layers (and its shard of their moments)."""
        saved = ModuleState(ckpt, manifest)
        for st in self.stages.values():
            st.load(saved)
        self._full, self._collected_at = None, -1

    @torch.no_grad()
    def load_hf(self, tensors: Any) -> list[str]:
        missing = []
        for st in self.stages.values():
            for name, view in st.named(st.w):
                t = self.spec.lookup_hf(tensors, name)
                if t is None:
                    missing.append(name)
                else:
                    view.copy_(t.reshape(view.shape))
        return missing

    def close(self) -> None:
        # leave reductions in flight alone: a failing rank must exit at once, not wait on its peers
        self._schedules.clear()
