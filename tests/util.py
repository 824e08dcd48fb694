"""Shared test helpers: tiny configs composed exactly as the CLI composes them, and in-process runs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from l2l_cli.compose import compose
from l2l_cli.data.batches import Batch, TrainStream
from l2l_cli.data.loading import synthetic
from l2l_cli.engine.device import make_accelerator
from l2l_cli.engine.precision import make_precision
from l2l_cli.models.bert import ModelSpec
from l2l_cli.runners import make_runner
from l2l_cli.runners.common import Runner

REPO = Path(__file__).resolve().parent.parent
GLUE = REPO.parent / "shared" / "data" / "glue"

# 3 blocks of width 32, a 512-token vocabulary: every mode runs a step in milliseconds
TINY = [
    "model.num_layers=3",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.intermediate_size=64",
    "model.vocab_size=512",
    "model.dropout=0.0",
    "task.max_seq_len=16",
    "batch.size=8",
    "batch.ubatch_size=2",
    "trainer.progress=none",
]


def tiny_cfg(*overrides: str) -> DictConfig:
    return compose([*TINY, *overrides])


@contextmanager
def built(cfg: DictConfig, total_steps: int = 10) -> Iterator[Runner]:
    """A runner for ``cfg`` on its accelerator (meter on), closed afterwards."""
    acc = make_accelerator(cfg)
    spec = ModelSpec.from_config(cfg.model, 2)
    with acc.running():
        runner = make_runner(cfg, acc, spec, make_precision(cfg, acc), total_steps)
        try:
            yield runner
        finally:
            runner.close()


def batches(cfg: DictConfig, n: int = 256, seed: int = 1) -> Iterator[Batch]:
    data = synthetic(n, cfg.task.max_seq_len, cfg.model.vocab_size, seed=seed)
    pad = cfg.task.max_seq_len if cfg.task.pad_to_max else None
    return TrainStream(data, cfg.batch.size, seed=0, pad_to_max=pad).batches()


def weights(runner: Runner) -> dict[str, torch.Tensor]:
    """A copy of every weight, by HF name (made outside the device meter: it is the test's memory)."""
    with runner.acc.meter.paused():
        return {n: t.detach().float().clone() for n, t in runner.hf_tensors()}


def train(cfg: DictConfig, steps: int = 3, total_steps: int = 10) -> dict[str, Any]:
    """Run ``steps`` steps in-process; returns losses, final weights, reports and the device peak."""
    with built(cfg, total_steps) as runner:
        it = batches(cfg)
        reports = [runner.step(next(it)) for _ in range(steps)]
        return {
            "losses": [r.loss for r in reports],
            "reports": reports,
            "weights": weights(runner),
            "peak": runner.acc.meter.peak_bytes,
            "parts": runner.acc.meter.peak_parts,
        }


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-4) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def l2l(
    *args: str, timeout: float = 300, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The real CLI as a subprocess (``python -m l2l_cli``, so it runs wherever the tests run)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "l2l_cli", *args], capture_output=True, text=True, timeout=timeout,
        cwd=cwd or REPO, env=full_env,
    )  # fmt: skip
