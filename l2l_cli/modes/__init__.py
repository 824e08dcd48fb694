"""Execution modes: one file per algorithm of the papers (its runner and its :class:`ModeSpec`), each
registered on import. ``l2l train`` dispatches through the registry, never on a mode's name."""

from l2l_cli.modes import baseline, baseline_ag, l2l, l2l_p  # noqa: F401  (register the built-ins)
from l2l_cli.modes.base import DeviceResident, Runner, RunnerArgs, RunnerBase, StepReport, StepSettings
from l2l_cli.modes.registry import (
    MODES,
    ModeSpec,
    effective_precision,
    find_mode,
    get_mode,
    method_label,
    mode_names,
    register_mode,
    run_clip,
    run_precision,
    run_stash,
    unregister_mode,
)

__all__ = [
    "MODES", "DeviceResident", "ModeSpec", "Runner", "RunnerArgs", "RunnerBase", "StepReport", "StepSettings",
    "effective_precision", "find_mode", "get_mode", "method_label", "mode_names", "register_mode", "run_clip",
    "run_precision", "run_stash", "unregister_mode",
]  # fmt: skip
