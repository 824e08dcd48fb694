"""Training runs that must each be a process of their own (killed with SIGKILL, or measured for peak RSS),
forked from one fresh interpreter so the imports are paid once.

    python -m tests.forkrun JOBS.json RESULTS.json [PARALLEL]

JOBS.json: a list of {"overrides": [...], "run_dir": str, "crash": "<event>:<n>" (the disk EPS kills its own
process there; see l2l_cli.engine.tiers.disk.format), "kill_after_steps": n (SIGKILL from outside once n steps
are logged, after "kill_delay_s"), "fault": "<ENOSPC|EIO>:<path part>@n" (that write refused)}. RESULTS.json:
per job {"signal", "exit", "maxrss_bytes"} (the child's peak RSS, from wait4). PARALLEL (default 1): jobs
run up to that many at a time (none killed; what each measures is its own peak RSS, not time). The parent
only imports: no torch op runs before a fork."""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

# imported before the forks, so each child starts with them: the run's modules, and what a run imports on
# first use (torch._dynamo with the first dispatch mode: ~1 s; BERT's modeling: ~2 s)
PRELOAD = (
    "l2l_cli.compose",
    "l2l_cli.data.metrics",
    "l2l_cli.engine.tiers.disk",
    "l2l_cli.train",
    "torch._dynamo",
    "transformers.models.bert.modeling_bert",
)


def _logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.endswith("}"))


def _child(job: dict, run_dir: Path) -> None:
    try:
        log = os.open(run_dir / "child.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        from l2l_cli.compose import compose
        from l2l_cli.engine.tiers.disk import format as disk_format
        from l2l_cli.train import run_job

        disk_format._CRASH = job.get("crash", "")
        if job.get("fault"):  # "<ENOSPC|EIO>:<path part>@n": that write refused (l2l_cli.problems.writing)
            from l2l_cli import problems

            kind, _, where = job["fault"].partition(":")
            setattr(problems, "_FAULT" if kind == "ENOSPC" else "_FAULT_EIO", where)
        status = run_job(compose(job["overrides"]), run_dir)
        os._exit(0 if status == "ok" else 1)
    except BaseException:
        traceback.print_exc()
        os._exit(1)


def _result(status: int, usage: object) -> dict:
    return {
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "maxrss_bytes": usage.ru_maxrss * 1024,  # type: ignore[attr-defined]
    }


def _start(job: dict) -> int:
    run_dir = Path(job["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        _child(job, run_dir)
    return pid


def main(jobs_path: str, results_path: str, parallel: int = 1) -> None:
    for name in PRELOAD:
        importlib.import_module(name)

    jobs = json.loads(Path(jobs_path).read_text())
    if parallel > 1:  # jobs measured apart (peak RSS is each child's own), up to ``parallel`` at a time
        assert not any(job.get("kill_after_steps") for job in jobs), "a killed job runs alone"
        results: list[dict | None] = [None] * len(jobs)
        running: dict[int, int] = {}
        for i, job in enumerate(jobs):
            if len(running) == parallel:
                pid, status, usage = os.wait4(-1, 0)
                results[running.pop(pid)] = _result(status, usage)
            running[_start(job)] = i
        while running:
            pid, status, usage = os.wait4(-1, 0)
            results[running.pop(pid)] = _result(status, usage)
        Path(results_path).write_text(json.dumps(results))
        return
    results = []
    for job in jobs:
        run_dir = Path(job["run_dir"])
        pid = _start(job)
        done = None
        if job.get("kill_after_steps"):
            deadline = time.time() + 300
            while done is None and _logged(run_dir) < job["kill_after_steps"] and time.time() < deadline:
                reaped = os.wait4(pid, os.WNOHANG)
                done = reaped if reaped[0] else None
                time.sleep(0.05)
            if done is None:
                time.sleep(job.get("kill_delay_s", 0.0))
                os.kill(pid, signal.SIGKILL)
        _, status, usage = done or os.wait4(pid, 0)
        results.append(_result(status, usage))
    Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:4]))
