"""Data parallel on gloo (two processes through the elastic launcher); L2L-p is in test_l2l_p.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.util import REPO, TINY, assert_same_weights, kill_rank_1_mid_run

MODES = ["baseline_ag", "l2l", "l2l_p"]
DP = [
    *TINY,
    "model.dropout=0.1",
    "trainer.max_steps=3",
    "task.num_train=256",
    "task.num_eval=16",
    "trainer.save_final=true",
]


def _final(run: Path) -> dict[str, torch.Tensor]:
    assert json.loads((run / "summary.json").read_text())["status"] == "ok"
    return load_file(run / "final" / "model.safetensors")


def _sweep(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "l2l_cli", "train", "-m", f"mode={','.join(MODES)}", *DP, *args, f"hydra.sweep.dir={tmp}"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip


def test_two_ranks_equal_one_process_with_the_global_batch(tmp_path) -> None:
    one = _sweep(tmp_path / "one", "batch.size=8", "batch.ubatch_size=2")
    two = _sweep(tmp_path / "two", "dist.nproc=2", "batch.size=4", "batch.ubatch_size=2")
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, two.stderr[-2000:]
    for job, mode in enumerate(MODES):
        a, b = _final(tmp_path / "one" / str(job)), _final(tmp_path / "two" / str(job))
        assert_same_weights(a, b, rtol=1e-4)
        memory = json.loads((tmp_path / "two" / str(job) / "memory.json").read_text())
        assert [r["rank"] for r in memory["ranks"]] == [0, 1], mode
        summary = json.loads((tmp_path / "two" / str(job) / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["config"]["global_batch_size"] == 8


def test_killing_one_rank_ends_the_job_with_a_clear_error(tmp_path) -> None:
    kill_rank_1_mid_run(tmp_path, "dist.nproc=2", "mode=l2l", *TINY)


def test_two_rank_resume_is_exact(tmp_path) -> None:
    args = ["mode=l2l", "dist.nproc=2", "batch.size=4", *DP[:-1], "trainer.max_steps=4", "trainer.save_every=2",
            "trainer.keep_checkpoints=3"]  # fmt: skip
    full, cut = tmp_path / "full", tmp_path / "cut"
    r = subprocess.run(
        [sys.executable, "-m", "l2l_cli", "train", *args, f"hydra.run.dir={full}"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_4")
    r = subprocess.run(
        [sys.executable, "-m", "l2l_cli", "train", *args, f"trainer.resume={cut}"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    for f in (full / "checkpoints" / "step_4").glob("layer_*.safetensors"):
        a, b = load_file(f), load_file(cut / "checkpoints" / "step_4" / f.name)
        assert all(torch.equal(a[k], b[k]) for k in a), f.name
