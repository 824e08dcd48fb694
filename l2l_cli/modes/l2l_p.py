"""Algorithm 4 (L2L v1): L2L-p, the host update overlapped with the backward pass.

The forward pass and the per-layer backward are Algorithm 3's. The difference is when the EPS updates:
as soon as layer l+1's gradient has left the device, the EPS reduces and updates layer l+1 on its own
thread (Process 2) while the device runs backward on layer l (Process 1).

Exact, with global-norm clipping (the default, as in every mode): the clipping factor is known only once
the last layer's gradient is in, so each update is *speculative* (SuperOffload, ASPLOS'26): made as if no
clipping applied, with the layer's pre-update state in the undo log. When the finished norm says clipping
applies, the updated layers are rolled back and redone with the right factor on the EPS thread, in forward
order, behind the next step's forward (the relay waits for a layer only if its redo is not in yet); once
the norm seen so far already exceeds ``optim.max_grad_norm`` the remaining layers are not updated
speculatively at all. A non-finite gradient rolls the whole step back (skipped). The result equals
``mode=l2l``'s. ``optim.clip=layer`` (per-layer norms, never rolled back) stays available.

The trailing update (layer 0, the embeddings: nothing is left to overlap it with) is held to the next step:
the rows of the embedding tables that the next batch reads (and the small tensors) are updated before its
forward starts, the rest on the EPS thread behind that forward; nothing reads them before they are in
(the next update of the layer, evaluation and checkpoints wait for them). AdamW only: LAMB's trust ratio
needs the whole tensor and 8-bit AdamW quantizes whole blocks, so with them the trailing update stays at the
end of the step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from l2l_cli.data.batches import Batch
from l2l_cli.modes.base import StepReport
from l2l_cli.modes.l2l import L2LRunner

log = logging.getLogger("l2l")


class L2LPRunner(L2LRunner):
    def step(self, minibatch: Batch) -> StepReport:
        t0, lr = time.perf_counter(), self.lr()
        scaler, clip, max_norm = self.precision.scaler, self.clip, self.settings.max_grad_norm
        div = self.loss_divisors(minibatch)  # the loss: one mean over the global minibatch's terms
        with self.timer("optimizer"):  # the last step's trailing update: the rows this batch reads
            self.eps.start_step(minibatch)
        ubatches, masks = self.split(minibatch)
        x = self.forward_pass(ubatches, masks)  # Alg. 4: for l in layers: for u in ubatches: forward
        g, loss = self.turn(x, ubatches, div)
        for i in reversed(range(self.head)):  # Alg. 4: for l in reversed(layers):
            # Process 2 (the EPS thread): w_{l+1} = optimizer(w_{l+1}, g_{l+1}) ...
            self.eps.update_async(i + 1, lr, scaler, clip, max_norm)
            # ... while Process 1 (the device): for u in ubatches: g_l = backward(g_{l+1})
            self.backward_layer(i, g, ubatches, masks)
        with self.timer("optimizer"):  # the verdict on the speculative updates; layer 0's update held
            applied, norm = self.eps.finish_async(scaler, trailing=(0, lr, clip, max_norm), defer=True)
        extra = self.background()
        if self.eps.last_rollback is not None:
            log.info("l2l_p: step %d rolled back: %s", self.step_count + 1, self.eps.last_rollback)
            extra["rollback"] = 1.0
        return self.finish(loss, len(minibatch), t0, lr, skipped=not applied, grad_norm=norm, extra=extra)

    def sections(self) -> dict[str, dict[str, Any]]:
        """summary.json's ``l2l_p`` section (steps rolled back, layer updates undone) besides L2L's."""
        rollbacks = {"rollbacks": self.eps.rollbacks, "rolled_back_layer_updates": self.eps.rollback_layers}
        return {**super().sections(), "l2l_p": rollbacks}
