"""What every runner shares: the typed arguments it is built from, the step report, the ``Runner``
protocol the trainer drives, dropout seeding, and the device-resident model of the baselines (placement,
update, evaluation, checkpoints). The schedules themselves live in the mode files."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from l2l_cli.checkpoint import ModuleState, module_state_files
from l2l_cli.data.batches import Batch
from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.dist import DistContext
from l2l_cli.engine.optim import (
    OptimSettings,
    clip_coefficients,
    layer_norms,
    lr_at,
    make_optimizer,
    param_groups,
    set_lr,
    state_step,
)
from l2l_cli.engine.precision import Precision
from l2l_cli.engine.recompute import RecomputeSettings
from l2l_cli.engine.tiers import TierSettings
from l2l_cli.models.base import ModelSpec
from l2l_cli.models.layered import LayeredModel
from l2l_cli.profiling.timers import PhaseTimer

if TYPE_CHECKING:
    from l2l_cli.checkpoint import RealtimeWriter

LayerFiles = list[tuple[str, Callable[[], dict[str, torch.Tensor]]]]  # (file name, its tensors when called)


@dataclass(frozen=True)
class StepSettings:
    """How a runner executes a step: the config's execution keys, resolved for its mode."""

    num_ubatches: int
    ubatch_size: int
    seed: int
    total_steps: int  # the lr schedule's length
    clip: str  # global | layer | none (optim.clip=auto resolved by the mode)
    max_grad_norm: float
    stash: str | None = None  # device | cpu (the L2L modes)
    prefetch: bool = True  # relay: copy layer l+1 while layer l computes
    eager_reduce: bool = True  # EPS: reduce each layer's gradient as it lands
    sync_timers: bool = False
    recompute: RecomputeSettings = field(default_factory=RecomputeSettings)  # the L2L modes
    cuda_graphs: str = "off"  # the L2L modes' blocks as CUDA graphs: auto | on | off (engine/graphs.py)


@dataclass(frozen=True)
class RunnerArgs:
    """Everything a runner is built from (typed; never the whole config)."""

    spec: ModelSpec
    acc: Accelerator
    precision: Precision
    settings: StepSettings
    optim: OptimSettings
    dist: DistContext = field(default_factory=DistContext)
    eps_tier: TierSettings = field(default_factory=TierSettings)  # where an EPS keeps the state (eps.*)
    parallel: Any = None  # the parallel strategy's typed settings (pipeline: PipelineSettings); None: none


@dataclass
class StepReport:
    loss: float
    samples: int
    step_time_s: float
    phases: dict[str, float]
    lr: float
    skipped: bool = False  # non-finite gradients: no update was applied
    grad_norm: float | None = None
    loss_scale: float = 1.0
    extra: dict[str, float] = field(default_factory=dict)


class DurableState(Protocol):
    """A training state that is a checkpoint by itself (the disk EPS: every layer in its own file, committed
    after each step), so the trainer commits it instead of saving one, and resumes from its last commit."""

    root: Path  # where it lives: the checkpoint a stop points to

    def commit(self, step: int, trainer_state: dict[str, Any], ident: dict[str, Any] | None = None) -> None:
        """Make the state after ``step`` (and the trainer's ``trainer_state``) the one a restart finds."""
        ...

    def resume_point(self) -> dict[str, Any] | None:
        """The last commit it started from (its step, identity and ``trainer`` state), if any."""
        ...

    def summary(self) -> dict[str, Any]:
        """summary.json's section on it (``eps_disk``)."""
        ...


@runtime_checkable
class Runner(Protocol):
    """What the trainer, the checkpointer and the evaluator drive. ``step_count`` is the number of
    optimizer steps taken (the dropout seed, the lr schedule and the data position follow it)."""

    spec: ModelSpec
    acc: Accelerator
    precision: Precision
    step_count: int

    def step(self, minibatch: Batch) -> StepReport: ...

    def predict(self, batch: Batch) -> torch.Tensor: ...

    def load_hf(self, tensors: Any) -> list[str]: ...

    def hf_tensors(self) -> Iterable[tuple[str, torch.Tensor]]: ...

    def host_parts(self) -> dict[str, int]: ...

    def state_files(self) -> Iterator[tuple[str, bytes]]: ...

    def load_state(self, ckpt: Path, manifest: dict[str, Any]) -> None: ...

    def collect(self) -> None:
        """Collective (every rank calls it): bring the training state to rank 0, which writes checkpoints
        and the final model. A no-op where rank 0 already holds all of it."""
        ...

    def write_shards(self, root: Path, step: int) -> None:
        """Collective, before rank 0 writes step ``step``'s checkpoint under ``root``: where no rank holds
        the whole state (a pipeline's L2L stages), each rank writes its own files under
        ``checkpoint.shard_dir`` and rank 0's ``state_files`` names them. A no-op otherwise."""
        ...

    def sections(self) -> dict[str, dict[str, Any]]:
        """Collective: the mode's own summary.json sections (``pipeline``: per-rank times, the bubble)."""
        ...

    def attach_realtime(self, writer: RealtimeWriter) -> None:
        """Real-time checkpoints (``trainer.realtime_ckpt``): hand each layer's file to ``writer`` right
        after its update. Only modes that keep the state per layer on the host (an EPS) can."""
        ...

    def layer_files(self) -> LayerFiles:
        """Every layer's real-time checkpoint file, as views of the live state taken when called: a step's
        real-time checkpoint writes those its updates did not (a skipped step's)."""
        ...

    def durable_state(self) -> DurableState | None:
        """The state's own checkpoint when it keeps one (a disk EPS); None: the trainer's saves are the
        only checkpoints."""
        ...

    def close(self) -> None: ...


def ubatch_seed(seed: int, step: int, layer: int, ubatch: int) -> int:
    """The dropout seed of (step, layer, micro-batch): a layer-by-layer runner and a whole-model runner
    that reseed with it draw the same dropout masks, and a recompute reproduces its forward exactly."""
    return ((seed * 1_000_003 + step) * 1_000_033 + layer * 8_191 + ubatch) % (2**63 - 1)


def _metered(fn: Any, kind: str) -> Any:
    """``fn(self, batch, ...)`` inside a meter window keyed by the batch's shape (see
    ``MemoryMeter.window``); a training step on the compute thread's cores for one (``Accelerator.launching``:
    on CUDA one core launches, the rest are the EPS's)."""

    @functools.wraps(fn)
    def run(self: Any, batch: Batch, *args: Any, **kw: Any) -> Any:
        cores = self.acc.launching() if kind == "train" else nullcontext()
        with cores, self.acc.meter.window((kind, tuple(batch.input_ids.shape))):
            return fn(self, batch, *args, **kw)

    run._metered = True  # type: ignore[attr-defined]
    return run


class RunnerBase:
    """Shared mechanics: dropout seeding, inputs to the device, the lr schedule, the step report.

    Every subclass's ``step`` and ``predict`` run in a device-memory meter window (wrapped here, so a new
    mode cannot forget it): the meter counts the device tier's allocations there and nowhere else. A step
    also runs on the compute thread's share of the host's cores."""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        for name, kind in (("step", "train"), ("predict", "eval")):
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "_metered", False):
                setattr(cls, name, _metered(fn, kind))

    def __init__(self, args: RunnerArgs):
        self.args = args
        self.spec, self.acc, self.precision, self.dist = args.spec, args.acc, args.precision, args.dist
        self.settings, self.optim = args.settings, args.optim
        self.total_steps = args.settings.total_steps
        self.num_ubatches = args.settings.num_ubatches
        self.clip = args.settings.clip
        self.seed = args.settings.seed
        self.timer = PhaseTimer(args.acc.wait_compute if args.settings.sync_timers else None)
        self.step_count = 0

    def seed_dropout(self, layer: int, ubatch: int) -> None:
        """Reseed dropout for (layer, micro-batch), numbering micro-batches across data-parallel ranks, so
        N ranks draw the masks one process with the whole global minibatch draws."""
        global_ubatch = self.dist.data_rank * self.num_ubatches + ubatch
        self.acc.seed(ubatch_seed(self.seed, self.step_count, layer, global_ubatch))

    def to_device(self, batch: Batch) -> Batch:
        return batch.to(self.acc.device, copy=self.acc.copies_inputs)

    def lr(self) -> float:
        return lr_at(self.step_count, self.total_steps, self.optim)

    def loss_divisors(self, minibatch: Batch, parts: int | None = None) -> list[float]:
        """Per micro-batch of ``minibatch`` (on the host, before the step), what its mean loss is divided
        by so that the minibatch's loss is the sum of every loss term over its micro-batches and the
        data-parallel ranks, divided by their global count (torchtitan's ``global_valid_tokens``): the
        global count over (its own count x the data-parallel ranks, whose gradients are averaged). One
        mean whatever ``batch.ubatch_size``, the mode or the ranks; with equal counts (one label per
        example) the divisor is exactly the number of micro-batches. inf for a micro-batch with no term.
        ``parts``: the micro-batches the mode cuts (default ``batch.size / batch.ubatch_size``)."""
        counts = [self.spec.loss_count(ub) for ub in minibatch.split(parts or self.num_ubatches)]
        total, world = self.dist.data_sum(sum(counts)), self.dist.data_world
        return [total / (c * world) if c else math.inf for c in counts]

    def finish(self, loss: torch.Tensor, samples: int, t0: float, lr: float, **kw: Any) -> StepReport:
        self.step_count += 1
        return StepReport(
            loss=float(loss),
            samples=samples,
            step_time_s=time.perf_counter() - t0,
            phases=self.timer.pop(),
            lr=lr,
            loss_scale=self.precision.scaler.scale,
            **kw,
        )

    def host_parts(self) -> dict[str, int]:
        return {}

    def collect(self) -> None:
        return None

    def write_shards(self, root: Path, step: int) -> None:
        return None

    def sections(self) -> dict[str, dict[str, Any]]:
        """``peft``: a LoRA run's settings and parameter counts (the whole model lives on the device)."""
        from l2l_cli.models.lora import lora_of, summary_section

        return {"peft": summary_section(self.spec, None)} if lora_of(self.spec) is not None else {}

    def attach_realtime(self, writer: RealtimeWriter) -> None:
        raise NotImplementedError(f"{type(self).__name__}: real-time checkpoints need the state on an EPS")

    def layer_files(self) -> LayerFiles:
        return []

    def durable_state(self) -> DurableState | None:
        return None  # the state lives in memory: the trainer's checkpoints are its only copy on disk

    def close(self) -> None:
        return None


class DeviceResident(RunnerBase):
    """The baselines' arrangement: the whole model, its gradients and optimizer state on the device."""

    def __init__(self, args: RunnerArgs):
        super().__init__(args)
        acc = self.acc
        with acc.meter.part("weights"):
            self.model = LayeredModel(self.spec, seed=self.seed, device=acc.device)
        self.model.train()
        # a frozen base (peft=lora) has no gradient and no optimizer state: only what trains gets them
        with acc.meter.part("grads"):  # resident gradient buffers, zeroed (not freed) after each update
            for p in self.model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        for p in self.model.parameters():  # allocation points this runner owns (CUDA's meter parts)
            acc.meter.count(p, "weights")
            if p.grad is not None:
                acc.meter.count(p.grad, "grads")
        self._state_counted = False
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        with acc.meter.part("optimizer_state"):
            self.optimizer = make_optimizer(param_groups(named, self.optim.weight_decay), self.optim)
        self.net: torch.nn.Module = self.model
        if self.dist.enabled:  # data parallel: DDP averages gradients over the ranks during backward
            from torch.nn.parallel import DistributedDataParallel

            ids = [acc.device.index] if acc.device.type == "cuda" else None
            with acc.meter.part("grads"):
                self.net = DistributedDataParallel(self.model, device_ids=ids, broadcast_buffers=False)

    @torch.no_grad()
    def load_hf(self, tensors: Any) -> list[str]:
        return self.model.load_hf_state_dict(tensors)

    def hf_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The trained tensors by Hugging Face name (with adapters: the adapters only; the base is
        ``model.pretrained``'s or the seed's, unchanged)."""
        return self.model.hf_state_dict(trainable_only=True).items()

    def full_layers(self) -> Iterator[tuple[int, torch.nn.Module]]:
        """(index, a CPU copy of the layer: base and adapters) per layer (``l2l export --merge``)."""
        import copy

        for i, layer in self.model.layers():
            yield i, copy.deepcopy(layer).to("cpu", torch.float32)

    def forward_backward(self, ub: Batch, u: int, scale: float, sync: bool = True) -> torch.Tensor:
        """One (micro-)batch through the whole model and back; returns its loss (detached). ``sync``:
        whether data-parallel ranks reduce gradients in this backward (only the last micro-batch)."""

        def seed_fn(layer: int) -> None:
            self.seed_dropout(layer, u)

        no_sync = self.net.no_sync() if self.dist.enabled and not sync else nullcontext()
        with no_sync:
            with self.timer("forward"), self.acc.meter.part("activations"), self.precision.autocast():
                loss, _ = self.net(ub, seed_fn=seed_fn)
            with self.timer("backward"), self.acc.meter.part("backward"):
                self.precision.scaler.scale_loss(loss * scale).backward()
        return loss.detach()

    def update(self) -> tuple[bool, float]:
        """Unscale, check for non-finite gradients, clip, and step; returns (applied, grad norm)."""
        scaler = self.precision.scaler
        # per layer, a tied LM head's tensor counted once, in the pre layer (as the EPS does)
        layers = [
            [p.grad for _, p in self.model.own_parameters(i, m) if p.grad is not None]
            for i, m in self.model.layers()
        ]
        if scaler.scale != 1.0:
            torch._foreach_mul_([g for gs in layers for g in gs], 1.0 / scaler.scale)
        norms = layer_norms(layers)
        finite = bool(torch.isfinite(norms).all())
        scaler.update(not finite)
        if finite:
            coefs = clip_coefficients(norms, self.clip, self.settings.max_grad_norm)
            if coefs is not None:
                for grads, c in zip(layers, coefs):
                    if grads:  # (a frozen layer has none)
                        torch._foreach_mul_(grads, c)
            set_lr(self.optimizer, self.lr())
            with self.acc.meter.part("optimizer_state"):
                self.optimizer.step()
            if not self._state_counted:  # the moments exist from the first step on
                self._state_counted = True
                for st in self.optimizer.state.values():
                    for t in st.values():
                        if isinstance(t, torch.Tensor) and t.device == self.acc.device and t.dim():
                            self.acc.meter.count(t, "optimizer_state")
        self.optimizer.zero_grad(set_to_none=False)
        return finite, float(torch.linalg.vector_norm(norms))

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        self.model.eval()
        try:
            with self.precision.autocast(), self.acc.meter.part("activations"):
                _, logits = self.model(self.to_device(batch))
            return logits.float().cpu()
        finally:
            self.model.train()

    # ---- checkpoints: the model and optimizer state by Hugging Face parameter name -----------------

    def state_files(self) -> Iterator[tuple[str, bytes]]:
        named = self.model.hf_state_dict(trainable_only=True)
        moments = {name: st for name, p in named.items() if (st := self.optimizer.state.get(p))}
        return module_state_files(named, moments)

    @torch.no_grad()
    def load_state(self, ckpt: Path, manifest: dict[str, Any]) -> None:
        named = self.model.hf_state_dict(trainable_only=True)
        for name, st in ModuleState(ckpt, manifest).load(named.items(), whole=True).items():
            p = named[name]
            self.optimizer.state[p] = {
                k: state_step(self.optimizer, p, t) if k == "step" else t.to(p.device).clone()
                for k, t in st.items()
            }

    def close(self) -> None:
        # drop DDP while its process group is alive: a Reducer that outlives the group tears the group
        # down itself, holding the GIL, and can deadlock against gloo's worker threads
        self.net = self.model


def run_head(
    r: RunnerBase, layer: nn.Module, head: int, x: list[Any], ubatches: list[Batch], div: list[float]
) -> tuple[list[Any], torch.Tensor]:
    """The head's forward and backward per micro-batch (``head``: its index in the model, for the dropout
    seed): dLoss/d(last block output) per micro-batch and the minibatch's loss (each micro-batch's mean
    divided by its ``div``, see ``RunnerBase.loss_divisors``), summed on the device (no host sync per
    micro-batch). Shared by L2L and the pipeline's L2L stages."""
    n = len(ubatches)
    g: list[Any] = [None] * n
    loss = torch.zeros((), device=r.acc.device)
    for u, ub in enumerate(ubatches):
        x_in = x[u].detach().requires_grad_()
        r.seed_dropout(head, u)
        with r.timer("forward"), r.acc.meter.part("activations"), r.precision.autocast():
            loss_u, _ = r.spec.run_head(layer, x_in, ub)
        with r.timer("backward"), r.acc.meter.part("workspace"):
            r.precision.scaler.scale_loss(loss_u / div[u]).backward()
        g[u], x[u] = x_in.grad, None
        loss += loss_u.detach().float() / div[u]
    return g, loss
