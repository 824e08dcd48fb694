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
its own, on the run's backend, like the EPS's eager per-layer reduction), overlapping the backward of the
stages below it.
``dist.partition_state``: the reduction is a reduce-scatter, each data-parallel rank updates its shard of
every stage with the optimizer state of that shard only, and an all-gather brings the updated weights back.

Measured, per rank and step: compute (forward and backward chunks), idle (the pipeline's fill and drain:
before a rank's first chunk and after its last), wait (blocked on a neighbour between chunks), and the
bubble = 1 - compute / pipeline time, next to appendix C's prediction (§2.4 and §4).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import ScheduleLoopedBFS

from l2l_cli.checkpoint import ModuleState, module_state_files
from l2l_cli.data.batches import Batch
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.optim import clip_coefficients
from l2l_cli.models.base import BLOCK, POST, PRE
from l2l_cli.modes.base import RunnerArgs, RunnerBase, StepReport
from l2l_cli.modes.registry import ModeSpec
from l2l_cli.parallel.pipeline.bubble import bubble_section, pipeline_section, run_action
from l2l_cli.parallel.pipeline.calibrate import link_costs
from l2l_cli.parallel.pipeline.groups import neighbours, pipeline_groups, pipeline_position
from l2l_cli.parallel.pipeline.p2p import from_last_stage, logits_from_last_stage
from l2l_cli.parallel.pipeline.plan import StagePlan, hidden_bytes, recvs_ahead
from l2l_cli.parallel.pipeline.settings import SCHEDULES, PipelineSettings, schedule_class, torch_problem
from l2l_cli.parallel.pipeline.shards import gather_on_rank0, merge_module_states, module_state
from l2l_cli.parallel.pipeline.stage import RecvsAhead, TimedStage, Timeline
from l2l_cli.parallel.pipeline.state import Shard, StageState

KINDS = ("forward", "backward")  # a chunk's kinds, as the stage's timeline names them
MAX_SCHEDULES = 8  # one per padded batch shape (torch fixes shapes at a schedule's first step), LRU


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
        # what a message and a schedule action cost the bubble model: measured now (hardware=measure,
        # collective over the pipeline) on the configured micro-batch's hidden state, or the preset's
        message = hidden_bytes(
            self.settings.ubatch_size, self.settings.recompute.seq_len, self.spec.hidden_size
        )
        peers = neighbours(self.pp_rank, self.dp_rank, P)
        with self.acc.meter.paused():
            self.links = link_costs(s, groups, peers, self.dist.backend, self.acc.device, message)
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
        n = self.num_ubatches if train else 1
        if train:
            cls, many = schedule_class(self.pipe.schedule), SCHEDULES[self.pipe.schedule][1]
        else:  # evaluation: forward only, one micro-batch, through every stage in order
            cls, many = ScheduleLoopedBFS, True
        gloo = self.dist.backend == "gloo"
        ahead = None
        if gloo and train:  # the rank's receives in the order its schedule posts them, all at the first
            ops = self.plan.orders(n, cls.__name__, many)[self.pp_rank]
            ahead = RecvsAhead(
                [
                    ("forward" if k == "RECV_F" else "backward", s, u)
                    for k, s, u, _ in ops
                    if k.startswith("RECV")
                ]
            )
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
                    own_recvs=gloo,
                    ahead=ahead,
                )
            )
        sched = cls(stages if many else stages[0], n, loss_fn=loss, scale_grads=False)
        if ahead is not None:
            sched._l2l_recvs_ahead = ahead  # (the runner opens each step's)
        return sched

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
        if (ahead := getattr(sched, "_l2l_recvs_ahead", None)) is not None:
            ahead.start_step()
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
            "pipe_compute_s": times["compute"],
            "pipe_wait_s": times["wait"],
            "pipe_idle_s": times["idle"],
            "pipe_bubble": (times["pipeline"] - times["compute"]) / times["pipeline"],
        }
        return report

    def _pipeline_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The minibatch's mean loss, from the last stage's rank to every rank of the pipeline."""
        t = torch.zeros((), dtype=torch.float32)
        if losses:
            t = torch.stack([x.detach().float() for x in losses]).sum().cpu() / self.precision.scaler.scale
        return from_last_stage(t, self.last_rank, self.pp_host)

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
            "rank": self.dist.rank,
            "pipeline_rank": self.pp_rank,
            "data_rank": self.dp_rank,
            "stages": sorted(self.stages),
            "layers": [i for s in sorted(self.stages) for i in self.plan.layers(s)],
            "compute_s": mean.get("compute", 0.0),
            "forward_s": mean.get("forward", 0.0),
            "backward_s": mean.get("backward", 0.0),
            "wait_s": mean.get("wait", 0.0),
            "idle_s": mean.get("idle", 0.0),
            "recv_wait_s": mean.get("recv_wait", 0.0),
            "overhead_s": mean.get("overhead", 0.0),
            "chunks": mean.get("chunks", 0.0),
            "pipeline_s": pipe,
            "step_s": mean.get("step", 0.0),
            "bubble": (pipe - mean.get("compute", 0.0)) / pipe if pipe > 0 else None,
            "steps_timed": self.timed_steps,
            # each stage's mean [forward, backward] chunk over the run: how the rank's compute splits (the
            # first stage's backward, the embeddings' dense gradient, weighs more than its forward)
            "stage_chunks": {str(st): self._chunks(st) for st in sorted(self.stages)},
        }

    def _chunks(self, stage: int) -> list[float]:
        """Stage ``stage``'s mean forward and backward chunk over the run (1.0 each where none ran)."""
        by = self.timeline.by_stage
        return [by[stage, k][0] / by[stage, k][1] if by.get((stage, k), [0, 0])[1] else 1.0 for k in KINDS]

    def sections(self) -> dict[str, dict[str, Any]]:
        """summary.json's ``pipeline``: the layout, each rank's times, the bubble measured and predicted.
        Collective: every rank's times are gathered; the costs the model charges were settled at build."""
        ranks: list[Any] = [None] * self.dist.world
        dist.all_gather_object(ranks, self.rank_stats())
        s, plan, n = self.pipe, self.plan, self.num_ubatches
        cls, many = SCHEDULES[s.schedule]
        orders = plan.orders(n, cls, many)
        if self.dist.backend == "gloo":  # a training step's receives all posted at its first (RecvsAhead)
            orders = recvs_ahead(orders)
        # a rank's compute over its stages: as their measured mean chunks (all ranks', gathered above)
        chunks = {int(k): (v[0], v[1]) for r in ranks for k, v in r["stage_chunks"].items()}

        def weights(p: int) -> dict[int, tuple[float, float]]:
            return {k: chunks[k] for k in plan.stages_of(p)}

        own = {
            "partition_state": s.partition_state,
            "side_inputs": "rebuilt per stage from the batch (mask, labels, micro-batch index as keyword "
            "arguments); only hidden states cross ranks",
        }
        links = self.links
        if self.acc.device.type == "cpu" and self.dist.backend == "gloo":  # the stages time their waits
            links = run_action(links, ranks, orders)
        bubble = bubble_section(plan, n, ranks, orders, weights, links, self.message_bytes)
        runs = {"torch_schedule": cls, "stage_mode": self.stage_mode.name}
        section = pipeline_section(s, plan, n, runs, own, ranks, bubble)
        return {"pipeline": section}

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
        logits = out.float().cpu() if out is not None else None
        return logits_from_last_stage(logits, self.last_rank, self.pp_host)

    # ---- checkpoints and weights: Hugging Face names, gathered on rank 0 ----------------------------

    def collect(self) -> None:
        """Collective: rank 0 gets every stage's weights and moments (the partitioned moments first
        gathered over the data-parallel group), by Hugging Face name: the baselines' checkpoint layout,
        so a run resumes with any pipeline degree or placement (resharding on load), or none."""
        if self._collected_at == self.step_count:  # every rank decides alike
            return
        mine = module_state(self.stages.values(), self.dp_group)
        self._collected_at = self.step_count
        if self.dp_rank != 0:
            return
        parts = gather_on_rank0(mine, self.pipe.pipeline, self.dist.rank, self.pp_host)
        if parts is not None:
            self._full = merge_module_states(parts)

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
