"""``l2l plan --search``: the config's model and machine as a search target, the rows, and for each row this
tool can run the ``l2l train`` / ``torchrun`` command line that runs it."""

from __future__ import annotations

import shlex
from typing import Any

from l2l_cli.plan import scaling as ga
from l2l_cli.plan.scaling import GA_BASELINE, GA_IMPROVED, GA_PARTITIONED, METHODS
from l2l_cli.plan.search import DAY, MIXES, Bounds, Found, Target, search

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


def links_for(cfg: Any) -> ga.Links:
    """The machine of the search: the hardware preset, the chosen network, the node size."""
    hw, plan = cfg.hardware, cfg.plan
    network = hw.network_gbps if plan.network == "infiniband" else hw.ethernet_gbps
    node = hw.node_size if plan.node_size is None else plan.node_size
    return ga.Links(
        peak_flops=hw.device_peak_tflops * 1e12,
        network_gbps=network,
        tensor_gbps=hw.tensor_link_gbps,
        offload_gbps=hw.offload_gbps,
        device_memory_gib=hw.device_memory_gb,
        pcie_gbps=hw.pcie_gbps,
        node_size=node,
    )


def target_for(cfg: Any) -> tuple[Target, Any]:
    """The config's model as the paper's transformer (d_s = model.seq_len, as ``for_config``), its critical
    batch (Table B.1's form for X[x]) and the machine."""
    from l2l_cli.plan.planner import model_shape

    shape, _ = model_shape(cfg)
    m = ga.transformer_of(shape, int(cfg.model.seq_len))
    b_c = ga.x_critical_batch_size(int(cfg.model.x)) if cfg.model.x is not None else m.critical_batch_size
    return Target(m, b_c, links_for(cfg)), shape


def bounds_for(cfg: Any, whole: bool = True) -> Bounds:
    plan = cfg.plan
    return Bounds(
        max_gpus=int(plan.max_gpus),
        max_days=float(plan.max_days),
        max_overhead=float(plan.max_overhead),
        whole=whole,
        steps=int(plan.train_steps),
        n_l=plan.pipeline_parallel if plan.pipeline_parallel > 1 else 0,
        n_a=plan.tensor_parallel if plan.tensor_parallel > 1 else 0,
    )


def command(f: Found, user: list[str], node_size: int, seq: int) -> tuple[str | None, str]:
    """The command line that runs a row here, or None and why not. l2l runs data parallelism
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


def search_plan(cfg: Any, overrides: list[str]) -> dict[str, Any]:
    """Everything ``l2l plan --search`` prints, as one JSON-ready dict."""
    t, shape = target_for(cfg)
    b = bounds_for(cfg)
    plan = cfg.plan
    mixes = tuple(MIXES) if plan.parallelism == "all" else (plan.parallelism,)
    methods = METHODS if plan.method == "all" else (plan.method,)
    rows, missing = search(t, b, methods, mixes)
    user = [o for o in overrides if not o.startswith(_OWN)]
    out_rows, notes = [], []
    for f in rows:
        row = f.row()
        cmd, why = command(f, user, t.links.node_size, t.model.d_s)
        row["command"] = cmd
        if why:
            notes.append(f"{f.mix} / {f.method}: {why}")
        out_rows.append(row)
    best = min(rows, key=lambda f: (f.time_s, f.config.n_gpu), default=None)
    if b.max_days > 0:
        meeting = [f for f in rows if f.meets_days]
        best = min(meeting, key=lambda f: (f.config.n_gpu, f.time_s), default=best)
    m = t.model
    return {
        "model": cfg.model.name,
        "params": m.p,
        "params_total": shape.total_params,
        "shape": {"d_l": m.d_l, "d_m": m.d_m, "d_a": m.d_a, "d_s": m.d_s, "n_I": m.n_I},
        "critical_batch_size": t.b_c,
        "hardware": {
            "name": cfg.hardware.name,
            "peak_tflops": t.links.peak_flops / 1e12,
            "memory_gb": t.links.device_memory_gib,
            "network": plan.network,
            "network_gbps": t.links.network_gbps,
            "tensor_link_gbps": t.links.tensor_gbps,
            "offload_gbps": t.links.offload_gbps,
            "pcie_gbps": t.links.pcie_gbps,
            "node_size": t.links.node_size,
        },
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
        },
        "not_found": missing,
        "notes": notes,
    }
