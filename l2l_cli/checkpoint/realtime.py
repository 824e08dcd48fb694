"""Real-time checkpoints (L2L modes, layered-GA paper §8.2): the EPS already holds the master weights on the
host, so a background writer saves each layer right after its update; a step's files become a checkpoint
(``checkpoints/realtime/step_<k>/``) once all its layers are written, so a SIGKILL loses at most the step
in flight."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from l2l_cli.checkpoint.commit import commit_dir
from l2l_cli.checkpoint.discovery import prune
from l2l_cli.checkpoint.io import write_bytes, write_tensors


def _background() -> None:
    """Lower this thread's CPU priority (Linux nice is per thread): the writer should take the cores
    only when training leaves them idle, not preempt an intra-op worker that a whole matmul waits on."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


class RealtimeWriter:
    """Writes each layer of the EPS right after its update, on a thread of its own; ``commit(step)``
    turns a step's layer files into a checkpoint once they are all on disk.

    The runner calls ``before_update(i)`` before it updates layer i again, so the previous step's file
    for layer i is complete before its buffers change (the writer reads the EPS buffers in place)."""

    def __init__(self, root: Path, ident: dict[str, Any], config_yaml: str):
        self.root = root / "realtime"
        self.root.mkdir(parents=True, exist_ok=True)
        self.ident, self.config_yaml = ident, config_yaml
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="l2l-rtckpt", initializer=_background
        )
        self._layer_jobs: dict[int, Future] = {}
        self._commit_job: Future | None = None
        self._files: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.busy_s = 0.0
        self.step: int | None = None

    def _tmp(self, step: int) -> Path:
        return self.root / f".tmp-step_{step}"

    def begin(self, step: int) -> None:
        """Layers updated from now on belong to the checkpoint of ``step``."""
        self.step = step
        tmp = self._tmp(step)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        self._files[step] = {}

    def layer_updated(self, i: int, name: str, payload: Callable[[], dict[str, torch.Tensor]]) -> None:
        step = self.step
        assert step is not None

        def job() -> None:
            t0 = time.perf_counter()
            entry = write_tensors(self._tmp(step) / name, payload())
            with self._lock:
                self._files[step][name] = entry
                self.busy_s += time.perf_counter() - t0

        self._layer_jobs[i] = self._pool.submit(job)

    def before_update(self, i: int) -> None:
        """Layer i's buffers are about to change: its pending write, and the last commit, must be done."""
        job = self._layer_jobs.pop(i, None)
        if job is not None:
            job.result()
        self.wait_commit()

    def commit(
        self, step: int, trainer_state: dict[str, Any], layer_files: Callable[[], list[tuple[str, Callable]]]
    ) -> None:
        """After ``step``: write the layers it did not update (a skipped step), its state and manifest,
        then rename it into place and drop the older real-time checkpoint."""

        def job() -> None:
            t0 = time.perf_counter()
            tmp = self._tmp(step)
            for name, payload in layer_files():
                if name not in self._files[step]:
                    self._files[step][name] = write_tensors(tmp / name, payload())
            files = dict(self._files.pop(step))
            files["state.json"] = write_bytes(tmp / "state.json", json.dumps(trainer_state).encode())
            files["config.yaml"] = write_bytes(tmp / "config.yaml", self.config_yaml.encode())
            meta = {"step": step, "created": time.time(), "realtime": True, **self.ident}
            commit_dir(tmp, self.root / f"step_{step}", files, meta)
            prune(self.root, 1)
            self.busy_s += time.perf_counter() - t0

        self._commit_job = self._pool.submit(job)  # one thread, FIFO: after this step's layer writes

    def wait_commit(self) -> None:
        if self._commit_job is not None:
            self._commit_job.result()
            self._commit_job = None

    def pop_busy(self) -> float:
        with self._lock:
            busy, self.busy_s = self.busy_s, 0.0
        return busy

    def close(self) -> None:
        self._pool.shutdown(wait=True)
