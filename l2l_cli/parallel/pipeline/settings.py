"""The pipeline's ``dist.*`` keys: their typed settings (``auto`` resolved), the schedules they name, and
the strategy's own config rules (``validate``), checked for every config before any process starts."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from l2l_cli.engine.optim import OPTIMIZERS
from l2l_cli.models import FAMILIES, family_for_dir
from l2l_cli.modes.registry import MODES
from l2l_cli.parallel.pipeline.plan import plan_of
from l2l_cli.problems import Problem, divisors

# dist.schedule -> torch's schedule (its class in torch.distributed.pipelining, imported only by a rank that
# runs it: that package is slow to import, paid otherwise by every `l2l` command), and whether it runs
# several stages per rank
SCHEDULES: dict[str, tuple[str, bool]] = {
    "breadth_first": ("ScheduleLoopedBFS", True),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True),
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
}


def schedule_class(schedule: str) -> type:
    """torch's class for ``dist.schedule``."""
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, SCHEDULES[schedule][0])


AUTO_SCHEDULE = {"modular": "breadth_first", "contiguous": "1f1b"}
# the first torch whose schedules call the REDUCE_GRAD action after each stage's last backward, from which
# our stage starts its data-parallel reduction (TimedStage.perform_reduce_grad): older schedules never call
# it, and data-parallel pipelines would drift apart silently (docs/benchmarks.md, "The pipeline's
# constants"). Keep in step with pyproject.toml.
MIN_TORCH = (2, 10)


def torch_problem(version: str | None = None) -> str | None:
    """Why this torch cannot run the pipeline's stages on its schedules (None: it can)."""
    import torch  # here, not at the top: the strategy's rules are read without torch (l2l plan)

    version = version or torch.__version__
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None or (int(m.group(1)), int(m.group(2))) >= MIN_TORCH:
        return None
    need = ".".join(map(str, MIN_TORCH))
    return (
        f"torch {version} is older than {need}, whose pipeline schedules first call REDUCE_GRAD (the "
        f"data-parallel pipelines would drift apart); install torch>={need}"
    )


def eps_stages(mode: Any) -> bool:
    """Whether ``mode`` keeps its state in an EPS: its stages run L2L (stages.py), not torch's schedules."""
    return mode is not None and mode.host_state == "eps"


@dataclass(frozen=True)
class PipelineSettings:
    """The ``dist.*`` pipeline keys, ``auto`` resolved."""

    pipeline: int
    placement: str
    schedule: str
    layers_per_stage: int
    partition_state: bool
    # the bubble's message cost (hardware.*): a preset's latency and network, or measured between the ranks
    p2p_latency_s: float = 10e-6
    p2p_bytes_per_s: float = 12.5e9
    measure_p2p: bool = False  # hardware=measure: time an exchange and a schedule's action on the ranks
    action_s: float = 100e-6  # hardware.pipe_action_us: one schedule action beyond compute and bytes
    wake_s: float = 0.0  # hardware.pipe_wake_us: a message's wait for its computing sender's core
    link: str = "nccl"  # hardware.pipe_link: the transport the preset's action and wake describe
    preset: str = ""  # hardware.name (the summary names the preset whose figures it is unsure of)

    @classmethod
    def from_cfg(cls, cfg: Any) -> PipelineSettings:
        d, hw = cfg.dist, cfg.hardware
        schedule = AUTO_SCHEDULE[d.placement] if d.schedule == "auto" else d.schedule
        return cls(
            pipeline=d.pipeline,
            placement=d.placement,
            schedule=schedule,
            layers_per_stage=d.layers_per_stage,
            partition_state=bool(d.partition_state),
            p2p_latency_s=hw.p2p_latency_us * 1e-6,
            p2p_bytes_per_s=hw.network_gbps * 1e9,
            measure_p2p=bool(hw.measured),
            action_s=hw.pipe_action_us * 1e-6,
            wake_s=hw.pipe_wake_us * 1e-6,
            link=hw.pipe_link,
            preset=hw.name,
        )


def selected(cfg: Any) -> bool:
    """A run is a pipeline when its ranks form pipelines of more than one."""
    return int(cfg.dist.pipeline) > 1


# ---- the strategy's rules ---------------------------------------------------------------------------


def _shape(cfg: Any) -> tuple[int, bool]:
    """The model's depth as ``l2l train`` builds it (a local pretrained directory's config.json wins), and
    whether its LM head is tied to its embeddings."""
    m = cfg.model
    family = FAMILIES.get(m.family)
    tied = family is not None and family.tied_head(m)
    if m.pretrained:
        path = Path(m.pretrained).expanduser()
        if (path / "config.json").is_file():
            try:
                spec = family_for_dir(path, m.pretrained, m.family).from_hf_dir(path, m, 2)
                return int(spec.num_layers), bool(spec.tied_params())
            except Exception:  # reported by the model check
                return int(m.num_layers), tied
    return int(m.num_layers), tied


def validate(cfg: Any) -> list[Problem]:
    """The pipeline keys' rules: every problem, one line each, before any process starts."""
    d, p = cfg.dist, []

    def bad(key: str, message: str) -> None:
        p.append(Problem(key, message))

    P = d.pipeline
    if P == 1:
        defaults = {
            "placement": "modular",
            "schedule": "auto",
            "layers_per_stage": 1,
            "partition_state": False,
        }
        for key, default in defaults.items():
            if d[key] != default:
                bad(f"dist.{key}", "applies to pipeline runs; set dist.pipeline > 1 (and dist.nproc)")
        return p
    N, (L, tied), lps = d.nproc, _shape(cfg), d.layers_per_stage
    if tied:  # one tensor on the first and the last rank: its two gradients would need a sum across ranks
        bad(
            "dist.pipeline",
            "the model's LM head is tied to its token embedding, which lives on another "
            "pipeline rank; set model.tie_word_embeddings=false, or dist.pipeline=1",
        )
    if N % P:
        bad(
            "dist.pipeline",
            f"{P} does not divide dist.nproc={N} (the ranks form nproc/P pipelines); allowed: "
            f"a divisor of {N} ({divisors(N)})",
        )
    if P > L:
        bad("dist.pipeline", f"got {P}; every pipeline rank needs a layer: must be <= model.num_layers={L}")
        return p
    if L % P:
        bad(
            "dist.pipeline",
            f"torch's schedules give every rank as many stages: {P} does not divide "
            f"model.num_layers={L}; allowed: a divisor of {L} ({divisors(L)})",
        )
        return p
    if d.placement == "modular" and (L % lps or (L // lps) % P):
        ok = [k for k in range(1, L + 1) if L % k == 0 and (L // k) % P == 0]
        bad(
            "dist.layers_per_stage",
            f"{lps} layers per stage do not make a multiple of dist.pipeline={P} "
            f"stages of model.num_layers={L}; allowed: {', '.join(map(str, ok))}",
        )
        return p
    if d.placement == "contiguous" and lps not in (1, L // P):
        bad(
            "dist.layers_per_stage",
            f"applies to placement=modular; contiguous runs one stage of L/P={L // P} "
            "layers per rank (torch's multi-stage schedules place stages modularly)",
        )
    plan = plan_of(cfg, L)
    schedule = AUTO_SCHEDULE[d.placement] if d.schedule == "auto" else d.schedule
    if plan.stages_per_rank > 1 and not SCHEDULES[schedule][1]:
        multi = ", ".join(k for k, (_, many) in SCHEDULES.items() if many)
        bad(
            "dist.schedule",
            f"{schedule} runs one stage per rank, but placement={d.placement} puts "
            f"{plan.stages_per_rank} on each; allowed: {multi} (or dist.layers_per_stage={L // P})",
        )
    b = cfg.batch
    n = b.size // b.ubatch_size if b.ubatch_size >= 1 and b.size % b.ubatch_size == 0 else None
    if n is not None and n < P:
        bad(
            "batch.ubatch_size",
            f"{n} micro-batches for dist.pipeline={P}: a pipeline needs at least P in "
            f"flight; allowed: batch.size / batch.ubatch_size >= {P}",
        )
    elif n is not None and schedule == "interleaved_1f1b" and n % max(1, n // P):
        bad(
            "batch.ubatch_size",
            f"interleaved_1f1b runs rounds of P micro-batches: {n} is not a multiple of "
            f"its {max(1, n // P)} rounds; allowed: a multiple of {P}, or dist.schedule=breadth_first",
        )
    spec = MODES.get(cfg.mode.name)
    p.extend(_device_rules(cfg))
    if eps_stages(spec):
        p.extend(_l2l_stage_rules(cfg, spec, schedule))
    elif (why := torch_problem()) is not None:
        bad("dist.pipeline", why)
    if spec is not None and not spec.pipeline_stage:
        stage_modes = ", ".join(m.name for m in MODES.values() if m.pipeline_stage)
        bad(
            "mode.name",
            f"mode={spec.name} cannot run as a pipeline stage; allowed with dist.pipeline > 1: {stage_modes}",
        )
    if d.partition_state and cfg.optim.name in OPTIMIZERS and not OPTIMIZERS[cfg.optim.name].elementwise:
        bad(
            "dist.partition_state",
            f"optim={cfg.optim.name}'s trust ratio needs whole parameter tensors, which "
            "a shard of the state splits; use optim=adamw, or dist.partition_state=false",
        )
    return p


def _device_rules(cfg: Any) -> list[Problem]:
    """The backend must move the stages' hidden states: NCCL between GPUs, gloo between CPU processes."""
    # a pipeline's rules only (dist.pipeline > 1): plan and plain runs do not import torch here
    from l2l_cli.engine.device import cuda_available
    from l2l_cli.engine.dist import resolve_backend

    d, dev = cfg.dist, cfg.device.name
    cuda = dev == "cuda" or (dev == "auto" and cuda_available())
    backend = resolve_backend(d.backend, dev)
    if backend == "nccl" and not cuda:
        return [
            Problem(
                "dist.backend",
                f"nccl moves CUDA tensors, and device={dev} runs the stages on the CPU "
                "here; allowed: gloo, auto",
            )
        ]
    if backend == "gloo" and cuda:
        return [
            Problem(
                "dist.backend",
                "gloo's send/recv take CPU tensors: the stages' hidden states on "
                f"device={dev} cannot cross ranks; allowed: nccl, auto",
            )
        ]
    return []


def _l2l_stage_rules(cfg: Any, mode: Any, schedule: str) -> list[Problem]:
    (
        """L2L stages (an EPS mode with dist.pipeline > 1) run layered gradient accumulation breadth-first:
    what they cannot do yet is refused here, one line each (the disk tier refuses several ranks itself:
    each would keep the whole model's files)."""
        ""
    )
    p: list[Problem] = []
    if schedule != "breadth_first":
        p.append(
            Problem(
                "dist.schedule",
                f"mode={mode.name} stages load each layer once per batch, every "
                "micro-batch through it first: allowed: breadth_first, auto (modular)",
            )
        )
    if cfg.dist.partition_state:
        p.append(
            Problem(
                "dist.partition_state",
                f"mode={mode.name}'s state is on the host EPS, reduced there whole; allowed: false",
            )
        )
    if cfg.trainer.realtime_ckpt:
        p.append(
            Problem(
                "trainer.realtime_ckpt",
                f"mode={mode.name} pipeline stages write checkpoints every "
                "trainer.save_every steps, each rank its layers, rank 0 committing them; real-time "
                "checkpoints (one commit per layer update) are one process's: unset it",
            )
        )
    return p
