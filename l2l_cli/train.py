"""The training loop: step -> log -> eval -> checkpoint, and the run directory's files.

Run dir contract (later issues and users rely on it):
  metrics.jsonl  one object per logged step: step, loss, lr, samples_per_s, step_time_s, device_peak_bytes, ...
  eval.jsonl     one object per evaluation: step, metrics
  memory.json    {"device": {peak_bytes, method, parts}, "host": {bytes, parts}, ...}
  summary.json   status (ok | oom | error | interrupted), steps, samples_per_s, device_peak_bytes,
                 time_breakdown_s, eval, params
  checkpoints/   step_<k>/ (trainer.save_every) and realtime/step_<k>/ (trainer.realtime_ckpt)
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from l2l_cli import checkpoint as ckpt
from l2l_cli.checkpoint import CheckpointError, RealtimeWriter
from l2l_cli.config import ConfigError, effective_clip, effective_precision, validate
from l2l_cli.data.batches import TrainStream, eval_batches
from l2l_cli.data.loading import TaskData, load_task
from l2l_cli.engine.device import Accelerator, make_accelerator
from l2l_cli.engine.dist import DistContext
from l2l_cli.engine.dist import from_env as dist_from_env
from l2l_cli.engine.dist import shutdown as dist_shutdown
from l2l_cli.engine.precision import make_precision
from l2l_cli.models.bert import ModelSpec, resolve_pretrained, save_hf
from l2l_cli.profiling.memory import fmt_bytes
from l2l_cli.progress import RunProgress, console, summary_table
from l2l_cli.runners import make_runner
from l2l_cli.runners.common import Runner

log = logging.getLogger("l2l")


def method_label(cfg: Any) -> str:
    """The papers' METHOD column: baseline, baseline-ag, l2l, l2l-p, with '-stash-cpu' where it applies."""
    name = {"baseline": "baseline", "baseline_ag": "baseline-ag", "l2l": "l2l", "l2l_p": "l2l-p"}[
        cfg.mode.name
    ]
    return name + ("-stash-cpu" if cfg.mode.stash == "cpu" else "")


def model_spec(cfg: Any, num_labels: int) -> ModelSpec:
    if cfg.model.pretrained:
        return ModelSpec.from_hf_dir(
            resolve_pretrained(cfg.model.pretrained), dropout=cfg.model.dropout, num_labels=num_labels
        )
    return ModelSpec.from_config(cfg.model, num_labels)


def total_steps(cfg: Any, stream: TrainStream) -> int:
    return cfg.trainer.max_steps if cfg.trainer.max_steps > 0 else cfg.trainer.epochs * stream.steps_per_epoch


def evaluate(runner: Runner, data: TaskData, cfg: Any) -> dict[str, float]:
    """The task's GLUE metrics on the dev split."""
    preds = np.zeros(len(data.dev), dtype=np.float64 if data.spec.is_regression else np.int64)
    size = cfg.batch.eval_size or cfg.batch.size
    pad = cfg.task.max_seq_len if cfg.task.pad_to_max else None
    for idx, batch in eval_batches(data.dev, size, pad):
        logits = runner.predict(batch)
        preds[idx] = logits.squeeze(-1).numpy() if data.spec.is_regression else logits.argmax(-1).numpy()
    from l2l_cli.data.metrics import compute

    labels = np.asarray(data.dev.labels)
    return compute(data.spec.metrics, preds, labels)


def evaluate_on_rank0(runner: Runner, data: TaskData, cfg: Any, ctx: DistContext) -> dict[str, float]:
    """Rank 0 evaluates (the weights are identical on every rank); the others wait for it."""
    metrics = evaluate(runner, data, cfg) if ctx.rank == 0 else {}
    ctx.barrier()
    return metrics


class RunFiles:
    """Writers for the run directory's files."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.dir = run_dir
        self.enabled = enabled
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)

    def append(self, name: str, record: dict[str, Any]) -> None:
        if self.enabled:
            with (self.dir / name).open("a") as f:
                f.write(json.dumps(record) + "\n")

    def write(self, name: str, obj: dict[str, Any]) -> None:
        if self.enabled:
            tmp = self.dir / f".{name}.tmp"
            tmp.write_text(json.dumps(obj, indent=2) + "\n")
            os.replace(tmp, self.dir / name)


def run_dir_of(cfg: DictConfig) -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def run_job(cfg: DictConfig, run_dir: Path, handle_sigint: bool = True) -> str:
    """One training run (one rank of it, under data parallel). Returns its status (ok | oom | error |
    interrupted, or config for bad input); failures are written to summary.json, not raised."""
    rank = int(os.environ.get("RANK", "0"))
    files = RunFiles(run_dir, enabled=rank == 0)
    t_start = time.perf_counter()
    summary: dict[str, Any] = {"status": "error", "run_dir": str(run_dir), "steps": 0}
    acc: Accelerator | None = None
    runner: Runner | None = None
    ctx = DistContext()
    stop = StopSignals(handle_sigint)
    try:
        problems = validate(cfg)
        if problems:
            raise ConfigError(problems)
        ctx = dist_from_env(cfg)
        torch.manual_seed(cfg.trainer.seed)
        data = load_task(cfg.task, cfg.model)
        spec = model_spec(cfg, data.spec.num_labels)
        stream = TrainStream(
            data.train, cfg.batch.size, seed=cfg.trainer.seed, world=ctx.world, rank=ctx.rank,
            pad_to_max=cfg.task.max_seq_len if cfg.task.pad_to_max else None,
        )  # fmt: skip
        steps = total_steps(cfg, stream)
        acc = make_accelerator(cfg, local_rank=ctx.local_rank)
        summary.update(run_header(cfg, spec, acc, data, ctx.world))
        summary["params"] = runner_params(spec)  # known even when building the runner runs out of memory
        log.info("run %s on %s: %s", run_dir, acc.describe(), json.dumps(summary["config"]))
        with acc.running():
            precision = make_precision(cfg, acc)
            runner = make_runner(cfg, acc, spec, precision, steps, dist=ctx)
            trainer = Trainer(cfg, runner, stream, data, steps, files, summary, ctx, stop)
            if cfg.trainer.resume:
                trainer.resume(Path(cfg.trainer.resume))
            elif cfg.model.pretrained:
                load_pretrained(runner, cfg.model.pretrained)
            trainer.run()
            summary["status"] = "ok"
    except ConfigError as e:
        summary.update(status="error", error=f"config: {e}", exit_code=2)
    except CheckpointError as e:
        summary.update(status="error", error=f"checkpoint: {e}", exit_code=2)
    except TrainingError as e:
        summary.update(status="error", error=str(e))
    except Interrupted as e:
        summary.update(
            status="interrupted", error=str(e), exit_code=128 + e.signum, resume_with=e.resume_with
        )
    except Exception as e:
        if acc is not None and acc.is_oom(e):
            summary.update(status="oom", error=oom_message(e))
        else:
            summary.update(status="error", error=f"{type(e).__name__}: {e}")
            log.error("run failed:\n%s", traceback.format_exc())
    finally:
        stop.restore()
        if runner is not None:
            runner.close()
    summary["wall_time_s"] = time.perf_counter() - t_start
    if acc is not None:
        memory = memory_report(acc, runner)
        if ctx.enabled and summary["status"] == "ok":  # per-rank memory and timing, gathered on rank 0
            ranks = ctx.gather({"rank": rank, **memory, "time_breakdown_s": summary.get("time_breakdown_s")})
            memory["ranks"] = ranks
        files.write("memory.json", memory)
        summary.setdefault("device_peak_bytes", acc.meter.peak_bytes)
        summary["device_peak_bytes"] = max(summary["device_peak_bytes"], acc.meter.peak_bytes)
    dist_shutdown(ctx)
    files.write("summary.json", summary)
    if rank == 0:
        console.print(summary_table(summary))
        if summary["status"] == "interrupted":
            console.print(f"[bold yellow]l2l: {summary['error']}[/]\n  resume with: {summary['resume_with']}")
        elif summary["status"] != "ok":
            console.print(
                f"[bold red]l2l: {summary['status']}[/]: {summary.get('error')}  (see {run_dir}/train.log)"
            )
    return job_status(summary)


def job_status(summary: dict[str, Any]) -> str:
    """What a job reports to the CLI: its status, ``config`` for bad input, ``interrupted:<signal>``."""
    if summary.get("exit_code") == 2:
        return "config"
    if summary["status"] == "interrupted":
        return f"interrupted:{summary['exit_code'] - 128}"
    return summary["status"]


def exit_code(status: str) -> int:
    if status.startswith("interrupted:"):
        return 128 + int(status.split(":")[1])
    return {"ok": 0, "oom": 3, "config": 2}.get(status, 1)


class TrainingError(Exception):
    """Training cannot go on (a clear, expected failure: reported without a traceback)."""


class Interrupted(Exception):
    def __init__(self, msg: str, signum: int, resume_with: str):
        super().__init__(msg)
        self.signum, self.resume_with = signum, resume_with


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


def run_header(cfg: Any, spec: ModelSpec, acc: Accelerator, data: TaskData, world: int) -> dict[str, Any]:
    return {
        "device": acc.describe(),
        "world_size": world,
        "config": {
            "method": method_label(cfg),
            "mode": cfg.mode.name,
            "stash": cfg.mode.stash,
            "precision": effective_precision(cfg),
            "model": cfg.model.name if not cfg.model.pretrained else f"pretrained:{cfg.model.pretrained}",
            "num_layers": spec.num_layers,
            "hidden_size": spec.hidden_size,
            "ubatch_size": cfg.batch.ubatch_size,
            "num_ubatches": cfg.batch.size // cfg.batch.ubatch_size,
            "batch_size": cfg.batch.size,
            "global_batch_size": cfg.batch.size * world,
            "seq_len": cfg.task.max_seq_len,
            "task": cfg.task.name,
            "data_source": data.source,
            "train_samples": len(data.train),
            "optimizer": cfg.optim.name,
            "clip": effective_clip(cfg),
            "device": cfg.device,
            "sim_memory_gb": cfg.sim.memory_gb if cfg.device == "sim" else None,
            "sim_link_gbps": cfg.sim.link_gbps if cfg.device == "sim" else None,
        },
    }


def runner_params(spec: ModelSpec) -> int:
    """Parameter count of the whole model (embeddings, blocks, head), from the layer shapes."""
    from l2l_cli.models.bert import new_layer

    total = 0
    for kind in ("pre", "block", "post"):
        layer = new_layer(spec, kind, device="meta")
        n = sum(p.numel() for p in layer.parameters())
        total += n * (spec.num_layers if kind == "block" else 1)
    return total


def load_pretrained(runner: Runner, ref: str) -> None:
    """Stream a Hugging Face checkpoint's tensors in: safetensors, or a legacy ``pytorch_model.bin`` read
    with ``torch.load(weights_only=True)``, which refuses anything but tensors (no code runs from a file)."""
    from safetensors import safe_open

    root = resolve_pretrained(ref)
    if (root / "model.safetensors").is_file():
        with safe_open(str(root / "model.safetensors"), framework="pt") as f:
            missing = runner.load_hf(_SafeTensors(f))
    else:
        try:
            tensors = torch.load(root / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"{root}/pytorch_model.bin: refused ({str(e).splitlines()[0]})") from e
        missing = runner.load_hf(tensors)
    log.info("loaded %s; newly initialized: %s", ref, ", ".join(missing) or "none")


class _SafeTensors:
    """A safetensors handle that reads one tensor at a time (never the whole checkpoint at once)."""

    def __init__(self, handle: Any):
        self.h = handle
        self._keys = set(handle.keys())

    def keys(self) -> set[str]:
        return self._keys

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.h.get_tensor(name)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.h.get_tensor(name)


class Trainer:
    """The loop: step -> log -> eval -> checkpoint, with exact resume, real-time checkpoints (L2L), a stop
    at a step boundary on SIGINT/SIGTERM, and the non-finite-step policy."""

    def __init__(
        self, cfg: Any, runner: Runner, stream: TrainStream, data: TaskData, steps: int, files: RunFiles,
        summary: dict[str, Any], ctx: DistContext, stop: StopSignals,
    ):  # fmt: skip
        self.cfg, self.runner, self.stream, self.data, self.steps = cfg, runner, stream, data, steps
        self.files, self.summary, self.ctx, self.stop = files, summary, ctx, stop
        self.ckpt_root = files.dir / "checkpoints"
        self.config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
        self.skipped = self.bad_in_row = 0
        self.steady = {"time": 0.0, "samples": 0, "n": 0}
        self.phase_sum: dict[str, float] = {}
        self.loss = float("nan")
        self.realtime: RealtimeWriter | None = None

    # ---- checkpoint state --------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything besides the weights and moments that an exact resume needs (plain JSON)."""
        return {
            "step": self.runner.step_count,  # also the data position: the stream is a function of it
            "scaler": self.runner.precision.scaler.state_dict(),
            "rng": ckpt.rng_state(),
            "skipped": self.skipped,
            "bad_in_row": self.bad_in_row,
            "steady": self.steady,
            "phase_sum": self.phase_sum,
            "world_size": self.ctx.world,
            "global_batch_size": self.stream.global_batch,
        }

    def resume(self, run_dir: Path) -> None:
        path, manifest = ckpt.latest_valid(run_dir)
        ckpt.check_identity(path, manifest, self.runner, self.cfg)
        state = json.loads(ckpt._read_checked(path, "state.json", manifest))
        if state["global_batch_size"] != self.stream.global_batch:
            raise CheckpointError(
                f"{path} was trained with a global batch of {state['global_batch_size']}; this run has "
                f"{self.stream.global_batch} (batch.size x dist.nproc): the data position would not match"
            )
        self.runner.load_state(path, manifest)
        self.runner.step_count = state["step"]
        self.runner.precision.scaler.load_state_dict(state["scaler"])
        ckpt.set_rng_state(state["rng"])
        self.skipped, self.bad_in_row = state["skipped"], state["bad_in_row"]
        self.steady, self.phase_sum = state["steady"], state["phase_sum"]
        for name in ("metrics.jsonl", "eval.jsonl"):  # the logs continue from the checkpoint's step
            self._truncate(name, state["step"])
        log.info("resumed from %s at step %d", path, state["step"])
        self.summary["resumed_from"] = {"checkpoint": str(path), "step": state["step"]}

    def _truncate(self, name: str, step: int) -> None:
        path = self.files.dir / name
        if self.files.enabled and path.exists():
            keep = [
                ln for ln in path.read_text().splitlines() if ln and json.loads(ln).get("step", 0) <= step
            ]
            path.write_text("".join(f"{ln}\n" for ln in keep))

    def save(self) -> Path | None:
        if not self.files.enabled:  # rank 0 writes (the state is identical on every rank)
            return None
        if self.realtime is not None:
            self.realtime.wait_commit()
        return ckpt.save(
            self.ckpt_root, self.runner.step_count, self.runner, self.cfg, self.state(),
            self.cfg.trainer.keep_checkpoints, self.config_yaml,
        )  # fmt: skip

    # ---- the loop -------------------------------------------------------------------------------------

    def run(self) -> None:
        cfg, tr, runner, meter = self.cfg, self.cfg.trainer, self.runner, self.runner.acc.meter
        if tr.realtime_ckpt and self.files.enabled:
            self.realtime = RealtimeWriter(self.ckpt_root, runner, cfg, self.config_yaml)
            runner.eps.realtime = self.realtime  # type: ignore[attr-defined]
        title = f"{method_label(cfg)} {cfg.model.name} {cfg.task.name}"
        batches = self.stream.batches(start_step=runner.step_count)
        try:
            with RunProgress(tr.progress, self.steps, title, enabled=self.ctx.rank == 0) as progress:
                while runner.step_count < self.steps:
                    if self.realtime is not None:
                        self.realtime.begin(runner.step_count + 1)
                    report = runner.step(next(batches))
                    step = runner.step_count
                    report.loss, stop_now = self.ctx.mean_and_any(report.loss, self.stop.signum)
                    if self.realtime is not None:
                        self.realtime.commit(step, self.state(), self._all_layer_files)
                        report.extra["realtime_ckpt_s"] = self.realtime.pop_busy()
                    self.account(report, step)
                    progress.update(
                        step,
                        report.loss,
                        report.samples * self.ctx.world / report.step_time_s,
                        meter.peak_bytes,
                    )
                    if tr.save_every and step % tr.save_every == 0 and step < self.steps:
                        self.save()
                    if stop_now:
                        self.interrupt(step)
                    if tr.eval_every and step % tr.eval_every == 0 and step < self.steps:
                        self.files.append(
                            "eval.jsonl",
                            {"step": step, **evaluate_on_rank0(runner, self.data, cfg, self.ctx)},
                        )
        finally:
            if self.realtime is not None:
                self.realtime.wait_commit()
                self.realtime.close()
        self.finish()

    def _all_layer_files(self) -> list[tuple[str, Any]]:
        eps = self.runner.eps  # type: ignore[attr-defined]
        return [eps.layer_file(i) for i in range(len(eps.layers))]

    def account(self, report: Any, step: int) -> None:
        """Bookkeeping of one step: the bad-step policy, throughput, metrics.jsonl."""
        tr, meter, world = self.cfg.trainer, self.runner.acc.meter, self.ctx.world
        self.loss = report.loss
        self.skipped += int(report.skipped)
        scaler = self.runner.precision.scaler
        # with dynamic loss scaling a skip is routine (the scale adapts); it is a failure once the scale
        # cannot go lower, or without loss scaling
        hopeless = report.skipped and (not scaler.dynamic or scaler.scale <= 1.0)
        self.bad_in_row = self.bad_in_row + 1 if hopeless else 0
        sps = report.samples * world / report.step_time_s
        if step > 1 or self.steps == 1:
            self.steady["time"] += report.step_time_s
            self.steady["samples"] += report.samples * world
            self.steady["n"] += 1
            for k, v in report.phases.items():
                self.phase_sum[k] = self.phase_sum.get(k, 0.0) + v
        if step % tr.log_every == 0 or step == self.steps or report.skipped:
            self.files.append(
                "metrics.jsonl",
                {
                    "step": step, "loss": report.loss, "lr": report.lr, "samples_per_s": sps,
                    "step_time_s": report.step_time_s, "device_peak_bytes": meter.peak_bytes,
                    "device_bytes": meter.current_bytes, "skipped": report.skipped,
                    "grad_norm": report.grad_norm, "loss_scale": report.loss_scale,
                    "phases": report.phases, **report.extra,
                },
            )  # fmt: skip
        if self.bad_in_row >= tr.max_bad_steps:
            raise TrainingError(
                f"non-finite loss or gradients at step {step}: {self.bad_in_row} steps in a row skipped "
                f"(trainer.max_bad_steps={tr.max_bad_steps}); lower optim.lr, check the data, or use precision=fp32"
            )

    def interrupt(self, step: int) -> None:
        path = self.save()
        self.ctx.barrier()
        signum = self.stop.signum or signal.SIGTERM
        where = f"; checkpoint {path}" if path else ""
        raise Interrupted(
            f"stopped by {signal.Signals(signum).name} after step {step}{where}",
            signum,
            f"l2l train <the same overrides> trainer.resume={self.files.dir}",
        )

    def finish(self) -> None:
        cfg, runner = self.cfg, self.runner
        metrics = evaluate_on_rank0(runner, self.data, cfg, self.ctx)
        self.files.append("eval.jsonl", {"step": runner.step_count, **metrics})
        if cfg.trainer.save_every and self.files.enabled:
            self.save()  # the final state is resumable too (e.g. to train further with more steps)
        if cfg.trainer.save_final and self.files.enabled:
            save_hf(self.files.dir / "final", runner.spec, runner.hf_tensors(), self.data.spec)
        n, total = self.steady["n"], self.steady["time"]
        breakdown = {k: v / n for k, v in sorted(self.phase_sum.items())} if n else {}
        if n:
            breakdown["other"] = max(0.0, total / n - sum(breakdown.values()))
        self.summary.update(
            steps=runner.step_count,
            skipped_steps=self.skipped,
            final_loss=self.loss if math.isfinite(self.loss) else None,
            samples_per_s=self.steady["samples"] / total if total else 0.0,
            step_time_s=total / n if n else None,
            time_breakdown_s=breakdown,
            eval=metrics,
            device_peak_bytes=runner.acc.meter.peak_bytes,
        )


def memory_report(acc: Accelerator, runner: Runner | None) -> dict[str, Any]:
    host_parts = runner.host_parts() if runner is not None and hasattr(runner, "host_parts") else {}
    device = acc.meter.report()
    if acc.kind == "sim":
        device["budget_bytes"] = acc.meter.budget_bytes  # type: ignore[attr-defined]
    return {
        "device": {**device, "kind": acc.kind},
        "host": {
            "bytes": sum(host_parts.values()),
            "parts": host_parts,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        },
        "transfer": acc.memory_stats(),
    }


def oom_message(e: BaseException) -> str:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return (
        f"{first}. Knobs that lower device memory: a smaller batch.ubatch_size, mode=l2l (layers relayed "
        f"from host memory), mode.stash=cpu (activation stash in host memory), precision=cmp (half-size "
        f"device copies)"
    )


def resolved_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


__all__ = ["fmt_bytes", "run_dir_of", "run_job"]
