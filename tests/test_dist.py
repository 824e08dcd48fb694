"""Data parallel on gloo (two processes through the elastic launcher) and L2L-p."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.util import REPO, TINY, assert_same_weights, tiny_cfg, train

MODES = ["baseline_ag", "l2l", "l2l_p"]
DP = [
    *TINY,
    "model.dropout=0.1",
    "trainer.max_steps=3",
    "task.num_train=256",
    "task.num_eval=16",
    "trainer.save_final=true",
]


@pytest.mark.parametrize("optim", ["adamw", "lamb"])
@pytest.mark.parametrize("stash", ["device", "cpu"])
def test_l2l_p_matches_l2l(stash: str, optim: str) -> None:
    common = [f"mode.stash={stash}", f"optim={optim}", "optim.clip=layer"]
    ref = train(tiny_cfg("mode=l2l", *common))
    got = train(tiny_cfg("mode=l2l_p", *common))
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert_same_weights(got["weights"], ref["weights"])


def test_l2l_p_hides_the_update_behind_backward() -> None:
    """Only the trailing update is on the step's critical path: the EPS thread's work exceeds it."""
    r = train(tiny_cfg("mode=l2l_p", "model.num_layers=8"), steps=4)
    for rep in r["reports"][1:]:
        assert rep.extra["eps_background_s"] > rep.phases["optimizer"]


def test_l2l_p_non_finite_gradient_in_a_lower_layer_rolls_back_the_updated_layers() -> None:
    """L2L-p has already updated the upper layers when the embeddings' gradient turns out non-finite:
    the step is still skipped as a whole, every layer restored exactly from its undo copy."""
    from tests.util import batches, built

    cfg = tiny_cfg("mode=l2l_p")
    with built(cfg) as runner:
        before = [(st.w.clone(), st.m.clone(), st.v.clone()) for st in runner.eps.layers]
        send = runner.relay.send_grads

        def poisoned(i: int) -> None:
            if i == 0:  # the last gradient of the step: every other layer is updated by now
                runner.relay.current.g[0] = float("inf")
            send(i)

        runner.relay.send_grads = poisoned
        report = runner.step(next(batches(cfg)))
        assert report.skipped
        for st, (w, m, v) in zip(runner.eps.layers, before):
            assert torch.equal(st.w, w) and torch.equal(st.m, m) and torch.equal(st.v, v)
        assert runner.eps.host_parts()["undo_log"] > 0  # upper layers were updated, then undone
        runner.relay.send_grads = send
        assert not runner.step(next(batches(cfg, seed=3))).skipped  # and training goes on


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
    proc = subprocess.Popen(
        [sys.executable, "-m", "l2l_cli", "train", "dist.nproc=2", "mode=l2l", *TINY, "trainer.max_steps=100000",
         "task.num_train=256", "dist.timeout_s=30", f"hydra.run.dir={tmp_path}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        deadline = time.time() + 120
        metrics = tmp_path / "metrics.jsonl"
        while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
            time.sleep(0.5)
        log = (tmp_path / "train-rank1.log").read_text()
        victim = int(re.search(r"rank 1 of 2, pid (\d+)", log).group(1))
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        _, err = proc.communicate(timeout=90)
        assert time.time() - killed_at < 60
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert "rank 1 failed (killed by signal 9)" in err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "error" and "rank 1 failed" in summary["error"]


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
