"""The mode registry: one :class:`ModeSpec` per execution algorithm, registered by the mode's own file.

Validation, runner dispatch, checkpoints, the progress header, ``l2l report`` and ``l2l plan`` read the
spec, never the mode's name, so a new algorithm is one file: its runner and a
``register_mode(ModeSpec(...))``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from l2l_cli.modes.base import Runner, RunnerArgs
    from l2l_cli.problems import Problem


@dataclass(frozen=True)
class ModeSpec:
    name: str  # mode.name
    label: str  # the papers' METHOD column ("l2l-p"); "-stash-cpu" is added where the stash is on the host
    runner: Callable[[RunnerArgs], Runner]
    description: str
    # precision.name -> what it means in this mode (``mixed`` resolved to the mode's own); names missing
    # here are refused, with ``precision_note`` saying why
    precisions: Mapping[str, str] = field(
        default_factory=lambda: {"fp32": "fp32", "amp": "amp", "mixed": "amp"}
    )
    precision_note: str = ""
    default_clip: str = "global"  # what optim.clip=auto means here
    clips: tuple[str, ...] = ("global", "layer", "none")
    clip_note: str = ""  # why a clip rule missing from ``clips`` is refused
    microbatches: bool = True  # False: the whole minibatch at once (Alg. 1), ubatch = batch
    stash: tuple[str, ...] = ()  # mode.stash options (the first is the default); () = no stash
    # reads mode.recompute / keep_layers / activation_budget_gb (layer-wise recompute)
    recompute: bool = False
    host_state: str | None = None  # "eps": the training state lives in the eager param-server
    undo_log: bool = False  # keeps each layer's pre-update state until the step is known finite (L2L-p)
    overlapped_update: bool = False  # the host update of layer l+1 runs during layer l's backward
    distribute: str = "ddp"  # data parallel by: "ddp" (gradients in backward) | "eps" (EPS, layer by layer)
    state_layout: str = "module-v1"  # checkpoint layout; modes sharing one resume each other's checkpoints
    validate: Callable[[Any], list[Problem]] | None = None  # mode-specific rules on the composed config
    pipeline_stage: bool = False  # can be the algorithm each stage of a pipeline runs (dist.pipeline > 1)
    decodes: bool = False  # its runner decodes layer by layer (``decoder()``): what ``l2l generate`` runs

    @property
    def realtime_ckpt(self) -> bool:
        """Real-time per-layer checkpoints need the EPS: it writes each layer right after its update."""
        return self.host_state == "eps"

    def method(self, stash: str | None) -> str:
        return self.label + ("-stash-cpu" if stash == "cpu" else "")


class UpdateSchedule(Enum):
    """When an EPS runner's host update of a layer runs: chosen once, when the runner is built
    (:func:`update_schedule`), and read by its ``step()``."""

    AFTER_BACKWARD = "after_backward"  # Alg. 3: every layer, once the whole backward is over
    IN_BACKWARD = "in_backward"  # layer l+1 while the device runs backward on layer l, speculatively
    IN_BACKWARD_TRAILING = "in_backward_trailing"  # ... and the last one behind the next forward (Alg. 4)

    @property
    def in_backward(self) -> bool:
        """Each layer is updated as its gradient lands (speculatively: engine/speculative.py)."""
        return self is not UpdateSchedule.AFTER_BACKWARD

    @property
    def trailing(self) -> bool:
        """The step's last update (the embeddings') is held and runs behind the next forward
        (engine/trailing.py)."""
        return self is UpdateSchedule.IN_BACKWARD_TRAILING


def update_schedule(mode: ModeSpec, tier_updates_in_backward: bool, eager_reduce: bool) -> UpdateSchedule:
    """The mode's schedule (``overlapped_update``: L2L-p's, Alg. 4), or Alg. 3's; except that Alg. 3 on a
    tier that would read each layer twice (the disk tier: once for its backward, once for its update after
    the whole backward) updates each layer in its backward instead, when the reductions are eager: the
    speculative update is exact, so the numbers are Alg. 3's, with fewer bytes moved."""
    if mode.overlapped_update:
        return UpdateSchedule.IN_BACKWARD_TRAILING
    if tier_updates_in_backward and eager_reduce:
        return UpdateSchedule.IN_BACKWARD
    return UpdateSchedule.AFTER_BACKWARD


MODES: dict[str, ModeSpec] = {}


def register_mode(spec: ModeSpec) -> ModeSpec:
    """Add (or replace) a mode; returns it, so a mode file can keep a handle."""
    MODES[spec.name] = spec
    return spec


def unregister_mode(name: str) -> None:
    MODES.pop(name, None)


def get_mode(name: str) -> ModeSpec:
    return MODES[name]


def mode_names() -> tuple[str, ...]:
    return tuple(MODES)


def find_mode(**attrs: Any) -> ModeSpec:
    """The first registered mode with these attributes (the planner's reference L2L, say)."""
    for spec in MODES.values():
        if all(getattr(spec, k) == v for k, v in attrs.items()):
            return spec
    raise KeyError(f"no registered mode with {attrs}")


def method_label(mode: str | None, stash: str | None) -> str | None:
    """The papers' METHOD for a mode name (an unregistered name stands for itself)."""
    if mode is None:
        return None
    spec = MODES.get(mode)
    return spec.method(stash) if spec else mode + ("-stash-cpu" if stash == "cpu" else "")


def effective_precision(mode: str, precision: str) -> str:
    """precision.name as ``mode`` runs it (``mixed``: AMP for the baselines, CMP for the L2L modes)."""
    spec = MODES.get(mode)
    return spec.precisions.get(precision, precision) if spec else precision


def run_precision(cfg: Any) -> str:
    """precision.name with ``mixed`` resolved by the run's mode (L2L v2 Table 2)."""
    return effective_precision(cfg.mode.name, cfg.precision.name)


def run_clip(cfg: Any) -> str:
    """optim.clip with ``auto`` resolved by the mode (global-norm clipping, unless the mode says)."""
    if cfg.optim.clip != "auto":
        return cfg.optim.clip
    spec = MODES.get(cfg.mode.name)
    return spec.default_clip if spec else "global"


def run_stash(cfg: Any) -> str | None:
    """mode.stash, or the mode's default stash when unset (None for modes without one)."""
    spec = MODES.get(cfg.mode.name)
    if cfg.mode.stash is not None or spec is None or not spec.stash:
        return cfg.mode.stash
    return spec.stash[0]
