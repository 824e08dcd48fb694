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
layers, gradients and optimizer state resident on the rank's device.

Side inputs are rebuilt per stage from the batch, not sent with the activations: every rank of a pipeline
reads the same data shard, and torch's schedules hand every stage the same keyword arguments cut into the
same micro-batches, so the attention mask (and the labels, and the micro-batch index that seeds dropout)
reach each stage without crossing the network. Only hidden states travel between ranks.

Data parallel across pipelines: as soon as a stage's last micro-batch finishes backward (torch's
REDUCE_GRAD action), its gradient starts an asynchronous reduction on the data-parallel group (a gloo group
of its own, like the EPS's eager per-layer reduction), overlapping the backward of the stages below it.
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from l2l_cli.checkpoint import CheckpointError, read_tensors, tensors_bytes
from l2l_cli.data.batches import Batch
from l2l_cli.engine.dist import DistContext
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.optim import OPTIMIZERS, clip_coefficients, make_optimizer, set_lr
from l2l_cli.models import FAMILIES, family_for_dir
from l2l_cli.models.base import BLOCK, POST, PRE, ModelSpec
from l2l_cli.modes.base import RunnerArgs, RunnerBase, StepReport
from l2l_cli.modes.registry import MODES, ModeSpec, ParallelSpec, register_parallel
from l2l_cli.problems import Problem

# dist.schedule -> torch's schedule, and whether it runs several stages per rank
SCHEDULES: dict[str, tuple[type, bool]] = {
    "breadth_first": (ScheduleLoopedBFS, True),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, True),
    "gpipe": (ScheduleGPipe, False),
    "1f1b": (Schedule1F1B, False),
}
AUTO_SCHEDULE = {"modular": "breadth_first", "contiguous": "1f1b"}
MAX_SCHEDULES = 8  # one per padded batch shape (torch fixes shapes at a schedule's first step), LRU


@dataclass(frozen=True)
class PipelineSettings:
    """The ``dist.*`` pipeline keys, ``auto`` resolved."""

    pipeline: int
    placement: str
    schedule: str
    layers_per_stage: int
    partition_state: bool

    @classmethod
    def from_cfg(cls, cfg: Any) -> PipelineSettings:
        d = cfg.dist
        schedule = AUTO_SCHEDULE[d.placement] if d.schedule == "auto" else d.schedule
        return cls(d.pipeline, d.placement, schedule, d.layers_per_stage, bool(d.partition_state))


@dataclass(frozen=True)
class StagePlan:
    """Which layers each stage holds and which pipeline rank runs it. Layer indices are the models':
    0 = embeddings, 1..N = transformer blocks, N+1 = head."""

    num_layers: int  # N transformer blocks
    pipeline: int  # P
    placement: str
    layers_per_stage: int

    @property
    def block_size(self) -> int:
        """Transformer layers per stage (contiguous: the rank's L/P)."""
        return self.layers_per_stage if self.placement == "modular" else self.num_layers // self.pipeline

    @property
    def num_stages(self) -> int:
        return self.num_layers // self.block_size

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pipeline

    def layers(self, s: int) -> list[int]:
        b = self.block_size
        out = list(range(s * b + 1, (s + 1) * b + 1))
        if s == 0:
            out.insert(0, 0)  # the embeddings go with the first block
        if s == self.num_stages - 1:
            out.append(self.num_layers + 1)  # the head with the last
        return out

    def rank_of(self, s: int) -> int:
        """Modular: stage s on rank s mod P; contiguous has one stage per rank (s)."""
        return s % self.pipeline

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank_of(s) == rank]

    def bubble_overhead(self, num_ubatches: int) -> float:
        """Appendix C / §2.4: the bubble lengthens a step by (P-1)/n_mu of its compute; §4: the modular
        pipeline divides that by d_l/n_l, the stages each rank holds (interleaved 1F1B alike)."""
        return (self.pipeline - 1) / (num_ubatches * self.stages_per_rank)

    def bubble_fraction(self, num_ubatches: int) -> float:
        """The predicted share of a step's pipeline time a rank spends not computing: o / (1 + o)."""
        o = self.bubble_overhead(num_ubatches)
        return o / (1.0 + o)


def plan_of(cfg: Any, num_layers: int) -> StagePlan:
    d = cfg.dist
    return StagePlan(num_layers, d.pipeline, d.placement, d.layers_per_stage)


# ---- configuration --------------------------------------------------------------------------------


def _shape(cfg: Any) -> tuple[int, bool]:
    """The model's depth as ``l2l train`` builds it (a local pretrained directory's config.json wins), and
    whether its LM head is tied to its embeddings."""
    m = cfg.model
    family = FAMILIES.get(m.family)
    tied = family is not None and family.tied_head(m)
    if m.pretrained:
        path = Path(m.pretrained).expanduser()
        if (path / "config.json").is_file():
            try:
                spec = family_for_dir(path, m.pretrained, m.family).from_hf_dir(path, m, 2)
                return int(spec.num_layers), bool(spec.tied_params())
            except Exception:  # reported by the model check
                return int(m.num_layers), tied
    return int(m.num_layers), tied


def _num_layers(cfg: Any) -> int:
    return _shape(cfg)[0]


def validate(cfg: Any) -> list[Problem]:
    """The pipeline keys' rules: every problem, one line each, before any process starts."""
    from l2l_cli.problems import divisors

    d, p = cfg.dist, []

    def bad(key: str, message: str) -> None:
        p.append(Problem(key, message))

    P = d.pipeline
    if P == 1:
        defaults = {
            "placement": "modular",
            "schedule": "auto",
            "layers_per_stage": 1,
            "partition_state": False,
        }
        for key, default in defaults.items():
            if d[key] != default:
                bad(f"dist.{key}", "applies to pipeline runs; set dist.pipeline > 1 (and dist.nproc)")
        return p
    N, (L, tied), lps = d.nproc, _shape(cfg), d.layers_per_stage
    if tied:  # one tensor on the first and the last rank: its two gradients would need a sum across ranks
        bad("dist.pipeline", "the model's LM head is tied to its token embedding, which lives on another "
            "pipeline rank; set model.tie_word_embeddings=false, or dist.pipeline=1")  # fmt: skip
    if N % P:
        bad("dist.pipeline", f"{P} does not divide dist.nproc={N} (the ranks form nproc/P pipelines); allowed: "
            f"a divisor of {N} ({divisors(N)})")  # fmt: skip
    if P > L:
        bad("dist.pipeline", f"got {P}; every pipeline rank needs a layer: must be <= model.num_layers={L}")
        return p
    if L % P:
        bad("dist.pipeline", f"torch's schedules give every rank as many stages: {P} does not divide "
            f"model.num_layers={L}; allowed: a divisor of {L} ({divisors(L)})")  # fmt: skip
        return p
    if d.placement == "modular" and (L % lps or (L // lps) % P):
        ok = [k for k in range(1, L + 1) if L % k == 0 and (L // k) % P == 0]
        bad("dist.layers_per_stage", f"{lps} layers per stage do not make a multiple of dist.pipeline={P} "
            f"stages of model.num_layers={L}; allowed: {', '.join(map(str, ok))}")  # fmt: skip
        return p
    if d.placement == "contiguous" and lps not in (1, L // P):
        bad("dist.layers_per_stage", f"applies to placement=modular; contiguous runs one stage of L/P={L // P} "
            "layers per rank (torch's multi-stage schedules place stages modularly)")  # fmt: skip
    plan = plan_of(cfg, L)
    schedule = AUTO_SCHEDULE[d.placement] if d.schedule == "auto" else d.schedule
    if plan.stages_per_rank > 1 and not SCHEDULES[schedule][1]:
        multi = ", ".join(k for k, (_, many) in SCHEDULES.items() if many)
        bad("dist.schedule", f"{schedule} runs one stage per rank, but placement={d.placement} puts "
            f"{plan.stages_per_rank} on each; allowed: {multi} (or dist.layers_per_stage={L // P})")  # fmt: skip
    b = cfg.batch
    n = b.size // b.ubatch_size if b.ubatch_size >= 1 and b.size % b.ubatch_size == 0 else None
    if n is not None and n < P:
        bad("batch.ubatch_size", f"{n} micro-batches for dist.pipeline={P}: a pipeline needs at least P in "
            f"flight; allowed: batch.size / batch.ubatch_size >= {P}")  # fmt: skip
    elif n is not None and schedule == "interleaved_1f1b" and n % max(1, n // P):
        bad("batch.ubatch_size", f"interleaved_1f1b runs rounds of P micro-batches: {n} is not a multiple of "
            f"its {max(1, n // P)} rounds; allowed: a multiple of {P}, or dist.schedule=breadth_first")  # fmt: skip
    spec = MODES.get(cfg.mode.name)
    if spec is not None and not spec.pipeline_stage:
        stage_modes = ", ".join(m.name for m in MODES.values() if m.pipeline_stage)
        bad("mode.name", f"mode={spec.name} cannot run as a pipeline stage; allowed with dist.pipeline > 1: "
            f"{stage_modes}")  # fmt: skip
    if d.partition_state and cfg.optim.name in OPTIMIZERS and not OPTIMIZERS[cfg.optim.name].elementwise:
        bad("dist.partition_state", f"optim={cfg.optim.name}'s trust ratio needs whole parameter tensors, which "
            "a shard of the state splits; use optim=adamw, or dist.partition_state=false")  # fmt: skip
    return p


def layout(ctx: DistContext, s: PipelineSettings) -> DistContext:
    """Ranks [d·P, (d+1)·P) form pipeline d and share data shard d; the first pipeline evaluates."""
    P = s.pipeline
    return replace(
        ctx, data_rank=ctx.rank // P, data_world=max(1, ctx.world // P), eval_ranks=tuple(range(P))
    )


# ---- a stage: its layers, run in order --------------------------------------------------------------


def _ubatch(ids: torch.Tensor | None, tt: torch.Tensor | None, mask: torch.Tensor, labels: Any) -> Batch:
    none = mask.new_empty(0)
    return Batch(ids if ids is not None else none, tt if tt is not None else none, mask,
                 labels if labels is not None else none)  # fmt: skip


class StageModule(nn.Module):
    """The layers of one stage. Its forward takes the stage's input (token ids and segment ids for the first
    stage, hidden states otherwise) and, as keyword arguments cut into the same micro-batches on every
    stage, the attention mask, the micro-batch index (dropout seeding) and, training, the labels; the last
    stage returns the micro-batch's loss (training) or its logits."""

    def __init__(self, spec: ModelSpec, index: list[int], layers: list[nn.Module], runner: PipelineRunner):
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


# ---- a stage's training state on this rank ----------------------------------------------------------


@dataclass(frozen=True)
class LayerSlice:
    index: int  # the model's layer index
    layout: FlatLayout
    offset: int  # in the stage's flat buffers


class StageState:
    """One local stage: its layers' weights and gradients as two flat device buffers (the modules'
    parameters are views of them, so autograd accumulates every micro-batch in place), the optimizer
    over this rank's shard of them (all of it unless ``dist.partition_state``), and its reduction."""

    def __init__(self, runner: PipelineRunner, stage: int, layers: list[int]):
        acc, spec, optim = runner.acc, runner.spec, runner.optim
        self.stage, self.runner = stage, runner
        layouts = runner.layouts
        self.slices: list[LayerSlice] = []
        offset = 0
        for i in layers:
            self.slices.append(LayerSlice(i, layouts[spec.kind(i)], offset))
            offset += layouts[spec.kind(i)].numel
        D = runner.dp_world
        self.numel = offset
        self.padded = -(-offset // D) * D  # equal shards for the reduce-scatter and all-gather
        shard = self.padded // D if runner.pipe.partition_state else self.padded
        self.lo = runner.dp_rank * shard if runner.pipe.partition_state else 0
        self.hi = self.lo + shard
        self.w = acc.empty(self.padded, torch.float32, part="weights").zero_()
        self.g = acc.empty(self.padded, torch.float32, part="grads").zero_()
        partitioned = runner.pipe.partition_state and D > 1
        # the gradient the optimizer reads: the reduce-scatter's output shard, or the stage's own buffer
        self.g_opt = acc.empty(shard, torch.float32, part="grads").zero_() if partitioned else self.g
        self.partitioned = partitioned
        self.m = acc.empty(shard, torch.float32, part="optimizer_state").zero_()
        self.v = acc.empty(shard, torch.float32, part="optimizer_state").zero_()
        modules = []
        with acc.meter.part("weights"):
            for sl in self.slices:
                n = sl.layout.numel
                w, g = self.w[sl.offset : sl.offset + n], self.g[sl.offset : sl.offset + n]
                sl.layout.pack(spec.build_layer(sl.index, runner.seed), w)  # every mode's seeded init
                shell = spec.new_layer(spec.kind(sl.index), device="meta")
                sl.layout.bind(shell, w, g)
                for owner in shell.modules():  # index buffers (position ids) become real tensors
                    for name, buf in list(owner._buffers.items()):
                        if buf is not None and buf.device.type == "meta":
                            owner._buffers[name] = torch.empty_like(buf, device=acc.device)
                spec.reset_buffers(shell)
                modules.append(shell)
        self.module = StageModule(spec, layers, modules, runner).train()
        # the optimizer: AdamW over each layer's two contiguous runs (decayed, not), LAMB per tensor (its
        # trust ratio is per tensor); clipped to this rank's shard, with the moments in flat shard buffers
        self.groups: dict[int, list[tuple[int, int]]] = {}  # layer -> [a, b) ranges in the shard it updates
        named: list[tuple[str, nn.Parameter]] = []
        states = []
        for sl in self.slices:
            runs = (
                [(sl.offset, sl.offset + sl.layout.n_decay, "decay"), (sl.offset + sl.layout.n_decay,
                  sl.offset + sl.layout.numel, "bias")]
                if optim.elementwise
                else [(sl.offset + e.offset, sl.offset + e.offset + e.numel, e.name) for e in sl.layout.entries]
            )  # fmt: skip
            for a, b, name in runs:
                a, b = max(a, self.lo), min(b, self.hi)
                if b <= a:
                    continue
                p = nn.Parameter(self.w[a:b])
                p.grad = self.g_opt[a - self.lo : b - self.lo]
                named.append((name, p))
                states.append((p, a - self.lo, b - self.lo))
                self.groups.setdefault(sl.index, []).append((a - self.lo, b - self.lo))
        self.optimizer = make_optimizer(_param_groups(named, optim.weight_decay), optim) if named else None
        for p, a, b in states:
            assert self.optimizer is not None
            self.optimizer.state[p] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": self.m[a:b],
                "exp_avg_sq": self.v[a:b],
            }
        self.reduce: Any = None  # the data-parallel reduction in flight

    # ---- the step ------------------------------------------------------------------------------------

    def start_reduce(self, group: Any) -> None:
        """Sum this stage's gradient over the data-parallel ranks, in the background."""
        if self.partitioned:
            self.reduce = dist.reduce_scatter_tensor(self.g_opt, self.g, group=group, async_op=True)
        else:
            self.reduce = dist.all_reduce(self.g, group=group, async_op=True)

    def wait_reduce(self) -> None:
        if self.reduce is not None:
            self.reduce.wait()
            self.reduce = None

    def add_sq_norms(self, sq: torch.Tensor) -> None:
        """Add the squared norm of each layer's gradient (the part this rank updates) into ``sq``."""
        for i, ranges in self.groups.items():
            for a, b in ranges:
                sq[i] += torch.linalg.vector_norm(self.g_opt[a:b], dtype=torch.float64) ** 2

    def apply(self, lr: float, mults: dict[int, float | None]) -> None:
        """Scale each layer's gradient (unscale, average, clip) and take the optimizer step."""
        for i, ranges in self.groups.items():
            if mults.get(i) is not None:
                for a, b in ranges:
                    self.g_opt[a:b].mul_(mults[i])
        if self.optimizer is not None:
            set_lr(self.optimizer, lr)
            self.optimizer.step()

    def gather_weights(self, group: Any) -> None:
        """Partitioned state: every data-parallel rank gets the others' updated shards."""
        if self.partitioned:
            mine = self.w[self.lo : self.hi].clone()
            dist.all_gather_into_tensor(self.w, mine, group=group)

    def zero_grads(self) -> None:
        self.g.zero_()
        if self.g_opt is not self.g:
            self.g_opt.zero_()

    def full_moments(self, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole stage's moments (collective over the data-parallel group when partitioned)."""
        if not self.partitioned:
            return self.m, self.v
        out = []
        for t in (self.m, self.v):
            full = torch.empty(self.padded, dtype=t.dtype, device=t.device)
            dist.all_gather_into_tensor(full, t.contiguous(), group=group)
            out.append(full)
        return out[0], out[1]

    def steps_taken(self) -> float:
        if self.optimizer is None or not self.optimizer.state:
            return 0.0
        return float(next(iter(self.optimizer.state.values()))["step"])

    def set_steps(self, step: float) -> None:
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                st["step"].fill_(step)


def _param_groups(named: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """Decayed runs/tensors and the rest (biases, LayerNorm): BERT's rule, on flat runs' names."""
    from l2l_cli.engine.optim import no_decay

    decay = [p for n, p in named if n != "bias" and not no_decay(n)]
    plain = [p for n, p in named if n == "bias" or no_decay(n)]
    return [
        g
        for g in ({"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0})
        if g["params"]
    ]


# ---- the runner -------------------------------------------------------------------------------------


class PipelineRunner(RunnerBase):
    """One rank of a pipeline: its stages, torch's schedule over them, and the update of its layers."""

    def __init__(self, args: RunnerArgs, mode: ModeSpec):
        super().__init__(args)
        s: PipelineSettings = args.parallel
        self.pipe, self.stage_mode = s, mode
        P, world, rank = s.pipeline, self.dist.world, self.dist.rank
        if world % P:
            raise RuntimeError(f"dist.pipeline={P} does not divide the {world} ranks launched")
        self.pp_rank, self.dp_rank, self.dp_world = rank % P, rank // P, world // P
        self.pp_group, self.dp_group = self._groups(P, world)
        self.plan = StagePlan(self.spec.num_layers, P, s.placement, s.layers_per_stage)
        self.head = self.spec.num_layers + 1
        self.last_rank = self.dp_rank * P + self.plan.rank_of(self.plan.num_stages - 1)  # global rank
        self.layouts = {k: FlatLayout(self.spec.new_layer(k, "meta")) for k in (PRE, BLOCK, POST)}
        self.stages = {
            st: StageState(self, st, self.plan.layers(st)) for st in self.plan.stages_of(self.pp_rank)
        }
        self.timeline = Timeline()
        self._schedules: OrderedDict[tuple[bool, int, int], Any] = OrderedDict()
        self._full: dict[str, dict[str, torch.Tensor]] | None = None
        self._collected_at = -1
        self.totals: dict[str, float] = {}
        self.timed_steps = 0
        self.first_step = True
        self._first: dict[str, float] = {}

    def _groups(self, P: int, world: int) -> tuple[Any, Any]:
        """Pipeline groups (consecutive ranks) and data-parallel groups (same pipeline rank); every rank
        creates every group, in the same order, as torch.distributed requires."""
        pp = dp = None
        for d in range(world // P):
            g = dist.new_group([d * P + i for i in range(P)], backend="gloo")
            pp = g if d == self.dp_rank else pp
        for i in range(P):
            g = dist.new_group([d * P + i for d in range(world // P)], backend="gloo")
            dp = g if i == self.pp_rank else dp
        return pp, dp

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
        H, S = self.spec.hidden_size, self.plan.num_stages
        stages = []
        for s, st in self.stages.items():
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
                out = self._meta((rows, self.spec.num_labels), torch.float32, False)
            stages.append(
                TimedStage(
                    st.module,
                    s,
                    S,
                    self.acc.device,
                    input_args=inputs,
                    output_args=out,
                    group=self.pp_group,
                    timeline=self.timeline,
                    grads_ready=self._grads_ready,
                )
            )
        n = self.num_ubatches if train else 1
        loss_fn = self._loss if train else None
        if train:
            cls, many = SCHEDULES[self.pipe.schedule]
        else:  # evaluation: forward only, one micro-batch, through every stage in order
            cls, many = ScheduleLoopedBFS, True
        sched = cls(stages if many else stages[0], n, loss_fn=loss_fn, scale_grads=False)
        self._schedules[key] = sched
        while len(self._schedules) > MAX_SCHEDULES:
            self._schedules.popitem(last=False)
        return sched

    def _loss(self, loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """What the last stage's backward starts from: the micro-batch's share of the minibatch's mean
        loss, scaled (Alg. 2's loss / #ubatches)."""
        return self.precision.scaler.scale_loss(loss * (1.0 / self.num_ubatches))

    def _grads_ready(self, stage: int) -> None:
        if self.dp_world > 1:
            self.stages[stage].start_reduce(self.dp_group)

    # ---- Alg. 2 per stage, the micro-batches pipelined by torch's schedule --------------------------

    def step(self, minibatch: Batch) -> StepReport:
        t_start, lr = time.perf_counter(), self.lr()
        self._full, self._collected_at = None, -1
        mb = self.to_device(minibatch)
        n = self.num_ubatches
        rows = len(mb) // n
        sched = self.schedule(rows, mb.seq_len, train=True)
        # side inputs by keyword: torch cuts them into the same micro-batches for every stage
        kwargs = {
            "mask": mb.attention_mask,
            "ubatch": torch.arange(n, device=mb.input_ids.device).repeat_interleave(rows),
            "labels": mb.labels,
        }
        args = (mb.input_ids, mb.token_type_ids) if 0 in self.stages else ()
        losses: list[torch.Tensor] = []
        # the pipeline's window opens and closes together on its ranks: a rank's wait for the first
        # micro-batch (fill) and for the others to finish (drain) is its bubble, not its neighbour's update
        dist.barrier(group=self.pp_group)
        t0 = time.perf_counter()
        with self.acc.meter.part("activations"):
            sched.step(*args, target=mb.labels, losses=losses, return_outputs=False, **kwargs)
        dist.barrier(group=self.pp_group)
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
        dist.broadcast(t, src=self.last_rank, group=self.pp_group)
        return t

    def update(self, lr: float) -> tuple[bool, float]:
        """Alg. 2's update of this rank's layers: one verdict for the whole model (every rank takes the
        same norms), then clip, unscale and average over the data-parallel ranks, and step."""
        scaler, D = self.precision.scaler, self.dp_world
        sq = torch.zeros(self.spec.num_all_layers, dtype=torch.float64)
        for st in self.stages.values():
            st.add_sq_norms(sq)
        partitioned = any(st.partitioned for st in self.stages.values())
        dist.all_reduce(sq, group=None if partitioned else self.pp_group)  # shards: over every rank
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
            "idle_s": mean.get("idle", 0.0), "pipeline_s": pipe, "step_s": mean.get("step", 0.0),
            "bubble": (pipe - mean.get("compute", 0.0)) / pipe if pipe > 0 else None,
            "steps_timed": self.timed_steps,
        }  # fmt: skip

    def sections(self) -> dict[str, dict[str, Any]]:
        """summary.json's ``pipeline``: the layout, each rank's times, the bubble measured and predicted."""
        ranks = [None] * self.dist.world
        dist.all_gather_object(ranks, self.rank_stats())
        bubbles = [r["bubble"] for r in ranks if r["bubble"] is not None]
        s, plan, n = self.pipe, self.plan, self.num_ubatches
        cls = SCHEDULES[s.schedule][0].__name__
        return {
            "pipeline": {
                "pipeline": s.pipeline, "data_parallel": self.dp_world, "placement": s.placement,
                "schedule": s.schedule, "torch_schedule": cls, "stage_mode": self.stage_mode.name,
                "num_stages": plan.num_stages, "layers_per_stage": plan.block_size,
                "stages_per_rank": plan.stages_per_rank, "num_ubatches": n, "partition_state": s.partition_state,
                "side_inputs": "rebuilt per stage from the batch (mask, labels, micro-batch index as keyword "
                               "arguments); only hidden states cross ranks",
                "bubble_measured": sum(bubbles) / len(bubbles) if bubbles else None,
                "bubble_predicted": plan.bubble_fraction(n),
                "bubble_overhead_predicted": plan.bubble_overhead(n),
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
        try:
            args = (b.input_ids, b.token_type_ids) if 0 in self.stages else ()
            kwargs = {"mask": b.attention_mask, "ubatch": torch.zeros(len(b), dtype=torch.long)}
            with self.acc.meter.part("activations"):
                out = sched.step(*args, return_outputs=True, **kwargs)
            self.timeline.chunks.clear()
        finally:
            for st in self.stages.values():
                st.module.train()
        # the logits' shape first: (rows, labels) for a classifier, (rows, sequence, vocabulary) for an LM
        shape = torch.zeros(3, dtype=torch.long)
        if out is not None:
            shape[: out.dim()] = torch.tensor(out.shape)
        dist.broadcast(shape, src=self.last_rank, group=self.pp_group)
        dims = [int(d) for d in shape if d > 0]
        logits = out.float().cpu() if out is not None else torch.empty(dims)
        dist.broadcast(logits, src=self.last_rank, group=self.pp_group)
        return logits

    # ---- checkpoints and weights: Hugging Face names, gathered on rank 0 ----------------------------

    def _named(self, st: StageState, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for sl in st.slices:
            for name, view in sl.layout.views(flat[sl.offset : sl.offset + sl.layout.numel]):
                yield self.spec.hf_name(sl.index, name), view

    def collect(self) -> None:
        """Collective: rank 0 gets every stage's weights and moments (the partitioned moments first
        gathered over the data-parallel group), by Hugging Face name: the baselines' checkpoint layout,
        so a run resumes with any pipeline degree or placement (resharding on load), or none."""
        if self._collected_at == self.step_count:  # every rank decides alike
            return
        mine: dict[str, dict[str, torch.Tensor]] = {"weights": {}, "moments": {}}
        for st in self.stages.values():
            m, v = st.full_moments(self.dp_group)
            steps = st.steps_taken()
            named = zip(self._named(st, st.w), self._named(st, m), self._named(st, v))
            for (name, w), (_, exp_avg), (_, exp_avg_sq) in named:
                mine["weights"][name] = w.detach().cpu().clone()
                if steps > 0:  # as the baselines: moments once the optimizer has stepped
                    mine["moments"][f"{name}.exp_avg"] = exp_avg.detach().cpu().clone()
                    mine["moments"][f"{name}.exp_avg_sq"] = exp_avg_sq.detach().cpu().clone()
                    mine["moments"][f"{name}.step"] = torch.tensor(steps, dtype=torch.float32)
        self._collected_at = self.step_count
        if self.dp_rank != 0:
            return
        parts: list[Any] | None = [None] * self.pipe.pipeline if self.dist.rank == 0 else None
        dist.gather_object(mine, parts, dst=0, group=self.pp_group)
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
            yield from self._named(st, st.w)

    def state_files(self) -> Iterator[tuple[str, bytes]]:
        assert self._full is not None, "collect() first"
        yield "model.safetensors", tensors_bytes(self._full["weights"])
        yield "optimizer.safetensors", tensors_bytes(self._full["moments"])

    @torch.no_grad()
    def load_state(self, ckpt: Path, manifest: dict[str, Any]) -> None:
        """Every rank reads the checkpoint and takes its own layers (and its shard of their moments)."""
        weights = read_tensors(ckpt, "model.safetensors", manifest)
        moments = read_tensors(ckpt, "optimizer.safetensors", manifest)
        for st in self.stages.values():
            m_full = torch.zeros(st.padded)
            v_full = torch.zeros(st.padded)
            steps = 0.0
            for (name, w), (_, m), (_, v) in zip(
                self._named(st, st.w), self._named(st, m_full), self._named(st, v_full)
            ):
                if name not in weights:
                    raise CheckpointError(f"{ckpt}: model.safetensors has no {name}")
                if weights[name].shape != w.shape:
                    raise CheckpointError(
                        f"{ckpt}: {name} has shape {tuple(weights[name].shape)}, expected {tuple(w.shape)}"
                    )
                w.copy_(weights[name])
                if f"{name}.exp_avg" in moments:
                    m.copy_(moments[f"{name}.exp_avg"])
                    v.copy_(moments[f"{name}.exp_avg_sq"])
                    steps = float(moments[f"{name}.step"])
            st.m.copy_(m_full[st.lo : st.hi])
            st.v.copy_(v_full[st.lo : st.hi])
            st.set_steps(steps)
        self._full, self._collected_at = None, -1

    @torch.no_grad()
    def load_hf(self, tensors: Any) -> list[str]:
        missing = []
        for st in self.stages.values():
            for name, view in self._named(st, st.w):
                t = self.spec.lookup_hf(tensors, name)
                if t is None:
                    missing.append(name)
                else:
                    view.copy_(t.reshape(view.shape))
        return missing

    def close(self) -> None:
        # leave reductions in flight alone: a failing rank must exit at once, not wait on its peers
        self._schedules.clear()


def _selected(cfg: Any) -> bool:
    return int(cfg.dist.pipeline) > 1


SPEC = register_parallel(
    ParallelSpec(
        name="pipeline",
        description="layered-GA §4: modular (or contiguous) pipeline stages on torch.distributed.pipelining, "
        "data parallel across pipelines",
        selected=_selected,
        settings=PipelineSettings.from_cfg,
        runner=PipelineRunner,
        layout=layout,
        validate=validate,
    )
)

__all__ = ["PipelineRunner", "PipelineSettings", "StagePlan"]
