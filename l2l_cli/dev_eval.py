"""The task's metrics on the dev split, for the trainer's evaluations and ``l2l eval``: which ranks
predict, how a stop request ends an evaluation, and how the ranks agree on it afterwards."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from l2l_cli.data.tasks import TaskData
from l2l_cli.engine.dist import DistContext
from l2l_cli.loop import EvalStopped, StopFlag
from l2l_cli.models import ModelSpec
from l2l_cli.modes import Runner


@dataclass
class DevEvaluator:
    """Evaluates ``runner`` on ``data.dev`` in batches of ``batch_size`` (padded to ``pad_to`` tokens when
    set); the session builds one, the trainer and ``l2l eval`` call it."""

    runner: Runner
    model: ModelSpec
    data: TaskData
    dist: DistContext
    batch_size: int
    pad_to: int | None = None
    stop: StopFlag | None = None

    def __call__(self, on_batch: Callable[[int, int], None] | None = None) -> dict[str, float]:
        """The task's metrics on the dev split: rank 0 evaluates (the weights are identical on every
        rank), the others wait for it; ranks that each hold part of the model (a pipeline's) predict
        together, and rank 0 keeps the metrics. ``on_batch(done, total)`` follows it; a stop requested
        meanwhile (``stop``) ends it at the next batch with :class:`EvalStopped` (a rank that evaluates
        alone; ranks that predict together finish the evaluation). The ranks then agree (a host
        all-reduce): if any was asked to stop, every rank raises :class:`EvalStopped`, so none goes on into
        the next step's collectives alone."""
        runner, dist, stop = self.runner, self.dist, self.stop
        metrics: dict[str, float] = {}
        stopped: EvalStopped | None = None
        size = self.batch_size
        total, done = -(-len(self.data.dev) // size), 0
        alone = len(dist.eval_ranks) == 1  # several ranks predicting together stop together, after
        if dist.rank in dist.eval_ranks:

            def predict(batch: Any) -> torch.Tensor:
                nonlocal done
                if alone and stop is not None and stop.signum:
                    raise EvalStopped(done, total)
                out = runner.predict(batch)
                done += 1
                if on_batch is not None:
                    on_batch(done, total)
                return out

            try:
                metrics = self.model.evaluate(predict, self.data.dev, self.data.spec, size, self.pad_to)
            except EvalStopped as e:
                stopped = e
        asked = stopped is not None or bool(stop is not None and stop.signum)
        if dist.any(asked):  # one verdict for every rank (this is also the ranks' barrier)
            raise stopped or EvalStopped(done if dist.rank in dist.eval_ranks else 0, total)
        return metrics
