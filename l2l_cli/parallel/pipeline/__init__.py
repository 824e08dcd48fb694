"""Pipeline parallelism with layered gradient accumulation (layered-GA §3-§4) on torch's own pipeline
engine, ``dist.pipeline > 1``. A reader's path through it:

- ``settings.py``: the ``dist.*`` keys (``PipelineSettings``), the schedules they name, and their rules;
- ``plan.py``: which layers each stage holds, which rank runs it, and the bubble the paper predicts;
- ``stage.py``: a stage's module (its layers in order) and torch's ``PipelineStage`` timing it;
- ``state.py``: a stage's flat weights, gradients, optimizer shard and moments, and its reduction;
- ``runner.py``: one rank's ``PipelineRunner``: its stages, torch's schedule, the update, checkpoints;
- ``l2l_stages.py``: ``L2LStagesRunner``, stages that run L2L (an EPS mode): each rank's EPS holds its
  stages' layers, relayed once per batch each way, the breadth-first schedule written out as Alg. 3.
"""

from l2l_cli.parallel.pipeline.l2l_stages import L2LStagesRunner, stage_runner
from l2l_cli.parallel.pipeline.plan import StagePlan, plan_of
from l2l_cli.parallel.pipeline.runner import PipelineRunner, layout
from l2l_cli.parallel.pipeline.settings import AUTO_SCHEDULE, SCHEDULES, PipelineSettings, selected, validate
from l2l_cli.parallel.registry import ParallelSpec, register_parallel

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

__all__ = [
    "AUTO_SCHEDULE",
    "SCHEDULES",
    "L2LStagesRunner",
    "PipelineRunner",
    "PipelineSettings",
    "StagePlan",
    "plan_of",
]
