"""Checking an ``l2l train`` command line before any work starts: every problem at once.

``preflight`` parses the overrides like Hydra does, checks every key, group option and value type against
the schema, expands sweeps (command line and a recipe's ``hydra.sweeper.params``) and validates every
resulting config, so a bad sweep fails at once, with every problem listed, before the first job runs. A
resume is checked as the run's own config with the command line on top (:mod:`l2l_cli.inherit`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from l2l_cli.compose import check_overrides, compose, extra_keys, resolution_problem, values
from l2l_cli.config.validate import validate
from l2l_cli.inherit import NoSavedConfig, inherit, resume_problems, saved_config
from l2l_cli.problems import Problem

MAX_SWEEP_JOBS = 512


def preflight(
    overrides: list[str],
    multirun: bool,
    warn: list[str] | None = None,
    *,
    resume: Path | None = None,
    info: dict[str, Any] | None = None,
    check_space: bool = True,
) -> list[Problem]:
    """All problems with an ``l2l train`` command line (empty: safe to start).

    In a sweep, a job whose own combination is invalid (say mode=baseline with micro-batches) does not stop
    the others: it is listed in ``warn`` and will end as a failed job. Problems every job shares (unknown
    keys, options, types), or a sweep with no valid job, are errors. ``resume``: the run being resumed; the
    config checked is its own with these overrides on top (l2l_cli/inherit.py). ``info`` receives
    ``multirun``, ``jobs``, the sweep's ``dir`` (one run: its ``run_dir``), the jobs' ``pretrained``
    references and, for one valid job, its composed ``cfg`` (without the ``hydra`` node: what ``compose``
    returns, so a caller such as ``l2l plan`` need not compose it again). ``check_space``: whether the disk
    EPS's directory here can hold the state (``l2l plan`` asks about the machine its ``hardware.*`` keys
    describe, not this one).
    """
    problems, parsed = check_overrides(overrides)
    if problems:
        return problems
    plain = [
        ov.input_line
        for ov in parsed
        if not ov.is_sweep_override() and not ov.key_or_group.startswith("hydra")
    ]
    if resume is not None:
        return _resume_preflight(resume, plain)
    try:
        base = compose(plain, hydra=True)
    except Exception as e:
        return [Problem("config", str(e).splitlines()[0])]
    try:  # a recipe's sweep may be computed (``${l2l.pick:...}``): resolve it here, not in Hydra
        sweeper = dict(OmegaConf.select(base, "hydra.sweeper.params") or {})
    except OmegaConfBaseException as e:
        return [resolution_problem(e)]
    multirun = multirun or str(OmegaConf.select(base, "hydra.mode")) == "RunMode.MULTIRUN"
    sweeps = [ov for ov in parsed if ov.is_sweep_override()]
    if sweeps and not multirun:
        keys = ", ".join(ov.key_or_group for ov in sweeps)
        return [Problem(keys, "a list of values is a sweep; add -m (--multirun) to run one job per value")]
    jobs = list(itertools.islice(_sweep_jobs(parsed, sweeper if multirun else {}), MAX_SWEEP_JOBS + 1))
    if len(jobs) > MAX_SWEEP_JOBS:
        return [Problem("sweep", f"more than {MAX_SWEEP_JOBS} jobs; split the sweep")]
    if info is not None:
        info.update(multirun=multirun, jobs=len(jobs))
        with suppress(OmegaConfBaseException):
            if multirun:
                info["dir"] = str(OmegaConf.select(base, "hydra.sweep.dir"))
            else:
                info["run_dir"] = str(OmegaConf.select(base, "hydra.run.dir"))
    failing: list[tuple[list[str], list[Problem]]] = []
    for job in jobs:
        try:
            cfg = base if job == plain else compose(job)  # a single job: the config composed above
        except Exception as e:
            found = [Problem("config", f"{str(e).splitlines()[0]}")]
        else:
            try:
                found = extra_keys(cfg) + validate(cfg, check_space=check_space)
            except OmegaConfBaseException as e:  # an interpolation that cannot resolve for this job
                found = [resolution_problem(e)]
        if found:
            failing.append((job, found))
            continue
        if warn is not None and (advice := _lr_advice(cfg, job)) and advice not in warn:
            warn.append(advice)
        if info is not None:
            if cfg.model.pretrained:
                info.setdefault("pretrained", {})[str(cfg.model.pretrained)] = str(cfg.model.family)
            if len(jobs) == 1:
                info["cfg"] = _without_hydra(cfg)
    if len(jobs) == 1 or len(failing) == len(jobs):
        seen: dict[str, Problem] = {}
        for job, found in failing:
            for p in found:
                suffix = f" [job: {' '.join(job)}]" if len(jobs) > 1 else ""
                seen.setdefault(str(p), Problem(p.key, p.message + suffix))
        return list(seen.values())
    if warn is not None:
        for job, found in failing:
            warn.append(f"job {' '.join(job)} will fail: " + "; ".join(map(str, found)))
    return []


def _lr_advice(cfg: Any, job: list[str]) -> str | None:
    """A fine-tuning task's rate (task=csv, json, chat, GLUE: 5e-5, 2e-5) on a model that starts from random
    weights trains it barely at all: said before the run, unless the command line or a recipe chose it."""
    chosen = any(a.split("=", 1)[0].lstrip("+") in ("optim.lr", "recipe") for a in job)
    lr, own = cfg.optim.lr, cfg.model.lr
    if (
        chosen
        or cfg.model.pretrained
        or not (isinstance(lr, float) and isinstance(own, float))
        or lr >= own / 4
    ):
        return None
    return (
        f"optim.lr={lr:g} is task={cfg.task.name}'s fine-tuning rate, but the model starts from random "
        "weights "
        f"(no model.pretrained): {cfg.model.name} from scratch trains at model.lr={own:g}; set "
        f"model.pretrained=<checkpoint> to fine-tune, or optim.lr=<rate> to keep this one and silence this"
    )


def _without_hydra(cfg: Any) -> Any:
    """``cfg`` as ``compose`` returns it (the checked job's config is not used after this)."""
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return cfg


def _resume_preflight(run_dir: Path, overrides: list[str]) -> list[Problem]:
    """A resume: the run's own config with ``overrides`` on top must be valid, change nothing the
    checkpoint depends on, and the run must hold a usable checkpoint."""
    try:
        saved = saved_config(run_dir)
        cfg = inherit(saved, overrides)
    except NoSavedConfig as e:
        return [Problem("trainer.resume", str(e))]
    except OmegaConfBaseException as e:
        return [resolution_problem(e)]
    try:
        found = validate(cfg)
    except OmegaConfBaseException as e:
        return [resolution_problem(e)]
    return found + resume_problems(saved, cfg, run_dir)


def _sweep_jobs(parsed: list[Override], config_params: dict[str, str]) -> Iterator[list[str]]:
    """Every job's overrides, as Hydra's basic sweeper would build them (command line wins over config)."""
    fixed, axes = [], []
    cli_keys = {ov.key_or_group for ov in parsed}
    for key, value in config_params.items():
        if key not in cli_keys:
            ov = OverridesParser.create().parse_override(f"{key}={value}")
            axes.append([f"{key}={v}" for v in values(ov)])
    for ov in parsed:
        if ov.key_or_group.startswith("hydra"):
            continue
        if ov.is_sweep_override():
            axes.append([f"{ov.get_key_element()}={v}" for v in values(ov)])
        else:
            fixed.append(ov.input_line)
    for combo in itertools.product(*axes):
        yield fixed + list(combo)
