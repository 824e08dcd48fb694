"""Where the eager param-server keeps each layer's training state: host RAM, or disk (``eps.tier``).

The EPS and the relay ask the tier for a layer's buffers before they touch them and hand them back after;
with the host tier every layer's buffers are always in RAM and these calls do nothing, so the host tier is
exactly the EPS it has always been. The disk tier (:mod:`l2l_cli.engine.disk`) keeps one file per layer and
only ``eps.host_cache_layers`` layers in RAM, read ahead of use and written back behind the compute.

The calls, by who makes them:
- the relay: ``pin(i, "w")`` before it copies layer i to the device, ``unpin(i, after=copy)`` once the
  copy is issued; ``pin(i, "g", fresh=True)`` before the device's gradient lands in the host buffer;
- the EPS: ``holding(i, parts, dirty=True)`` around an update (the new state is written back behind the
  compute), ``release_grad(i)`` once its background job is done with layer i's gradient;
- the runner: ``pop_step(timer)`` at the end of a step (the tier's I/O seconds join the phase breakdown);
- the trainer: ``commit(step, state, ident)`` after each step (a durable tier makes that step its
  checkpoint: ``trainer.resume`` continues from it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from l2l_cli.engine.device import CopyHandle

if TYPE_CHECKING:
    from l2l_cli.engine.device import Accelerator
    from l2l_cli.engine.eps import LayerState
    from l2l_cli.engine.flat import FlatLayout
    from l2l_cli.engine.optim import OptimSettings
    from l2l_cli.models.base import ModelSpec
    from l2l_cli.profiling.timers import PhaseTimer

TIERS = ("host", "disk")


@dataclass(frozen=True)
class TierSettings:
    """``eps.*`` as the EPS takes it (the path resolved by the session)."""

    tier: str = "host"  # host | disk
    path: str | None = None  # disk: the directory of the layer files (None: a temporary one)
    cache_layers: int = 2  # disk: layers whose state is in RAM at once
    resume: bool = False  # disk: continue from the state committed at ``path`` (trainer.resume)


class HostTier:
    """Every layer's state in host RAM for the whole run: nothing to fetch, nothing to write back."""

    durable = False  # its state is not a checkpoint by itself
    adopted = False  # it never starts from state found on disk

    def new_layer(
        self, index: int, kind: str, layout: FlatLayout, acc: Accelerator, send_dtype: torch.dtype,
        optim: OptimSettings,
    ) -> LayerState:  # fmt: skip
        from l2l_cli.engine.eps import LayerState

        return LayerState(index, kind, layout, acc, send_dtype, optim)

    def pin(self, i: int, parts: str = "w", *, fresh: bool = False) -> None:
        return None

    def unpin(self, i: int, after: CopyHandle | None = None) -> None:
        return None

    @contextmanager
    def holding(
        self, i: int, parts: str = "wmv", *, fresh: bool = False, dirty: bool = False
    ) -> Iterator[None]:
        yield

    def release_grad(self, i: int) -> None:
        return None

    def export(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor of a layer's state that outlives ``holding`` (the host tier's buffers always do)."""
        return t

    def host_parts(self) -> dict[str, int]:
        return {}

    def pop_step(self, timer: PhaseTimer, training: bool = True) -> dict[str, float]:
        return {}

    def commit(self, step: int, trainer_state: dict[str, Any], ident: dict[str, Any] | None = None) -> None:
        return None

    def summary(self) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        return None


def make_tier(
    settings: TierSettings, spec: ModelSpec, layouts: dict[str, FlatLayout], acc: Accelerator,
    send_dtype: torch.dtype, optim: OptimSettings, timer: PhaseTimer | None = None,
) -> Any:  # fmt: skip
    """The tier for ``eps.tier``: :class:`HostTier`, or the disk tier (``timer``: where the compute
    thread's waits for the disk are charged, as ``disk_wait``)."""
    if settings.tier == "host":
        return HostTier()
    from l2l_cli.engine.disk import DiskTier

    return DiskTier(settings, spec, layouts, acc, send_dtype, optim, timer)
