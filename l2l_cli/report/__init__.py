"""``l2l report``: run directories in, the papers' tables and plots out.

    l2l report outputs/l2l_v2_table4/2026-01-01_12-00-00     # a sweep (multirun dir)
    l2l report outputs/2026-01-01/12-00-00-l2l-synthetic     # one run
    l2l report outputs/l2l_v2_table3 outputs/l2l_v2_table4   # folders of sweeps, together
    l2l report outputs/layered_ga_scaling                    # what `l2l plan --scaling` wrote

Prints a table (rich) and writes report.md, report.csv and plots (PNG and SVG). Runs that ran out of device
memory are OOM rows and failed runs show their error, as the papers' tables do. Folders that ``l2l plan
--scaling`` wrote (scaling.json beside figure4/5/8 and scaling.csv) get a section of report.md that links
their figures and gives layered-GA §7's limits, also in limits.csv. The report itself only fails (exit code 2)
on bad input: a path that does not exist, or a folder with neither runs nor scaling outputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from l2l_cli.report.runs import ReportError, Run, find_runs
from l2l_cli.report.scaling import Scaling, find_scaling, limit_rows, write_limits
from l2l_cli.report.scaling import markdown as scaling_markdown
from l2l_cli.report.table import breakdown_rows, columns, md_table, rows, write_csv

__all__ = ["Report", "build", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ReportError(f"{message} (usage: l2l report <run dirs or multirun dirs...> [--out DIR])")


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="l2l report",
        description="Tables (rich, report.md, report.csv) and plots (PNG, SVG) from l2l run directories.",
    )
    p.add_argument("paths", nargs="+", metavar="DIR", help="run dirs, multirun dirs, or folders holding them")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="where report.md, report.csv and the plots go (default: DIR/report for one DIR, else ./report)",
    )
    p.add_argument("--no-plots", action="store_true", help="tables only")
    return p


class Report:
    """The runs and what was written for them."""

    def __init__(self, runs: list[Run], out: Path, plots: list[tuple[str, str]], scaling: list[Scaling]):
        self.runs, self.out, self.plots, self.scaling = runs, out, plots, scaling

    def files(self) -> list[str]:
        """What the report wrote into ``out``."""
        tables = (["report.csv"] if self.runs else []) + (["limits.csv"] if self.scaling else [])
        return ["report.md", *tables, *(name for name, _ in self.plots)]


def build(paths: list[str], out: Path | None = None, plots: bool = True) -> Report:
    """Read the runs and scaling outputs under ``paths`` and write report.md, report.csv (runs), limits.csv
    (scaling outputs) and the plots into ``out``."""
    scaling = find_scaling(paths)
    runs = find_runs(paths, frozenset(s.dir for s in scaling))
    if out is None:
        out = Path(paths[0]) / "report" if len(paths) == 1 else Path("report")
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    written: list[tuple[str, str]] = []
    if plots and runs:
        from l2l_cli.report.plots import write_plots  # matplotlib: only when drawing

        written = write_plots(runs, out)
    if runs:
        write_csv(out / "report.csv", runs)
    if scaling:
        write_limits(out / "limits.csv", scaling)
    (out / "report.md").write_text(markdown(runs, paths, written, scaling, out))
    return Report(runs, out, written, scaling)


def markdown(
    runs: list[Run],
    paths: list[str],
    plots: list[tuple[str, str]],
    scaling: list[Scaling] | None = None,
    out: Path = Path("."),
) -> str:
    parts = ["# l2l report", "", *_runs_markdown(runs, paths, plots)] if runs else ["# l2l report"]
    if scaling:
        parts += scaling_markdown(scaling, out, md_table)
    return "\n".join(parts).rstrip() + "\n"


def _runs_markdown(runs: list[Run], paths: list[str], plots: list[tuple[str, str]]) -> list[str]:
    cols = columns(runs)
    n = {s: sum(r.status == s for r in runs) for s in ("ok", "oom", "error")}
    parts = [
        f"{len(runs)} runs ({n['ok']} ok, {n['oom']} out of memory, {n['error']} failed) from "
        + ", ".join(f"`{p}`" for p in paths)
        + ". THROUGHPUT is steady-state samples/s (the first step excluded); MEMORY is the device-tier peak.",
        "",
        md_table([c.header for c in cols], rows(runs, cols)),
    ]
    header, body = breakdown_rows(runs)
    if body:
        parts += ["", "## Time per step by phase (ms, share of the step)", "", md_table(header, body)]
    if plots:
        parts += ["", "## Plots", ""]
        parts += [f"![{caption}]({name})\n\n*{caption}*\n" for name, caption in plots]
    failed = [r for r in runs if not r.ok]
    if failed:
        parts += ["", "## Out of memory and failed runs", ""]
        parts += [f"- `{r.name}` ({r.status}): {(r.error or '').strip()}" for r in failed]
    return parts


def print_tables(report: Report) -> None:
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table

    console = Console(highlight=False)
    piped = not console.is_terminal  # a pipe or a log file: each table as wide as it needs (at least 240)

    def show(table: Table) -> None:
        if not piped:
            console.print(table)
            return
        wide = Console(highlight=False, width=100_000)
        width = Measurement.get(wide, wide.options, table).maximum
        Console(highlight=False, width=max(240, width)).print(table)

    for s in report.scaling:
        header, body = limit_rows(s)
        st = Table(title=f"layered-GA §7 limits: {s.name}", header_style="bold", title_justify="left")
        for i, h in enumerate(header):
            st.add_column(h, justify="left" if i == 0 else "right")
        for row in body:
            st.add_row(*row)
        show(st)
    if not report.runs:
        console.print(f"wrote {', '.join(report.files())} to {report.out}")
        return
    cols = columns(report.runs)
    t = Table(title=f"l2l report: {len(report.runs)} runs", header_style="bold", title_justify="left")
    for c in cols:  # headers whole (a narrow terminal shortens cells, not names); notes and run names fold
        fold = c.header in ("NOTE", "RUN")
        t.add_column(
            c.header,
            justify="right" if c.numeric else "left",
            no_wrap=not fold,
            min_width=len(c.header),
            overflow="fold" if fold else "ellipsis",
            max_width=70 if fold else None,
        )
    for r, cells in zip(report.runs, rows(report.runs, cols), strict=True):
        t.add_row(*cells, style=None if r.ok else "red")
    show(t)
    header, body = breakdown_rows(report.runs)
    if body:
        b = Table(
            title="time per step by phase (ms, share of the step)", header_style="bold", title_justify="left"
        )
        for i, h in enumerate(header):
            b.add_column(h, justify="left" if i < 2 else "right")
        for row in body:
            b.add_row(*row)
        show(b)
    console.print(f"wrote {', '.join(report.files())} to {report.out}")


def main(argv: list[str]) -> int:
    """``l2l report`` entry point: 0 when the report was written, 2 on bad input (one line, no traceback)."""
    try:
        args = parser().parse_args(argv)
        report = build(args.paths, Path(args.out) if args.out else None, plots=not args.no_plots)
    except ReportError as e:
        print(f"l2l: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # an unwritable --out, say
        print(f"l2l: {e.strerror or e}: {e.filename}", file=sys.stderr)
        return 2
    print_tables(report)
    return 0
