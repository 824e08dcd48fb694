"""The terminal view of a plan: rich tables, one per question (size, memory, time, what to change)."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from l2l_cli.engine.tiers import TIERS
from l2l_cli.problems import fmt_bytes

GiB = 2**30
PART_NAMES = {
    "training_state": "training state (weights, grads, moments)",
    "param_grad_buffers": "parameter + gradient buffers",
    "stash": "activation stash",
    "working_activations": "working activations",
    "send_copy": "half send copy (cmp)",
    "undo_copies": "L2L-p undo copies",
    "eps_cache": "EPS cache (eps.host_cache_layers)",
    "eps_grad_pool": "EPS gradients in RAM (eps.grad_ram_layers)",
    "eps_files": "EPS layer files (two versions)",
    "runtime_reserved": "CUDA context, workspaces, allocator (hardware.device_reserved_gb)",
    "eps_kept_grads": "EPS kept gradients (at most)",
    "frozen_base": "frozen base (peft.base_dtype)",
    "frozen_base_slots": "frozen base, dequantized in the relay slots",
    "dequantize_scratch": "dequantize scratch (one tensor's fp32 decode)",
    "frozen_base_readahead": "frozen base read ahead (3 layers)",
    "frozen_base_files": "frozen base layer files",
}


def overrides_note(hw: dict[str, Any]) -> str:
    """The preset's name is not the whole machine when hardware.* keys override it: say which."""
    keys = hw.get("overrides") or []
    return f" (with {', '.join(keys)})" if keys else ""


def fmt_s(t: float | None) -> str:
    if t is None:
        return "-"
    if t == 0:
        return "0"
    for unit, k in (("d", 86400.0), ("h", 3600.0), ("min", 60.0), ("s", 1.0), ("ms", 1e-3)):
        if t >= k:
            return f"{t / k:.3g} {unit}"
    return f"{t * 1e6:.3g} µs"


def fmt_n(n: float) -> str:
    for unit, k in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.3g}{unit}"
    return f"{n:.3g}"


def new_table(title: str, *cols: str, **kw: Any) -> Table:
    """A table whose cells wrap (fold) rather than end in "…": a number is never cut short."""
    t = Table(title=title, title_justify="left", title_style="bold", **kw)
    for i, c in enumerate(cols):
        t.add_column(c, justify="left" if i == 0 else "right", overflow="fold")
    return t


def render(plan: dict[str, Any], console: Console) -> None:
    c, hw = plan["config"], plan["hardware"]
    head = (
        f"[bold]{c['model']}[/] ({fmt_n(plan['params']['total'])} parameters) · {c['method']} · "
        f"{c['precision']} · "
        f"seq {c['seq_len']} · batch {c['batch_size']} = {c['num_ubatches']} × ubatch {c['ubatch_size']}"
        + (f" × {c['nproc']} processes" if c["nproc"] > 1 else "")
        + (
            f" = {c['nproc'] // c['pipeline']} (data) × {c['pipeline']} (pipeline)"
            if c.get("pipeline", 1) > 1
            else ""
        )
        + (
            f" · LoRA r={plan['peft']['r']}, base {plan['peft']['base_dtype']} on "
            f"{plan['peft']['base_source']}, "
            f"{plan['config']['optimizer']}"
            if plan.get("peft")
            else ""
        )
        + f"\nhardware [bold]{hw['name']}[/]{overrides_note(hw)}: {hw['rate']}, "
        f"{hw['device_memory_gib']:.3g} GiB device, link {hw['h2d_gbps']:.3g} GB/s, "
        f"host update {hw['host_gflops']:.3g} GFLOP/s"
    )
    ok = plan["fits"]
    verdict = Text(("✓ " if ok else "✗ ") + plan["verdict"], style="bold green" if ok else "bold red")
    lines = [Text.from_markup(head), verdict]
    if plan.get("peft"):  # a LoRA plan: the step and the term that bounds it, beside the verdict
        pe = plan["peft"]
        lines.append(Text(f"step {fmt_s(plan['step_time_s']['total'])}, bound by {pe['bound']}"))
    console.print(Panel(Group(*lines), title="l2l plan", title_align="left", expand=False))

    p = plan["params"]
    t = new_table("Parameters", "layer", "parameters")
    t.add_row("embeddings", fmt_n(p["embeddings"]))
    t.add_row(f"{c['num_layers']} blocks × {fmt_n(p['per_block'])}", fmt_n(p["blocks"]))
    t.add_row(f"head ({p.get('head_parts', 'pooler, classifier')})", fmt_n(p["head"]))
    t.add_row("[bold]total", f"[bold]{p['total']:,}")
    console.print(t)

    m = plan["memory_bytes"]
    tiers = ["device", "host"] + (["disk"] if m.get("disk", {}).get("total") else [])
    t = new_table(
        "Memory at the step's peak",
        "part",
        "device",
        "host (offloaded)",
        *(["disk"] if "disk" in tiers else []),
    )
    for k in dict.fromkeys(p for tier in tiers for p in m[tier]["parts"]):
        t.add_row(
            PART_NAMES.get(k, k),
            *(fmt_bytes(m[x]["parts"][k]) if m[x]["parts"].get(k) else "-" for x in tiers),
        )
    t.add_row("[bold]total", *(f"[bold]{fmt_bytes(m[x]['total'])}" for x in tiers))
    if m["host"].get("ranks_on_node", 1) > 1:
        n = m["host"]["ranks_on_node"]
        t.add_row(
            f"host per node: {n} ranks share it",
            "",
            fmt_bytes(m["host"]["node_total"]),
            *([""] if "disk" in tiers else []),
        )
    budgets = [fmt_bytes(m[x]["budget"]) for x in tiers]
    budgets[1] += " per node"  # the second column, host memory: its ranks share a node's
    t.add_row("budget", *budgets)
    console.print(t)

    if plan.get("peft"):
        render_peft(plan["peft"], console)

    st, hid = plan["step_time_s"], plan["hidden_s"]
    t = new_table("Step time by phase", "phase", "exposed", "hidden (overlapped)")
    for k in ("forward", "recompute", "backward", "transfer", "optimizer", "reduce", "disk_wait", "bubble"):
        if st[k] or hid[k]:
            t.add_row(k, fmt_s(st[k]), fmt_s(hid[k]) if hid[k] else "-")
    t.add_row("[bold]step", f"[bold]{fmt_s(st['total'])}", "")
    t.add_row("[bold]samples/s", f"[bold]{plan['samples_per_s']:.4g}", "")
    console.print(t)

    if plan.get("pipeline"):
        render_pipeline(plan["pipeline"], console)

    r = plan["recommendation"]
    t = new_table("Recommendation", "", "")
    if r["num_ubatches_min"] is not None:
        t.add_row(
            f"#ubatches for L2L transfer ≤ {r['max_transfer_overhead']:.0%} (v2 eq. 4)",
            f"{r['num_ubatches_min']}  (now {c['num_ubatches']}: {r['transfer_overhead_now']:.1%})",
        )
        t.add_row(
            "  per layer: forward / transfer",
            f"{fmt_s(r['layer_forward_s'])} / {fmt_s(r['layer_transfer_s'])}",
        )
    t.add_row(
        f"largest ubatch dividing batch {c['batch_size']} that fits", str(r["max_ubatch_size"] or "none")
    )
    t.add_row(
        f"largest ubatch at {c['num_ubatches']} ubatches (batch scales)",
        str(r["max_ubatch_size_any"] or "none"),
    )
    t.add_row("device floor: one layer + one sample", fmt_bytes(r["single_layer_device_bytes"]))
    tier = plan.get("eps_tier")
    if tier:
        host, disk = tier["host"], tier["disk"]
        t.add_row(
            f"EPS tier needed (configured: {tier['configured']})",
            _tier_needed(tier["needed"]),
        )
        t.add_row("  host tier: RAM, step", f"{fmt_bytes(host['host_bytes'])}, {fmt_s(host['step_time_s'])}")
        t.add_row(
            f"  disk tier: disk, RAM ({tier['cache_layers']} layers), step",
            f"{fmt_bytes(disk['disk_bytes'])}, {fmt_bytes(disk['host_bytes'])}, {fmt_s(disk['step_time_s'])} "
            f"(disk waits {fmt_s(disk['disk_wait_s'])}, hidden {fmt_s(disk['disk_hidden_s'])})",
        )
    console.print(t)

    t = new_table(
        "All modes at this batch", "method", "ubatch × n", "device", "host", "fits", "step", "samples/s"
    )
    for row in plan["modes"]:
        style = "bold" if row["configured"] else ""
        t.add_row(
            row["method"],
            f"{row['ubatch_size']} × {row['num_ubatches']}",
            fmt_bytes(row["device_bytes"]),
            fmt_bytes(row["host_bytes"]) if row["host_bytes"] else "-",
            "yes" if row["fits"] else "[red]no",
            fmt_s(row["step_time_s"]),
            f"{row['samples_per_s']:.4g}",
            style=style,
        )
    console.print(t)

    if plan.get("recompute"):
        render_recompute(plan["recompute"], console)

    ga = plan["layered_ga"]
    t = new_table(
        f"Layered-GA view (d_s={ga['d_s']}, p={fmt_n(ga['params'])}): critical batch "
        f"{plan['critical_batch_size']:.4g}, "
        f"batch {ga['batch']} = {ga['batch_vs_critical']:.2g}× critical; memory in GiB per device",
        "method",
        "GPUs",
        "state",
        "ckpt",
        "buffers",
        "acts",
        "on-dev",
        "eff",
        "time",
    )
    for row in ga["methods"]:
        mb = {k: f"{v / GiB:.3g}" for k, v in row["memory_bytes"].items()}
        t.add_row(
            row["method"],
            str(row["config"]["n_gpu"]),
            mb["state"],
            mb["checkpoints"],
            mb["buffers"],
            mb["activations"],
            mb["non_offloadable"],
            f"{row['efficiency']:.2f}",
            fmt_s(row["train_time_s"]),
        )
    console.print(t)
    console.print(
        f"[dim]  (ckpt = activation checkpoints; state and ckpt can be offloaded, on-dev cannot; time = "
        f"{ga['budget']}: {ga['methods'][0]['steps']:,.0f} steps of batch {ga['batch']} at "
        f"{ga['rate_tflops']:.3g} TFLOP/s × efficiency)"
    )
    for note in plan["notes"]:
        console.print(f"[dim]note: {note}")


def render_peft(pe: dict[str, Any], console: Console) -> None:
    """peft=lora: bytes per parameter where each part lives, and which term bounds the step."""
    targets = ",".join(pe["target_modules"])
    t = new_table(
        f"LoRA (peft=lora, r={pe['r']} on {targets}): bytes per parameter",
        "part",
        "parameters",
        "B/param",
        "in",
        "bytes",
        "set by",
    )
    disk = pe["base_on_disk"]
    t.add_row(
        f"frozen base, {pe['base_dtype']}",
        fmt_n(pe["frozen_params"]),
        f"{pe['base_bytes_per_param']:.3g}",
        "disk" if disk else "RAM",
        fmt_bytes(pe["base_bytes"]),
        "peft.base_dtype",
    )
    if disk:
        t.add_row(
            "  read ahead (3 layers at most)",
            "",
            "0",
            "RAM",
            fmt_bytes(pe["base_readahead_bytes"]),
            "peft.base_source",
        )
    t.add_row(
        "  a relay slot: one layer, dequantized",
        fmt_n(pe["slot_params"]),
        f"{pe['device_layer_bytes_per_param']:.3g}",
        "device",
        fmt_bytes(pe["device_slot_bytes"]),
        "precision",
    )
    t.add_row(
        f"adapters' state ({pe['optimizer']})",
        fmt_n(pe["trainable_params"]),
        f"{pe['state_bytes_per_trainable_param']:.3g}",
        "RAM",
        fmt_bytes(pe["adapter_state_bytes"]),
        "optim, peft.r",
    )
    t.add_row(
        "[bold]host state per model parameter",
        fmt_n(pe["total_params"]),
        f"[bold]{pe['host_bytes_per_param']:.3g}",
        "RAM",
        "",
        "summary.json",
    )
    console.print(t)
    terms = pe["step_terms_s"]
    read = pe["base_bytes_read_per_step"]
    t = new_table(
        "LoRA step terms (each layer's base is loaded twice a step: for the forward, and for the backward's "
        "recompute + backward)",
        "term",
        "per step",
    )
    t.add_row("compute (forward, recompute, backward without weight gradients)", fmt_s(terms["compute"]))
    t.add_row("dequantize on the device", fmt_s(terms["dequantize"]))
    if read:
        t.add_row(f"disk read of the base ({fmt_bytes(read)})", fmt_s(terms["disk_read"]))
    t.add_row(
        f"link: base as stored + adapters ({fmt_bytes(pe['base_bytes_loaded_per_step'])} of base)",
        fmt_s(terms["link"]),
    )
    t.add_row("host optimizer (adapters only)", fmt_s(terms["optimizer"]))
    t.add_row(f"[bold]bound by: {pe['bound']}", f"[bold]{fmt_s(pe['bound_s'])}")
    console.print(t)


def render_recompute(rc: dict[str, Any], console: Console) -> None:
    """mode.recompute / keep_layers: each choice's device memory and step, and auto's pick."""
    t = new_table(
        "Recompute choices (mode.recompute, mode.keep_layers; room beyond full: "
        f"{fmt_bytes(max(0.0, rc['room_bytes']))})",
        "choice",
        "device",
        "fits",
        "step",
        "samples/s",
    )
    rows = [(f"{r['policy']}, keep {r['kept_layers']}", r, "") for r in rc["choices"]]
    if rc["configured"] is not None:
        rows.append(("configured", rc["configured"], "bold"))
    rows.append((f"auto picks: {rc['auto']['policy']}, keep {rc['auto']['kept_layers']}", rc["auto"], "bold"))
    for name, r, style in rows:
        t.add_row(
            name,
            fmt_bytes(r["device_bytes"]),
            "yes" if r["fits"] else "[red]no",
            fmt_s(r["step_time_s"]),
            f"{r['samples_per_s']:.4g}",
            style=style,
        )
    console.print(t)


def render_pipeline(p: dict[str, Any], console: Console) -> None:
    """The pipeline's predicted bubble (layered-GA appendix C, §4) and step time, for this (N, P) and the
    other placements and schedules."""
    t = new_table(
        f"Pipeline bubble at {p['num_ubatches']} ubatches (layered-GA appendix C, §4): o = "
        "(P-1)/n_mu/(stages per "
        "rank), the share of the pipeline's time o/(1+o) (paper: messages free); the model runs each rank's "
        f"schedule actions (read off the schedule) in dependency order, each action {fmt_s(p['action_s'])}, "
        "each "
        f"of its 2(S-1)n_mu/P exchanges {fmt_s(p['exchange_s'])} (latency + bytes over the link), a message "
        f"{fmt_s(p['wake_s'])} later where its sender computes",
        "placement",
        "schedule",
        "stages/rank",
        "bubble (paper)",
        "actions",
        "messages",
        "bubble",
        "step",
        "samples/s",
    )
    for row in p["alternatives"]:
        t.add_row(
            row["placement"],
            row["schedule"],
            str(row["stages_per_rank"]),
            f"{row['bubble_predicted_paper']:.1%}",
            str(row["actions_per_rank"]),
            f"{row['messages_per_rank']:.3g}",
            f"{row['bubble_predicted']:.1%}",
            fmt_s(row["step_time_s"]),
            f"{row['samples_per_s']:.4g}",
            style="bold" if row["configured"] else "",
        )
    console.print(t)


def render_compare(cmp: dict[str, Any], console: Console) -> None:
    t = new_table(
        f"Predicted vs measured: {cmp['run_dir']}", "phase", "predicted", "measured", "measured / predicted"
    )
    for k, row in cmp["phases"].items():
        ratio = row["ratio"]
        t.add_row(
            k, fmt_s(row["predicted"]), fmt_s(row["measured"]), f"{ratio:.2f}" if ratio is not None else "-"
        )
    tot = cmp["step"]
    t.add_row(
        "[bold]step",
        f"[bold]{fmt_s(tot['predicted'])}",
        f"[bold]{fmt_s(tot['measured'])}",
        f"[bold]{tot['ratio']:.2f}",
    )
    sp = cmp["samples_per_s"]
    t.add_row("samples/s", f"{sp['predicted']:.4g}", f"{sp['measured']:.4g}", f"{sp['ratio']:.2f}")
    if cmp.get("device_peak"):
        dp = cmp["device_peak"]
        t.add_row("device peak", fmt_bytes(dp["predicted"]), fmt_bytes(dp["measured"]), f"{dp['ratio']:.2f}")
    console.print(t)


def _tier_needed(name: str) -> str:
    if name not in TIERS:
        return "none fits"
    return f"{name} (eps.tier={name})" if TIERS[name].on_disk else name
