"""Runs that survive: signals stop at a step boundary and save; SIGKILL loses at most the step in flight
with real-time checkpoints; non-finite steps are skipped, then stop the run with a clear error."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from l2l_cli import checkpoint as ckpt
from l2l_cli.train import run_job
from tests.util import REPO, TINY, l2l, tiny_cfg

LONG = [*TINY, "trainer.max_steps=100000", "task.num_train=256", "task.num_eval=16"]


def _start(run: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "l2l_cli", "train", *LONG, *args, f"hydra.run.dir={run}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _logged_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_steps(run: Path, n: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while len(_logged_steps(run)) < n:
        assert time.time() < deadline, "the run did not get going"
        time.sleep(0.2)


def test_sigterm_stops_at_a_step_boundary_saves_and_says_how_to_resume(tmp_path) -> None:
    proc = _start(tmp_path, "mode=l2l")
    _wait_steps(tmp_path, 3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    summary = json.loads((tmp_path / "summary.json").read_text())
    stopped = (
        summary["steps"] if summary["steps"] else int(summary["error"].split("after step ")[1].split(";")[0])
    )
    assert summary["status"] == "interrupted" and "stopped by SIGTERM after step" in summary["error"]
    assert f"trainer.resume={tmp_path}" in out and "Traceback" not in out + err
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])  # issue 40 item 9d:
    assert summary["steps"] == stopped and summary["final_loss"] == last["loss"]  # not `final loss -`
    assert summary["samples_per_s"] > 0 and "0.0 samples/s" not in out  # nor 0.0 samples/s
    _, manifest = ckpt.latest_valid(tmp_path)
    assert manifest["step"] == stopped == _logged_steps(tmp_path)[-1]
    r = l2l(
        "train",
        *TINY,
        "mode=l2l",
        f"trainer.max_steps={stopped + 2}",
        "task.num_train=256",
        "task.num_eval=16",
        f"trainer.resume={tmp_path}",
    )
    assert r.returncode == 0, r.stderr
    assert _logged_steps(tmp_path) == list(range(1, stopped + 3))


def test_the_resume_command_and_an_ooms_path_print_whole_at_any_terminal_width(monkeypatch) -> None:
    """A run dir longer than the terminal (80 columns where stdout is no terminal, as under a scheduler):
    the resume command is printed on one line, whole, and a bracket in a path is text, not markup."""
    import io

    from rich.console import Console

    from l2l_cli import train
    from l2l_cli.runfiles import Summary

    out = io.StringIO()
    monkeypatch.setattr(train, "console", Console(file=out, width=40, color_system=None))
    run = "/scratch/" + "a-long-directory-name/" * 4 + "[sweep 3]"
    command = f"l2l train trainer.resume={run}"
    train.print_stop(
        Summary(status="interrupted", run_dir=run, error="stopped by SIGTERM", resume_with=command)
    )
    train.print_stop(Summary(status="oom", run_dir=run, error="out of memory at layer 3"))
    lines = out.getvalue().splitlines()
    assert lines == [
        "l2l: stopped by SIGTERM",
        f"  resume with: {command}",
        f"l2l: oom: out of memory at layer 3  (see {run}/train.log)",
    ]


@pytest.mark.slow  # the step-boundary SIGTERM is the default one
def test_a_second_signal_exits_at_once(tmp_path) -> None:
    proc = _start(
        tmp_path,
        "mode=baseline_ag",
        "model.num_layers=24",
        "model.hidden_size=256",
        "model.num_heads=4",
        "model.intermediate_size=1024",
    )
    _wait_steps(tmp_path, 1)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT
    assert "second signal (SIGINT): exiting now" in out


@pytest.mark.parametrize(
    "trial", [pytest.param(0, marks=pytest.mark.slow), 1, pytest.param(2, marks=pytest.mark.slow)]
)  # the default suite: L2L-p (its update in flight at the kill); l2l and l2l_stash_cpu: -m slow
def test_sigkill_at_a_random_moment_loses_at_most_the_step_in_flight(tmp_path, trial: int) -> None:
    mode = ["l2l", "l2l_p", "l2l_stash_cpu"][trial]
    proc = _start(tmp_path, f"mode={mode}", "trainer.realtime_ckpt=true", "trainer.save_every=4")
    _wait_steps(tmp_path, 2)
    time.sleep(random.Random(trial).uniform(0.0, 3.0))
    proc.kill()
    proc.communicate(timeout=30)
    done = _logged_steps(tmp_path)[-1]
    _, manifest = ckpt.latest_valid(tmp_path)  # the latest checkpoint always loads
    assert manifest["step"] >= done - 1, (manifest["step"], done)
    cfg = tiny_cfg(
        f"mode={mode}",
        f"trainer.max_steps={manifest['step'] + 2}",
        "task.num_train=256",
        "task.num_eval=16",
        f"trainer.resume={tmp_path}",
    )
    assert run_job(cfg, tmp_path) == "ok"  # and training continues from it


def test_sigkill_without_realtime_resumes_from_the_last_full_checkpoint(tmp_path) -> None:
    proc = _start(tmp_path, "mode=baseline_ag", "trainer.save_every=2")
    _wait_steps(tmp_path, 5)
    proc.kill()
    proc.communicate(timeout=30)
    _, manifest = ckpt.latest_valid(tmp_path)
    assert manifest["step"] >= 4 and manifest["step"] % 2 == 0
    assert not list((tmp_path / "checkpoints").glob(".tmp-*/manifest.json"))


def test_non_finite_steps_are_skipped_then_stop_with_the_step(tmp_path) -> None:
    cfg = tiny_cfg(
        "mode=l2l",
        "optim.lr=1e30",
        "optim.warmup_ratio=0",
        "trainer.max_steps=50",
        "trainer.max_bad_steps=3",
        "task.num_train=256",
        "task.num_eval=16",
    )
    assert run_job(cfg, tmp_path) == "error"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (
        "non-finite loss or gradients at step" in summary["error"]
        and "3 steps in a row skipped" in summary["error"]
    )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows[-3:]] == [True, True, True]


def test_cmp_overflow_skips_are_counted_not_fatal(tmp_path) -> None:
    cfg = tiny_cfg(
        "mode=l2l",
        "precision=cmp",
        "precision.init_scale=1e38",
        "precision.dtype=bf16",
        "trainer.max_steps=8",
        "trainer.max_bad_steps=2",
        "task.num_train=256",
        "task.num_eval=16",
    )
    assert run_job(cfg, tmp_path) == "ok"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["skipped_steps"] >= 1 and summary["status"] == "ok"


@pytest.mark.slow  # the step-boundary SIGTERM is the default one
def test_sigterm_during_the_final_evaluation_stops_it_at_the_next_batch(tmp_path) -> None:
    """20000 dev examples in batches of 4 would take minutes; a SIGTERM while they run ends the evaluation
    at its next batch, with a checkpoint of the finished training and summary.json saying what happened."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "l2l_cli",
            "train",
            *TINY,
            "trainer.max_steps=2",
            "task.num_train=64",
            "task.num_eval=20000",
            "batch.eval_size=4",
            "mode=l2l",
            f"hydra.run.dir={tmp_path}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    log = tmp_path / "train.log"
    deadline = time.time() + 180
    while not (log.exists() and "evaluating at step 2" in log.read_text()):
        assert time.time() < deadline and proc.poll() is None, "the final evaluation did not start"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps"] == 2
    assert "during the final evaluation (evaluation stopped after" in summary["error"]
    done, total = summary["error"].split("stopped after ")[1].split(" batches")[0].split(" of ")
    assert total == "5000" and int(done) < 100  # it stopped at once, not after the 5000 batches
    assert not (tmp_path / "eval.jsonl").exists() and summary["eval"] == {}
    _, manifest = ckpt.latest_valid(tmp_path)  # the training is saved: a resume only evaluates
    assert manifest["step"] == 2 and f"trainer.resume={tmp_path}" in out and "Traceback" not in out + err


@pytest.mark.slow  # two ranks; the one-rank evaluation stop is the default one
def test_a_stop_during_evaluation_on_one_rank_stops_every_rank_together(tmp_path) -> None:
    """2 ranks: rank 0 evaluates (long) while rank 1 waits; a SIGTERM to rank 0 alone ends its evaluation,
    and the ranks agree on the stop (a host all-reduce), so rank 1 does not go on into the next step's
    collectives alone: the job stops cleanly with a checkpoint, well inside ``dist.timeout_s``."""
    import re

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "l2l_cli",
            "train",
            *TINY,
            "dist.nproc=2",
            "batch.size=4",
            "trainer.max_steps=6",
            "trainer.eval_every=2",
            "task.num_train=64",
            "task.num_eval=20000",
            "batch.eval_size=4",
            "mode=l2l",
            "dist.timeout_s=90",
            f"hydra.run.dir={tmp_path}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        log = tmp_path / "train.log"
        deadline = time.time() + 240
        while not (log.exists() and "evaluating at step 2" in log.read_text()):
            assert time.time() < deadline and proc.poll() is None, "the evaluation did not start"
            time.sleep(0.1)
        rank0 = int(re.search(r"rank 0 of 2, pid (\d+)", log.read_text()).group(1))  # type: ignore[union-attr]
        os.kill(rank0, signal.SIGTERM)
        signalled = time.time()
        _, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert time.time() - signalled < 60, "a rank waited for the other until dist.timeout_s"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "interrupted", summary.get("error")
    assert "stopped by SIGTERM after step 2 during the evaluation" in summary["error"]
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    _, manifest = ckpt.latest_valid(tmp_path)
    assert manifest["step"] == 2


def _sigint_as_from_a_terminal() -> None:
    """In the child before exec: SIGINT delivered and handled by default, whatever the suite inherited
    (ignored under ``cmd &``; blocked by a library's thread in this process)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _signal_masks(pid: int) -> str:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "no /proc status"
    return " ".join(ln.replace("\t", "") for ln in lines if ln.startswith(("SigBlk", "SigIgn", "SigCgt")))


def test_ctrl_c_in_the_first_second_is_one_line(tmp_path) -> None:
    """Issue 40 item 9c: Ctrl-C while ``l2l train`` still imports and composes printed a 63-line
    KeyboardInterrupt traceback; it is one line and exit code 130, with no run dir."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "l2l_cli", "train", f"hydra.run.dir={run}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        # as from a terminal: a suite started in the background (``cmd &``) ignores SIGINT, and a child
        # inherits that, so Python would install no KeyboardInterrupt handler and the Ctrl-C would be lost
        preexec_fn=_sigint_as_from_a_terminal,
    )
    time.sleep(0.4)  # the interpreter is up, the command line not yet composed
    status = _signal_masks(proc.pid)  # what the child does with SIGINT, should this fail
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    ours = [ln for ln in (out + err).splitlines() if ln.startswith("l2l:")]
    assert proc.returncode == 130, (status, out, err)
    assert "Traceback" not in out + err and ours == [
        "l2l: train interrupted before it started (nothing written)"
    ]
    assert not run.exists()
