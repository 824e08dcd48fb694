"""L2L stages: a modular pipeline whose stages run layer-to-layer execution (L2L Alg. 3 on each rank, the
layered-GA paper's §3 and §8.2 offloaded rows), ``mode=l2l`` with ``dist.pipeline > 1``.

Each rank's eager param-server holds only the layers of its stages, in host memory; the device holds the
relay's slots and the stash. The schedule is Alg. 3's with the layer loop cut at stage boundaries, the
layered-GA paper's breadth-first pipeline:

- forward: for each of this rank's stages, in order; for each of its layers: load the layer once (the
  relay), then every micro-batch through it, stashing its input (device or host, ``mode.stash``); a stage's
  first layer receives each micro-batch's hidden state from the previous stage's rank as it arrives, its last
  sends each one on as soon as it is computed, so the next rank starts on micro-batch 0 at once;
- the turn: the head's forward and backward per micro-batch, on the last stage's rank;
- backward: the stages in reverse, each layer loaded once more, recomputed from its stash per micro-batch
  with the gradient from the stage above (received per micro-batch), its accumulated gradient handed to the
  EPS, which reduces it over the data-parallel pipelines in the background as it lands;
- the update: on the host, once every gradient is in; the gradient norms are combined over the pipeline's
  ranks first (global clipping is exact: the same coefficient as one process), and one verdict on
  non-finite gradients holds for every rank;
- ``mode=l2l_p``: each layer is updated on the EPS thread as its gradient lands (Alg. 4), speculatively as
  in one process (engine/speculative.py); the verdict at the step's end takes the pipeline's norms
  (``pipeline_norms``), so a rank whose own layers would not clip still rolls its updates back and redoes
  them when the whole model's norm says clip. The numbers are ``mode=l2l`` stages' bit for bit.

Hidden states travel in FP32 over the pipeline group (NCCL between GPUs, gloo on CPU); the micro-batch index
is the loop's own. What is not built: the disk tier (refused by the tier: one process).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from l2l_cli import checkpoint as ckpt
from l2l_cli.data.batches import Batch
from l2l_cli.engine.dist import DistContext
from l2l_cli.engine.eps import EagerParamServer
from l2l_cli.engine.optim import clip_coefficients
from l2l_cli.engine.relay import Relay
from l2l_cli.engine.speculative import Speculation
from l2l_cli.engine.stash import CpuStash, DeviceStash
from l2l_cli.engine.trailing import TrailingUpdate, finish_updates
from l2l_cli.modes.base import RunnerArgs, RunnerBase, StepReport, run_head
from l2l_cli.modes.registry import ModeSpec, update_schedule
from l2l_cli.parallel.pipeline.bubble import (
    StageTimes,
    bubble_section,
    layer_chunk_weights,
    layer_flops,
    layer_params,
    pipeline_section,
    relay_cost,
    run_action,
)
from l2l_cli.parallel.pipeline.calibrate import link_costs
from l2l_cli.parallel.pipeline.groups import neighbours, pipeline_groups, pipeline_position
from l2l_cli.parallel.pipeline.p2p import StageMessages, from_last_stage, logits_from_last_stage
from l2l_cli.parallel.pipeline.plan import StagePlan, hidden_bytes
from l2l_cli.parallel.pipeline.rank_layers import RankLayers
from l2l_cli.parallel.pipeline.runner import PipelineRunner
from l2l_cli.parallel.pipeline.settings import PipelineSettings, eps_stages
from l2l_cli.parallel.pipeline.shards import gather_on_rank0, in_layer_order, write_layer_files


class L2LStagesRunner(RunnerBase):
    """One rank of a pipeline of L2L stages: its EPS (its stages' layers), the relay and the stash."""

    def __init__(self, args: RunnerArgs, mode: ModeSpec):
        super().__init__(args)
        s: PipelineSettings = args.parallel
        self.pipe, self.stage_mode = s, mode
        P, world = s.pipeline, self.dist.world
        self.pp_rank, self.dp_rank, self.dp_world = pipeline_position(self.dist, P)
        # hidden states on the run's backend; the EPS reduces host buffers over a gloo group of its own
        groups = pipeline_groups(P, world, self.pp_rank, self.dp_rank, self.dist.backend, dp_backend="gloo")
        self.pp_group, self.pp_host = groups.pp, groups.pp_host
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
        self.my_stages = self.plan.stages_of(self.pp_rank)
        self.index = [i for st in self.my_stages for i in self.plan.layers(st)]
        self.local = {i: j for j, i in enumerate(self.index)}
        self.last_rank = self._global(self.plan.num_stages - 1)
        gloo = self.dist.backend == "gloo"  # a stage's receives all posted as it starts (p2p.StageMessages)
        self.messages = StageMessages(self.pp_group, self.acc.device, self.num_ubatches, self._global, gloo)
        dtype = self.precision.device_dtype
        eps_dist = DistContext(self.dp_rank, self.dp_world, eps_group=groups.dp)  # the EPS's: D pipelines
        self.layers = RankLayers(self.spec, self.index)
        self.eps = EagerParamServer(
            self.layers,
            self.optim,
            self.acc,
            dtype,
            seed=self.seed,
            dist=eps_dist,  # type: ignore[arg-type]
            eager_reduce=self.settings.eager_reduce,
            tier=args.eps_tier,
            timer=self.timer,
        )
        self.relay = Relay(self.acc, self.layers, self.eps, dtype, self.settings.prefetch, self.timer)  # type: ignore[arg-type]
        cpu = self.settings.stash == "cpu"
        self.stash = CpuStash(self.acc, self.eps, self.timer) if cpu else DeviceStash(self.acc, self.timer)
        self.eps.files.numbers = self.index  # its checkpoint files by the model's layer: one process's
        self._shards: dict[str, ckpt.Written] | None = None  # rank 0: the files the ranks wrote
        # l2l_p: each layer updated as its gradient lands, its verdict on the whole pipeline's norms (a
        # stage's tier does not change the schedule: the stages' breadth-first order is its own)
        schedule = update_schedule(
            mode, tier_updates_in_backward=False, eager_reduce=self.settings.eager_reduce
        )
        self.trailing = TrailingUpdate(self.eps) if schedule.trailing else None
        speculate = schedule.in_backward
        self.speculation = (
            Speculation(self.eps, self.trailing, combine=self.pipeline_norms) if speculate else None
        )
        self._lr = 0.0
        self.times = StageTimes()
        self._full: dict[str, torch.Tensor] | None = None
        self.message_bytes, self.seq_len = 0.0, 1  # the last step's hidden state on the wire, its tokens

    def _global(self, stage: int) -> int:
        """The global rank that runs ``stage`` in this rank's pipeline."""
        return self.dp_rank * self.pipe.pipeline + self.plan.rank_of(stage)

    def _body(self, stage: int) -> list[int]:
        """The stage's layers that run per micro-batch forward (the head runs in the turn)."""
        return [i for i in self.plan.layers(stage) if i != self.head]

    def run_layer(self, layer: nn.Module, i: int, x: Any, ub: Batch, side: Any) -> torch.Tensor:
        """The model's layer i on one micro-batch (as L2L's runner: under the precision's autocast)."""
        with self.precision.autocast():
            return self.spec.run_layer(layer, i, x, ub, side)

    # ---- the step: Alg. 3 over this rank's layers, stage by stage -------------------------------------

    def step(self, minibatch: Batch) -> StepReport:
        t_start, lr = time.perf_counter(), self.lr()
        self._lr = lr
        div = self.loss_divisors(minibatch)  # the loss: one mean over the global minibatch's terms
        if self.trailing is not None:
            with self.timer("optimizer"):  # L2L-p: the last step's trailing update, the rows read first
                self.trailing.start_step(minibatch)
        ubatches = self.to_device(minibatch).split(self.num_ubatches)
        dtype = self.precision.device_dtype
        masks = [self.spec.side_inputs(ub, dtype) for ub in ubatches]
        shape = (len(ubatches[0]), ubatches[0].seq_len, self.spec.hidden_size)
        self.message_bytes = hidden_bytes(*shape)
        self.seq_len = shape[1]
        dist.barrier(group=self.pp_host)  # the pipeline's window opens together (as PipelineRunner's)
        t0 = time.perf_counter()
        self.messages.pop_blocked()  # (the step's own waits only)
        x = self.forward_pass(ubatches, masks, shape)
        g: list[Any] = [None] * len(ubatches)
        loss = torch.zeros((), device=self.acc.device)
        if self.head in self.local:
            g, loss = self.head_forward_backward(x, ubatches, div)
        self.backward_pass(g, ubatches, masks, shape)
        self.messages.wait_sends()
        t_own = time.perf_counter()
        dist.barrier(group=self.pp_host)  # the window closes together: a rank done early waits here
        t1 = time.perf_counter()
        blocked = self.messages.pop_blocked() + (t1 - t_own)
        loss = self._pipeline_loss(loss)
        applied, norm = self.finish_overlapped(lr) if self.speculation is not None else self.update(lr)
        phases = self.timer.pop()
        compute = sum(phases.get(k, 0.0) for k in ("forward", "recompute", "backward"))
        self.times.add(self.step_count, phases, compute, t1 - t0, blocked)
        report = self.finish(loss, len(minibatch), t_start, lr, skipped=not applied, grad_norm=norm)
        report.phases = phases
        report.extra = {
            "eps_background_s": self.eps.worker.pop_busy(),
            **self.eps.worker.pop_optimizer(),
            "pipe_compute_s": compute,
            "pipe_bubble": max(0.0, 1 - compute / max(t1 - t0, 1e-9)),
        }
        if self.speculation is not None and self.speculation.last_rollback is not None:
            report.extra["rollback"] = 1.0
        return report

    def forward_pass(self, ubatches: list[Batch], masks: list[Any], shape: tuple[int, ...]) -> list[Any]:
        """for stage in my stages: for l in its layers: for u in ubatches: act = forward(act), stashing each
        layer's input. Returns the last block's output per micro-batch (on the head's rank)."""
        n, S = len(ubatches), self.plan.num_stages
        x: list[Any] = [None] * n
        for s in self.my_stages:
            body = self._body(s)
            self.messages.wait_sends()  # the last stage's messages are out: one stage's in flight at most
            recv = self.messages.recv(shape, s, n, backward=False) if s > 0 else None
            for k, i in enumerate(body):
                j = self.local[i]
                layer = self.relay.acquire(j, prefetch=j + 1 if j + 1 < len(self.index) else None)
                with self.times.layer(i, self.timer):  # (its compute phases only)
                    for u, ub in enumerate(ubatches):
                        if k == 0 and recv is not None:
                            x[u] = self.messages.arrived(recv[u], self.precision.device_dtype)
                        if i > 0:
                            self.stash.put(j, u, x[u])  # the input of layer i
                        self.seed_dropout(i, u)
                        with self.timer("forward"), torch.no_grad(), self.acc.meter.part("activations"):
                            x[u] = self.run_layer(layer, i, x[u], ub, masks[u])
                        if k == len(body) - 1 and s < S - 1:
                            self.messages.send(x[u], s, u, backward=False)  # on to the next rank at once
                            x[u] = None
        return x

    def head_forward_backward(
        self, x: list[Any], ubatches: list[Batch], div: list[float]
    ) -> tuple[list[Any], torch.Tensor]:
        """The head: forward and backward per micro-batch (nothing to recompute), as L2L's turn."""
        j = self.local[self.head]
        layer = self.relay.acquire(j, prefetch=j - 1, grads=True)
        with self.times.layer(self.head, self.timer):
            g, loss = run_head(self, layer, self.head, x, ubatches, div)
        self.relay.send_grads(j)
        self.on_grads_ready(j)
        return g, loss

    def on_grads_ready(self, j: int) -> None:
        """Local layer j's gradient has left the device: L2L reduces it in the background (the update waits
        for the step's end); L2L-p reduces and updates it, speculatively (Alg. 4's Process 2), while the
        device runs the layers below; except local layer 0, the rank's last, whose update trails."""
        if self.speculation is None:
            self.eps.reduce_async(j)
        elif j > 0:
            s = self.settings
            self.speculation.update_async(j, self._lr, self.precision.scaler, self.clip, s.max_grad_norm)

    def backward_pass(
        self, g: list[Any], ubatches: list[Batch], masks: list[Any], shape: tuple[int, ...]
    ) -> None:
        """for stage in reversed(my stages): for l in reversed(its layers): for u in ubatches: recompute l
        from its stash, g = backward(g); each layer's gradient leaves for the EPS once accumulated."""
        n, S = len(ubatches), self.plan.num_stages
        for s in reversed(self.my_stages):
            body = self._body(s)
            self.messages.wait_sends()
            recv = self.messages.recv(shape, s, n, backward=True) if s < S - 1 else None
            for k in reversed(range(len(body))):
                i = body[k]
                j = self.local[i]
                layer = self.relay.acquire(j, prefetch=j - 1 if j > 0 else None, grads=True)
                with self.times.layer(i, self.timer):
                    for u, ub in enumerate(ubatches):
                        if k == len(body) - 1 and recv is not None:
                            g[u] = self.messages.arrived(recv[u], self.precision.device_dtype)
                        x_in = None
                        if i > 0:
                            x_in = self.stash.pop(j, u).detach().requires_grad_()
                            if u + 1 < n:
                                self.stash.prefetch(j, u + 1)
                        self.seed_dropout(i, u)  # the forward's dropout masks
                        with self.timer("recompute"), self.acc.meter.part("workspace"):
                            y = self.run_layer(layer, i, x_in, ub, masks[u])
                        with self.timer("backward"), self.acc.meter.part("workspace"):
                            torch.autograd.backward(y, g[u])
                        g[u] = x_in.grad if x_in is not None else None
                        if k == 0 and s > 0:
                            self.messages.send(g[u], s, u, backward=True)  # down to the previous rank
                            g[u] = None
                self.relay.send_grads(j)
                self.on_grads_ready(j)  # reduced over the pipelines as it lands (and, L2L-p, updated)

    def _pipeline_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The minibatch's mean loss (unscaled: the turn sums the losses before scaling), from the last
        stage's rank to every rank of the pipeline."""
        return from_last_stage(loss.detach().float().cpu(), self.last_rank, self.pp_host)

    def pipeline_norms(self, local: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Collective over the pipeline: every layer's gradient norm in model order, from each rank's own
        (``local``: this rank's layers'), and where this rank's layers are in it. Bit for bit the norms one
        process takes: a float32 squared in float64 is exact, summed with zeros, its root the same float."""
        sq = torch.zeros(self.spec.num_all_layers, dtype=torch.float64)
        sq[self.index] = local.double() ** 2
        dist.all_reduce(sq, group=self.pp_host)  # every layer's squared norm, on every rank
        return sq.sqrt().float(), self.index

    def finish_overlapped(self, lr: float) -> tuple[bool, float]:
        """L2L-p's verdict on the speculative updates (engine/speculative.py), on the pipeline's norms: a
        rank's updates are rolled back and redone when the whole model's norm says clip, though its own
        layers' norm would not; one non-finite gradient anywhere undoes every rank's step."""
        s = self.settings
        assert self.speculation is not None
        with self.timer("optimizer"):
            return self.speculation.finish(self.precision.scaler, (0, lr, self.clip, s.max_grad_norm))

    def update(self, lr: float) -> tuple[bool, float]:
        """Alg. 3's host update of this rank's layers, with the norms of every rank of the pipeline: one
        verdict and one global clipping coefficient for the whole model, as one process takes them."""
        eps, scaler = self.eps, self.precision.scaler
        eps.gather_grads(self.timer)
        with self.timer("optimizer"), eps.worker.work():
            norms, _ = self.pipeline_norms(eps.grad_norms(scaler))
            finite = bool(torch.isfinite(norms).all())
            scaler.update(not finite)
            if finite:
                coefs = clip_coefficients(norms, self.clip, self.settings.max_grad_norm)
                for j, i in enumerate(self.index):
                    eps.update_layer(j, lr, eps.grad_mult(scaler, None if coefs is None else coefs[i]))
        return finite, float(torch.linalg.vector_norm(norms))

    def finish_updates(self) -> None:
        """Every update in flight is in (a held trailing update applied) before anything reads the EPS."""
        finish_updates(self.eps, self.trailing)

    # ---- evaluation: forward only through the first pipeline ---------------------------------------

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        """Logits of a batch (one micro-batch), layer by layer through the pipeline; every rank gets them."""
        self.finish_updates()
        b = self.to_device(batch)
        mask = self.spec.side_inputs(b, self.precision.device_dtype)
        shape = (len(b), b.seq_len, self.spec.hidden_size)
        x: Any = None
        self.relay.train(False)
        try:
            for s in self.my_stages:
                if s > 0:
                    x = self.messages.arrived(
                        self.messages.recv(shape, s, 1, backward=False)[0], self.precision.device_dtype
                    )
                for i in self._body(s):
                    layer = self.relay.acquire(self.local[i])
                    with self.acc.meter.part("activations"):
                        x = self.run_layer(layer, i, x, b, mask)
                if s < self.plan.num_stages - 1:
                    self.messages.send(x, s, 0, backward=False)
            logits = None
            if self.head in self.local:
                layer = self.relay.acquire(self.local[self.head])
                with self.precision.autocast():
                    logits = self.spec.head_logits(layer, x).float().cpu()
            self.messages.wait_sends()
        finally:
            self.relay.train(True)
            self.timer.pop()
        return logits_from_last_stage(logits, self.last_rank, self.pp_host)

    # ---- weights: by Hugging Face name, gathered on rank 0 ------------------------------------------

    def collect(self) -> None:
        """Collective: rank 0 gets every stage's weights by Hugging Face name (the final model)."""
        self.finish_updates()
        mine = {name: t.detach().cpu().clone() for name, t in self.eps.files.hf_tensors()}
        self._full = None
        if self.dp_rank != 0:
            return
        parts = gather_on_rank0(mine, self.pipe.pipeline, self.dist.rank, self.pp_host)
        if parts is not None:
            self._full = {k: v for part in parts for k, v in part.items()}

    def hf_tensors(self) -> Any:
        if self._full is not None:
            return iter(self._full.items())
        self.finish_updates()
        return self.eps.files.hf_tensors()

    def load_hf(self, tensors: Any) -> list[str]:
        self.finish_updates()
        return self.eps.load_hf(tensors)

    def host_parts(self) -> dict[str, int]:
        return self.eps.host_parts()

    # ---- checkpoints: each rank writes its layers' files, rank 0 commits them -------------------------

    def write_shards(self, root: Path, step: int) -> None:
        """Collective: the first pipeline's ranks each write their layers' EPS files (one process's layout,
        by the model's layer number; the other pipelines hold the same state) under the step's shard
        directory; rank 0 gets their names and checksums, and its checkpoint renames them in. No rank ever
        holds another's state; the manifest rank 0 writes last is the commit, as for any checkpoint."""
        self._shards = None
        if self.dp_rank != 0:
            return
        self.finish_updates()
        files = self.eps.files.state_files()
        P, rank = self.pipe.pipeline, self.dist.rank
        self._shards = write_layer_files(files, root, step, self.pp_rank, P, rank, self.pp_host)

    def state_files(self) -> Any:
        """Rank 0: the files every rank wrote (``write_shards``), in the model's layer order."""
        if self._shards is None:
            raise RuntimeError("L2L stages write their checkpoint files in write_shards (the trainer's)")
        shards, self._shards = self._shards, None
        return in_layer_order(shards)

    def load_state(self, ckpt_dir: Any, manifest: dict[str, Any]) -> None:
        """This rank's layers from any checkpoint of the EPS layout: one process's, or a pipeline's of any
        placement (each file is one of the model's layers)."""
        self.finish_updates()
        self.eps.files.load_state(ckpt_dir, manifest)

    def rank_stats(self) -> dict[str, Any]:
        """This rank's layout and mean times per timed step (compute, the pipeline's window, the relay's
        transfers), its bubble, and (L2L-p) the steps whose speculative updates it undid."""
        mine = {"rank": self.dist.rank, "pipeline_rank": self.pp_rank, "data_rank": self.dp_rank}
        mine |= {"stages": self.my_stages, "layers": self.index, **self.times.means()}
        spec = self.speculation
        if spec is not None:  # L2L-p: steps whose speculative updates this rank undid, and how many
            mine |= {"rollbacks": spec.rollbacks, "rolled_back_layer_updates": spec.rollback_layers}
        mine["bubble"] = 1 - mine["compute_s"] / mine["pipeline_s"] if mine["pipeline_s"] > 0 else None
        return mine

    def sections(self) -> dict[str, dict[str, Any]]:
        """summary.json's ``pipeline``: the layout, the bubble measured (1 - compute / pipeline time, the
        mean over ranks) and predicted. Collective: every rank's times are gathered; the costs the model
        charges were settled at build."""
        ranks: list[Any] = [None] * self.dist.world
        dist.all_gather_object(ranks, self.rank_stats())
        s, plan, n = self.pipe, self.plan, self.num_ubatches
        # the pre-run model on this run's compute: its own loops' actions, each layer's measured chunks,
        # the relay's moves by the bytes they carry
        orders = plan.l2l_orders(n)
        load, move_s = relay_cost(orders, ranks, lambda i: layer_params(self.spec, i))
        weights = layer_chunk_weights(plan, ranks, lambda i: layer_flops(self.spec, i, self.seq_len))
        links, nbytes = self.links, self.message_bytes
        if self.acc.device.type == "cpu":  # the host's clock is the device's: the run's own action cost
            links = run_action(links, ranks, orders)
        bubble = bubble_section(plan, n, ranks, orders, weights, links, nbytes, load, move_s)
        runs = {"torch_schedule": None, "stage_mode": self.stage_mode.name}
        section = pipeline_section(s, plan, n, runs, {"stash": self.settings.stash}, ranks, bubble)
        return {"pipeline": section}

    def close(self) -> None:
        try:
            self.finish_updates()
        finally:
            self.eps.close()


def stage_runner(args: RunnerArgs, mode: ModeSpec) -> RunnerBase:
    """The runner of a pipeline rank: L2L stages for a mode whose state is on an EPS, torch's schedules
    over device-resident stages (Alg. 2) otherwise."""
    if eps_stages(mode):
        return L2LStagesRunner(args, mode)
    return PipelineRunner(args, mode)


__all__ = ["L2LStagesRunner", "stage_runner"]
