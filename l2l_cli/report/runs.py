"""Finding run directories and reading what they hold, tolerating runs that crashed half-way.

A run directory (Hydra's) has ``.hydra/`` and, once the job ended, ``summary.json``; a multirun directory
has ``multirun.yaml`` and one numbered run directory per job. A run that died hard may lack any file but
``.hydra/``: it is still a run (an error row), so a report never hides a failure.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from l2l_cli.data.tasks import TASKS
from l2l_cli.modes import effective_precision, method_label
from l2l_cli.runfiles import (
    OTHER,
    PHASES,
    MemoryReport,
    MetricsRow,
    RunConfig,
    Summary,
    read_json,
    read_jsonl,
    read_metrics,
)


class ReportError(Exception):
    """Bad input to ``l2l report`` (a missing path, a folder without runs): one line, exit code 2."""


@dataclass
class Run:
    """One training run as the report sees it: its status, the summary's config block and its numbers."""

    dir: Path
    name: str  # the path shown in the table (relative to the inputs' common folder)
    status: str  # ok | oom | error
    error: str | None
    config: RunConfig  # summary.json's "config" block (derived from .hydra/config.yaml when missing)
    summary: Summary = field(default_factory=Summary)
    memory: MemoryReport | None = None  # None: the run wrote no memory.json
    metrics: list[MetricsRow] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)
    train_samples: int | None = None  # one epoch's samples, for time per epoch (None: unknown)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def get(self, key: str) -> Any:
        """A config field (method, precision, ubatch_size, num_layers, ...), else a field of a mode's
        summary section (``placement``, ``schedule`` of a pipeline run), or None."""
        value = self.config.get(key)
        if value is None:
            for section in self.summary.sections.values():
                if key in section and not isinstance(section[key], dict | list):
                    return section[key]
        return value

    @property
    def pipeline(self) -> dict[str, Any]:
        """summary.json's ``pipeline`` section ({} for runs without a pipeline)."""
        return self.summary.sections.get("pipeline", {}) if self.ok else {}

    @property
    def throughput(self) -> float | None:
        return _num(self.summary.samples_per_s) if self.ok else None

    @property
    def peak_bytes(self) -> int | None:
        if self.status == "error":
            return None
        v = self.summary.device_peak_bytes or (self.memory.device.peak_bytes if self.memory else None)
        return int(v) if isinstance(v, int | float) else None

    @property
    def budget_bytes(self) -> int | None:
        v = self.memory.device.budget_bytes if self.memory else None
        if v is None and self.get("sim_memory_gb"):
            v = self.get("sim_memory_gb") * 2**30  # same rule as the simulated device's meter
        return int(v) if v else None

    @property
    def params(self) -> int | None:
        v = self.summary.params
        return int(v) if isinstance(v, int | float) else None

    @property
    def breakdown(self) -> dict[str, float]:
        """Mean seconds per step by phase (steady state), phases in the papers' order."""
        raw = self.summary.time_breakdown_s if self.ok else {}
        known = (*PHASES, OTHER)
        order = [p for p in known if p in raw] + sorted(set(raw) - set(known))
        return {p: float(raw[p]) for p in order}

    @property
    def epoch_time_s(self) -> float | None:
        """Seconds per epoch at the measured throughput (the L2L v1 paper's Figure 5 axis)."""
        sps = self.throughput
        if not sps or not self.train_samples:
            return None
        return self.train_samples / sps


def find_runs(paths: list[str], elsewhere: frozenset[Path] = frozenset()) -> list[Run]:
    """Every run under ``paths`` (run dirs, multirun dirs, or folders holding either), in a stable order.
    ``elsewhere``: other outputs the report found (``l2l plan --scaling`` folders): a path holding one of
    them needs no runs."""
    dirs: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise ReportError(f"{raw} does not exist")
        if not path.is_dir():
            raise ReportError(
                f"{raw} is not a directory (give a run dir, a multirun dir or a folder of them)"
            )
        found = list(_run_dirs(path))
        top = path.resolve()
        if not found and not any(e == top or top in e.parents for e in elsewhere):
            raise ReportError(
                f"no runs under {raw} (a run dir holds summary.json or .hydra/; run `l2l train` first; "
                "or scaling.json, from `l2l plan --scaling`)"
            )
        dirs.extend(d for d in found if d not in dirs)
    root = _common_root(dirs)
    return [load_run(d, _display_name(d, root)) for d in dirs]


def is_run_dir(path: Path) -> bool:
    return (path / "summary.json").is_file() or (path / ".hydra").is_dir()


def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _run_dirs(top: Path) -> list[Path]:
    if is_run_dir(top):
        return [top.resolve()]
    out = []
    for root, subdirs, _ in os.walk(top):
        subdirs[:] = sorted((s for s in subdirs if not s.startswith(".")), key=_natural)
        here = Path(root)
        keep = []
        for s in subdirs:
            if is_run_dir(here / s):
                out.append((here / s).resolve())
            else:
                keep.append(s)
        subdirs[:] = keep
    return sorted(out, key=lambda p: _natural(str(p)))


def _common_root(dirs: list[Path]) -> Path:
    parents = [d.parent for d in dirs]
    return Path(os.path.commonpath([str(p) for p in parents])) if parents else Path(".")


def _display_name(d: Path, root: Path) -> str:
    rel = os.path.relpath(d, root)
    return d.name if rel == "." else rel


# --------------------------------------------------------------------------------------------------


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def load_run(d: Path, name: str) -> Run:
    """Read one run dir (any schema version). A missing or unreadable summary makes it an error row,
    never an exception."""
    obj, problem = read_json(d / "summary.json")
    mem, _ = read_json(d / "memory.json")
    hydra_cfg = _hydra_config(d)
    summary = Summary.from_json(obj) if obj else Summary(run_dir=str(d))
    config = summary.config
    if hydra_cfg is not None:
        for k, v in config_from_hydra(hydra_cfg).items():
            if config.get(k) is None:
                setattr(config, k, v)  # fills what a run that failed early never wrote
    if problem:
        status, error = "error", problem
    elif not obj:
        status, error = "error", "no summary.json: the run crashed hard or is still running"
    else:
        status = summary.status if summary.status in ("ok", "oom", "error") else "error"
        error = summary.error or (None if status == "ok" else f"status {summary.status!r}")
    return Run(
        dir=d,
        name=name,
        status=status,
        error=error,
        config=config,
        summary=summary,
        memory=MemoryReport.from_json(mem) if mem else None,
        metrics=read_metrics(d / "metrics.jsonl"),
        evals=read_jsonl(d / "eval.jsonl"),
        overrides=_overrides(d),
        train_samples=_train_samples(summary, hydra_cfg),
    )


def _overrides(d: Path) -> list[str]:
    path = d / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    try:
        from omegaconf import OmegaConf

        return [str(x) for x in OmegaConf.load(path)]
    except Exception:
        return []


def _hydra_config(d: Path) -> Any:
    """The composed config Hydra saved (interpolations resolvable: the l2l resolvers are registered)."""
    path = d / ".hydra" / "config.yaml"
    if not path.is_file():
        return None
    try:
        from omegaconf import OmegaConf

        from l2l_cli.compose import setup

        setup()
        return OmegaConf.load(path)
    except Exception:
        return None


def _select(cfg: Any, key: str) -> Any:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
    except Exception:
        return None


def config_from_hydra(cfg: Any) -> dict[str, Any]:
    """The summary's config block, rebuilt from .hydra/config.yaml (for runs that never wrote it)."""
    mode, stash = _select(cfg, "mode.name"), _select(cfg, "mode.stash")
    size, ub = _select(cfg, "batch.size"), _select(cfg, "batch.ubatch_size")
    nproc = _select(cfg, "dist.nproc") or 1
    shards = nproc // max(1, _select(cfg, "dist.pipeline") or 1)  # a pipeline's ranks share one shard
    pretrained = _select(cfg, "model.pretrained")
    device = _select(cfg, "device.name") or _select(cfg, "device")  # (a run before device.*: its name)
    out = {
        "method": method_label(mode, stash),
        "mode": mode,
        "stash": stash,
        "precision": _precision(_select(cfg, "precision.name"), mode),
        "family": None if pretrained else _select(cfg, "model.family"),
        "model": f"pretrained:{pretrained}" if pretrained else _select(cfg, "model.name"),
        "num_layers": None if pretrained else _select(cfg, "model.num_layers"),
        "hidden_size": None if pretrained else _select(cfg, "model.hidden_size"),
        "ubatch_size": ub,
        "num_ubatches": size // ub if isinstance(size, int) and isinstance(ub, int) and ub else None,
        "batch_size": size,
        "global_batch_size": size * shards if isinstance(size, int) and isinstance(shards, int) else None,
        "seq_len": _select(cfg, "task.max_seq_len"),
        "task": _select(cfg, "task.name"),
        "optimizer": _select(cfg, "optim.name"),
        "device": device,
        "sim_memory_gb": _select(cfg, "sim.memory_gb") if device == "sim" else None,
        "sim_link_gbps": _select(cfg, "sim.link_gbps") if device == "sim" else None,
    }
    return {k: v for k, v in out.items() if v is not None}


def _train_samples(summary: Summary, cfg: Any) -> int | None:
    """One epoch's training samples: the summary's count when it has one, else the synthetic task's size."""
    v = summary.config.train_samples
    if isinstance(v, int) and v > 0:
        return v
    spec = TASKS.get(str(_select(cfg, "task.name"))) if cfg is not None else None
    if spec is None or not spec.generated:
        return None
    n, cap = _select(cfg, "task.num_train"), _select(cfg, "task.max_train_samples")
    if not isinstance(n, int):
        return None
    return min(n, cap) if isinstance(cap, int) else n


def _precision(name: str | None, mode: str | None) -> str | None:
    """``mixed`` is the mode's own mixed precision (the registry says which)."""
    if name is None or mode is None:
        return name
    return effective_precision(mode, name)
