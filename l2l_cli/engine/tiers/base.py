"""What every EPS storage tier is: the :class:`Tier` protocol the EPS, the relay and the trainer call, the
settings it is built from, and the :class:`TierKind` each tier registers under its ``eps.tier`` name.

The EPS and the relay ask the tier for a layer's buffers before they touch them and hand them back after;
with the host tier every layer's buffers are always in RAM and these calls do nothing, so the host tier is
exactly the EPS it has always been. The disk tier keeps one file per layer and only
``eps.host_cache_layers`` layers in RAM, read ahead of use and written back behind the compute.

The calls, by who makes them:
- the relay: ``pin(i, "w")`` before it copies layer i to the device, ``unpin(i, after=copy)`` once the
  copy is issued; ``pin(i, "g", fresh=True)`` before the device's gradient lands in the host buffer;
- the EPS: ``holding(i, parts, dirty=True)`` around an update (the new state is written back behind the
  compute), ``release_grad(i)`` once its background job is done with layer i's gradient;
- the runner: ``pop_step(timer)`` at the end of a step (the tier's I/O seconds join the phase breakdown);
- the trainer: ``commit(step, state, ident)`` after each step (a durable tier makes that step its
  checkpoint: ``trainer.resume`` continues from it, ``resume_point()``).

Everything a caller outside the engine needs to know about a tier (does it keep files, in which folder,
which config rules it brings) is on its :class:`TierKind`, so no code compares a tier's name.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from l2l_cli.problems import Problem

if TYPE_CHECKING:  # torch too: the registry is read without it (l2l plan)
    import torch

    from l2l_cli.engine.copies import CopyHandle
    from l2l_cli.engine.device import Accelerator
    from l2l_cli.engine.flat import FlatLayout
    from l2l_cli.engine.layer_state import LayerState
    from l2l_cli.engine.optim import OptimSettings
    from l2l_cli.models.base import ModelSpec
    from l2l_cli.profiling.timers import PhaseTimer


@dataclass(frozen=True)
class TierSettings:
    """``eps.*`` as the EPS takes it (the path resolved by the session)."""

    tier: str = "host"  # a registered tier's name (TIERS)
    path: str | None = None  # a tier that keeps files: their directory (None: a temporary one)
    cache_layers: int = 4  # disk: layers whose state is in RAM at once
    resume: bool = False  # disk: continue from the state committed at ``path`` (trainer.resume)
    grad_ram_bytes: int = 0  # disk: gradients kept in RAM instead of on disk, bytes (eps.grad_ram_gb)
    grad_ram_layers: int = 2  # disk: ... and at most this many layers' of them (eps.grad_ram_layers)
    clip_global: bool = True  # disk: global-norm clipping (gradients kept for its verdict: the space check)
    clip_redo: str = "auto"  # disk: keep | replay | auto (eps.clip_redo: how a clipped step is redone)
    optim: str = "adamw"  # disk: optim.name, whose state the layer files hold (the space check's bytes)


class Tier(Protocol):
    """Where the EPS keeps each layer's training state (see the module doc for who calls what)."""

    @property
    def durable(self) -> bool: ...  # its state is a checkpoint by itself (committed after every step)

    @property
    def update_in_backward(self) -> bool: ...  # L2L updates each layer right after its backward (see EPS)

    @property
    def clip_redo(
        self,
    ) -> str: ...  # keep | replay | auto: how a clipped step's speculative updates are redone

    @property
    def resumed(self) -> bool: ...  # it started from state found on disk (the EPS builds no initial weights)

    @property
    def root(self) -> Path | None: ...  # the directory of its files (None: it keeps none)

    def new_layer(
        self,
        index: int,
        kind: str,
        layout: FlatLayout,
        acc: Accelerator,
        send_dtype: torch.dtype,
        optim: OptimSettings,
    ) -> LayerState: ...

    def pin(self, i: int, parts: str = "w", *, fresh: bool = False) -> None: ...

    def unpin(self, i: int, after: CopyHandle | None = None) -> None: ...

    def holding(
        self, i: int, parts: str = "wmv", *, fresh: bool = False, dirty: bool = False
    ) -> AbstractContextManager[None]: ...

    def release_grad(self, i: int) -> None: ...

    def export(self, t: torch.Tensor) -> torch.Tensor: ...

    def host_parts(self) -> dict[str, int]: ...

    def pop_step(self, timer: PhaseTimer, training: bool = True) -> dict[str, float]: ...

    def commit(
        self, step: int, trainer_state: dict[str, Any], ident: dict[str, Any] | None = None
    ) -> None: ...

    def resume_point(self) -> dict[str, Any] | None: ...

    def summary(self) -> dict[str, Any] | None: ...

    def close(self) -> None: ...


def _no_problems(*args: Any) -> list[Problem]:
    return []


@dataclass(frozen=True)
class TierKind:
    """A tier ``eps.tier`` selects: how to build it, and what the config and the session need to know."""

    name: str
    # (settings, spec, layouts, acc, send_dtype, optim, timer) -> the tier
    build: Callable[..., Tier]
    # a tier that keeps files: the folder of the run dir they go to unless eps.path says (None: RAM only)
    dir_name: str | None = None
    # why the tier needs a mode whose state lives in the EPS (None: any mode)
    eps_modes_only: str | None = None
    # (cfg) -> problems: the values of the ``eps.*`` keys the tier reads, checked whichever tier is
    # selected (a bad value is a mistake even where it is not used)
    check_keys: Callable[[Any], list[Problem]] = _no_problems
    # (cfg, check_files) -> problems: the tier's own rules when it is selected
    validate: Callable[[Any, bool], list[Problem]] = _no_problems
    # (cfg, spec) -> problems: whether the place the config points at can hold ``spec``'s state (before
    # the run dir exists; None: the tier needs no place)
    check_space: Callable[[Any, ModelSpec], list[Problem]] | None = None
    # (settings, spec, world) -> problems: the same once the session knows the place and the ranks
    check_start: Callable[[TierSettings, ModelSpec, int], list[Problem]] = _no_problems
    # (cfg) -> whether the place the config points at holds a committed state a resume can start from
    # (a tier that commits every step is a checkpoint by itself)
    committed: Callable[[Any], bool] = lambda cfg: False

    @property
    def on_disk(self) -> bool:
        """The tier keeps the state in files, a few layers cached in RAM."""
        return self.dir_name is not None


TIERS: dict[str, TierKind] = {}


def register_tier(kind: TierKind) -> TierKind:
    """Make ``kind`` selectable as ``eps.tier=<kind.name>`` (each tier registers itself on import)."""
    TIERS[kind.name] = kind
    return kind


def make_tier(
    settings: TierSettings,
    spec: ModelSpec,
    layouts: dict[str, FlatLayout],
    acc: Accelerator,
    send_dtype: torch.dtype,
    optim: OptimSettings,
    timer: PhaseTimer | None = None,
) -> Tier:
    """The tier ``settings.tier`` names (``timer``: where the compute thread's waits for a disk tier are
    charged, as ``disk_wait``)."""
    return TIERS[settings.tier].build(settings, spec, layouts, acc, send_dtype, optim, timer)
