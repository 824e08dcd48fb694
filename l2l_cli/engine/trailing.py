"""L2L-p's trailing update: the last layer whose gradient a step produces (the embeddings) is updated behind
the next step's forward instead of holding up the step's end.

It exists because the embeddings' gradient is complete only when the backward is over, and their update is
the one no backward hides. Held until the next step begins, the update goes first to the rows the next
batch reads (written to the layer's send copy: the forward needs them now), then, whole, to the layer's
state on the EPS thread behind the forward. AdamW is elementwise, so the early rows equal the whole update's
bit for bit (see ``LayerState.preview_rows``).

Built by a runner whose schedule holds the trailing update (L2L-p), beside the EPS it updates; the EPS does
not know it, so the runner's ``finish_updates`` applies a held update before it waits for the EPS thread.
"""

from __future__ import annotations

from typing import Any

import torch

from l2l_cli.engine.eps import EagerParamServer


class TrailingUpdate:
    """A held update of one layer, and the layers whose device copy may be older than their rows."""

    def __init__(self, eps: EagerParamServer):
        self.eps, self.worker = eps, eps.worker
        self.pending: tuple[int, float, torch.Tensor | float | None] | None = None  # decided, not applied
        self._stale: set[int] = set()  # layers whose device copy may hold rows updated after it was loaded

    def defer(self, i: int, lr: float, mult: torch.Tensor | float | None) -> None:
        """Layer i's update, decided: applied when the next step starts (``start_step``) or ``apply``."""
        self.pending = (i, lr, mult)

    def start_step(self, batch: Any) -> None:
        """A step begins with ``batch``: the last step's held trailing update goes first to the rows this
        batch reads (written to the layer's send copy on the compute thread: the forward needs them now),
        then, whole, to the layer's state on the EPS thread, behind the forward pass. The device never reads
        the other rows in this step; everything else that reads the layer waits for it
        (``finish_updates``, the layer's next gradient)."""
        if self.pending is None:
            return
        eps = self.eps
        i, lr, mult = self.pending
        self.pending = None
        st = eps.layers[i]
        rows = eps.spec.rows_read(i, batch)
        if rows is None:
            with self.worker.work():
                eps.update_layer(i, lr, mult)
            return
        with self.worker.work():
            st.make_send_copy(eps.acc)
            st.preview_rows(lr, mult, rows)
            st.version += 1  # the device reloads it: the rows it reads are current
        self.worker.submit(self.worker.timed, self._update_behind, i, lr, mult, layer=i, host_only=True)
        self._stale.add(i)

    def _update_behind(self, i: int, lr: float, mult: torch.Tensor | float | None) -> None:
        with self.worker.work(trailing=True):
            # the master only: the device may be copying the send copy (the rows previewed for this
            # step) right now; the send copy is rewritten when the layer is settled (``refresh_stale``)
            self.eps.update_master(i, lr, mult)

    def finish_behind_forward(self) -> None:
        """The step's end, its other updates possibly still on the EPS thread: the update behind this step's
        forward is in (its job, queued first, is long done) and its layer's send copy whole again."""
        for i in self._stale:
            self.worker.wait_host(i)
        self.refresh_stale()

    def apply(self) -> None:
        """A held trailing update no step has started: apply it whole, here."""
        if self.pending is not None:
            i, lr, mult = self.pending
            self.pending = None
            with self.worker.work():
                self.eps.update_layer(i, lr, mult)

    def refresh_stale(self) -> None:
        """Every update is in (the EPS has waited for its thread) and no device copy is being made: the
        send copy of a layer updated behind the forward gets all its rows, and a device copy loaded
        before (it held only the previewed rows) is stale now. Called at the end of every step (a step
        that is skipped holds no trailing update that would refresh the layer) and before anything
        outside the step reads the EPS."""
        for i in self._stale:
            st = self.eps.layers[i]
            st.refresh_send()
            st.version += 1
        self._stale.clear()


def finish_updates(eps: EagerParamServer, trailing: TrailingUpdate | None) -> None:
    """Finish every update of ``eps`` in flight (held by ``trailing``, partial, or on the EPS thread) before
    anything outside the step reads it: evaluation, checkpoints, exported weights, a step's verdict."""
    if trailing is not None:
        trailing.apply()  # a held update no step has started: apply it whole, first
    eps.worker.wait_all()
    if trailing is not None:
        trailing.refresh_stale()  # the update behind the forward is in: refresh its send copy
