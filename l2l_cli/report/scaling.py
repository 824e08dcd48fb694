"""What ``l2l plan --scaling`` wrote (layered-GA §7 and §8.3), as the report shows it: the figures, linked,
and the limits read off them.

A scaling output directory holds ``scaling.json`` (the ``--json`` object: the limits per figure and the
Ethernet slowdown of X160) beside figure4/5/8 (.png, .svg) and ``scaling.csv``. ``l2l report`` finds such
directories under its inputs as it finds run directories, lists them in report.md and writes their limits
to ``limits.csv``, one row per directory and figure.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from l2l_cli.plan.figures import FIGURES, SUMMARY

LIMITS = {  # scaling.json's limit -> what it is (§7, the improved method)
    "fits_80gb_params": "largest model whose non-offloadable memory fits the device",
    "offload_above_params": "offload needed above",
    "one_month_params": "largest trained in one month",
    "one_year_params": "largest trained in one year",
}
CAPTIONS = {
    "figure4": "Figure 4: InfiniBand, 16 GPUs per node",
    "figure5": "Figure 5: no node-size limit on tensor parallelism",
    "figure8": "Figure 8: over Ethernet (dotted: InfiniBand)",
}
# The paper's values beside the tool's (§7: Figure 4, "80 GB is enough to train models up to 280 trillion
# parameters, with offloading being required above 90 trillion", "about 4.5 and 50 trillion" in a month and a
# year; Figure 5: "100 quadrillion", "40 trillion (one month) or 900 trillion parameters (one year)")
PAPER = {
    "fits_80gb_params": "280 T / 100 P",
    "offload_above_params": "90 T / -",
    "one_month_params": "4.5 T / 40 T",
    "one_year_params": "50 T / 900 T",
}
LIMITS_FIELDS = ("scaling_dir", "figure", "hardware", "memory_gb", "sizes", *LIMITS, "ethernet_slowdown_x160")


@dataclass
class Scaling:
    """One ``l2l plan --scaling`` output directory."""

    dir: Path
    name: str  # as shown (relative to the inputs' common folder)
    summary: dict[str, Any]

    def limits(self, figure: str) -> dict[str, float | None]:
        key = "limits" if figure == "figure4" else f"limits_{figure}"
        return self.summary.get(key) or {}

    def files(self) -> list[str]:
        """The files it holds, of those ``l2l plan --scaling`` writes."""
        names = [f"{n}.{ext}" for n in FIGURES for ext in ("png", "svg")] + ["scaling.csv", SUMMARY]
        return [n for n in names if (self.dir / n).is_file()]


def is_scaling_dir(path: Path) -> bool:
    return (path / SUMMARY).is_file()


def find_scaling(paths: list[str]) -> list[Scaling]:
    """Every scaling output directory at or under ``paths`` (missing paths are left to ``find_runs``)."""
    dirs: list[Path] = []
    for raw in paths:
        top = Path(raw).expanduser()
        if not top.is_dir():
            continue
        found = [top] if is_scaling_dir(top) else []
        for root, subdirs, _ in os.walk(top):
            subdirs[:] = sorted(s for s in subdirs if not s.startswith("."))
            found += [Path(root) / s for s in subdirs if is_scaling_dir(Path(root) / s)]
        dirs += [d.resolve() for d in found if d.resolve() not in dirs]
    if not dirs:
        return []
    root = Path(os.path.commonpath([str(d.parent) for d in dirs]))
    out = []
    for d in dirs:
        try:
            summary = json.loads((d / SUMMARY).read_text())
        except (OSError, ValueError):
            summary = {}
        rel = os.path.relpath(d, root)
        out.append(Scaling(d, d.name if rel == "." else rel, summary if isinstance(summary, dict) else {}))
    return out


def fmt_params(v: float | None) -> str:
    """Parameters as the paper writes them: 4.5 T, 280 T, 1.2 P (three significant digits)."""
    if not isinstance(v, int | float):
        return "-"
    for div, unit in ((1e15, "P"), (1e12, "T"), (1e9, "B"), (1e6, "M")):
        if v >= div:
            return f"{v / div:.3g} {unit}"
    return f"{v:.3g}"


def limit_rows(s: Scaling) -> tuple[list[str], list[list[str]]]:
    """The limits as a table: one row per limit, one column per figure."""
    memory = s.summary.get("memory_gb")
    header = [
        "limit (improved method)",
        *(CAPTIONS[f].split(":")[0] for f in FIGURES),
        "paper (Figure 4 / Figure 5)",
    ]
    body = []
    for key, label in LIMITS.items():
        if key == "fits_80gb_params" and isinstance(memory, int | float):
            label = f"largest model whose non-offloadable memory fits {memory:g} GB"
        body.append([label, *(fmt_params(s.limits(f).get(key)) for f in FIGURES), PAPER[key]])
    return header, body


def markdown(scalings: list[Scaling], out: Path, md_table: Any) -> list[str]:
    """report.md's section: per directory, the limits table, the Ethernet slowdown and the figures, linked
    relative to the report's folder."""
    parts = ["", "## Layered-GA scaling (`l2l plan --scaling`)", ""]
    for s in scalings:
        sm = s.summary
        lo, hi = (sm.get("params_range") or [None, None])[:2]
        parts += [
            f"`{s.name}`: {sm.get('sizes', '?')} X[x] sizes from {fmt_params(lo)} to {fmt_params(hi)} "
            f"parameters on {sm.get('hardware', '?')}; the fastest configuration of each method per size.",
            "",
            md_table(*limit_rows(s)),
            "",
        ]
        slow = sm.get("ethernet_slowdown_x160")
        if isinstance(slow, int | float):
            parts += [
                f'X160 over Ethernet (§8.3): {slow:+.0%} training time against InfiniBand (paper: "about '
                f'4%").',
                "",
            ]
        files = s.files()
        for fig in FIGURES:
            if f"{fig}.png" in files:
                png = os.path.relpath(s.dir / f"{fig}.png", out)
                svg = (
                    f" ([SVG]({os.path.relpath(s.dir / f'{fig}.svg', out)}))" if f"{fig}.svg" in files else ""
                )
                parts += [f"![{CAPTIONS[fig]}]({png})", "", f"*{CAPTIONS[fig]}*{svg}", ""]
        data = [f"[{n}]({os.path.relpath(s.dir / n, out)})" for n in ("scaling.csv", SUMMARY) if n in files]
        if data:
            parts += ["Data: " + ", ".join(data), ""]
    return parts


def write_limits(path: Path, scalings: list[Scaling]) -> None:
    """limits.csv: one row per scaling directory and figure, the raw numbers of scaling.json."""
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=LIMITS_FIELDS)
        w.writeheader()
        for s in scalings:
            for fig in FIGURES:
                lim = s.limits(fig)
                if not lim:
                    continue
                slow = s.summary.get("ethernet_slowdown_x160") if fig == "figure8" else None
                row = {
                    "scaling_dir": s.name,
                    "figure": fig,
                    "hardware": s.summary.get("hardware"),
                    "memory_gb": s.summary.get("memory_gb"),
                    "sizes": s.summary.get("sizes"),
                    **{k: lim.get(k) for k in LIMITS},
                    "ethernet_slowdown_x160": slow,
                }
                w.writerow({k: "" if v is None else v for k, v in row.items()})
