"""One writer per run dir and per disk EPS directory: a second process is refused in one line naming the
holder's pid and host; a holder that dies (SIGKILL) releases the lock."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from l2l_cli.locks import LOCK_NAME, DirectoryInUse, DirLock, LockError, held

HOLD = """
import sys, time
from pathlib import Path
from l2l_cli.locks import DirLock
DirLock(Path(sys.argv[1]), "eps.path").acquire()
print("held", flush=True)
time.sleep(60)
"""


def _holder(path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_process_is_refused_naming_the_holder(tmp_path) -> None:
    proc = _holder(tmp_path / "eps")
    try:
        with pytest.raises(DirectoryInUse) as e:
            DirLock(tmp_path / "eps", "eps.path").acquire()
        msg = str(e.value)
        assert msg.startswith("eps.path: ") and f"pid {proc.pid} on host {socket.gethostname()}" in msg
        assert "\n" not in msg
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path) -> None:
    proc = _holder(tmp_path / "run")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (tmp_path / "run" / LOCK_NAME).exists()  # the file stays; the kernel dropped the lock
    with DirLock(tmp_path / "run", "trainer.resume") as lock:
        assert lock._fd is not None
    DirLock(tmp_path / "run", "trainer.resume").acquire().release()  # released on exit


def test_one_process_may_not_hold_a_directory_twice(tmp_path) -> None:
    """flock is per open file: a second acquire in the same process is refused too (a run that would
    point its EPS at its own run dir's lock twice is a bug, not a reentrant lock)."""
    first = DirLock(tmp_path, "x").acquire()
    try:
        t0 = time.perf_counter()
        with pytest.raises(DirectoryInUse):
            DirLock(tmp_path, "x").acquire()
        assert time.perf_counter() - t0 < 1.0  # refused at once, never waits
    finally:
        first.release()


def test_a_second_run_into_a_live_runs_dir_is_refused_and_writes_nothing_there(tmp_path) -> None:
    """``l2l train hydra.run.dir=<a running run's dir>``: exit 2, one line naming the live run's pid and
    host; the live run's files are left as they were (no summary.json from the refused start)."""
    from tests.util import REPO, TINY, l2l

    run = tmp_path / "run"
    live = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "l2l_cli",
            "train",
            *TINY,
            "trainer.max_steps=100000",
            "task.num_train=256",
            f"hydra.run.dir={run}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    try:
        deadline = time.time() + 120
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text()):
            assert time.time() < deadline and live.poll() is None, "the live run did not start"
            time.sleep(0.2)
        hydra = {p.name: p.read_bytes() for p in (run / ".hydra").iterdir()}
        r = l2l("train", *TINY, "trainer.max_steps=1", "optim.lr=0.5", f"hydra.run.dir={run}")
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert lines[0].startswith(f"l2l: config error: hydra.run.dir: {run} is in use by another l2l run")
        assert f"pid {live.pid} on host {socket.gethostname()}" in lines[0]
        assert not (run / "summary.json").exists() and live.poll() is None
        # refused before Hydra wrote anything: the live run's config is its own (a resume trains under it)
        assert {p.name: p.read_bytes() for p in (run / ".hydra").iterdir()} == hydra
        assert "optim.lr=0.5" not in (run / "train.log").read_text()
    finally:
        live.kill()
        live.wait()


def test_the_lock_file_is_never_followed_through_a_symbolic_link(tmp_path) -> None:
    """A link planted where the lock file goes (a shared eps.path such as /dev/shm) is refused in one line;
    its target is not truncated."""
    target = tmp_path / "precious"
    target.write_text("keep me")
    (tmp_path / "eps").mkdir()
    (tmp_path / "eps" / LOCK_NAME).symlink_to(target)
    with pytest.raises(LockError) as e:
        DirLock(tmp_path / "eps", "eps.path").acquire()
    assert str(e.value).startswith("eps.path: ") and "symbolic link" in str(e.value)
    assert target.read_text() == "keep me"


def test_a_directory_that_cannot_be_written_is_one_line(tmp_path) -> None:
    """A run dir that cannot be made or written (read-only, or under a file) is refused in one line."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(LockError) as e:
        DirLock(tmp_path / "file" / "run", "hydra.run.dir").acquire()
    assert str(e.value).startswith("hydra.run.dir: ") and "cannot be written" in str(e.value)
    assert "\n" not in str(e.value)


def test_the_process_that_took_a_directory_finds_it_held(tmp_path) -> None:
    """l2l train takes its run dir before Hydra starts; the session finds it held and keeps it."""
    lock = DirLock(tmp_path, "hydra.run.dir").acquire()
    try:
        assert held(tmp_path) is lock
    finally:
        lock.release()
    assert held(tmp_path) is None


def test_a_live_runs_eps_path_is_named_by_its_holder(tmp_path, capsys) -> None:
    """A disk EPS folder another live run holds: one line naming that run's pid, not advice to resume it."""
    from l2l_cli.cli import train
    from tests.util import TINY

    eps = tmp_path / "eps"
    proc = _holder(eps)
    try:
        (eps / "commit.json").write_text("{}")
        code = train(
            [*TINY, "mode=l2l", "eps.tier=disk", f"eps.path={eps}", f"hydra.run.dir={tmp_path / 'run'}"]
        )
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1, lines
        assert lines[0].startswith(
            f"l2l: config error: eps.path: {eps} is in use by another l2l run (pid {proc.pid}"
        )
        assert not (tmp_path / "run").exists()
    finally:
        proc.kill()
        proc.wait()


def test_a_runner_that_fails_to_close_still_releases_the_runs_locks(tmp_path, monkeypatch) -> None:
    """A disk EPS whose last write finds the disk full raises from ``runner.close()``: the session still
    releases its locks (run dir, eps.path) and the accelerator's threads, so the next job of a ``-m``
    sweep in this process may take the same eps.path."""
    from l2l_cli.session import build
    from tests.util import tiny_cfg, tiny_data

    eps = tmp_path / "eps"
    cfg = tiny_cfg("mode=l2l", "eps.tier=disk", f"eps.path={eps}", "trainer.max_steps=1")
    session = build(cfg, tmp_path / "run", data=tiny_data(cfg))
    assert session.runner is not None

    real = session.runner.close

    def full() -> None:
        real()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(session.runner, "close", full)
    with pytest.raises(OSError, match="No space left"):
        session.close()
    DirLock(eps, "eps.path").acquire().release()  # free again
    DirLock(tmp_path / "run", "hydra.run.dir").acquire().release()
