"""One training run: build the session, run the loop, write how it ended.

Run dir contract (users and ``l2l report`` rely on it; the types are in :mod:`l2l_cli.runfiles`):
  metrics.jsonl  one MetricsRow per logged step       eval.jsonl    one object per evaluation
  memory.json    MemoryReport (device peak and parts, host bytes, link bytes)
  summary.json   Summary (status ok | oom | error | interrupted, throughput, time by phase, eval, ...)
  checkpoints/   step_<k>/ (trainer.save_every) and realtime/step_<k>/ (trainer.realtime_ckpt)
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from l2l_cli.checkpoint import CheckpointError
from l2l_cli.config.validate import require_valid
from l2l_cli.engine.dist import shutdown as dist_shutdown
from l2l_cli.loop import Interrupted, TrainingError
from l2l_cli.memory_report import memory_report
from l2l_cli.problems import ConfigError, WriteFailed
from l2l_cli.progress import console, summary_table, summary_text
from l2l_cli.rundir import RunFiles
from l2l_cli.runfiles import Summary, host_bytes_per_param
from l2l_cli.session import Session

log = logging.getLogger("l2l")


def run_dir_of(cfg: DictConfig) -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def run_job(cfg: DictConfig, run_dir: Path, handle_sigint: bool = True) -> str:
    """One training run (one rank of it, under data parallel): build -> run -> write. Returns its status
    (ok | oom | error | interrupted:<signal>, or config for bad input); failures go to summary.json."""
    t_start = time.perf_counter()
    stop = StopSignals(handle_sigint)
    session = Session(cfg, run_dir, stop=stop)
    summary = session.summary
    try:
        require_valid(cfg)  # the entry's check (a config the preflight validated and marked passes at once)
        session.open()
        assert session.trainer is not None
        session.trainer.run()
        summary.status = "ok"
    except ConfigError as e:
        summary.status, summary.error, summary.exit_code = "error", f"config: {e}", 2
        session.problems = [str(p) for p in e.problems]
    except CheckpointError as e:
        summary.status, summary.error, summary.exit_code = "error", f"checkpoint: {e}", 2
        session.problems = [str(e)]
    except TrainingError as e:
        summary.status, summary.error = "error", str(e)
    except (
        WriteFailed
    ) as e:  # one line naming the path (a full disk: the free space); the last checkpoint stands
        summary.status, summary.error = "error", str(e)
    except Interrupted as e:
        summary.status, summary.error = "interrupted", str(e)
        summary.exit_code, summary.resume_with = 128 + e.signum, e.resume_with
    except Exception as e:
        if session.acc is not None and session.acc.is_oom(e):
            summary.status, summary.error = "oom", oom_message(e)
        else:
            summary.status, summary.error = "error", f"{type(e).__name__}: {e}"
            log.error("run failed:\n%s", traceback.format_exc())
            session.crashed = True
    finally:
        stop.restore()
        try:
            session.close()
        except WriteFailed as e:  # the last background write (a disk EPS's commit) failed
            if summary.status == "ok":
                summary.status, summary.error = "error", str(e)
        except CheckpointError as e:  # a background job's refusal (a disk EPS's checksum), or raised again
            if summary.status == "ok":  # by the job the run already stopped on: the first one stands
                summary.status, summary.error, summary.exit_code = "error", f"checkpoint: {e}", 2
                session.problems = [str(e)]
    if summary.status == "ok":
        remove_encoded_base(session)
    write_outcome(session, time.perf_counter() - t_start)
    return summary.code


def remove_encoded_base(session: Session) -> None:
    """A finished LoRA run's frozen base encoded on disk (``peft.base_source=disk``) is removed unless
    ``peft.keep_encoded_base`` keeps it for a resume to more steps or a next run on the same base and
    ``eps.path``; a run that stopped short (a signal, an error, a kill) keeps it for its resume to reuse."""
    from l2l_cli.engine.frozen_disk import remove_encoded
    from l2l_cli.models.lora_settings import on_disk

    peft = session.cfg.peft
    if (
        peft.name != "none"
        and on_disk(peft.base_source)
        and not peft.keep_encoded_base
        and session.dist.rank == 0
    ):
        remove_encoded(session.tier.path)


def write_outcome(session: Session, wall_s: float) -> None:
    """memory.json and summary.json (rank 0), the summary table, and how to go on.

    A resume that did not get as far as loading its checkpoint writes nothing into the run it would have
    continued (that run's files stay as they were); a start refused for bad input (exit 2) writes only
    summary.json, saying why, and prints one line, never a table of empty fields."""
    summary, files, ctx = session.summary, session.files, session.dist
    summary.wall_time_s = wall_s
    rank0 = int(os.environ.get("RANK", "0")) == 0
    bad_input = summary.exit_code == 2
    if summary.status != "ok" and (session.locked_out or (session.resuming and not session.resumed)):
        dist_shutdown(ctx)  # another run's dir, or one a refused resume would have continued: untouched
        if rank0:
            _error_lines(summary, session.problems, f"{summary.run_dir} was left as it was")
        log.error("start refused: %s (the run's files were left as they were)", summary.error)
        return
    if summary.status != "ok" and session.runner is not None and not summary.steps:
        summary.steps = session.runner.step_count  # how far a failed or stopped run got
    if session.acc is not None and not bad_input:
        memory = memory_report(session.acc, session.runner)
        if ctx.enabled and summary.status == "ok":  # per-rank memory and timing, gathered on rank 0
            memory.ranks = ctx.gather(
                {"rank": ctx.rank, **memory.to_json(), "time_breakdown_s": summary.time_breakdown_s}
            )
        _write_file(files, "memory.json", memory.to_json())
        summary.host_bytes_per_param = host_bytes_per_param(memory.host.parts, summary.params)
        summary.device_peak_bytes = max(summary.device_peak_bytes, session.acc.meter.peak_bytes)
    dist_shutdown(ctx)
    _write_file(files, "summary.json", summary.to_json())
    started = summary.config.mode is not None and not bad_input  # the table has something to show
    if started:
        log.info("run ended: %s\n%s", summary.status, summary_text(summary))
    elif summary.error:
        log.error("run did not start: %s", summary.error)
    if not rank0:
        return
    if started:
        console.print(summary_table(summary))
    if summary.status in ("interrupted", "oom"):
        print_stop(summary)
    elif summary.status != "ok":
        where = (
            "" if bad_input else f"{'traceback in' if session.crashed else 'see'} {summary.run_dir}/train.log"
        )
        _error_lines(summary, session.problems, where)


def _write_file(files: RunFiles, name: str, obj: dict) -> None:
    """A run file; on a full disk the run's one line still says why it stopped (the file is logged lost)."""
    try:
        files.write(name, obj)
    except WriteFailed as e:
        log.error("%s not written: %s", name, e)


def print_stop(summary: Summary) -> None:
    """An interrupted run's line and the command that resumes it, or an oom's line: never wrapped at the
    terminal's width (the command and the paths are copied from them), the error's text taken as it is
    (a path with brackets is no markup)."""
    from rich.markup import escape

    if summary.status == "interrupted":
        resume = escape(summary.resume_with or "")
        text = f"[bold yellow]l2l: {escape(summary.error or '')}[/]\n  resume with: {resume}"
    else:
        text = (
            f"[bold red]l2l: oom[/]: {escape(summary.error or '')}  (see {escape(summary.run_dir)}/train.log)"
        )
    console.print(text, soft_wrap=True)


def _error_lines(summary: Summary, problems: list[str], where: str) -> None:
    """Bad input: one line per problem (``l2l: config error: key: what``); a failure: its first line."""
    if summary.exit_code == 2 and problems:
        for problem in problems:
            print(f"l2l: config error: {problem}", file=sys.stderr)
        return
    first = summary.error.splitlines()[0] if summary.error else summary.status
    print(f"l2l: {summary.status}: {first}" + (f" ({where})" if where else ""), file=sys.stderr)


def exit_code(status: str) -> int:
    if status.startswith("interrupted:"):
        return 128 + int(status.split(":")[1])
    return {"ok": 0, "oom": 3, "config": 2}.get(status, 1)


class StopSignals:
    """SIGINT/SIGTERM: the first asks the loop to stop at the next step boundary (and save); a second one
    exits at once. Under the elastic launcher, ranks take SIGTERM from the agent and ignore SIGINT."""

    def __init__(self, handle_sigint: bool = True):
        self.signum = 0
        self._saved: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM) if handle_sigint else (signal.SIGTERM,):
            self._saved[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum:
            print(
                f"\nl2l: second signal ({signal.Signals(signum).name}): exiting now, without a checkpoint",
                flush=True,
            )
            os._exit(128 + signum)
        self.signum = signum
        print(
            f"\nl2l: {signal.Signals(signum).name}: stopping after this step (again to exit at once)",
            flush=True,
        )

    def restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()


def oom_message(e: BaseException) -> str:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return (
        f"{first}. Knobs that lower device memory: a smaller batch.ubatch_size, mode=l2l (layers relayed "
        f"from host memory), mode.stash=cpu (activation stash in host memory), precision=cmp (half-size "
        f"device copies)"
    )


__all__ = ["exit_code", "run_dir_of", "run_job"]
