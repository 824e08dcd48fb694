"""The config's rules, one check per group, registered in the order their problems are listed: what is
trained (``model``, ``mode``, ``precision``, ``task``, ``optim``, ``batch``, ``trainer``) here, where and
how it runs (``device``, ``logger``, ``dist``, ``eps``, ``peft``, ``plan``) in
:mod:`l2l_cli.config.placement`. Mode- and family-specific rules come from the registries, never from a
list of names here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from l2l_cli.config.schema import (
    CLIP,
    HALF_DTYPES,
    LOSS_SCALE,
    PRECISIONS,
    PROGRESS,
    SCHEDULES,
    ModelConfig,
)
from l2l_cli.config.settings import Config, typed
from l2l_cli.data.loading import task_problems
from l2l_cli.data.tasks import LM, TASKS
from l2l_cli.engine.optim import OPTIMIZERS
from l2l_cli.models import (
    FAMILIES,
    check_pretrained,
    family_names,
    family_of,
)
from l2l_cli.modes import MODES, ModeSpec, run_clip
from l2l_cli.problems import Problem, at_least, divisors, one_of, positive

Check = Callable[[Config, bool], list[Problem]]
CHECKS: list[tuple[str, Check]] = []


def check(group: str) -> Callable[[Check], Check]:
    """Register ``fn(cfg, check_files) -> problems`` as the validation of ``group``."""

    def deco(fn: Check) -> Check:
        CHECKS.append((group, fn))
        return fn

    return deco


def mode_of(cfg: Config) -> ModeSpec | None:
    """The mode's view of the config (resolved through the registry); None for an unknown mode."""
    return MODES.get(cfg.mode.name)


@check("model")
def _model(cfg: Config, check_files: bool) -> list[Problem]:
    p: list[Problem] = []
    m = cfg.model
    one_of(p, "model.family", m.family, family_names())
    if m.x is not None:
        at_least(p, "model.x", m.x, 2)
        if m.x % 2:
            p.append(Problem("model.x", f"got {m.x}; X[x] needs an even x (heads = x/2)"))
    for k in ("num_layers", "hidden_size", "num_heads", "intermediate_size", "vocab_size", "seq_len"):
        at_least(p, f"model.{k}", getattr(m, k), 1)
    at_least(p, "model.type_vocab_size", m.type_vocab_size, 1)
    if m.hidden_size >= 1 and m.num_heads >= 1 and m.hidden_size % m.num_heads:
        p.append(
            Problem(
                "model.num_heads",
                f"{m.num_heads} heads do not divide model.hidden_size={m.hidden_size}; "
                f"allowed: a divisor of {m.hidden_size} ({divisors(m.hidden_size)})",
            )
        )
    if m.dropout is not None and not (0.0 <= m.dropout < 1.0):
        p.append(Problem("model.dropout", f"got {m.dropout}; must be in [0, 1)"))
    family = family_of(m)
    if m.pretrained is None:  # keys of another family: the run would ignore them
        defaults = ModelConfig()
        for f in FAMILIES.values():
            for key in f.keys:
                if f is not family and getattr(m, key) != getattr(defaults, key):
                    p.append(
                        Problem(
                            f"model.{key}",
                            f"applies to model.family={f.name}, not {m.family}; leave it unset",
                        )
                    )
    if family is not None and family.validate is not None:
        p.extend(family.validate(typed(m, ModelConfig)))
    positive(p, "model.rope_theta", m.rope_theta)
    positive(p, "model.init_std", m.init_std)
    if m.pretrained is not None and check_files:
        p.extend(check_pretrained(m.pretrained, m.family))
    return p


@check("mode")
def _mode_group(cfg: Config, check_files: bool) -> list[Problem]:
    p: list[Problem] = []
    mode = cfg.mode
    spec = MODES.get(mode.name)
    if spec is None:
        return [Problem("mode.name", f"got {mode.name!r}; allowed: {', '.join(MODES)}")]
    if spec.stash:
        if mode.stash is not None:
            one_of(p, "mode.stash", mode.stash, spec.stash)
    elif mode.stash is not None:
        with_stash = ", ".join(m.name for m in MODES.values() if m.stash)
        p.append(Problem("mode.stash", f"applies to the L2L modes ({with_stash}), not mode={mode.name}"))
    if not spec.recompute:
        with_rc = _recomputing_modes()
        for key, unset in (("recompute", "full"), ("keep_layers", None), ("activation_budget_gb", None)):
            if getattr(mode, key, unset) != unset:
                p.append(
                    Problem(f"mode.{key}", f"applies to the L2L modes ({with_rc}), not mode={mode.name}")
                )
    one_of(p, "mode.cuda_graphs", mode.cuda_graphs, ("auto", "on", "off"))
    if mode.cuda_graphs == "on":
        p.extend(_graphs_on(cfg, spec))
    if spec.validate is not None:
        p.extend(spec.validate(cfg))
    return p


def _recomputing_modes() -> str:
    """The modes that relay and recompute layers (the L2L modes), as a config line lists them."""
    return ", ".join(m.name for m in MODES.values() if m.recompute)


def _graphs_on(cfg: Config, spec: ModeSpec) -> list[Problem]:
    """``mode.cuda_graphs=on``: the blocks of one L2L runner (not a pipeline's stages) on a CUDA device."""
    key = "mode.cuda_graphs"
    if not spec.recompute:
        modes = _recomputing_modes()
        return [
            Problem(key, f"on applies to the L2L modes ({modes}), not mode={spec.name}; allowed: auto, off")
        ]
    if cfg.dist.pipeline > 1:
        return [
            Problem(key, "on: a pipeline's L2L stages run their blocks eagerly; allowed there: auto, off")
        ]
    from l2l_cli.engine import graphs
    from l2l_cli.engine.device import cuda_available

    name = cfg.device.name
    kind = "cuda" if name == "cuda" or (name == "auto" and cuda_available()) else name
    if graphs.supported(kind):
        return []
    where = "the CPU (no GPU visible)" if kind == "auto" else f"device={kind}"
    return [Problem(key, f"on needs a CUDA device; this run's is {where}; allowed here: auto, off")]


@check("precision")
def _precision(cfg: Config, check_files: bool) -> list[Problem]:
    p: list[Problem] = []
    prec = cfg.precision
    one_of(p, "precision.name", prec.name, PRECISIONS)
    one_of(p, "precision.dtype", prec.dtype, HALF_DTYPES)
    one_of(p, "precision.loss_scale", prec.loss_scale, LOSS_SCALE)
    positive(p, "precision.init_scale", prec.init_scale)
    at_least(p, "precision.growth_interval", prec.growth_interval, 1)
    spec = mode_of(cfg)
    if spec is not None and prec.name in PRECISIONS and prec.name not in spec.precisions:
        note = (
            f"{spec.precision_note} (mode={spec.name})"
            if spec.precision_note
            else f"not with mode={spec.name}"
        )
        p.append(Problem("precision", f"{note}; allowed for mode={spec.name}: {', '.join(spec.precisions)}"))
    return p


@check("task")
def _task(cfg: Config, check_files: bool) -> list[Problem]:
    """The keys every task reads, then its kind's own rules (data/: glue, synthetic, lm, files), then
    whether the model family trains this kind of task."""
    p: list[Problem] = []
    task, m = cfg.task, cfg.model
    one_of(p, "task.name", task.name, tuple(TASKS))
    at_least(p, "task.max_seq_len", task.max_seq_len, 4)
    if task.max_seq_len > m.seq_len and m.pretrained is None:
        p.append(Problem("task.max_seq_len", f"got {task.max_seq_len}; must be <= model.seq_len={m.seq_len}"))
    for k in ("max_train_samples", "max_eval_samples"):
        v = getattr(task, k)
        if v is not None and v < 1:
            p.append(Problem(f"task.{k}", f"got {v}; must be >= 1 or unset"))
    at_least(p, "task.num_train", task.num_train, 1)
    at_least(p, "task.num_eval", task.num_eval, 1)
    if task.name not in TASKS:
        return p
    p.extend(task_problems(cfg, check_files))
    family, spec = family_of(m), TASKS[task.name]
    if family is not None and spec.objective != family.objective:
        if family.objective == LM:
            why = f"model family {family.name} is a decoder language model: it trains task=lm"
        else:
            decoders = ", ".join(f.name for f in FAMILIES.values() if f.objective == LM)
            why = (
                f"task={task.name} needs a decoder (model.family={decoders}, or a decoder checkpoint); "
                f"{family.name} classifies"
            )
        p.append(Problem("task.name", f"got {task.name!r}; {why}"))
    return p


@check("optim")
def _optim(cfg: Config, check_files: bool) -> list[Problem]:
    p: list[Problem] = []
    opt = cfg.optim
    one_of(p, "optim.name", opt.name, tuple(OPTIMIZERS))
    one_of(p, "optim.schedule", opt.schedule, SCHEDULES)
    one_of(p, "optim.clip", opt.clip, CLIP)
    positive(p, "optim.lr", opt.lr)
    if opt.weight_decay < 0:
        p.append(Problem("optim.weight_decay", f"got {opt.weight_decay}; must be >= 0"))
    for k in ("beta1", "beta2"):
        v = getattr(opt, k)
        if not (0.0 <= v < 1.0):
            p.append(Problem(f"optim.{k}", f"got {v}; must be in [0, 1)"))
    positive(p, "optim.eps", opt.eps)
    if not (0.0 <= opt.warmup_ratio <= 1.0):
        p.append(Problem("optim.warmup_ratio", f"got {opt.warmup_ratio}; must be in [0, 1]"))
    if opt.warmup_steps is not None and opt.warmup_steps < 0:
        p.append(Problem("optim.warmup_steps", f"got {opt.warmup_steps}; must be >= 0 or unset"))
    positive(p, "optim.max_grad_norm", opt.max_grad_norm)
    kind = OPTIMIZERS.get(opt.name)
    if kind is not None and not kind.fp32_moments and cfg.dist.pipeline > 1:  # a stage keeps FP32 moments
        p.append(
            Problem(
                "optim.name",
                f"{opt.name} is not available with dist.pipeline > 1 yet "
                "(a stage keeps FP32 moments); use dist.pipeline=1, or optim=adamw",
            )
        )
    spec = mode_of(cfg)
    if spec is not None and opt.clip in CLIP and run_clip(cfg) not in spec.clips:
        why = spec.clip_note or f"{opt.clip} is not available with mode={spec.name}"
        p.append(Problem("optim.clip", f"{why}; allowed: {', '.join(spec.clips)}"))
    return p


@check("batch")
def _batch(cfg: Config, check_files: bool) -> list[Problem]:
    p: list[Problem] = []
    b = cfg.batch
    at_least(p, "batch.size", b.size, 1)
    at_least(p, "batch.ubatch_size", b.ubatch_size, 1)
    spec = mode_of(cfg)
    if b.size >= 1 and b.ubatch_size >= 1:
        if b.size % b.ubatch_size:
            p.append(
                Problem(
                    "batch.ubatch_size",
                    f"{b.ubatch_size} does not divide batch.size={b.size}; allowed: a divisor of "
                    f"{b.size} ({divisors(b.size)})",
                )
            )
        elif spec is not None and not spec.microbatches and b.ubatch_size != b.size:
            p.append(
                Problem(
                    "batch.ubatch_size",
                    f"mode={spec.name} runs the whole minibatch at once, so "
                    f"batch.ubatch_size must equal batch.size={b.size}; "
                    "use mode=baseline_ag for micro-batches",
                )
            )
    if b.eval_size is not None and b.eval_size < 1:
        p.append(Problem("batch.eval_size", f"got {b.eval_size}; must be >= 1 or unset"))
    return p


@check("trainer")
def _trainer(cfg: Config, check_files: bool) -> list[Problem]:
    p: list[Problem] = []
    tr = cfg.trainer
    if tr.max_steps == 0 or tr.max_steps < -1:
        p.append(Problem("trainer.max_steps", f"got {tr.max_steps}; must be >= 1, or -1 for trainer.epochs"))
    at_least(p, "trainer.epochs", tr.epochs, 1)
    for k in ("eval_every", "save_every", "seed"):
        at_least(p, f"trainer.{k}", getattr(tr, k), 0)
    at_least(p, "trainer.log_every", tr.log_every, 1)
    at_least(p, "trainer.max_bad_steps", tr.max_bad_steps, 1)
    at_least(p, "trainer.keep_checkpoints", tr.keep_checkpoints, 1)
    one_of(p, "trainer.progress", tr.progress, PROGRESS)
    spec = mode_of(cfg)
    if tr.realtime_ckpt and spec is not None and not spec.realtime_ckpt:
        with_eps = ", ".join(m.name for m in MODES.values() if m.realtime_ckpt)
        p.append(
            Problem(
                "trainer.realtime_ckpt",
                f"needs an L2L mode ({with_eps}): the EPS writes each layer as it is updated",
            )
        )
    if tr.resume is not None and check_files:
        p.extend(check_resume(tr.resume))
    p.extend(_best_rules(cfg))
    return p


def _best_rules(cfg: Config) -> list[Problem]:
    """``trainer.save_best`` names a metric the task's evaluation reports; early stopping needs it and
    evaluations during training."""
    p: list[Problem] = []
    tr = cfg.trainer
    at_least(p, "trainer.early_stopping_patience", tr.early_stopping_patience, 0)
    spec = TASKS.get(cfg.task.name)
    if tr.save_best is not None and tr.save_best != "auto" and spec is not None:
        allowed = set(spec.metrics) | (
            {"accuracy", "f1", "pearson", "spearmanr"} if spec.file_format else set()
        )
        if tr.save_best not in allowed:
            p.append(
                Problem(
                    "trainer.save_best", f"got {tr.save_best!r}; allowed: auto, {', '.join(sorted(allowed))}"
                )
            )
    if tr.early_stopping_patience:
        if tr.save_best is None:
            p.append(
                Problem("trainer.early_stopping_patience", "needs trainer.save_best (the metric to watch)")
            )
        if not tr.eval_every:
            p.append(
                Problem(
                    "trainer.early_stopping_patience",
                    "needs trainer.eval_every > 0 (evaluations during training)",
                )
            )
    return p


def check_resume(ref: str) -> list[Problem]:
    if ref == "latest":
        return []
    if not Path(ref).is_dir():
        return [Problem("trainer.resume", f"{ref} is not a run directory; allowed: a run dir or 'latest'")]
    return []
