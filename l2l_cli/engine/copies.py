"""Copies between the host and the device tier, apart from CUDA's streams (``device.py``): a copy's handle,
the inline engine of a CPU device tier, and the simulated link's (``device=sim``): a thread per direction
that takes ``bytes / link bandwidth`` per copy, so prefetch overlap and exposed transfer are real."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch


class CopyHandle:
    """A copy in flight; ``wait()`` blocks until its destination may be used by the caller;
    ``wait_device()`` only orders the device's later work after it (a stream wait on CUDA; on a CPU device
    tier, where the host is the device, the same as ``wait()``)."""

    def wait(self) -> None:
        return None

    def wait_device(self) -> None:
        self.wait()

    def done(self) -> bool:
        return True


DONE = CopyHandle()


class AllOf(CopyHandle):
    """Several copies that one consumer waits for together (a layer loaded in pieces)."""

    __slots__ = ("handles",)

    def __init__(self, *handles: CopyHandle):
        self.handles = handles

    def wait(self) -> None:
        # the last issued first: where the copies share a stream its end is the others' too, and a wait
        # on a copy already done costs the host no synchronize (the loop stays correct on any streams)
        for h in reversed(self.handles):
            h.wait()

    def wait_device(self) -> None:
        for h in self.handles:
            h.wait_device()

    def done(self) -> bool:
        return all(h.done() for h in self.handles)


class CopyEngine:
    """Inline copies (CPU device): the copy happens in ``copy()``; the handle is already done."""

    def __init__(self) -> None:
        self.bytes = 0
        self.busy_s = 0.0

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> CopyHandle:
        """Copy ``src`` into ``dst`` (same dtype: a conversion belongs on one side of the link, never
        on it) once ``after`` (a CopyHandle, or a CUDA event) is done."""
        same_dtype(dst, src)
        if isinstance(after, CopyHandle):
            after.wait()
        t0 = time.perf_counter()
        dst.copy_(src)
        self.busy_s += time.perf_counter() - t0
        self.bytes += src.nbytes
        return DONE

    def close(self) -> None:
        return None


class _ThreadHandle(CopyHandle):
    __slots__ = ("error", "event")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> None:
        self.event.wait()
        if self.error is not None:
            raise self.error

    def done(self) -> bool:
        return self.event.is_set()


class LinkCopyEngine(CopyEngine):
    """A copy engine thread behind a link of ``gbps`` GB/s: each copy takes max(memcpy, bytes / bandwidth).

    Copies run in submission order (one DMA queue per direction), so a prefetch issued early overlaps the
    compute that follows it, and a wait on it measures exactly the transfer time compute could not hide.
    """

    def __init__(self, gbps: float, name: str):
        super().__init__()
        self.bytes_per_s = gbps * 1e9
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"l2l-copy-{name}", daemon=True)
        self._thread.start()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> CopyHandle:
        same_dtype(dst, src)
        h = _ThreadHandle()
        self._q.put((dst, src, h, after if isinstance(after, CopyHandle) else None))
        return h

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            dst, src, h, after = job
            try:
                if after is not None:  # e.g. a stash coming back waits for its trip out (the other engine)
                    after.wait()
            except BaseException as e:
                h.error = e
                h.event.set()
                continue
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    dst.copy_(src)
                link_s = src.nbytes / self.bytes_per_s
                rest = link_s - (time.perf_counter() - t0)
                if rest > 0:
                    time.sleep(rest)
                self.bytes += src.nbytes
            except BaseException as e:  # surfaced to the waiter
                h.error = e
            self.busy_s += time.perf_counter() - t0
            del dst, src
            h.event.set()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)


def same_dtype(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.dtype != src.dtype:
        raise ValueError(
            f"a copy over the link converts {src.dtype} to {dst.dtype}: convert on one side (CMP gradients "
            "cross in half precision and become FP32 on the host)"
        )
