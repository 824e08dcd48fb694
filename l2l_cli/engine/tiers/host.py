"""The host tier (``eps.tier=host``, the default): every layer's state in host RAM for the whole run."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from l2l_cli.engine.tiers.base import TierKind, TierSettings, register_tier

if TYPE_CHECKING:  # torch and the layer state are imported when a run builds the tier, not by l2l plan
    import torch

    from l2l_cli.engine.copies import CopyHandle
    from l2l_cli.engine.device import Accelerator
    from l2l_cli.engine.flat import FlatLayout
    from l2l_cli.engine.layer_state import LayerState
    from l2l_cli.engine.optim import OptimSettings
    from l2l_cli.models.base import ModelSpec
    from l2l_cli.profiling.timers import PhaseTimer


class HostTier:
    """Every layer's state in host RAM for the whole run: nothing to fetch, nothing to write back."""

    durable = False  # its state is not a checkpoint by itself
    update_in_backward = False  # every layer stays in RAM: L2L updates after the whole backward (Alg. 3)
    clip_redo = "keep"  # a speculative update's gradient stays in its buffer for a redo: keeping is free
    resumed = False  # it never starts from state found on disk
    root: Path | None = None  # it keeps no files

    def new_layer(
        self,
        index: int,
        kind: str,
        layout: FlatLayout,
        acc: Accelerator,
        send_dtype: torch.dtype,
        optim: OptimSettings,
    ) -> LayerState:
        from l2l_cli.engine.layer_state import LayerState

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

    def resume_point(self) -> dict[str, Any] | None:
        return None

    def summary(self) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        return None


def _build(
    settings: TierSettings,
    spec: ModelSpec,
    layouts: dict[str, FlatLayout],
    acc: Accelerator,
    send_dtype: torch.dtype,
    optim: OptimSettings,
    timer: PhaseTimer | None = None,
) -> HostTier:
    return HostTier()


HOST = register_tier(TierKind("host", _build))
