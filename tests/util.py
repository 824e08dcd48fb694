"""Shared test helpers: tiny configs composed exactly as the CLI composes them, and in-process runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from l2l_cli.compose import compose
from l2l_cli.config import ModelConfig
from l2l_cli.data.batches import Batch, TrainStream
from l2l_cli.data.synthetic import synthetic
from l2l_cli.data.tasks import TASKS, TaskData
from l2l_cli.models import FAMILIES, ModelSpec
from l2l_cli.modes import Runner
from l2l_cli.session import build
from tests.cliserver import FAULTS

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
    "mode.recompute=full",  # the papers' algorithm (every layer recomputed); the L2L modes' default is auto
]


def tiny_cfg(*overrides: str) -> DictConfig:
    return compose([*TINY, *overrides])


def bert_spec(
    num_layers: int, hidden: int, heads: int, intermediate: int, num_labels: int = 2, **sizes: Any
) -> ModelSpec:
    """A BERT spec of these sizes, the rest from the schema's defaults (``model.*``)."""
    m = replace(
        ModelConfig(),
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=heads,
        intermediate_size=intermediate,
        **sizes,
    )
    return FAMILIES["bert"].from_config(m, num_labels)


def tiny_data(cfg: DictConfig, n_train: int = 256, n_dev: int = 64) -> TaskData:
    """A small synthetic task for ``cfg`` (building the default 8192 examples each time is wasted)."""
    train = synthetic(n_train, cfg.task.max_seq_len, cfg.model.vocab_size, seed=1)
    dev = synthetic(n_dev, cfg.task.max_seq_len, cfg.model.vocab_size, seed=2)
    return TaskData(TASKS["synthetic"], train, dev, "synthetic")


@contextmanager
def built(cfg: DictConfig, total_steps: int = 10, data: TaskData | None = None) -> Iterator[Runner]:
    """A runner for ``cfg`` built by the session builder (meter on), closed afterwards. ``total_steps``
    sets the learning-rate schedule's length (trainer.max_steps); ``data``: the task's data (default: a
    small synthetic task)."""
    cfg = cfg.copy()
    cfg.trainer.max_steps = total_steps
    with build(cfg, data=data or tiny_data(cfg)) as session:
        assert session.runner is not None
        yield session.runner


def batches(cfg: DictConfig, n: int = 256, seed: int = 1) -> Iterator[Batch]:
    data = synthetic(n, cfg.task.max_seq_len, cfg.model.vocab_size, seed=seed)
    pad = cfg.task.max_seq_len if cfg.task.pad_to_max else None
    return TrainStream(data, cfg.batch.size, seed=0, pad_to_max=pad).batches()


def weights(runner: Runner) -> dict[str, torch.Tensor]:
    """A copy of every weight, by HF name (made outside the device meter: it is the test's memory)."""
    with runner.acc.meter.paused():
        return {n: t.detach().float().clone() for n, t in runner.hf_tensors()}


def train(
    cfg: DictConfig, steps: int = 3, total_steps: int = 10, data: TaskData | None = None
) -> dict[str, Any]:
    """Run ``steps`` steps in-process; returns losses, final weights, reports and the device peak.
    ``data``: the task's data (its train split feeds the steps; default: the synthetic task)."""
    with built(cfg, total_steps, data) as runner:
        it = batches(cfg) if data is None else TrainStream(data.train, cfg.batch.size, seed=0).batches()
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
        x, y = (
            a[k].cpu(),
            b[k].cpu(),
        )  # the values: a baseline's weights stay on the device, the EPS's on the host
        torch.testing.assert_close(x, y, rtol=rtol, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


# variables the package reads at import that ``tests.cliserver``'s child sets again from its own environment:
# a command given only these is forked from the server too
SERVER_ENV = frozenset(FAULTS)


def l2l(
    *args: str,
    timeout: float = 300,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """The real CLI as a process of its own (``python -m l2l_cli``, so it runs wherever the tests run).
    It is forked from ``tests.cliserver``, which has paid the imports once; with ``fresh``, with ``env``
    (variables a module may read at import) or with ``L2L_TEST_FRESH=1`` in the environment, a new
    interpreter runs it instead (what a user's shell starts: the imports, their warnings, the startup);
    except for the fault injections of :data:`SERVER_ENV`, which the server's child reads again itself."""
    served = not fresh and (env is None or set(env) <= SERVER_ENV)
    return _run(None, args, timeout, cwd, env, served)


def python(
    script: Path, *args: str, timeout: float = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` (an example or a benchmark of the repository) as a process of its own, forked
    from ``tests.cliserver`` as :func:`l2l` commands are (without seconds of imports per script); with
    ``L2L_TEST_FRESH=1`` in the environment, a new interpreter."""
    return _run(str(script), args, timeout, cwd, None, True)


def _argv(script: str | None, args: Sequence[str]) -> list[str]:
    """``python SCRIPT ARGS``, or ``python -m l2l_cli ARGS`` without a script."""
    return [sys.executable, *([script] if script else ["-m", "l2l_cli"]), *args]


def _run(
    script: str | None,
    args: Sequence[str],
    timeout: float,
    cwd: Path | None,
    env: dict[str, str] | None,
    served: bool,
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if served and os.environ.get("L2L_TEST_FRESH") != "1":
        return _SERVER.run(list(args), timeout, cwd or REPO, full_env, script=script)
    return subprocess.run(
        _argv(script, args), capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO, env=full_env
    )


class _CliServer:
    """The client of ``tests.cliserver`` (started at the first command, one per test session)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.buf = b""

    def _line(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The server's next reply, or None after ``timeout`` seconds without one."""
        import select
        import time

        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            assert chunk, "tests.cliserver ended"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def _start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.cliserver"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=REPO,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            self.buf = b""
            assert (self._line() or {}).get("ready"), "tests.cliserver did not start"
        return self.proc

    def run(
        self, argv: list[str], timeout: float, cwd: Path, env: dict[str, str], script: str | None = None
    ) -> subprocess.CompletedProcess:
        import tempfile

        proc = self._start()
        assert proc.stdin is not None
        with tempfile.TemporaryDirectory(prefix="l2l-cli-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            req = {
                "argv": argv,
                "cwd": str(cwd),
                "env": env,
                "out": str(out),
                "err": str(err),
                "script": script,
            }
            proc.stdin.write(json.dumps(req).encode() + b"\n")
            proc.stdin.flush()
            pid = (self._line() or {})["pid"]
            done = self._line(timeout)
            if done is None:  # as subprocess.run: the command is killed, then TimeoutExpired
                os.kill(pid, 9)
                self._line()
            stdout, stderr = (p.read_text(errors="replace") if p.exists() else "" for p in (out, err))
        cmd = _argv(script, argv)
        if done is None:
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
        return subprocess.CompletedProcess(cmd, done["returncode"], stdout, stderr)


_SERVER = _CliServer()


def kill_rank_1_mid_run(run_dir: Path, *overrides: str) -> None:
    """Start a 2-rank ``l2l train`` with ``overrides``, SIGKILL rank 1 once 3 steps are logged, and check
    the job ends within a minute, non-zero, naming the rank, with a summary that says so."""
    import json
    import re
    import signal
    import time

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "l2l_cli",
            "train",
            *overrides,
            "trainer.max_steps=100000",
            "task.num_train=256",
            "dist.timeout_s=30",
            f"hydra.run.dir={run_dir}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.time() + 120
        metrics = run_dir / "metrics.jsonl"
        while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
            time.sleep(0.5)
        log = (run_dir / "train-rank1.log").read_text()
        victim = int(re.search(r"rank 1 of 2, pid (\d+)", log).group(1))  # type: ignore[union-attr]
        os.kill(
            victim, signal.SIGKILL
        )  # rank 0 is blocked in a collective or a recv from it, or soon will be
        killed_at = time.time()
        _, err = proc.communicate(timeout=90)
        assert time.time() - killed_at < 60
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert "rank 1 failed (killed by signal 9)" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "error" and "rank 1 failed" in summary["error"]


def recording_p2p(posted: list[tuple[str, ...]], request_per_op: bool) -> Any:
    """A stand-in for ``torch.distributed``'s point-to-point calls (``p2p.dist``): each post is recorded in
    ``posted`` (a batch as its ops' names, a lone op as "isend alone" / "irecv alone"), each receive fills
    its tensor with its tag (stage, direction, micro-batch), and a batch returns one request per op (gloo)
    or one for the whole batch (NCCL: ``request_per_op`` false)."""
    from types import SimpleNamespace

    class Work:
        def wait(self) -> None:
            return None

    class FakeDist:
        @staticmethod
        def P2POp(op: Any, tensor: Any, peer: int, group: object = None, tag: int = 0) -> Any:
            return SimpleNamespace(op=op, tensor=tensor, peer=peer, tag=tag)

        @staticmethod
        def barrier(group: object = None) -> None:
            return None

        @staticmethod
        def isend(tensor: Any, dst: int = 0, group: object = None, tag: int = 0) -> Work:
            posted.append(("isend alone",))
            return Work()

        @staticmethod
        def irecv(tensor: Any, src: int = 0, group: object = None, tag: int = 0) -> Work:
            tensor.fill_(tag)
            posted.append(("irecv alone",))
            return Work()

        @staticmethod
        def batch_isend_irecv(ops: list) -> list[Work]:
            for op in ops:
                if op.op is FakeDist.irecv:
                    op.tensor.fill_(op.tag)
            posted.append(tuple(op.op.__name__ for op in ops))
            return [Work() for _ in ops] if request_per_op else [Work()]

    return FakeDist
