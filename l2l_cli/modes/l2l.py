"""Algorithm 3 (L2L v1; Alg. 2 in v2): layer-to-layer execution.

The model and its training state live in the eager param-server (host memory); the device holds the
executing layer and the next one (the relay). The loops are inverted: every micro-batch runs through
layer l before layer l+1 is loaded, so each layer crosses the link once per pass however many
micro-batches there are. Only each layer's input is stashed (on the device, or on the host with
``mode.stash=cpu``); in backward each layer is recomputed from its stash, its gradient accumulates over
the micro-batches on the device, then goes to the EPS and the device copy is released before the next
layer. The host updates every layer at the end of the step (or, as the runner's schedule says, each
layer as its gradient lands: Alg. 4, ``modes/l2l_p.py``; see ``step``). With spare device memory the last
``mode.keep_layers`` blocks keep their graph instead, and ``mode.recompute=selective`` saves each block's
matmul outputs (engine/recompute.py): less or no recompute, the same numbers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from l2l_cli.data.batches import Batch
from l2l_cli.engine import graphs as cuda_graphs
from l2l_cli.engine.decode import LayeredDecoder
from l2l_cli.engine.eps import EagerParamServer
from l2l_cli.engine.recompute import (
    MARGIN,
    LayerBytes,
    RecomputePlan,
    choose,
    default_cpu_budget,
    measure_block,
    measure_pre,
    run_selective,
)
from l2l_cli.engine.relay import Relay
from l2l_cli.engine.speculative import Speculation
from l2l_cli.engine.stash import CpuStash, DeviceStash
from l2l_cli.engine.trailing import TrailingUpdate, finish_updates
from l2l_cli.models.base import BLOCK, POST
from l2l_cli.models.decoder import DecoderSpec
from l2l_cli.models.lora import lora_of, summary_section
from l2l_cli.modes.base import DurableState, LayerFiles, RunnerArgs, RunnerBase, StepReport, run_head
from l2l_cli.modes.registry import ModeSpec, UpdateSchedule, update_schedule

if TYPE_CHECKING:
    from l2l_cli.checkpoint import RealtimeWriter

log = logging.getLogger("l2l")


class L2LRunner(RunnerBase):
    """Alg. 3 (and Alg. 4 with ``mode``'s schedule): the EPS, the relay, the stash, and the update schedule
    chosen once here, from the mode's spec and the EPS tier's capabilities."""

    def __init__(self, args: RunnerArgs, mode: ModeSpec):
        super().__init__(args)
        acc, spec, dtype = self.acc, self.spec, self.precision.device_dtype
        self.eps = EagerParamServer(
            spec,
            self.optim,
            acc,
            dtype,
            seed=self.seed,
            dist=self.dist,
            eager_reduce=self.settings.eager_reduce,
            tier=args.eps_tier,
            timer=self.timer,
        )
        # when the host updates each layer (Alg. 3: after the backward; Alg. 4: in it), and the parts that
        # schedule needs beside the EPS
        self.schedule: UpdateSchedule = update_schedule(
            mode, self.eps.tier.update_in_backward, self.settings.eager_reduce
        )
        self.trailing = TrailingUpdate(self.eps) if self.schedule.trailing else None
        self.speculation = (  # (one process's EPS holds every layer: a clipped step can be replayed)
            Speculation(self.eps, self.trailing, replay=True) if self.schedule.in_backward else None
        )
        self.relay = Relay(acc, spec, self.eps, dtype, self.settings.prefetch, self.timer)
        self.stash = (
            CpuStash(acc, self.eps, self.timer)
            if self.settings.stash == "cpu"
            else DeviceStash(acc, self.timer)
        )
        self.head = spec.num_layers + 1  # layer indices: 0 = embeddings, 1..N = blocks, N+1 = head
        tokens = self.settings.ubatch_size * self.settings.recompute.seq_len  # (the longest micro-batch)
        flops = 2 * tokens * (self.relay.numel[BLOCK] + self.relay.frozen_numel[BLOCK])
        self.block_graphs = cuda_graphs.for_runner(
            self.settings.cuda_graphs, acc, flops, spec, self.precision
        )
        self.recompute = self.plan_recompute()
        for slot in self.relay.slots:  # the head's shells run its loss as the plan says
            if POST in slot.shells:
                spec.keep_head_graph(slot.shells[POST], self.recompute.head_kept)
        # the progress header's part (none for today's default: full recompute, nothing kept)
        self.recompute_info = None if self.settings.recompute.trivial else self.recompute.describe()
        self.graphs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # kept: (input, output)
        self.steady = {"steps": 0, "optimizer_s": 0.0, "optimizer_exposed_s": 0.0}
        # the host's passes and the link's bytes from the first training step on (building, loading
        # weights and a resume's checkpoint are no step's), and the steps since
        self.traffic: tuple[dict[str, int], dict[str, float], int] | None = None
        self.traffic_steps = 0

    def run_layer(
        self, layer: nn.Module, i: int, x: torch.Tensor | None, ub: Batch, side: Any, graph: bool = False
    ) -> torch.Tensor:
        """Layer i's forward on one micro-batch (embeddings read the token ids, blocks the hidden states;
        with ``graph`` (the forward pass), a block through its CUDA graph where ``mode.cuda_graphs`` made
        them)."""
        if graph and self.block_graphs is not None and x is not None:
            return self.block_graphs.forward(layer, i, x, side)
        with self.precision.autocast():
            return self.spec.run_layer(layer, i, x, ub, side)

    def step(self, minibatch: Batch) -> StepReport:
        """One step on ``self.schedule``: Alg. 3's forward, turn and backward, and the host update after
        the backward (``AFTER_BACKWARD``) or each layer's as its gradient lands, speculatively
        (``IN_BACKWARD``; ``IN_BACKWARD_TRAILING``, Alg. 4: the last one behind the next forward)."""
        t0, lr = time.perf_counter(), self.lr()
        scaler, clip, max_norm = self.precision.scaler, self.clip, self.settings.max_grad_norm
        if self.traffic is None:
            self.traffic = (*self.eps.passes.snapshot(), self.relay.transfer_bytes)
        self.traffic_steps += 1
        div = self.loss_divisors(minibatch)  # the loss: one mean over the global minibatch's terms
        if self.trailing is not None:  # Alg. 4: the last step's trailing update, the rows this batch reads
            with self.timer("optimizer"):
                self.trailing.start_step(minibatch)
        ubatches, masks = self.split(minibatch)
        loss = self.forward_backward(ubatches, masks, div, lr)
        replayed = False
        if self.speculation is not None:  # the verdict on the speculative updates; layer 0's (trailing)
            with self.timer("optimizer"):
                applied, norm = self.speculation.finish(scaler, last=(0, lr, clip, max_norm))
            if self.speculation.replay_factor is not None:  # clipping, no gradient kept (eps.clip_redo):
                replayed = True  # the same pass again, from the restored weights, with the factor known
                log.info(
                    "step %d runs again: global gradient norm %.4g > optim.max_grad_norm %g and its "
                    "gradients were not kept (eps.clip_redo=%s)",
                    self.step_count + 1,
                    norm,
                    max_norm,
                    self.eps.tier.clip_redo,
                )
                loss = self.forward_backward(ubatches, masks, div, lr)
                with self.timer("optimizer"):
                    applied, norm = self.speculation.finish(scaler, last=(0, lr, clip, max_norm))
        else:  # Alg. 3: for l in layers: w_l = optimizer(w_l, g_l), on the host, once every gradient is in
            self.eps.reduce_async(0)
            applied, norm = self.eps.step(lr, scaler, clip, max_norm, self.timer)
        extra = self.background()
        if replayed:
            extra["replayed"] = 1.0
        return self.finish(loss, len(minibatch), t0, lr, skipped=not applied, grad_norm=norm, extra=extra)

    def forward_backward(
        self, ubatches: list[Batch], masks: list[torch.Tensor], div: list[float], lr: float
    ) -> torch.Tensor:
        """Alg. 3's forward, the head's turn and the per-layer backward, each layer's gradient handed to the
        EPS as it lands (reduced; under Alg. 4's schedule also updated, speculatively). Returns the loss."""
        scaler, clip, max_norm = self.precision.scaler, self.clip, self.settings.max_grad_norm
        x = self.forward_pass(ubatches, masks)  # Alg. 3: for l in layers: for u in ubatches: forward
        g, loss = self.head_forward_backward(
            x, ubatches, div
        )  # the head: forward and backward per micro-batch
        for i in reversed(range(self.head)):  # Alg. 3: for l in reversed(layers): for u in ubatches
            if self.speculation is not None:  # Alg. 4, Process 2 (the EPS thread): w_{l+1} = optimizer(...)
                self.speculation.update_async(i + 1, lr, scaler, clip, max_norm)
            else:  # Alg. 3: the EPS reduces each gradient as soon as it lands; the update waits
                self.eps.reduce_async(i + 1)
            # ... while Process 1 (the device): for u in ubatches: g_l = backward(g_{l+1})
            self.backward_layer(i, g, ubatches, masks)
        return loss

    def finish_updates(self) -> None:
        """Finish every update in flight (held, partial or in the background) before anything outside the
        step reads the EPS: evaluation, checkpoints, exported weights."""
        finish_updates(self.eps, self.trailing)

    # ---- the pieces of Algorithms 3 and 4 -----------------------------------------------------------

    def split(self, minibatch: Batch) -> tuple[list[Batch], list[torch.Tensor]]:
        ubatches = self.to_device(minibatch).split(self.num_ubatches)
        return ubatches, [self.spec.side_inputs(ub, self.precision.device_dtype) for ub in ubatches]

    def forward_pass(self, ubatches: list[Batch], masks: list[torch.Tensor]) -> list[torch.Tensor]:
        """for l in layers: for u in ubatches: act_l = forward(act_{l-1}), stashing only each layer's
        input (a kept or selective block keeps its graph instead: ``mode.recompute``). Returns the last
        block's output per micro-batch."""
        x: list[Any] = [None] * len(ubatches)
        self.graphs.clear()  # nothing from a step that did not finish (an out-of-memory) is reused
        self.relay.graph_slots.clear()
        for i in range(self.head):
            layer = self.relay.acquire(i, prefetch=i + 1)
            graph = self.recompute.graph(i)
            if graph is not None:
                self.relay.keep_graph(i)
            for u, ub in enumerate(ubatches):
                if graph is not None:
                    self.seed_dropout(i, u)
                    with self.timer("forward"), self.acc.meter.part("activations"):
                        x[u] = self.run_graph(layer, i, u, x[u], ub, masks[u], graph)
                    continue
                if i > 0:
                    self.stash.put(i, u, x[u])  # the input of layer i (the output of layer i-1)
                self.seed_dropout(i, u)
                with self.timer("forward"), torch.no_grad(), self.acc.meter.part("activations"):
                    x[u] = self.run_layer(layer, i, x[u], ub, masks[u], graph=True)
        return x

    def run_graph(
        self, layer: nn.Module, i: int, u: int, x: torch.Tensor, ub: Batch, side: Any, graph: str
    ) -> torch.Tensor:
        """Block i's forward with autograd, its graph kept for backward: whole (``none``), or under
        selective checkpointing (the matmul outputs saved, the rest replayed in backward). Returns its
        output, detached: each layer's backward stays its own. The embeddings' (i = 0) input is the ids."""
        x_in = x.detach().requires_grad_() if x is not None else None
        with torch.enable_grad():
            if graph == "selective":
                y = run_selective(lambda h: self.run_layer(layer, i, h, ub, side), x_in)
            else:
                y = self.run_layer(layer, i, x_in, ub, side)
        self.graphs[i, u] = (x_in, y)
        return y.detach()

    def head_forward_backward(
        self, x: list[torch.Tensor], ubatches: list[Batch], div: list[float]
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The head runs forward and backward per micro-batch right away (nothing to recompute): gives
        dLoss/d(last block output) per micro-batch, and sends the head's gradient to the EPS. ``div``: each
        micro-batch's loss divisor (``loss_divisors``)."""
        head = self.head
        layer = self.relay.acquire(head, prefetch=head - 1, grads=True)
        g, loss = run_head(self, layer, head, x, ubatches, div)
        self.relay.send_grads(head)
        return g, loss

    def backward_layer(self, i: int, g: list[Any], ubatches: list[Batch], masks: list[torch.Tensor]) -> None:
        """for u in ubatches: recompute layer i from its stashed input, g_i = backward(g_{i+1}); then the
        layer's accumulated gradient leaves for the EPS and its device buffer is reused."""
        n = len(ubatches)
        layer = self.relay.acquire(i, prefetch=i - 1 if i > 0 else None, grads=True)
        if self.recompute.graph(i) is not None:
            self.backward_graph(i, g, n)
            return
        if i == 0 and self.eps.layouts[self.spec.kind(0)].numel == 0:  # a frozen embedding: nothing to
            self.relay.send_grads(i)  # compute (no gradient of its own, none to pass further down)
            return
        if i > 0:
            self.stash.prefetch(i, 0)
        for u, ub in enumerate(ubatches):
            x_in = None
            if i > 0:
                x_in = self.stash.pop(i, u).detach().requires_grad_()
                if u + 1 < n:
                    self.stash.prefetch(i, u + 1)
                elif i > 1:
                    self.stash.prefetch(i - 1, 0)
            self.seed_dropout(i, u)  # the same dropout masks as in the forward pass
            if self.block_graphs is not None and x_in is not None:  # recompute and backward: one graph
                with self.timer("backward"), self.acc.meter.part("workspace"):
                    g[u] = self.block_graphs.backward(layer, i, x_in, masks[u], g[u])
                continue
            with self.timer("recompute"), self.acc.meter.part("workspace"):
                y = self.run_layer(layer, i, x_in, ub, masks[u])
            with self.timer("backward"), self.acc.meter.part("workspace"):
                torch.autograd.backward(y, g[u])
            g[u] = x_in.grad if x_in is not None else None
        self.relay.send_grads(i)

    def backward_graph(self, i: int, g: list[Any], n: int) -> None:
        """Block i's backward through the graph its forward kept (a selective one replays its elementwise
        ops first, with the forward's RNG state); then its gradient leaves like any layer's."""
        if i > 1:
            self.stash.prefetch(i - 1, 0)
        for u in range(n):
            x_in, y = self.graphs.pop((i, u))
            if y.requires_grad:  # (a frozen embedding's output does not: nothing to differentiate)
                with self.timer("backward"), self.acc.meter.part("workspace"):
                    torch.autograd.backward(y, g[u])
            g[u] = x_in.grad if x_in is not None else None
        self.relay.send_grads(i)
        self.relay.release_graph(i)

    def plan_recompute(self) -> RecomputePlan:
        """``mode.recompute`` / ``mode.keep_layers`` resolved: today's full recompute as is, or one block's
        saved bytes per micro-batch measured (a forward on a zero micro-batch of the longest sequence) and
        the choice made within the device's free room less what ``full`` needs (the stash, the layer and
        gradient lists, one layer's working set). With every block kept, the head keeps its graph too
        where the room left holds it (a language model's loss chunks then run once, not twice)."""
        rc, depth = self.settings.recompute, self.spec.num_layers
        if rc.trivial:
            return RecomputePlan("full", 0, depth)
        per = self.measure_block(rc.seq_len)
        n = self.num_ubatches
        free = self.acc.free_bytes()
        if free is None:  # the device is the host
            free = rc.budget_bytes if rc.budget_bytes is not None else default_cpu_budget()
        on_device = self.settings.stash != "cpu"
        stash = (depth * n if on_device else 2) * per.full
        room = MARGIN * free - stash - 2 * n * per.full - 2 * per.none
        plan = choose(rc, depth, per, n, room, stash_on_device=on_device)
        head = self.spec.head_graph_bytes(self.settings.ubatch_size, rc.seq_len)
        if plan.every_layer_kept and plan.saved_bytes + head <= room:
            plan = replace(plan, head_kept=True)
        return plan

    def measure_block(self, seq: int) -> LayerBytes:
        """Saved bytes of one block for one micro-batch of ``seq`` tokens, per policy, and of the embeddings'
        graph (uncounted by the meter: a measurement, not the run's memory; the slot's weights are whatever
        it holds)."""
        ub, dev, dtype = self.settings.ubatch_size, self.acc.device, self.precision.device_dtype
        ids = torch.zeros(ub, max(1, seq), dtype=torch.long, device=dev)
        batch = Batch(ids, ids.clone(), torch.ones_like(ids), torch.zeros(ub, dtype=torch.long, device=dev))
        side = self.spec.side_inputs(batch, dtype)
        slot = self.relay.slots[0]
        with self.acc.meter.paused():
            pre = slot.shells[self.spec.kind(0)]
            x, pre_bytes = measure_pre(lambda: self.run_layer(pre, 0, None, batch, side), [slot.w, slot.g])
            block = slot.shells[self.spec.kind(1)]
            per = measure_block(lambda h: self.run_layer(block, 1, h, batch, side), x, [slot.w, slot.g])
            return LayerBytes(per.full, per.selective, per.none, pre=pre_bytes)

    def sections(self) -> dict[str, dict[str, Any]]:
        """summary.json's ``optimizer`` section (below) and ``recompute``: the policy, kept layers, the
        bytes they hold for backward."""
        out = {**self.optimizer_section(), "recompute": self.recompute.section(), "eps": self.eps_section()}
        if self.block_graphs is not None:
            out["cuda_graphs"] = self.block_graphs.section()
        if self.speculation is not None:  # how a clipped step's speculative updates were redone
            spec = self.speculation
            out["speculation"] = {"clip_redo": self.eps.tier.clip_redo, "replayed_steps": spec.replays}
        if lora_of(self.spec) is not None:
            out["peft"] = summary_section(self.spec, self.eps.host_parts())
            base, steps = self.eps.base, max(1, self.step_count)
            if base is not None:  # what the relay took of the frozen base, and (on disk) read from its files
                out["peft"]["base_bytes_loaded_per_step"] = base.bytes_loaded / steps
                if base.source is not None:
                    out["peft"]["base_bytes_read_per_step"] = base.source.bytes_read / steps
        return out

    def background(self) -> dict[str, float]:
        """Seconds the EPS thread worked this step (reduction, and L2L-p's hidden updates), the host
        update's seconds (``optimizer_s``, any thread; ``optimizer_exposed_s``, what the compute thread ran
        itself or waited for; see ``EpsWorker.pop_optimizer``) and, with the disk tier, its I/O
        (seconds as phases, bytes here)."""
        times = self.eps.worker.pop_optimizer()
        if self.step_count > 0:  # steady state, like the summary's throughput (the first step excluded)
            self.steady["steps"] += 1
            self.steady["optimizer_s"] += times["optimizer_s"]
            self.steady["optimizer_exposed_s"] += times["optimizer_exposed_s"]
        busy = self.eps.worker.pop_busy()
        return {"eps_background_s": busy, **times, **self.eps.tier.pop_step(self.timer)}

    def eps_section(self) -> dict[str, Any]:
        """summary.json's ``eps``: what the host's passes over the EPS's buffers read and wrote per trained
        parameter per step, by purpose (counted by the code that makes them), the update's own GB/s, the
        link's bytes per parameter per step (the relay's copies, apart), and which update ran."""
        return self.eps.traffic_section(self.relay.transfer_bytes, self.traffic, self.traffic_steps)

    def optimizer_section(self) -> dict[str, dict[str, Any]]:
        """summary.json's ``optimizer`` section: the host update's seconds per steady-state step, the part
        on the compute thread's path, and the hidden share = 1 - exposed / total."""
        n = self.steady["steps"]
        total = self.steady["optimizer_s"] / n if n else None
        exposed = self.steady["optimizer_exposed_s"] / n if n else None
        hidden = min(1.0, max(0.0, 1.0 - exposed / total)) if total and exposed is not None else None
        return {"optimizer": {"optimizer_s": total, "optimizer_exposed_s": exposed, "hidden_share": hidden}}

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        """Logits, layer by layer over the micro-batches (no stash, no gradients)."""
        self.finish_updates()  # every update in flight is in before the weights are read
        ub_size = self.settings.ubatch_size
        ubatches = self.to_device(batch).split(max(1, -(-len(batch) // ub_size)))
        masks = [self.spec.side_inputs(ub, self.precision.device_dtype) for ub in ubatches]
        x: list[Any] = [None] * len(ubatches)
        self.relay.train(False)
        try:
            for i in range(self.head):
                layer = self.relay.acquire(i, prefetch=i + 1)
                for u, ub in enumerate(ubatches):
                    with self.acc.meter.part("activations"):
                        x[u] = self.run_layer(layer, i, x[u], ub, masks[u])
            layer = self.relay.acquire(self.head, prefetch=0)
            with self.precision.autocast():
                logits = [self.spec.head_logits(layer, x[u]) for u in range(len(ubatches))]
        finally:
            self.relay.train(True)
            self.eps.tier.pop_step(self.timer, training=False)  # evaluation's I/O is no training step's
            self.timer.pop()
        return torch.cat(logits).float().cpu()

    def decoder(self) -> LayeredDecoder:
        """Generation layer by layer through this runner's EPS and relay (``l2l generate``)."""
        assert isinstance(self.spec, DecoderSpec), "generation needs a decoder"
        self.finish_updates()  # (a held update is applied: the decoder reads the EPS's layers as they are)
        return LayeredDecoder(self.spec, self.eps, self.relay, self.acc, self.precision)

    def load_hf(self, tensors: Any) -> list[str]:
        self.finish_updates()
        return self.eps.load_hf(tensors)

    def hf_tensors(self) -> Any:
        self.finish_updates()
        return self.eps.files.hf_tensors()

    def full_layers(self) -> Any:
        """(index, a CPU module of the layer: frozen base and trained tensors) per layer (``l2l export``)."""
        self.finish_updates()
        return self.eps.full_layers()

    def host_parts(self) -> dict[str, int]:
        return self.eps.host_parts()

    def state_files(self) -> Any:
        self.finish_updates()
        return self.eps.files.state_files()

    def load_state(self, ckpt: Any, manifest: dict[str, Any]) -> None:
        self.finish_updates()
        self.eps.files.load_state(ckpt, manifest)

    # ---- the EPS's checkpoints (real-time files; the disk tier's commits) --------------------------------

    def attach_realtime(self, writer: RealtimeWriter) -> None:
        self.eps.realtime = writer

    def layer_files(self) -> LayerFiles:
        return [self.eps.files.layer_file(i) for i in range(len(self.eps.layers))]

    def durable_state(self) -> DurableState | None:
        tier = self.eps.tier
        return tier if tier.durable else None  # type: ignore[return-value]

    def close(self) -> None:
        try:
            self.finish_updates()
        finally:
            self.eps.close()
