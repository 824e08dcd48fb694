"""``l2l plan [overrides] [--json] [--compare RUN_DIR]``: the analytic memory and time model for a config.

Takes the same overrides as ``l2l train`` and rejects bad ones the same way (``l2l: config error: ...``
on stderr, exit 2). A config that does not fit is an answer, not an error: the verdict says so and why
(exit 0; ``fits`` is false in ``--json``). Exit 2 for bad input, including a ``hardware=measure`` that
cannot time one layer on this machine.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from l2l_cli.plan import PlanError

USAGE = """\
usage: l2l plan [group=option] [key=value ...] [--json] [--compare RUN_DIR | --search | --scaling [--out DIR]]

  Parameter count, memory per tier (device / host), step time by phase, samples/s, the recommended
  #ubatches and ubatch size, every mode side by side, and the layered-GA 3d-parallel view, for the
  config `l2l train` would compose from the same overrides.

  Budget: plan.tokens=100e6 (a fine-tune) or plan.steps=N (steps of the configured batch); neither:
  plan.train_steps steps of it. Efficiency: hardware.mfu (the preset's published figure). The paper's
  X[x] (model=x) answers the paper's question unless these keys (or batch.size) ask another: 100k steps at
  the critical batch, at peak x efficiency, offload with no host-memory bound. docs/plan-budget.md

  --json              print the plan as one JSON object on stdout
  --compare RUN_DIR   predicted vs measured per phase for a finished run (its overrides, then these)
  --search            layered-GA §5: the fastest configuration per method and parallelism mix that fits
                      (plan.parallelism, plan.method, plan.max_gpus, plan.max_days, plan.network,
                      plan.node_size), with the l2l train / torchrun command for the ones l2l can run
  --scaling           layered-GA §7: sweep the X[x] family (1e9..1e16 parameters), write figure4/5/8 (.png,
                      .svg), scaling.csv and scaling.json into --out DIR (default outputs/layered_ga_scaling),
                      report the limits; recipe=layered_ga_scaling sets the paper's machine and bounds

examples:
  l2l plan model=bert-large batch.size=64 batch.ubatch_size=4 task.max_seq_len=512
  l2l plan model=x model.x=64 hardware=a100-80g plan.tensor_parallel=16 plan.data_parallel=64
  l2l plan mode=l2l hardware=measure --json
  l2l plan --compare outputs/2026-01-01/12-00-00-l2l-synthetic hardware=measure
  l2l plan --search model=bert-large hardware=a100-80g plan.max_gpus=8
  l2l plan --search model=llama-7b task=lm hardware=a100-80g plan.max_gpus=8 plan.tokens=100e6
  l2l plan --search model=x model.x=160 hardware=a100-80g plan.max_days=30 plan.parallelism=3d
  l2l plan --scaling recipe=layered_ga_scaling            # then: l2l report outputs/layered_ga_scaling
"""


def hardware_overrides(overrides: list[str]) -> list[str]:
    """The ``hardware.*`` keys the command line sets over its preset (the header names them beside it)."""
    return [o.lstrip("+~") for o in overrides if o.lstrip("+~").startswith("hardware.")]


def _console() -> Any:
    """The terminal's width; piped to a file, wide enough that no table cell wraps or is cut."""
    from rich.console import Console

    return Console(highlight=False, width=None if sys.stdout.isatty() else 240)


def _fail(lines: list[str]) -> int:
    for line in lines:
        print(f"l2l: {line}", file=sys.stderr)
    return 2


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def parse(argv: list[str]) -> tuple[dict[str, Any], list[str], list[str]]:
    """(flags, overrides, errors)."""
    flags: dict[str, Any] = {
        "json": False,
        "compare": None,
        "help": False,
        "search": False,
        "scaling": False,
        "out": None,
    }
    overrides, errors = [], []
    it = iter(argv)
    for a in it:
        if a in ("-h", "--help"):
            flags["help"] = True
        elif a == "--json":
            flags["json"] = True
        elif a == "--compare" or a.startswith("--compare="):
            value = a.split("=", 1)[1] if "=" in a else next(it, None)
            if not value:
                errors.append("--compare needs a run directory")
            flags["compare"] = value
        elif a in ("--search", "--scaling"):
            flags[a[2:]] = True
        elif a == "--out" or a.startswith("--out="):
            value = a.split("=", 1)[1] if "=" in a else next(it, None)
            if not value:
                errors.append("--out needs a directory")
            flags["out"] = value
        elif a.startswith("-"):
            errors.append(
                f"unknown option {a}; allowed: --json, --compare RUN_DIR, --search, --scaling, --out DIR, "
                "--help"
            )
        else:
            overrides.append(a)
    return flags, overrides, errors


def main(argv: list[str]) -> int:
    flags, overrides, errors = parse(argv)
    if flags["help"]:
        print(USAGE, end="")
        return 0
    picked = [k for k in ("compare", "search", "scaling") if flags[k]]
    if len(picked) > 1:
        errors.append(f"--{picked[0]} and --{picked[1]}: one question at a time")
    if flags["out"] and not flags["scaling"]:
        errors.append("--out applies to --scaling")
    if errors:
        return _fail(errors)
    from l2l_cli.compose import check_overrides, compose
    from l2l_cli.preflight import preflight

    run_dir = Path(flags["compare"]).expanduser() if flags["compare"] else None
    if run_dir is not None:
        from l2l_cli.plan.compare import run_overrides

        base, problems = run_overrides(run_dir)
        if problems:
            return _fail([f"config error: {p}" for p in problems])
        overrides = base + overrides
    info: dict[str, Any] = {}
    # this machine's disk is not the question (hardware.disk_free_gb, or hardware=measure's reading, is)
    problems = preflight(overrides, multirun=False, info=info, check_space=False)
    if problems:  # a sweep is one of them (checked here, not before: a valid command line parses once)
        _, parsed = check_overrides(overrides)
        sweeps = [ov.key_or_group for ov in parsed if ov.is_sweep_override()]
        if sweeps:
            return _fail([f"config error: {', '.join(sweeps)}: l2l plan takes one config; give one value"])
        return _fail([f"config error: {p}" for p in problems])
    if info.get("jobs", 1) > 1:  # a training recipe's sweep (hydra.sweeper.params): plan one config of it
        return _fail(
            [
                f"config error: recipe: a sweep of {info['jobs']} jobs (run it with l2l train); l2l plan "
                "takes "
                "one config: give one value for each swept key"
            ]
        )
    cfg = info.get("cfg") or compose(overrides)  # preflight's composed config: Hydra composes once
    if flags["search"] or flags["scaling"]:
        return _search_or_scaling(cfg, overrides, flags)
    from l2l_cli.plan.budget import command_keys
    from l2l_cli.plan.planner import make_plan

    try:
        plan = make_plan(cfg, given=command_keys(overrides))
    except PlanError as e:
        return _fail([f"plan error: {e}"])
    plan["hardware"]["overrides"] = hardware_overrides(overrides)
    out: dict[str, Any] = plan
    if run_dir is not None:
        from l2l_cli.plan.compare import predicted_vs_measured

        out = {**plan, "compare": predicted_vs_measured(run_dir, plan)}
    if flags["json"]:
        print(json.dumps(_jsonable(out)))
        return 0
    from l2l_cli.plan.render import render, render_compare

    console = _console()
    render(plan, console)
    if run_dir is not None:
        render_compare(out["compare"], console)
    return 0


def _search_or_scaling(cfg: Any, overrides: list[str], flags: dict[str, Any]) -> int:
    """``--search`` (layered-GA §5 for the config's model) or ``--scaling`` (§7's sweep and figures)."""
    if cfg.hardware.measured:
        return _fail(
            [
                "config error: hardware=measure: --search and --scaling need a GPU preset "
                "(hardware=a100-80g, ...)"
            ]
        )
    if cfg.peft.name != "none":
        return _fail(
            [
                f"config error: peft.name: --search and --scaling plan full training (the layered-GA paper's "
                f"methods), not peft={cfg.peft.name}; ask l2l plan without them for the LoRA plan"
            ]
        )
    try:
        if flags["search"]:
            from l2l_cli.plan.choose import search_plan

            out = search_plan(cfg, overrides)
        else:
            from l2l_cli.plan.figures import DEFAULT_OUT, scaling_plan

            out = scaling_plan(cfg, Path(flags["out"] or DEFAULT_OUT).expanduser())
    except (PlanError, OSError) as e:
        return _fail([f"plan error: {e}"])
    if flags["search"]:
        out["hardware"]["overrides"] = hardware_overrides(overrides)
    if flags["json"]:
        print(json.dumps(_jsonable(out)))
        return 0
    from l2l_cli.plan.render_search import render_scaling, render_search

    (render_search if flags["search"] else render_scaling)(out, _console())
    return 0
