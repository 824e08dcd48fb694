"""The parallel-strategy registry: one :class:`ParallelSpec` per way of spreading a run over ranks beyond
plain data parallel, registered by the strategy's own package (``parallel/pipeline/``).

The session asks ``parallel_for(cfg)`` and validation runs every strategy's ``validate``; neither names a
strategy, so a new one is a package of its own and a ``register_parallel(ParallelSpec(...))``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from l2l_cli.engine.dist import DistContext
    from l2l_cli.modes.base import Runner, RunnerArgs
    from l2l_cli.modes.registry import ModeSpec
    from l2l_cli.problems import Problem


@dataclass(frozen=True)
class ParallelSpec:
    """A parallel strategy chosen by the config (pipeline parallelism when ``dist.pipeline > 1``).

    The mode still names the algorithm (``mode=baseline_ag``: what each pipeline stage runs); the strategy
    builds the runner around it, says which ranks share a data shard and evaluate together, and checks its
    own config keys. The session asks ``parallel_for(cfg)``, never a name, so a strategy is one package too.
    """

    name: str
    description: str
    selected: Callable[[Any], bool]  # cfg -> whether this run uses the strategy
    settings: Callable[[Any], Any]  # cfg -> its typed settings (``RunnerArgs.parallel``)
    runner: Callable[[RunnerArgs, ModeSpec], Runner]  # (args, the per-part mode) -> the runner
    layout: Callable[[DistContext, Any], DistContext]  # this rank's data shard and evaluation ranks
    validate: Callable[[Any], list[Problem]]  # its keys' rules (run for every config, selected or not)


PARALLEL: dict[str, ParallelSpec] = {}


def register_parallel(spec: ParallelSpec) -> ParallelSpec:
    PARALLEL[spec.name] = spec
    return spec


def parallel_for(cfg: Any) -> ParallelSpec | None:
    """The strategy this config runs under (None: one process, or plain data parallel)."""
    for spec in PARALLEL.values():
        if spec.selected(cfg):
            return spec
    return None
