"""What a user watches during a run: a rich progress bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from l2l_cli.profiling.memory import fmt_bytes

console = Console(stderr=False, highlight=False)


class RunProgress:
    """Step, loss, samples/s and device memory, live. ``style``: rich | plain | none | auto (rich on a TTY)."""

    def __init__(self, style: str, total: int, title: str, enabled: bool = True):
        if style == "auto":
            style = "rich" if sys.stdout.isatty() else "plain"
        self.style = style if enabled else "none"
        self.total = total
        self.title = title
        self._bar: Progress | None = None
        self._task: Any = None
        self._last_print = 0.0
        self.every = max(1, total // 10)

    def __enter__(self) -> RunProgress:
        if self.style == "rich":
            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(
                    "loss {task.fields[loss]}  {task.fields[sps]} samples/s  device {task.fields[mem]}"
                ),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
                transient=False,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.title, total=self.total, loss="-", sps="-", mem="-")
        elif self.style == "plain":
            console.print(f"{self.title}: {self.total} steps")
        return self

    def update(self, step: int, loss: float, samples_per_s: float, device_bytes: int, note: str = "") -> None:
        mem = fmt_bytes(device_bytes)
        if self._bar is not None:
            self._bar.update(
                self._task, completed=step, loss=f"{loss:.4f}", sps=f"{samples_per_s:.1f}", mem=mem
            )
        elif self.style == "plain" and (step % self.every == 0 or step == self.total or step == 1):
            now = time.perf_counter()
            console.print(
                f"step {step}/{self.total}  loss {loss:.4f}  {samples_per_s:.1f} samples/s  device {mem}{note}"
            )
            self._last_print = now

    def note(self, msg: str) -> None:
        if self.style != "none":
            console.print(msg)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)


def summary_table(summary: dict[str, Any]) -> Table:
    t = Table(title=f"l2l run: {summary.get('status')}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    cfg = summary.get("config", {})
    rows = [
        ("mode", f"{cfg.get('method')}  ({cfg.get('precision')}, device {summary.get('device')})"),
        (
            "model",
            f"{cfg.get('model')}: {cfg.get('num_layers')} layers, {summary.get('params', 0) / 1e6:.2f}M params",
        ),
        ("batch", f"{cfg.get('batch_size')} = {cfg.get('num_ubatches')} x ubatch {cfg.get('ubatch_size')}"),
        ("steps", f"{summary.get('steps')}  (skipped {summary.get('skipped_steps', 0)})"),
        ("final loss", f"{summary['final_loss']:.4f}" if summary.get("final_loss") is not None else "-"),
        ("throughput", f"{summary.get('samples_per_s', 0):.1f} samples/s"),
        ("device peak", fmt_bytes(summary.get("device_peak_bytes", 0))),
    ]
    phases = summary.get("time_breakdown_s") or {}
    if phases:
        rows.append(("time per step", "  ".join(f"{k} {v * 1e3:.1f}ms" for k, v in phases.items())))
    for name, value in (summary.get("eval") or {}).items():
        rows.append((f"eval {name}", f"{value:.4f}"))
    if summary.get("error"):
        rows.append(("error", summary["error"]))
    rows.append(("run dir", summary.get("run_dir", "")))
    for k, v in rows:
        t.add_row(k, str(v))
    return t
