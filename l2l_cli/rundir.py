"""Writing the run directory: JSON files replaced atomically, JSON-lines appended, on rank 0 only; and the
loggers the trainer reports each step and evaluation to (``metrics.jsonl`` and ``eval.jsonl`` here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from l2l_cli.schema import MetricsRow, write_json


class RunFiles:
    """Writers for the run directory's files (no-ops on ranks other than 0)."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.dir = run_dir
        self.enabled = enabled
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)

    def append(self, name: str, record: dict[str, Any]) -> None:
        if self.enabled:
            with (self.dir / name).open("a") as f:
                f.write(json.dumps(record) + "\n")

    def write(self, name: str, obj: dict[str, Any]) -> None:
        if self.enabled:
            write_json(self.dir / name, obj)

    def truncate(self, name: str, step: int) -> None:
        """Drop the records after ``step`` (a resumed run's logs continue from its checkpoint)."""
        path = self.dir / name
        if self.enabled and path.exists():
            keep = [
                ln for ln in path.read_text().splitlines() if ln and json.loads(ln).get("step", 0) <= step
            ]
            path.write_text("".join(f"{ln}\n" for ln in keep))


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
