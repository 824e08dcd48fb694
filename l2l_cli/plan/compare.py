"""Predicted vs measured, per phase, for a finished run (``l2l plan --compare RUN_DIR [overrides]``).

The run directory holds what ``l2l train`` saw (``.hydra/overrides.yaml``) and what it measured
(``summary.json``: ``time_breakdown_s`` per phase, ``samples_per_s``, ``device_peak_bytes``). The plan is
recomposed from the same overrides, plus any given here (``hardware=measure`` to predict for this
machine). ``l2l report`` can call :func:`compare_run` (one run dir in, the same columns out).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from l2l_cli.plan import PlanError
from l2l_cli.problems import Problem
from l2l_cli.runfiles import BACKGROUND_PHASES, OTHER, PHASES, Summary, read_json


def run_overrides(run_dir: Path) -> tuple[list[str], list[Problem]]:
    """The overrides a run was started with, or the problems reading them."""
    summary, ov = run_dir / "summary.json", run_dir / ".hydra" / "overrides.yaml"
    if not run_dir.is_dir():
        return [], [Problem("--compare", f"{run_dir} is not a directory; give a run directory of l2l train")]
    missing = [p.name for p in (summary, ov) if not p.is_file()]
    if missing:
        return [], [
            Problem("--compare", f"{run_dir} has no {' or '.join(missing)}; is it an l2l train run dir?")
        ]
    return [str(x) for x in OmegaConf.load(ov)], []


def _ratio(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or not predicted:
        return None
    return measured / predicted


def predicted_vs_measured(run_dir: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """Per-phase seconds per step, predicted (``plan``) and measured (the run's summary.json)."""
    obj, problem = read_json(run_dir / "summary.json")
    if obj is None:
        raise PlanError(f"{run_dir}: {problem or 'no summary.json'}")
    summary = Summary.from_json(obj)
    measured = summary.time_breakdown_s
    predicted = dict(plan["step_time_s"])
    phases = {}
    for k in (*PHASES, OTHER):
        p, m = predicted.get(k, 0.0), measured.get(k)
        if p or m:
            phases[k] = {"predicted": p, "measured": m, "ratio": _ratio(m, p)}
    step_m = summary.step_time_s or sum(v for k, v in measured.items() if k not in BACKGROUND_PHASES)
    out: dict[str, Any] = {
        "run_dir": str(run_dir),
        "status": summary.status,
        "phases": phases,
        "step": {
            "predicted": predicted["total"],
            "measured": step_m,
            "ratio": _ratio(step_m, predicted["total"]),
        },
        "samples_per_s": {
            "predicted": plan["samples_per_s"],
            "measured": summary.samples_per_s,
            "ratio": _ratio(summary.samples_per_s, plan["samples_per_s"]),
        },
    }
    peak = summary.device_peak_bytes
    if peak:
        pred = plan["memory_bytes"]["device"]["total"]
        out["device_peak"] = {"predicted": pred, "measured": peak, "ratio": _ratio(peak, pred)}
    return out


def compare_run(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The whole round trip for ``l2l report``: recompose the run's config (plus ``overrides``, e.g.
    ``hardware=measure``), plan it, and compare with what the run measured. Raises ``PlanError`` (one
    line) on a directory that is not a finished run or overrides that do not compose."""
    from l2l_cli.compose import compose
    from l2l_cli.plan import PlanError
    from l2l_cli.plan.budget import command_keys
    from l2l_cli.plan.planner import make_plan
    from l2l_cli.preflight import preflight

    path = Path(run_dir)
    base, problems = run_overrides(path)
    problems = problems or preflight([*base, *overrides], multirun=False)
    if problems:
        raise PlanError("; ".join(str(p) for p in problems))
    argv = [*base, *overrides]
    return predicted_vs_measured(path, make_plan(compose(argv), given=command_keys(argv)))
