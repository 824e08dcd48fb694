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

The schedule is chosen once, when the runner is built (``modes/registry.py``'s ``update_schedule``: this
mode's spec says ``overlapped_update``), and ``L2LRunner.step`` (modes/l2l.py) runs it: the forward, the
turn and the per-layer backward are Alg. 3's, the update is this file's algorithm. This runner adds what
L2L-p reports: the steps rolled back and the layer updates undone.
"""

from __future__ import annotations

import logging
from typing import Any

from l2l_cli.engine.speculative import Speculation
from l2l_cli.modes.l2l import L2LRunner

log = logging.getLogger("l2l")


class L2LPRunner(L2LRunner):
    """L2L-p: Alg. 3's runner on the schedule ``IN_BACKWARD_TRAILING``, reporting its rollbacks."""

    speculation: Speculation

    def background(self) -> dict[str, float]:
        """Alg. 3's background times, and ``rollback`` on a step whose speculative updates were undone."""
        extra = super().background()
        if self.speculation.last_rollback is not None:
            log.info("l2l_p: step %d rolled back: %s", self.step_count + 1, self.speculation.last_rollback)
            extra["rollback"] = 1.0
        return extra

    def sections(self) -> dict[str, dict[str, Any]]:
        """summary.json's ``l2l_p`` section (steps rolled back, layer updates undone) besides L2L's."""
        spec = self.speculation
        rollbacks = {"rollbacks": spec.rollbacks, "rolled_back_layer_updates": spec.rollback_layers}
        return {**super().sections(), "l2l_p": rollbacks}
