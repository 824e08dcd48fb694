"""The planner's own config rules: ``plan.*`` (the parallelism it evaluates) and ``hardware.*`` (rates)."""

from __future__ import annotations

from typing import Any

from l2l_cli.problems import Problem, at_least, divisors, positive


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
                f"got {nl}; a pipeline stage needs at least one layer: must be <= model.num_layers={m.num_layers}",
            )
        )
    hw = cfg.hardware
    for k in ("device_tflops", "device_tflops_half", "device_peak_tflops", "backward_factor",
              "device_memory_gb", "device_optim_gflops", "host_gflops", "host_memory_gb", "h2d_gbps",
              "network_gbps", "offload_gbps", "disk_read_gbps", "disk_write_gbps", "disk_free_gb"):  # fmt: skip
        positive(p, f"hardware.{k}", getattr(hw, k))
    if hw.tensor_link_gbps < 0:
        p.append(Problem("hardware.tensor_link_gbps", f"got {hw.tensor_link_gbps}; must be >= 0 (0: none)"))
    return p
