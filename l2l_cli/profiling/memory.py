"""Device-tier memory meters.

On CUDA the allocator's own statistics are the measurement. On a CPU (``device=cpu`` or the simulated
accelerator) there is no separate device memory, so :class:`StorageMeter` measures what the compute side
holds: a ``TorchDispatchMode`` sees every tensor an op creates on the compute thread, counts its storage
once (views and in-place results share their input's storage and are not new), and a weak reference on
the storage subtracts it when it is freed. Work the host tier does (the EPS optimizer, host stash buffers)
runs outside the meter (other threads, or inside :meth:`paused`), so it is excluded by construction.
Every allocation carries a *part* label (weights, activations, stash, ...), and the breakdown at the
moment of the peak is kept.

The meter runs in *windows* the runners own (``window(key)``: building the runner, each training step, each
evaluation batch; ``RunnerBase`` opens one around every ``step`` and ``predict``), so the data loader's batch
collation, checkpoint serialisation and other host work between them are never counted. Buffers the runners
allocate themselves (the relay's slots, the baselines' weights, gradients and optimizer state) are counted at
their allocation points as well. Sampled (``profile.memory_sample``, the default on ``device=cpu``), the
per-op dispatch, which costs microseconds per op, runs only in windows that can set a new peak: the first two
of each kind and any batch shape no metered window's shape covers (a step with the same shapes allocates the
same tensors in the same order); other windows run at full speed.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class DeviceOutOfMemory(RuntimeError):
    """The device tier ran out of memory (the simulated budget, or CUDA's allocator)."""


class MemoryMeter:
    """Interface and no-op implementation (``profile.memory=false``)."""

    method = "none"

    def __init__(self) -> None:
        self._part = threading.local()

    def __enter__(self) -> MemoryMeter:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Label allocations made inside the block (on this thread) as ``name``."""
        prev = getattr(self._part, "name", "workspace")
        self._part.name = name
        try:
            yield
        finally:
            self._part.name = prev

    @property
    def current_part(self) -> str:
        return getattr(self._part, "name", "workspace")

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Host-tier work on the compute thread: allocations inside are not device memory."""
        yield

    @contextmanager
    def window(self, key: Any = None) -> Iterator[None]:
        """Device-tier work the runner owns (a step, an evaluation batch, building the runner): the meter
        counts what ops allocate inside it. ``key`` = (kind, batch shape) lets a sampling meter skip windows
        that cannot set a new peak; None: always metered."""
        yield

    def mark(self) -> None:
        """A point where the parts in use are worth noting against the peak (CUDA: see ``CudaMeter``)."""

    def count(self, t: torch.Tensor, part: str | None = None) -> None:
        """Count a device tensor the runner allocated itself (an allocation point it owns)."""

    def tag(self, t: torch.Tensor, part: str) -> None:
        """Re-label an already-counted tensor (e.g. a layer output kept as stash)."""

    @property
    def current_bytes(self) -> int:
        return 0

    @property
    def peak_bytes(self) -> int:
        return 0

    @property
    def peak_parts(self) -> dict[str, int]:
        return {}

    def reset_peak(self) -> None:
        return None

    def report(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "method": self.method, "parts": self.peak_parts}

    @property
    def note(self) -> str | None:
        """How the peak was taken, when that is worth saying (sampling)."""
        return None


class StorageMeter(MemoryMeter):
    """Counts storages created by ops on the compute thread; optional budget raises DeviceOutOfMemory."""

    method = "torch_dispatch_storage_tracking"

    def __init__(self, budget_bytes: int | None = None, sample: bool = False):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.sample = sample
        self._windows = {"metered": 0, "skipped": 0}
        self._kinds: dict[Any, list[Any]] = {}  # kind -> [windows seen, shapes of metered steady windows]
        self._lock = threading.RLock()
        self._live: dict[int, tuple[Any, int, str]] = {}  # storage key -> (weakref, nbytes, part)
        self._by_part: dict[str, int] = defaultdict(int)
        self._current = 0
        self._peak = 0
        self._peak_parts: dict[str, int] = {}
        self._paused = threading.local()
        self._mode: _AllocationMode | None = None

    def __enter__(self) -> StorageMeter:
        self._mode = _AllocationMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    @contextmanager
    def window(self, key: Any = None) -> Iterator[None]:
        if self._mode is not None or getattr(self._paused, "window", False):  # already metering here
            yield
            return
        if not self._wanted(key):
            self._windows["skipped"] += 1
            yield
            return
        self._windows["metered"] += 1
        mode = _AllocationMode(self)
        self._paused.window = True
        try:
            with mode:
                yield
        finally:
            self._paused.window = False

    def _wanted(self, key: Any) -> bool:
        """Whether to meter a window: always unless sampling; sampled, the first two windows of a kind
        (the first allocates lazily: optimizer state, buffers) and any batch shape (rows, sequence) that no
        steady metered window's shape covers (fewer rows and no longer sequence allocate no more)."""
        if not self.sample or key is None:
            return True
        kind, shape = key
        seen = self._kinds.setdefault(kind, [0, []])
        seen[0] += 1
        if seen[0] == 1:
            return True
        covered = any(all(a <= b for a, b in zip(shape, big)) for big in seen[1])
        if not covered:
            seen[1].append(tuple(shape))
        return not covered

    @property
    def note(self) -> str | None:
        if not self.sample:
            return None
        m, k = self._windows["metered"], self._windows["skipped"]
        return (
            f"sampled: {m} of {m + k} windows metered op by op (the first two of each kind and every batch "
            "shape not covered by one metered before); profile.memory_sample=false meters every one"
        )

    @contextmanager
    def paused(self) -> Iterator[None]:
        prev = getattr(self._paused, "on", False)
        self._paused.on = True
        try:
            yield
        finally:
            self._paused.on = prev

    @property
    def is_paused(self) -> bool:
        return getattr(self._paused, "on", False)

    def count(self, t: torch.Tensor, part: str | None = None) -> None:
        """Count ``t``'s storage if it is new (used by the dispatch mode, and for tensors made elsewhere)."""
        st = t.untyped_storage()
        key = st._cdata
        nbytes = st.nbytes()
        part = part or self.current_part
        with self._lock:
            if key in self._live or nbytes == 0:
                return
            self._live[key] = (weakref.ref(st, lambda _r, k=key: self._free(k)), nbytes, part)
            self._by_part[part] += nbytes
            self._current += nbytes
            if self._current > self._peak:
                self._peak = self._current
                self._peak_parts = {k: v for k, v in self._by_part.items() if v}
            over = self.budget_bytes is not None and self._current > self.budget_bytes
            if over:
                in_use = self._current - nbytes
                self._free(key)
        if over:
            raise DeviceOutOfMemory(
                f"device out of memory: tried to allocate {_fmt(nbytes)} ({part}) with {_fmt(in_use)} "
                f"in use of the {_fmt(self.budget_bytes or 0)} budget"
            )

    def _free(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                _, nbytes, part = entry
                self._by_part[part] -= nbytes
                self._current -= nbytes

    def tag(self, t: torch.Tensor, part: str) -> None:
        key = t.untyped_storage()._cdata
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return
            ref, nbytes, old = entry
            self._live[key] = (ref, nbytes, part)
            self._by_part[old] -= nbytes
            self._by_part[part] += nbytes

    @property
    def current_bytes(self) -> int:
        return self._current

    @property
    def peak_bytes(self) -> int:
        return self._peak

    @property
    def peak_parts(self) -> dict[str, int]:
        return dict(self._peak_parts)

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._current
            self._peak_parts = {k: v for k, v in self._by_part.items() if v}


class _AllocationMode(TorchDispatchMode):
    """Sees every op on the thread that entered it; new output storages are allocations."""

    def __init__(self, meter: StorageMeter):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self.meter.is_paused or _aliases(func):
            return out  # views and in-place ops return storage the op was given
        if isinstance(out, torch.Tensor):
            if out.device.type != "meta":
                self.meter.count(out)
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.meter.count(t)
        return out


_ALIASES: dict[Any, bool] = {}


def _aliases(func: Any) -> bool:
    """Whether an op's outputs alias its inputs (views, in-place and out= variants), from its schema."""
    hit = _ALIASES.get(func)
    if hit is None:
        hit = _ALIASES[func] = any(r.alias_info is not None for r in func._schema.returns)
    return hit


class CudaMeter(MemoryMeter):
    """CUDA: the peak is the allocator's ``max_memory_allocated``. Its parts are the tensors the runners own
    (counted where they allocate them: layer slots, stash, weights, gradients, optimizer state), as they
    stood at the first ``mark`` after the peak last rose (marks: every window's end and every layer the
    relay loads); ``workspace`` is the rest of the peak (activations, autograd's buffers, kernels')."""

    method = "cuda_allocator_max_memory_allocated"

    def __init__(self, device: torch.device, allocator: Any):
        super().__init__()
        self.device = device
        self.allocator = allocator  # the caching allocator's counters (engine/device.py's CudaAllocator)
        self._lock = threading.Lock()
        self._live: dict[int, tuple[Any, int, str]] = {}  # storage key -> (weakref, nbytes, part)
        self._by_part: dict[str, int] = defaultdict(int)
        self._peak_parts: dict[str, int] = {}
        self._marked_peak = -1
        self._base = allocator.allocated()
        # the allocator's peak is the process's: a run after another in one process (a sweep, a test
        # session) would otherwise report the earlier run's peak, and its parts as they stood at build
        allocator.reset_peak()

    def count(self, t: torch.Tensor, part: str | None = None) -> None:
        st = t.untyped_storage()
        key, nbytes, part = st._cdata, st.nbytes(), part or self.current_part
        with self._lock:
            if key in self._live or nbytes == 0:
                return
            self._live[key] = (weakref.ref(st, lambda _r, k=key: self._free(k)), nbytes, part)
            self._by_part[part] += nbytes

    def _free(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self._by_part[entry[2]] -= entry[1]

    def tag(self, t: torch.Tensor, part: str) -> None:
        key = t.untyped_storage()._cdata
        with self._lock:
            entry = self._live.get(key)
            if entry is not None:
                ref, nbytes, old = entry
                self._live[key] = (ref, nbytes, part)
                self._by_part[old] -= nbytes
                self._by_part[part] += nbytes
                return
        self.count(t, part)

    @contextmanager
    def window(self, key: Any = None) -> Iterator[None]:
        try:
            yield
        finally:
            self.mark()

    def mark(self) -> None:
        peak = self.peak_bytes
        if peak > self._marked_peak:
            with self._lock:
                owned = {k: v for k, v in self._by_part.items() if v > 0}
            self._marked_peak = peak
            self._peak_parts = {**owned, "workspace": max(0, peak - sum(owned.values()))}

    @property
    def current_bytes(self) -> int:
        return self.allocator.allocated() - self._base

    @property
    def peak_bytes(self) -> int:
        return self.allocator.max_allocated() - self._base

    @property
    def peak_parts(self) -> dict[str, int]:
        self.mark()
        return dict(self._peak_parts)

    def reset_peak(self) -> None:
        self.allocator.reset_peak()
        self._marked_peak = -1


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_bytes(n: float) -> str:
    """Human-readable bytes (binary units)."""
    return _fmt(n)
