"""The disk tier's on-disk format and its raw I/O: what a layer file is, byte for byte.

A layer file (``layer_<i>.eps``) is a 4 KiB header and two slots, each ``[w | m | v]`` (FP32, every part
block-aligned), so a layer's state is one sequential read or write, with ``O_DIRECT`` where the filesystem
allows it (else buffered I/O whose pages are dropped after use), so the page cache never holds a second
copy. ``commit.json`` (:data:`COMMIT`, written by :mod:`.writeback`) names each layer's current slot. The
functions here keep no state of the tier: sizes, the header, aligned buffers, large sequential calls, a
probe of the filesystem, a dd-style measurement of it, and the tests' kill points.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from l2l_cli.engine.device import Accelerator
from l2l_cli.models.base import ModelSpec

ALIGN = 4096  # O_DIRECT: buffers, offsets and lengths block-aligned
CHUNK = 64 << 20  # one read/write call
STATE = "wmv"  # the parts a slot of a layer file holds, in file order
FORMAT = 1
MAGIC = b"l2l-eps-layer\n"
COMMIT = "commit.json"


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layer_file_bytes(numel: int) -> int:
    """Bytes of one layer's file: the header and two slots of FP32 weights and moments."""
    return ALIGN + 2 * len(STATE) * aligned(4 * numel)


def disk_bytes(spec: ModelSpec) -> int:
    """What the disk tier needs on disk for ``spec``: 24 bytes per parameter (two versions of w, m, v)."""
    pre, block, post = spec.param_counts()
    return layer_file_bytes(pre) + spec.num_layers * layer_file_bytes(block) + layer_file_bytes(post)


# ---- crash injection (the tests' kill points; unset in normal runs) ---------------------------------

_CRASH = os.environ.get("L2L_EPS_CRASH", "")  # "<event>:<n>": SIGKILL at the n-th write|park|commit
_crash_counts: dict[str, int] = {}


def crash_point(event: str) -> None:
    if not _CRASH:
        return
    name, _, nth = _CRASH.partition(":")
    if name != event:
        return
    _crash_counts[event] = _crash_counts.get(event, 0) + 1
    if _crash_counts[event] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


# ---- I/O ------------------------------------------------------------------------------------------------


def probe_direct(root: Path) -> bool:
    """Whether ``root``'s filesystem takes O_DIRECT reads and writes (tmpfs and some others refuse it)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    buf = AlignedBuffer(ALIGN)
    fd = -1
    path = root / f".probe-{os.getpid()}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | flag, 0o644)
        os.pwritev(fd, [buf.view(0, ALIGN)], 0)
        os.preadv(fd, [buf.view(0, ALIGN)], 0)
        return True
    except OSError:
        return False
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()


class AlignedBuffer:
    """Page-aligned host memory as a uint8 tensor (pinned on CUDA hosts: ``acc.host_empty``)."""

    def __init__(self, nbytes: int, acc: Accelerator | None = None):
        raw = (
            acc.host_empty(nbytes + ALIGN, torch.uint8)
            if acc
            else torch.empty(nbytes + ALIGN, dtype=torch.uint8)
        )
        base = (-raw.data_ptr()) % ALIGN
        self.tensor = raw[base : base + nbytes]
        self._raw = raw
        self._np = self.tensor.numpy()

    def view(self, start: int, nbytes: int) -> memoryview:
        return memoryview(self._np[start : start + nbytes])


class DiskIo:
    """Open, read and write layer files: large sequential calls, O_DIRECT or pages dropped after use."""

    def __init__(self, direct: bool):
        self.direct = direct

    def open(self, path: Path) -> int:
        return os.open(path, os.O_RDWR | (os.O_DIRECT if self.direct else 0))

    def read(self, fd: int, mv: memoryview, offset: int) -> None:
        self._transfer(os.preadv, fd, mv, offset, "read")
        if not self.direct:
            os.posix_fadvise(fd, offset, len(mv), os.POSIX_FADV_DONTNEED)

    def write(self, fd: int, mv: memoryview, offset: int) -> None:
        self._transfer(os.pwritev, fd, mv, offset, "write")

    def _transfer(self, call: Any, fd: int, mv: memoryview, offset: int, what: str) -> None:
        """All of ``mv`` at ``offset``, in calls of at most CHUNK bytes. A call may move fewer bytes than
        asked; under O_DIRECT the next one must still start on a block boundary (an unaligned offset is
        EINVAL), so the progress of a partial call is rounded down to ALIGN and the tail of that block
        moved again (the same bytes: rereading or rewriting them is harmless)."""
        done, n, stalls = 0, len(mv), 0
        while done < n:
            k = call(fd, [mv[done : done + min(CHUNK, n - done)]], offset + done)
            if k <= 0:
                raise OSError(f"short {what} at byte {offset + done} (file shorter than its layout)")
            if self.direct and done + k < n:
                k -= k % ALIGN
                stalls = stalls + 1 if k == 0 else 0
                if stalls > 8:  # the file system keeps returning less than a block: give up, say where
                    raise OSError(
                        f"{what} at byte {offset + done}: less than one {ALIGN}-byte block per call"
                    )
            done += k

    def sync(self, fd: int, offset: int, n: int) -> None:
        os.fdatasync(fd)
        if not self.direct:  # clean pages can be dropped now
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)


class LayerFile:
    """``layer_<i>.eps``: a header block, then slots 0 and 1, each [w | m | v] in FP32, parts block-aligned."""

    def __init__(self, root: Path, index: int, kind: str, numel: int):
        self.path = root / f"layer_{index:05d}.eps"
        self.index, self.kind, self.numel = index, kind, numel
        self.part_bytes = aligned(4 * numel)
        self.size = layer_file_bytes(numel)

    def offset(self, slot: int, part: str) -> int:
        return ALIGN + (len(STATE) * slot + STATE.index(part)) * self.part_bytes

    def header(self) -> bytes:
        meta = {"format": FORMAT, "index": self.index, "kind": self.kind, "numel": self.numel, "dtype": "float32",
                "part_bytes": self.part_bytes, "slots": 2, "parts": list(STATE)}  # fmt: skip
        text = MAGIC + json.dumps(meta).encode() + b"\n"
        return text + b" " * (ALIGN - len(text))

    def create(self) -> None:
        """A new file with its blocks reserved (a full disk fails here, not mid-run); unwritten blocks
        read as zeros, which is the initial state of the moments."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:
                os.posix_fallocate(fd, 0, self.size)
            except OSError as e:
                raise OSError(e.errno, f"{self.path}: cannot reserve {self.size} bytes ({e.strerror})") from e
            os.pwrite(fd, self.header(), 0)
            os.fsync(fd)
        finally:
            os.close(fd)

    def problem(self) -> str | None:
        """Why this file cannot be this layer's (None: it can)."""
        try:
            if self.path.stat().st_size != self.size:
                return f"{self.path.name} has {self.path.stat().st_size} bytes, expected {self.size}"
            with open(self.path, "rb") as f:
                head = f.read(ALIGN)
        except OSError as e:
            return f"{self.path.name}: {e.strerror or e}"
        if head != self.header():
            return f"{self.path.name} does not hold layer {self.index} of this model ({self.kind}, {self.numel} parameters)"
        return None


# ---- the disk itself ------------------------------------------------------------------------------------


def measure_disk(root: Path, nbytes: int) -> dict[str, Any]:
    """Sequential write then read bandwidth of ``root``'s filesystem, the way the disk tier does its I/O
    (O_DIRECT where allowed, 64 MiB calls, fdatasync): a dd-style measurement of the same disk. Writes a
    temporary file of ``nbytes`` (rounded to 4 KiB) and removes it."""
    root.mkdir(parents=True, exist_ok=True)
    nbytes = max(ALIGN, aligned(nbytes))
    io = DiskIo(probe_direct(root))
    buf = AlignedBuffer(min(nbytes, CHUNK))
    buf.tensor.random_(0, 255)  # not zeros: some filesystems and drives shortcut those
    path = root / f".l2l-disk-bench-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if io.direct else 0), 0o644)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, CHUNK):
            io.write(fd, buf.view(0, min(CHUNK, nbytes - off)), off)
        io.sync(fd, 0, nbytes)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for off in range(0, nbytes, CHUNK):
            io.read(fd, buf.view(0, min(CHUNK, nbytes - off)), off)
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()
    st = os.statvfs(root)
    return {
        "path": str(root),
        "bytes": nbytes,
        "direct_io": io.direct,
        "write_gbps": nbytes / write_s / 1e9,
        "read_gbps": nbytes / read_s / 1e9,
        "free_bytes": st.f_bavail * st.f_frsize,
    }
