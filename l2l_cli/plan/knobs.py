"""The plan's view of one config: the execution knobs (``Setup``) the memory and step-time models read.

``Setup`` is a frozen copy of the config keys that change what a step holds and costs (mode, stash,
precision, micro-batching, the EPS tier, the pipeline), so a search can derive variants with ``but``
without touching a config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from l2l_cli.engine.optim import ADAM_FP32, OPTIMIZERS, state_of
from l2l_cli.engine.tiers import TIERS
from l2l_cli.modes import MODES, ModeSpec, run_clip, run_precision, run_stash
from l2l_cli.plan.shapes import ModelShape

LOW_BIT = ("int8", "nf4")
FP32_STATE = 16  # bytes per parameter: FP32 weights, gradients, and the two Adam/LAMB moments


@dataclass(frozen=True)
class Setup:
    """The config's execution knobs."""

    mode: str
    stash: str | None
    prefetch: bool
    precision: str
    seq: int
    batch: int
    ubatch: int
    nproc: int = 1
    tier: str = "host"  # eps.tier: where the EPS keeps the state (the L2L modes)
    cache_layers: int = 4  # eps.host_cache_layers (tier=disk)
    pipeline: int = 1  # dist.pipeline: ranks per pipeline (layered-GA §4); nproc / pipeline pipelines
    placement: str = "modular"
    schedule: str = "breadth_first"  # resolved (dist.schedule=auto: by placement)
    layers_per_stage: int = 1
    partition_state: bool = False
    grad_ram_gb: float = 8.0  # eps.grad_ram_gb (tier=disk): gradients waiting in RAM
    grad_ram_layers: int = 2  # eps.grad_ram_layers (tier=disk): ... for at most this many layers at a time
    clip_global: bool = True  # global clipping: the disk tier keeps each applied gradient until the verdict
    clip_redo: str = (
        "auto"  # eps.clip_redo: keep writes those beyond the RAM pool every step (auto: only near
    )
    # the limit, counted as never; a replayed step is not in the prediction)
    bf16_master_planes: bool = False  # CMP in bf16 on the disk tier: the forward reads a 2-byte hi plane
    reserved: float = 0.0  # device bytes beyond the tensors: CUDA context, workspaces, allocator reserve
    # bytes per attention score the device's kernel keeps (amp/cmp); None: HF math
    att_half: float | None = None
    optim: str = "adamw"  # optim.name: its state's bytes per parameter (8-bit moments: ~2 instead of 8)
    # the recompute the run does (mode.recompute / keep_layers as the planner resolves them, make_plan): the
    # last ``recompute_kept`` blocks keep their graph (no recompute), the others run full or selective
    recompute_kept: int = 0
    recompute_selective: bool = False

    @classmethod
    def from_cfg(cls, cfg: Any) -> Setup:
        from l2l_cli.parallel.pipeline.settings import PipelineSettings

        pipe = PipelineSettings.from_cfg(cfg)
        return cls(
            cfg.mode.name,
            run_stash(cfg),
            bool(cfg.mode.prefetch),
            run_precision(cfg),
            cfg.task.max_seq_len,
            cfg.batch.size,
            cfg.batch.ubatch_size,
            cfg.dist.nproc,
            cfg.eps.tier,
            cfg.eps.host_cache_layers,
            pipe.pipeline,
            pipe.placement,
            pipe.schedule,
            pipe.layers_per_stage if pipe.placement == "modular" else 1,
            pipe.partition_state,
            grad_ram_gb=cfg.eps.grad_ram_gb,
            grad_ram_layers=cfg.eps.grad_ram_layers,
            clip_global=run_clip(cfg) == "global",
            clip_redo=cfg.eps.clip_redo,
            # (8-bit AdamW's files keep an FP32 master: format 3, engine/tiers/disk/format.py)
            bf16_master_planes=run_precision(cfg) == "cmp"
            and cfg.precision.dtype == "bf16"
            and state_of(cfg.optim.name) == ADAM_FP32,
            **device_terms(cfg),
            optim=cfg.optim.name,
        )

    @property
    def disk(self) -> bool:
        """The EPS keeps its state on disk, a few layers cached in RAM (eps.tier=disk)."""
        kind = TIERS.get(self.tier)
        return self.l2l and kind is not None and kind.on_disk

    @property
    def state_bytes(self) -> float:
        """Training state per parameter: FP32 weights and gradient, and the optimizer's state (16 with
        AdamW or LAMB; ~10 with adamw8bit's 8-bit moments and their per-block absmax)."""
        kind = OPTIMIZERS.get(self.optim)
        return FP32_STATE if kind is None else 8.0 + kind.state_bytes_per_param

    def state_bytes_with(self, small_share: float) -> float:
        """``state_bytes`` when ``small_share`` of the trained elements sit in tensors under the 8-bit
        minimum, which keep FP32 moments (adamw8bit: a small model's LoRA adapters; the same for others)."""
        return self.state_bytes + (FP32_STATE - self.state_bytes) * small_share

    @property
    def moment_bytes(self) -> float:
        """The optimizer's state per parameter as the disk tier's files hold it (one version): 8 for FP32
        moments, ~2.03 for adamw8bit's codes and per-block absmax (its small tensors' FP32 moments are too
        few parameters to count)."""
        kind = OPTIMIZERS.get(self.optim)
        return FP32_STATE - 8.0 if kind is None else kind.state_bytes_per_param

    @property
    def disk_state_bytes(self) -> float:
        """The disk tier's files per parameter: two versions (slots) of the FP32 weights and the optimizer's
        state (24 with FP32 moments, ~12.06 with adamw8bit's)."""
        return 2 * (4.0 + self.moment_bytes)

    @property
    def data_parallel(self) -> int:
        """Ranks reading distinct samples: every rank, or one pipeline of ``pipeline`` ranks each."""
        return max(1, self.nproc // self.pipeline)

    @property
    def num_ubatches(self) -> int:
        return max(1, self.batch // self.ubatch)

    @property
    def spec(self) -> ModeSpec:
        return MODES[self.mode]

    @property
    def l2l(self) -> bool:
        """The training state lives in the EPS and layers are relayed (the L2L modes)."""
        return self.spec.host_state == "eps"

    @property
    def label(self) -> str:
        return self.spec.method(self.stash)

    def but(self, **kw: Any) -> Setup:
        return replace(self, **kw)

    def pool_layers(self, max_layer_params: int, layers: int) -> int:
        """How many layers' waiting gradients the disk tier keeps in RAM at once: ``eps.grad_ram_layers``,
        within ``eps.grad_ram_gb`` (buffers of the largest layer) and the model's layers (the tier's rule,
        :class:`~l2l_cli.engine.tiers.disk.pool.GradPool`)."""
        buf = 4.0 * max_layer_params
        return max(0, min(self.grad_ram_layers, layers, int(self.grad_ram_gb * 1e9 // buf) if buf else 0))


def device_terms(cfg: Any) -> dict[str, Any]:
    """The hardware preset's fixed device terms (``hardware.device_reserved_gb``, ``hardware.
    attention_bytes_half``) where the plan is for that GPU; none for a CPU or simulated device tier (what
    the run's own meter counts is its tensors, on a CPU's math attention) or a measured machine."""
    hw = cfg.hardware
    if cfg.device.name in ("cpu", "sim") or hw.measured:
        return {}
    return {"reserved": hw.device_reserved_gb * 2**30, "att_half": hw.attention_bytes_half}


def stage_plan(shape: ModelShape, s: Setup) -> Any:
    """The pipeline's stages for this setup (``StagePlan``: its layers per rank and placement), as the
    pipeline runner builds them."""
    from l2l_cli.parallel.pipeline.plan import StagePlan

    return StagePlan(shape.num_layers, s.pipeline, s.placement, s.layers_per_stage)
