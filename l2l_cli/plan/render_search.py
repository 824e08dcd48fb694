"""The terminal view of ``l2l plan --search`` (layered-GA §5: the fastest configuration per method and
parallelism mix, with the command l2l runs for it) and ``--scaling`` (§7's limits)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.text import Text

from l2l_cli.plan.render import fmt_n, new_table, overrides_note


def fmt_days(d: float | None) -> str:
    """Table 6.1's time column: days below a year, years above."""
    if d is None:
        return "-"
    return f"{d:.3g} d" if d < 365 else f"{d / 365:.3g} y"


def fmt_time(days: float | None) -> str:
    """A training time: hours below a day, days below a year, years above."""
    if days is None:
        return "-"
    return f"{days * 24:.3g} h" if days < 1 else fmt_days(days)


def render_search(out: dict[str, Any], console: Console) -> None:
    """``l2l plan --search``: Table 6.1's columns, Table 6.2's memory, what binds each row, the commands."""
    hw, bd = out["hardware"], out["bounds"]
    head = (
        f"[bold]{out['model']}[/] ({fmt_n(out['params'])} parameters in the layers; d_l "
        f"{out['shape']['d_l']}, "
        f"d_m {out['shape']['d_m']}, heads {out['shape']['d_a']}, d_s {out['shape']['d_s']}) · critical "
        "batch "
        f"{out['critical_batch_size']:.4g} · budget {out['budget']}\n"
        f"[bold]{hw['name']}[/]{overrides_note(hw)}: {out['rate']}, {hw['memory_gb']:g} GB, {hw['network']} "
        f"{hw['network_gbps']:g} GB/s, tensor link {hw['tensor_link_gbps']:g} GB/s × "
        f"{hw['node_size'] or 'any'} GPUs, "
        f"CPU-GPU {hw['offload_gbps']:g} GB/s · objective: {out['objective']}"
        + (f" · max {bd['max_gpus']} GPUs" if bd["max_gpus"] else "")
        + (f" · max {bd['max_days']:g} days" if bd["max_days"] else "")
    )
    console.print(
        Panel(
            Text.from_markup(head),
            title="l2l plan --search (layered-GA §5)",
            title_align="left",
            expand=False,
        )
    )
    t = new_table(
        f"Fastest configuration per method for {out['model']}, {out['budget']} (Table 6.1's columns; "
        "l2l ✗: the paper's, l2l cannot run it)",
        "parallelism",
        "method",
        "offload",
        "b",
        "b_mu",
        "n_mu",
        "n_gpu",
        "n_b",
        "n_l",
        "n_a",
        "efficiency",
        "time",
        "l2l",
    )
    for r in out["search"]:
        t.add_row(
            r["parallelism"],
            r["method"],
            "✓" if r["offload"] else "✗",
            str(r["b"]),
            str(r["b_mu"]),
            str(r["n_mu"]),
            str(r["n_gpu"]),
            str(r["n_b"]),
            str(r["n_l"]),
            str(r["n_a"]),
            f"{r['efficiency']:.2f}",
            fmt_time(r["days"]),
            "✓" if r["l2l_runs"] else "✗",
            style="" if r["l2l_runs"] else "dim",
        )
    console.print(t)
    t = new_table(
        f"Memory per GPU, GB (Table 6.2's columns), {out['model']}",
        "parallelism",
        "method",
        "state",
        "checkpoint",
        "buffers",
        "activations",
        "offloadable",
        "non-offloadable",
    )
    for r in out["search"]:
        mem = r["memory"]
        t.add_row(
            r["parallelism"],
            r["method"],
            *(
                f"{mem[k]:.3g}"
                for k in ("state", "checkpoint", "buffers", "activations", "offloadable", "non_offloadable")
            ),
        )
    console.print(t)
    for r in out["search"]:
        console.print(f"[bold]{r['parallelism']} / {r['method']}[/]: {r['binding']}")
        if r["command"]:
            console.print(f"  [green]{r['command']}", soft_wrap=True)
    for line in out["not_found"] + out["notes"]:
        console.print(f"[dim]note: {line}")
    if out["best"]:
        b = out["best"]
        console.print(
            f"[bold]best (l2l runs it): {b['parallelism']} / {b['method']}, {b['n_gpu']} GPUs, "
            f"{fmt_time(b['days'])} for {out['budget']}"
        )
        console.print(f"  [green]{b['command']}", soft_wrap=True)
    else:
        console.print("[bold]best: none of these rows is one l2l runs (see the notes)")


def render_scaling(out: dict[str, Any], console: Console) -> None:
    """``l2l plan --scaling``: where the files went and §7's limits."""
    lim = out["limits"]
    t = new_table(
        f"Layered-GA §7 limits, improved method ({out['hardware']}, Figure 4)", "limit", "parameters"
    )
    names = {
        "fits_80gb_params": f"largest model whose non-offloadable memory fits {out['memory_gb']:g} GB",
        "offload_above_params": "offload needed above",
        "one_month_params": "largest trained in one month",
        "one_year_params": "largest trained in one year",
    }
    for k, label in names.items():
        t.add_row(label, fmt_n(lim[k]) if lim[k] else "-")
    console.print(t)
    for k, v in out.get("extra", {}).items():
        console.print(f"{k}: {v}")
    console.print(f"wrote {', '.join(out['files'])} into {out['out']}")
