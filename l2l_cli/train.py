"""The training loop: step -> log -> eval -> checkpoint, and the run directory's files.

Run dir contract (later issues and users rely on it):
  metrics.jsonl  one object per logged step: step, loss, lr, samples_per_s, step_time_s, device_peak_bytes, ...
  eval.jsonl     one object per evaluation: step, metrics
  memory.json    {"device": {peak_bytes, method, parts}, "host": {bytes, parts}, ...}
  summary.json   status (ok | oom | error), steps, samples_per_s, device_peak_bytes, time_breakdown_s, eval, params
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from l2l_cli.config import ConfigError, effective_clip, validate
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


def run_job(cfg: DictConfig, run_dir: Path) -> str:
    """One training run (one rank of it, under data parallel). Returns its status (ok | oom | error, or
    config for bad input); failures are written to summary.json, not raised."""
    rank = int(os.environ.get("RANK", "0"))
    files = RunFiles(run_dir, enabled=rank == 0)
    t_start = time.perf_counter()
    summary: dict[str, Any] = {"status": "error", "run_dir": str(run_dir), "steps": 0}
    acc: Accelerator | None = None
    runner: Runner | None = None
    ctx = DistContext()
    try:
        problems = validate(cfg)
        if problems:
            raise ConfigError(problems)
        ctx = dist_from_env(cfg)
        world = ctx.world
        torch.manual_seed(cfg.trainer.seed)
        data = load_task(cfg.task, cfg.model)
        spec = model_spec(cfg, data.spec.num_labels)
        stream = TrainStream(
            data.train, cfg.batch.size, seed=cfg.trainer.seed, world=world, rank=rank,
            pad_to_max=cfg.task.max_seq_len if cfg.task.pad_to_max else None,
        )  # fmt: skip
        steps = total_steps(cfg, stream)
        acc = make_accelerator(cfg, local_rank=ctx.local_rank)
        summary.update(run_header(cfg, spec, acc, data, world))
        log.info("run %s on %s: %s", run_dir, acc.describe(), json.dumps(summary["config"]))
        with acc.running():
            precision = make_precision(cfg, acc)
            runner = make_runner(cfg, acc, spec, precision, steps, dist=ctx)
            summary["params"] = runner_params(spec)
            if cfg.model.pretrained:
                load_pretrained(runner, cfg.model.pretrained)
            train_loop(cfg, runner, stream, data, steps, files, summary, ctx)
            summary["status"] = "ok"
    except ConfigError as e:
        summary.update(status="error", error=f"config: {e}", exit_code=2)
    except Exception as e:
        if acc is not None and acc.is_oom(e):
            summary.update(status="oom", error=oom_message(e))
        else:
            summary.update(status="error", error=f"{type(e).__name__}: {e}")
            log.error("run failed:\n%s", traceback.format_exc())
    finally:
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
    status = "config" if summary.get("exit_code") == 2 else summary["status"]
    if rank == 0:
        console.print(summary_table(summary))
        if summary["status"] != "ok":
            console.print(
                f"[bold red]l2l: {summary['status']}[/]: {summary.get('error')}  (see {run_dir}/train.log)"
            )
    return status


def run_header(cfg: Any, spec: ModelSpec, acc: Accelerator, data: TaskData, world: int) -> dict[str, Any]:
    return {
        "device": acc.describe(),
        "world_size": world,
        "config": {
            "method": method_label(cfg),
            "mode": cfg.mode.name,
            "stash": cfg.mode.stash,
            "precision": cfg.precision.name,
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
    from safetensors import safe_open

    path = resolve_pretrained(ref) / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        missing = runner.load_hf(_SafeTensors(f))
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


def train_loop(
    cfg: Any, runner: Runner, stream: TrainStream, data: TaskData, steps: int, files: RunFiles,
    summary: dict[str, Any], ctx: DistContext,
) -> None:  # fmt: skip
    tr = cfg.trainer
    meter = runner.acc.meter
    steady_time, steady_samples, n_steady = 0.0, 0, 0
    phase_sum: dict[str, float] = {}
    skipped = bad_in_row = 0
    loss = float("nan")
    title = f"{method_label(cfg)} {cfg.model.name} {cfg.task.name}"
    batches = stream.batches(start_step=runner.step_count)
    with RunProgress(tr.progress, steps, title, enabled=ctx.rank == 0) as progress:
        while runner.step_count < steps:
            report = runner.step(next(batches))
            step = runner.step_count
            report.loss = loss = ctx.mean(report.loss)  # the global minibatch's loss
            skipped += int(report.skipped)
            bad_in_row = bad_in_row + 1 if report.skipped else 0
            if bad_in_row >= tr.max_bad_steps:
                raise RuntimeError(
                    f"non-finite loss or gradients at step {step}: {bad_in_row} steps in a row skipped "
                    f"(trainer.max_bad_steps={tr.max_bad_steps}); lower optim.lr or check the data"
                )
            sps = report.samples * stream.world / report.step_time_s
            if step > 1 or steps == 1:
                steady_time += report.step_time_s
                steady_samples += report.samples * stream.world
                n_steady += 1
                for k, v in report.phases.items():
                    phase_sum[k] = phase_sum.get(k, 0.0) + v
            if step % tr.log_every == 0 or step == steps:
                files.append(
                    "metrics.jsonl",
                    {
                        "step": step, "loss": report.loss, "lr": report.lr, "samples_per_s": sps,
                        "step_time_s": report.step_time_s, "device_peak_bytes": meter.peak_bytes,
                        "device_bytes": meter.current_bytes, "skipped": report.skipped,
                        "grad_norm": report.grad_norm, "loss_scale": report.loss_scale,
                        "phases": report.phases, **report.extra,
                    },
                )  # fmt: skip
            progress.update(step, report.loss, sps, meter.peak_bytes)
            if tr.eval_every and step % tr.eval_every == 0 and step < steps:
                files.append("eval.jsonl", {"step": step, **evaluate_on_rank0(runner, data, cfg, ctx)})
    metrics = evaluate_on_rank0(runner, data, cfg, ctx)
    files.append("eval.jsonl", {"step": runner.step_count, **metrics})
    if tr.save_final and files.enabled:
        save_hf(files.dir / "final", runner.spec, runner.hf_tensors(), data.spec)
    breakdown = {k: v / n_steady for k, v in sorted(phase_sum.items())} if n_steady else {}
    if n_steady:
        breakdown["other"] = max(0.0, steady_time / n_steady - sum(breakdown.values()))
    summary.update(
        steps=runner.step_count,
        skipped_steps=skipped,
        final_loss=loss if math.isfinite(loss) else None,
        samples_per_s=steady_samples / steady_time if steady_time else 0.0,
        step_time_s=steady_time / n_steady if n_steady else None,
        time_breakdown_s=breakdown,
        eval=metrics,
        device_peak_bytes=meter.peak_bytes,
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
