"""Shared by the benchmark scripts: run a few steps of a composed config in-process and time them."""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from l2l_cli.compose import compose
from l2l_cli.data.batches import TrainStream
from l2l_cli.data.synthetic import synthetic
from l2l_cli.data.tasks import TASKS, TaskData
from l2l_cli.session import Session, build

# L2L v1 Table 1 widths (BERT-Large), 8 layers, sequence 128: what issues 3 and 4 benchmark on this CPU
BERT_LARGE_8 = [
    "model=bert-large",
    "model.num_layers=8",
    "task.max_seq_len=128",
    "task.pad_to_max=true",
    "trainer.progress=none",
]


def session(overrides: list[str], samples: int = 256) -> Session:
    """The built session for ``overrides`` on a small synthetic task (``with session([...]) as s:``)."""
    cfg = compose([*overrides, "trainer.max_steps=100"])
    data = synthetic(samples, cfg.task.max_seq_len, cfg.model.vocab_size, seed=1)
    return build(cfg, data=TaskData(TASKS["synthetic"], data, data, "synthetic"))


def measure(
    overrides: list[str],
    steps: int = 3,
    warmup: int = 1,
    probe: Callable[[Session], dict[str, Any]] | None = None,
    load: bool = False,
) -> dict[str, Any]:
    """Median samples/s and mean phase times over ``steps - warmup`` steps, and the device-tier peak;
    ``probe(session)``'s entries too, read once built, before the first step (no second build);
    ``load``: every step's wall time and CPU load (``steps``: see :func:`step_load`)."""
    cfg = compose([*overrides, "trainer.max_steps=100"])
    data = synthetic(
        max(256, cfg.batch.size * (steps + 1)), cfg.task.max_seq_len, cfg.model.vocab_size, seed=1
    )
    task = TaskData(TASKS["synthetic"], data, data, "synthetic")
    stream = TrainStream(data, cfg.batch.size, seed=0, pad_to_max=cfg.task.max_seq_len)
    with build(cfg, data=task) as session:
        runner = session.runner
        assert runner is not None
        probed = probe(session) if probe is not None else {}
        it = stream.batches()
        reports, loads = [], []
        for _ in range(steps):
            mb = next(it)
            before = cpu_mark()
            reports.append(runner.step(mb))
            loads.append(step_load(before, cpu_mark()))
        reports = reports[warmup:]
        peak = runner.acc.meter.peak_bytes
        eps = runner.sections().get("eps") if hasattr(runner, "eps") else None
    phases: dict[str, float] = {}
    for r in reports:
        for k, v in {**r.phases, **r.extra}.items():
            phases[k] = phases.get(k, 0.0) + v / len(reports)
    return {
        "samples_per_s": statistics.median(r.samples / r.step_time_s for r in reports),
        "step_time_s": statistics.median(r.step_time_s for r in reports),
        "peak_bytes": peak,
        "phases": phases,
        "eps": eps,  # an EPS mode's host traffic per parameter per step (summary.json's ``eps``)
        **({"steps": loads} if load else {}),
        **probed,
    }


_BUSY = (0, 1, 2, 5, 6, 7)  # /proc/stat's cpu line: user nice system (idle iowait) irq softirq steal


def cpu_mark() -> tuple[float, float, float, int, float]:
    """(wall, this process's CPU seconds, the machine's busy CPU seconds, minor faults, steal seconds)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    busy = steal = 0.0
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
        busy, steal = sum(ticks[i] for i in _BUSY) / hz, ticks[7] / hz
    except (OSError, ValueError, IndexError):
        pass
    return time.perf_counter(), ru.ru_utime + ru.ru_stime, busy, ru.ru_minflt, steal


def step_load(
    a: tuple[float, float, float, int, float], b: tuple[float, float, float, int, float]
) -> dict[str, float]:
    """One step between two :func:`cpu_mark` s: its wall seconds, this process's CPU seconds, the CPU seconds
    the rest of the machine used meanwhile (other processes: a timing with them is under contention), the
    minor page faults it took, and the hypervisor's steal."""
    return {
        "wall_s": b[0] - a[0],
        "cpu_s": b[1] - a[1],
        "others_cpu_s": max(0.0, (b[2] - a[2]) - (b[1] - a[1])),
        "faults": b[3] - a[3],
        "steal_s": b[4] - a[4],
    }


def timeit(fn: Any, repeat: int = 5) -> float:
    """Median seconds of ``fn()`` over ``repeat`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def threads() -> int:
    return torch.get_num_threads()
