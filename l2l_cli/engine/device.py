"""The accelerator a runner executes on: CPU, CUDA, or the simulated accelerator (``device=sim``).

Runners never branch on the device: they ask the accelerator for device and host buffers, copy through its
copy engines, seed dropout through it, and measure with its meter.

- ``cpu``: the device tier is the CPU itself; copies are done inline; a storage meter measures memory.
- ``cuda``: a side stream per copy direction with events; pinned host buffers; the allocator's statistics.
- ``sim`` (engine/accelerators.py, which also picks a run's accelerator): compute on the CPU under an
  enforced device-memory budget, copies at a link's rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from typing import Any

import torch

from l2l_cli.engine.copies import AllOf, CopyEngine, CopyHandle, same_dtype
from l2l_cli.engine.host_passes import HostPasses, compute_threads
from l2l_cli.profiling.memory import CudaMeter, DeviceOutOfMemory, MemoryMeter

# ---- torch.cuda, in one place: the CPU, sim and CUDA paths differ here (tests/test_architecture.py) ------


def cuda_available() -> bool:
    return bool(torch.cuda.is_available())


def cuda_device_count() -> int:
    return int(torch.cuda.device_count()) if cuda_available() else 0


def cuda_total_memory(index: int = 0) -> float:
    """Bytes of CUDA device ``index``'s memory."""
    return float(torch.cuda.get_device_properties(index).total_memory)


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has run the work queued on it (nothing off CUDA): a clock read after times it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timing_event() -> Any:
    """A CUDA event that can time the stream work between two of them (``elapsed_time``)."""
    return torch.cuda.Event(enable_timing=True)


_SPIN_CYCLES: dict[int, float] = {}  # a CUDA device's spin-kernel cycles per second, timed once


def keep_busy(device: torch.device, seconds: float) -> None:
    """Occupy ``device`` for ``seconds`` as a layer's chunk does: on CUDA a kernel spins on the GPU (queued,
    the host returns at once, and the stream's events time it); elsewhere the host's core spins."""
    if device.type != "cuda":
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
        return
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SPIN_CYCLES:  # the spin's rate, on this device's clock
        n, a, b = 1 << 22, timing_event(), timing_event()
        torch.cuda._sleep(n)  # warm-up
        a.record()
        torch.cuda._sleep(n)
        b.record()
        b.synchronize()
        _SPIN_CYCLES[i] = n / max(a.elapsed_time(b) / 1e3, 1e-9)
    torch.cuda._sleep(int(seconds * _SPIN_CYCLES[i]))


def own_cuda_index(device: torch.device | None) -> int | None:
    """The index of this rank's CUDA device (``device``; None: the current one, which the accelerator set),
    or None off CUDA."""
    if not cuda_available() or (device is not None and device.type != "cuda"):
        return None
    return device.index if device is not None and device.index is not None else torch.cuda.current_device()


def cuda_rng_state(device: torch.device | None = None) -> torch.Tensor | None:
    """The RNG state of this rank's own CUDA device (None off CUDA). Only its own: another rank draws on
    the other devices, and a resume may see fewer of them (one GPU instead of two, a narrower
    ``CUDA_VISIBLE_DEVICES``)."""
    index = own_cuda_index(device)
    return None if index is None else torch.cuda.get_rng_state(index)


def set_cuda_rng_state(state: torch.Tensor, device: torch.device | None = None) -> None:
    """Restore this rank's own CUDA device's RNG state (nothing off CUDA)."""
    index = own_cuda_index(device)
    if index is not None:
        torch.cuda.set_rng_state(state, index)


# CUDA graphs (engine/graphs.py): one pool for a run's graphs; a capture thread-local (the relay's and the
# EPS's threads go on copying and waiting meanwhile); warm-up on a side stream


def graph_pool() -> Any:
    return torch.cuda.graph_pool_handle()


def capture_graph(fn: Callable[[], Any], pool: Any) -> tuple[Callable[[], None], Any]:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph.replay, out


def on_side_stream(device: torch.device, fn: Callable[[], Any]) -> None:
    main, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        fn()
    main.wait_stream(side)


class CudaAllocator:
    """The caching allocator's counters of one CUDA device, as ``profiling.memory.CudaMeter`` reads them
    (tests hand the meter a fake with the same three methods)."""

    def __init__(self, device: torch.device):
        self.device = device

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def max_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


class _CudaHandle(CopyHandle):
    __slots__ = ("event", "host")

    def __init__(self, event: Any, host: bool):
        self.event, self.host = event, host

    def wait(self) -> None:
        # a host consumer blocks (not where the copy is done: a query, no synchronize); a device consumer
        # only orders its stream after the copy
        if self.host:
            if not self.event.query():
                self.event.synchronize()
        else:
            torch.cuda.current_stream().wait_event(self.event)

    def wait_device(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)  # no host synchronize: the stream waits

    def done(self) -> bool:
        return self.event.query()


class CudaCopyEngine(CopyEngine):
    """A side stream per direction; ``after`` is an event the copy must wait for (buffer reuse)."""

    def __init__(self, device: torch.device, to_host: bool):
        super().__init__()
        self.stream = torch.cuda.Stream(device)
        self.to_host = to_host

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> CopyHandle:
        """On this engine's stream, after ``after``: a CUDA event the compute stream recorded (a slot it is
        done with), or another copy's handle (an event dependency between the streams, never a host wait;
        the copy also follows the compute queued so far), or, without one, after the compute queued so far.
        The host side must be pinned for the copy to be asynchronous."""
        same_dtype(dst, src)
        producer = torch.cuda.current_stream()
        with torch.cuda.stream(self.stream):
            if after is None or isinstance(after, CopyHandle):
                # after the compute queued so far (a buffer it just allocated is free to write) ...
                self.stream.wait_stream(producer)
                for h in after.handles if isinstance(after, AllOf) else (after,):
                    if isinstance(h, _CudaHandle):  # ... and after other copies, on their engines' streams
                        self.stream.wait_event(h.event)
            else:
                self.stream.wait_event(after)  # an event the compute stream recorded
            dst.copy_(src, non_blocking=True)
            src.record_stream(self.stream) if src.is_cuda else dst.record_stream(self.stream)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.bytes += src.nbytes
        return _CudaHandle(ev, host=self.to_host)


class Accelerator:
    """The CPU as the device tier (and the base of the others)."""

    kind = "cpu"
    eps_threads = 0  # eps.threads (0: the default)
    update_kernel = "auto"  # eps.update_kernel
    _passes: HostPasses | None = None

    def __init__(
        self,
        device: torch.device,
        meter: MemoryMeter,
        h2d: CopyEngine,
        d2h: CopyEngine,
        budget_gb: Any = None,
    ):
        self.device, self.meter, self.h2d, self.d2h = device, meter, h2d, d2h
        # the device memory the run may use (device.memory_gb, sim.memory_gb; None: all the device has)
        self.budget_bytes = None if budget_gb is None else int(budget_gb * 2**30)

    @property
    def host_passes(self) -> HostPasses:
        """The host's passes over the EPS's buffers (the one-pass update, counted), on ``host_threads``."""
        self._passes = self._passes or HostPasses(self.host_threads, self.update_kernel)
        return self._passes

    @property
    def half_dtype(self) -> torch.dtype:
        """The half type for AMP/CMP: bf16 on CPUs (fp16 matmuls are ~100x slower there)."""
        return torch.bfloat16

    @property
    def copies_inputs(self) -> bool:
        """Whether moving a batch to this device must copy it (a CPU device tier owns its inputs)."""
        return True

    @property
    def copies_inline(self) -> bool:
        """Whether a copy has finished when ``copy`` returns (the CPU's engines): a buffer copied out is free
        at once, so the relay needs no second gradient buffer for one leaving while the next is computed."""
        return type(self.d2h) is CopyEngine

    def host_empty(self, numel: int, dtype: torch.dtype = torch.float32, link: bool = False) -> torch.Tensor:
        """A host-tier buffer (not device memory). ``link``: copies to or from the device read or write it
        (a send copy, a receive buffer, a stash): pinned, to its exact size, where that makes the copies
        asynchronous; the rest (masters, moments, undo sets) stays plain pageable memory."""
        with self.meter.paused():
            return torch.empty(numel, dtype=dtype)

    def empty(self, numel: int, dtype: torch.dtype, part: str) -> torch.Tensor:
        """A device-tier buffer counted under ``part`` (an allocation point the runner owns: counted whether
        or not the meter is looking at ops just now)."""
        with self.meter.part(part):
            t = torch.empty(numel, dtype=dtype, device=self.device)
        self.meter.count(t, part)
        return t

    def seed(self, seed: int) -> None:
        """Seed this device's dropout RNG (layer-by-layer runners reseed per layer and micro-batch)."""
        torch.random.default_generator.manual_seed(seed)

    def autocast(self, dtype: torch.dtype | None) -> Any:
        if dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def wait_compute(self) -> None:
        """Wait until the calling thread's compute stream has run what it queued (``profile.sync_timers``:
        a phase's kernels land in that phase). Nothing to wait for off CUDA."""
        return None

    def launching(self) -> Any:
        """The compute thread's cores for a training step: here it computes, on all of them."""
        return nullcontext()

    def link(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, a host buffer the device's copies read (a frozen base in RAM), page-locked on CUDA."""
        return t

    def bind_thread(self) -> None:
        """The calling thread works for this device (a thread the run starts, first thing): on CUDA a new
        thread's current device is cuda:0 whatever the rank's, so a wait, stream or pinned buffer it made
        would land on another rank's GPU. Nothing to bind off CUDA."""
        return None

    def free_bytes(self) -> float | None:
        """Device memory still free for activations: the budget less what the meter counts live now (the
        relay's slots, once built); None without one (the device is the host, whose budget the runner is
        given: ``mode.activation_budget_gb``)."""
        return None if self.budget_bytes is None else float(self.budget_bytes - self.meter.current_bytes)

    def record_event(self) -> Any:
        return None

    def is_oom(self, exc: BaseException) -> bool:
        return isinstance(exc, DeviceOutOfMemory | torch.OutOfMemoryError)

    def memory_stats(self) -> dict[str, Any]:
        return {"h2d_bytes": self.h2d.bytes, "d2h_bytes": self.d2h.bytes}

    @property
    def host_threads(self) -> int:
        """Threads of the EPS's host work (``eps.threads``; 0: the device's default). Here the device *is*
        the host's cores: the EPS takes a share instead of a full team, since two OpenMP teams on the
        same cores spin against each other and slow both sides down several-fold."""
        return self.eps_threads or max(1, torch.get_num_threads() // 2)

    @contextmanager
    def running(self) -> Iterator[Accelerator]:
        """The accelerator in use for the block; its copy engines shut down at the end. (The meter counts
        in the windows the runners open: a step, an evaluation batch, building the runner.)"""
        try:
            yield self
        finally:
            self.h2d.close()
            self.d2h.close()
            if self._passes is not None:
                self._passes.close()

    def describe(self) -> str:
        return "cpu" + (f" ({self.budget_bytes / 2**30:g} GiB device budget)" if self.budget_bytes else "")


def pin_exact(t: torch.Tensor) -> torch.Tensor:
    """Page-lock ``t``'s memory where it is (``cudaHostRegister``), so copies to and from the device are
    asynchronous DMA. torch's pinned allocator (``pin_memory=True``) rounds every buffer up to a power of
    two (a 50.4 MB layer takes 64 MB); registering keeps the host's RAM to what the buffers hold."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {t.nbytes} bytes failed (error {int(err)})")
    return t


def unpin(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class CudaAccelerator(Accelerator):
    kind = "cuda"
    cores = 0  # torch's thread count when built (a step's compute thread runs on one; 0: read it now)

    def __init__(self, index: int, memory_gb: float | None = None):
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        meter = CudaMeter(device, CudaAllocator(device))
        super().__init__(
            device, meter, CudaCopyEngine(device, False), CudaCopyEngine(device, True), memory_gb
        )
        self.pinned: list[torch.Tensor] = []  # host buffers registered with CUDA (``host_empty(link=True)``)
        self.cores = torch.get_num_threads()
        if self.budget_bytes is not None:  # device.memory_gb: the caching allocator's cap, an OOM past it
            share = self.budget_bytes / cuda_total_memory(index)
            torch.cuda.set_per_process_memory_fraction(min(1.0, share), device)

    @contextmanager
    def running(self) -> Iterator[Accelerator]:
        try:
            with super().running():
                yield self
        finally:
            torch.cuda.synchronize(self.device)  # no copy may still read a buffer about to be unpinned
            for t in self.pinned:
                unpin(t)
            self.pinned.clear()

    @property
    def half_dtype(self) -> torch.dtype:
        return torch.float16

    @property
    def copies_inputs(self) -> bool:
        return False

    def host_empty(self, numel: int, dtype: torch.dtype = torch.float32, link: bool = False) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        if link and t.nbytes:
            self.pinned.append(pin_exact(t))  # (kept, and unpinned, with the accelerator)
        return t

    def seed(self, seed: int) -> None:
        torch.cuda.default_generators[self.device.index].manual_seed(seed)

    @property
    def host_threads(self) -> int:
        """The GPU computes; the host's cores (this rank's share) are the EPS's, less one: the compute
        thread launches kernels and must never wait for a core."""
        return self.eps_threads or max(1, (self.cores or torch.get_num_threads()) - 1)

    def link(self, t: torch.Tensor) -> torch.Tensor:
        # a pageable copy blocks the caller at a fraction of the link's rate (small ones: left as they are)
        if t.nbytes >= 1 << 16 and t.is_contiguous() and not t.is_pinned():
            with suppress(RuntimeError):
                self.pinned.append(pin_exact(t))
        return t

    def launching(self) -> Any:
        """The compute thread launches kernels: its host ops on one core, its passes on the EPS's pool (with a
        team of its own it spun against the EPS's: on an H200's host the update ran at half speed)."""
        return compute_threads(1, self.host_threads)

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def wait_compute(self) -> None:
        # this thread's stream only: a device-wide synchronize would also wait for the copy streams, so a
        # phase timer would charge a prefetch to the phase that queued it and no copy would overlap
        torch.cuda.current_stream(self.device).synchronize()

    def free_bytes(self) -> float | None:
        """Free device memory, counting what torch's caching allocator holds but does not use."""
        free, _ = torch.cuda.mem_get_info(self.device)
        used = torch.cuda.memory_allocated(self.device)
        free = float(free + torch.cuda.memory_reserved(self.device) - used)
        return free if self.budget_bytes is None else min(free, float(self.budget_bytes - used))

    def record_event(self) -> Any:
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def describe(self) -> str:
        cap = f", {self.budget_bytes / 2**30:g} GiB of it: device.memory_gb" if self.budget_bytes else ""
        return f"cuda:{self.device.index} ({torch.cuda.get_device_name(self.device)}{cap})"
