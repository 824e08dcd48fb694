"""One runner per algorithm of the papers; ``make_runner`` picks it from ``mode.name``."""

from __future__ import annotations

from typing import Any

from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.dist import DistContext
from l2l_cli.engine.precision import Precision
from l2l_cli.models.bert import ModelSpec
from l2l_cli.runners.common import Runner


def make_runner(
    cfg: Any,
    acc: Accelerator,
    spec: ModelSpec,
    precision: Precision,
    total_steps: int,
    dist: DistContext | None = None,
) -> Runner:
    from l2l_cli.runners.baseline import BaselineRunner
    from l2l_cli.runners.baseline_ag import BaselineAGRunner
    from l2l_cli.runners.l2l import L2LRunner
    from l2l_cli.runners.l2l_p import L2LPRunner

    runners: dict[str, type[Runner]] = {
        "baseline": BaselineRunner,
        "baseline_ag": BaselineAGRunner,
        "l2l": L2LRunner,
        "l2l_p": L2LPRunner,
    }
    return runners[cfg.mode.name](cfg, acc, spec, precision, total_steps, dist=dist)
