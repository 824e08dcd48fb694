"""The config schema (the single home of defaults) and its validation.

Group YAMLs under conf/ extend these dataclasses; unknown keys (also via ``+key=``) are rejected by the
structured-config merge. Cross-field rules are checked by :func:`validate`, which reports every problem
at once, each naming the key and what is allowed, before any work starts.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

MODES = ("baseline", "baseline_ag", "l2l", "l2l_p")
L2L_MODES = ("l2l", "l2l_p")
STASH = ("device", "cpu")
PRECISIONS = ("fp32", "amp", "cmp", "mixed")
HALF_DTYPES = ("auto", "bf16", "fp16")
LOSS_SCALE = ("dynamic", "none")
OPTIMIZERS = ("adamw", "lamb")
SCHEDULES = ("linear", "constant")
CLIP = ("auto", "global", "layer", "none")
DEVICES = ("auto", "cpu", "cuda", "sim")
PROGRESS = ("auto", "rich", "plain", "none")
DIST_BACKENDS = ("auto", "gloo", "nccl")
SCALES = ("cpu", "paper")


@dataclass
class ModelConfig:
    """BERT-style encoder. ``x`` selects the layered-GA paper's X[x] family (sizes derived from x)."""

    name: str = "bert-tiny"
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 2
    intermediate_size: int = 512
    dropout: float = 0.1  # hidden and attention dropout
    vocab_size: int = 30522
    seq_len: int = 512  # max positions (the papers' d_s for tnlg / X[x])
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    init_std: float = 0.02
    pretrained: str | None = None  # hub id or local HF directory
    x: int | None = None


@dataclass
class ModeConfig:
    """Execution algorithm. ``stash`` and ``prefetch`` belong to the L2L runners."""

    name: str = "l2l"
    stash: str | None = None  # device | cpu (L2L modes only)
    prefetch: bool = True  # relay: copy layer l+1 while layer l computes


@dataclass
class PrecisionConfig:
    name: str = "fp32"  # fp32 | amp (autocast, master on device) | cmp (half device copy, FP32 master in EPS)
    dtype: str = (
        "auto"  # half type for amp/cmp: auto = fp16 on CUDA, bf16 elsewhere (fp16 is unusable on CPU)
    )
    loss_scale: str = "dynamic"  # dynamic | none (for half precision)
    init_scale: float = 65536.0
    growth_interval: int = 2000


@dataclass
class TaskConfig:
    name: str = "synthetic"
    data_dir: str | None = None  # original GLUE TSV layout; unset = the hub (GLUE) or generated (synthetic)
    max_seq_len: int = 64
    tokenizer: str | None = None  # unset: model.pretrained's, else the bundled uncased WordPiece vocab
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    pad_to_max: bool = False  # pad every batch to max_seq_len (constant shapes, for memory studies)
    num_train: int = 8192  # synthetic task size
    num_eval: int = 1024


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    warmup_ratio: float = 0.1
    warmup_steps: int | None = None
    schedule: str = "linear"
    clip: str = "auto"  # auto (global; per layer for l2l_p) | global | layer | none
    max_grad_norm: float = 1.0


@dataclass
class BatchConfig:
    size: int = 32  # samples per optimizer step per device
    ubatch_size: int = 8  # micro-batch; #ubatches = size / ubatch_size
    eval_size: int | None = None  # eval batch; unset = batch.size


@dataclass
class TrainerConfig:
    max_steps: int = -1  # -1: run trainer.epochs
    epochs: int = 1
    seed: int = 0
    eval_every: int = 0  # 0: evaluate once, at the end
    log_every: int = 1
    save_final: bool = False
    save_every: int = 0
    keep_checkpoints: int = 2
    resume: str | None = None  # a run dir, or "latest"
    realtime_ckpt: bool = False
    max_bad_steps: int = 3
    progress: str = "auto"


@dataclass
class SimConfig:
    """Simulated accelerator: a device-memory budget and a host<->device link, on the CPU."""

    memory_gb: float = 16.0
    link_gbps: float = 16.0  # GB/s (bytes), per direction, like the papers' "16 GB/sec PCIe"


@dataclass
class DistConfig:
    nproc: int = 1
    backend: str = "auto"  # auto = nccl on CUDA, gloo otherwise
    timeout_s: float = 600.0  # a collective that waits longer ends the job (a dead rank ends it at once)
    eager_reduce: bool = True  # L2L: reduce each layer's gradient as it lands (false: all after backward)


@dataclass
class ProfileConfig:
    memory: bool = True  # device-tier memory meter (always on for device=sim: it enforces the budget)
    sync_timers: bool = False  # CUDA: synchronize at phase boundaries for exact phase times


@dataclass
class HardwareConfig:
    """Hardware model for ``l2l plan`` (see conf/hardware). Defaults: the L2L v1 paper's V100 (§3.1.2).

    Rates are *effective* (what a transformer layer achieves), except ``device_peak_tflops``, which the
    layered-GA analysis uses at perfect efficiency. Optimizer work is counted in the L2L v1 paper's units
    (an update of BERT-Large's ~335M parameters = 100 GFLOP, i.e. 300 FLOP per parameter).
    """

    name: str = "v100-16g"
    device_tflops: float = 30.0  # effective device throughput for layer matmuls, fp32
    device_tflops_half: float = 30.0  # the same under precision=amp|cmp
    device_peak_tflops: float = 125.0  # half-precision peak (layered-GA: compute time, intensity thresholds)
    backward_factor: float = 2.0  # backward time / forward time of a layer (the papers: 2)
    device_memory_gb: float = 16.0  # GiB
    device_optim_gflops: float = 480.0  # the baselines' on-device update (elementwise, memory-bound)
    host_gflops: float = 300.0  # EPS (host optimizer) throughput
    host_memory_gb: float = 512.0  # GiB
    h2d_gbps: float = 16.0  # host<->device link, GB/s per direction
    network_gbps: float = 12.5  # data-parallel / pipeline network per device, GB/s (input + output)
    tensor_link_gbps: float = 0.0  # tensor-parallel interconnect (NVLink), GB/s (input + output); 0: none
    offload_gbps: float = 32.0  # CPU<->GPU for offloading (layered-GA eq. 13), GB/s (input + output)
    async_copy: bool = True  # copies run beside compute (GPU copy engines, device=sim); false: inline
    measured: bool = False  # hardware=measure: time this machine and use those numbers instead


@dataclass
class PlanConfig:
    """``l2l plan``: recommendation target, 3d-parallel degrees (layered-GA §5), measurement repeats."""

    max_transfer_overhead: float = 0.10  # bound on L2L's transfer share of the step (L2L v2 eq. 4)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    train_steps: int = 100_000  # steps for the layered-GA training-time estimate (the paper's 100k)
    measure_repeats: int = 5  # hardware=measure: timed repetitions per primitive (the median is used)


@dataclass
class L2LConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    mode: ModeConfig = field(default_factory=ModeConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    device: str = "auto"
    scale: str = "cpu"  # recipes/: cpu (minutes on a small CPU) | paper (the papers' sizes); see l2l.pick


def register() -> None:
    """Put the schema in Hydra's ConfigStore; conf/config.yaml names it first in its defaults."""
    ConfigStore.instance().store(name="l2l_schema", node=L2LConfig)


# --------------------------------------------------------------------------------------------------
# Validation: every problem at once, each one line naming the key.


@dataclass
class Problem:
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


class ConfigError(Exception):
    """Bad user input: reported as one line per problem, exit code 2, no traceback."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


def _one_of(problems: list[Problem], key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        problems.append(Problem(key, f"got {value!r}; allowed: {', '.join(allowed)}"))


def _at_least(problems: list[Problem], key: str, value: Any, lo: float, what: str = "") -> None:
    if value is None or value < lo:
        problems.append(Problem(key, f"got {value!r}; must be >= {lo}{what}"))


# Sizes beyond these are typos, not models: refuse them before a run tries to allocate them.
LIMITS = {
    "model.num_layers": 100_000, "model.hidden_size": 65_536, "model.num_heads": 4_096,
    "model.intermediate_size": 1_048_576, "model.vocab_size": 10_000_000, "model.seq_len": 1_048_576,
    "model.type_vocab_size": 1_024, "task.max_seq_len": 1_048_576, "batch.size": 1_048_576,
    "batch.ubatch_size": 1_048_576, "dist.nproc": 4_096, "trainer.epochs": 1_000_000,
}  # fmt: skip


def _limits(problems: list[Problem], cfg: Any) -> None:
    for key, hi in LIMITS.items():
        value = OmegaConf.select(cfg, key) if isinstance(cfg, DictConfig) else _select(cfg, key)
        if isinstance(value, int) and value > hi:
            problems.append(Problem(key, f"got {value}; must be <= {hi}"))


def _select(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _finite(problems: list[Problem], cfg: Any, prefix: str = "") -> None:
    """Every float in the config is a real number (nan and inf pass most range checks silently)."""
    items = cfg.items() if isinstance(cfg, DictConfig) else vars(cfg).items()
    for k, v in items:
        if k == "hydra" and not prefix:  # Hydra's own node, when composed with it
            continue
        if isinstance(v, DictConfig) or hasattr(v, "__dataclass_fields__"):
            _finite(problems, v, f"{prefix}{k}.")
        elif isinstance(v, float) and not math.isfinite(v):
            problems.append(Problem(f"{prefix}{k}", f"got {v}; must be a finite number"))


def _divisors(n: int) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, ds[:12])) + (", ..." if len(ds) > 12 else "")


def effective_precision(cfg: Any) -> str:
    """precision.name with ``mixed`` resolved: the mode's own mixed precision, AMP for the baselines
    (FP32 weights on the device) and CMP for the L2L modes (FP32 master in the EPS), as in L2L v2 Table 2."""
    if cfg.precision.name != "mixed":
        return cfg.precision.name
    return "cmp" if cfg.mode.name in L2L_MODES else "amp"


def effective_clip(cfg: Any) -> str:
    """optim.clip with ``auto`` resolved: global-norm clipping, except per layer for l2l_p."""
    if cfg.optim.clip != "auto":
        return cfg.optim.clip
    return "layer" if cfg.mode.name == "l2l_p" else "global"


def validate(cfg: Any, *, check_files: bool = True) -> list[Problem]:
    """Cross-field rules of the composed config. Returns every problem found (empty when valid)."""
    p: list[Problem] = []
    _finite(p, cfg)
    _limits(p, cfg)
    m, mode, prec, task, opt, b, tr = (
        cfg.model,
        cfg.mode,
        cfg.precision,
        cfg.task,
        cfg.optim,
        cfg.batch,
        cfg.trainer,
    )

    # model
    if m.x is not None:
        _at_least(p, "model.x", m.x, 2)
        if m.x % 2:
            p.append(Problem("model.x", f"got {m.x}; X[x] needs an even x (heads = x/2)"))
    for k in ("num_layers", "hidden_size", "num_heads", "intermediate_size", "vocab_size", "seq_len"):
        _at_least(p, f"model.{k}", getattr(m, k), 1)
    _at_least(p, "model.type_vocab_size", m.type_vocab_size, 1)
    if m.hidden_size >= 1 and m.num_heads >= 1 and m.hidden_size % m.num_heads:
        p.append(
            Problem(
                "model.num_heads",
                f"{m.num_heads} heads do not divide model.hidden_size={m.hidden_size}; "
                f"allowed: a divisor of {m.hidden_size} ({_divisors(m.hidden_size)})",
            )
        )
    if not (0.0 <= m.dropout < 1.0):
        p.append(Problem("model.dropout", f"got {m.dropout}; must be in [0, 1)"))
    if m.init_std <= 0:
        p.append(Problem("model.init_std", f"got {m.init_std}; must be > 0"))
    if m.pretrained is not None and check_files:
        p.extend(_check_pretrained(m.pretrained))

    # mode
    _one_of(p, "mode.name", mode.name, MODES)
    if mode.name in L2L_MODES:
        _one_of(p, "mode.stash", mode.stash, STASH)
    elif mode.stash is not None:
        p.append(
            Problem("mode.stash", f"applies to the L2L modes ({', '.join(L2L_MODES)}), not mode={mode.name}")
        )

    # precision
    _one_of(p, "precision.name", prec.name, PRECISIONS)
    _one_of(p, "precision.dtype", prec.dtype, HALF_DTYPES)
    _one_of(p, "precision.loss_scale", prec.loss_scale, LOSS_SCALE)
    if prec.init_scale <= 0:
        p.append(Problem("precision.init_scale", f"got {prec.init_scale}; must be > 0"))
    _at_least(p, "precision.growth_interval", prec.growth_interval, 1)
    if effective_precision(cfg) == "cmp" and mode.name not in L2L_MODES:
        p.append(
            Problem(
                "precision",
                f"cmp keeps the FP32 master in the eager param-server, which only the L2L modes have "
                f"(mode={mode.name}); use precision=amp for the baselines or mode=l2l",
            )
        )

    # task
    from l2l_cli.data.tasks import TASKS  # local: data imports config types

    _one_of(p, "task.name", task.name, tuple(TASKS))
    _at_least(p, "task.max_seq_len", task.max_seq_len, 4)
    if task.max_seq_len > m.seq_len and m.pretrained is None:
        p.append(Problem("task.max_seq_len", f"got {task.max_seq_len}; must be <= model.seq_len={m.seq_len}"))
    for k in ("max_train_samples", "max_eval_samples"):
        v = getattr(task, k)
        if v is not None and v < 1:
            p.append(Problem(f"task.{k}", f"got {v}; must be >= 1 or unset"))
    _at_least(p, "task.num_train", task.num_train, 1)
    _at_least(p, "task.num_eval", task.num_eval, 1)
    if task.name == "synthetic":
        from l2l_cli.data.loading import SYNTHETIC_MIN_LEN, SYNTHETIC_MIN_VOCAB

        if task.max_seq_len < SYNTHETIC_MIN_LEN:
            p.append(
                Problem(
                    "task.max_seq_len",
                    f"got {task.max_seq_len}; the synthetic task needs >= {SYNTHETIC_MIN_LEN}",
                )
            )
        if m.vocab_size < SYNTHETIC_MIN_VOCAB:
            p.append(
                Problem(
                    "model.vocab_size",
                    f"got {m.vocab_size}; the synthetic task needs >= {SYNTHETIC_MIN_VOCAB}",
                )
            )
    if task.name in TASKS and check_files:
        p.extend(TASKS[task.name].check_source(task.data_dir))

    # optim
    _one_of(p, "optim.name", opt.name, OPTIMIZERS)
    _one_of(p, "optim.schedule", opt.schedule, SCHEDULES)
    _one_of(p, "optim.clip", opt.clip, CLIP)
    if opt.lr <= 0:
        p.append(Problem("optim.lr", f"got {opt.lr}; must be > 0"))
    if opt.weight_decay < 0:
        p.append(Problem("optim.weight_decay", f"got {opt.weight_decay}; must be >= 0"))
    for k in ("beta1", "beta2"):
        v = getattr(opt, k)
        if not (0.0 <= v < 1.0):
            p.append(Problem(f"optim.{k}", f"got {v}; must be in [0, 1)"))
    if opt.eps <= 0:
        p.append(Problem("optim.eps", f"got {opt.eps}; must be > 0"))
    if not (0.0 <= opt.warmup_ratio <= 1.0):
        p.append(Problem("optim.warmup_ratio", f"got {opt.warmup_ratio}; must be in [0, 1]"))
    if opt.warmup_steps is not None and opt.warmup_steps < 0:
        p.append(Problem("optim.warmup_steps", f"got {opt.warmup_steps}; must be >= 0 or unset"))
    if opt.max_grad_norm <= 0:
        p.append(Problem("optim.max_grad_norm", f"got {opt.max_grad_norm}; must be > 0"))
    if mode.name == "l2l_p" and opt.clip == "global":
        p.append(
            Problem(
                "optim.clip",
                "global-norm clipping needs every layer's gradient before the first update, but l2l_p "
                "updates layer l+1 while layer l runs backward; use optim.clip=layer (or none), or mode=l2l",
            )
        )

    # batch
    _at_least(p, "batch.size", b.size, 1)
    _at_least(p, "batch.ubatch_size", b.ubatch_size, 1)
    if b.size >= 1 and b.ubatch_size >= 1:
        if b.size % b.ubatch_size:
            p.append(
                Problem(
                    "batch.ubatch_size",
                    f"{b.ubatch_size} does not divide batch.size={b.size}; allowed: a divisor of "
                    f"{b.size} ({_divisors(b.size)})",
                )
            )
        elif mode.name == "baseline" and b.ubatch_size != b.size:
            p.append(
                Problem(
                    "batch.ubatch_size",
                    f"mode=baseline runs the whole minibatch at once (Alg. 1), so batch.ubatch_size must "
                    f"equal batch.size={b.size}; use mode=baseline_ag for micro-batches",
                )
            )
    if b.eval_size is not None and b.eval_size < 1:
        p.append(Problem("batch.eval_size", f"got {b.eval_size}; must be >= 1 or unset"))

    # trainer
    if tr.max_steps == 0 or tr.max_steps < -1:
        p.append(Problem("trainer.max_steps", f"got {tr.max_steps}; must be >= 1, or -1 for trainer.epochs"))
    _at_least(p, "trainer.epochs", tr.epochs, 1)
    for k in ("eval_every", "save_every", "seed"):
        _at_least(p, f"trainer.{k}", getattr(tr, k), 0)
    _at_least(p, "trainer.log_every", tr.log_every, 1)
    _at_least(p, "trainer.max_bad_steps", tr.max_bad_steps, 1)
    _at_least(p, "trainer.keep_checkpoints", tr.keep_checkpoints, 1)
    _one_of(p, "trainer.progress", tr.progress, PROGRESS)
    if tr.realtime_ckpt and mode.name not in L2L_MODES:
        p.append(
            Problem(
                "trainer.realtime_ckpt",
                f"needs an L2L mode ({', '.join(L2L_MODES)}): the EPS writes each layer as it is updated",
            )
        )
    if tr.resume is not None and check_files:
        p.extend(_check_resume(tr.resume))

    # device
    _one_of(p, "device", cfg.device, DEVICES)
    _one_of(p, "scale", cfg.scale, SCALES)
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.append(
                Problem("device", "cuda requested but no CUDA device is available; allowed: auto, cpu, sim")
            )
    if cfg.sim.memory_gb <= 0:
        p.append(Problem("sim.memory_gb", f"got {cfg.sim.memory_gb}; must be > 0"))
    if cfg.sim.link_gbps <= 0:
        p.append(Problem("sim.link_gbps", f"got {cfg.sim.link_gbps}; must be > 0"))

    # dist
    _at_least(p, "dist.nproc", cfg.dist.nproc, 1)
    _one_of(p, "dist.backend", cfg.dist.backend, DIST_BACKENDS)
    if cfg.dist.timeout_s <= 0:
        p.append(Problem("dist.timeout_s", f"got {cfg.dist.timeout_s}; must be > 0"))

    # plan
    if not (0.0 < cfg.plan.max_transfer_overhead < 1.0):
        p.append(
            Problem("plan.max_transfer_overhead", f"got {cfg.plan.max_transfer_overhead}; must be in (0, 1)")
        )
    for k in ("tensor_parallel", "pipeline_parallel", "data_parallel", "train_steps", "measure_repeats"):
        _at_least(p, f"plan.{k}", getattr(cfg.plan, k), 1)
    na, nl = cfg.plan.tensor_parallel, cfg.plan.pipeline_parallel
    if na >= 1 and m.num_heads >= 1 and m.num_heads % na:
        p.append(
            Problem(
                "plan.tensor_parallel",
                f"{na} does not divide model.num_heads={m.num_heads} (tensor parallelism splits the heads); "
                f"allowed: a divisor of {m.num_heads} ({_divisors(m.num_heads)})",
            )
        )
    if nl > m.num_layers >= 1:
        p.append(
            Problem(
                "plan.pipeline_parallel",
                f"got {nl}; a pipeline stage needs at least one layer: must be <= model.num_layers={m.num_layers}",
            )
        )
    hw = cfg.hardware
    for k in ("device_tflops", "device_tflops_half", "device_peak_tflops", "backward_factor",
              "device_memory_gb", "device_optim_gflops", "host_gflops", "host_memory_gb", "h2d_gbps",
              "network_gbps", "offload_gbps"):  # fmt: skip
        if getattr(hw, k) <= 0:
            p.append(Problem(f"hardware.{k}", f"got {getattr(hw, k)}; must be > 0"))
    if hw.tensor_link_gbps < 0:
        p.append(Problem("hardware.tensor_link_gbps", f"got {hw.tensor_link_gbps}; must be >= 0 (0: none)"))
    return p


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _check_pretrained(ref: str) -> list[Problem]:
    path = Path(ref).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            return [
                Problem("model.pretrained", f"{ref} has no config.json; expected a Hugging Face model dir")
            ]
        try:
            json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as e:
            return [Problem("model.pretrained", f"{ref}/config.json is not valid JSON ({e})")]
        if not any((path / n).is_file() for n in ("model.safetensors", "pytorch_model.bin")):
            return [Problem("model.pretrained", f"{ref} has no model.safetensors (or pytorch_model.bin)")]
        return []
    if ref.startswith((".", "/", "~")) or not _HUB_ID.match(ref):
        return [
            Problem("model.pretrained", f"{ref} is neither an existing directory nor a hub id (org/name)")
        ]
    return []


def _check_resume(ref: str) -> list[Problem]:
    if ref == "latest":
        return []
    if not Path(ref).is_dir():
        return [Problem("trainer.resume", f"{ref} is not a run directory; allowed: a run dir or 'latest'")]
    return []


def to_container(cfg: Any) -> dict[str, Any]:
    """Plain dict of a config (for JSON files)."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]
