"""The config's rules on where and how a run executes: ``device``, ``logger``, ``dist``, ``eps``,
``peft`` and ``plan``, registered after the training groups of :mod:`l2l_cli.config.checks`, and the
checks of what the config points at on this machine (the EPS tier's space, a resumed run dir)."""

from __future__ import annotations

from l2l_cli.config.checks import Config, check, mode_of
from l2l_cli.config.schema import (
    DEVICES,
    DIST_BACKENDS,
    PIPE_SCHEDULES,
    PLACEMENTS,
    SCALES,
)
from l2l_cli.data.tasks import TASKS
from l2l_cli.engine.tiers import TIERS, TierKind
from l2l_cli.models import (
    UnsupportedModel,
    lora,
    lora_init,
    lora_settings,
    make_spec,
)
from l2l_cli.modes import MODES
from l2l_cli.parallel import PARALLEL, parallel_for
from l2l_cli.plan.rules import plan_problems
from l2l_cli.problems import Problem, at_least, one_of, positive
from l2l_cli.rundir import logger_problems


@check("device")
def _device(cfg: Config, check_files: bool) -> list[Problem]:
    p: list[Problem] = []
    d = cfg.device
    one_of(p, "device.name", d.name, DEVICES)
    one_of(p, "scale", cfg.scale, SCALES)
    gpu = d.name == "cuda" or (d.name == "auto" and d.memory_gb is not None)  # (else no torch imported)
    if gpu:
        from l2l_cli.engine.device import cuda_available, cuda_total_memory

        gpu = cuda_available()
        if d.name == "cuda" and not gpu:
            p.append(
                Problem("device", "cuda requested but no CUDA device is available; allowed: auto, cpu, sim")
            )
    if d.memory_gb is not None:
        positive(p, "device.memory_gb", d.memory_gb)
        if d.name == "sim":
            p.append(Problem("device.memory_gb", "device=sim has its budget in sim.memory_gb; set that"))
        elif gpu and d.memory_gb * 2**30 > (total := cuda_total_memory(0)):
            p.append(
                Problem("device.memory_gb", f"got {d.memory_gb:g}; this GPU has {total / 2**30:.1f} GiB")
            )
    positive(p, "sim.memory_gb", cfg.sim.memory_gb)
    positive(p, "sim.link_gbps", cfg.sim.link_gbps)
    return p


@check("logger")
def _logger(cfg: Config, check_files: bool) -> list[Problem]:
    return [Problem("logger", msg) for msg in logger_problems(cfg.logger)]


@check("dist")
def _dist(cfg: Config, check_files: bool) -> list[Problem]:
    p: list[Problem] = []
    d = cfg.dist
    at_least(p, "dist.nproc", d.nproc, 1)
    one_of(p, "dist.backend", d.backend, DIST_BACKENDS)
    positive(p, "dist.timeout_s", d.timeout_s)
    at_least(p, "dist.pipeline", d.pipeline, 1)
    at_least(p, "dist.layers_per_stage", d.layers_per_stage, 1)
    one_of(p, "dist.placement", d.placement, PLACEMENTS)
    one_of(p, "dist.schedule", d.schedule, PIPE_SCHEDULES)
    p.extend(_gpus_for_ranks(cfg))
    if not p:  # the strategies' cross-field rules (pipeline: P divides nproc, #ubatches >= P, ...)
        for strategy in PARALLEL.values():
            p.extend(strategy.validate(cfg))
    spec = mode_of(cfg)
    if not cfg.dist.eager_reduce and spec is not None and spec.distribute != "eps":
        with_eps = ", ".join(m.name for m in MODES.values() if m.distribute == "eps")
        p.append(
            Problem(
                "dist.eager_reduce",
                f"applies to the modes whose EPS reduces layer by layer ({with_eps}); mode={spec.name} "
                f"reduces with DDP during backward",
            )
        )
    return p


def _gpus_for_ranks(cfg: Config) -> list[Problem]:
    """One GPU per rank: more ranks than this machine's CUDA devices would put two on one GPU (NCCL stops
    at its first collective; an EPS run would train until its stop)."""
    if cfg.dist.nproc <= 1 or cfg.device.name not in ("auto", "cuda"):
        return []
    from l2l_cli.engine.device import cuda_device_count

    gpus = cuda_device_count()
    if not gpus or cfg.dist.nproc <= gpus:
        return []
    return [
        Problem(
            "dist.nproc",
            f"{cfg.dist.nproc} ranks on {gpus} GPU{'s' if gpus > 1 else ''}: each rank needs a GPU of "
            f"its own (CUDA_VISIBLE_DEVICES counts); allowed: at most {gpus}, or device=cpu",
        )
    ]


UPDATE_KERNELS = ("auto", "native", "torch")  # eps.update_kernel (engine/host_passes.py)


@check("eps")
def _eps(cfg: Config, check_files: bool) -> list[Problem]:
    """The EPS's storage tier: every tier's keys, the selected tier's own rules (its ``TierKind``) and the
    one that needs the mode registry; with ``check_files``, whether the tier's directory can hold the
    model's state (the session checks its exact directory again once the run dir exists)."""

    p: list[Problem] = []
    e = cfg.eps
    one_of(p, "eps.tier", e.tier, tuple(TIERS))
    one_of(p, "eps.update_kernel", e.update_kernel, UPDATE_KERNELS)
    at_least(p, "eps.threads", e.threads, 0, "(0: the device's default)")
    if e.update_kernel == "native":
        from l2l_cli.engine.native import native_available

        ok, why = native_available()
        if not ok:
            p.append(
                Problem("eps.update_kernel", f"native: the kernel is unavailable here ({why}); use auto")
            )
    for kind in TIERS.values():
        p.extend(kind.check_keys(cfg))
    tier = TIERS.get(e.tier)
    if tier is None:
        return p
    spec = mode_of(cfg)
    if tier.eps_modes_only is not None and spec is not None and spec.host_state != "eps":
        with_eps = ", ".join(m.name for m in MODES.values() if m.host_state == "eps")
        p.append(
            Problem(
                "eps.tier",
                f"{tier.eps_modes_only}; mode={spec.name} keeps its state on the device (modes with an EPS: "
                f"{with_eps})",
            )
        )
    p.extend(tier.validate(cfg, check_files))
    return p


@check("peft")
def _peft(cfg: Config, check_files: bool) -> list[Problem]:
    """``peft.*``: its values (models/lora.py), then what they need of the rest: a pipeline refuses
    adapters for now; a low-bit or disk base lives beside an EPS (the relay dequantizes it); the target
    modules must be the model's."""
    p = lora_settings.key_problems(cfg.peft)
    if cfg.peft.name == "none" or p:
        return p
    if parallel_for(cfg) is not None:
        p.append(
            Problem(
                "peft.name",
                "adapters do not run in the pipeline yet (dist.pipeline > 1); use "
                "data parallel (dist.nproc) with dist.pipeline=1",
            )
        )
    spec = mode_of(cfg)
    if spec is not None and spec.host_state != "eps":
        with_eps = ", ".join(m.name for m in MODES.values() if m.host_state == "eps")
        if cfg.peft.base_dtype != "fp32":
            p.append(
                Problem(
                    "peft.base_dtype",
                    f"a low-precision base is streamed by the relay of the modes with "
                    f"an EPS ({with_eps}); mode={spec.name} keeps the base on the device in fp32",
                )
            )
        if lora_settings.on_disk(cfg.peft.base_source):
            p.append(
                Problem(
                    "peft.base_source",
                    f"disk streams the base layer by layer in the modes with an EPS "
                    f"({with_eps}), not mode={spec.name}",
                )
            )
    tier = TIERS.get(cfg.eps.tier)
    own_folder = tier is not None and not tier.on_disk  # (a disk tier checks its folder itself)
    if check_files and cfg.eps.path and lora_settings.on_disk(cfg.peft.base_source) and own_folder:
        p.extend(lora_settings.base_folder_problems(str(cfg.eps.path)))
    if cfg.task.name in TASKS and not (cfg.model.pretrained and not check_files):
        try:
            model = make_spec(cfg.model, TASKS[cfg.task.name].num_labels)
        except (UnsupportedModel, OSError, ValueError, KeyError):
            return p  # the model's own check says why
        settings = lora.LoraSettings.from_cfg(cfg.peft)
        p.extend(lora.problems(model, settings))
        if cfg.peft.init_from and check_files and not p:  # the saved adapter is this run's kind
            p.extend(lora_init.init_problems(model, lora.for_model(model, settings), str(cfg.peft.init_from)))
    return p


@check("plan")
def _plan(cfg: Config, check_files: bool) -> list[Problem]:
    return plan_problems(cfg)


# ---- files the config points at -------------------------------------------------------------------


def eps_space(cfg: Config, tier: TierKind) -> list[Problem]:
    if tier.check_space is None or cfg.task.name not in TASKS:
        return []
    try:
        spec = make_spec(cfg.model, TASKS[cfg.task.name].num_labels)
    except (UnsupportedModel, OSError, ValueError, KeyError):
        return []  # the model's own check says why
    return tier.check_space(cfg, spec)
