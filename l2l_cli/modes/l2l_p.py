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
from l2l_cli.modes.base import StepReport
from l2l_cli.modes.l2l import L2L_PRECISIONS, L2LRunner
from l2l_cli.modes.registry import ModeSpec, register_mode


class L2LPRunner(L2LRunner):
    def step(self, minibatch: Batch) -> StepReport:
        t0, lr = time.perf_counter(), self.lr()
        scaler, clip, max_norm = self.precision.scaler, self.clip, self.settings.max_grad_norm
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


SPEC = register_mode(
    ModeSpec(
        name="l2l_p",
        label="l2l-p",
        runner=L2LPRunner,
        description="Alg. 4: L2L with the host update of layer l+1 overlapped with the backward of layer l",
        precisions=L2L_PRECISIONS,
        default_clip="layer",
        clips=("layer", "none"),
        clip_note="global-norm clipping needs every layer's gradient before the first update, but l2l_p "
        "updates layer l+1 while layer l runs backward; use optim.clip=layer (or none), or mode=l2l",
        stash=("device", "cpu"),
        host_state="eps",
        undo_log=True,
        overlapped_update=True,
        distribute="eps",
        state_layout="eps-flat-v1",
    )
)
