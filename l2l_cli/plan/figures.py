"""``l2l plan --scaling``: layered-GA §7 and §8.3. Sweep the X[x] family from 1e9 to 1e16 parameters, take the
fastest configuration of each method at every size (``plan/search.py``), and draw the paper's Figures 4
(InfiniBand, 16 GPUs per node), 5 (no node-size limit) and 8 (25 Gb/s Ethernet), with ``scaling.csv`` and
the limits §7 reads off Figure 4.

The sweep treats the degrees as free (any n_l <= d_l, any n_a), as the paper's smooth curves do: the X[x]
head counts x/2 have few divisors, and a divisor rule would make the curves jump where it does not matter.
Nor does it bound n_a by the head count: §7 says tensor parallelism "is limited by a computer design choice
which limits the node size to 16 ... tensor parallelism only requires a ring topology, which is easy to
scale to an arbitrary size", and Figure 5's numbers need it (``tests/test_plan_search.py``); with 16-GPU
nodes the tensor cap over the network binds long before the heads do, so Figures 4 and 8 do not change.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from l2l_cli.plan import scaling as ga
from l2l_cli.plan.candidates import DAY, MEMORY_KEYS, PAIRS, Bounds, Target
from l2l_cli.plan.scaling import GA_IMPROVED, GA_NO_PARTITION, METHODS, GiB
from l2l_cli.plan.search import Found, fastest

MONTH_DAYS, YEAR_DAYS = 365.25 / 12, 365.25
# --out's default: where recipes/layered_ga_scaling.yaml's report looks
DEFAULT_OUT = "outputs/layered_ga_scaling"
SUMMARY = "scaling.json"  # the sweep's summary (the --json object) beside the figures: `l2l report` reads it
FIGURES = {  # name -> what differs from the base machine
    "figure4": {"node_size": 16, "network": "infiniband"},
    "figure5": {"node_size": 0, "network": "infiniband"},
    "figure8": {"node_size": 16, "network": "ethernet"},
}
LABELS = {"baseline": "3d Baseline", "partitioned": "2d Partitioned", "improved": "3d Improved"}
# a search row's fields that a figure's CSV row takes as they are
SEARCH_FIELDS = ("b", "b_mu", "n_mu", "n_b", "n_l", "n_a", "n_gpu", "offload", "efficiency", "days")
CSV_FIELDS = (
    "figure",
    "network",
    "node_size",
    "method",
    "parallelism",
    "x",
    "params",
    "critical_batch",
    *SEARCH_FIELDS,
    *(f"{k}_gb" for k in MEMORY_KEYS),
    "fits_device",
    "binding",
)


# The paper's analysis: free degrees, no head bound (module doc)
PAPER = Bounds(whole=False, heads=False)
X_MAX = 4096  # the largest X[x] a limit is looked for at (1.4e19 parameters)
UNBOUNDED_GIB = 1e12  # device memory for the part of a curve past the device's (no configuration fits)
# The paper's "1 TB (offload)" line (Figure 4): what one GPU may offload to its host in the figures; a
# configuration that needs more is not drawn
OFFLOAD_CAP_GIB = 1024.0
# The paper's axes (Figures 4, 5, 8): non-offloadable to 1e2 GB, offloadable to 1e3 GB (its 1 TB line
# just above), time to 1e5 days. A curve ends where it would leave them (scaling.csv keeps every value).
AXIS_MAX = {"Non-offloadable (GB)": 1e2, "Offloadable (GB)": OFFLOAD_CAP_GIB, "Training time (days)": 1e5}


def sizes(points: int, lo: float = 1e9, hi: float = 1e16) -> list[int]:
    """Even x whose X[x] (p ≈ 12·x⁵) spans lo..hi parameters, about evenly in log p."""
    xs = np.geomspace((lo / 12) ** 0.2, (hi / 12) ** 0.2, points)
    return sorted({max(2, 2 * round(x / 2)) for x in xs})


def sweep(
    links: ga.Links, xs: list[int], bounds: Bounds | None = None
) -> list[tuple[int, str, Found | None]]:
    """For each size and method, the fastest configuration over the method's parallelism mixes. Where none
    fits the device, the fastest without that bound (``Found.over_memory``): the paper's curves go on past
    the 80 GB line (§7 reads "80 GB is enough ... up to 280 trillion" off them; Figure 4's time axis
    reaches 10^5 days), and the figures draw that part dashed."""
    b = bounds or PAPER
    unbounded = replace(links, device_memory_gib=UNBOUNDED_GIB)  # the offload cap stays (OFFLOAD_CAP_GIB)
    out = []
    for x in xs:
        t = Target(ga.x_family(x), ga.x_critical_batch_size(x), links)
        for method in METHODS:
            mixes = tuple(mix for mix, m in PAIRS if m == method)
            f = fastest(t, b, method, mixes)
            if f is None:
                f = fastest(replace(t, links=unbounded), b, method, mixes)
                if f is not None:
                    f.over_memory = True
            out.append((x, method, f))
    return out


def crossing(params: list[float], values: list[float], limit: float, rising: bool = True) -> float | None:
    """The parameter count where ``values`` first crosses ``limit`` (log-log interpolation between the two
    sizes around it); None if it never does."""
    for i in range(1, len(params)):
        a, b = values[i - 1], values[i]
        if (a <= limit < b) if rising else (a >= limit > b):
            if a <= 0 or b <= 0:
                return params[i]
            f = (math.log(limit) - math.log(a)) / (math.log(b) - math.log(a))
            return math.exp(math.log(params[i - 1]) + f * (math.log(params[i]) - math.log(params[i - 1])))
    return None


def _last_true(xs: list[int], test: Any) -> int | None:
    """The largest even x in [xs[0], xs[-1]] with ``test(x)`` true, given it holds below some size and
    fails above (bisection between the sweep's last true and first false sizes)."""
    flags = [test(x) for x in xs]
    if not flags[0]:
        return None
    i = next((k for k, f in enumerate(flags) if not f), None)
    if i is None:  # still true at the sweep's top: look further up (Figure 5 fits past 1e16)
        lo = xs[-1]
        while True:
            hi = min(X_MAX, max(lo + 2, 2 * round(lo * 1.25 / 2)))
            if hi <= lo or not test(hi):
                break
            lo = hi
        if hi <= lo:
            return lo
    else:
        lo, hi = xs[i - 1], xs[i]
    while hi - lo > 2:
        mid = (lo + hi) // 4 * 2
        lo, hi = (mid, hi) if test(mid) else (lo, mid)
    return lo


def limits(
    rows: list[tuple[int, str, Found | None]],
    links: ga.Links,
    bounds: Bounds | None = None,
    method: str = "improved",
) -> dict:
    """§7, for the improved method: the largest X[x] with a configuration that fits the device (its
    non-offloadable memory), the largest with a configuration that needs no offload (above it offload is
    required), and the
    largest trainable in a month and in a year (log-log interpolation of the time between sizes)."""
    b = bounds or PAPER
    mixes = tuple(mix for mix, m in PAIRS if m == method)
    found = {x: f for x, m, f in rows if m == method}
    xs = sorted(found)

    def best(x: int) -> Found | None:
        if x not in found:
            found[x] = fastest(Target(ga.x_family(x), ga.x_critical_batch_size(x), links), b, method, mixes)
        return found[x]

    def fits(x: int) -> bool:
        f = best(x)
        return f is not None and not f.over_memory

    stay = replace(b, offload=False)

    def fits_on_device(x: int) -> bool:
        t = Target(ga.x_family(x), ga.x_critical_batch_size(x), links)
        return fastest(t, stay, method, mixes) is not None

    largest = _last_true(xs, fits)
    no_offload = _last_true(xs, fits_on_device)
    pts = [(ga.x_family(x).p, found[x].time_s / DAY) for x in xs if found[x] is not None and fits(x)]
    p, days = [q for q, _ in pts], [d for _, d in pts]
    return {
        "fits_80gb_params": None if largest is None else ga.x_family(largest).p,
        "offload_above_params": None if no_offload is None else ga.x_family(no_offload).p,
        "one_month_params": crossing(p, days, MONTH_DAYS),
        "one_year_params": crossing(p, days, YEAR_DAYS),
    }


def csv_rows(
    name: str, links: ga.Links, network: str, rows: list[tuple[int, str, Found | None]]
) -> list[dict]:
    out = []
    for x, method, f in rows:
        if f is None:
            continue
        r = f.row()
        out.append(
            {
                "figure": name,
                "network": network,
                "node_size": links.node_size,
                "method": method,
                "parallelism": f.mix,
                "x": x,
                "params": ga.x_family(x).p,
                "critical_batch": ga.x_critical_batch_size(x),
                **{k: r[k] for k in SEARCH_FIELDS},
                **{f"{k}_gb": r["memory"][k] for k in MEMORY_KEYS},
                "fits_device": not f.over_memory,
                "binding": r["binding"],
            }
        )
    return out


def curve(rows: list[tuple[int, str, Found | None]], method: str, value: Any, top: float) -> list[tuple]:
    """One method's drawn points (parameters, value, past the device's memory), in size order: the curve
    starts where it enters the paper's axis (``value <= top``) and ends where it leaves it, so that no point
    is drawn above the axis (an infeasible size is not a spike)."""
    pts: list[tuple] = []
    for x, _m, f in sorted((r for r in rows if r[1] == method and r[2] is not None), key=lambda r: r[0]):
        if value(f) > top * (1 + 1e-9):
            if pts:
                break
            continue
        pts.append((ga.x_family(x).p, value(f), f.over_memory))
    return pts


PANELS = (
    ("Non-offloadable (GB)", lambda f: f.memory_bytes["non_offloadable"] / GiB),
    ("Offloadable (GB)", lambda f: f.memory_bytes["offloadable"] / GiB),
    ("Training time (days)", lambda f: f.time_s / DAY),
)


def no_partition(
    links: ga.Links, xs: list[int], bounds: Bounds | None = None
) -> list[tuple[int, str, Found | None]]:
    """§8.3's "No partition" curve (Figure 8, dotted): the improved method's fastest configuration without the
    state partition, at each size ("for the smallest models, the partition can be avoided to further reduce
    the training time at a minimal memory cost")."""
    b = bounds or PAPER
    mixes = tuple(mix for mix, m in PAIRS if m == GA_IMPROVED)
    return [
        (
            x,
            GA_NO_PARTITION,
            fastest(Target(ga.x_family(x), ga.x_critical_batch_size(x), links), b, GA_NO_PARTITION, mixes),
        )
        for x in xs
    ]


def draw(
    path: Path,
    rows: list[tuple[int, str, Found | None]],
    memory_gib: float,
    title: str,
    compare: list[tuple[int, str, Found | None]] | None = None,
    compare_label: str = "",
    extra: list[tuple[int, str, Found | None]] | None = None,
) -> list[str]:
    """The paper's three panels: non-offloadable and offloadable memory per GPU, training time; log axes, one
    line per method, the device memory, 1 TB offload, one-month and one-year lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    panels = PANELS
    colors = {"baseline": "tab:blue", "partitioned": "tab:orange", "improved": "tab:green"}
    beyond = any(f is not None and f.over_memory for _, _, f in rows)
    for ax, (ylabel, value) in zip(axes, panels):
        top = AXIS_MAX[ylabel]
        for method in METHODS:
            pts = curve(rows, method, value, top)
            fit = [(p, v) for p, v, over in pts if not over]
            if fit:
                ax.plot(*zip(*fit), color=colors[method], label=LABELS[method])
            over = [(p, v) for p, v, o in pts if o]
            if over:  # past the device's memory: from the last point that fits, dashed
                ax.plot(*zip(*(fit[-1:] + over)), color=colors[method], ls="--", lw=1)
            if compare:
                cp = [(p, v) for p, v, _ in curve(compare, method, value, top)]
                if cp:
                    ax.plot(
                        *zip(*cp),
                        color=colors[method],
                        ls=":",
                        lw=1,
                        label=compare_label if method == "improved" else None,
                    )
        if extra:
            pts = curve(extra, GA_NO_PARTITION, value, top)
            if pts:
                ax.plot(
                    [p for p, _, _ in pts],
                    [v for _, v, _ in pts],
                    color="black",
                    ls=":",
                    lw=1.2,
                    label="No partition",
                )
        if "time" in ylabel:
            ax.axhline(MONTH_DAYS, color="gray", ls="-.", lw=1, label="One month")
            ax.axhline(YEAR_DAYS, color="black", ls="-.", lw=1, label="One year")
        else:
            ax.axhline(memory_gib, color="red", ls="-.", lw=1, label=f"{memory_gib:g} GB (device)")
            if "Offloadable" in ylabel:
                ax.axhline(1024, color="purple", ls="-.", lw=1, label="1 TB (offload)")
        if beyond:
            ax.plot([], [], color="gray", ls="--", lw=1, label=f"dashed: nothing fits {memory_gib:g} GB")
        ax.plot(
            [],
            [],
            ls="none",
            label=f"curves end above {top:g}"
            + (" GB" if "GB" in ylabel else " days")
            + (" (offload capped at 1 TB)" if "Offloadable" in ylabel else ""),
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("Parameters")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    files = []
    for ext in ("png", "svg"):
        fig.savefig(path.with_suffix(f".{ext}"), dpi=110)
        files.append(path.with_suffix(f".{ext}").name)
    plt.close(fig)
    return files


def scaling_plan(cfg: Any, out: Path) -> dict[str, Any]:
    """Sweep, write the figures, scaling.csv and scaling.json into ``out``, and return the limits
    (``--scaling``)."""
    from l2l_cli.plan.choose import links_for

    # the paper's machine for its figures: each GPU may offload up to the 1 TB line (not the tool's
    # per-node host memory)
    base = replace(links_for(cfg), host_memory_gib=OFFLOAD_CAP_GIB, node_host_memory_gib=0.0)
    hw = cfg.hardware
    xs = sizes(int(cfg.plan.scaling_points))
    bounds = replace(PAPER, max_overhead=float(cfg.plan.max_overhead), steps=int(cfg.plan.train_steps))
    out.mkdir(parents=True, exist_ok=True)
    results, table, files = {}, [], []
    for name, spec in FIGURES.items():
        net = hw.network_gbps if spec["network"] == "infiniband" else hw.ethernet_gbps
        links = replace(base, node_size=spec["node_size"], network_gbps=net)
        results[name] = sweep(links, xs, bounds)
        table += csv_rows(name, links, spec["network"], results[name])
    titles = {
        "figure4": f"Figure 4: fastest configuration per method, {hw.name}, InfiniBand, 16 GPUs per node",
        "figure5": f"Figure 5: the same without the node-size limit on tensor parallelism ({hw.name})",
        "figure8": (
            f"Figure 8: over Ethernet ({hw.ethernet_gbps:g} GB/s per GPU); dotted: InfiniBand, black: No "
            f"partition ({hw.name})"
        ),
    }
    eth = replace(base, node_size=FIGURES["figure8"]["node_size"], network_gbps=hw.ethernet_gbps)
    unpartitioned = no_partition(eth, xs, bounds)
    for name in FIGURES:
        cmp_rows = results["figure4"] if name == "figure8" else None
        files += draw(
            out / name,
            results[name],
            base.device_memory_gib,
            titles[name],
            cmp_rows,
            "InfiniBand",
            unpartitioned if name == "figure8" else None,
        )
    with (out / "scaling.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(table)
    files.append("scaling.csv")
    links4 = {
        n: replace(
            base,
            node_size=FIGURES[n]["node_size"],
            network_gbps=hw.network_gbps if FIGURES[n]["network"] == "infiniband" else hw.ethernet_gbps,
        )
        for n in FIGURES
    }
    lim = limits(results["figure4"], links4["figure4"], bounds)
    files.append(SUMMARY)
    out_obj = {
        "out": str(out),
        "files": files,
        "hardware": hw.name,
        "memory_gb": base.device_memory_gib,
        "sizes": len(xs),
        "params_range": [ga.x_family(xs[0]).p, ga.x_family(xs[-1]).p],
        "limits": lim,
        "limits_figure5": limits(results["figure5"], links4["figure5"], bounds),
        "limits_figure8": limits(results["figure8"], links4["figure8"], bounds),
        "ethernet_slowdown_x160": ethernet_slowdown(base, hw.network_gbps, hw.ethernet_gbps, bounds),
    }
    # what `l2l report` reads back (the figures' captions and §7's limits), as --json prints it
    (out / SUMMARY).write_text(json.dumps(_finite(out_obj), indent=1) + "\n")
    return out_obj


def _finite(obj: Any) -> Any:
    """JSON without NaN/Infinity (None instead), as ``--json`` prints it."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj


def ethernet_slowdown(links: ga.Links, ib: float, eth: float, bounds: Bounds | None = None) -> float:
    """§8.3: how much longer X160's fastest improved configuration takes over Ethernet than InfiniBand."""
    b = bounds or PAPER
    t = {}
    for net in (ib, eth):
        tg = Target(
            ga.x_family(160), ga.x_critical_batch_size(160), replace(links, network_gbps=net, node_size=16)
        )
        f = fastest(tg, b, "improved")
        t[net] = f.time_s if f else math.inf
    return t[eth] / t[ib] - 1.0
