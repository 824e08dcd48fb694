"""The disk tier's config rules: its keys, what it cannot run with, and whether its directory can hold the
model's state. ``config/validate.py`` runs them through the tier's :class:`~l2l_cli.engine.tiers.TierKind`
(with the one rule that needs the mode registry, which the engine never imports); the session checks the
directory again once the run dir exists."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from l2l_cli.engine.optim import state_of
from l2l_cli.engine.tiers.base import TierSettings
from l2l_cli.engine.tiers.disk.layout import COMMIT, disk_bytes, kept_grads_bytes
from l2l_cli.problems import Problem, at_least, fmt_bytes, one_of

if TYPE_CHECKING:
    from l2l_cli.models.base import ModelSpec

DIR = "eps"  # the run dir's folder for the layer files, unless eps.path says
CLIP_REDO = ("auto", "keep", "replay")  # eps.clip_redo
EPS_MODES_ONLY = "disk moves the eager param-server's state to disk"


def check_keys(cfg: Any) -> list[Problem]:
    """``eps.host_cache_layers``, ``eps.grad_ram_gb``, ``eps.grad_ram_layers``, ``eps.clip_redo`` and
    ``eps.path``, whichever tier is selected."""
    p: list[Problem] = []
    e = cfg.eps
    at_least(p, "eps.host_cache_layers", e.host_cache_layers, 2, " (the layer in use and the one read ahead)")
    at_least(p, "eps.grad_ram_gb", e.grad_ram_gb, 0, " (0: every waiting gradient on disk)")
    at_least(p, "eps.grad_ram_layers", e.grad_ram_layers, 0, " (0: every waiting gradient on disk)")
    one_of(p, "eps.clip_redo", e.clip_redo, CLIP_REDO)
    if e.path is not None and not str(e.path).strip():
        p.append(Problem("eps.path", "got an empty path; allowed: a directory, or unset for <run dir>/eps"))
    return p


def validate(cfg: Any, check_files: bool) -> list[Problem]:
    """What ``eps.tier=disk`` cannot run with (``check_files``: the directory's space is checked by
    :func:`check_space`, once the config knows the model)."""
    p: list[Problem] = []
    if cfg.dist.nproc > 1 and cfg.dist.pipeline > 1:  # L2L stages: each rank would hold its layers
        p.append(
            Problem(
                "eps.tier",
                "disk runs in one process (dist.nproc=1): a pipeline's ranks would each "
                "commit their layers' files after every step, and a crash between two ranks' commits "
                "leaves no step that every rank can resume from (a pipeline-wide commit record is not "
                "built); use eps.tier=host with dist.pipeline > 1",
            )
        )
    elif cfg.dist.nproc > 1:
        p.append(
            Problem("eps.tier", "disk runs in one process (dist.nproc=1): every rank would keep its own copy")
        )
    if cfg.trainer.realtime_ckpt:
        p.append(
            Problem(
                "trainer.realtime_ckpt",
                "not with eps.tier=disk: the disk EPS is committed after every step, it is a real-time "
                "checkpoint already",
            )
        )
    if not cfg.dist.eager_reduce:
        p.append(
            Problem(
                "dist.eager_reduce",
                "false is not available with eps.tier=disk (every gradient would wait in RAM for the end of "
                "the backward); use true",
            )
        )
    return p


def check_eps_path(root: Path, need: int, params: int, resume: bool = False, kept: int = 0) -> list[Problem]:
    """A disk EPS directory that cannot hold the state is refused before any work, saying what it needs
    (``need``: the layer files; ``kept``: the most ``kept_grads.eps`` takes, counted in with them)."""
    root = root.expanduser()
    total = need + kept
    what = (
        f"the disk EPS needs {fmt_bytes(total)} ({total:,} bytes: two versions of the FP32 weights and "
        f"optimizer moments, {need / max(1, params):.2f} bytes per parameter x {params:,}"
        + (
            f", and up to {fmt_bytes(kept)} of gradients kept for the global clipping verdict in "
            f"kept_grads.eps, 4 bytes per parameter beyond eps.grad_ram_layers)"
            if kept
            else ")"
        )
    )
    if (root / COMMIT).is_file():
        if resume:
            return []  # continuing in place: the files are checked when the EPS adopts them
        return [
            Problem(
                "eps.path",
                f"{root} already holds a disk EPS (commit.json); continue it with trainer.resume=<its run "
                f"dir>, or choose an empty directory",
            )
        ]
    base = root
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        return [Problem("eps.path", f"{root}: {base} is not a directory; {what}")]
    st = os.statvfs(base)
    if st.f_flag & os.ST_RDONLY or not os.access(base, os.W_OK):
        return [Problem("eps.path", f"{root} is not writable (read-only file system or permissions); {what}")]
    free = st.f_bavail * st.f_frsize
    if free < total:
        return [Problem("eps.path", f"{root} has {fmt_bytes(free)} free; {what}")]
    return []


def committed(cfg: Any) -> bool:
    """The disk EPS the config points at has a commit record: a state to resume from."""
    return (eps_dir_guess(cfg) / COMMIT).is_file()


def eps_dir_guess(cfg: Any) -> Path:
    """Where a disk EPS will live, as far as the config says before the run dir exists: eps.path, the
    resumed run's eps/, else the run dir Hydra will make (its nearest existing folder is what is checked)."""
    if cfg.eps.path:
        return Path(cfg.eps.path).expanduser()
    if cfg.trainer.resume and cfg.trainer.resume != "latest":
        return Path(cfg.trainer.resume).expanduser() / DIR
    try:
        run_dir = OmegaConf.select(cfg, "hydra.run.dir") if isinstance(cfg, DictConfig) else None
    except Exception:  # ${now:...} outside a Hydra run
        run_dir = None
    return Path(str(run_dir) if run_dir else "outputs") / DIR


def clip_may_be_global(cfg: Any) -> bool:
    """Whether the run clips by the global norm (``optim.clip=auto`` is global in every built-in mode):
    then speculative updates keep their gradients until the verdict, beyond the RAM pool in kept_grads.eps."""
    return str(cfg.optim.clip) in ("auto", "global") and bool(cfg.optim.max_grad_norm)


def check_space(cfg: Any, spec: ModelSpec) -> list[Problem]:
    """Whether the directory the config points at can hold ``spec``'s state and the gradients kept for the
    clipping verdict (before the run dir exists)."""
    e = cfg.eps
    kept = kept_grads_bytes(spec, e.grad_ram_layers, int(e.grad_ram_gb * 1e9), clip_may_be_global(cfg))
    need = disk_bytes(spec, state_of(cfg.optim.name))
    return check_eps_path(eps_dir_guess(cfg), need, spec.total_params, bool(cfg.trainer.resume), kept)


def check_start(settings: TierSettings, spec: ModelSpec, world: int) -> list[Problem]:
    """The session's check once the directory and the ranks are known."""
    root = Path(settings.path) if settings.path else Path(tempfile.gettempdir())
    s = settings
    kept = kept_grads_bytes(spec, s.grad_ram_layers, s.grad_ram_bytes, s.clip_global)
    need = disk_bytes(spec, state_of(s.optim))
    problems = check_eps_path(root, need, spec.total_params, settings.resume, kept)
    if world > 1:
        problems.append(Problem("eps.tier", "disk runs in one process; this job has more ranks"))
    return problems
