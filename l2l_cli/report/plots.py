"""Plots (PNG at 200 dpi, and SVG beside each) of a set of runs: the papers' sweeps (memory and throughput
against depth, #ubatches, ubatch size and batch size), the time breakdown per phase (L2L v1 Figure 6), and
loss and eval curves.

A plot is drawn only when the runs hold what it shows (a sweep axis that varies within a series, a
breakdown, logged steps), so a report of one run is not padded with empty figures. Titles name what all
runs share (model, task, method); legends name what differs. Each series has its own colour, marker and
line style, so identical curves (L2L and its baseline, say) stay visible on top of each other.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.ticker import FixedLocator, MaxNLocator, NullLocator

from l2l_cli.report.runs import Run
from l2l_cli.report.table import breakdown_columns, memory_unit

# how a run is named in legends: the fields that differ between the runs of the report
LABEL_FIELDS = (
    ("method", "{}"),
    ("precision", "{}"),
    ("ubatch_size", "ub{}"),
    ("num_ubatches", "x{}"),
    ("batch_size", "b{}"),
    ("num_layers", "L{}"),
    ("hidden_size", "H{}"),
    ("seq_len", "S{}"),
    ("model", "{}"),
    ("task", "{}"),
    ("placement", "{}"),
    ("schedule", "{}"),
)
CONTEXT_FIELDS = ("model", "task", "method")  # in the titles when every run shares them
DPI = 200
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")

# sweep axis -> (axis label, file, fields that move with it and so do not split series)
SWEEPS = {
    "num_layers": ("#LAYER", "vs_depth.png", {"num_layers"}),
    "num_ubatches": ("#UBATCHES", "vs_num_ubatches.png", {"num_ubatches", "batch_size"}),
    "ubatch_size": ("UBATCH SIZE", "vs_ubatch_size.png", {"ubatch_size", "num_ubatches"}),
    "batch_size": ("DEVICE BATCH SIZE", "vs_batch_size.png", {"batch_size", "ubatch_size", "num_ubatches"}),
}
PHASE_COLORS = {
    "forward": "#4c72b0",
    "recompute": "#8172b3",
    "backward": "#55a868",
    "optimizer": "#c44e52",
    "transfer": "#dd8452",
    "reduce": "#937860",
    "bubble": "#da8bc3",
    "other": "#b0b0b0",
}


def varying(runs: list[Run]) -> list[str]:
    return [k for k, _ in LABEL_FIELDS if len({r.get(k) for r in runs}) > 1]


def short(key: str, value: Any) -> Any:
    """A field as a legend or title shows it: a checkpoint (``pretrained:/models/minilm``) by its folder's
    or hub id's last part, not its whole path."""
    if key == "model" and isinstance(value, str) and "/" in value:
        return value.removeprefix("pretrained:").rstrip("/").rsplit("/", 1)[-1]
    return value


def label(run: Run, fields: list[str]) -> str:
    """The run's legend entry: the fields that differ between runs (else its model, task and method)."""
    fmt = dict(LABEL_FIELDS)
    parts = [fmt[k].format(short(k, run.get(k))) for k in fields or CONTEXT_FIELDS if run.get(k) is not None]
    return " ".join(parts) or run.name


def outside_legend(ax: Axes) -> None:
    """The legend right of the plot, never over the curves."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False)


def context(runs: list[Run]) -> str:
    """What every run shares among model, task and method, for titles ("bert-tiny · rte · l2l")."""
    shared = []
    for k in CONTEXT_FIELDS:
        values = {r.get(k) for r in runs}
        if len(values) == 1 and None not in values:
            shared.append(str(short(k, next(iter(values)))))
    return " · ".join(shared)


def titled(what: str, runs: list[Run]) -> str:
    ctx = context(runs)
    return f"{what}\n{ctx}" if ctx else what


def style(i: int, points: int = 0) -> dict[str, Any]:
    """Series i's colour, marker and line style (all three differ between neighbours). Earlier series are
    drawn thicker with larger markers, odd ones hollow, and markers start at a different point per series,
    so a curve that coincides with another (L2L and its baseline, say) stays visible under it."""
    every = max(1, points // 12)
    return {
        "color": f"C{i % 10}",
        "marker": MARKERS[i % len(MARKERS)],
        "linestyle": LINESTYLES[i % len(LINESTYLES)],
        "markevery": (i % every, every),
        "markersize": max(4.0, 9.0 - 1.2 * i),
        "linewidth": max(1.0, 2.8 - 0.45 * i),
        "fillstyle": "none" if i % 2 else "full",
    }


def write_plots(runs: list[Run], out: Path) -> list[tuple[str, str]]:
    """Draw every plot these runs support into ``out``; returns (file name, caption) per plot written."""
    written: list[tuple[str, str]] = []
    for axis in SWEEPS:
        item = sweep_plot(runs, axis, out)
        if item:
            written.append(item)
    for fn in (pipeline_plot, breakdown_plot, loss_plot, eval_plot):
        item = fn(runs, out)
        if item:
            written.append(item)
    return written


def _save(fig: Any, path: Path, tight: bool = True) -> None:
    """PNG at 200 dpi, and the same figure as SVG beside it."""
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=DPI, bbox_inches="tight")  # (a legend outside the axes stays in the picture)
    with plt.rc_context({"svg.fonttype": "none"}):  # SVG text stays text (searchable, editable)
        fig.savefig(path.with_suffix(".svg"), bbox_inches="tight")
    plt.close(fig)


def _series(runs: list[Run], axis: str) -> dict[str, list[Run]]:
    """Runs grouped into lines: same value of every varying field except the axis and what moves with it."""
    moves = SWEEPS[axis][2]
    keys = [k for k in varying(runs) if k not in moves]
    groups: dict[str, list[Run]] = {}
    for r in runs:
        if r.get(axis) is not None:
            groups.setdefault(label(r, keys or ["method", "precision"]), []).append(r)
    return groups


def _x_axis(ax: Axes, xs: list[float], name: str) -> None:
    xs = sorted(set(xs))
    if xs and min(xs) > 0 and max(xs) / min(xs) >= 8:
        ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(xs))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{x:g}" for x in xs])
    ax.set_xlabel(name)
    ax.grid(True, alpha=0.3)


def sweep_plot(runs: list[Run], axis: str, out: Path) -> tuple[str, str] | None:
    """Memory and throughput (and time per epoch, against batch size) along one sweep axis; OOM runs are
    crosses on the device budget line, as the papers' tables list them as OOM rows."""
    name, fname, _ = SWEEPS[axis]
    groups = _series(runs, axis)
    if not any(len({r.get(axis) for r in g}) > 1 for g in groups.values()):
        return None
    unit, div = memory_unit(runs)
    panels: list[tuple[str, Callable[[Run], float | None]]] = [
        (f"device memory ({unit})", lambda r: None if r.peak_bytes is None else r.peak_bytes / div),
        ("throughput (samples/s)", lambda r: r.throughput),
    ]
    if axis != "num_layers":
        panels.reverse()
    if axis == "batch_size" and any(r.epoch_time_s for r in runs):
        panels.append(("time per epoch (s)", lambda r: r.epoch_time_s))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    budgets = {r.budget_bytes for r in runs if r.budget_bytes}
    for ax, (ylabel, value) in zip(axes[0], panels, strict=True):
        is_memory = ylabel.startswith("device memory")
        for i, (series, members) in enumerate(groups.items()):
            color = f"C{i % 10}"
            ok = sorted((r.get(axis), value(r)) for r in members if r.ok and value(r) is not None)
            if ok:
                ax.plot([x for x, _ in ok], [y for _, y in ok], label=series, **style(i))
            if is_memory:
                ooms = [r for r in members if r.status == "oom"]
                for r in ooms:
                    y = (r.budget_bytes or r.peak_bytes or 0) / div
                    ax.plot([r.get(axis)], [y], "x", color=color, markersize=11, markeredgewidth=2.5)
                    ax.annotate(
                        "OOM",
                        (r.get(axis), y),
                        textcoords="offset points",
                        xytext=(4, 6),
                        color=color,
                        fontsize=8,
                    )
        if is_memory and len(budgets) == 1:
            ax.axhline(next(iter(budgets)) / div, color="gray", ls="--", lw=1, label="device budget")
        _x_axis(ax, [r.get(axis) for r in runs if r.get(axis) is not None], name)
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)  # room for the OOM labels on the budget line
        ax.set_title(f"{ylabel.split(' (')[0]} vs {name}")
    for ax in axes[0]:
        ax.legend(fontsize=8)
    ctx = context(runs)
    if ctx:
        fig.suptitle(ctx, fontsize=10)
    _save(fig, out / fname)
    return fname, f"device memory and throughput vs {name} (OOM: a cross on the device budget)"


def pipeline_plot(runs: list[Run], out: Path) -> tuple[str, str] | None:
    """Layered-GA §4 and appendix C: each (placement, schedule)'s bubble fraction against #ubatches, measured
    (solid) and predicted (dashed), and its throughput: the modular pipeline's bubble is L/P times smaller."""
    piped = [r for r in runs if r.pipeline and r.pipeline.get("bubble_measured") is not None]
    if not piped:
        return None
    groups: dict[str, list[Run]] = {}
    for r in piped:
        p = r.pipeline
        groups.setdefault(f"{p['placement']} {p['schedule']} P={p['pipeline']}", []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 4.2), squeeze=False)
    bubble, speed = axes[0]
    for i, (series, members) in enumerate(groups.items()):
        color = f"C{i % 10}"
        pts = sorted(
            (
                r.pipeline["num_ubatches"],
                r.pipeline["bubble_measured"],
                r.pipeline["bubble_predicted"],
                r.throughput,
            )
            for r in members
        )
        xs = [x for x, *_ in pts]
        bubble.plot(xs, [100 * m for _, m, _, _ in pts], "o-", color=color, label=f"{series} measured")
        bubble.plot(
            xs,
            [100 * p for _, _, p, _ in pts],
            "s--",
            color=color,
            alpha=0.6,
            label=f"{series} predicted (+ messages)",
        )
        speed.plot(xs, [t or 0.0 for *_, t in pts], "o-", color=color, label=series)
    xs_all = [r.pipeline["num_ubatches"] for r in piped]
    for ax, ylabel in ((bubble, "bubble (% of the pipeline's time)"), (speed, "throughput (samples/s)")):
        _x_axis(ax, xs_all, "#UBATCHES")
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
        ax.legend(fontsize=7)
    bubble.set_title("pipeline bubble: measured vs appendix C")
    speed.set_title("throughput vs #UBATCHES")
    _save(fig, out / "pipeline_bubble.png")
    return (
        "pipeline_bubble.png",
        "pipeline bubble (measured, and predicted by the layered-GA paper) and throughput",
    )


def breakdown_plot(runs: list[Run], out: Path) -> tuple[str, str] | None:
    """Each run's step split into phases, as shares of the step (L2L v1 Figure 6 is one such split, as a
    pie), the step's length in ms at the end of its bar: shares compare across runs of any speed."""
    done = [r for r in runs if r.breakdown]
    if not done:
        return None
    keys = varying(runs)
    phases = breakdown_columns(done)  # the papers' order: forward, recompute, backward, optimizer, ...
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.42 * len(done)))
    labels = [label(r, keys) for r in done]
    totals = [sum(r.breakdown.values()) for r in done]
    left = [0.0] * len(done)
    for j, p in enumerate(phases):
        pct = [100 * r.breakdown.get(p, 0.0) / t if t > 0 else 0.0 for r, t in zip(done, totals, strict=True)]
        ax.barh(range(len(done)), pct, left=left, color=PHASE_COLORS.get(p, f"C{j % 10}"), label=p)
        for i, (x0, w) in enumerate(zip(left, pct, strict=True)):
            if w >= 6:
                ax.text(x0 + w / 2, i, f"{w:.0f}%", ha="center", va="center", fontsize=7, color="white")
        left = [a + b for a, b in zip(left, pct, strict=True)]
    for i, t in enumerate(totals):
        ax.text(101, i, f"{1e3 * t:.0f} ms", va="center", fontsize=7)
    ax.set_yticks(range(len(done)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 112)
    ax.set_xticks(range(0, 101, 20))
    ax.set_xlabel("share of the mean step time (%)")
    ax.set_title(titled("time per step by phase", runs))
    handles, names = ax.get_legend_handles_labels()
    fig.legend(handles, names, ncol=min(6, len(phases)), fontsize=8, loc="lower center", frameon=False)
    fig.tight_layout(rect=(0, 0.12 if len(done) < 4 else 0.06, 1, 1))
    _save(fig, out / "time_breakdown.png", tight=False)
    return (
        "time_breakdown.png",
        "each run's mean step split by phase (forward, recompute, backward, optimizer, transfer)",
    )


def loss_plot(runs: list[Run], out: Path) -> tuple[str, str] | None:
    curves = [(r, [(m.step, m.loss) for m in r.metrics if _finite(m.loss)]) for r in runs]
    curves = [(r, c) for r, c in curves if c]
    if not curves:
        return None
    keys = varying(runs)
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for i, (r, c) in enumerate(curves):
        ax.plot([s for s, _ in c], [v for _, v in c], label=label(r, keys), **style(i, len(c)))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(titled("training loss", runs))
    ax.grid(True, alpha=0.3)
    if len(curves) <= 16:
        outside_legend(ax)
    _save(fig, out / "loss.png")
    return "loss.png", "training loss per logged step"


def eval_plot(runs: list[Run], out: Path) -> tuple[str, str] | None:
    """Eval metrics over steps; bars when every run evaluated once (at the end)."""
    names: list[str] = []
    for r in runs:
        for e in r.evals:
            names += [k for k in e if k != "step" and _finite(e[k]) and k not in names]
    if not names:
        return None
    keys = varying(runs)
    with_evals = [r for r in runs if r.evals]
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4.2), squeeze=False)
    once = all(len(r.evals) <= 1 for r in with_evals)
    for ax, m in zip(axes[0], names, strict=True):
        if once:
            having = [r for r in with_evals if _finite(r.evals[-1].get(m))]  # F1 only where the task has it
            labels = [label(r, keys) for r in having]
            vals = [r.evals[-1][m] for r in having]
            ax.bar(range(len(vals)), vals, color=[f"C{i % 10}" for i in range(len(vals))])
            ax.set_xticks(range(len(vals)), labels, rotation=30, ha="right", fontsize=7)
            for i, v in enumerate(vals):
                if _finite(v):
                    ax.text(i, v, f"{v:.3f}", ha="center", va="bottom", fontsize=7)
        else:
            for i, r in enumerate(with_evals):
                pts = [(e["step"], e[m]) for e in r.evals if _finite(e.get(m))]
                if not pts:
                    continue
                ax.plot([s for s, _ in pts], [v for _, v in pts], label=label(r, keys), **style(i, len(pts)))
            ax.set_xlabel("step")
            if len(with_evals) <= 16:
                outside_legend(ax)
        ax.set_ylabel(m)
        ax.set_title(titled(f"eval {m}", runs))
        ax.grid(True, alpha=0.3)
    _save(fig, out / "eval.png")
    return "eval.png", "evaluation metrics (dev split)"


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and v == v and abs(v) != float("inf")
