"""Random kill trials: SIGKILL a training run at a random moment (seeded), resume it, and its final weights
equal an uninterrupted run's bit for bit, for every runner that can resume. One trial in the default suite
(L2L-p on the disk tier: the EPS and its disk tier at once); five per runner, data parallel and the pipeline
included, with ``-m slow``."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.util import REPO, TINY, l2l

RUNNERS = {
    "baseline_ag": ["mode=baseline_ag"],
    "l2l": ["mode=l2l"],
    "l2l_p": ["mode=l2l_p"],
    "l2l_stash_cpu": ["mode=l2l_stash_cpu"],
    "disk": ["mode=l2l_p", "eps.tier=disk"],
    "dp2": ["mode=l2l_p", "dist.nproc=2"],
    "pipeline2": ["mode=baseline_ag", "dist.nproc=2", "dist.pipeline=2", "model.num_layers=4"],
}
# the default suite's trial: the EPS on its disk tier (the host tier and the device-resident state:
# test_signals' SIGKILLs, test_disk_tier's kills at each write; every runner: -m slow)
DEFAULT = ["disk"]
STEPS = 16
COMMON = [
    *TINY,
    f"trainer.max_steps={STEPS}",
    "trainer.save_every=1",
    "trainer.keep_checkpoints=1",
    "trainer.save_final=true",
    "task.num_train=256",
    "task.num_eval=16",
    "logger=none",
]


@cache
def reference(runner: str, root: str) -> dict[str, torch.Tensor]:
    """The uninterrupted run's final weights (once per runner and session)."""
    run = Path(root) / f"ref-{runner}"
    r = l2l("train", *COMMON, *RUNNERS[runner], f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr[-2000:]
    return load_file(str(run / "final" / "model.safetensors"))


def _first_checkpoint(run: Path) -> bool:
    return any(run.glob("checkpoints/step_*/manifest.json"))


def kill_and_resume(runner: str, seed: int, tmp: Path, ref_root: Path) -> None:
    rng = random.Random(seed)
    run = tmp / f"{runner}-{seed}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "l2l_cli", "train", *COMMON, *RUNNERS[runner], f"hydra.run.dir={run}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
        start_new_session=True,
    )
    deadline = time.time() + 240
    while not _first_checkpoint(run) and proc.poll() is None:
        assert time.time() < deadline, "no checkpoint in time"
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.5))  # somewhere in the steps after it: mid-step, mid-save, mid-commit
    assert proc.poll() is None, "the run ended before the kill: make it longer"
    os.killpg(proc.pid, signal.SIGKILL)  # the whole job (every rank), as a machine failing would
    proc.wait()
    r = l2l("train", f"trainer.resume={run}", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = load_file(str(run / "final" / "model.safetensors"))
    ref = reference(runner, str(ref_root))
    assert got.keys() == ref.keys()
    differ = [k for k in ref if not torch.equal(got[k], ref[k])]
    assert differ == [], differ[:5]


@pytest.fixture(scope="module")
def ref_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kill-refs")


@pytest.mark.parametrize("runner", DEFAULT)
def test_one_random_kill_resumes_to_the_uninterrupted_weights(runner: str, tmp_path, ref_root) -> None:
    kill_and_resume(runner, seed=1, tmp=tmp_path, ref_root=ref_root)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("runner", list(RUNNERS))
def test_random_kills_resume_to_the_uninterrupted_weights(runner: str, seed: int, tmp_path, ref_root) -> None:
    kill_and_resume(runner, seed=100 + seed, tmp=tmp_path, ref_root=ref_root)
