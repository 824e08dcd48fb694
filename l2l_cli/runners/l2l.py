"""Algorithm 3 (L2L v1; Alg. 2 in v2): layer-to-layer execution.

The model and its training state live in the eager param-server (host memory); the device holds the
executing layer and the next one (the relay). The loops are inverted: every micro-batch runs through
layer l before layer l+1 is loaded, so each layer crosses the link once per pass however many
micro-batches there are. Only each layer's input is stashed (on the device, or on the host with
``mode.stash=cpu``); in backward each layer is recomputed from its stash, its gradient accumulates over
the micro-batches on the device, then goes to the EPS and the device copy is released before the next
layer. The host updates every layer at the end of the step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from l2l_cli.data.batches import Batch
from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.eps import EagerParamServer
from l2l_cli.engine.precision import Precision
from l2l_cli.engine.relay import Relay
from l2l_cli.engine.stash import CpuStash, DeviceStash
from l2l_cli.models.bert import ModelSpec, extended_mask
from l2l_cli.runners.common import Runner, StepReport


class L2LRunner(Runner):
    def __init__(self, cfg: Any, acc: Accelerator, spec: ModelSpec, precision: Precision, total_steps: int):
        super().__init__(cfg, acc, spec, precision, total_steps)
        self.eps = EagerParamServer(spec, cfg, acc, precision.device_dtype, seed=cfg.trainer.seed)
        self.relay = Relay(acc, spec, self.eps, precision.device_dtype, cfg.mode.prefetch, self.timer)
        self.stash = (
            CpuStash(acc, self.eps, self.timer) if cfg.mode.stash == "cpu" else DeviceStash(acc, self.timer)
        )
        self.head = spec.num_layers + 1  # layer indices: 0 = embeddings, 1..N = blocks, N+1 = head

    def run_layer(
        self, layer: nn.Module, i: int, x: torch.Tensor | None, ub: Batch, mask: torch.Tensor
    ) -> torch.Tensor:
        """Layer i's forward on one micro-batch (embeddings read the token ids, blocks the hidden states)."""
        with self.precision.autocast():
            if i == 0:
                return layer(input_ids=ub.input_ids, token_type_ids=ub.token_type_ids)
            return layer(x, mask)

    def step(self, minibatch: Batch) -> StepReport:
        t0 = time.perf_counter()
        lr = self.lr()
        n, relay, stash, head = self.num_ubatches, self.relay, self.stash, self.head
        ubatches = self.to_device(minibatch).split(n)
        masks = [extended_mask(ub.attention_mask, self.precision.device_dtype) for ub in ubatches]
        scale = self.precision.scaler.scale_loss

        # Alg. 3 forward: for l in layers: for u in ubatches: act_l = forward(act_{l-1})
        x: list[Any] = [None] * n
        for i in range(head):
            layer = relay.acquire(i, prefetch=i + 1)
            for u in range(n):
                if i > 0:
                    stash.put(i, u, x[u])  # stash only the layer's input (the previous layer's output)
                self.seed_dropout(i, u)
                with self.timer("forward"), torch.no_grad(), self.acc.meter.part("activations"):
                    x[u] = self.run_layer(layer, i, x[u], ubatches[u], masks[u])

        # The turn: the head runs forward and backward per micro-batch, giving dLoss/d(last block output).
        g: list[Any] = [None] * n
        loss = torch.zeros(())
        layer = relay.acquire(head, prefetch=head - 1, grads=True)
        for u in range(n):
            x_in = x[u].detach().requires_grad_()
            self.seed_dropout(head, u)
            with self.timer("forward"), self.acc.meter.part("activations"), self.precision.autocast():
                loss_u, _ = layer(x_in, ubatches[u].labels)
            with self.timer("backward"), self.acc.meter.part("workspace"):
                scale(loss_u / n).backward()
            g[u], x[u] = x_in.grad, None
            loss += loss_u.detach().float().cpu() / n
        relay.send_grads(head)

        # Alg. 3 backward: for l in reversed(layers): for u in ubatches: recompute layer l, g_l = backward(g_{l+1})
        for i in range(head - 1, -1, -1):
            layer = relay.acquire(i, prefetch=i - 1 if i > 0 else None, grads=True)
            if i > 0:
                stash.prefetch(i, 0)
            for u in range(n):
                x_in = None
                if i > 0:
                    x_in = stash.pop(i, u).detach().requires_grad_()
                    if u + 1 < n:
                        stash.prefetch(i, u + 1)
                    elif i > 1:
                        stash.prefetch(i - 1, 0)
                self.seed_dropout(i, u)  # the same dropout masks as in the forward pass
                with self.timer("recompute"), self.acc.meter.part("workspace"):
                    y = self.run_layer(layer, i, x_in, ubatches[u], masks[u])
                with self.timer("backward"), self.acc.meter.part("workspace"):
                    torch.autograd.backward(y, g[u])
                g[u] = x_in.grad if x_in is not None else None
            relay.send_grads(i)  # the layer's gradient goes to the EPS; its device buffer is reused next

        # Alg. 3: for l in layers: w_l = optimizer(w_l, g_l), on the host
        applied, norm = self.eps.step(
            lr, self.precision.scaler, self.clip, self.cfg.optim.max_grad_norm, self.timer
        )
        return self.finish(loss, len(minibatch), t0, lr, skipped=not applied, grad_norm=norm)

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        """Logits, layer by layer over the micro-batches (no stash, no gradients)."""
        ub_size = self.cfg.batch.ubatch_size
        ubatches = self.to_device(batch).split(max(1, -(-len(batch) // ub_size)))
        masks = [extended_mask(ub.attention_mask, self.precision.device_dtype) for ub in ubatches]
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
                logits = [layer.logits(x[u]) for u in range(len(ubatches))]
        finally:
            self.relay.train(True)
            self.timer.pop()
        return torch.cat(logits).float().cpu()

    def load_hf(self, tensors: Any) -> list[str]:
        return self.eps.load_hf(tensors)

    def hf_tensors(self) -> Any:
        return self.eps.hf_tensors()

    def host_parts(self) -> dict[str, int]:
        return self.eps.host_parts()
