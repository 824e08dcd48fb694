"""Algorithm 1 (L2L v1): the baseline. The whole minibatch runs forward through every layer, then
backward, then every layer is updated; the model, its gradients and optimizer state live on the device."""

from __future__ import annotations

import time

from l2l_cli.data.batches import Batch
from l2l_cli.modes.base import DeviceResident, StepReport


class BaselineRunner(DeviceResident):
    def step(self, minibatch: Batch) -> StepReport:
        t0 = time.perf_counter()
        (div,) = self.loss_divisors(minibatch, parts=1)
        mb = self.to_device(minibatch)
        lr = self.lr()
        # Alg. 1: for l in layers: forward(mb); for l in reversed(layers): backward(mb)
        loss = self.forward_backward(mb, u=0, scale=1.0 / div) / div
        # Alg. 1: for l in layers: w_l = optimizer(w_l, g_l)
        with self.timer("optimizer"):
            applied, norm = self.update()
        return self.finish(loss, len(mb), t0, lr, skipped=not applied, grad_norm=norm)
