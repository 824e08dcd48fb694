"""Algorithm 2 (L2L v1; Alg. 1 in v2): the baseline with accumulated gradients. Each micro-batch runs
forward and backward through the whole model, its gradients accumulate, and one update follows."""

from __future__ import annotations

import time

from l2l_cli.data.batches import Batch
from l2l_cli.modes.base import DeviceResident, StepReport


class BaselineAGRunner(DeviceResident):
    def step(self, minibatch: Batch) -> StepReport:
        t0 = time.perf_counter()
        div = self.loss_divisors(minibatch)  # the loss: one mean over the global minibatch's terms
        ubatches = self.to_device(minibatch).split(self.num_ubatches)
        lr = self.lr()
        loss = 0.0
        # Alg. 2: for u in ubatches: (for l in layers: forward) (for l in reversed(layers): backward)
        for u, ub in enumerate(ubatches):
            last = u == self.num_ubatches - 1  # data parallel: reduce during the last micro-batch only
            loss = loss + self.forward_backward(ub, u, 1.0 / div[u], sync=last) / div[u]
        # Alg. 2: for l in layers: w_l = optimizer(w_l, acc_grads_l)
        with self.timer("optimizer"):
            applied, norm = self.update()
        return self.finish(loss, len(minibatch), t0, lr, skipped=not applied, grad_norm=norm)
