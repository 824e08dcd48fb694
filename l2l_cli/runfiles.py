"""The run directory's files as types: ``summary.json``, ``memory.json`` and ``metrics.jsonl`` rows.

The trainer writes them and ``l2l report`` / ``l2l plan`` read them through these dataclasses, so a field
has one name in one place. ``schema_version`` is 2 since the files became typed; a file without it is
version 1 (written before), which had the same fields and is read the same way.

Modes add their own sections (``pipeline``, ``l2l_p``, ...) as ``Summary.sections``: a dict per name,
written as a top-level object of that name, so a reader finds ``summary["pipeline"]["bubble_measured"]``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 2

# The phases of a step, in the papers' order (L2L v1 Figure 6); "other" is the step's remainder. "bubble": a
# pipeline rank's time inside the schedule not computing (fill, drain, waits on its neighbours).
PHASES = ("forward", "recompute", "backward", "optimizer", "transfer", "reduce", "disk_wait", "bubble")
OTHER = "other"
# Seconds of work on background threads (the disk EPS's reader and writer): reported beside the phases,
# but not part of the step's critical path (their exposed part is ``disk_wait``), so never in "other".
BACKGROUND_PHASES = ("disk_read", "disk_write")
STATUSES = ("ok", "oom", "error", "interrupted")


def _known(cls: type, obj: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``obj`` into the dataclass's own fields and the rest."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in obj.items() if k in names}, {k: v for k, v in obj.items() if k not in names}


@dataclass
class RunConfig:
    """``summary.config``: what the run was (the papers' table columns and what identifies a row)."""

    method: str | None = None  # the papers' METHOD: baseline, baseline-ag, l2l, l2l-p[-stash-cpu]
    mode: str | None = None
    stash: str | None = None
    precision: str | None = None  # mixed resolved to the mode's own
    model: str | None = None  # model.name, or pretrained:<ref>
    family: str | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    ubatch_size: int | None = None
    num_ubatches: int | None = None
    batch_size: int | None = None
    global_batch_size: int | None = None
    seq_len: int | None = None
    task: str | None = None
    data_source: str | None = None
    train_samples: int | None = None
    optimizer: str | None = None
    clip: str | None = None
    device: str | None = None
    sim_memory_gb: float | None = None
    sim_link_gbps: float | None = None
    eps_tier: str | None = None  # the L2L modes: host | disk (eps.tier)

    @classmethod
    def from_json(cls, obj: dict[str, Any] | None) -> RunConfig:
        known, _ = _known(cls, obj or {})
        return cls(**known)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def get(self, key: str) -> Any:
        return getattr(self, key, None)


_OPTIONAL = ("error", "exit_code", "resume_with", "resumed_from", "rank0_error")  # omitted when unset


@dataclass
class Summary:
    """``summary.json``: how the run ended and its headline numbers."""

    status: str = "error"  # ok | oom | error | interrupted
    run_dir: str = ""
    steps: int = 0
    device: str | None = None
    world_size: int = 1
    config: RunConfig = field(default_factory=RunConfig)
    params: int | None = None
    skipped_steps: int = 0
    final_loss: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None  # non-padding tokens per second (a language model's throughput)
    step_time_s: float | None = None
    time_breakdown_s: dict[str, float] = field(default_factory=dict)  # mean seconds per step and phase
    eval: dict[str, float] = field(default_factory=dict)
    device_peak_bytes: int = 0
    # the EPS's host bytes of training state (master, gradient, optimizer state; its RAM cache on the disk
    # tier), measured from its tensors, per parameter of the model; None: no EPS (state on the device)
    host_bytes_per_param: float | None = None
    wall_time_s: float | None = None
    error: str | None = None
    exit_code: int | None = None
    resume_with: str | None = None
    resumed_from: dict[str, Any] | None = None
    rank0_error: str | None = None
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)  # mode-owned: pipeline, l2l_p, ...
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema_version": self.schema_version}
        for f in fields(self):
            if f.name in ("schema_version", "sections"):
                continue
            value = getattr(self, f.name)
            if f.name in _OPTIONAL and value is None:
                continue
            out[f.name] = value.to_json() if isinstance(value, RunConfig) else value
        for name, section in self.sections.items():
            out[name] = section
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Summary:
        """A summary of any schema version (1: no ``schema_version`` key, same fields)."""
        known, rest = _known(cls, obj)
        known.pop("sections", None)
        known["config"] = RunConfig.from_json(known.get("config"))
        known["schema_version"] = int(obj.get("schema_version", 1))
        for k in ("time_breakdown_s", "eval"):
            if not isinstance(known.get(k), dict):
                known[k] = {}
        s = cls(**known)
        s.sections = {k: v for k, v in rest.items() if isinstance(v, dict)}
        return s

    @property
    def code(self) -> str:
        """What the job reports to the CLI: its status, ``config`` for bad input, ``interrupted:<signal>``."""
        if self.exit_code == 2:
            return "config"
        if self.status == "interrupted":
            return f"interrupted:{(self.exit_code or 143) - 128}"
        return self.status


@dataclass
class DeviceMemory:
    peak_bytes: int = 0
    method: str = "none"  # how it was measured (cuda_allocator_max_memory_allocated, ...)
    parts: dict[str, int] = field(default_factory=dict)  # breakdown at the peak
    kind: str | None = None  # cpu | cuda | sim
    budget_bytes: int | None = None  # device=sim's, or device.memory_gb's
    note: str | None = None  # how the peak was taken, when worth saying (sampled windows)


@dataclass
class HostMemory:
    bytes: int = 0  # host-tier state (EPS buffers, CPU stash)
    parts: dict[str, int] = field(default_factory=dict)
    peak_rss_bytes: int | None = None


# memory.json's host parts that are training state (what ``host_bytes_per_param`` counts): the EPS's
# master, gradient and optimizer state, a frozen base it keeps, and the disk tier's RAM cache of them
HOST_STATE_PARTS = ("master", "grads", "optimizer_state", "frozen_base", "eps_cache", "eps_grad_pool")


def host_bytes_per_param(parts: dict[str, int], params: int | None) -> float | None:
    """Host bytes of training state (:data:`HOST_STATE_PARTS` of memory.json's host parts) per parameter;
    None where the runner keeps none on the host or the parameter count is unknown."""
    held = sum(parts.get(k, 0) for k in HOST_STATE_PARTS)
    return held / params if held and params else None


@dataclass
class Transfer:
    h2d_bytes: int = 0
    d2h_bytes: int = 0


@dataclass
class MemoryReport:
    """``memory.json``: the device-tier peak and its parts, host-tier bytes, bytes over the link."""

    device: DeviceMemory = field(default_factory=DeviceMemory)
    host: HostMemory = field(default_factory=HostMemory)
    transfer: Transfer = field(default_factory=Transfer)
    ranks: list[dict[str, Any]] | None = None  # data parallel: every rank's own report, gathered on rank 0
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema_version": self.schema_version}
        device = asdict(self.device)
        for key in ("budget_bytes", "note"):
            if device[key] is None:
                del device[key]
        out.update(device=device, host=asdict(self.host), transfer=asdict(self.transfer))
        if self.ranks is not None:
            out["ranks"] = self.ranks
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> MemoryReport:
        def part(kind: type, key: str) -> Any:
            raw = obj.get(key)
            return kind(**_known(kind, raw)[0]) if isinstance(raw, dict) else kind()

        ranks = obj.get("ranks")
        return cls(
            part(DeviceMemory, "device"),
            part(HostMemory, "host"),
            part(Transfer, "transfer"),
            ranks if isinstance(ranks, list) else None,
            int(obj.get("schema_version", 1)),
        )


@dataclass
class MetricsRow:
    """One line of ``metrics.jsonl``: a logged optimizer step. ``extra`` holds the runner's own numbers
    (``eps_background_s``, ``realtime_ckpt_s``, ...), written as top-level keys."""

    step: int
    loss: float | None = None
    lr: float | None = None
    samples_per_s: float | None = None
    step_time_s: float | None = None
    device_peak_bytes: int | None = None
    device_bytes: int | None = None
    skipped: bool = False
    grad_norm: float | None = None
    loss_scale: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float | None = None  # non-padding tokens per second
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**out, **self.extra}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> MetricsRow:
        known, rest = _known(cls, obj)
        known.pop("extra", None)
        return cls(**known, extra=rest)


# ---- reading and writing ----------------------------------------------------------------------------


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Replace ``path`` atomically (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(object, None), (None, None) when absent, or (None, problem) when unreadable."""
    if not path.is_file():
        return None, None
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"unreadable {path.name} ({e})"
    return (obj, None) if isinstance(obj, dict) else (None, f"unreadable {path.name} (not an object)")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One object per line; a torn last line (a run killed mid-write) is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def read_metrics(path: Path) -> list[MetricsRow]:
    return [MetricsRow.from_json(o) for o in read_jsonl(path) if isinstance(o.get("step"), int)]


def finite(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None
