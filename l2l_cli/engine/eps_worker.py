"""The EPS's own thread and the bookkeeping of the work it does in the background.

The EPS reduces (and, for L2L-p, updates) each layer on one thread of its own while the device computes.
This class runs that thread, remembers which background job still writes which layer (so the device does
not load a layer, and nothing overwrites its host buffers, before its update is in), and accounts the host
update time: on the compute thread (exposed), on the EPS thread (hidden), and the compute thread's waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from contextlib import contextmanager
from typing import Any

import torch

from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.host_passes import set_thread_share

_THREAD = threading.local()


def _worker_init(threads: int, bind: Callable[[], None]) -> None:
    torch.set_num_threads(threads)
    set_thread_share(threads)
    bind()  # the rank's own device (CUDA: a new thread starts on cuda:0)
    _THREAD.eps_worker = True


class EpsWorker:
    """The EPS thread, its jobs in flight, and the time spent on host updates."""

    def __init__(self, acc: Accelerator):
        self.acc = acc
        self.pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="l2l-eps",
            initializer=_worker_init,
            initargs=(acc.host_threads, acc.bind_thread),
        )
        self.jobs: list[Future] = []
        self._lock = threading.Lock()
        self.busy_s = 0.0  # time the worker spent this step (reduction and background updates)
        # host update work this step: on the compute thread (exposed), on the EPS thread (overlapped), and
        # the compute thread's waits on the EPS (exposed)
        self._times = {"main_s": 0.0, "eps_s": 0.0, "trailing_s": 0.0, "wait_s": 0.0}
        # background work that still writes a layer: until it is done, the device may not load that layer
        # (device) or nothing else may read or overwrite its host buffers (host)
        self.device_jobs: dict[int, Future] = {}
        self.host_jobs: dict[int, Future] = {}

    def submit(
        self, fn: Callable[..., Any], *args: Any, layer: int | None = None, host_only: bool = False
    ) -> Future:
        """Run ``fn(*args)`` on the EPS thread; ``layer``: the job writes that layer (its device copy may not
        be loaded until it is done, unless ``host_only``; its host buffers not touched)."""
        job = self.pool.submit(fn, *args)
        if len(self.jobs) >= 512:  # steps judged early leave their jobs running: forget the finished ones
            done = [j for j in self.jobs if j.done()]
            self.jobs = [j for j in self.jobs if not j.done()]
            for j in done:
                j.result()  # (a failure surfaces here, on the compute thread)
        self.jobs.append(job)
        if layer is not None:
            if not host_only:
                self.device_jobs[layer] = job
            self.host_jobs[layer] = job
        return job

    def timed(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)``, its time counted as the EPS thread's busy time."""
        t0 = time.perf_counter()
        try:
            fn(*args)
        finally:
            with self._lock:
                self.busy_s += time.perf_counter() - t0

    @contextmanager
    def work(self, trailing: bool = False) -> Iterator[None]:
        """Host update work: counted in ``optimizer_s``, and in ``exposed_s`` when the compute thread does
        it itself (the EPS thread's share is hidden behind the device's work). The meter is paused: this is
        host-tier work, whichever thread runs it."""
        t0 = time.perf_counter()
        try:
            with self.acc.meter.paused():
                yield
        finally:
            dt = time.perf_counter() - t0
            on_eps = getattr(_THREAD, "eps_worker", False)
            with self._lock:
                self._times[("trailing_s" if trailing else "eps_s") if on_eps else "main_s"] += dt

    def wait_background(self) -> None:
        """Every job so far is done (its failure raised here)."""
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job.result()

    def wait_all(self) -> None:
        """The compute thread waits for all background work (the time is exposed optimizer time)."""
        jobs, self.jobs = self.jobs, []
        t0 = time.perf_counter()
        try:
            for job in jobs:
                job.result()
        finally:
            with self._lock:
                self._times["wait_s"] += time.perf_counter() - t0
            self.device_jobs.clear()
            self.host_jobs.clear()

    def _wait(self, job: Future) -> None:
        t0 = time.perf_counter()
        futures_wait([job])
        with self._lock:
            self._times["wait_s"] += time.perf_counter() - t0

    def wait_device(self, i: int, block: bool = True) -> bool:
        """Whether layer i may be loaded onto the device now (its update is in); ``block``: wait for it."""
        job = self.device_jobs.get(i)
        if job is None:
            return True
        if not job.done():
            if not block:
                return False
            self._wait(job)
        del self.device_jobs[i]
        job.result()  # surface a failure of the background update
        return True

    def host_busy(self, i: int) -> bool:
        """Whether background work still writes layer i's host buffers."""
        job = self.host_jobs.get(i)
        return job is not None and not job.done()

    def wait_host(self, i: int) -> None:
        """Before layer i's host buffers are overwritten (its next gradient lands): its update is done."""
        job = self.host_jobs.pop(i, None)
        if job is not None:
            self._wait(job)
            job.result()

    def pop_busy(self) -> float:
        with self._lock:
            busy, self.busy_s = self.busy_s, 0.0
        return busy

    def pop_optimizer(self) -> dict[str, float]:
        """Since the last call: ``optimizer_s`` (host update work, any thread), ``optimizer_exposed_s``
        (the compute thread's share: updates it ran itself and its waits on the EPS thread), and the parts:
        ``eps_update_s`` (update work on the EPS thread behind the backward pass), ``trailing_update_s``
        (the trailing layer's, on the EPS thread behind the next forward) and ``optimizer_wait_s``."""
        with self._lock:
            t, self._times = self._times, dict.fromkeys(self._times, 0.0)
        return {
            "optimizer_s": t["main_s"] + t["eps_s"] + t["trailing_s"],
            "optimizer_exposed_s": t["main_s"] + t["wait_s"],
            "eps_update_s": t["eps_s"],
            "trailing_update_s": t["trailing_s"],
            "optimizer_wait_s": t["wait_s"],
        }

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)
