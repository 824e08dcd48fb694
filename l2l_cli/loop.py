"""The training loop: step -> log -> eval -> checkpoint, with exact resume, real-time checkpoints (modes
with an EPS), a stop at a step boundary on SIGINT/SIGTERM, and the non-finite-step policy."""

from __future__ import annotations

import json
import logging
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

from l2l_cli import checkpoint as ckpt
from l2l_cli.checkpoint import CheckpointError, RealtimeWriter
from l2l_cli.data.batches import TrainStream
from l2l_cli.data.tasks import LM, TaskData
from l2l_cli.engine.dist import DistContext
from l2l_cli.engine.stops import write_generation_config
from l2l_cli.modes.base import Runner, StepReport
from l2l_cli.progress import RunProgress
from l2l_cli.rundir import Logger, RunFiles
from l2l_cli.runfiles import BACKGROUND_PHASES, OTHER, MetricsRow, Summary, read_jsonl

log = logging.getLogger("l2l")
# eval metrics where smaller is better (trainer.save_best)
LOWER_IS_BETTER = frozenset({"loss", "perplexity"})


class TrainingError(Exception):
    """Training cannot go on (a clear, expected failure: reported without a traceback)."""


class Interrupted(Exception):
    def __init__(self, msg: str, signum: int, resume_with: str):
        super().__init__(msg)
        self.signum, self.resume_with = signum, resume_with


class StopFlag(Protocol):
    signum: int  # nonzero once a stop was requested


class EvalStopped(Exception):
    """A stop was requested during an evaluation: it ended at the next batch (``done`` of ``total``)."""

    def __init__(self, done: int, total: int):
        super().__init__(f"evaluation stopped after {done} of {total} batches")
        self.done, self.total = done, total


Evaluate = Callable[
    [Callable[[int, int], None] | None], dict[str, float]
]  # (on_batch(done, total)) -> metrics


class NoStop:
    signum = 0


@dataclass(frozen=True)
class TrainerSettings:
    """The trainer's knobs: ``trainer.*`` and what the session derives from the config for the loop (plain
    values, built by the session; the defaults live in the config schema, and the loop never reads it)."""

    steps: int  # the optimizer step to stop at (trainer.max_steps, or epochs x steps per epoch)
    ident: dict[str, Any]  # what a checkpoint must match to load (checkpoint.identity)
    config_yaml: str  # the resolved config, recorded in every checkpoint
    save_every: int  # a checkpoint every k steps (and after the last); 0: none
    keep_checkpoints: int  # the newest k checkpoints are kept
    realtime_ckpt: bool  # each layer written right after its update (modes with an EPS)
    save_final: bool  # final/: a Hugging Face model directory
    eval_every: int  # dev metrics every k steps; 0: only at the end
    log_every: int  # a metrics row every k steps (and every skipped step)
    max_bad_steps: int  # non-finite steps in a row (no loss scale left to lower) that end the run
    progress: str  # the console's progress: auto | rich | plain | none
    title: str  # the progress header (method, model, task)
    save_best: str | None = None  # the eval metric whose best value's weights best/ holds (auto: the task's)
    patience: int = 0  # evaluations without improvement that end the run (0: never)
    allow_base_change: bool = False  # peft.allow_base_change: a LoRA run resumes on another base


class Trainer:
    """Drives ``runner`` over ``stream`` for ``settings.steps`` optimizer steps. The rest are the live
    parts it works with: the data, where the run's files and logs go, the ranks (``ctx``), the stop flag."""

    def __init__(
        self,
        settings: TrainerSettings,
        *,
        runner: Runner,
        stream: TrainStream,
        data: TaskData,
        evaluate: Evaluate,
        files: RunFiles,
        loggers: list[Logger],
        summary: Summary,
        ctx: DistContext,
        stop: StopFlag | None = None,
    ):
        self.settings = settings
        self.runner, self.stream, self.data = runner, stream, data
        self.evaluate_fn, self.files, self.loggers, self.summary = evaluate, files, loggers, summary
        self.ctx = ctx
        self.stop = stop or NoStop()
        self.ckpt_root = files.dir / "checkpoints"
        if files.enabled:  # this run holds the run dir: what a save cut short (a kill) left is stale
            for path in ckpt.remove_stale(files.dir):
                log.info("removed %s (a save cut short)", path)
        self.skipped = self.bad_in_row = 0
        self.steady = {"time": 0.0, "samples": 0, "tokens": 0, "n": 0}
        self.phase_sum: dict[str, float] = {}
        self.loss = float("nan")
        self.final_eval: dict[str, Any] | None = None  # the final evaluation a resumed run logged already
        self.resumed_step: int | None = None
        self.realtime: RealtimeWriter | None = None
        # a disk EPS (eps.tier=disk): committed after every step, it is the run's checkpoint by itself
        self.store = runner.durable_state()
        self.progress_bar: RunProgress | None = None
        self.last_saved = -1
        self.best: dict[str, Any] | None = None  # trainer.save_best: {metric, value, step} of best/
        self.watch = data.spec.main_metric if settings.save_best == "auto" else settings.save_best
        self.evals_since_best = 0
        self.early_stopped_at: int | None = None

    # ---- checkpoint state --------------------------------------------------------------------------

    def state(self, rngs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Everything besides the weights and moments that an exact resume needs (plain JSON)."""
        data = self.stream.position()  # a streamed split's position (else the step says it)
        rngs = rngs or [ckpt.rng_state(self.runner.acc.device)]  # every rank's generators, or this one's
        return {
            **({"data": data} if data is not None else {}),
            "step": self.runner.step_count,  # also the data position: the stream is a function of it
            "scaler": self.runner.precision.scaler.state_dict(),
            "rng": rngs[0],
            "rng_ranks": rngs,  # each rank resumes its own
            "skipped": self.skipped,
            "bad_in_row": self.bad_in_row,
            "steady": self.steady,
            "phase_sum": self.phase_sum,
            "world_size": self.ctx.world,
            "global_batch_size": self.stream.global_batch,
            "best": self.best,
            "evals_since_best": self.evals_since_best,
            "loss": self.loss if math.isfinite(self.loss) else None,  # a resume with no step left reports it
        }

    def resume(self, run_dir: Path) -> None:
        """Continue from the newest checkpoint of ``run_dir``; a disk EPS's last commit counts as one, and
        one the EPS adopted in place needs nothing loaded."""
        point = self.store.resume_point() if self.store is not None else None
        skipped: list[str] = []
        try:
            path, manifest = ckpt.latest_valid(run_dir, skipped)
            for why in skipped:  # a corrupt newer checkpoint: the user must know the run goes back
                self.note(f"skipped a corrupt checkpoint: {why}", logging.WARNING)
                if self.ctx.rank == 0:
                    print(f"l2l: warning: skipped a corrupt checkpoint: {why}", file=sys.stderr, flush=True)
        except CheckpointError:
            if point is None:
                raise
            path, manifest = None, {}
        if point is not None and (path is None or point["step"] >= manifest["step"]):
            path, manifest = self.store.root, point
            state = point["trainer"]
        else:
            assert path is not None
            state = json.loads(ckpt.read_checked(path, "state.json", manifest))
        ckpt.check_identity(path, manifest, self.settings.ident, self.settings.allow_base_change)
        if state["global_batch_size"] != self.stream.global_batch:
            raise CheckpointError(
                f"{path} was trained with a global batch of {state['global_batch_size']}; this run has "
                f"{self.stream.global_batch} (batch.size x dist.nproc): the data position would not match"
            )
        if state.get("data") is not None:
            self.stream.seek(state["data"])
        if manifest is not point:
            self.runner.load_state(path, manifest)
        self.runner.step_count = state["step"]
        self.runner.precision.scaler.load_state_dict(state["scaler"])
        ckpt.set_rng_state(ckpt.rank_rng(state, self.ctx.rank), self.runner.acc.device)
        self.skipped, self.bad_in_row = state["skipped"], state["bad_in_row"]
        self.steady, self.phase_sum = state["steady"], state["phase_sum"]
        self.best, self.evals_since_best = state.get("best"), state.get("evals_since_best", 0)
        self.loss = state["loss"] if isinstance(state.get("loss"), float | int) else float("nan")
        for logger in self.loggers:  # the logs continue from the checkpoint's step
            logger.resume_at(state["step"])
        # a run resumed at its end (its final evaluation was stopped, or it had finished): the final
        # evaluation already logged at this step is not run and logged twice (every rank agrees)
        logged = [r for r in read_jsonl(self.files.dir / "eval.jsonl") if r.get("step") == state["step"]]
        _, done = self.ctx.mean_and_any(0.0, int(bool(logged) and self.files.enabled))
        if done:
            self.final_eval = {k: v for k, v in logged[-1].items() if k != "step"} if logged else {}
        self.resumed_step = state["step"]
        log.info("resumed from %s at step %d", path, state["step"])
        self.summary.resumed_from = {"checkpoint": str(path), "step": state["step"]}

    def save(self) -> Path | None:
        """Every rank calls it (a pipeline's ranks first bring their stages to rank 0); rank 0 writes."""
        self.runner.collect()
        self.runner.write_shards(self.ckpt_root, self.runner.step_count)  # (L2L stages: each rank its own)
        rngs = self.ctx.gather(ckpt.rng_state(self.runner.acc.device))  # each rank's own generators
        self.last_saved = self.runner.step_count  # on every rank: a stop at this step saves on none again
        if not self.files.enabled:  # rank 0 writes (the rest of the state is identical on every rank)
            return None
        if self.realtime is not None:
            self.realtime.wait_commit()
        t0, step, knobs = time.perf_counter(), self.runner.step_count, self.settings
        state = self.state(rngs)
        path = ckpt.save(
            self.ckpt_root, step, self.runner, knobs.ident, state, knobs.keep_checkpoints, knobs.config_yaml
        )
        self.note(f"saved checkpoint step {step} to {path} in {time.perf_counter() - t0:.2f} s")
        return path

    def note(self, msg: str, level: int = logging.INFO) -> None:
        """A line for train.log and, under the progress bar (unless trainer.progress=none), the console."""
        log.log(level, msg)
        if self.progress_bar is not None:
            self.progress_bar.note(msg)

    # ---- the loop -------------------------------------------------------------------------------------

    def run(self) -> None:
        runner, meter, knobs = self.runner, self.runner.acc.meter, self.settings
        if knobs.realtime_ckpt and self.files.enabled:
            self.realtime = RealtimeWriter(self.ckpt_root, knobs.ident, knobs.config_yaml)
            runner.attach_realtime(self.realtime)
        batches = self.stream.batches(start_step=runner.step_count)
        if self.store is not None:  # the state the run starts from (initial, pretrained, resumed)
            self.store.commit(runner.step_count, self.state(), knobs.ident)
        try:
            with RunProgress(
                knobs.progress, knobs.steps, knobs.title, enabled=self.ctx.rank == 0
            ) as progress:
                self.progress_bar = progress
                while runner.step_count < knobs.steps:
                    if self.realtime is not None:
                        self.realtime.begin(runner.step_count + 1)
                    batch = next(batches)
                    tokens = int((batch.attention_mask != 0).sum())  # real tokens (packed rows number them)
                    report = runner.step(batch)
                    step = runner.step_count
                    report.loss, stop_now = self.ctx.mean_and_any(report.loss, self.stop.signum)
                    if self.realtime is not None:
                        self.realtime.commit(step, self.state(), runner.layer_files)
                        report.extra["realtime_ckpt_s"] = self.realtime.pop_busy()
                    if self.store is not None:  # after this step's writes: a restart continues here
                        self.store.commit(step, self.state(), knobs.ident)
                    self.account(report, step, tokens)
                    sps = report.samples * self.ctx.data_world / report.step_time_s
                    progress.update(step, report.loss, sps, meter.peak_bytes)
                    if knobs.save_every and step % knobs.save_every == 0 and step < knobs.steps:
                        self.save()
                    if stop_now:
                        self.interrupt(step)
                    if knobs.eval_every and step % knobs.eval_every == 0 and step < knobs.steps:
                        metrics = self.evaluate(step)
                        self._log_eval(step, metrics)
                        if self.track_best(step, metrics):
                            self.early_stopped_at = step
                            self.note(
                                f"early stopping at step {step}: {self.watch} has not improved for "
                                f"{self.evals_since_best} evaluations (best {self.best['value']:.4f} at "
                                f"step {self.best['step']}, in best/)"
                            )
                            break
                if self.realtime is not None:
                    self.realtime.wait_commit()
                self.finish()
        finally:
            self.progress_bar = None
            if self.realtime is not None:
                self.realtime.wait_commit()
                self.realtime.close()

    def evaluate(self, step: int, final: bool = False) -> dict[str, float]:
        """The dev metrics, with a progress bar; a stop requested meanwhile ends it at the next batch, and
        the run as a signal does between steps (a checkpoint, then how to resume)."""
        bar = self.progress_bar
        t0 = time.perf_counter()
        log.info("evaluating at step %d", step)
        try:
            metrics = self.evaluate_fn(bar.eval_update if bar is not None else None)
        except EvalStopped as e:
            self.interrupt(step, f"during the {'final ' if final else ''}evaluation ({e})")
        shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        self.note(f"eval at step {step}: {shown} ({time.perf_counter() - t0:.1f} s)")
        return metrics

    def _log_eval(self, step: int, metrics: dict[str, float]) -> None:
        for logger in self.loggers:
            logger.log_eval(step, metrics)

    def account(self, report: StepReport, step: int, tokens: int = 0) -> None:
        """Bookkeeping of one step: the bad-step policy, throughput (samples and, on ``tokens``, the
        step's non-padding tokens per second), the step's metrics row."""
        meter, world = self.runner.acc.meter, self.ctx.data_world  # ranks reading distinct samples
        knobs = self.settings
        self.loss = report.loss
        self.skipped += int(report.skipped)
        scaler = self.runner.precision.scaler
        # with dynamic loss scaling a skip is routine (the scale adapts); it is a failure once the scale
        # cannot go lower, or without loss scaling
        hopeless = report.skipped and (not scaler.dynamic or scaler.scale <= 1.0)
        self.bad_in_row = self.bad_in_row + 1 if hopeless else 0
        sps = report.samples * world / report.step_time_s
        tps = tokens * world / report.step_time_s
        if step > 1 or knobs.steps == 1:
            self.steady["time"] += report.step_time_s
            self.steady["samples"] += report.samples * world
            self.steady["tokens"] = self.steady.get("tokens", 0) + tokens * world  # absent in old checkpoints
            self.steady["n"] += 1
            for k, v in report.phases.items():
                self.phase_sum[k] = self.phase_sum.get(k, 0.0) + v
        if step % knobs.log_every == 0 or step == knobs.steps or report.skipped:
            row = MetricsRow(
                step=step,
                loss=report.loss,
                lr=report.lr,
                samples_per_s=sps,
                step_time_s=report.step_time_s,
                device_peak_bytes=meter.peak_bytes,
                device_bytes=meter.current_bytes,
                skipped=report.skipped,
                grad_norm=report.grad_norm,
                loss_scale=report.loss_scale,
                phases=report.phases,
                tokens_per_s=tps,
                extra={**self.data.spec.step_metrics(report.loss), **report.extra},
            )
            for logger in self.loggers:
                logger.log_step(row)
        if self.bad_in_row >= knobs.max_bad_steps:
            raise TrainingError(
                f"non-finite loss or gradients at step {step}: {self.bad_in_row} steps in a row skipped "
                f"(trainer.max_bad_steps={knobs.max_bad_steps}); lower optim.lr, check the data, or use "
                "precision=fp32"
            )

    def interrupt(self, step: int, during: str = "") -> NoReturn:
        self.summarize()  # the summary of a stopped run: its steps, last loss and throughput so far
        if self.store is not None:  # a disk EPS is committed already: it is the checkpoint
            path: Path | None = self.store.root
        else:
            path = self.save() if self.last_saved != step else self.ckpt_root / f"step_{step}"
        self.ctx.barrier()
        signum = self.stop.signum or signal.SIGTERM
        where = f"; checkpoint {path}" if path else ""
        when = f" {during}" if during else ""
        raise Interrupted(
            f"stopped by {signal.Signals(signum).name} after step {step}{when}{where}",
            signum,
            f"l2l train trainer.resume={self.files.dir}",
        )

    def finish(self) -> None:
        """The run's numbers, its last checkpoint and final/ (so a stop in the final evaluation loses no
        training), then the final evaluation."""
        runner = self.runner
        self.summarize()
        if self.settings.save_every:
            self.save()  # the final state is resumable too (e.g. to train further with more steps)
        if self.settings.save_final:
            self.export("final")
        if self.final_eval is not None and runner.step_count == self.resumed_step:
            self.summary.eval = self.final_eval  # evaluated and logged before this resume
            if self.settings.save_best:
                self.summary.sections["best"] = {
                    **(self.best or {}),
                    "early_stopped_at": self.early_stopped_at,
                }
            return
        metrics = self.evaluate(runner.step_count, final=True)
        self._log_eval(runner.step_count, metrics)
        self.track_best(runner.step_count, metrics)
        self.summary.eval = metrics
        if self.settings.save_best:
            self.summary.sections["best"] = {**(self.best or {}), "early_stopped_at": self.early_stopped_at}

    def export(self, name: str) -> None:
        """``<run dir>/<name>/``: a Hugging Face model directory of the current weights (every rank calls it:
        a pipeline first brings its stages' layers to rank 0)."""
        runner, data = self.runner, self.data
        runner.collect()
        if not self.files.enabled:
            return

        def write(out: Path) -> None:
            runner.spec.save_hf(out, runner.hf_tensors(), data.spec)
            if data.tokenizer is not None:  # the export loads with AutoTokenizer from the one directory
                from l2l_cli.data.lm import save_tokenizer

                save_tokenizer(data.tokenizer, out)
                if data.spec.objective == LM:  # where generation stops: the base's list, end of turn
                    write_generation_config(out, data.tokenizer, base_dir(data))

        ckpt.save_dir(self.files.dir / name, write)  # atomic, checksummed
        log.info("saved %s/ (a Hugging Face model directory) to %s", name, self.files.dir / name)

    def track_best(self, step: int, metrics: dict[str, float]) -> bool:
        """``trainer.save_best``: export best/ when the watched metric improves (as transformers'
        ``load_best_model_at_end`` keeps the best checkpoint); True when early stopping ends the run. The
        value is averaged over ranks first, so every rank takes the same decision."""
        name = self.watch
        if name is None or name not in metrics:
            return False
        value, _ = self.ctx.mean_and_any(float(metrics[name]), 0)
        if self.best is not None and self.best["step"] == step:
            return False  # the final evaluation of a step already evaluated
        old = None if self.best is None else self.best["value"]
        better = old is None or (value < old if name in LOWER_IS_BETTER else value > old)
        if better and math.isfinite(value):
            self.best = {"metric": name, "value": value, "step": step}
            self.evals_since_best = 0
            self.export("best")
            self.note(f"best {name} so far: {value:.4f} at step {step} (saved best/)")
            return False
        self.evals_since_best += 1
        return bool(self.settings.patience) and self.evals_since_best >= self.settings.patience

    def summarize(self) -> None:
        runner = self.runner
        n, total = self.steady["n"], self.steady["time"]
        breakdown = {k: v / n for k, v in sorted(self.phase_sum.items())} if n else {}
        if n:
            on_path = sum(v for k, v in breakdown.items() if k not in BACKGROUND_PHASES)
            breakdown[OTHER] = max(0.0, total / n - on_path)
        s = self.summary
        s.steps = runner.step_count
        s.skipped_steps = self.skipped
        s.final_loss = self.loss if math.isfinite(self.loss) else None
        s.samples_per_s = self.steady["samples"] / total if total else 0.0
        s.tokens_per_s = self.steady.get("tokens", 0) / total if total else 0.0
        s.step_time_s = total / n if n else None
        s.time_breakdown_s = breakdown
        s.device_peak_bytes = runner.acc.meter.peak_bytes
        s.sections.update(runner.sections())
        if self.store is not None:
            s.sections["eps_disk"] = self.store.summary()


def base_dir(data: TaskData) -> str | None:
    """The run's tokenizer's folder (a pretrained checkpoint's own, with its generation config)."""
    ref = getattr(data.tokenizer, "name_or_path", None)
    return ref if ref and Path(ref).expanduser().is_dir() else None
