"""The checkpoint's file I/O: fsynced writes, a streaming safetensors writer (O_DIRECT, block-aligned, through
the disk tier's aligned buffer), and a directory replaced crash-consistently."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import struct
import threading
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

from l2l_cli.engine.tiers.disk.format import ALIGN, AlignedBuffer, DiskIo
from l2l_cli.problems import writing

CHUNK = 32 << 20  # the streaming writer's staging buffer, bytes
_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_staging = threading.local()


def fsync_dir(path: Path) -> None:
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


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """:func:`_write_tensors`, a full disk reported with the file's path."""
    with writing(path):
        return _write_tensors(path, tensors)


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Stream tensors into a safetensors file without building it in memory; returns its manifest
    entry (size, crc32).

    Why not ``write_bytes(st_save(...))``: a buffered write spends kernel CPU on page-cache copies, which
    a background writer steals from training (docs/benchmarks.md has the measurement). Here each
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
    hlen = -(-(8 + len(text)) // ALIGN) * ALIGN - 8
    head = struct.pack("<Q", hlen) + text + b" " * (hlen - len(text))
    total = len(head) + offset
    staging = getattr(_staging, "buf", None)
    if staging is None:
        staging = _staging.buf = AlignedBuffer(CHUNK)  # page-aligned, as O_DIRECT wants (the disk tier's)
    view, stage = staging.tensor, staging.view(0, CHUNK)
    pieces = [torch.frombuffer(bytearray(head), dtype=torch.uint8)]
    pieces += [t.reshape(-1).view(torch.uint8) for t in tensors.values() if t.numel()]
    direct = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
    except OSError:
        fd, direct = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 0
    crc, pos, fill = 0, 0, 0
    try:
        disk = DiskIo(
            bool(direct)
        )  # the disk tier's writer: whole blocks under O_DIRECT, short writes resumed

        def flush(n: int) -> None:
            nonlocal disk, pos
            padded = -(-n // ALIGN) * ALIGN if disk.direct else n  # the tail is padded, then truncated
            try:
                disk.write(fd, stage[:padded], pos)
            except OSError:
                if not disk.direct:
                    raise
                disk = DiskIo(False)  # the filesystem accepted the flag but not the write: fall back
                _set_direct(fd, False)
                disk.write(fd, stage[:n], pos)
            pos += n

        for piece in pieces:
            done = 0
            while done < piece.numel():
                k = min(CHUNK - fill, piece.numel() - done)
                view[fill : fill + k].copy_(piece[done : done + k])
                crc = zlib.crc32(stage[fill : fill + k], crc)
                fill, done = fill + k, done + k
                if fill == CHUNK:
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


def file_entry(path: Path) -> dict[str, Any]:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            n += len(chunk)
    return {"bytes": n, "sha256": h.hexdigest()}


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
            fsync_dir(final.parent)
            os.replace(new, final)
        fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(final.parent)


def recover_dir(final: Path) -> None:
    """Undo a replacement cut short between its two renames (``final`` missing, the old one aside)."""
    old = _aside(final)
    if not final.exists() and (old / "manifest.json").is_file():
        os.replace(old, final)
        fsync_dir(final.parent)
