"""Writing a checkpoint: files into a temporary directory, every one fsynced, the manifest last, then the
directory renamed into place (a crash leaves the old set of checkpoints or the new one, never half of
one); the shards other ranks wrote, moved in; and an exported model directory (a run's ``final/``) written
and verified the same way."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from l2l_cli.checkpoint.discovery import prune
from l2l_cli.checkpoint.io import file_entry, fsync_dir, replace_dir, write_bytes
from l2l_cli.checkpoint.manifest import FORMAT, CheckpointError
from l2l_cli.problems import writing


def commit_dir(tmp: Path, final: Path, files: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write the manifest last, fsync, and put the directory in place atomically: a crash at any point
    leaves either the old ``final`` or the new one, never neither (an existing ``final/`` or ``step_N``
    is swapped, not deleted first)."""
    write_bytes(
        tmp / "manifest.json", json.dumps({"format": FORMAT, **meta, "files": files}, indent=1).encode()
    )
    fsync_dir(tmp)
    replace_dir(tmp, final)
    return final


def shard_dir(root: Path, step: int) -> Path:
    """Where the ranks of a run whose state no rank holds whole (a pipeline's L2L stages) write their files
    of step ``step``'s checkpoint for rank 0 to commit (a dot name: never taken for a checkpoint)."""
    return root / f".shards-step_{step}"


@dataclass(frozen=True)
class Written:
    """A checkpoint file another rank has written and fsynced (:func:`write_bytes`) under
    :func:`shard_dir`, with its manifest entry: :func:`save` moves it into the checkpoint it commits."""

    path: Path
    entry: dict[str, Any]


def _put(tmp: Path, name: str, data: bytes | Written) -> dict[str, Any]:
    if isinstance(data, Written):  # renamed in: its bytes are on disk, the manifest's fsync covers the name
        os.replace(data.path, tmp / name)
        return data.entry
    return write_bytes(tmp / name, data)


def save(
    root: Path,
    step: int,
    runner: Any,
    ident: dict[str, Any],
    trainer_state: dict[str, Any],
    keep: int,
    config_yaml: str,
) -> Path:
    """A full checkpoint of ``runner`` after ``step`` steps, under ``root`` (``<run dir>/checkpoints``).
    Crash-consistent whoever wrote its files: nothing is a checkpoint before the manifest is in place."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step_{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        files = {name: _put(tmp, name, data) for name, data in runner.state_files()}
        files["state.json"] = write_bytes(tmp / "state.json", json.dumps(trainer_state).encode())
        files["config.yaml"] = write_bytes(tmp / "config.yaml", config_yaml.encode())
        meta = {"step": step, "created": time.time(), **ident}
        final = commit_dir(tmp, root / f"step_{step}", files, meta)
    except BaseException:  # a full disk, say: the partial checkpoint goes, the last whole one stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(shard_dir(root, step), ignore_errors=True)
    prune(root, keep)
    return final


DIR_CHECKSUMS = "checksums.json"


def save_dir(final: Path, write: Callable[[Path], None]) -> Path:
    """Write a directory of files (a run's ``final/``) as a checkpoint is written: ``write(tmp)`` fills a
    temporary directory beside it, every file is fsynced and listed with its size and sha256 in
    ``checksums.json``, then the directory is renamed into place; a failure (a full disk: DiskFull naming
    the file) leaves the old ``final`` or none, never half of one. Files get the umask's mode (0644
    under the usual umask), as any file the user writes."""
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    mask = os.umask(0)
    os.umask(mask)
    try:
        with writing(tmp):
            tmp.mkdir(parents=True)
            write(tmp)
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            os.chmod(path, 0o666 & ~mask)
            with writing(path), open(path, "rb+") as f:
                os.fsync(f.fileno())
            files[path.relative_to(tmp).as_posix()] = file_entry(path)
        write_bytes(tmp / DIR_CHECKSUMS, json.dumps({"format": FORMAT, "files": files}, indent=1).encode())
        os.chmod(tmp / DIR_CHECKSUMS, 0o666 & ~mask)
        fsync_dir(tmp)
        with writing(final):
            replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def verify_dir(root: Path) -> None:
    """Every file ``root/checksums.json`` lists (:func:`save_dir`) is there, whole and unchanged; else a
    CheckpointError naming the file. A directory without the list (exported before it existed, or not by
    l2l) is not checked here; its safetensors are still read only through their own header checks."""
    path = root / DIR_CHECKSUMS
    if not path.is_file():
        return
    try:
        listed = json.loads(path.read_text())["files"]
        assert isinstance(listed, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from e
    for name, entry in listed.items():
        target = root / name
        if not isinstance(name, str) or name.startswith("/") or ".." in Path(name).parts:
            raise CheckpointError(f"{path}: refuses file name {name!r} (files must stay inside {root})")
        if not target.is_file():
            raise CheckpointError(f"{target}: missing (listed in {DIR_CHECKSUMS})")
        if not isinstance(entry, dict) or file_entry(target) != {
            k: entry.get(k) for k in ("bytes", "sha256")
        }:
            raise CheckpointError(
                f"{target}: size or checksum differs from {DIR_CHECKSUMS} (corrupt or truncated)"
            )
