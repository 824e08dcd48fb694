"""Writing the run directory: JSON files replaced atomically, JSON-lines appended, on rank 0 only; and the
loggers the trainer reports each step and evaluation to (``metrics.jsonl`` and ``eval.jsonl`` here)."""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from l2l_cli.problems import writing
from l2l_cli.runfiles import MetricsRow, write_json

log = logging.getLogger("l2l")

# what a run leaves in its directory: a directory holding any of them belongs to that run
RUN_MARKERS = (
    ".hydra",
    "metrics.jsonl",
    "eval.jsonl",
    "summary.json",
    "memory.json",
    "checkpoints",
    "final",
    "train.log",
)


def run_markers(path: Path) -> list[str]:
    """The run files ``path`` already holds (empty: a new or empty directory a run may take)."""
    return [name for name in RUN_MARKERS if (path / name).exists()]


class RunFiles:
    """Writers for the run directory's files (no-ops on ranks other than 0)."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.dir = run_dir
        self.enabled = enabled
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)

    def append(self, name: str, record: dict[str, Any]) -> None:
        if self.enabled:
            with writing(self.dir / name), (self.dir / name).open("a") as f:
                f.write(json.dumps(record) + "\n")

    def write(self, name: str, obj: dict[str, Any]) -> None:
        if self.enabled:
            with writing(self.dir / name):
                write_json(self.dir / name, obj)

    def write_text(self, name: str, text: str) -> None:
        if self.enabled:
            path = self.dir / name
            tmp = path.with_name(f".{path.name}.tmp")
            with writing(path):
                tmp.write_text(text)
                tmp.replace(path)

    def truncate(self, name: str, step: int) -> None:
        """Drop the records after ``step`` (a resumed run's logs continue from its checkpoint). A line that
        is not a whole record (an append the disk filled, a kill cut short) is dropped with a warning
        naming the file and line: it never blocks the resume."""
        path = self.dir / name
        if not (self.enabled and path.exists()):
            return
        keep, torn = [], []
        for n, ln in enumerate(path.read_bytes().decode("utf-8", "replace").splitlines(), 1):
            try:
                record = json.loads(ln) if ln.strip() else None
            except ValueError:
                record = None
            if not isinstance(record, dict):
                if ln.strip():
                    torn.append(n)
                continue
            if record.get("step", 0) <= step:
                keep.append(ln)
        if torn:
            lines = ", ".join(map(str, torn))
            msg = f"{path}: dropped {len(torn)} line(s) that are not whole records (line {lines})"
            log.warning("%s", msg)
            print(f"l2l: warning: {msg}", file=sys.stderr, flush=True)
        self.write_text(name, "".join(f"{ln}\n" for ln in keep))


class Logger(Protocol):
    """Where the trainer reports: every logged step, every evaluation; ``close`` at the end of the run."""

    def log_step(self, row: MetricsRow) -> None: ...

    def log_eval(self, step: int, metrics: dict[str, float]) -> None: ...

    def resume_at(self, step: int) -> None: ...

    def close(self) -> None: ...


class JsonlLogger:
    """``metrics.jsonl`` (one :class:`MetricsRow` per logged step) and ``eval.jsonl``."""

    def __init__(self, files: RunFiles):
        self.files = files

    def log_step(self, row: MetricsRow) -> None:
        self.files.append("metrics.jsonl", row.to_json())

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.files.append("eval.jsonl", {"step": step, **metrics})

    def resume_at(self, step: int) -> None:
        for name in ("metrics.jsonl", "eval.jsonl"):
            self.files.truncate(name, step)

    def close(self) -> None:
        return None


# ---- experiment loggers (``logger=csv|tensorboard|wandb|none``, several as a list) ---------------------

METRIC_COLUMNS = (
    "step",
    "loss",
    "lr",
    "samples_per_s",
    "tokens_per_s",
    "step_time_s",
    "device_peak_bytes",
    "device_bytes",
    "skipped",
    "grad_norm",
    "loss_scale",
)


def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _plain(value: Any) -> Any:
    from omegaconf import ListConfig, OmegaConf

    return OmegaConf.to_container(value) if isinstance(value, ListConfig) else value


def logger_names(value: Any) -> list[str]:
    """``logger`` as a list of names: ``auto`` is csv and tensorboard (when installed), ``none`` nothing."""
    value = _plain(value)
    names = [value] if isinstance(value, str) else [str(v) for v in value or []]
    if names == ["auto"]:
        return ["csv", "tensorboard"] if installed("tensorboard") else ["csv"]
    return [n for n in names if n != "none"]


def logger_problems(value: Any) -> list[str]:
    """What is wrong with a ``logger`` value (empty: usable)."""
    value = _plain(value)
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, list | tuple) else None
    if names is None or not names or not all(isinstance(n, str) for n in names):
        return [
            f"got {value!r}; allowed: auto, one of {', '.join(LOGGERS)}, or a list such as [csv,tensorboard]"
        ]
    if names == ["auto"]:
        return []
    out = [f"got {n!r}; allowed: auto, {', '.join(LOGGERS)}" for n in names if n not in LOGGERS]
    if "none" in names and len(names) > 1:
        out.append(f"got {names}: none cannot be combined with other loggers")
    if len(set(names)) < len(names):
        out.append(f"got {names}: a logger is named twice")
    for name, module, pip in (("tensorboard", "tensorboard", "tensorboard"), ("wandb", "wandb", "wandb")):
        if name in names and not installed(module):
            out.append(f"{name} is not installed (pip install {pip}); choose csv or none, or install it")
    return out


def make_loggers(value: Any, files: RunFiles, cfg: Any = None) -> list[Logger]:
    """The loggers ``logger`` names (train.log's text logger always), writing into ``files``' run dir."""
    out: list[Logger] = [TextLogger()]
    for name in logger_names(value):
        if name in LOGGER_KINDS:  # "none": the text logger alone
            out.append(LOGGER_KINDS[name](files, cfg))
    return out


class TextLogger:
    """train.log: every skipped step (a warning) and every evaluation; the trainer logs saves, the
    session the run's header and its summary."""

    def __init__(self) -> None:
        import logging

        self.log = logging.getLogger("l2l")

    def log_step(self, row: MetricsRow) -> None:
        if row.skipped:
            self.log.warning(
                "step %d skipped: non-finite loss or gradients (loss %s, loss scale %s); no update applied",
                row.step,
                row.loss,
                row.loss_scale,
            )

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        return None  # the trainer logs each evaluation with its duration

    def resume_at(self, step: int) -> None:
        self.log.info("logs continue from step %d", step)

    def close(self) -> None:
        return None


class CsvLogger:
    """``metrics.csv`` (a row per logged step: the metrics.jsonl fields, phases as ``time_<phase>_s``) and
    ``eval.csv``. Columns are fixed by the first row; keys a later row adds are left out (metrics.jsonl
    has them all)."""

    def __init__(self, files: RunFiles):
        self.files = files
        self._columns: dict[str, list[str]] = {}

    def _row(self, name: str, record: dict[str, Any]) -> None:
        import csv

        if not self.files.enabled:
            return
        path = self.files.dir / name
        if name not in self._columns:
            if path.exists() and path.stat().st_size:  # resumed: keep the file's own columns
                with path.open(newline="") as f:
                    self._columns[name] = next(csv.reader(f), []) or list(record)
            else:
                self._columns[name] = list(record)
                with path.open("w", newline="") as f:
                    csv.writer(f).writerow(self._columns[name])
        with writing(path), path.open("a", newline="") as f:
            csv.writer(f).writerow(
                ["" if record.get(c) is None else record.get(c) for c in self._columns[name]]
            )

    def log_step(self, row: MetricsRow) -> None:
        from l2l_cli.runfiles import PHASES

        record: dict[str, Any] = {c: getattr(row, c) for c in METRIC_COLUMNS}
        record.update(
            {f"time_{p}_s": row.phases.get(p) for p in (*PHASES, *sorted(set(row.phases) - set(PHASES)))}
        )
        record.update({k: v for k, v in sorted(row.extra.items()) if isinstance(v, int | float | str | bool)})
        self._row("metrics.csv", record)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        self._row("eval.csv", {"step": step, **metrics})

    def resume_at(self, step: int) -> None:
        import csv

        for name in ("metrics.csv", "eval.csv"):
            path = self.files.dir / name
            if not (self.files.enabled and path.exists()):
                continue
            with path.open(newline="") as f:
                rows = list(csv.reader(f))
            keep = rows[:1] + [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) <= step]
            with path.open("w", newline="") as f:
                csv.writer(f).writerows(keep)

    def close(self) -> None:
        return None


class TensorBoardLogger:
    """TensorBoard event files in ``<run dir>/tensorboard/``: ``train/*`` per logged step (loss, lr,
    samples_per_s, tokens_per_s, step_time_s, grad_norm, loss_scale, device_peak_bytes; a language model's
    perplexity), ``time/<phase>_s`` and
    ``eval/<metric>``. A resumed run purges the events after its checkpoint's step (TensorBoard's
    ``purge_step``), so the curves continue without a fold."""

    def __init__(self, files: RunFiles):
        self.files = files
        self.purge_step: int | None = None
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(
                log_dir=str(self.files.dir / "tensorboard"), purge_step=self.purge_step
            )
        return self._writer

    def log_step(self, row: MetricsRow) -> None:
        if not self.files.enabled:
            return
        w = self.writer
        for key in (
            "loss",
            "lr",
            "samples_per_s",
            "tokens_per_s",
            "step_time_s",
            "grad_norm",
            "loss_scale",
            "device_peak_bytes",
        ):
            value = getattr(row, key)
            if isinstance(value, int | float) and math.isfinite(value):
                w.add_scalar(f"train/{key}", value, row.step)
        perplexity = row.extra.get("perplexity")  # task=lm|chat: the step's loss as perplexity
        if isinstance(perplexity, int | float) and math.isfinite(perplexity):
            w.add_scalar("train/perplexity", perplexity, row.step)
        for phase, seconds in row.phases.items():
            w.add_scalar(f"time/{phase}_s", seconds, row.step)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        if not self.files.enabled:
            return
        for name, value in metrics.items():
            self.writer.add_scalar(f"eval/{name}", value, step)
        self.writer.flush()

    def resume_at(self, step: int) -> None:
        self.purge_step = step + 1

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def run_id(run_dir: Path) -> str:
    """A stable id per run dir: a resumed run continues its own wandb run, and no other."""
    import hashlib

    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]


class WandbLogger:
    """Weights & Biases (optional: ``pip install wandb``). Project from ``WANDB_PROJECT`` (default l2l), the
    run named after the run dir, its files under the run dir; ``WANDB_MODE=offline`` works as wandb's own."""

    def __init__(self, files: RunFiles, cfg: Any = None):
        self.files = files
        self.cfg = cfg
        self._run: Any = None

    @property
    def run(self) -> Any:
        if self._run is None:
            import os

            import wandb
            from omegaconf import OmegaConf

            config = OmegaConf.to_container(self.cfg, resolve=True) if self.cfg is not None else {}
            self._run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "l2l"),
                name=self.files.dir.name,
                dir=str(self.files.dir),
                config=config,
                resume="allow",
                id=run_id(self.files.dir),
            )
        return self._run

    def log_step(self, row: MetricsRow) -> None:
        if self.files.enabled:
            values = {f"train/{k}": v for k, v in row.to_json().items() if isinstance(v, int | float)}
            self.run.log(values, step=row.step)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        if self.files.enabled:
            self.run.log({f"eval/{k}": v for k, v in metrics.items()}, step=step)

    def resume_at(self, step: int) -> None:
        return None

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()


# logger=<name>: what each writes into the run dir (``none``: only train.log)
LOGGER_KINDS: dict[str, Callable[[RunFiles, Any], Logger]] = {
    "csv": lambda files, cfg: CsvLogger(files),
    "tensorboard": lambda files, cfg: TensorBoardLogger(files),
    "wandb": WandbLogger,
}
LOGGERS = (*LOGGER_KINDS, "none")
