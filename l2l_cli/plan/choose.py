"""``l2l plan --search``: the config's model and machine as a search target, the rows, and for each row this
tool can run the ``l2l train`` / ``torchrun`` command line that runs it."""

from __future__ import annotations

import shlex
from collections.abc import Collection
from typing import Any

from l2l_cli.models.papers import paper_question
from l2l_cli.plan import scaling as ga
from l2l_cli.plan.budget import budget_of, command_keys, paper_terms
from l2l_cli.plan.candidates import DAY, MIXES, Bounds, Target
from l2l_cli.plan.ga_view import transformer_of
from l2l_cli.plan.hardware import gpus_per_node, half_tflops
from l2l_cli.plan.scaling import GA_BASELINE, GA_IMPROVED, GA_PARTITIONED, METHODS
from l2l_cli.plan.search import Found, search

# overrides the command sets itself (the rest of the user's are passed through)
_OWN = (
    "plan.",
    "dist.",
    "batch.",
    "mode=",
    "mode.",
    "precision=",
    "hardware=",
    "hardware.",
    "task.max_seq_len=",
)


def fmt_time(seconds: float) -> str:
    """Days, or hours below a day."""
    return f"{seconds / DAY:.3g} d" if seconds >= DAY else f"{seconds / 3600:.3g} h"


def links_for(cfg: Any, given: Collection[str] = ()) -> ga.Links:
    """The machine of the search: the hardware preset, the chosen network, the node size. For a model a
    paper analyses (``models/papers.py``), the paper's efficiency and host memory unless the command line
    (``given``, its keys) sets them."""
    hw, plan = cfg.hardware, cfg.plan
    network = hw.network_gbps if plan.network == "infiniband" else hw.ethernet_gbps
    node = hw.node_size if plan.node_size is None else plan.node_size
    rate, host_free = paper_terms(cfg, given)
    mfu = rate if rate is not None else half_tflops(hw) / hw.device_peak_tflops
    host = 0.0 if host_free else hw.host_memory_gb
    return ga.Links(
        peak_flops=hw.device_peak_tflops * 1e12,
        mfu=mfu,
        network_gbps=network,
        tensor_gbps=hw.tensor_link_gbps,
        offload_gbps=hw.offload_gbps,
        device_memory_gib=hw.device_memory_gb,
        pcie_gbps=hw.pcie_gbps,
        node_size=node,
        node_host_memory_gib=host,
        gpus_per_node=gpus_per_node(hw),
        pipe_in_node=True,
    )


def target_for(cfg: Any, given: Collection[str] = ()) -> tuple[Target, Any]:
    """The config's model as the paper's transformer (d_s = model.seq_len, as ``for_config``), its critical
    batch (Table B.1's form for X[x]) and the machine (``links_for``)."""
    from l2l_cli.plan.planner import model_shape

    shape, _ = model_shape(cfg)
    m = transformer_of(shape, int(cfg.model.seq_len))
    b_c = ga.x_critical_batch_size(int(cfg.model.x)) if cfg.model.x is not None else m.critical_batch_size
    return Target(m, b_c, links_for(cfg, given)), shape


def bounds_for(cfg: Any, whole: bool = True, d_s: int | None = None, given: Collection[str] = ()) -> Bounds:
    """The search's bounds; with ``d_s``, the config's budget (``plan/budget.py``; ``given``: the command
    line's keys) as samples of d_s."""
    plan = cfg.plan
    return Bounds(
        samples=budget_of(cfg, given).samples(d_s) if d_s else 0.0,
        max_gpus=int(plan.max_gpus),
        max_days=float(plan.max_days),
        max_overhead=float(plan.max_overhead),
        whole=whole,
        steps=int(plan.train_steps),
        n_l=plan.pipeline_parallel if plan.pipeline_parallel > 1 else 0,
        n_a=plan.tensor_parallel if plan.tensor_parallel > 1 else 0,
    )


def command(
    f: Found, user: list[str], node_size: int, seq: int, max_steps: int | None = None
) -> tuple[str | None, str]:
    """The command line that runs a row here (``trainer.max_steps`` the budget's steps, when given), or None
    and why not. l2l runs data parallelism
    (``dist.nproc``), the modular or contiguous pipeline (``dist.pipeline``) with a partitioned state across
    pipelines (``dist.partition_state``), and layered GA with the state offloaded to its EPS (``mode=l2l``);
    it has no tensor parallelism."""
    c = f.config
    if c.n_a > 1:
        return None, "tensor parallelism (n_a > 1) is not in l2l"
    keys: list[str] = []
    if f.method == GA_IMPROVED and c.n_l == 1:
        # layered GA on each rank: L2L runs every micro-batch through a layer before the next, its state
        # in the host EPS (offloaded) and reduced layer by layer
        keys += ["mode=l2l", "precision=cmp"]
        note = "" if c.offload else "l2l keeps the state in host memory (its EPS): offloaded"
        if c.n_b > 1:
            note += ("; " if note else "") + "each rank's EPS holds the whole state (not partitioned)"
    elif c.offload:
        return (
            None,
            "offload without layered GA is not an l2l mode (method=improved offloads through the EPS)",
        )
    elif f.method == GA_PARTITIONED and c.n_b > 1:
        return (
            None,
            "l2l partitions the state across pipelines only (dist.partition_state with dist.pipeline > 1)",
        )
    else:
        keys += ["mode=baseline_ag", "precision=amp"]
        note = ""
        if c.n_l > 1:
            keys += [f"dist.pipeline={c.n_l}"]
            if f.method == GA_BASELINE:
                keys += ["dist.placement=contiguous", "dist.schedule=1f1b"]
            else:  # §4: the modular pipeline, breadth-first (layered GA across the ranks)
                keys += ["dist.placement=modular", "dist.schedule=breadth_first"]
                if c.n_b > 1:
                    keys += ["dist.partition_state=true"]
    keys += [f"batch.size={c.b_mu * c.n_mu}", f"batch.ubatch_size={c.b_mu}", f"task.max_seq_len={seq}"]
    if max_steps:
        keys += [f"trainer.max_steps={max_steps}"]
    if c.n_gpu > 1:
        keys.insert(0, f"dist.nproc={c.n_gpu}")
    args = " ".join(shlex.quote(a) for a in [*user, *keys])
    if node_size and c.n_gpu > node_size:
        nodes = -(-c.n_gpu // node_size)
        if c.n_gpu % node_size:
            return None, f"{c.n_gpu} ranks do not fill {nodes} nodes of {node_size}"
        launch = (
            f"torchrun --nnodes={nodes} --nproc-per-node={node_size} --rdzv-backend=c10d "
            f"--rdzv-endpoint=$MASTER_ADDR:29500 -m l2l_cli train"
        )
        return f"{launch} {args}", note
    return f"l2l train {args}", note


def setup_of(f: Found, seq: int) -> Any:
    """The ``Setup`` the row's command runs (its mode, precision, batch per rank and ranks), for l2l's own
    memory model; None where no command runs it."""
    from l2l_cli.plan.knobs import Setup

    c = f.config
    batch = c.b_mu * c.n_mu
    if f.method == GA_IMPROVED and c.n_l == 1:
        return Setup("l2l", "device", True, "cmp", seq, batch, c.b_mu, c.n_gpu)
    modular = f.method != GA_BASELINE
    return Setup(
        "baseline_ag",
        None,
        True,
        "amp",
        seq,
        batch,
        c.b_mu,
        c.n_gpu,
        pipeline=c.n_l,
        placement="modular" if modular else "contiguous",
        schedule="breadth_first" if modular else "1f1b",
        partition_state=modular and c.n_l > 1 and c.n_b > 1,
    )


def l2l_fits(f: Found, shape: Any, seq: int, hw: Any) -> str:
    """Why l2l's own memory model (``plan/memory.py``) says the row's command does not fit the machine
    asked about ('' when it fits): a rank's device memory, and a node's host memory, which its ranks share
    (each l2l rank's EPS holds the whole state: l2l does not partition it across data-parallel ranks)."""
    from l2l_cli.plan.hardware import gpus_per_node
    from l2l_cli.plan.memory import memory

    s = setup_of(f, seq).but(reserved=hw.device_reserved_gb * ga.GiB, att_half=hw.attention_bytes_half)
    mem = memory(shape, s)
    dev, host = sum(mem["device"].values()), sum(mem["host"].values())
    on_node = max(1, min(s.nproc, gpus_per_node(hw)))
    if dev > hw.device_memory_gb * ga.GiB:
        return (
            f"l2l's {s.mode} needs {dev / ga.GiB:,.1f} GiB per GPU > "
            f"hardware.device_memory_gb={hw.device_memory_gb:g}"
        )
    if on_node * host > hw.host_memory_gb * ga.GiB:
        return (
            f"{on_node} ranks on a node, each EPS holding the whole state: {on_node * host / ga.GiB:,.0f} "
            "GiB "
            f"host memory > hardware.host_memory_gb={hw.host_memory_gb:g} (per node)"
        )
    return ""


def search_plan(cfg: Any, overrides: list[str]) -> dict[str, Any]:
    """Everything ``l2l plan --search`` prints, as one JSON-ready dict. The rows are the paper's selection;
    a row l2l cannot run (tensor parallelism, offload without its EPS, a state partitioned without a
    pipeline, an EPS per rank that the node's host memory cannot hold) is marked and never the best: the
    best is the fastest row l2l runs, ties to fewer GPUs, then less offload."""
    import math

    from l2l_cli.plan.hardware import gpus_per_node

    given = command_keys(overrides)
    t, shape = target_for(cfg, given)
    b = bounds_for(cfg, d_s=t.model.d_s, given=given)
    budget = budget_of(cfg, given)
    plan, hw = cfg.plan, cfg.hardware
    mixes = tuple(MIXES) if plan.parallelism == "all" else (plan.parallelism,)
    methods = METHODS if plan.method == "all" else (plan.method,)
    rows, missing = search(t, b, methods, mixes)
    user = [o for o in overrides if not o.startswith(_OWN)]
    out_rows, notes, runs = [], [], []
    per_node = gpus_per_node(hw)
    for f in rows:
        row = f.row()
        steps = math.ceil(b.samples / f.config.b - 1e-9) if b.samples else None
        cmd, why = command(f, user, t.links.node_size, t.model.d_s, steps)
        if cmd and (short := l2l_fits(f, shape, t.model.d_s, hw)):
            cmd, why = None, short
        row["command"] = cmd
        row["l2l_runs"] = cmd is not None
        row["steps"] = b.samples / f.config.b if b.samples else None
        if why:
            notes.append(f"{f.mix} / {f.method}: {why}")
        out_rows.append(row)
        runs.append(cmd is not None)

    def key(f: Found, ok: bool) -> tuple:
        return (round(f.time_s / fastest_s, 6), f.config.n_gpu, f.config.offload, not ok)

    fastest_s = min((f.time_s for f in rows), default=1.0) or 1.0
    order = sorted(zip(rows, runs), key=lambda fr: key(*fr))
    if b.max_days > 0:
        meeting = [fr for fr in order if fr[0].meets_days]
        order = sorted(meeting, key=lambda fr: (fr[0].config.n_gpu, *key(*fr))) + [
            fr for fr in order if not fr[0].meets_days
        ]
    best = next((f for f, ok in order if ok), None)
    paper_best = order[0][0] if order else None
    if paper_best is not None and paper_best is not best:
        notes.append(
            f"the paper's choice, {paper_best.mix} / {paper_best.method} ({fmt_time(paper_best.time_s)}, "
            f"{paper_best.config.n_gpu} GPUs), is not one l2l runs"
        )
    paper = paper_question(cfg.model)
    paper_rate, host_free = paper_terms(cfg, given)
    if host_free:
        notes.append(
            f"offload: no host-memory bound ({paper.source}, Table 6.2); hardware.host_memory_gb sets one "
            "(the l2l column checks it)"
        )
    m = t.model
    return {
        "model": cfg.model.name,
        "params": m.p,
        "params_total": shape.total_params,
        "shape": {"d_l": m.d_l, "d_m": m.d_m, "d_a": m.d_a, "d_s": m.d_s, "n_I": m.n_I},
        "critical_batch_size": t.b_c,
        "hardware": {
            "name": hw.name,
            "peak_tflops": t.links.peak_flops / 1e12,
            "mfu": t.links.mfu,
            "host_memory_gb": hw.host_memory_gb,
            "gpus_per_node": per_node,
            "memory_gb": t.links.device_memory_gib,
            "network": plan.network,
            "network_gbps": t.links.network_gbps,
            "tensor_link_gbps": t.links.tensor_gbps,
            "offload_gbps": t.links.offload_gbps,
            "pcie_gbps": t.links.pcie_gbps,
            "node_size": t.links.node_size,
        },
        "budget": budget.label,
        "budget_samples": b.samples,
        "rate": (
            f"{t.links.rate / 1e12:.4g} TFLOP/s = {t.links.mfu:.0%} of {t.links.peak_flops / 1e12:.4g} peak "
            + (
                f"({paper.source}: peak × efficiency; hardware.mfu asks another)"
                if paper_rate
                else "(hardware.mfu)"
            )
        ),
        "bounds": {
            "max_gpus": b.max_gpus,
            "max_days": b.max_days,
            "max_overhead": b.max_overhead,
            "train_steps": b.steps,
            "parallelism": plan.parallelism,
            "method": plan.method,
        },
        "objective": "fewest GPUs within max_days" if b.max_days > 0 else "shortest time",
        "search": out_rows,
        "best": None
        if best is None
        else {
            "parallelism": best.mix,
            "method": best.method,
            "days": best.time_s / DAY,
            "n_gpu": best.config.n_gpu,
            "command": out_rows[rows.index(best)]["command"],
        },
        "not_found": missing,
        "notes": notes,
    }
