"""Pipeline parallelism with layered gradient accumulation (layered-GA §3-§4) on torch's own pipeline
engine, ``dist.pipeline > 1``. A reader's path through it:

- ``settings.py``: the ``dist.*`` keys (``PipelineSettings``), the schedules they name, and their rules;
- ``plan.py``: which layers each stage holds, which rank runs it, and the bubble the paper predicts;
- ``stage.py``: a stage's module (its layers in order) and torch's ``PipelineStage`` timing it;
- ``state.py``: a stage's flat weights, gradients, optimizer shard and moments, and its reduction;
- ``groups.py``: which ranks form a pipeline, and each rank's process groups;
- ``p2p.py``: what crosses between ranks: hidden states and their gradients, the loss, the logits;
- ``shards.py``: checkpoints of a state no rank holds whole (gathered on rank 0, or written per rank);
- ``bubble.py``: summary.json's ``pipeline`` section, the bubble measured and predicted (reporting only);
- ``calibrate.py``: ``hardware=measure``'s costs of a message and a schedule action, timed once, as a
  runner is built;
- ``runner.py``: one rank's ``PipelineRunner``: its stages, torch's schedule, the update (Alg. 2);
- ``l2l_stages.py``: ``L2LStagesRunner``, stages that run L2L (an EPS mode): each rank's EPS holds its
  stages' layers (``rank_layers.py``), relayed once per batch each way, the breadth-first schedule
  written out as Alg. 3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from l2l_cli.parallel.pipeline.plan import StagePlan, plan_of
from l2l_cli.parallel.pipeline.settings import AUTO_SCHEDULE, SCHEDULES, PipelineSettings, selected, validate
from l2l_cli.parallel.registry import ParallelSpec, register_parallel

if TYPE_CHECKING:
    from l2l_cli.engine.dist import DistContext
    from l2l_cli.modes.base import RunnerArgs, RunnerBase
    from l2l_cli.modes.registry import ModeSpec


# The runners import torch.distributed.pipelining (slow to import): only a pipeline rank pays it, not
# every `l2l` command that registers the strategy (plan, report, validation, a one-process run).
def stage_runner(args: RunnerArgs, mode: ModeSpec) -> RunnerBase:
    """A pipeline rank's runner (L2L stages or torch's schedules: see ``l2l_stages.stage_runner``)."""
    from l2l_cli.parallel.pipeline.l2l_stages import stage_runner as make

    return make(args, mode)


def layout(ctx: DistContext, s: PipelineSettings) -> DistContext:
    """Which ranks share a data shard and evaluate together (``groups.layout``)."""
    from l2l_cli.parallel.pipeline.groups import layout as lay

    return lay(ctx, s)


SPEC = register_parallel(
    ParallelSpec(
        name="pipeline",
        description="layered-GA §4: modular (or contiguous) pipeline stages on torch.distributed.pipelining, "
        "data parallel across pipelines",
        selected=selected,
        settings=PipelineSettings.from_cfg,
        runner=stage_runner,
        layout=layout,
        validate=validate,
    )
)

__all__ = ["AUTO_SCHEDULE", "SCHEDULES", "PipelineSettings", "StagePlan", "layout", "plan_of", "stage_runner"]
