"""The plan for one config: memory, fit and step time of a setup, the micro-batch that fits, the papers'
closed forms beside the layer-by-layer model (``equations``), and the modes compared on the same inputs.

The models themselves: ``knobs.py`` (the setup), ``memory.py`` (bytes by part), ``steptime.py`` (seconds by
phase); ``views.py`` builds the plan's other sections from these.
"""

from __future__ import annotations

from typing import Any

from l2l_cli.engine.tiers import TIERS
from l2l_cli.modes import MODES, find_mode
from l2l_cli.plan import costmodel as cm
from l2l_cli.plan.hardware import Rates
from l2l_cli.plan.knobs import Setup
from l2l_cli.plan.memory import memory
from l2l_cli.plan.shapes import ModelShape, device_weight_bytes
from l2l_cli.plan.steptime import step_time


def evaluate(shape: ModelShape, s: Setup, rates: Rates) -> dict[str, Any]:
    """Memory, fit and time of one setup."""
    mem = memory(shape, s)
    dev, host, disk = sum(mem["device"].values()), sum(mem["host"].values()), sum(mem["disk"].values())
    phases = step_time(shape, s, rates)
    total = sum(p.exposed for p in phases.values())
    node = host * rates.ranks_on_node(s.nproc)  # the ranks on a node share its host memory
    fits = dev <= rates.device_memory and node <= rates.host_memory and disk <= rates.disk_free
    return {
        "label": s.label,
        "setup": s,
        "memory": mem,
        "device_bytes": dev,
        "host_bytes": host,
        "host_node_bytes": node,
        "disk_bytes": disk,
        "fits": fits,
        "phases": phases,
        "step_time_s": total,
        "samples_per_s": s.batch * s.data_parallel / total if total > 0 else float("inf"),
    }


def fits(shape: ModelShape, s: Setup, rates: Rates) -> bool:
    mem = memory(shape, s)
    return (
        sum(mem["device"].values()) <= rates.device_memory
        and sum(mem["host"].values()) * rates.ranks_on_node(s.nproc) <= rates.host_memory
        and sum(mem["disk"].values()) <= rates.disk_free
    )


def eps_tier(shape: ModelShape, s: Setup, rates: Rates) -> dict[str, Any] | None:
    """Which tier the EPS needs for this model (the L2L modes): ``host`` when its state fits in host RAM,
    ``disk`` when only the disk tier fits (its layer files on disk, a few layers in RAM), else ``none``;
    with each tier's host, disk and step-time numbers."""
    if not s.l2l:
        return None
    tiers = {}
    for tier in TIERS:  # the registered tiers, host first
        r = evaluate(shape, s.but(tier=tier), rates)
        tiers[tier] = {
            "host_bytes": r["host_bytes"],
            "disk_bytes": r["disk_bytes"],
            "fits": r["fits"],
            "host_fits": r["host_node_bytes"] <= rates.host_memory,
            "disk_fits": r["disk_bytes"] <= rates.disk_free,
            "step_time_s": r["step_time_s"],
            "disk_wait_s": r["phases"]["disk_wait"].exposed,
            "disk_hidden_s": r["phases"]["disk_wait"].hidden,
        }
    # a tier in RAM needs its state to fit there; one on disk needs the whole run (disk, RAM, device) to fit
    needed = next(
        (t for t, r in tiers.items() if (r["fits"] if TIERS[t].on_disk else r["host_fits"])),
        "none",
    )
    return {"configured": s.tier, "needed": needed, "cache_layers": s.cache_layers, **tiers}


def largest_ubatch(shape: ModelShape, s: Setup, rates: Rates) -> int | None:
    """The largest micro-batch (a divisor of batch.size) that fits the budgets, or None."""
    for ub in sorted((d for d in range(1, s.batch + 1) if s.batch % d == 0), reverse=True):
        if not s.spec.microbatches and ub != s.batch:
            break
        if fits(shape, s.but(ubatch=ub), rates):
            return ub
    return None


def largest_ubatch_any(shape: ModelShape, s: Setup, rates: Rates, cap: int = 1 << 16) -> int | None:
    """The largest micro-batch that fits with the same number of micro-batches (batch.size scaled)."""
    u = s.num_ubatches
    if not fits(shape, s.but(ubatch=1, batch=u), rates):
        return None
    lo, hi = 1, 2
    while hi <= cap and fits(shape, s.but(ubatch=hi, batch=hi * u), rates):
        lo, hi = hi, hi * 2
    if hi > cap:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(shape, s.but(ubatch=mid, batch=mid * u), rates) else (lo, mid)
    return lo


def single_layer_need(shape: ModelShape, s: Setup) -> float:
    """Device bytes L2L needs at the least: one slot for the largest layer and its gradient, and one
    sample's working set with the stash on the host."""
    relay = find_mode(host_state="eps", overlapped_update=False).name  # plain L2L (Alg. 3)
    m = memory(shape, s.but(mode=relay, stash="cpu", prefetch=False, ubatch=1, batch=1))
    return sum(m["device"].values())


def recommend(shape: ModelShape, s: Setup, rates: Rates, max_overhead: float) -> dict[str, Any]:
    """The #ubatches that bounds L2L's transfer share (l2l-v2 eq. 4) and the largest ubatch that fits."""
    ub = largest_ubatch(shape, s, rates)
    ub_any = largest_ubatch_any(shape, s, rates)
    basis = ub or s.ubatch
    lt = rates.layer_times(shape, s.seq, basis)
    C = lt.block_fwd
    pe = shape.peft
    if pe:  # a block's adapters in the compute type and its base as stored
        X = rates.copy_time(pe.block.trainable * device_weight_bytes(s.precision) + pe.block.stored)
    else:
        X = rates.copy_time(shape.block_params * device_weight_bytes(s.precision))
    u_min = cm.min_ubatches(C, X, max_overhead) if C > 0 else None
    return {
        "max_transfer_overhead": max_overhead,
        "layer_forward_s": C,
        "layer_transfer_s": X,
        "num_ubatches_min": u_min,
        "transfer_overhead_now": cm.transfer_overhead(s.num_ubatches, C, X) if C > 0 else None,
        "ubatch_basis": basis,
        "batch_size_for_overhead": u_min * basis if u_min else None,
        "max_ubatch_size": ub,
        "max_ubatch_size_any": ub_any,
        "single_layer_device_bytes": single_layer_need(shape, s),
    }


def equations(shape: ModelShape, s: Setup, rates: Rates) -> dict[str, float]:
    """The papers' closed forms for this config (N blocks only, as the papers count them)."""
    N, u, mb, ub = shape.num_layers, s.num_ubatches, s.batch, s.ubatch
    lt = rates.layer_times(shape, s.seq, ub)
    L = shape.block_params * device_weight_bytes(s.precision)
    Hb = L / rates.copy_time(L) if L else rates.h2d
    X, A = shape.block_saved_bytes(s.seq, s.precision, s.att_half), shape.output_bytes(s.seq, s.precision)
    L_state = shape.block_params * 4.0
    P = shape.total_params
    Ft, Bt = lt.block_fwd, lt.block_bwd
    return {
        "eq1_baseline_memory_bytes": cm.baseline_memory(N, L_state, mb, X, A, ubatch=ub),
        "eq2_l2l_memory_bytes": cm.l2l_memory(N, L, mb, X, A, ubatch=ub),
        "eq3_l2l_p_memory_bytes": cm.l2l_p_memory(N, L, mb, X, A, ubatch=ub),
        "eq4_l2l_p_stash_cpu_memory_bytes": cm.l2l_p_memory_stash_cpu(L, mb, X, ubatch=ub),
        "eq5_baseline_s": cm.baseline_time(N, u, Ft, Bt, rates.device_update_time(P)),
        "eq6_l2l_s": cm.l2l_time(N, u, Ft, Bt, L, Hb, rates.host_update_time(P)),
        "eq7_l2l_p_s": cm.l2l_p_time(N, u, Ft, Bt, L, Hb, rates.host_update_time(P)),
        "v2_eq4_total_s": cm.v2_total_time(N, u, Ft, L / Hb),
        "v2_eq6_samples_per_s": cm.v2_training_throughput(N, u, ub, Ft, L / Hb) if Ft > 0 else 0.0,
    }


def compare_setups(s: Setup) -> list[Setup]:
    """Every registered mode at the config's batch, once per stash option (a mode without micro-batches
    runs the batch whole; the others split it as configured); in a pipeline, the modes a stage can run."""
    out = []
    for spec in MODES.values():
        if s.pipeline > 1 and not spec.pipeline_stage:
            continue
        ub = s.ubatch if spec.microbatches else s.batch
        for stash in spec.stash or (None,):
            out.append(s.but(mode=spec.name, stash=stash, ubatch=ub))
    return out


def compare_modes(shape: ModelShape, s: Setup, rates: Rates) -> list[dict[str, Any]]:
    """Every mode at the config's batch, side by side."""
    rows = []
    for alt in compare_setups(s):
        r = evaluate(shape, alt, rates)
        rows.append(
            {
                "method": r["label"],
                "ubatch_size": alt.ubatch,
                "num_ubatches": alt.num_ubatches,
                "device_bytes": r["device_bytes"],
                "host_bytes": r["host_bytes"],
                "fits": r["fits"],
                "step_time_s": r["step_time_s"],
                "samples_per_s": r["samples_per_s"],
                "configured": alt == s,
            }
        )
    return rows
