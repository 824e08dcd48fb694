"""Data parallel on torch.distributed: the process group, and launching ranks through torch's elastic
launcher (the same machinery as ``torchrun``) on a free port.

gloo on CPU, NCCL between GPUs for the baselines' DDP. The eager param-server reduces its host gradient
buffers on a gloo group of its own (the paper's "parallel reduce" runs on the EPS, in the background), so
its collectives never interleave with the main thread's.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from l2l_cli.engine.device import cuda_available


@dataclass
class DistContext:
    """This rank's place among the ranks. Plain data parallel: every rank reads its own shard of each
    global minibatch and holds the whole model. A parallel strategy (pipeline parallelism) may give
    several ranks one shard (``data_rank``/``data_world``) and evaluate with several ranks together."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    eps_group: Any = None  # gloo group for the EPS's host-side gradient reduction
    data_rank: int = 0  # which shard of each global minibatch this rank reads
    data_world: int = 1  # how many shards a global minibatch has (the data-parallel degree)
    eval_ranks: tuple[int, ...] = (0,)  # the ranks that run ``predict`` together; rank 0 keeps the metrics
    # the default group's backend (dist.backend, ``auto`` resolved): device tensors' groups
    backend: str = "gloo"
    host_group: Any = None  # gloo group for the main thread's host collectives (None: the default group)
    # the EPS's ranks are the default group's: a layer's gradient can be summed on the device over it
    # (plain data parallel); False: over ``eps_group`` on the host (a pipeline's data-parallel replicas)
    device_reduce: bool = False

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def mean_and_any(self, value: float, flag: int) -> tuple[float, bool]:
        """The mean of a scalar over ranks, and whether any rank raised ``flag`` (one collective per step:
        every rank learns of a stop request at the same step boundary)."""
        if not self.enabled:
            return value, bool(flag)
        t = torch.tensor([value, float(bool(flag))], dtype=torch.float64)  # a host tensor: gloo's
        dist.all_reduce(t, group=self.host_group)
        return float(t[0]) / self.world, bool(t[1] > 0)

    def any(self, flag: bool) -> bool:
        """Whether any rank raised ``flag`` (every rank must call it at the same point)."""
        if not self.enabled:
            return bool(flag)
        t = torch.tensor([int(bool(flag))], dtype=torch.int64)
        dist.all_reduce(t, group=self.host_group)
        return bool(t[0] > 0)

    def data_sum(self, count: int) -> int:
        """The sum of ``count`` over the data shards of a global minibatch: each rank gives its shard's
        count; a shard several ranks read (a pipeline's ranks) is counted once. A host collective."""
        if not self.enabled:
            return count
        t = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(t, group=self.host_group)
        return int(t[0]) // (self.world // self.data_world)

    def gather(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.host_group)
        return out

    def barrier(self) -> None:
        if self.enabled:  # a host barrier (the stop path): NCCL's would be its first op, on a guessed GPU
            dist.barrier(group=self.host_group)


def resolve_backend(backend: str, device: str, cuda: bool | None = None) -> str:
    """``dist.backend`` for ``device``: auto is NCCL where the ranks run on CUDA devices, gloo otherwise."""
    if backend != "auto":
        return backend
    cuda = cuda_available() if cuda is None else cuda
    return "nccl" if device in ("auto", "cuda") and cuda else "gloo"


def from_env(cfg: Any) -> DistContext:
    """Join the process group described by the environment (set by the elastic launcher or torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    backend = resolve_backend(cfg.dist.backend, cfg.device.name)
    timeout = timedelta(seconds=cfg.dist.timeout_s)
    if not dist.is_initialized():  # NCCL: the communicator on this rank's own GPU, created now
        gpu = {"device_id": torch.device("cuda", local_rank)} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=timeout, **gpu)
    eps_group = dist.new_group(backend="gloo", timeout=timeout)
    backend = str(dist.get_backend())  # a group someone else initialised (torchrun's caller) may differ
    # the main thread's host collectives (the loss and stop flag each step, the memory report) need gloo:
    # NCCL refuses host tensors; the EPS thread's group is not shared (collectives on one group from two
    # threads would interleave differently on each rank)
    host = None if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return DistContext(
        rank,
        world,
        local_rank,
        eps_group,
        data_rank=rank,
        data_world=world,
        backend=backend,
        host_group=host,
        device_reduce=True,
    )


def shutdown(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, entrypoint: Any, args: tuple, monitor_s: float = 0.5) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` in ``nproc`` local processes with torch's elastic launcher.

    If a rank dies, the agent stops the others and raises ChildFailedError; the caller turns it into a
    clear message. Returns each rank's return value.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        run_id=f"l2l-{os.getpid()}",
        max_restarts=0,
        monitor_interval=monitor_s,
        shutdown_timeout=120,  # time for ranks to finish the step and checkpoint after a SIGTERM
        start_method="spawn",
    )
    return elastic_launch(config, entrypoint)(*args)


def failure_message(exc: BaseException) -> str:
    """One line naming the rank that failed, from a ChildFailedError."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    rank, info = sorted(failures.items())[0]
    how = f"exit code {info.exitcode}"
    if info.exitcode is not None and info.exitcode < 0:
        how = f"killed by signal {-info.exitcode}"
    msg = info.message if isinstance(info.message, str) else ""
    detail = f": {msg.splitlines()[0]}" if msg and "Signal" not in msg else ""
    return f"rank {rank} failed ({how}){detail}; the other ranks were stopped"
