"""``build(cfg) -> Session``: the one place that wires a run's parts together (data, model, accelerator,
precision, runner, trainer, checkpoints, loggers), for ``l2l train``, the tests and the benchmarks alike.

A session opens in order and keeps what it has built, so a start that fails half-way (out of device memory
while the runner allocates, say) still reports the run's header and memory; ``close`` releases it all.
"""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from l2l_cli.checkpoint import BaseChanged, CheckpointError, identity
from l2l_cli.config.schema import L2LConfig
from l2l_cli.config.settings import Config, settings
from l2l_cli.config.validate import require_valid
from l2l_cli.data.batches import TrainStream
from l2l_cli.data.loading import load_task
from l2l_cli.data.tasks import TaskData
from l2l_cli.dev_eval import DevEvaluator
from l2l_cli.engine.accelerators import make_accelerator
from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.dist import DistContext
from l2l_cli.engine.dist import from_env as dist_from_env
from l2l_cli.engine.optim import OptimSettings
from l2l_cli.engine.precision import Precision, make_precision
from l2l_cli.engine.tiers import TIERS, TierSettings
from l2l_cli.inherit import record_config_sum
from l2l_cli.locks import DirLock, LockError, held
from l2l_cli.loop import StopFlag, Trainer
from l2l_cli.models import ModelSpec, PretrainedUnavailable, UnsupportedModel, make_spec
from l2l_cli.models.hf import base_fingerprint, load_adapter, load_exported, load_pretrained
from l2l_cli.models.lora import refresh_dora
from l2l_cli.modes import (
    MODES,
    ModeSpec,
    Runner,
    RunnerArgs,
    run_precision,
)
from l2l_cli.parallel import ParallelSpec, parallel_for
from l2l_cli.problems import ConfigError, Problem
from l2l_cli.run_header import run_header, run_title
from l2l_cli.run_settings import (
    check_vocab,
    eps_tier,
    run_config,
    step_settings,
    total_steps,
    trainer_settings,
)
from l2l_cli.rundir import JsonlLogger, Logger, RunFiles, make_loggers
from l2l_cli.runfiles import Summary

log = logging.getLogger("l2l")


class Session:
    """One run's parts. ``open()`` builds them (``build(cfg)`` does it for you); ``close()`` releases them.

    A session builds from a validated config and does not validate it again: the command that runs it
    validates at its entry (``l2l train``'s preflight and :func:`~l2l_cli.train.run_job`, ``l2l
    eval|predict|generate``'s ``run_config``, :func:`build` for tests and benchmarks). Its parts read the
    config as typed settings (:attr:`cfg`); :attr:`node` is the config as given, which the run records."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path | None = None,
        *,
        data: TaskData | None = None,
        stop: StopFlag | None = None,
        write_files: bool | None = None,
        train: bool = True,
        weights: Path | None = None,
    ):
        self.node, self.stop = cfg, stop
        self._settings: L2LConfig | None = None
        self.train, self.weights = train, weights  # train False: evaluation only (no stream, no trainer)
        self.dist = DistContext()
        self.run_dir = run_dir
        rank0 = int(os.environ.get("RANK", "0")) == 0
        enabled = rank0 if write_files is None else write_files and rank0
        self.files = RunFiles(run_dir or Path("."), enabled=enabled and run_dir is not None)
        self.summary = Summary(run_dir=str(run_dir or ""))
        self.data = data
        self.mode: ModeSpec | None = MODES.get(cfg.mode.name)
        self.parallel: ParallelSpec | None = None  # a strategy beyond plain data parallel (pipeline)
        self.parallel_settings: Any = None  # its typed settings (pipeline: PipelineSettings)
        self.model: ModelSpec | None = None
        self.acc: Accelerator | None = None
        self.precision: Precision | None = None
        self.tier = TierSettings()  # where an EPS keeps the state (eps.*, resolved)
        self.runner: Runner | None = None
        self.evaluator: DevEvaluator | None = None  # the task's metrics on the dev split
        self.stream: TrainStream | None = None
        self.trainer: Trainer | None = None
        self.loggers: list[Logger] = []
        self.steps = 0
        self.resuming = bool(cfg.trainer.resume)
        self.resumed = False  # a resume got as far as loading its checkpoint (from then on it may write)
        self.problems: list[str] = []  # bad input that stopped the start, one line each
        self.crashed = False  # an unexpected exception ended the run (its traceback is in train.log)
        self.locked_out = False  # another live run holds the run dir or the EPS folder: write nothing there
        self._stack = ExitStack()

    @property
    def cfg(self) -> L2LConfig:
        """The config as typed settings (resolved, each field of its schema type), read on first use."""
        if self._settings is None:
            self._settings = settings(self.node)
        return self._settings

    # ---- building: one step per part, in the order each needs the last ----------------------------------

    def open(self) -> Session:
        """Build the run's parts in order: the typed settings, ranks, data and model, the EPS's storage, the
        training stream, accelerator, precision, runner; then either the weights to evaluate, or the
        loggers, the trainer and the state it starts from (a resumed checkpoint, pretrained weights)."""
        try:
            self._read_settings()
            self._lay_out_ranks()
            self._load_data_and_model()
            self._place_eps()
            check_vocab(self.data, self.model, self.cfg)
            self._make_stream()
            self._make_accelerator()
            self._make_precision()
            self._make_runner()
            self._make_evaluator()
            if not self.train:
                self._load_eval_weights()
                return self
            if not self.resuming and self.files.enabled:  # the config as Hydra wrote it: edits are seen
                record_config_sum(self.files.dir)
            self._make_loggers()
            self._make_trainer()
            self._load_start_state()
            dev = len(self.data.dev) if self.data else 0
            log.info("%s", run_header(self.summary, self.cfg, self.run_dir, self.dist.world, dev, self.steps))
        except BaseException:
            self.close()
            raise
        return self

    def _read_settings(self) -> None:
        """The validated config as typed settings, before any work (the entry validated it)."""
        self._settings = settings(self.node)

    def _lay_out_ranks(self) -> None:
        """The mode, the parallel strategy beyond plain data parallel (a pipeline) and the ranks: which
        share a data shard (a pipeline's do) and which evaluate together."""
        cfg = self.cfg
        self.mode = MODES[cfg.mode.name]
        self.parallel = parallel_for(cfg)
        self.parallel_settings = self.parallel.settings(cfg) if self.parallel else None
        self.dist = dist_from_env(cfg)
        if self.parallel:
            self.dist = self.parallel.layout(self.dist, self.parallel_settings)

    def _load_data_and_model(self) -> None:
        """The task's data (unless given) and the model's spec, after seeding torch: a pretrained
        checkpoint that cannot be had, or a model no family builds, is bad input (``model.pretrained``)."""
        cfg = self.cfg
        torch.manual_seed(cfg.trainer.seed)
        try:
            data = self.data = self.data or load_task(cfg.task, cfg.model, train_split=self.train)
            self.model = make_spec(cfg.model, data.spec.num_labels)
            if cfg.peft.name != "none":  # LoRA adapters on a frozen base (models/lora.py)
                from l2l_cli.models.lora import LoraSettings, with_lora

                ref = cfg.model.pretrained  # the base the adapter is trained on, by its files' hashes
                lora = LoraSettings.from_cfg(cfg.peft, bool(ref), base_fingerprint(ref) if ref else None)
                self.model = with_lora(self.model, lora)
        except (UnsupportedModel, PretrainedUnavailable) as e:
            raise ConfigError([Problem("model.pretrained", str(e))]) from e

    def _place_eps(self) -> None:
        """Where an EPS keeps the state (``eps.*``), its folder and the run dir locked (:meth:`_lock_dirs`);
        a disk EPS must fit its folder and run in one process, which only the model's size and the ranks
        tell, so it is checked here rather than with the config."""
        assert self.model is not None
        tier = self.tier = eps_tier(self.cfg, self.run_dir)
        self._lock_dirs()  # first: a live run's folder is named by its holder, not by what it holds
        problems = TIERS[tier.tier].check_start(tier, self.model, self.dist.world)
        if problems:
            raise ConfigError(problems)

    def _lock_dirs(self) -> None:
        """One writer per directory: the run dir (rank 0 writes it) and a disk EPS's folder stay locked for
        as long as this run lasts (released at exit, however it exits). Another live run holding either is
        refused before anything is written, so its files stay as they were."""
        wanted: list[tuple[str, Path]] = []
        if self.train and self.run_dir is not None and self.dist.rank == 0:
            wanted.append(("trainer.resume" if self.resuming else "hydra.run.dir", Path(self.run_dir)))
        if TIERS[self.tier.tier].on_disk and self.tier.path:
            eps = Path(self.tier.path)
            if self.run_dir is not None and eps.resolve() == Path(self.run_dir).resolve():
                self.locked_out = True
                raise ConfigError(
                    [
                        Problem(
                            "eps.path",
                            f"{eps} is this run's own directory; leave eps.path "
                            "unset (the run's eps/ folder) or name a folder of its own",
                        )
                    ]
                )
            wanted.append(("eps.path", eps))
        for key, path in wanted:
            if held(path) is not None:  # l2l train took it before Hydra wrote there: this run's already
                continue
            try:
                lock = DirLock(path, key).acquire()
            except LockError as e:
                self.locked_out = True
                raise ConfigError([Problem(e.key, e.detail)]) from None
            self._stack.callback(lock.release)

    def _make_stream(self) -> None:
        """The training examples in this rank's order (none when only evaluating), and the run's length."""
        cfg = self.cfg
        assert self.data is not None
        pad_to_max = cfg.task.max_seq_len if cfg.task.pad_to_max else None
        if self.train and self.data.stream is not None:  # a streamed split makes its own (task.streaming)
            self.stream = self.data.stream(
                cfg.batch.size, self.dist.data_world, self.dist.data_rank, pad_to_max
            )
        elif self.train:
            self.stream = TrainStream(
                self.data.train,
                cfg.batch.size,
                seed=cfg.trainer.seed,
                world=self.dist.data_world,
                rank=self.dist.data_rank,
                pad_to_max=pad_to_max,
            )
        if self.data.stats:
            self.summary.sections["data"] = dict(self.data.stats)
        self.steps = total_steps(cfg, self.stream) if self.stream is not None else 1

    def _make_accelerator(self) -> None:
        """The device (cpu, cuda, or the simulated one) and its memory meter, entered for the session's
        life; the summary learns the run's shape now, so a start that runs out of memory still reports it."""
        cfg = self.cfg
        assert self.mode is not None and self.model is not None and self.data is not None
        self.acc = make_accelerator(
            cfg.device.name,
            local_rank=self.dist.local_rank,
            memory_gb=cfg.device.memory_gb,
            sim_memory_gb=cfg.sim.memory_gb,
            sim_link_gbps=cfg.sim.link_gbps,
            measure_memory=cfg.profile.memory,
            sample_memory=cfg.profile.memory_sample,
            eps_threads=cfg.eps.threads,
            update_kernel=cfg.eps.update_kernel,
        )
        self.summary.device = self.acc.describe()
        self.summary.world_size = self.dist.world
        self.summary.config = run_config(cfg, self.mode, self.model, self.data, self.dist.data_world)
        self.summary.params = self.model.total_params  # known even when the runner runs out of memory
        self._stack.enter_context(self.acc.running())

    def _make_precision(self) -> None:
        """The mode's precision as an object (FP32, AMP, CMP), so the runner never branches on dtype."""
        p = self.cfg.precision
        assert self.acc is not None
        self.precision = make_precision(
            run_precision(self.cfg),
            self.acc,
            dtype=p.dtype,
            loss_scale=p.loss_scale,
            init_scale=p.init_scale,
            growth_interval=p.growth_interval,
        )

    def _make_runner(self) -> None:
        """The mode's runner (wrapped in the parallel strategy's, if any), from typed arguments only; what
        it allocates on the device as it is built counts in the memory report."""
        assert self.model is not None and self.acc is not None and self.precision is not None
        assert self.mode is not None
        args = RunnerArgs(
            self.model,
            self.acc,
            self.precision,
            step_settings(self.cfg, self.steps),
            OptimSettings.from_cfg(self.cfg.optim),
            self.dist,
            self.tier,
            self.parallel_settings,
        )
        with self.acc.meter.window():
            self.runner = self.parallel.runner(args, self.mode) if self.parallel else self.mode.runner(args)

    def _make_evaluator(self) -> None:
        """The dev split's evaluation (``batch.eval_size``, else ``batch.size``): the trainer's and
        ``l2l eval``'s."""
        cfg = self.cfg
        assert self.runner is not None and self.model is not None and self.data is not None
        pad_to = cfg.task.max_seq_len if cfg.task.pad_to_max else None
        size = cfg.batch.eval_size or cfg.batch.size
        self.evaluator = DevEvaluator(self.runner, self.model, self.data, self.dist, size, pad_to, self.stop)

    def _load_eval_weights(self) -> None:
        """Evaluation only: the weights asked for, if any (else the runner's initialization)."""
        assert self.acc is not None
        if self.weights is not None:
            with self.acc.meter.window():
                self._load_weights(self.weights)

    def _load_weights(self, path: Path) -> None:
        """A checkpoint (``checkpoints/step_<k>``: verified, of this model and state layout) or a Hugging
        Face model directory (``final/``, ``best/``: every file against its checksums.json); a LoRA run's
        base first, once it is known to be the one its adapter was trained on."""
        from l2l_cli import checkpoint as ckpt
        from l2l_cli.models import lora_init
        from l2l_cli.models.lora import lora_of

        assert self.runner is not None and self.model is not None and self.mode is not None
        lora, manifest = lora_of(self.model), None
        allow = lora is not None and lora.allow_base_change
        try:
            if (path / "manifest.json").is_file():
                manifest = ckpt.verify(path)
                ident = identity(self.model, self.mode, self.cfg.optim.name)
                ckpt.check_identity(path, manifest, ident, allow)
            else:
                ckpt.verify_dir(path)
                if lora is not None:  # an adapter of this run's rank, alpha, rsLoRA, targets; on its base
                    lora_init.check(self.model, lora, path)
                if lora is not None and not allow:
                    ckpt.check_base(ckpt.recorded(path), lora.base_fingerprint, path)
        except ckpt.BaseChanged as e:  # the adapter's base, checked before it is loaded
            raise ConfigError([Problem("model.pretrained", str(e))]) from e
        if lora is not None and self.cfg.model.pretrained:  # the frozen base first: the adapter's only
            load_pretrained(self.runner, self.cfg.model.pretrained)
        if manifest is not None:
            self.runner.load_state(path, manifest)
        elif lora is not None:
            load_adapter(self.runner, self.model, path)
        else:
            load_exported(self.runner, path)

    def _make_loggers(self) -> None:
        """metrics.jsonl always (rank 0, with a run dir), then the configured ``logger`` backends."""
        self.loggers = [JsonlLogger(self.files), *make_loggers(self.cfg.logger, self.files, self.node)]

    def _make_trainer(self) -> None:
        """The loop, from its settings (the config's ``trainer.*`` resolved) and the live parts it drives."""
        assert self.runner is not None and self.stream is not None and self.data is not None
        title = run_title(self.summary, self.cfg, getattr(self.runner, "recompute_info", None))
        ident = identity(self.model, self.mode, self.cfg.optim.name)
        self.trainer = Trainer(
            trainer_settings(self.cfg, self.steps, ident, title),
            runner=self.runner,
            stream=self.stream,
            data=self.data,
            evaluate=self.evaluator,
            files=self.files,
            loggers=self.loggers,
            summary=self.summary,
            ctx=self.dist,
            stop=self.stop,
        )

    def _load_start_state(self) -> None:
        """Where training starts: a resumed run's checkpoint (its trainer state too), or pretrained
        weights, or the runner's initialization. A checkpoint or weights that cannot be used is bad input."""
        cfg = self.cfg
        assert self.acc is not None and self.trainer is not None and self.runner is not None
        with self.acc.meter.window():
            if cfg.trainer.resume:
                if (
                    cfg.model.pretrained and cfg.peft.name != "none"
                ):  # the frozen base is not in the checkpoint
                    load_pretrained(self.runner, cfg.model.pretrained)
                try:
                    self.trainer.resume(Path(cfg.trainer.resume))
                except BaseChanged as e:  # the adapter's base is not under model.pretrained any more
                    raise ConfigError([Problem("model.pretrained", str(e))]) from e
                except CheckpointError as e:
                    raise ConfigError([Problem("trainer.resume", str(e))]) from e
                self.resumed = True
                self._record_config()
            elif (
                cfg.peft.init_from
            ):  # the base, then a saved adapter as the run's start (models/lora_init.py)
                try:
                    self._load_weights(Path(cfg.peft.init_from).expanduser())
                except CheckpointError as e:
                    raise ConfigError([Problem("peft.init_from", str(e))]) from e
            elif cfg.model.pretrained:
                try:
                    load_pretrained(self.runner, cfg.model.pretrained)
                except (CheckpointError, PretrainedUnavailable) as e:
                    raise ConfigError([Problem("model.pretrained", str(e))]) from e
            if not (cfg.trainer.resume or cfg.peft.init_from):  # DoRA's magnitudes: the base it starts on
                refresh_dora(self.runner, self.model)

    def _record_config(self) -> None:
        """A resumed run's config (its own, with this command's overrides) becomes the run's config, so a
        later resume or ``l2l eval`` inherits it (Hydra does not write .hydra/ for a resume)."""
        hydra_dir = self.files.dir / ".hydra"
        if hydra_dir.is_dir() and self.files.enabled:
            self.files.write_text(".hydra/config.yaml", OmegaConf.to_yaml(self.node))
            record_config_sum(self.files.dir)

    # ---- releasing it ------------------------------------------------------------------------------------

    def close(self) -> None:
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as e:  # a logger that cannot flush must not hide how the run ended
                log.warning("closing logger %s: %s", type(logger).__name__, e)
        self.loggers = []
        try:
            if self.runner is not None:
                self.runner.close()  # (may raise: a disk EPS's last write can find the disk full)
        finally:  # the locks and the accelerator's copy threads are released however the runner closed
            self._stack.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build(cfg: Config, run_dir: Path | None = None, **kw: Any) -> Session:
    """The opened session for ``cfg``, validated first (use it as ``with build(cfg) as s:``): the entry
    of tests and benchmarks. ``run_dir`` None: nothing is written; ``data``: a task's data already loaded."""
    require_valid(cfg)
    return Session(cfg, run_dir, **kw).open()
