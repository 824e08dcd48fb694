"""L2L-p's speculative update (Alg. 4, Process 2, with SuperOffload's speculation-then-validation).

L2L-p updates layer l+1 on the EPS thread while the device runs backward on layer l, before the step's
gradient norm is known. With global clipping the factor is known only once every gradient is in, and a
non-finite gradient anywhere skips the whole step; so each layer is updated as if no clipping applied, its
pre-update state kept in an undo log, and the step is judged at its end: non-finite -> every speculative
update is undone; clipping applies -> undone and redone with the right factor. Layers updated after the
norm so far already exceeds the limit are held back instead (their update would only be undone). This class
keeps that bookkeeping (the step's norms, the layers updated and held, the rollbacks so far).

A redo needs the gradient each speculative update consumed. Where keeping it costs I/O (the disk tier beyond
its RAM pool: 4 B per parameter written every step, for a redo most steps never need) ``eps.clip_redo``
may keep none instead: a step that then turns out to clip is rolled back and *replayed*, its forward and
backward run again from the same weights, micro-batches and dropout seeds, each layer updated with the
factor now known (the runner runs the second pass: ``replay_factor``). ``auto`` keeps while a recent step's
norm came within ``AUTO_NEAR`` of the limit (clipping likely), and replays otherwise.

Built by a runner whose schedule updates in the backward (L2L-p; L2L on a tier that updates in the
backward), beside the EPS whose layers it updates, with the trailing update (if the schedule holds one) and
the verdict's norms beyond this EPS (a pipeline rank's) given at construction.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import torch

from l2l_cli.engine.eps import EagerParamServer, grad_mult
from l2l_cli.engine.optim import clip_coefficients
from l2l_cli.engine.precision import LossScaler
from l2l_cli.engine.trailing import TrailingUpdate, finish_updates

AUTO_NEAR = 0.5  # eps.clip_redo=auto keeps the gradients while a recent norm was >= this x max_grad_norm
AUTO_STEPS = 8  # ... among this many last steps' norms


class Speculation:
    """One L2L-p step's speculative updates, judged at its end; and the rollbacks of the run."""

    def __init__(
        self,
        eps: EagerParamServer,
        trailing: TrailingUpdate | None = None,
        combine: Callable[[torch.Tensor], tuple[torch.Tensor, list[int]]] | None = None,
        replay: bool = False,
    ):
        self.eps, self.worker, self.tier, self.trailing = eps, eps.worker, eps.tier, trailing
        # the step's per-layer norms, the layers updated before the verdict (undo log kept), those held
        # back once global clipping was certain
        self._bad = False
        self._updated: list[int] = []
        self._deferred: list[int] = []
        self._norms: dict[int, torch.Tensor] = {}
        # the gradients as they arrived, of the layers updated speculatively while the unscaling is not a
        # power of two (the update scales the gradient in place, inexactly: a redo starts from these)
        self._received: dict[int, torch.Tensor] = {}
        self.rollbacks = 0  # steps whose speculative updates were undone (clipping, or a non-finite gradient)
        self.rollback_layers = 0
        self.last_rollback: str | None = None  # why the last step rolled back (None: it did not)
        # the verdict's norms beyond this EPS: this EPS's per-layer norms -> (the whole model's, in model
        # order; where each of this EPS's layers is in them). A pipeline's L2L stages give it (each rank's
        # EPS holds some layers: the clipping factor and the verdict are the whole model's); None: this
        # EPS holds the model
        self.combine = combine
        # a clipped step with gradients not kept runs again (``replay``: the runner can; a pipeline's stages
        # cannot, they always keep): ``finish`` sets ``replay_factor`` for that pass; its own finish clears it
        self.can_replay = replay
        self.replay_factor: torch.Tensor | None = None
        self.replays = 0  # steps run twice
        # this step keeps its gradients for a redo (chosen at its first update)
        self._keep: bool | None = None
        self._unkept: set[int] = set()  # layers updated speculatively whose gradient was not kept
        self._recent: deque[float] = deque(maxlen=AUTO_STEPS)  # the last steps' global norms (finite ones)

    def keeps(self, max_norm: float) -> bool:
        """Whether this step keeps each speculative update's gradient for a redo (``eps.clip_redo``): always
        where keeping is free (the host tier) or a replay is not possible; ``auto``: while a recent step's
        norm came within ``AUTO_NEAR`` of ``max_norm`` (with no step seen yet, as after a resume: kept)."""
        how = self.tier.clip_redo if self.can_replay else "keep"
        if how == "auto":
            return not self._recent or max(self._recent) >= AUTO_NEAR * max_norm
        return how == "keep"

    def update_async(self, i: int, lr: float, scaler: LossScaler, clip: str, max_norm: float) -> None:
        """Reduce and update layer i in the background (Alg. 4, Process 2), speculatively: with global
        clipping the factor is known only once every gradient is in, so layer i is updated as if no
        clipping applied, its pre-update state kept in the undo log; ``finish`` rolls it back and redoes it
        with the right factor when the finished norm says clipping applies, and rolls back the whole step
        on a non-finite gradient (SuperOffload's speculation-then-validation)."""
        self.worker.submit(
            self.eps.layer_job, self._reduce_and_update, i, lr, scaler.scale, clip, max_norm, layer=i
        )

    def _reduce_and_update(self, i: int, lr: float, scale: float, clip: str, max_norm: float) -> None:
        eps = self.eps
        eps.reduce(i)
        st = eps.layers[i]
        norm = eps.layer_norm(i) / (scale * eps.dist.world)
        self._norms[i] = norm
        if self._bad or not bool(torch.isfinite(norm)):
            self._bad = True
            return
        inv = 1.0 / (scale * eps.dist.world)
        known = self.replay_factor
        if clip == "global" and known is not None:  # a replayed step: the factor known, as for a held layer
            mult = _with_factor(known, inv)
        elif clip == "global":
            norms = torch.stack(list(self._norms.values()))
            if self._keep is None:
                self._keep = self.keeps(max_norm)
            certain = float(clip_coefficients(norms, clip, max_norm)[0]) < 1.0
            if certain or (self._keep and not st.reserve_redo()):
                # the norm so far already exceeds max_grad_norm: clipping is certain, and any update
                # made now would be undone; wait for the factor instead. So does a layer whose tier
                # cannot keep the gradient the update consumes (a redo needs it; the disk tier keeps it
                # in RAM or on disk, its undo is the file's other slot, the state before the update)
                self._deferred.append(i)
                return
            if not self._keep:  # a redo would need this gradient: the step would be replayed instead
                self._unkept.add(i)
            mult = None if inv == 1.0 else inv  # as if the factor were 1; checked in finish
        else:
            coef = clip_coefficients(norm[None], clip, max_norm)
            mult = (coef[0] * inv) if coef is not None else (None if inv == 1.0 else inv)
        with self.worker.work():
            st.save_undo(eps.acc)
            if clip == "global" and known is None and not _power_of_two(inv) and not st.update_keeps_grad:
                self._received[i] = st.g.clone()  # (a torch optimizer scales the gradient in place)
            eps.update_layer(i, lr, mult)
        self._updated.append(i)

    def finish(self, scaler: LossScaler, last: tuple[int, float, str, float]) -> tuple[bool, float]:
        """The end of a step: wait for the background updates, take the last layer's gradient (``last`` =
        (layer, lr, clip, max_norm)), and judge the step on every layer's norm: non-finite -> undo every
        speculative update (the step is skipped); global clipping applies -> undo and redo them with the
        right factor, in forward order on the EPS thread, each layer ready before the next forward loads
        it. The last layer's own update is applied here, or, with a trailing update, held for its
        ``start_step`` (it then runs behind the next forward). Returns (applied, norm)."""
        with self.eps.acc.meter.paused():  # host-tier work on the compute thread
            try:
                return self._judge(scaler, last)
            finally:
                self.tier.release_grad(last[0])  # (the disk tier may move its gradient out now)

    def _judge(self, scaler: LossScaler, last: tuple[int, float, str, float]) -> tuple[bool, float]:
        eps = self.eps
        i0, lr, clip, max_norm = last
        finish_updates(eps, self.trailing)  # (the update behind this step's forward is in)
        eps.reduce(i0)
        scale = scaler.scale * eps.dist.world
        self._norms[i0] = eps.layer_norm(i0) / scale
        norms = torch.stack([self._norms[i] for i in sorted(self._norms)])  # in layer order, as Alg. 3
        where = list(range(len(norms)))
        if self.combine is not None:  # (a pipeline rank: every rank's norms, one verdict for all)
            norms, where = self.combine(norms)
        bad, updated, held = self._bad or not bool(torch.isfinite(norms).all()), self._updated, self._deferred
        received, unkept, known = self._received, self._unkept, self.replay_factor
        self._bad, self._updated, self._deferred, self._norms, self._received = False, [], [], {}, {}
        self._unkept, self._keep, self.replay_factor = set(), None, None
        self.last_rollback = None
        total = float(torch.linalg.vector_norm(norms))
        if bad:
            scaler.update(bad)
            self._undo(updated)
            self._count_rollback(updated, "a non-finite gradient")
            return False, total
        coefs = clip_coefficients(norms, clip, max_norm)
        if clip == "global" and known is None and float(coefs[0]) < 1.0 and unkept:  # type: ignore[index]
            # clipping nobody foresaw, with gradients not kept: undo the step's updates and run it again
            # with the factor known (the runner's second pass; the loss scale stays until its verdict)
            self._undo(updated)
            self.replay_factor = coefs[0]  # type: ignore[index]
            self.replays += 1
            why = f"global gradient norm {total:.4g} > optim.max_grad_norm {max_norm:g}, gradients not kept"
            self._count_rollback(updated, f"{why} (eps.clip_redo={self.tier.clip_redo}, step replayed)")
            return True, total
        scaler.update(bad)
        self._recent.append(total)
        if known is not None:  # (the replayed pass updated every layer with the factor; so is the last)
            coefs = known.expand_as(norms)
        if clip == "global":
            factor = coefs[0]  # type: ignore[index]
            redo = updated if known is None and float(factor) < 1.0 else []
            for i in sorted(held + redo):  # forward order: the next forward needs layer 1 first
                self.worker.submit(
                    self.worker.timed,
                    self._redo,
                    i,
                    lr,
                    factor,
                    i in redo,
                    1.0 / scale,
                    received.get(i),
                    layer=i,
                )
            if redo:
                self._count_rollback(
                    redo, f"global gradient norm {total:.4g} > optim.max_grad_norm {max_norm:g}"
                )
        mult = grad_mult(scale, None if coefs is None else coefs[where[i0]])
        if self.trailing is not None and eps.elementwise and not eps.checkpoints_each_step:
            self.trailing.defer(i0, lr, mult)
        else:
            with self.worker.work():
                eps.update_layer(i0, lr, mult)
        if eps.checkpoints_each_step:  # the step's checkpoint (a real-time one, or the disk tier's
            self.worker.wait_all()  # commit) is taken next: every layer must be in
        return True, float(torch.linalg.vector_norm(norms))

    def _redo(
        self,
        i: int,
        lr: float,
        factor: torch.Tensor,
        rollback: bool,
        inv: float,
        received: torch.Tensor | None = None,
    ) -> None:
        """Layer i with the step's clipping factor, as Alg. 3 applies it (g·(coef·inv)): undo its
        speculative update first, or update it for the first time (it was held back). An update that
        leaves the gradient as it arrived (AdamW in one pass) redoes from it with g·(coef·inv); a torch
        optimizer's left it unscaled in place: exact when ``inv`` is a power of two, else ``received``, the
        gradient as it arrived, is put back and unscaled with the factor."""
        eps = self.eps
        with self.worker.work():
            if rollback:
                eps.restore_layer(i, announce=False)
                if eps.layers[i].update_keeps_grad:
                    eps.update_layer(i, lr, _with_factor(factor, inv))
                elif received is not None:
                    eps.layers[i].g.copy_(received)
                    eps.update_layer(i, lr, factor * inv)
                else:
                    eps.update_layer(i, lr, factor)
            else:
                eps.update_layer(i, lr, _with_factor(factor, inv))

    def _undo(self, layers: list[int]) -> None:
        """Every speculative update of ``layers`` undone (each layer back to its pre-update state)."""
        with self.worker.work():
            for i in layers:
                self.eps.restore_layer(i)

    def _count_rollback(self, layers: list[int], why: str) -> None:
        if layers:
            self.rollbacks += 1
            self.rollback_layers += len(layers)
            self.last_rollback = f"{why}: {len(layers)} speculative layer updates undone"


def _with_factor(factor: torch.Tensor, inv: float) -> torch.Tensor:
    """The multiplier of a layer updated with the clipping factor known (held back, or replayed):
    g·(coef·inv), Alg. 3's."""
    return factor * inv if inv != 1.0 else factor


def _power_of_two(x: float) -> bool:
    """Whether multiplying by ``x`` is exact (barring underflow), so that it commutes with the clipping
    factor bit for bit: g·x·coef == g·(coef·x)."""
    return x > 0 and math.frexp(x)[0] == 0.5
