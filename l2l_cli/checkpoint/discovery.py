"""Finding a run's checkpoints: the newest that verifies, the run a checkpoint belongs to, the run with the
newest checkpoint; pruning old ones and removing what saves cut short left behind."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

from l2l_cli.checkpoint.io import recover_dir
from l2l_cli.checkpoint.manifest import CheckpointError, verify

log = logging.getLogger("l2l")

_STEP_DIR = re.compile(r"^step_(\d+)$")


def remove_stale(run_dir: Path) -> list[Path]:
    """Remove what saves cut short left behind (``checkpoints/.tmp-step_*``, ``checkpoints/realtime/
    .tmp-step_*``, ``.tmp-final-*``): called by the run that holds ``run_dir``'s lock, so no live writer
    owns them. Returns what was removed."""
    root = run_dir / "checkpoints"
    found = [
        *root.glob(".tmp-step_*"),
        *(root / "realtime").glob(".tmp-step_*"),
        *run_dir.glob(".tmp-final-*"),
    ]
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found


def prune(root: Path, keep: int) -> None:
    steps = sorted(_steps(root))
    for _, path in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)


def _steps(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    for p in list(root.iterdir()):  # a replacement a crash cut short: the old checkpoint back in place
        if p.name.startswith(".old-step_"):
            recover_dir(p.with_name(p.name.removeprefix(".old-")))
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return out


def candidates(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete-looking checkpoints of a run (full and real-time), newest step first."""
    root = run_dir / "checkpoints"
    found = _steps(root) + _steps(root / "realtime")
    return sorted((x for x in found if (x[1] / "manifest.json").exists()), key=lambda x: -x[0])


def latest_valid(run_dir: Path, skipped: list[str] | None = None) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint of ``run_dir`` that verifies. Newer ones that do not are skipped: each is
    logged as a warning and, with ``skipped``, appended to it (``"<path>: why"``) for the caller to show."""
    errors = []
    for _, path in candidates(run_dir):
        try:
            found = path, verify(path)
        except CheckpointError as e:
            errors.append(str(e))
            continue
        for error in errors:
            log.warning("skipped a corrupt checkpoint: %s", error)
        if skipped is not None:
            skipped.extend(errors)
        return found
    detail = f" ({'; '.join(errors)})" if errors else ""
    raise CheckpointError(f"{run_dir} has no usable checkpoint{detail}")


def run_dir_of_checkpoint(ckpt: Path) -> Path:
    """``<run>/checkpoints/step_k`` or ``<run>/checkpoints/realtime/step_k`` -> ``<run>``."""
    for parent in ckpt.parents:
        if parent.name == "checkpoints":
            return parent.parent
    raise CheckpointError(f"{ckpt} is not inside a checkpoints/ folder")


def find_latest_run(outputs: Path) -> Path:
    """The run directory under ``outputs`` holding the most recently written checkpoint."""
    manifests = list(outputs.glob("**/checkpoints/step_*/manifest.json")) + list(
        outputs.glob("**/checkpoints/realtime/step_*/manifest.json")
    )
    if not manifests:
        raise CheckpointError(f"trainer.resume=latest: no checkpoint under {outputs}/")
    newest = max(manifests, key=lambda m: m.stat().st_mtime)
    return run_dir_of_checkpoint(newest.parent)
