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

from l2l_cli.data.tasks import counts_tokens
from l2l_cli.profiling.memory import fmt_bytes
from l2l_cli.runfiles import BACKGROUND_PHASES, Summary

console = Console(stderr=False, highlight=False)


class RunProgress:
    """Step, loss, samples/s and device memory, live. ``style``: rich | plain | none | auto (rich on a
    TTY)."""

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
        self._eval_task: Any = None
        self._eval_t0 = 0.0

    def __enter__(self) -> RunProgress:
        if self.style == "rich":
            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
                transient=False,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.title, total=self.total, info="")
        elif self.style == "plain":
            console.print(f"{self.title}: {self.total} steps", soft_wrap=True, markup=False)
        return self

    def update(self, step: int, loss: float, samples_per_s: float, device_bytes: int, note: str = "") -> None:
        mem = fmt_bytes(device_bytes)
        if self._bar is not None:
            info = f"loss {loss:.4f}  {samples_per_s:.1f} samples/s  device {mem}"
            self._bar.update(self._task, completed=step, info=info)
        elif self.style == "plain" and (step % self.every == 0 or step == self.total or step == 1):
            now = time.perf_counter()
            console.print(
                f"step {step}/{self.total}  loss {loss:.4f}  {samples_per_s:.1f} samples/s  device "
                f"{mem}{note}",
                soft_wrap=True,
            )
            self._last_print = now

    def note(self, msg: str) -> None:
        if self.style != "none":
            console.print(msg, soft_wrap=True, markup=False)  # one line, as train.log has it

    def eval_update(self, done: int, total: int) -> None:
        """Evaluation progress in dev batches: a second bar under the training one, or plain lines."""
        if done <= 1:
            self._eval_t0 = time.perf_counter()
        if self._bar is not None:
            if self._eval_task is None:
                self._eval_task = self._bar.add_task("eval", total=total, info="dev batches")
            if done <= 1:
                self._bar.reset(self._eval_task, total=total)
            self._bar.update(self._eval_task, completed=done)
        elif self.style == "plain" and (done == total or done % max(1, total // 4) == 0):
            console.print(
                f"eval {done}/{total} batches  {time.perf_counter() - self._eval_t0:.1f} s", soft_wrap=True
            )

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)


def summary_text(summary: Summary) -> str:
    """The summary table as plain text (for train.log)."""
    import io

    buf = io.StringIO()
    Console(file=buf, width=110, color_system=None, highlight=False).print(summary_table(summary))
    return buf.getvalue().rstrip()


def summary_table(summary: Summary) -> Table:
    t = Table(title=f"l2l run: {summary.status}", show_header=False, title_justify="left")
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    cfg = summary.config
    rows = [
        ("mode", f"{cfg.method}  ({cfg.precision}, device {summary.device})"),
        ("model", f"{cfg.model}: {cfg.num_layers} layers, {(summary.params or 0) / 1e6:.2f}M params"),
        ("task", f"{cfg.task}  ({cfg.data_source}, {cfg.train_samples} training examples)"),
        ("batch", f"{cfg.batch_size} = {cfg.num_ubatches} x ubatch {cfg.ubatch_size}"),
        ("steps", f"{summary.steps}  (skipped {summary.skipped_steps})"),
        ("final loss", f"{summary.final_loss:.4f}" if summary.final_loss is not None else "-"),
        (
            "throughput",
            f"{summary.samples_per_s or 0:.1f} samples/s"
            + (
                f", {summary.tokens_per_s:.0f} tokens/s"
                if counts_tokens(cfg.task) and summary.tokens_per_s
                else ""
            ),
        ),
        ("device peak", fmt_bytes(summary.device_peak_bytes)),
    ]
    if summary.host_bytes_per_param is not None:
        opt = f", {cfg.optimizer}" if cfg.optimizer else ""
        rows.append(
            ("host state", f"{summary.host_bytes_per_param:.2f} B/param (master, gradient, optimizer{opt})")
        )
    if summary.time_breakdown_s:
        on_path = {k: v for k, v in summary.time_breakdown_s.items() if k not in BACKGROUND_PHASES}
        rows.append(("time per step", "  ".join(f"{k} {v * 1e3:.1f}ms" for k, v in on_path.items())))
    disk = summary.sections.get("eps_disk")
    if disk:
        gbps = "  ".join(
            f"{k} {disk[f'{k}_gbps']:.2f} GB/s" for k in ("read", "write") if disk.get(f"{k}_gbps")
        )
        hidden = disk.get("hidden_share")
        rb, wb = disk.get("read_bytes_per_param_step"), disk.get("write_bytes_per_param_step")
        per = f" = {rb:.1f} + {wb:.1f} B/param/step" if rb is not None and wb is not None else ""
        rows.append(
            (
                "disk EPS",
                f"{fmt_bytes(disk['read_bytes'])} read, {fmt_bytes(disk['write_bytes'])} written{per} "
                f"({gbps}); "
                f"{'-' if hidden is None else f'{100 * hidden:.0f}%'} of it hidden behind compute; "
                f"{disk['host_cache_layers']} layers in RAM",
            )
        )
    pipe = summary.sections.get("pipeline")
    if pipe and pipe.get("bubble_measured") is not None:  # layered-GA §4: measured vs appendix C
        rows.append(
            (
                "pipeline",
                f"{pipe['data_parallel']} x {pipe['pipeline']} ranks, {pipe['placement']} "
                f"{pipe['schedule']}: bubble {pipe['bubble_measured']:.1%} (predicted "
                f"{pipe['bubble_predicted']:.1%} "
                f"counting the schedule's actions and messages, {pipe['bubble_predicted_paper']:.1%} the "
                "paper's)",
            )
        )
    for name, value in summary.eval.items():
        rows.append((f"eval {name}", f"{value:.4f}"))
    rows.append(("run dir", summary.run_dir))
    for k, v in rows:
        t.add_row(k, str(v))
    return t
