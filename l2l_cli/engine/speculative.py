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
from dataclasses import dataclass, field

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
        self._step = _Step()  # this step's bookkeeping (its background jobs hold it: see ``_judge``)
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
        self.verdicts_early = 0  # steps judged on the device's norms with their updates still running
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
        job = (i, self._step, self.replay_factor, lr, scaler.scale, clip, max_norm)
        self.worker.submit(self.eps.layer_job, self._reduce_and_update, *job, layer=i)

    def _reduce_and_update(
        self,
        i: int,
        s: _Step,
        known: torch.Tensor | None,
        lr: float,
        scale: float,
        clip: str,
        max_norm: float,
    ) -> None:
        eps = self.eps
        eps.reduce(i)
        st = eps.layers[i]
        norm = eps.layer_norm(i) / (scale * eps.dist.world)
        s.norms[i] = norm
        if s.bad or not bool(torch.isfinite(norm)):
            s.bad = True
            return
        inv = 1.0 / (scale * eps.dist.world)
        if clip == "global" and known is not None:  # a replayed step: the factor known, as for a held layer
            mult = _with_factor(known, inv)
        elif clip == "global":
            norms = torch.stack(list(s.norms.values()))
            if s.keep is None:
                s.keep = self.keeps(max_norm)
            certain = float(clip_coefficients(norms, clip, max_norm)[0]) < 1.0
            if certain or (s.keep and not st.reserve_redo()):
                # the norm so far already exceeds max_grad_norm: clipping is certain, and any update
                # made now would be undone; wait for the factor instead. So does a layer whose tier
                # cannot keep the gradient the update consumes (a redo needs it; the disk tier keeps it
                # in RAM or on disk, its undo is the file's other slot, the state before the update)
                s.deferred.append(i)
                return
            if not s.keep:  # a redo would need this gradient: the step would be replayed instead
                s.unkept.add(i)
            mult = None if inv == 1.0 else inv  # as if the factor were 1; checked in finish
        else:
            coef = clip_coefficients(norm[None], clip, max_norm)
            mult = (coef[0] * inv) if coef is not None else (None if inv == 1.0 else inv)
        with self.worker.work():
            st.save_undo(eps.acc)
            if clip == "global" and known is None and not _power_of_two(inv) and not st.update_keeps_grad:
                s.received[i] = st.g.clone()  # (a torch optimizer scales the gradient in place)
            eps.update_layer(i, lr, mult)
        s.updated.append(i)

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
        s, self._step = self._step, _Step()  # (the next step's jobs get their own bookkeeping)
        known, self.replay_factor = self.replay_factor, None
        self.last_rollback = None
        scale = scaler.scale * eps.dist.world
        early = None
        if self._early_verdict():
            eps.reduce(i0)
            early = self._device_norms(i0, scale)
        if early is not None:
            # the verdict from the norms the device took, with this step's updates still running: a
            # finite step that needs no rollback leaves them to the EPS thread, and the next forward
            # waits only for the layer it loads (the relay's wait on that layer's job)
            norms = early
            coefs = clip_coefficients(norms, clip, max_norm)
            finite = bool(torch.isfinite(norms).all())
            clipped = clip == "global" and known is None and float(coefs[0]) < 1.0  # type: ignore[index]
            if finite and not clipped:
                self.verdicts_early += 1
                if self.trailing is not None:
                    self.trailing.finish_behind_forward()  # (the update behind this step's forward is in)
                return self._apply_last(scaler, norms, coefs, list(range(len(norms))), known, last, scale)
        finish_updates(eps, self.trailing)  # every job of the step done: its lists are complete
        if not self._early_verdict():  # (a disk tier's layer 0 may wait for a slot the jobs free)
            eps.reduce(i0)
        s.norms[i0] = eps.layer_norm(i0) / scale
        norms = torch.stack([s.norms[i] for i in sorted(s.norms)])  # in layer order, as Alg. 3
        where = list(range(len(norms)))
        if self.combine is not None:  # (a pipeline rank: every rank's norms, one verdict for all)
            norms, where = self.combine(norms)
        bad, updated, held = s.bad or not bool(torch.isfinite(norms).all()), s.updated, s.deferred
        total = float(torch.linalg.vector_norm(norms))
        if bad:
            scaler.update(bad)
            self._undo(updated)
            self._count_rollback(updated, "a non-finite gradient")
            return False, total
        coefs = clip_coefficients(norms, clip, max_norm)
        if clip == "global" and known is None and float(coefs[0]) < 1.0 and s.unkept:  # type: ignore[index]
            # clipping nobody foresaw, with gradients not kept: undo the step's updates and run it again
            # with the factor known (the runner's second pass; the loss scale stays until its verdict)
            self._undo(updated)
            self.replay_factor = coefs[0]  # type: ignore[index]
            self.replays += 1
            why = f"global gradient norm {total:.4g} > optim.max_grad_norm {max_norm:g}, gradients not kept"
            self._count_rollback(updated, f"{why} (eps.clip_redo={self.tier.clip_redo}, step replayed)")
            return True, total
        if clip == "global" and known is None:
            factor = coefs[0]  # type: ignore[index]
            redo = updated if float(factor) < 1.0 else []
            for i in sorted(held + redo):  # forward order: the next forward needs layer 1 first
                self.worker.submit(
                    self.worker.timed,
                    self._redo,
                    i,
                    lr,
                    factor,
                    i in redo,
                    1.0 / scale,
                    s.received.get(i),
                    layer=i,
                )
            if redo:
                self._count_rollback(
                    redo, f"global gradient norm {total:.4g} > optim.max_grad_norm {max_norm:g}"
                )
        return self._apply_last(scaler, norms, coefs, where, known, last, scale)

    def _early_verdict(self) -> bool:
        """Whether a step can be judged on the device's norms, its updates still running: not where some
        norm is the EPS thread's to take (the sum over the ranks on the host, a pipeline's verdict over
        every rank) or a checkpoint follows each step (every layer must be in anyway)."""
        eps = self.eps
        on_host = eps.dist.enabled and not eps.reduce_on_device
        return self.combine is None and not eps.checkpoints_each_step and not on_host

    def _device_norms(self, i0: int, scale: float) -> torch.Tensor | None:
        """Every layer's unscaled norm, from what the device sent beside each gradient (``i0``'s taken here),
        without waiting for the EPS thread (None: one was not sent)."""
        eps = self.eps
        norms = []
        for st in eps.layers:
            if st.index == i0:
                norms.append(eps.layer_norm(i0))
            elif st.layout.numel == 0:
                norms.append(torch.zeros(()))
            else:
                # (its copy, the norm's included: sent in backward order, so the first layer here was sent
                # last, and once it is in the rest are, with no further host synchronize)
                st.grad_in.wait()
                if st.grad_norm is None:
                    return None
                norms.append(st.grad_norm.clone())
        return torch.stack(norms) / scale

    def _apply_last(
        self,
        scaler: LossScaler,
        norms: torch.Tensor,
        coefs: torch.Tensor | None,
        where: list[int],
        known: torch.Tensor | None,
        last: tuple[int, float, str, float],
        scale: float,
    ) -> tuple[bool, float]:
        """A step that is applied: the loss scale's verdict, and the last layer's update, here or, with a
        trailing update, held for the next step's ``start_step``."""
        eps = self.eps
        i0, lr, _, _ = last
        total = float(torch.linalg.vector_norm(norms))
        scaler.update(False)
        self._recent.append(total)
        if known is not None:  # (the replayed pass updated every layer with the factor; so is the last)
            coefs = known.expand_as(norms)
        mult = grad_mult(scale, None if coefs is None else coefs[where[i0]])
        if self.trailing is not None and eps.elementwise and not eps.checkpoints_each_step:
            self.trailing.defer(i0, lr, mult)
        else:
            with self.worker.work():
                eps.update_layer(i0, lr, mult)
        if eps.checkpoints_each_step:  # the step's checkpoint (a real-time one, or the disk tier's
            self.worker.wait_all()  # commit) is taken next: every layer must be in
        return True, total

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


@dataclass
class _Step:
    """One step's speculative bookkeeping, filled by its jobs on the EPS thread: a non-finite norm seen, the
    layers updated before the verdict (their undo kept), those held back once global clipping was
    certain, the norms so far, the gradients a redo needs that a torch optimizer scales in place, the
    layers whose gradient was not kept (``eps.clip_redo``), and whether this step keeps them."""

    bad: bool = False
    updated: list[int] = field(default_factory=list)
    deferred: list[int] = field(default_factory=list)
    norms: dict[int, torch.Tensor] = field(default_factory=dict)
    received: dict[int, torch.Tensor] = field(default_factory=dict)
    unkept: set[int] = field(default_factory=set)
    keep: bool | None = None


def _with_factor(factor: torch.Tensor, inv: float) -> torch.Tensor:
    """The multiplier of a layer updated with the clipping factor known (held back, or replayed):
    g·(coef·inv), Alg. 3's."""
    return factor * inv if inv != 1.0 else factor


def _power_of_two(x: float) -> bool:
    """Whether multiplying by ``x`` is exact (barring underflow), so that it commutes with the clipping
    factor bit for bit: g·x·coef == g·(coef·x)."""
    return x > 0 and math.frexp(x)[0] == 0.5
