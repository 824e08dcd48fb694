"""Model families a paper analyses, and the question that paper asks of them: ``l2l plan`` answers it for
such a model unless the command line asks another.

The layered-GA paper's X[x] family (appendix B; ``model=x model.x=...``) is the only one: §6 trains it for
100,000 steps at the critical batch (eq. 2), times each configuration at the device's peak × the
configuration's efficiency (§5 "Resource usage": the kernels' own efficiency is not considered) and bounds
offload by no host memory (Table 6.2 offloads 61.2K GB from one GPU). Without these, ``l2l plan --search
model=x model.x=160`` answers a fine-tune of ``batch.size`` on the preset's published efficiency, not
Table 6.1. Imports nothing of torch (``l2l plan`` reads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PaperQuestion:
    """What a paper assumes when it times a model family; each field is a default a command line may
    override (its keys are named in ``overrides``)."""

    source: str  # where the paper asks it (plan titles name it)
    mfu: float  # the share of peak each configuration is timed at (hardware.mfu)
    host_memory_bound: bool  # whether offload is bounded by a node's host memory (hardware.host_memory_gb)
    # the budget: plan.train_steps steps at the critical batch (a budget given on the command line wins)
    budget_keys: tuple[str, ...] = ("plan.tokens", "plan.steps", "batch.size")
    rate_keys: tuple[str, ...] = ("hardware.mfu", "hardware.device_tflops_half")
    host_keys: tuple[str, ...] = ("hardware.host_memory_gb", "hardware.gpus_per_node")


LAYERED_GA = PaperQuestion(source="layered-GA §6", mfu=1.0, host_memory_bound=False)


def paper_question(model: Any) -> PaperQuestion | None:
    """The paper whose question a model's ``model.*`` keys declare: X[x] (``model.x`` set, as ``model=x``
    sets it) is the layered-GA paper's; every other model is the user's own (None)."""
    return LAYERED_GA if model.x is not None else None
