"""Data parallel on gloo (two processes through the elastic launcher); L2L-p is in test_l2l_p.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.util import REPO, TINY, assert_same_weights, kill_rank_1_mid_run, l2l, tiny_cfg, train

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


def test_two_ranks_equal_one_process_with_the_global_batch() -> None:
    """Every EPS-less and EPS mode on 2 ranks (each half the global batch), started once and run one
    config after another in one process group (``run_jobs``), equals one process with the whole batch.
    The CLI's own 2-rank run (files, gathered memory, the summary) is test_two_rank_resume_is_exact's."""
    from l2l_cli.launch import run_jobs

    shared = [*DP[len(TINY) :], "batch.ubatch_size=2"]
    results = run_jobs(2, [[*TINY, *shared, f"mode={m}", "batch.size=4"] for m in MODES], steps=3)
    for job, mode in enumerate(MODES):
        one = train(tiny_cfg(*shared, f"mode={mode}", "batch.size=8"), steps=3, total_steps=3)["weights"]
        two = results[0][job]
        assert len(two["losses"]) == 3 and two["samples"] == [8, 8, 8], mode  # the global batch, per step
        assert_same_weights(two["weights"], one, rtol=1e-4)


def test_killing_one_rank_ends_the_job_with_a_clear_error(tmp_path) -> None:
    kill_rank_1_mid_run(tmp_path, "dist.nproc=2", "mode=l2l", *TINY)


@pytest.mark.slow  # two-rank resume: the pipeline's reshard-on-resume test is the default one
def test_two_rank_resume_is_exact(tmp_path) -> None:
    args = [
        "mode=l2l",
        "dist.nproc=2",
        "batch.size=4",
        *DP[:-1],
        "trainer.max_steps=4",
        "trainer.save_every=2",
        "trainer.keep_checkpoints=3",
    ]
    full, cut = tmp_path / "full", tmp_path / "cut"
    r = l2l("train", *args, f"hydra.run.dir={full}", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    memory = json.loads((full / "memory.json").read_text())
    assert [r["rank"] for r in memory["ranks"]] == [0, 1]  # every rank's memory, gathered on rank 0
    summary = json.loads((full / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["config"]["global_batch_size"] == 16  # 2 x batch.size=8
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_4")
    r = l2l("train", *args, f"trainer.resume={cut}", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    for f in (full / "checkpoints" / "step_4").glob("layer_*.safetensors"):
        a, b = load_file(f), load_file(cut / "checkpoints" / "step_4" / f.name)
        assert all(torch.equal(a[k], b[k]) for k in a), f.name


# ---- several machines: torchrun --nnodes 2, each node its own torchrun on this machine -------------------

NODES = [
    *TINY,
    "model.num_layers=4",
    "task.num_train=128",
    "task.num_eval=16",
    "batch.size=4",
    "trainer.max_steps=3",
    "trainer.save_every=2",
    "trainer.save_final=true",
    "mode=baseline_ag",
    "dist.pipeline=2",
]


def _nodes(run: Path, *args: str, port: int) -> list[subprocess.Popen]:
    """Two nodes of two ranks (2 data x 2 pipeline), each its own torchrun, meeting at one c10d endpoint;
    every node is given the run dir; the world size comes from torchrun (no dist.nproc)."""
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"localhost:{port}",
        "--rdzv-id",
        f"l2l-{port}",
    ]
    cmd = [*torchrun, "-m", "l2l_cli", "train", *args, f"hydra.run.dir={run}"]
    return [
        subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]


@pytest.mark.slow
def test_two_torchrun_nodes_equal_nproc_4_resume_and_end_together_when_one_dies(tmp_path) -> None:
    """Acceptance 3: a 2 x 2 job over two torchrun "nodes" gives dist.nproc=4's weights bit for bit, writes
    one run dir (every rank's log, the checkpoints), resumes from its checkpoint on two nodes again; a node
    whose torchrun is killed (SIGKILL: it cannot stop its workers, which notice and stop) ends the other
    node non-zero within dist.timeout_s."""
    from l2l_cli.engine.dist import free_port

    r = l2l("train", *NODES, "dist.nproc=4", f"hydra.run.dir={tmp_path / 'nproc'}", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    nodes = tmp_path / "nodes"
    procs = _nodes(nodes, *NODES, port=free_port())
    for p in procs:
        assert p.wait(timeout=600) == 0, p.stderr.read()[-3000:] if p.stderr else ""
    a, b = _final(nodes), _final(tmp_path / "nproc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert {f.name for f in nodes.glob("train*.log")} == {
        "train.log",
        *(f"train-rank{i}.log" for i in (1, 2, 3)),
    }
    summary = json.loads((nodes / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["pipeline"]["data_parallel"] == 2
    # resume from step 2 on two nodes again: the same weights
    shutil.rmtree(nodes / "checkpoints" / "step_3")
    shutil.rmtree(nodes / "final")
    procs = _nodes(nodes, *NODES, f"trainer.resume={nodes}", port=free_port())
    for p in procs:
        assert p.wait(timeout=600) == 0, p.stderr.read()[-3000:] if p.stderr else ""
    resumed = _final(nodes)
    assert all(torch.equal(resumed[k], b[k]) for k in b)
    # a node dies: the other ends, non-zero, within dist.timeout_s
    long = [
        *NODES[:-5],
        "trainer.max_steps=100000",
        "task.num_train=4096",
        "mode=baseline_ag",
        "dist.pipeline=2",
        "dist.timeout_s=60",
    ]
    dead = tmp_path / "dead"
    procs = _nodes(dead, *long, port=free_port())
    deadline = time.time() + 300
    while not (dead / "metrics.jsonl").is_file() and time.time() < deadline:
        time.sleep(0.5)
    assert (dead / "metrics.jsonl").is_file(), "the job never started training"
    t0 = time.time()
    procs[1].kill()  # the agent only: its workers see it gone
    assert procs[0].wait(timeout=120) != 0
    assert time.time() - t0 < 60
    procs[1].wait(timeout=60)
