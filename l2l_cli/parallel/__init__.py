"""Parallel strategies: how a run's runners spread over ranks beyond plain data parallel, each a package
registered on import (``pipeline/``: layered-GA §4 on ``torch.distributed.pipelining``). ``l2l train``
(session.py) and validation (config/validate.py) reach them through this package, never by name."""

from l2l_cli.parallel import pipeline  # noqa: F401  (registers the built-in)
from l2l_cli.parallel.registry import PARALLEL, ParallelSpec, parallel_for, register_parallel

__all__ = ["PARALLEL", "ParallelSpec", "parallel_for", "register_parallel"]
