"""The disk tier's on-disk format and its raw I/O: what a layer file is, byte for byte.

A layer file (``layer_<i>.eps``) is a 4 KiB header and two slots, each ``[w | m | v]`` (FP32, every part
block-aligned; format 1), or under bf16 CMP ``[h | l | m | v]`` (format 2, :data:`SPLIT`): the FP32 master
split in two 16-bit planes, ``h`` its bf16 round-to-nearest-even (exactly the weights the device computes
with, so the forward reads 2 bytes per parameter) and ``l`` its low 16 bits (see :func:`split_master`).
Under 8-bit AdamW (format 3) a slot is ``[w | m | v]`` with the FP32 master and each moment part holding
that moment's state buffers (:func:`~.layout.moment_layout`: its 8-bit codes, one FP32 absmax per block,
the small tensors' FP32 moments), about 2 bytes per parameter for both moments instead of 8; the header
names each buffer's place. Format 3 keeps the master in FP32 under bf16 CMP too: format 2's tie marks live
in v's sign bit, which 8-bit codes do not have free (all 256 codes are values), and a separate mark part
would be a third read per update for a rare case; the cost is the forward's and backward's read of the
weights, 4 bytes per parameter instead of 2.
A layer's state is one sequential read or write, with ``O_DIRECT`` where the filesystem
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
import xxhash

from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.tiers.disk.layout import (  # noqa: F401  (the sizes, re-exported for the I/O's users)
    ALIGN,
    COMMIT,
    SPLIT,
    STATE,
    Piece,
    aligned,
    disk_bytes,
    layer_file_bytes,
    moment_bytes,
    part_width,
)
from l2l_cli.problems import writing

CHUNK = 64 << 20  # one read/write call
FORMAT = 1  # FP32 weights (FP32 and fp16 CMP runs; what every disk EPS before format 2 wrote)
FORMAT_SPLIT = 2  # bf16 CMP: the master split in hi/lo planes, the forward reads hi alone
FORMAT_STATE = 3  # 8-bit AdamW: FP32 weights, each moment part the optimizer's own state buffers
FORMATS = (FORMAT, FORMAT_SPLIT, FORMAT_STATE)
MAGIC = b"l2l-eps-layer\n"


def format_of(split: bool, pieces: Any) -> int:
    """A layer file's format: 3 where its moment parts hold an optimizer's state buffers (``pieces``), 2
    where the master is split in bf16 planes, else 1."""
    return FORMAT_STATE if pieces else FORMAT_SPLIT if split else FORMAT


# ---- the master as two 16-bit planes (format 2) ----------------------------------------------------------
#
# hi = bf16(w) rounded to nearest even: its bits are the top half of w's, or that plus one (rounded up).
# lo = w's low 16 bits. Then w = ((hi - borrow) << 16) | lo, with borrow = 1 exactly when rounding went up:
# lo > 0x8000, or the tie lo == 0x8000 with w's top half odd (ties go to the even hi). In the tie the lo
# plane cannot tell the two apart (for an even hi, 65537 FP32 values round to it: one more than 16 bits
# hold), so the missing bit goes where no value needs it: the sign bit of v (Adam's second moment is
# >= +0, never -0 or negative), set in the file for a tie that rounded *down*. (A NaN master comes back a
# NaN, its payload not kept: bf16 rounding makes every NaN the same one.)

_CHUNK_EL = 1 << 22  # elements per vectorised pass (bounded temporaries)
_SIGN = -(2**31)


def split_master(w: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Write ``lo`` (int16) from the FP32 master ``w`` whose bf16 rounding ``hi`` already holds, and mark
    the ties that rounded down in ``v``'s sign bit. Returns those indices: the caller clears the marks
    (:func:`clear_marks`) once ``v`` is on disk."""
    n = w.numel()
    wi = w.view(torch.int32)
    lo.copy_(w.view(torch.int16).view(n, 2)[:, 0])  # little-endian: the low half of each element
    ties = torch.nonzero(lo == -32768).flatten()  # lo == 0x8000
    if ties.numel():
        top_even = (wi[ties].bitwise_right_shift(16) & 1) == 0
        down = ties[top_even]
        vi = v.view(torch.int32)
        vi[down] = vi[down] | _SIGN
        return down
    return ties


def clear_marks(v: torch.Tensor, marks: torch.Tensor) -> None:
    """Undo :func:`split_master`'s tie marks in ``v`` (its sign bits back to 0)."""
    if marks.numel():
        vi = v.view(torch.int32)
        vi[marks] = vi[marks] & 0x7FFFFFFF


def join_master(hi: torch.Tensor, lo: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> None:
    """The FP32 master from its planes (``v`` as read from the file: its tie marks are cleared here)."""
    n = w.numel()
    wi = w.view(torch.int32)
    for a in range(0, n, _CHUNK_EL):
        b = min(n, a + _CHUNK_EL)
        out = wi[a:b]
        out.copy_(hi[a:b].view(torch.int16))  # sign-extended: (hi << 16) wraps to hi's bits exactly
        out.bitwise_left_shift_(16)
        out.add_(lo[a:b])  # lo as a signed 16-bit value: -(0x10000 - lo) when it borrowed
    ties = torch.nonzero(lo == -32768).flatten()
    if ties.numel():
        vi = v.view(torch.int32)
        down = ties[vi[ties] < 0]  # marked: the tie rounded down, lo is +0x8000, not -0x8000
        wi[down] = wi[down] + 0x10000
        vi[down] = vi[down] & 0x7FFFFFFF


# ---- checksums: each part of a slot as written, checked when it is read back ---------------------------


def digest(mv: memoryview) -> int:
    """The checksum of a part's bytes (xxh3, 64 bits: a few % of a read's time at disk speeds)."""
    return xxhash.xxh3_64_intdigest(mv)


_ZEROS: dict[int, int] = {}


def zeros_digest(nbytes: int) -> int:
    """The checksum of ``nbytes`` zero bytes (a part never written: what ``posix_fallocate`` left)."""
    if nbytes not in _ZEROS:
        h, block = xxhash.xxh3_64(), bytes(min(nbytes, CHUNK))
        for a in range(0, nbytes, CHUNK):
            h.update(block[: min(CHUNK, nbytes - a)])
        _ZEROS[nbytes] = h.intdigest()
    return _ZEROS[nbytes]


def record_digest(record: dict[str, Any]) -> str:
    """The commit record's own checksum: over its JSON without the ``checksum`` key, keys sorted."""
    body = {k: v for k, v in record.items() if k != "checksum"}
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True).encode())


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
    """Page-aligned host memory as a uint8 tensor (pinned on CUDA hosts, to its size: ``acc.host_empty``; a
    cache slot's buffers cross the link)."""

    def __init__(self, nbytes: int, acc: Accelerator | None = None):
        raw = (
            acc.host_empty(nbytes + ALIGN, torch.uint8, link=True)
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
    """``layer_<i>.eps``: a header block, then slots 0 and 1, each [w | m | v] in FP32 (format 1) or
    [h | l | m | v] (format 2, ``split``), or [w | m | v] with each moment part the optimizer's state
    buffers (format 3, ``pieces``: :func:`~.layout.moment_layout`, for 8-bit AdamW), parts block-aligned."""

    def __init__(
        self,
        root: Path,
        index: int,
        kind: str,
        numel: int,
        split: bool = False,
        pieces: dict[str, list[Piece]] | None = None,
    ):
        self.path = root / f"layer_{index:05d}.eps"
        self.index, self.kind, self.numel, self.split = index, kind, numel, split
        assert not (split and pieces), "format 3 keeps the master in FP32"
        self.pieces = pieces  # format 3: where each state buffer is in its moment part (None: FP32 moments)
        self.parts = SPLIT if split else STATE  # the file's parts, in slot order
        self.part_bytes = aligned(4 * numel)  # an FP32 part (w, m, v, g in RAM)
        moments = moment_bytes(pieces) if pieces else {}
        self._bytes = {p: moments.get(p, aligned(part_width(p) * numel)) for p in self.parts}
        self._at = {p: sum(self._bytes[q] for q in self.parts[:k]) for k, p in enumerate(self.parts)}
        self.slot_bytes = sum(self._bytes.values())
        self.size = layer_file_bytes(numel, split, moments)

    @property
    def format(self) -> int:
        return format_of(self.split, self.pieces)

    def nbytes(self, part: str) -> int:
        """Bytes of a file part (block-aligned)."""
        return self._bytes[part]

    def offset(self, slot: int, part: str) -> int:
        return ALIGN + slot * self.slot_bytes + self._at[part]

    def park_offset(self, slot: int) -> int:
        """Where a parked gradient (FP32) waits: over the weights of the slot the update will write."""
        return self.offset(slot, self.parts[0])

    def header(self) -> bytes:
        fmt = self.format
        dtype = "bfloat16+int16" if self.split else "float32"
        meta: dict[str, Any] = {
            "format": fmt,
            "index": self.index,
            "kind": self.kind,
            "numel": self.numel,
            "dtype": dtype,
            "part_bytes": self.part_bytes,
            "slots": 2,
            "parts": list(self.parts),
        }
        if self.pieces:  # each state buffer: [short name, dtype, byte offset in its part, entries]
            meta["state"] = {p: [list(x) for x in xs] for p, xs in self.pieces.items()}
        text = MAGIC + json.dumps(meta).encode() + b"\n"
        return text + b" " * (ALIGN - len(text))

    def create(self) -> None:
        """A new file with its blocks reserved (a full disk fails here, not mid-run); unwritten blocks
        read as zeros, which is the initial state of the moments."""
        with writing(self.path):  # a full disk or an I/O error: one line naming the file
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.posix_fallocate(fd, 0, self.size)
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
            return (
                f"{self.path.name} does not hold layer {self.index} of this model ({self.kind}, "
                f"{self.numel} parameters)"
            )
        return None


# ---- the disk itself ------------------------------------------------------------------------------------


def measure_disk(root: Path, nbytes: int) -> dict[str, Any]:
    """Sequential write then read bandwidth of ``root``'s filesystem, the way the disk tier does its I/O
    (O_DIRECT where allowed, 64 MiB calls, fdatasync): a dd-style measurement of the same disk; then both at
    once (``mixed_gbps``: bytes read + written per second while a reader and a writer thread run together,
    as the tier's read-ahead and write-behind do). Writes temporary files of ``nbytes`` (rounded to 4 KiB)
    and removes them."""
    import threading

    root.mkdir(parents=True, exist_ok=True)
    nbytes = max(ALIGN, aligned(nbytes))
    io = DiskIo(probe_direct(root))
    buf = AlignedBuffer(min(nbytes, CHUNK))
    buf.tensor.random_(0, 255)  # not zeros: some filesystems and drives shortcut those
    buf2 = AlignedBuffer(min(nbytes, CHUNK))
    flag = os.O_DIRECT if io.direct else 0
    path, path2 = root / f".l2l-disk-bench-{os.getpid()}", root / f".l2l-disk-bench-{os.getpid()}-b"

    def write_all(fd: int, b: AlignedBuffer) -> None:
        for off in range(0, nbytes, CHUNK):
            io.write(fd, b.view(0, min(CHUNK, nbytes - off)), off)
        io.sync(fd, 0, nbytes)

    def read_all(fd: int, b: AlignedBuffer) -> None:
        for off in range(0, nbytes, CHUNK):
            io.read(fd, b.view(0, min(CHUNK, nbytes - off)), off)

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    fd2 = os.open(path2, os.O_RDWR | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    try:
        t0 = time.perf_counter()
        write_all(fd, buf)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        read_all(fd, buf)
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()  # a write-behind and a read-ahead at once, each on its own thread
        writer = threading.Thread(target=write_all, args=(fd2, buf2))
        writer.start()
        read_all(fd, buf)
        writer.join()
        mixed_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.close(fd2)
        for q in (path, path2):
            with contextlib.suppress(OSError):
                q.unlink()
    st = os.statvfs(root)
    return {
        "path": str(root),
        "bytes": nbytes,
        "direct_io": io.direct,
        "write_gbps": nbytes / write_s / 1e9,
        "read_gbps": nbytes / read_s / 1e9,
        "mixed_gbps": 2 * nbytes / mixed_s / 1e9,
        "free_bytes": st.f_bavail * st.f_frsize,
    }
