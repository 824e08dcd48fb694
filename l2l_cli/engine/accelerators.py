"""Which accelerator a run gets (``device=auto|cpu|cuda|sim``), and the simulated one: compute on the CPU,
a device-memory budget its storage meter enforces (exceeding it is an out-of-memory, like CUDA's), and
host<->device copies through copy-engine threads, one per direction like a GPU's, each taking ``bytes / link
bandwidth``, so prefetch overlap and exposed transfer are real."""

from __future__ import annotations

import torch

from l2l_cli.engine.copies import CopyEngine, LinkCopyEngine
from l2l_cli.engine.device import Accelerator, CudaAccelerator, cuda_available, cuda_device_count
from l2l_cli.problems import ConfigError, Problem
from l2l_cli.profiling.memory import MemoryMeter, StorageMeter


class SimAccelerator(Accelerator):
    kind = "sim"

    def __init__(self, memory_gb: float, link_gbps: float):
        super().__init__(
            torch.device("cpu"),
            StorageMeter(budget_bytes=int(memory_gb * 2**30)),
            LinkCopyEngine(link_gbps, "h2d"),
            LinkCopyEngine(link_gbps, "d2h"),
            memory_gb,
        )
        self.memory_gb, self.link_gbps = memory_gb, link_gbps

    def describe(self) -> str:
        return f"sim ({self.memory_gb:g} GiB device budget, {self.link_gbps:g} GB/s link per direction)"


def make_accelerator(
    kind: str,
    *,
    local_rank: int = 0,
    memory_gb: float | None = None,
    sim_memory_gb: float = 16.0,
    sim_link_gbps: float = 16.0,
    measure_memory: bool = True,
    sample_memory: bool = True,
    eps_threads: int = 0,
    update_kernel: str = "auto",
) -> Accelerator:
    """The accelerator for ``device=kind`` (auto = CUDA when present, else the CPU). ``measure_memory``
    (profile.memory) turns the CPU's storage meter on, ``sample_memory`` (profile.memory_sample) lets it
    skip the op-by-op count in steps that repeat a metered one; the simulator always meters every op (it
    enforces a budget), as does the CPU under ``memory_gb`` (device.memory_gb; CUDA: the allocator's cap).
    ``eps_threads``, ``update_kernel``: the EPS's host update (``eps.*``)."""
    if kind == "auto":
        kind = "cuda" if cuda_available() else "cpu"
    acc: Accelerator
    if kind == "cuda":
        if local_rank >= (gpus := cuda_device_count()):  # never two ranks on one GPU (torchrun's count)
            why = f"local rank {local_rank} has no GPU of its own: {gpus} visible; allowed: at most {gpus}"
            why += " ranks"
            raise ConfigError([Problem("dist.nproc", f"{why} per machine (or torchrun --nproc-per-node)")])
        acc = CudaAccelerator(local_rank, memory_gb)
    elif kind == "sim":
        acc = SimAccelerator(sim_memory_gb, sim_link_gbps)
    else:
        budget = None if memory_gb is None else int(memory_gb * 2**30)  # enforced on every op, as the sim's
        meter = (
            StorageMeter(budget, sample_memory and budget is None)
            if measure_memory or budget
            else MemoryMeter()
        )
        acc = Accelerator(torch.device("cpu"), meter, CopyEngine(), CopyEngine(), memory_gb)
    acc.eps_threads, acc.update_kernel = eps_threads, update_kernel
    return acc
