"""One Hydra job: run it in this process, or with ``dist.nproc > 1`` launch that many ranks through torch's
elastic launcher (as ``torchrun`` would) and wait for them. Under ``torchrun`` each process is a rank.

A rank that dies makes the agent stop the others; the job then ends with an error naming the rank.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from l2l_cli.compose import compose, setup
from l2l_cli.config.settings import mark_validated, validated_before
from l2l_cli.data.synthetic import synthetic
from l2l_cli.data.tasks import TASKS, TaskData
from l2l_cli.engine.dist import failure_message, launch
from l2l_cli.inherit import ANNOUNCED, changed, inherit, saved_config
from l2l_cli.rundir import RunFiles
from l2l_cli.runfiles import Summary, read_json
from l2l_cli.session import build
from l2l_cli.train import exit_code, run_dir_of, run_job


def run_task(cfg: DictConfig) -> str:
    """Run the job for the composed ``cfg``; returns its status (ok | oom | error | config). A resume
    runs with the resumed run's own config, this command line's keys on top (l2l_cli/inherit.py). A
    config with the values ``l2l train``'s preflight validated is marked so, and is not validated again."""
    run_dir = run_dir_of(cfg)
    if cfg.trainer.resume:
        saved = saved_config(Path(cfg.trainer.resume))
        cfg = inherit(saved, list(HydraConfig.get().overrides.task))
        for key, (old, new) in changed(saved, cfg).items():
            logging.getLogger("l2l").info("resume: %s=%s (was %s)", key, new, old)
            if key in ANNOUNCED:
                print(f"l2l: note: resume with {key}={new} (was {old}): {ANNOUNCED[key]}", file=sys.stderr)
    validated = validated_before(cfg)
    if validated:
        mark_validated(cfg)
    if cfg.dist.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return launch_ranks(cfg, run_dir, validated)
    if "WORLD_SIZE" in os.environ:  # a rank under torchrun
        watch_agent()
    return run_job(cfg, run_dir)


def watch_agent(interval_s: float = 1.0) -> None:
    """A rank whose agent died (torchrun killed with SIGKILL cannot stop its workers) stops as if the agent
    had: SIGTERM to itself, the trainer's stop at the next step boundary, every rank agreeing; the job ends
    non-zero on every node instead of the orphans training on."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        logging.getLogger("l2l").error("the launcher (pid %d) died: stopping this rank", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="l2l-agent-watch", daemon=True).start()


def launch_ranks(cfg: DictConfig, run_dir: Path, validated: bool = False) -> str:
    """``dist.nproc`` ranks of this job through the elastic launcher; rank 0's status (``validated``: the
    config was validated here, so the ranks do not validate it again)."""
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):  # their tracebacks go to train.log
        logging.getLogger(name).setLevel(logging.CRITICAL)
    cfg_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    try:
        results = launch(cfg.dist.nproc, _rank_main, (cfg_yaml, str(run_dir), validated))
        return results[0]
    except Exception as e:  # ChildFailedError (a rank died or failed), or the launcher itself
        msg = failure_message(e)
        logging.getLogger("l2l").error("data-parallel job failed: %s", msg)
        obj, _ = read_json(run_dir / "summary.json")
        summary = Summary.from_json(obj) if obj else Summary(run_dir=str(run_dir))
        if summary.status in ("oom", "interrupted"):  # rank 0 said what happened to every rank
            return summary.code
        if summary.error:  # rank 0's own error is a consequence; the failed rank is the cause
            summary.rank0_error = summary.error
        summary.status, summary.error = "error", msg
        RunFiles(run_dir).write("summary.json", summary.to_json())
        failed = re.search(r"\brank (\d+) failed", msg)
        log_file = (
            "train.log" if failed is None or failed.group(1) == "0" else f"train-rank{failed.group(1)}.log"
        )
        print(f"l2l: error: {msg} (see {run_dir}/{log_file})", file=sys.stderr)
        return "error"


def _rank_main(cfg_yaml: str, run_dir: str, validated: bool = False) -> str:
    """Entry point of each rank spawned by the elastic launcher."""
    setup()
    rank = int(os.environ.get("RANK", "0"))
    log_file = Path(run_dir) / ("train.log" if rank == 0 else f"train-rank{rank}.log")
    logging.basicConfig(
        filename=log_file,
        level=logging.INFO,
        format=f"[%(asctime)s][rank {rank}][%(name)s][%(levelname)s] %(message)s",
    )
    if "OMP_NUM_THREADS" not in os.environ:  # ranks share the cores: oversubscribed OpenMP threads crawl
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    logging.getLogger("l2l").info("rank %d of %s, pid %d", rank, os.environ.get("WORLD_SIZE"), os.getpid())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent turns the user's Ctrl-C into one SIGTERM
    watch_agent()
    cfg = OmegaConf.create(cfg_yaml)
    if validated:  # the launching process validated these values before it started the ranks
        mark_validated(cfg)
    status = run_job(cfg, Path(run_dir), handle_sigint=False)
    if status != "ok":
        # a failed rank must not leave the others waiting in a collective: exit non-zero, the agent
        # stops them (when every rank failed the same way, rank 0's summary already says why)
        sys.exit(exit_code(status))
    return status


def run_jobs(
    nproc: int, jobs: list[list[str]], steps: int, save: dict[int, str] | None = None
) -> dict[int, list[dict]]:
    """Run each config of ``jobs`` (overrides) on ``nproc`` local ranks sharing one process group, to
    ``trainer.max_steps`` (default ``steps``; a resumed job goes on from its checkpoint's step), on the
    synthetic task (``task.num_train`` examples, seed 1: the tests' reference data). For tests and
    benchmarks: starting ranks costs seconds, a small config's steps milliseconds. ``save``: job index -> a
    run directory that gets a checkpoint after its steps (a later job's ``trainer.resume=<dir>`` goes on
    from it). Returns, per rank, one dict per job: losses, step times and the reports' extras, and on rank
    0 every weight by Hugging Face name and the mode's summary sections."""
    return launch(nproc, _jobs_main, (jobs, steps, save or {}))


def _jobs_main(jobs: list[list[str]], steps: int, save: dict[int, str]) -> list[dict]:
    setup()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    out = []
    for k, overrides in enumerate(jobs):
        cfg = compose([f"trainer.max_steps={steps}", *overrides])
        train = synthetic(cfg.task.num_train, cfg.task.max_seq_len, cfg.model.vocab_size, seed=1)
        dev = synthetic(cfg.task.num_eval, cfg.task.max_seq_len, cfg.model.vocab_size, seed=2)
        run_dir = Path(save[k]) if k in save else None
        with build(cfg, run_dir, data=TaskData(TASKS["synthetic"], train, dev, "synthetic")) as s:
            assert s.runner is not None and s.stream is not None and s.trainer is not None
            batches = s.stream.batches(start_step=s.runner.step_count)
            reports = [
                s.runner.step(next(batches)) for _ in range(s.runner.step_count, cfg.trainer.max_steps)
            ]
            if run_dir is not None:
                s.trainer.save()
            s.runner.collect()
            sections = s.runner.sections()
            rank0 = s.dist.rank == 0
            out.append(
                {
                    "losses": [r.loss for r in reports],
                    "extra": [r.extra for r in reports],
                    "step_time_s": [r.step_time_s for r in reports],
                    "samples": [r.samples * s.dist.data_world for r in reports],
                    "weights": {n: t.detach().float().clone() for n, t in s.runner.hf_tensors()}
                    if rank0
                    else None,
                    "sections": sections if rank0 else None,
                    "peak": s.runner.acc.meter.peak_bytes,  # this rank's device peak, and its parts
                    "parts": dict(s.runner.acc.meter.peak_parts),
                }
            )
    return out
