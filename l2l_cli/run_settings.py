"""The run's settings, read once from the validated config: the step's execution keys, the trainer's,
the EPS tier's, and the summary's ``config`` block. The session builds the run's parts from these."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from l2l_cli.data.batches import TrainStream
from l2l_cli.data.tasks import LM, TaskData
from l2l_cli.engine.recompute import RecomputeSettings
from l2l_cli.engine.tiers import TIERS, TierSettings
from l2l_cli.loop import TrainerSettings
from l2l_cli.models import ModelSpec
from l2l_cli.modes import ModeSpec, StepSettings, run_clip, run_precision, run_stash
from l2l_cli.problems import ConfigError, Problem
from l2l_cli.runfiles import RunConfig


def total_steps(cfg: Any, stream: TrainStream) -> int:
    return cfg.trainer.max_steps if cfg.trainer.max_steps > 0 else cfg.trainer.epochs * stream.steps_per_epoch


def step_settings(cfg: Any, steps: int) -> StepSettings:
    """The config's execution keys as the mode runs them (auto clipping and the default stash resolved)."""
    return StepSettings(
        num_ubatches=cfg.batch.size // cfg.batch.ubatch_size,
        ubatch_size=cfg.batch.ubatch_size,
        seed=cfg.trainer.seed,
        total_steps=steps,
        clip=run_clip(cfg),
        max_grad_norm=cfg.optim.max_grad_norm,
        stash=run_stash(cfg),
        prefetch=bool(cfg.mode.prefetch),
        eager_reduce=bool(cfg.dist.eager_reduce),
        sync_timers=bool(cfg.profile.sync_timers),
        recompute=recompute_settings(cfg),
        cuda_graphs=cfg.mode.cuda_graphs,
    )


def recompute_settings(cfg: Any) -> RecomputeSettings:
    """``mode.recompute`` / ``keep_layers`` / ``activation_budget_gb`` for the L2L runners."""
    m, budget = cfg.mode, cfg.mode.activation_budget_gb
    keep = m.keep_layers if m.keep_layers in (None, "auto") else int(m.keep_layers)
    return RecomputeSettings(
        policy=m.recompute,
        keep_layers=keep,
        budget_bytes=None if budget is None else budget * 2**30,
        seq_len=cfg.task.max_seq_len,
    )


def trainer_settings(cfg: Any, steps: int, ident: dict[str, Any], title: str) -> TrainerSettings:
    """``trainer.*`` as the loop runs it, with the run's length, the identity its checkpoints carry, the
    resolved config they record, and the progress header."""
    tr = cfg.trainer
    return TrainerSettings(
        steps=steps,
        ident=ident,
        config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
        save_every=tr.save_every,
        keep_checkpoints=tr.keep_checkpoints,
        realtime_ckpt=tr.realtime_ckpt,
        save_final=tr.save_final,
        eval_every=tr.eval_every,
        log_every=tr.log_every,
        max_bad_steps=tr.max_bad_steps,
        progress=tr.progress,
        title=title,
        save_best=tr.save_best,
        patience=tr.early_stopping_patience,
        allow_base_change=bool(cfg.peft.allow_base_change),
    )


def eps_tier(cfg: Any, run_dir: Path | None) -> TierSettings:
    """``eps.*`` resolved: a disk EPS lives in ``eps.path`` (``~`` expanded, as validation reads it), else
    in the run's ``eps/`` folder (a resumed run's own: the disk state is that run's checkpoint), else in a
    temporary folder (no run dir)."""
    e = cfg.eps
    path = str(Path(e.path).expanduser()) if e.path else None
    resume = cfg.trainer.resume
    folder = TIERS[e.tier].dir_name
    if folder is not None and path is None:
        if resume and resume != "latest":
            path = str(Path(resume).expanduser() / folder)
        elif run_dir is not None:
            path = str(run_dir / folder)
    if path is None and run_dir is not None and cfg.peft.name != "none":
        from l2l_cli.models.lora_settings import on_disk

        if on_disk(cfg.peft.base_source):  # a frozen base on disk keeps its layer files in the run's eps/
            path = str(run_dir / "eps")
    grad_ram = int(e.grad_ram_gb * 1e9)
    return TierSettings(
        e.tier,
        path,
        e.host_cache_layers,
        resume=bool(resume),
        grad_ram_bytes=grad_ram,
        grad_ram_layers=e.grad_ram_layers,
        clip_global=run_clip(cfg) == "global" and bool(cfg.optim.max_grad_norm),
        clip_redo=e.clip_redo,
        optim=cfg.optim.name,
    )


def check_vocab(data: TaskData, spec: ModelSpec, cfg: Any) -> None:
    """A language model's tokenizer ids must index its embedding (a bundled 2048-id BPE fits any decoder)."""
    if data.tokenizer is None or data.spec.objective != LM or len(data.tokenizer) <= spec.vocab_size:
        return
    key = "model.pretrained" if cfg.model.pretrained else "model.vocab_size"
    raise ConfigError(
        [
            Problem(
                key,
                f"the model has {spec.vocab_size} token ids, the tokenizer ({data.source}) "
                f"{len(data.tokenizer)}; use a model.vocab_size >= {len(data.tokenizer)} "
                "or set task.tokenizer",
            )
        ]
    )


def run_config(cfg: Any, mode: ModeSpec, spec: ModelSpec, data: TaskData, world: int) -> RunConfig:
    """The summary's ``config`` block: what the run was, in the papers' terms (``world``: the data-parallel
    degree, how many minibatches of ``batch.size`` make a global one)."""
    stash = run_stash(cfg)
    return RunConfig(
        method=mode.method(stash),
        mode=mode.name,
        stash=stash,
        precision=run_precision(cfg),
        model=cfg.model.name if not cfg.model.pretrained else f"pretrained:{cfg.model.pretrained}",
        family=spec.family,
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ubatch_size=cfg.batch.ubatch_size,
        num_ubatches=cfg.batch.size // cfg.batch.ubatch_size,
        batch_size=cfg.batch.size,
        global_batch_size=cfg.batch.size * world,
        seq_len=cfg.task.max_seq_len,
        task=cfg.task.name,
        data_source=data.source,
        train_samples=len(data.train),
        optimizer=cfg.optim.name,
        clip=run_clip(cfg),
        device=cfg.device.name,
        sim_memory_gb=cfg.sim.memory_gb if cfg.device.name == "sim" else None,
        sim_link_gbps=cfg.sim.link_gbps if cfg.device.name == "sim" else None,
        eps_tier=cfg.eps.tier if mode.host_state == "eps" else None,
    )
