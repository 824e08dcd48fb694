"""The plan's sections beyond memory and time: the LoRA view, the pipeline view, the recompute choices and
the one-line verdict (what does not fit, and the change that would make it fit).
"""

from __future__ import annotations

from typing import Any

from l2l_cli.engine.recompute_plan import MARGIN, SELECTIVE_SHARE, LayerBytes, RecomputeSettings, choose
from l2l_cli.engine.tiers import TIERS
from l2l_cli.plan.estimate import evaluate, single_layer_need
from l2l_cli.plan.hardware import Rates
from l2l_cli.plan.knobs import Setup, stage_plan
from l2l_cli.plan.shapes import ModelShape, act_bytes, device_weight_bytes
from l2l_cli.plan.steptime import (
    dequantize_time,
    exchange_time,
    pipeline_ranks,
    schedule_orders,
    simulate_step,
)
from l2l_cli.problems import fmt_bytes


def peft_view(shape: ModelShape, s: Setup, rates: Rates, result: dict[str, Any]) -> dict[str, Any] | None:
    """``l2l plan``'s LoRA section (``peft=lora``): bytes per parameter where each part lives (the frozen
    base at ``peft.base_dtype`` in RAM or on disk, one dequantized layer per device slot, the adapters'
    training state), the host bytes per parameter a run reports (``summary.json``'s
    ``host_bytes_per_param`` over the model's parameters, ``peft.host_bytes_per_param`` over trainable +
    frozen), and the step's terms: which one bounds it."""
    pe = shape.peft
    if pe is None:
        return None
    P = shape.total_params
    mem = result["memory"]
    e = device_weight_bytes(s.precision)
    host_state = sum(
        v
        for k, v in mem["host"].items()
        if k in ("training_state", "frozen_base", "eps_cache", "eps_grad_pool")
    )
    phases = result["phases"]
    compute = sum(phases[k].exposed + phases[k].hidden for k in ("forward", "recompute", "backward"))
    dequant = dequantize_time(shape, s, rates) if s.l2l else 0.0
    read = pe.bytes_read(s.prefetch) if s.l2l else 0.0
    terms = {
        "compute": compute,
        "dequantize": dequant,
        "disk_read": read / rates.disk_read,
        "link": phases["transfer"].exposed + phases["transfer"].hidden - dequant,
        "optimizer": phases["optimizer"].exposed + phases["optimizer"].hidden,
    }
    # the relay's reads, copies and the host's updates run beside the compute; the dequantize runs on
    # the compute's stream, in line with it
    lanes = {
        "compute + dequantize": compute + dequant,
        "disk read": terms["disk_read"],
        "link": terms["link"],
        "host optimizer": terms["optimizer"],
    }
    bound = max(lanes, key=lanes.get)
    return {
        **pe.summary(P),
        "optimizer": s.optim,
        "state_bytes_per_trainable_param": s.state_bytes_with(pe.small_share),
        "adapter_state_bytes": s.state_bytes_with(pe.small_share) * pe.trainable,
        "base_ram_bytes": mem["host"].get("frozen_base", 0.0),
        "base_readahead_bytes": mem["host"].get("frozen_base_readahead", 0.0),
        "base_disk_bytes": mem["disk"].get("frozen_base_files", 0.0),
        "device_layer_bytes_per_param": float(e) if s.l2l else 4.0,
        "slot_params": pe.max_slot if s.l2l else pe.frozen,
        "device_slot_bytes": mem["device"].get("frozen_base_slots", mem["device"].get("frozen_base", 0.0)),
        "host_bytes_per_param": host_state / P,
        "peft_host_bytes_per_param": host_state / max(1, pe.trainable + pe.frozen),
        "host_bytes_per_param_all": result["host_bytes"] / P,
        "base_loads_per_step": sum(pe.loads(s.prefetch)) if s.l2l else 0,
        "base_bytes_loaded_per_step": pe.bytes_loaded(s.prefetch) if s.l2l else 0.0,
        "base_bytes_read_per_step": read,
        "step_terms_s": terms,
        "bound": bound,
        "bound_s": lanes[bound],
    }


def verdict(shape: ModelShape, s: Setup, rates: Rates, result: dict[str, Any]) -> str:
    """One line: fits, or why not and what to change."""
    if result["fits"]:
        return "fits"
    dev_budget, host_budget = rates.device_memory, rates.host_memory
    need = single_layer_need(shape, s)
    if need > dev_budget:
        fix = "precision=cmp (half-size device copies) or " if s.precision != "cmp" else ""
        return (
            f"does not fit: a single layer needs {fmt_bytes(need)} on the device (the largest layer, "
            f"{shape.max_layer_params / 1e6:.1f}M parameters, and its gradient, with one sample) > budget "
            f"{fmt_bytes(dev_budget)}, so no mode or micro-batch fits; try {fix}a device with more memory"
        )
    pe = shape.peft
    if pe is not None and result["disk_bytes"] > rates.disk_free:
        return (
            f"does not fit: the frozen base's files and the EPS need {fmt_bytes(result['disk_bytes'])} on "
            "disk > "
            f"{fmt_bytes(rates.disk_free)} free; try a lower peft.base_dtype (nf4)"
        )
    if result["disk_bytes"] > rates.disk_free:
        return (
            f"does not fit: the disk EPS needs {fmt_bytes(result['disk_bytes'])} on disk > "
            f"{fmt_bytes(rates.disk_free)} free ({s.disk_state_bytes:.4g} bytes per parameter: two "
            "versions of weights and moments)"
        )
    if pe is not None and s.l2l and result["host_node_bytes"] > host_budget and not pe.on_disk:
        from dataclasses import replace as _replace

        from l2l_cli.config.schema import BASE_SOURCES

        on_disk = _replace(shape, peft=_replace(pe, base_source=BASE_SOURCES[1]))
        alt = evaluate(on_disk, s, rates)
        why = (
            f"host memory needs {fmt_bytes(result['host_node_bytes'])} > {fmt_bytes(host_budget)} per node "
            f"(the frozen base in {pe.base_dtype}: {fmt_bytes(pe.stored)}, "
            f"{pe.base_bytes_per_param:.3g} B/param)"
        )
        if alt["fits"]:
            return (
                f"does not fit: {why}; peft.base_source={BASE_SOURCES[1]} fits: the base on disk "
                f"({fmt_bytes(alt['disk_bytes'])}), {fmt_bytes(alt['host_bytes'])} in RAM, "
                f"~{alt['step_time_s']:.3g} s per step"
            )
        return f"does not fit: {why}; try peft.base_source={BASE_SOURCES[1]} or a lower peft.base_dtype (nf4)"
    if result["host_node_bytes"] > host_budget:
        ranks = rates.ranks_on_node(s.nproc)
        why = (
            f"host memory needs {fmt_bytes(result['host_node_bytes'])}"
            + (f" ({ranks} ranks on a node × {fmt_bytes(result['host_bytes'])})" if ranks > 1 else "")
            + f" > {fmt_bytes(host_budget)} per node"
        )
        if s.disk:
            return f"does not fit: {why} (eps.host_cache_layers={s.cache_layers} layers cached); lower it"
        on_disk = next(t for t, kind in TIERS.items() if kind.on_disk)
        alt = evaluate(shape, s.but(tier=on_disk), rates) if s.l2l else None
        if alt is not None and alt["fits"]:
            return (
                f"does not fit: {why} (the EPS keeps {s.state_bytes:.3g} bytes per parameter in RAM); "
                f"eps.tier={on_disk} fits: "
                f"{fmt_bytes(alt['disk_bytes'])} on disk, {fmt_bytes(alt['host_bytes'])} in RAM with "
                f"eps.host_cache_layers={s.cache_layers}, ~{alt['step_time_s']:.3g} s per step"
            )
        return f"does not fit: {why} (the EPS keeps {s.state_bytes:.3g} bytes per parameter)"
    parts = result["memory"]["device"]
    worst = max(parts, key=parts.get)
    hints = {
        "training_state": "mode=l2l (the training state moves to host memory)",
        "stash": "mode.stash=cpu (the stash moves to host memory)",
        "working_activations": "a smaller batch.ubatch_size",
        "param_grad_buffers": "mode.prefetch=false (one relay slot)"
        if s.precision == "cmp"
        else "precision=cmp",
    }
    return (
        f"does not fit: device needs {fmt_bytes(result['device_bytes'])} > budget {fmt_bytes(dev_budget)} "
        f"(largest part: {worst.replace('_', ' ')}, {fmt_bytes(parts[worst])}); try {hints[worst]}"
    )


def pipeline_view(shape: ModelShape, s: Setup, rates: Rates) -> dict[str, Any] | None:
    """``l2l plan``'s pipeline section: the configured (N, P, placement, schedule), its predicted bubble and
    step time, and the other placements and schedules at the same batch beside it."""
    if s.pipeline <= 1:
        return None
    from l2l_cli.parallel.pipeline.plan import count
    from l2l_cli.parallel.pipeline.settings import SCHEDULES

    rows = []
    for placement in ("modular", "contiguous"):
        lps = s.layers_per_stage if placement == "modular" else 1
        for schedule, (cls, many) in SCHEDULES.items():
            alt = s.but(placement=placement, schedule=schedule, layers_per_stage=lps)
            plan = stage_plan(shape, alt)
            if shape.num_layers % (s.pipeline * plan.block_size) or (plan.stages_per_rank > 1 and not many):
                continue  # the config check refuses it
            r = evaluate(shape, alt, rates)
            exchange = exchange_time(shape, alt, rates)
            # L2L stages: a relay move per layer load or offload, inline where copies do not overlap
            move = rates.copy_time(shape.block_params * device_weight_bytes(alt.precision))
            orders = schedule_orders(shape, alt)
            step, busy = simulate_step(shape, alt, rates, 0.0 if rates.async_copy else move, orders)
            acts = count(orders[0])
            rows.append(
                {
                    "placement": placement,
                    "schedule": schedule,
                    "torch_schedule": cls,
                    "stages_per_rank": plan.stages_per_rank,
                    "bubble_overhead": plan.bubble_overhead(s.num_ubatches),
                    "bubble_predicted": sum(1 - c / step for c in busy) / len(busy) if step > 0 else 0.0,
                    "actions_per_rank": acts.total,
                    "action_s": rates.pipe_action,
                    "wake_s": rates.pipe_wake,
                    "bubble_predicted_paper": plan.bubble_fraction(s.num_ubatches),
                    "messages_per_rank": plan.messages_per_rank(s.num_ubatches),
                    "exchange_s": exchange,
                    "step_time_s": r["step_time_s"],
                    "samples_per_s": r["samples_per_s"],
                    "configured": alt == s,
                }
            )
    mine = next(r for r in rows if r["configured"])
    return {
        "pipeline": s.pipeline,
        "data_parallel": s.data_parallel,
        "placement": s.placement,
        "schedule": s.schedule,
        "num_ubatches": s.num_ubatches,
        "layers_per_stage": s.layers_per_stage,
        "partition_state": s.partition_state,
        "bubble_overhead": mine["bubble_overhead"],
        "bubble_predicted": mine["bubble_predicted"],
        "bubble_predicted_paper": mine["bubble_predicted_paper"],
        "messages_per_rank": mine["messages_per_rank"],
        "exchange_s": mine["exchange_s"],
        "actions_per_rank": mine["actions_per_rank"],
        "action_s": mine["action_s"],
        "wake_s": mine["wake_s"],
        "step_time_s": mine["step_time_s"],
        "samples_per_s": mine["samples_per_s"],
        "ranks": pipeline_ranks(shape, s, rates),
        "alternatives": rows,
    }


def block_bytes(shape: ModelShape, s: Setup) -> LayerBytes:
    """One block's bytes per micro-batch for each recompute policy, from the shape (the runner measures
    them): the input (full), plus the matmul outputs (selective: Q/K/V, scores, context, output
    projection, both FFN matmuls), or everything the block saves (none); and the embeddings' graph (pre),
    kept with every block."""
    e, ub, h = act_bytes(s.precision), s.ubatch, shape.hidden
    a = ub * shape.output_bytes(s.seq, s.precision)
    mm = ub * s.seq * e * (6 * h + shape.intermediate + shape.heads * s.seq)
    return LayerBytes(
        full=int(a),
        selective=int(a + mm),
        none=int(ub * shape.block_saved_bytes(s.seq, s.precision, s.att_half)),
        pre=int(ub * shape.pre_saved_bytes(s.seq, s.precision)),
    )


def recompute_choices(
    shape: ModelShape, s: Setup, rates: Rates, policy: str, keep: Any, base: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """Memory and time of each recompute choice (full, selective, keep_layers 0, N/4, N/2, N) and the one
    ``auto`` picks within the device budget (the runner's rule: :func:`recompute.choose`). A kept block
    skips its recompute; a selective one still runs its elementwise share (``SELECTIVE_SHARE``); with
    every block kept the embeddings keep their graph too, and nothing is recomputed."""
    if not s.l2l or s.pipeline > 1:
        return None
    base = base or evaluate(shape, s, rates)  # (the caller's evaluation of ``s``, when it has one)
    dev = base["memory"]["device"]
    N, n = shape.num_layers, s.num_ubatches
    per = block_bytes(shape, s)
    lt = rates.layer_times(shape, s.seq, s.ubatch)
    rec = n * lt.block_fwd_grad  # one block's recompute, every micro-batch
    rec_pre = n * lt.pre_fwd_grad  # the embeddings', saved only when every block is kept
    on_device = s.stash != "cpu"
    # the runner plans in the device's free bytes once built: all but the stash and the working set
    resident = sum(v for k, v in dev.items() if k not in ("stash", "working_activations"))
    room = (
        MARGIN * (rates.device_memory - resident)
        - (N * n if on_device else 2) * per.full
        - 2 * n * per.full
        - 2 * per.none
    )

    def row(pol: str, kept: int) -> dict[str, Any]:
        plan = choose(RecomputeSettings(pol, kept), N, per, n, room, stash_on_device=on_device)
        stash = n * per.full if on_device else 0
        extra = plan.kept * (n * per.none - stash) + plan.every_layer_kept * n * per.pre
        if plan.policy == "selective":
            extra += (N - plan.kept) * (n * per.selective - stash)
        saved = plan.kept * rec + (N - plan.kept) * rec * (1 - SELECTIVE_SHARE) * (plan.policy == "selective")
        saved += rec_pre * plan.every_layer_kept
        step = base["step_time_s"] - saved
        device = base["device_bytes"] + extra
        return {
            "policy": plan.section()["policy"],
            "kept_layers": plan.kept,
            "device_bytes": device,
            "fits": device <= rates.device_memory,
            "step_time_s": step,
            "samples_per_s": s.batch * s.data_parallel / step if step > 0 else float("inf"),
        }

    rows = [row("full", 0), row("selective", 0)]
    for k in sorted({N // 4, N // 2, N} - {0}):
        rows.append(row("full", k))
    pick = choose(RecomputeSettings("auto", "auto"), N, per, n, room, stash_on_device=on_device)
    auto = row(pick.policy, pick.kept)
    configured = None
    if policy != "auto" and keep != "auto":
        configured = row(policy, int(keep or 0) if policy != "none" else N)
    return {"choices": rows, "auto": auto, "configured": configured, "room_bytes": room}
