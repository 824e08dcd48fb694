"""A pipeline stage's training state on this rank: its layers' weights and gradients in two flat device
buffers (the modules' parameters are views of them, so autograd accumulates every micro-batch in place),
the optimizer over this rank's shard of them (all of it unless ``dist.partition_state``) with its moments
in flat shard buffers, and the stage's data-parallel reduction."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from l2l_cli.checkpoint import ModuleState
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.optim import bind_flat, optimizer_runs, set_lr
from l2l_cli.modes.base import RunnerBase
from l2l_cli.parallel.pipeline.stage import StageModule


@dataclass(frozen=True)
class Shard:
    """The part of each stage's flat buffers this data-parallel rank updates: with ``dist.partition_state``
    its 1/D of them (and the optimizer state of that part only), otherwise all of them."""

    rank: int  # the data-parallel rank
    world: int  # D, the data-parallel ranks (pipelines)
    partition: bool  # dist.partition_state


@dataclass(frozen=True)
class LayerSlice:
    index: int  # the model's layer index
    layout: FlatLayout
    offset: int  # in the stage's flat buffers


class StageState:
    """One local stage: its layers' weights and gradients as two flat device buffers, the optimizer over
    this rank's shard of them, and its reduction. ``runner``: the stage's model, device, optimizer settings
    and seed (and, for the stage module, its dropout seeding and precision)."""

    def __init__(self, runner: RunnerBase, layers: list[int], layouts: dict[str, FlatLayout], shard: Shard):
        acc, spec, optim = runner.acc, runner.spec, runner.optim
        self.spec = spec
        self.slices: list[LayerSlice] = []
        offset = 0
        for i in layers:
            self.slices.append(LayerSlice(i, layouts[spec.kind(i)], offset))
            offset += layouts[spec.kind(i)].numel
        D = shard.world
        self.numel = offset
        self.padded = -(-offset // D) * D  # equal shards for the reduce-scatter and all-gather
        size = self.padded // D if shard.partition else self.padded
        self.lo = shard.rank * size if shard.partition else 0
        self.hi = self.lo + size
        self.w = acc.empty(self.padded, torch.float32, part="weights").zero_()
        self.g = acc.empty(self.padded, torch.float32, part="grads").zero_()
        partitioned = shard.partition and D > 1
        # the gradient the optimizer reads: the reduce-scatter's output shard, or the stage's own buffer
        self.g_opt = acc.empty(size, torch.float32, part="grads").zero_() if partitioned else self.g
        self.partitioned = partitioned
        self.m = acc.empty(size, torch.float32, part="optimizer_state").zero_()
        self.v = acc.empty(size, torch.float32, part="optimizer_state").zero_()
        modules = []
        with acc.meter.part("weights"):
            for sl in self.slices:
                n = sl.layout.numel
                w, g = self.w[sl.offset : sl.offset + n], self.g[sl.offset : sl.offset + n]
                sl.layout.pack(spec.build_layer(sl.index, runner.seed), w)  # every mode's seeded init
                shell = spec.new_layer(spec.kind(sl.index), device="meta")
                sl.layout.bind(shell, w, g)
                modules.append(spec.materialize(shell, acc.device))
        self.module = StageModule(spec, layers, modules, runner).train()
        # the optimizer over each layer's runs (engine/optim: AdamW's two, decayed and not; LAMB's one per
        # tensor), clipped to this rank's shard; parameters, gradients and moments are views of flat buffers
        self.groups: dict[int, list[tuple[int, int]]] = {}  # layer -> [a, b) ranges in the shard it updates
        runs = []
        lo = self.lo
        for sl in self.slices:
            for name, a, b in optimizer_runs(sl.layout, optim.flat_runs):
                a, b = max(sl.offset + a, lo), min(sl.offset + b, self.hi)
                if b <= a:
                    continue
                moments = {"exp_avg": self.m[a - lo : b - lo], "exp_avg_sq": self.v[a - lo : b - lo]}
                runs.append((name, self.w[a:b], self.g_opt[a - lo : b - lo], moments))
                self.groups.setdefault(sl.index, []).append((a - lo, b - lo))
        self.optimizer = bind_flat(runs, optim) if runs else None
        self.reduce: Any = None  # the data-parallel reduction in flight

    def named(self, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, view) of every parameter in ``flat``, a buffer of the stage's layout."""
        for sl in self.slices:
            for name, view in sl.layout.views(flat[sl.offset : sl.offset + sl.layout.numel]):
                yield self.spec.hf_name(sl.index, name), view

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

    @torch.no_grad()
    def load(self, saved: ModuleState) -> None:
        """This stage's weights, and this rank's shard of their moments, from a checkpoint of the module
        layout (written by any runner: any pipeline degree or placement, or none)."""
        m_full = torch.zeros(self.padded)
        v_full = torch.zeros(self.padded)
        moments = saved.load(self.named(self.w))
        steps = 0.0
        for (name, m), (_, v) in zip(self.named(m_full), self.named(v_full)):
            if name in moments:
                m.copy_(moments[name]["exp_avg"])
                v.copy_(moments[name]["exp_avg_sq"])
                steps = float(moments[name]["step"])
        self.m.copy_(m_full[self.lo : self.hi])
        self.v.copy_(v_full[self.lo : self.hi])
        self.set_steps(steps)
