"""Algorithm 4 (L2L v1): L2L-p, the host update overlapped with the backward pass.

The forward pass and the per-layer backward are Algorithm 3's. The difference is when the EPS updates:
as soon as layer l+1's gradient has left the device, the EPS reduces and updates layer l+1 on its own
thread (Process 2) while the device runs backward on layer l (Process 1), so only the trailing update is
exposed. Every decision is per layer: clipping by the layer's own norm (global-norm clipping would need
every gradient first and is refused by the config), LAMB's trust ratio is per layer by nature. A
non-finite gradient still skips the whole step: each layer's pre-update state is kept until the step
is known to be finite, and restored if it is not.
"""

from __future__ import annotations

import time

from l2l_cli.data.batches import Batch
from l2l_cli.runners.common import StepReport
from l2l_cli.runners.l2l import L2LRunner


class L2LPRunner(L2LRunner):
    def step(self, minibatch: Batch) -> StepReport:
        t0, lr = time.perf_counter(), self.lr()
        scaler, clip, max_norm = self.precision.scaler, self.clip, self.cfg.optim.max_grad_norm
        ubatches, masks = self.split(minibatch)
        x = self.forward_pass(ubatches, masks)  # Alg. 4: for l in layers: for u in ubatches: forward
        g, loss = self.turn(x, ubatches)
        for i in reversed(range(self.head)):  # Alg. 4: for l in reversed(layers):
            # Process 2 (the EPS thread): w_{l+1} = optimizer(w_{l+1}, g_{l+1}) ...
            self.eps.update_async(i + 1, lr, scaler, clip, max_norm)
            # ... while Process 1 (the device): for u in ubatches: g_l = backward(g_{l+1})
            self.backward_layer(i, g, ubatches, masks)
        with self.timer("optimizer"):  # the trailing update (layer 0): the only exposed part of the optimizer
            applied, norm = self.eps.finish_async(scaler, trailing=(0, lr, clip, max_norm))
        return self.finish(
            loss, len(minibatch), t0, lr, skipped=not applied, grad_norm=norm, extra=self.background()
        )
