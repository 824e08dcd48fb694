"""Execution modes: one file per algorithm of the papers (its runner), their :class:`ModeSpec` in
:mod:`.specs`, registered on import without torch (``l2l plan`` reads them; a runner's file is imported when
a run builds it). ``l2l train`` dispatches through the registry, never on a mode's name."""

from typing import Any

from l2l_cli.modes import specs  # noqa: F401  (register the built-ins)
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

_BASE = ("DeviceResident", "Runner", "RunnerArgs", "RunnerBase", "StepReport", "StepSettings")


def __getattr__(name: str) -> Any:
    """The runner base classes (:mod:`.base`, which imports torch), on first use."""
    if name in _BASE:
        from l2l_cli.modes import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MODES",
    "DeviceResident",
    "ModeSpec",
    "Runner",
    "RunnerArgs",
    "RunnerBase",
    "StepReport",
    "StepSettings",
    "effective_precision",
    "find_mode",
    "get_mode",
    "method_label",
    "mode_names",
    "register_mode",
    "run_clip",
    "run_precision",
    "run_stash",
    "unregister_mode",
]
