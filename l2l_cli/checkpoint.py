"""Checkpoints: written atomically, verified before use, never unpickled.

A checkpoint is a directory ``checkpoints/step_<k>/`` holding
  manifest.json   format, step, mode, state layout, model shape, and every file's size and sha256
                  (crc32 for real-time files, whose checksum is on the per-step CPU budget)
  state.json      the trainer: step, data position, loss scaler, RNG states, counters (plain JSON)
  config.yaml     the resolved config it was written with (for the record)
  *.safetensors   the training state: weights and optimizer moments (the runner's own layout)
It is written into a temporary directory, every file fsynced, then renamed into place, so a crash
leaves either the old set of checkpoints or the new one, never half of one. Loading checks the
manifest (sizes, checksums, file names), the model shape and the state layout before anything is read.

Real-time checkpoints (L2L modes, layered-GA paper §8.2): the EPS already holds the master weights on
the host, so a background writer saves each layer right after its update; a step's files become a
checkpoint (``checkpoints/realtime/step_<k>/``) once all its layers are written, so a SIGKILL loses at
most the step in flight.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import mmap
import os
import random
import re
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from l2l_cli.engine.device import cuda_rng_states, set_cuda_rng_states
from l2l_cli.problems import writing

log = logging.getLogger("l2l")

FORMAT = 1
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(Exception):
    """A checkpoint that cannot be used (corrupt, truncated, tampered with, or for another model/mode)."""


# ---- files ----------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> dict[str, Any]:
    """Write and fsync one file; returns its manifest entry (size, sha256)."""
    with writing(path), open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


_ALIGN = 4096  # O_DIRECT wants block-aligned buffers, offsets and lengths
_CHUNK = 32 << 20
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}  # fmt: skip
_staging = threading.local()


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """:func:`_write_tensors`, a full disk reported with the file's path."""
    with writing(path):
        return _write_tensors(path, tensors)


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Stream tensors into a safetensors file without building it in memory; returns its manifest
    entry (size, crc32).

    Why not ``write_bytes(st_save(...))``: on this class of machine a buffered write costs ~3 ms of
    kernel CPU per MB (page-cache copies), which a background writer steals from training. Here each
    32 MiB chunk is copied into a page-aligned staging buffer and written with O_DIRECT (DMA, almost
    no CPU); the header is padded with spaces (allowed by the format) so the data starts block-aligned.
    Where O_DIRECT is refused (tmpfs, some network filesystems) the same loop uses ordinary writes."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    header: dict[str, Any] = {}
    offset = 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        header[key] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    hlen = -(-(8 + len(text)) // _ALIGN) * _ALIGN - 8
    head = struct.pack("<Q", hlen) + text + b" " * (hlen - len(text))
    total = len(head) + offset
    stage = getattr(_staging, "buf", None)
    if stage is None:
        stage = _staging.buf = mmap.mmap(-1, _CHUNK)  # anonymous mmap: page-aligned
    view = torch.frombuffer(stage, dtype=torch.uint8)
    pieces = [torch.frombuffer(bytearray(head), dtype=torch.uint8)]
    pieces += [t.reshape(-1).view(torch.uint8) for t in tensors.values() if t.numel()]
    direct = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
    except OSError:
        fd, direct = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 0
    crc, pos, fill = 0, 0, 0
    try:

        def flush(n: int) -> None:
            nonlocal direct, pos
            padded = -(-n // _ALIGN) * _ALIGN if direct else n  # the tail is padded, then truncated
            data = memoryview(stage)[:padded]
            try:
                written = os.pwrite(fd, data, pos)
            except OSError:
                if not direct:
                    raise
                direct = 0  # the filesystem accepted the flag but not the write: fall back
                _set_direct(fd, False)
                written = os.pwrite(fd, data[:n], pos)
            if written < n:
                raise OSError(f"{path}: short write")
            pos += n

        for piece in pieces:
            done = 0
            while done < piece.numel():
                k = min(_CHUNK - fill, piece.numel() - done)
                view[fill : fill + k].copy_(piece[done : done + k])
                crc = zlib.crc32(memoryview(stage)[fill : fill + k], crc)
                fill, done = fill + k, done + k
                if fill == _CHUNK:
                    flush(fill)
                    fill = 0
        if fill:
            flush(fill)
        os.ftruncate(fd, total)
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"bytes": total, "crc32": f"{crc:08x}"}


def _set_direct(fd: int, on: bool) -> None:
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)


def tensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    return st_save({k: v.detach().contiguous() for k, v in tensors.items()}, metadata=metadata)


def read_tensors(ckpt: Path, name: str, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Load one safetensors file of a verified checkpoint, checking it against the manifest again."""
    data = read_checked(ckpt, name, manifest)
    try:
        return st_load(data)
    except Exception as e:
        raise CheckpointError(f"{ckpt / name}: not a valid safetensors file ({e})") from e


def read_checked(ckpt: Path, name: str, manifest: dict[str, Any]) -> bytes:
    """The bytes of file ``name`` of checkpoint ``ckpt``, checked against its ``manifest`` entry (listed,
    same size, same sha256, or crc32 for real-time files); a file that differs is a CheckpointError, so
    a corrupt, truncated or swapped file is never used."""
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{ckpt}: {name} is not in the manifest")
    if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int):
        raise CheckpointError(f"{ckpt}/manifest.json: malformed entry for {name}")
    data = (ckpt / name).read_bytes()
    if "crc32" in entry:  # real-time files (write_tensors)
        intact = f"{zlib.crc32(data):08x}" == entry["crc32"]
    else:
        intact = hashlib.sha256(data).hexdigest() == entry.get("sha256")
    if len(data) != entry["bytes"] or not intact:
        raise CheckpointError(
            f"{ckpt / name}: size or checksum differs from the manifest (corrupt or truncated)"
        )
    return data


# ---- an exported model directory (a run's final/) ----------------------------------------------------

DIR_CHECKSUMS = "checksums.json"


def _file_entry(path: Path) -> dict[str, Any]:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return {"bytes": n, "sha256": h.hexdigest()}


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
            files[path.relative_to(tmp).as_posix()] = _file_entry(path)
        write_bytes(tmp / DIR_CHECKSUMS, json.dumps({"format": FORMAT, "files": files}, indent=1).encode())
        os.chmod(tmp / DIR_CHECKSUMS, 0o666 & ~mask)
        _fsync_dir(tmp)
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
        if not isinstance(entry, dict) or _file_entry(target) != {
            k: entry.get(k) for k in ("bytes", "sha256")
        }:
            raise CheckpointError(
                f"{target}: size or checksum differs from {DIR_CHECKSUMS} (corrupt or truncated)"
            )


# ---- the module layout: weights and optimizer moments by Hugging Face name ----------------------------

WEIGHTS_FILE, MOMENTS_FILE = "model.safetensors", "optimizer.safetensors"


def module_state_files(
    weights: Mapping[str, torch.Tensor], moments: Mapping[str, Mapping[str, Any]]
) -> Iterator[tuple[str, bytes]]:
    """The module layout (``ModeSpec.state_layout`` ``module-v1``), every runner's that is not the EPS's:
    ``model.safetensors`` holds the weights by Hugging Face name; ``optimizer.safetensors``, for each
    parameter the optimizer has stepped, ``<name>.exp_avg``, ``<name>.exp_avg_sq`` and ``<name>.step``,
    and any other tensor of its state as ``<name>.<key>`` (8-bit AdamW: uint8 codes in the moments and
    ``exp_avg_absmax``, ``exp_avg_sq_absmax``). ``moments``: {name: its optimizer state (``step``: a
    tensor or a number)}. Written by name, not by rank or stage, so any runner resumes from any other's (a
    pipeline resharded)."""
    yield WEIGHTS_FILE, tensors_bytes(dict(weights))
    flat: dict[str, torch.Tensor] = {}
    for name, st in moments.items():
        flat |= {f"{name}.{k}": t for k, t in st.items() if k != "step"}
        flat[f"{name}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(())
    yield MOMENTS_FILE, tensors_bytes(flat)


class ModuleState:
    """A verified checkpoint's module layout, read once; ``load`` copies it into a runner's tensors."""

    def __init__(self, ckpt: Path, manifest: dict[str, Any]):
        self.ckpt = ckpt
        self.weights = read_tensors(ckpt, WEIGHTS_FILE, manifest)
        self.moments = read_tensors(ckpt, MOMENTS_FILE, manifest)

    @torch.no_grad()
    def load(
        self, params: Iterable[tuple[str, torch.Tensor]], *, whole: bool = False
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Copy each (HF name, tensor)'s weights in place; returns the optimizer state of those the
        checkpoint has moments for, {name: {exp_avg, exp_avg_sq, step, and any other key}} (on the CPU,
        not copied).
        ``whole``: the checkpoint must hold exactly these names (a runner with the whole model); otherwise
        any superset (a pipeline rank's layers)."""
        params = list(params)
        if whole and set(self.weights) != {name for name, _ in params}:
            raise CheckpointError(f"{self.ckpt}: {WEIGHTS_FILE} does not hold this model's parameters")
        out = {}
        keys: dict[str, list[str]] = {}  # parameter name -> its state's keys
        for full in self.moments:
            name, _, key = full.rpartition(".")
            keys.setdefault(name, []).append(key)
        for name, t in params:
            if name not in self.weights:
                raise CheckpointError(f"{self.ckpt}: {WEIGHTS_FILE} has no {name}")
            w = self.weights[name]
            if w.shape != t.shape:
                raise CheckpointError(
                    f"{self.ckpt}: {name} has shape {tuple(w.shape)}, expected {tuple(t.shape)}"
                )
            t.copy_(w)
            if f"{name}.exp_avg" in self.moments:
                out[name] = {k: self.moments[f"{name}.{k}"] for k in keys[name]}
        return out


# ---- trainer state --------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Every RNG state in plain JSON (torch's are byte lists; no pickle anywhere)."""
    state: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state().tolist(),
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": _numpy_state(),
    }
    if (cuda := cuda_rng_states()) is not None:
        state["torch_cuda"] = [s.tolist() for s in cuda]
    return state


def _numpy_state() -> list[Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch_cpu"], dtype=torch.uint8))
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    kind, keys, pos, has_gauss, g = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, g))
    if "torch_cuda" in state:
        set_cuda_rng_states([torch.tensor(s, dtype=torch.uint8) for s in state["torch_cuda"]])


# ---- what identifies a checkpoint's kind --------------------------------------------------------


def identity(model: Any, mode: Any, optimizer: str) -> dict[str, Any]:
    """What must match for a checkpoint to load: the model's family and shape (``ModelSpec.identity``), the
    mode's state layout (``ModeSpec.state_layout``: modes sharing one resume each other's) and optimizer."""
    return {
        "model": model.identity(),
        "family": model.family,
        "state_layout": mode.state_layout,
        "optimizer": optimizer,
        "mode": mode.name,
    }


def check_identity(ckpt: Path, manifest: dict[str, Any], want: dict[str, Any]) -> None:
    if manifest.get("family", want["family"]) != want["family"]:  # written before families: BERT
        raise CheckpointError(f"{ckpt} holds a {manifest.get('family')} model; this run is {want['family']}")
    have_model, want_model = manifest.get("model", {}), want["model"]
    diff = [
        f"{k} {have_model.get(k)} (checkpoint) vs {v} (this run)"
        for k, v in want_model.items()
        if have_model.get(k) != v
    ]
    if diff:
        raise CheckpointError(f"{ckpt} is for another model shape: {'; '.join(diff)}")
    if manifest.get("state_layout") != want["state_layout"]:
        raise CheckpointError(
            f"{ckpt} holds mode={manifest.get('mode')}'s state layout ({manifest.get('state_layout')}); this run is "
            f"mode={want['mode']} ({want['state_layout']}): resume with a mode of the same family"
        )
    if manifest.get("optimizer") != want["optimizer"]:
        raise CheckpointError(
            f"{ckpt} holds {manifest.get('optimizer')} state; this run uses optim={want['optimizer']}"
        )


def verify(ckpt: Path) -> dict[str, Any]:
    """The manifest of a complete, intact checkpoint (sizes and checksums of every file), or an error."""
    manifest = verify_manifest(ckpt)
    for name in manifest["files"]:
        read_checked(ckpt, name, manifest)
    return manifest


def verify_manifest(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's manifest, well formed (its files are checked as they are read: :func:`read_checked`)."""
    path = ckpt / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{ckpt}: no manifest.json (an incomplete checkpoint)") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({e})") from e
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise CheckpointError(f"{path}: not an l2l checkpoint manifest (format {FORMAT})")
    for name in manifest["files"]:
        if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
            raise CheckpointError(
                f"{path}: refuses file name {name!r} (files must stay inside the checkpoint)"
            )
    return manifest


# ---- writing ----------------------------------------------------------------------------------------


def _commit(tmp: Path, final: Path, files: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write the manifest last, fsync, and put the directory in place atomically: a crash at any point
    leaves either the old ``final`` or the new one, never neither (an existing ``final/`` or ``step_N``
    is swapped, not deleted first)."""
    write_bytes(
        tmp / "manifest.json", json.dumps({"format": FORMAT, **meta, "files": files}, indent=1).encode()
    )
    _fsync_dir(tmp)
    replace_dir(tmp, final)
    return final


def _exchange(a: Path, b: Path) -> None:
    """Swap two paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); OSError where the
    system or the file system cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))


def _aside(final: Path) -> Path:
    return final.with_name(f".old-{final.name}")


def replace_dir(new: Path, final: Path) -> None:
    """Move directory ``new`` to ``final``, replacing one that exists, crash-consistently. Where the
    atomic exchange is not available the old one is renamed aside first; :func:`recover_dir` puts it back
    if a crash came between the two renames."""
    if not final.exists():
        os.replace(new, final)
    else:
        try:
            _exchange(new, final)  # final is the new directory, new holds the old one
            old = new
        except OSError:
            old = _aside(final)
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            _fsync_dir(final.parent)
            os.replace(new, final)
        _fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(final.parent)


def recover_dir(final: Path) -> None:
    """Undo a replacement cut short between its two renames (``final`` missing, the old one aside)."""
    old = _aside(final)
    if not final.exists() and (old / "manifest.json").is_file():
        os.replace(old, final)
        _fsync_dir(final.parent)


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
    root: Path, step: int, runner: Any, ident: dict[str, Any], trainer_state: dict[str, Any], keep: int,
    config_yaml: str,
) -> Path:  # fmt: skip
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
        final = _commit(tmp, root / f"step_{step}", files, meta)
    except BaseException:  # a full disk, say: the partial checkpoint goes, the last whole one stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(shard_dir(root, step), ignore_errors=True)
    prune(root, keep)
    return final


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


# ---- real-time checkpoints ----------------------------------------------------------------------


def _background() -> None:
    """Lower this thread's CPU priority (Linux nice is per thread): the writer should take the cores
    only when training leaves them idle, not preempt an intra-op worker that a whole matmul waits on."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


class RealtimeWriter:
    """Writes each layer of the EPS right after its update, on a thread of its own; ``commit(step)``
    turns a step's layer files into a checkpoint once they are all on disk.

    The runner calls ``before_update(i)`` before it updates layer i again, so the previous step's file
    for layer i is complete before its buffers change (the writer reads the EPS buffers in place)."""

    def __init__(self, root: Path, ident: dict[str, Any], config_yaml: str):
        self.root = root / "realtime"
        self.root.mkdir(parents=True, exist_ok=True)
        self.ident, self.config_yaml = ident, config_yaml
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="l2l-rtckpt", initializer=_background
        )
        self._layer_jobs: dict[int, Future] = {}
        self._commit_job: Future | None = None
        self._files: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.busy_s = 0.0
        self.step: int | None = None

    def _tmp(self, step: int) -> Path:
        return self.root / f".tmp-step_{step}"

    def begin(self, step: int) -> None:
        """Layers updated from now on belong to the checkpoint of ``step``."""
        self.step = step
        tmp = self._tmp(step)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        self._files[step] = {}

    def layer_updated(self, i: int, name: str, payload: Callable[[], dict[str, torch.Tensor]]) -> None:
        step = self.step
        assert step is not None

        def job() -> None:
            t0 = time.perf_counter()
            entry = write_tensors(self._tmp(step) / name, payload())
            with self._lock:
                self._files[step][name] = entry
                self.busy_s += time.perf_counter() - t0

        self._layer_jobs[i] = self._pool.submit(job)

    def before_update(self, i: int) -> None:
        """Layer i's buffers are about to change: its pending write, and the last commit, must be done."""
        job = self._layer_jobs.pop(i, None)
        if job is not None:
            job.result()
        self.wait_commit()

    def commit(
        self, step: int, trainer_state: dict[str, Any], layer_files: Callable[[], list[tuple[str, Callable]]]
    ) -> None:
        """After ``step``: write the layers it did not update (a skipped step), its state and manifest,
        then rename it into place and drop the older real-time checkpoint."""

        def job() -> None:
            t0 = time.perf_counter()
            tmp = self._tmp(step)
            for name, payload in layer_files():
                if name not in self._files[step]:
                    self._files[step][name] = write_tensors(tmp / name, payload())
            files = dict(self._files.pop(step))
            files["state.json"] = write_bytes(tmp / "state.json", json.dumps(trainer_state).encode())
            files["config.yaml"] = write_bytes(tmp / "config.yaml", self.config_yaml.encode())
            meta = {"step": step, "created": time.time(), "realtime": True, **self.ident}
            _commit(tmp, self.root / f"step_{step}", files, meta)
            prune(self.root, 1)
            self.busy_s += time.perf_counter() - t0

        self._commit_job = self._pool.submit(job)  # one thread, FIFO: after this step's layer writes

    def wait_commit(self) -> None:
        if self._commit_job is not None:
            self._commit_job.result()
            self._commit_job = None

    def pop_busy(self) -> float:
        with self._lock:
            busy, self.busy_s = self.busy_s, 0.0
        return busy

    def close(self) -> None:
        self._pool.shutdown(wait=True)
