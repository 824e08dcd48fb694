"""The planner's own config rules: ``plan.*`` (the parallelism it evaluates) and ``hardware.*`` (rates)."""

from __future__ import annotations

from typing import Any

from l2l_cli.problems import Problem, at_least, divisors, one_of, positive


def plan_problems(cfg: Any) -> list[Problem]:
    """plan.* and hardware.*: the analytic model's own keys (what ``l2l plan`` evaluates)."""
    p: list[Problem] = []
    m, plan = cfg.model, cfg.plan
    if not (0.0 < plan.max_transfer_overhead < 1.0):
        p.append(
            Problem("plan.max_transfer_overhead", f"got {plan.max_transfer_overhead}; must be in (0, 1)")
        )
    for k in ("tensor_parallel", "pipeline_parallel", "data_parallel", "train_steps", "measure_repeats"):
        at_least(p, f"plan.{k}", getattr(plan, k), 1)
    na, nl = plan.tensor_parallel, plan.pipeline_parallel
    if na >= 1 and m.num_heads >= 1 and m.num_heads % na:
        p.append(
            Problem(
                "plan.tensor_parallel",
                f"{na} does not divide model.num_heads={m.num_heads} (tensor parallelism splits the heads); "
                f"allowed: a divisor of {m.num_heads} ({divisors(m.num_heads)})",
            )
        )
    if nl > m.num_layers >= 1:
        p.append(
            Problem(
                "plan.pipeline_parallel",
                f"got {nl}; a pipeline stage needs at least one layer: must be <= "
                f"model.num_layers={m.num_layers}",
            )
        )
    budget = [k for k in ("tokens", "steps") if getattr(plan, k)]
    for k in budget:
        if getattr(plan, k) < 0:
            p.append(Problem(f"plan.{k}", f"got {getattr(plan, k)}; must be > 0 (0: unset)"))
    if len(budget) > 1:
        p.append(Problem("plan.tokens", "and plan.steps: one training budget at a time; give one of them"))
    hw = cfg.hardware
    if not (0.0 < hw.mfu <= 1.0):
        p.append(Problem("hardware.mfu", f"got {hw.mfu}; must be in (0, 1] (a share of device_peak_tflops)"))
    if hw.device_tflops_half is not None:
        positive(p, "hardware.device_tflops_half", hw.device_tflops_half)
    if hw.gpus_per_node is not None:
        at_least(p, "hardware.gpus_per_node", hw.gpus_per_node, 1)
    for k in (
        "device_tflops",
        "device_peak_tflops",
        "backward_factor",
        "device_memory_gbps",
        "device_memory_gb",
        "device_optim_gflops",
        "host_gflops",
        "host_memory_gb",
        "h2d_gbps",
        "network_gbps",
        "offload_gbps",
        "disk_read_gbps",
        "disk_write_gbps",
        "disk_free_gb",
    ):
        positive(p, f"hardware.{k}", getattr(hw, k))
    for k in ("pipe_action_us", "pipe_wake_us"):
        if getattr(hw, k) < 0:
            p.append(Problem(f"hardware.{k}", f"got {getattr(hw, k)}; must be >= 0"))
    if hw.p2p_latency_us < 0:
        p.append(Problem("hardware.p2p_latency_us", f"got {hw.p2p_latency_us}; must be >= 0"))
    from l2l_cli.config.schema import PIPE_LINKS

    one_of(p, "hardware.pipe_link", hw.pipe_link, PIPE_LINKS)
    if hw.disk_mixed_gbps < 0:
        p.append(Problem("hardware.disk_mixed_gbps", f"got {hw.disk_mixed_gbps}; must be >= 0 (0: unknown)"))
    if hw.tensor_link_gbps < 0:
        p.append(Problem("hardware.tensor_link_gbps", f"got {hw.tensor_link_gbps}; must be >= 0 (0: none)"))
    return p + search_problems(cfg)


def search_problems(cfg: Any) -> list[Problem]:
    """The keys of ``l2l plan --search`` / ``--scaling`` (layered-GA §5's bounds)."""
    from l2l_cli.config.schema import PLAN_NETWORKS
    from l2l_cli.plan.candidates import MIXES
    from l2l_cli.plan.scaling import METHODS

    p: list[Problem] = []
    plan, hw = cfg.plan, cfg.hardware
    if plan.network not in PLAN_NETWORKS:
        p.append(Problem("plan.network", f"got {plan.network!r}; allowed: {', '.join(PLAN_NETWORKS)}"))
    if plan.parallelism not in ("all", *MIXES):
        p.append(Problem("plan.parallelism", f"got {plan.parallelism!r}; allowed: all, {', '.join(MIXES)}"))
    if plan.method not in ("all", *METHODS):
        p.append(Problem("plan.method", f"got {plan.method!r}; allowed: all, {', '.join(METHODS)}"))
    for k in ("max_gpus", "max_days"):
        if getattr(plan, k) < 0:
            p.append(Problem(f"plan.{k}", f"got {getattr(plan, k)}; must be >= 0 (0: no bound)"))
    if plan.node_size is not None and plan.node_size < 0:
        p.append(Problem("plan.node_size", f"got {plan.node_size}; must be >= 0 (0: no limit), or unset"))
    if not (0.0 < plan.max_overhead <= 1.0):
        p.append(Problem("plan.max_overhead", f"got {plan.max_overhead}; must be in (0, 1]"))
    at_least(p, "plan.scaling_points", plan.scaling_points, 2)
    for k in ("pcie_gbps", "ethernet_gbps"):
        if getattr(hw, k) < 0:
            p.append(Problem(f"hardware.{k}", f"got {getattr(hw, k)}; must be >= 0 (0: none)"))
    at_least(p, "hardware.node_size", hw.node_size, 1)
    return p
