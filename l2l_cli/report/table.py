"""The report's tables: the papers' columns for people (rich, markdown) and every raw number for tools (CSV).

Display cells are rounded; the CSV holds the run files' values unchanged, so a check against the run
directories compares exact numbers.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from l2l_cli.data.tasks import TASKS, counts_tokens
from l2l_cli.report.runs import Run
from l2l_cli.runfiles import BACKGROUND_PHASES, OTHER, PHASES

DASH = "-"


@dataclass
class Column:
    header: str
    cell: Callable[[Run], str]
    numeric: bool = True


def fmt_count(n: int | None) -> str:
    """Parameters the way the papers write them: 300M, 1.2B (three significant digits)."""
    if n is None:
        return DASH
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def memory_unit(runs: list[Run]) -> tuple[str, float]:
    """One unit for the whole MEMORY column (GiB once any run reaches 1 GiB, else MiB), so rows compare."""
    peaks = [r.peak_bytes for r in runs if r.peak_bytes is not None]
    return ("GiB", 2**30) if peaks and max(peaks) >= 2**30 else ("MiB", 2**20)


def _int(v: Any) -> str:
    return DASH if v is None else str(v)


def _varies(runs: list[Run], key: str) -> bool:
    return len({r.get(key) for r in runs}) > 1


def eval_metrics(runs: list[Run]) -> list[str]:
    names: list[str] = []
    for r in runs:
        for k in r.summary.eval if r.ok else {}:
            if k not in names:
                names.append(k)
    return names


def note(run: Run) -> str:
    """The error's first sentence (the report's last section has it whole)."""
    if run.ok:
        return ""
    first = (run.error or "").strip().splitlines()[0] if (run.error or "").strip() else ""
    first = first.split(". ")[0].rstrip(".")
    return f"{run.status}: {first}" if first else run.status


def columns(runs: list[Run]) -> list[Column]:
    """The papers' columns, plus the ones these runs need (task, eval metrics, epoch time, a note)."""
    unit, div = memory_unit(runs)

    def throughput(r: Run) -> str:
        return DASH if r.throughput is None else f"{r.throughput:.2f}"

    def memory(r: Run) -> str:
        if r.status == "oom":
            return "OOM"
        if r.status == "error":
            return "ERROR"
        return DASH if r.peak_bytes is None else f"{r.peak_bytes / div:.{2 if unit == 'GiB' else 1}f}"

    cols = [
        Column("RUN", lambda r: r.name, numeric=False),
        Column("METHOD", lambda r: str(r.get("method") or DASH), numeric=False),
        Column("PRECISION", lambda r: str(r.get("precision") or DASH), numeric=False),
        Column("UBATCH SIZE", lambda r: _int(r.get("ubatch_size"))),
        Column("#UBATCHES", lambda r: _int(r.get("num_ubatches"))),
        Column("DEVICE BATCH SIZE", lambda r: _int(r.get("batch_size"))),
    ]
    if any((r.summary.world_size or 1) > 1 for r in runs):
        cols.append(Column("TOTAL BATCH SIZE", lambda r: _int(r.get("global_batch_size"))))
    if any(r.pipeline for r in runs):  # layered-GA §4: the layout and its bubble, measured vs appendix C
        cols += [
            Column("PIPELINE", lambda r: _int(r.pipeline.get("pipeline"))),
            Column("PLACEMENT", lambda r: str(r.pipeline.get("placement") or DASH), numeric=False),
            Column("SCHEDULE", lambda r: str(r.pipeline.get("schedule") or DASH), numeric=False),
            Column("BUBBLE (%)", lambda r: _pct(r.pipeline.get("bubble_measured"))),
            Column("PREDICTED (%)", lambda r: _pct(r.pipeline.get("bubble_predicted"))),
        ]
    cols += [
        Column("#LAYER", lambda r: _int(r.get("num_layers"))),
        Column("#PARAMETERS", lambda r: fmt_count(r.params)),
    ]
    if _varies(runs, "hidden_size"):
        cols.append(Column("HIDDEN SIZE", lambda r: _int(r.get("hidden_size"))))
    if _varies(runs, "seq_len"):
        cols.append(Column("SEQ LEN", lambda r: _int(r.get("seq_len"))))
    if _varies(runs, "task") or any(r.get("task") and not _generated(r.get("task")) for r in runs):
        cols.append(Column("TASK", lambda r: str(r.get("task") or DASH), numeric=False))
    cols += [Column("THROUGHPUT (SAMPLES/S)", throughput)]
    if any(counts_tokens(r.get("task")) for r in runs):  # a language model's throughput is in tokens

        def tokens(r: Run) -> str:
            v = r.summary.tokens_per_s if r.ok else None
            return DASH if not v else f"{v:.0f}"

        cols.append(Column("THROUGHPUT (TOKENS/S)", tokens))
    cols += [Column(f"MEMORY ({unit})", memory)]
    for m in eval_metrics(runs) if _evals_tell(runs) else []:
        if m in RAW_METRICS:  # not fractions: shown as they are
            cols.append(Column(m.upper(), lambda r, m=m: _raw(r.summary.eval.get(m))))
        else:
            cols.append(Column(f"{m.upper()} (%)", lambda r, m=m: _pct(r.summary.eval.get(m))))
    if any(hidden_share(r) is not None for r in runs):
        cols.append(Column("OPTIMIZER HIDDEN (%)", lambda r: _pct(hidden_share(r))))
    if _epoch_study(runs):
        cols.append(
            Column("EPOCH TIME (S)", lambda r: DASH if r.epoch_time_s is None else f"{r.epoch_time_s:.1f}")
        )
    if any(not r.ok for r in runs):
        cols.append(Column("NOTE", note, numeric=False))
    return cols


def hidden_share(run: Run) -> float | None:
    """Share of the host update the compute thread neither ran nor waited for (summary's ``optimizer``
    section: 1 - optimizer_exposed_s / optimizer_s; runs with an EPS)."""
    v = run.summary.sections.get("optimizer", {}).get("hidden_share") if run.ok else None
    return float(v) if isinstance(v, int | float) else None


def _evals_tell(runs: list[Run]) -> bool:
    """Whether eval columns belong in the table: a real task, or a synthetic one trained for an epoch
    (after a few steps of a memory or speed study its accuracy is noise; report.csv keeps it anyway)."""
    for r in runs:
        if r.get("task") not in (None, "synthetic"):
            return True
        steps, batch = r.summary.steps or 0, r.get("global_batch_size") or r.get("batch_size") or 0
        if r.train_samples and steps * batch >= r.train_samples:
            return True
    return False


def _epoch_study(runs: list[Run]) -> bool:
    """Whether time per epoch tells something here: one method timed at several batch sizes (v1 Figure 5)."""
    sizes: dict[Any, set[Any]] = {}
    for r in runs:
        if r.epoch_time_s:
            sizes.setdefault(r.get("method"), set()).add(r.get("batch_size"))
    return any(len(s) > 1 for s in sizes.values())


RAW_METRICS = ("loss", "perplexity")  # eval metrics that are not fractions (task=lm)


def _pct(v: Any) -> str:
    return f"{100 * v:.2f}" if isinstance(v, int | float) else DASH


def _raw(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, int | float) else DASH


def rows(runs: list[Run], cols: list[Column]) -> list[list[str]]:
    return [[c.cell(r) for c in cols] for r in runs]


def breakdown_columns(runs: list[Run]) -> list[str]:
    phases: list[str] = []
    for r in runs:
        for p in r.breakdown:
            if p not in phases:
                phases.append(p)
    known = (*PHASES, OTHER)
    return [p for p in known if p in phases] + [p for p in phases if p not in known]


def breakdown_rows(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    """Per ok run: milliseconds per step in each phase and its share of the step (L2L v1 Figure 6)."""
    phases = breakdown_columns(runs)
    header = ["RUN", "METHOD", *[p.upper() for p in phases], "STEP (MS)"]
    out = []
    for r in runs:
        b = r.breakdown
        if not b:
            continue
        total = sum(v for k, v in b.items() if k not in BACKGROUND_PHASES)  # the step's critical path
        cells = [
            DASH
            if p not in b or total <= 0
            else f"{1e3 * b[p]:.1f} (bg)"
            if p in BACKGROUND_PHASES
            else f"{1e3 * b[p]:.1f} ({100 * b[p] / total:.0f}%)"
            for p in phases
        ]
        out.append([r.name, str(r.get("method") or DASH), *cells, f"{1e3 * total:.1f}"])
    return header, out


# --------------------------------------------------------------------------------------------------
# Markdown and CSV


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def md_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


CONFIG_FIELDS = (
    "method",
    "mode",
    "stash",
    "precision",
    "model",
    "task",
    "num_layers",
    "hidden_size",
    "seq_len",
    "ubatch_size",
    "num_ubatches",
    "batch_size",
    "global_batch_size",
)

CSV_FIELDS = [
    "run",
    "dir",
    "status",
    "error",
    *CONFIG_FIELDS,
    "world_size",
    "params",
    "samples_per_s",
    "tokens_per_s",
    "step_time_s",
    "device_peak_bytes",
    "device_budget_bytes",
    "host_bytes",
    "h2d_bytes",
    "d2h_bytes",
    "train_samples",
    "epoch_time_s",
    "steps",
    "final_loss",
    "skipped_steps",
    "wall_time_s",
    "device",
    "optimizer_s",
    "optimizer_exposed_s",
    "optimizer_hidden_share",
    "rollbacks",
    "wall_time_s",
    "device",
    "pipeline",
    "data_parallel",
    "placement",
    "schedule",
    "bubble_measured",
    "bubble_predicted",
    "bubble_predicted_paper",
]
PIPELINE_FIELDS = (
    "pipeline",
    "data_parallel",
    "placement",
    "schedule",
    "bubble_measured",
    "bubble_predicted",
    "bubble_predicted_paper",
)


def csv_record(r: Run, metrics: list[str], phases: list[str]) -> dict[str, Any]:
    """Every number of one run, as the run files hold it."""
    s, cfg, mem = r.summary, r.config, r.memory
    rec: dict[str, Any] = {
        "run": r.name,
        "dir": str(r.dir),
        "status": r.status,
        "error": r.error,
        **{k: cfg.get(k) for k in CONFIG_FIELDS},
        "world_size": s.world_size,
        "params": s.params,
        "samples_per_s": s.samples_per_s,
        "tokens_per_s": s.tokens_per_s,
        "step_time_s": s.step_time_s,
        "device_peak_bytes": s.device_peak_bytes,
        "device_budget_bytes": r.budget_bytes,
        "host_bytes": mem.host.bytes if mem else None,
        "h2d_bytes": mem.transfer.h2d_bytes if mem else None,
        "d2h_bytes": mem.transfer.d2h_bytes if mem else None,
        "train_samples": r.train_samples,
        "epoch_time_s": r.epoch_time_s,
        "steps": s.steps,
        "final_loss": s.final_loss,
        "skipped_steps": s.skipped_steps,
        "wall_time_s": s.wall_time_s,
        "device": s.device or cfg.get("device"),
        "optimizer_s": s.sections.get("optimizer", {}).get("optimizer_s"),
        "optimizer_exposed_s": s.sections.get("optimizer", {}).get("optimizer_exposed_s"),
        "optimizer_hidden_share": s.sections.get("optimizer", {}).get("hidden_share"),
        "rollbacks": s.sections.get("l2l_p", {}).get("rollbacks"),
        **{k: r.pipeline.get(k) for k in PIPELINE_FIELDS},
    }
    for m in metrics:
        rec[f"eval_{m}"] = s.eval.get(m)
    for p in phases:
        rec[f"time_{p}_s"] = s.time_breakdown_s.get(p)
    rec["overrides"] = " ".join(r.overrides)
    return rec


def write_csv(path: Path, runs: list[Run]) -> None:
    metrics, phases = eval_metrics(runs), breakdown_columns(runs)
    fields = [*CSV_FIELDS, *(f"eval_{m}" for m in metrics), *(f"time_{p}_s" for p in phases), "overrides"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in runs:
            w.writerow({k: ("" if v is None else v) for k, v in csv_record(r, metrics, phases).items()})


def _generated(task: str) -> bool:
    spec = TASKS.get(task)
    return spec is not None and spec.generated
