"""Which ranks form a pipeline and which share a pipeline rank across pipelines, and the process groups
each rank builds for them: ranks [d·P, (d+1)·P) are pipeline d (data-parallel rank d), and the ranks with
the same position in every pipeline reduce their gradients together."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist

from l2l_cli.engine.dist import DistContext
from l2l_cli.parallel.pipeline.settings import PipelineSettings


def layout(ctx: DistContext, s: PipelineSettings) -> DistContext:
    """Ranks [d·P, (d+1)·P) form pipeline d and share data shard d; the first pipeline evaluates."""
    P = s.pipeline
    return replace(
        ctx, data_rank=ctx.rank // P, data_world=max(1, ctx.world // P), eval_ranks=tuple(range(P))
    )


def pipeline_position(ctx: DistContext, P: int) -> tuple[int, int, int]:
    """This rank's place: (its pipeline rank, its pipeline's index = data-parallel rank, the pipelines)."""
    if ctx.world % P:
        raise RuntimeError(f"dist.pipeline={P} does not divide the {ctx.world} ranks launched")
    return ctx.rank % P, ctx.rank // P, ctx.world // P


def neighbours(pp_rank: int, dp_rank: int, P: int) -> tuple[int, int]:
    """The global ranks before and after this one in its pipeline (a ring: the last's next is the first)."""
    base = dp_rank * P
    return base + (pp_rank - 1) % P, base + (pp_rank + 1) % P


@dataclass(frozen=True)
class Groups:
    """This rank's process groups: ``pp`` carries the hidden states between pipeline ranks (the run's
    backend: NCCL between GPUs, whose send/recv take device tensors; gloo on CPU); ``dp`` the data-parallel
    reduction; ``pp_host`` the pipeline's small host-side collectives (the loss, the norms, logits, the
    gathered checkpoint): gloo, the same group as ``pp`` where that is gloo."""

    pp: Any
    dp: Any
    pp_host: Any


def pipeline_groups(
    P: int, world: int, pp_rank: int, dp_rank: int, backend: str, dp_backend: str | None = None
) -> Groups:
    """This rank's groups: pipelines are consecutive ranks, data-parallel groups share a pipeline rank;
    every rank creates every group, in the same order, as torch.distributed requires. ``dp_backend``: the
    data-parallel group's when it differs (an EPS reduces host buffers, on gloo)."""
    pp = dp = host = None
    for d in range(world // P):
        ranks = [d * P + i for i in range(P)]
        g = dist.new_group(ranks, backend=backend)
        h = g if backend == "gloo" else dist.new_group(ranks, backend="gloo")
        pp, host = (g, h) if d == dp_rank else (pp, host)
    for i in range(P):
        g = dist.new_group([d * P + i for d in range(world // P)], backend=dp_backend or backend)
        dp = g if i == pp_rank else dp
    return Groups(pp, dp, host)
