"""One Hydra job: run it in this process, or (dist.nproc > 1) launch the ranks and wait for them."""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig

from l2l_cli.train import run_dir_of, run_job


def run_task(cfg: DictConfig) -> str:
    """Run the job for the composed ``cfg``; returns its status (ok | oom | error | config)."""
    run_dir = run_dir_of(cfg)
    status = run_job(cfg, run_dir)
    return status


def env_rank() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


__all__ = ["Any", "env_rank", "run_task"]
