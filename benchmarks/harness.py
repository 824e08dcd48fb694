"""Shared by the benchmark scripts: run a few steps of a composed config in-process and time them."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from l2l_cli.compose import compose
from l2l_cli.data.batches import TrainStream
from l2l_cli.data.loading import synthetic
from l2l_cli.engine.device import make_accelerator
from l2l_cli.engine.precision import make_precision
from l2l_cli.models.bert import ModelSpec
from l2l_cli.runners import make_runner

# L2L v1 Table 1 widths (BERT-Large), 8 layers, sequence 128: what issues 3 and 4 benchmark on this CPU
BERT_LARGE_8 = [
    "model=bert-large",
    "model.num_layers=8",
    "task.max_seq_len=128",
    "task.pad_to_max=true",
    "trainer.progress=none",
]


def measure(overrides: list[str], steps: int = 3, warmup: int = 1) -> dict[str, Any]:
    """Median samples/s and mean phase times over ``steps - warmup`` steps, and the device-tier peak."""
    cfg = compose(overrides)
    acc = make_accelerator(cfg)
    spec = ModelSpec.from_config(cfg.model, 2)
    data = synthetic(
        max(256, cfg.batch.size * (steps + 1)), cfg.task.max_seq_len, cfg.model.vocab_size, seed=1
    )
    stream = TrainStream(data, cfg.batch.size, seed=0, pad_to_max=cfg.task.max_seq_len)
    with acc.running():
        runner = make_runner(cfg, acc, spec, make_precision(cfg, acc), total_steps=100)
        try:
            it = stream.batches()
            reports = [runner.step(next(it)) for _ in range(steps)][warmup:]
        finally:
            runner.close()
        peak = acc.meter.peak_bytes
    phases: dict[str, float] = {}
    for r in reports:
        for k, v in {**r.phases, **r.extra}.items():
            phases[k] = phases.get(k, 0.0) + v / len(reports)
    return {
        "samples_per_s": statistics.median(r.samples / r.step_time_s for r in reports),
        "step_time_s": statistics.median(r.step_time_s for r in reports),
        "peak_bytes": peak,
        "phases": phases,
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
