"""The disk tier of the eager param-server (``eps.tier=disk``): training state beyond host RAM.

Every layer's FP32 master weights and optimizer moments live in one file per layer; host RAM holds only
``eps.host_cache_layers`` layers at a time, in a cache of page-aligned slots. L2L's schedule is what makes
this cheap: layers are used one at a time in a known order (forward 0..N+1, backward N+1..0, the update),
so a reader thread reads the layers about to be used while the current one computes, and a writer thread
writes each updated layer back behind the compute; the host optimizer runs on the cached copy.

A layer file (``layer_<i>.eps``) is a 4 KiB header and two slots, each ``[w | m | v]`` (FP32, every part
block-aligned), so a layer's state is one sequential read or write, with ``O_DIRECT`` where the filesystem
allows it (else buffered I/O whose pages are dropped after use), so the page cache never holds a second
copy. An update is written to the slot that does not hold the layer's current version; ``commit.json``
(replaced atomically after the step's writes are on disk) names each layer's current slot and optimizer
step and the trainer's state. A ``kill -9`` at any point therefore leaves every layer readable at the
last committed step, and ``trainer.resume`` continues from it with no checkpoint of its own: the disk EPS
*is* the checkpoint. The slot that does not hold the current version doubles as L2L-p's undo log (the
pre-update state is still on disk) and, in L2L, as the place a layer's gradient waits for the update.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from l2l_cli.checkpoint import CheckpointError
from l2l_cli.engine.device import DONE, Accelerator, CopyHandle
from l2l_cli.engine.eps import LayerState, bind_optimizer
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.optim import OptimSettings
from l2l_cli.engine.tiers import TierSettings
from l2l_cli.models.base import ModelSpec
from l2l_cli.profiling.timers import PhaseTimer

ALIGN = 4096  # O_DIRECT: buffers, offsets and lengths block-aligned
CHUNK = 64 << 20  # one read/write call
STATE = "wmv"  # the parts a slot of a layer file holds, in file order
FORMAT = 1
MAGIC = b"l2l-eps-layer\n"
COMMIT = "commit.json"


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layer_file_bytes(numel: int) -> int:
    """Bytes of one layer's file: the header and two slots of FP32 weights and moments."""
    return ALIGN + 2 * len(STATE) * _round(4 * numel)


def disk_bytes(spec: ModelSpec) -> int:
    """What the disk tier needs on disk for ``spec``: 24 bytes per parameter (two versions of w, m, v)."""
    pre, block, post = spec.param_counts()
    return layer_file_bytes(pre) + spec.num_layers * layer_file_bytes(block) + layer_file_bytes(post)


# ---- crash injection (the tests' kill points; unset in normal runs) ---------------------------------

_CRASH = os.environ.get("L2L_EPS_CRASH", "")  # "<event>:<n>": SIGKILL at the n-th write|park|commit
_crash_counts: dict[str, int] = {}


def _crash_point(event: str) -> None:
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


class _Io:
    """Open, read and write layer files: large sequential calls, O_DIRECT or pages dropped after use."""

    def __init__(self, direct: bool):
        self.direct = direct

    def open(self, path: Path) -> int:
        return os.open(path, os.O_RDWR | (os.O_DIRECT if self.direct else 0))

    def read(self, fd: int, mv: memoryview, offset: int) -> None:
        done, n = 0, len(mv)
        while done < n:
            k = os.preadv(fd, [mv[done : done + min(CHUNK, n - done)]], offset + done)
            if k <= 0:
                raise OSError(f"short read at byte {offset + done} (file shorter than its layout)")
            done += k
        if not self.direct:
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)

    def write(self, fd: int, mv: memoryview, offset: int) -> None:
        done, n = 0, len(mv)
        while done < n:
            k = os.pwritev(fd, [mv[done : done + min(CHUNK, n - done)]], offset + done)
            if k <= 0:
                raise OSError(f"short write at byte {offset + done}")
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
        self.part_bytes = _round(4 * numel)
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


# ---- the cache ------------------------------------------------------------------------------------------


class _Slot:
    """One layer's state in RAM: [w | m | v | g] page-aligned, sized for the largest layer, with one
    optimizer per layer kind bound to views of it (the optimizer runs on the cached copy in place)."""

    def __init__(
        self, n_max: int, layouts: dict[str, FlatLayout], acc: Accelerator, send_dtype: torch.dtype,
        optim: OptimSettings,
    ):  # fmt: skip
        self.part_bytes = _round(4 * n_max)
        self.buf = AlignedBuffer(4 * self.part_bytes, acc)
        pb = self.part_bytes
        self.f32 = {
            p: self.buf.tensor[k * pb : (k + 1) * pb].view(torch.float32) for k, p in enumerate("wmvg")
        }
        self.w_send = acc.host_empty(n_max, send_dtype) if send_dtype != torch.float32 else None
        # CMP: the device's half gradient lands here and is widened into g on the host
        self.g_recv = acc.host_empty(n_max, send_dtype) if send_dtype != torch.float32 else None
        self.optimizers = {
            kind: bind_optimizer(layout, *(self.f32[p][: layout.numel] for p in "wgmv"), optim)
            for kind, layout in layouts.items()
        }
        self.layer: int | None = None
        self.valid: set[str] = set()  # parts that hold the layer's current values
        self.pins = 0
        self.busy = False  # the reader is evicting from / reading into this slot
        self.copies: list[CopyHandle] = []  # device copies still reading from this slot
        self.writing: Future | None = None  # the write-back of the layer's last update
        self.g_dirty = False  # g holds a gradient that is on no disk yet (parked on eviction)
        self.used = 0

    def mv(self, part: str, nbytes: int) -> memoryview:
        return self.buf.view("wmvg".index(part) * self.part_bytes, nbytes)

    @property
    def nbytes(self) -> int:
        return self.buf.tensor.nbytes + sum(t.nbytes for t in (self.w_send, self.g_recv) if t is not None)


@dataclass
class _Demand:
    layer: int
    need: frozenset[str]
    fresh: bool
    slot: _Slot | None = None
    done: bool = False
    error: BaseException | None = None


@dataclass
class _Job:
    slot: _Slot
    layer: int
    parts: frozenset[str]
    demand: _Demand | None = None
    evict: tuple[int | None, list[CopyHandle], Future | None, bool] | None = (
        None  # (layer, copies, write, park)
    )


@dataclass
class _Stream:
    """Who walks the layers in order (the relay; the updates), where it is and which way it goes."""

    last: int
    step: int
    parts: frozenset[str]
    reflect: bool  # the relay turns at the ends (forward -> backward -> next step's forward)
    clock: int


@dataclass
class IoStats:
    read_bytes: int = 0
    write_bytes: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    wait_s: float = 0.0  # the compute thread waiting for the disk (exposed)
    eps_wait_s: float = 0.0  # the EPS thread waiting for it (L2L-p's updates: hidden unless the step waits)
    hits: int = 0  # pins served from the cache (read ahead, or still there)
    misses: int = 0  # pins that waited for a read (or a free slot)
    parks: int = 0  # gradients written out to wait for their update on disk
    ahead: int = 0  # reads issued before anyone asked for the layer (read-ahead)
    demand: int = 0  # reads issued because a pin asked for a layer not read ahead

    def add(self, other: IoStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class DiskLayer(LayerState):
    """A layer whose state lives in its file. While the tier has it pinned, ``w``/``g``/``m``/``v`` and
    ``optimizer`` are those of the cache slot it occupies; touching them unpinned is a bug and raises."""

    def __init__(self, tier: DiskTier, index: int, kind: str, layout: FlatLayout):
        self.tier, self.index, self.kind, self.layout = tier, index, kind, layout
        self.version = 0
        self.grad_in: CopyHandle = DONE
        self.opt_step = 0.0  # the optimizer's step count for this layer (committed with the layer)
        self.undo: list[torch.Tensor] | None = None
        self.undo_step = 0.0
        self.undo_slot: int | None = None

    def _slot(self) -> _Slot:
        s = self.tier.slot_of(self.index)
        if s is None:
            raise RuntimeError(f"layer {self.index} is not in the host cache (touched without a pin)")
        return s

    def _part(self, p: str) -> torch.Tensor:
        return self._slot().f32[p][: self.layout.numel]

    w = property(lambda self: self._part("w"))  # type: ignore[assignment]
    g = property(lambda self: self._part("g"))  # type: ignore[assignment]
    m = property(lambda self: self._part("m"))  # type: ignore[assignment]
    v = property(lambda self: self._part("v"))  # type: ignore[assignment]

    @property  # type: ignore[override]
    def w_send(self) -> torch.Tensor | None:
        s = self._slot()
        return s.w_send[: self.layout.numel] if s.w_send is not None else None

    @property  # type: ignore[override]
    def g_recv(self) -> torch.Tensor | None:
        s = self._slot()
        return s.g_recv[: self.layout.numel] if s.g_recv is not None else None

    @property  # type: ignore[override]
    def optimizer(self) -> torch.optim.Optimizer:
        """The cache slot's optimizer for this layer's kind, its step count set to this layer's."""
        opt = self._slot().optimizers[self.kind]
        for state in opt.state.values():
            state["step"].fill_(self.opt_step)
        return opt

    def update(self, lr: float, grad_mult: torch.Tensor | float | None, bump: bool = True) -> None:
        super().update(lr, grad_mult, bump)
        opt = self._slot().optimizers[self.kind]
        self.opt_step = float(next(iter(opt.state.values()))["step"])

    def set_step(self, step: float) -> None:
        self.opt_step = step

    def save_undo(self, acc: Accelerator) -> None:
        """Nothing to copy: the pre-update state stays on disk, in the slot the update does not overwrite."""
        self.undo_slot = self.tier.latest[self.index]
        self.undo_step = self.opt_step

    def restore_undo(self) -> None:
        self.tier.restore(self)
        self.version += 1

    def nbytes(self) -> dict[str, int]:
        return {}  # the cache's bytes are the tier's (``host_parts``)


class DiskTier:
    """One file per layer on disk; ``cache_layers`` layers in RAM, read ahead and written back in the
    background. See the module doc for the layout and the crash-safety argument."""

    durable = True

    def __init__(
        self, settings: TierSettings, spec: ModelSpec, layouts: dict[str, FlatLayout], acc: Accelerator,
        send_dtype: torch.dtype, optim: OptimSettings, timer: PhaseTimer | None = None,
    ):  # fmt: skip
        self._tmp = None if settings.path else tempfile.mkdtemp(prefix="l2l-eps-")
        self.root = Path(settings.path or self._tmp or ".")
        self.root.mkdir(parents=True, exist_ok=True)
        self.settings, self.acc, self.timer = settings, acc, timer
        n = spec.num_all_layers
        kinds = [spec.kind(i) for i in range(n)]
        self.files = [LayerFile(self.root, i, kinds[i], layouts[kinds[i]].numel) for i in range(n)]
        self.io = _Io(probe_direct(self.root))
        n_max = max(layout.numel for layout in layouts.values())
        with acc.meter.paused():
            k = min(settings.cache_layers, n)  # more slots than layers would never be used
            self.slots = [_Slot(n_max, layouts, acc, send_dtype, optim) for _ in range(k)]
        self.cv = threading.Condition()
        self.latest: list[int | None] = [None] * n  # the file slot holding each layer's newest version
        self.committed: list[int | None] | None = None  # what commit.json names (None: no commit yet)
        self.parked = [False] * n  # the layer's gradient waits on disk (the slot the update will write)
        self.grad_live = [False] * n  # the cache's g holds this step's gradient, not yet applied
        self.layers: dict[int, DiskLayer] = {}
        self._demands: list[_Demand] = []
        self._streams: dict[str, _Stream] = {}
        # read-ahead from the last step's trace of pins (a step repeats the same accesses; ZeRO-Infinity
        # prefetches the same way): this step's pins so far, the last step's, and per thread (compute,
        # EPS) where in that trace its last pin was, or None when it strayed from it (evaluation, say)
        self._trace: list[tuple[int, frozenset[str], bool, bool]] = []
        self._plan: list[tuple[int, frozenset[str], bool, bool]] = []
        self._cursor: dict[bool, int | None] = {True: -1, False: -1}
        self._clock = 0
        self.stats, self.totals = IoStats(), IoStats()
        self.commits = 0
        self.last_commit_step: int | None = None
        self._commit_job: Future | None = None
        self._main = threading.get_ident()
        self._failed: BaseException | None = None
        self._closed = False
        self.adopted = False
        self.record: dict[str, Any] | None = None
        if settings.resume:
            self._adopt()
        if not self.adopted:
            self._create()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l2l-disk-write")
        self._reader = threading.Thread(target=self._read_loop, name="l2l-disk-read", daemon=True)
        self._reader.start()

    # ---- the layer files ------------------------------------------------------------------------------

    def _create(self) -> None:
        if (self.root / COMMIT).exists():
            raise CheckpointError(
                f"{self.root} already holds a disk EPS; continue it with trainer.resume=<its run dir>, or set "
                f"eps.path to an empty directory"
            )
        for f in self.files:
            f.create()

    def _adopt(self) -> None:
        """Continue from the state ``commit.json`` names (``trainer.resume``), checking every file first."""
        path = self.root / COMMIT
        if not path.is_file():
            return
        try:
            rec = json.loads(path.read_text())
            layers = rec["layers"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: unreadable commit record ({e})") from e
        if rec.get("format") != FORMAT or len(layers) != len(self.files):
            raise CheckpointError(
                f"{path}: a disk EPS of {len(layers)} layers (format {rec.get('format')}); this model has "
                f"{len(self.files)}: resume with the same model, or set eps.path to an empty directory"
            )
        for f, entry in zip(self.files, layers):
            problem = f.problem()
            if problem is None and entry.get("slot") not in (0, 1):
                problem = f"commit record names slot {entry.get('slot')!r} for layer {f.index}"
            if problem:
                raise CheckpointError(f"{self.root}: {problem}")
        self.latest = [int(e["slot"]) for e in layers]
        self.committed = list(self.latest)
        self.record, self.adopted = rec, True
        self.last_commit_step = rec.get("step")

    def new_layer(
        self, index: int, kind: str, layout: FlatLayout, acc: Accelerator, send_dtype: torch.dtype,
        optim: OptimSettings,
    ) -> DiskLayer:  # fmt: skip
        st = DiskLayer(self, index, kind, layout)
        if self.record is not None:
            st.opt_step = float(self.record["layers"][index]["step"])
        self.layers[index] = st
        return st

    def resume_point(self) -> dict[str, Any] | None:
        """The adopted commit record, if it holds a trainer state to resume with."""
        rec = self.record
        return rec if rec is not None and isinstance(rec.get("trainer"), dict) else None

    # ---- pins (the relay and the EPS) -------------------------------------------------------------------

    def slot_of(self, i: int) -> _Slot | None:
        for s in self.slots:
            if s.layer == i:
                return s
        return None

    def pin(self, i: int, parts: str = "w", *, fresh: bool = False) -> None:
        """Layer i's ``parts`` in RAM until ``unpin`` (``fresh``: the caller overwrites them; nothing is read)."""
        self._pin(i, frozenset(parts), fresh, "relay" if not fresh else None)

    def unpin(self, i: int, after: CopyHandle | None = None) -> None:
        """Done with layer i (``after``: a copy still reading from its buffers; the slot waits for it)."""
        with self.cv:
            s = self._must(i)
            s.pins -= 1
            if after is not None and not after.done():
                s.copies.append(after)
            self.cv.notify_all()

    @contextmanager
    def holding(
        self, i: int, parts: str = "wmv", *, fresh: bool = False, dirty: bool = False
    ) -> Iterator[None]:
        """Layer i's ``parts`` in RAM for the block; ``dirty``: the block changes the state, which is then
        written back (behind the compute) to the slot that does not hold the current version."""
        s = self._pin(i, frozenset(parts), fresh, "update" if dirty else None)
        if dirty and s.writing is not None:  # the last write-back still reads these buffers
            self._wait(s.writing.result)
        ok = False
        try:
            yield
            ok = True
        finally:
            with self.cv:
                if ok and dirty:
                    self._write_back(s, i)
                s.pins -= 1
                self.cv.notify_all()

    def release_grad(self, i: int) -> None:
        """The EPS is done with layer i's gradient for now: unpin it. One not yet applied (L2L updates after
        the whole backward) waits for its update on disk: written out at once when the cache cannot hold
        every layer (so its slot is free by the time the next layer's gradient needs one), else only if the
        slot is taken before the update."""
        with self.cv:
            s = self.slot_of(i)
            if s is None or s.pins <= 0:
                return
            s.pins -= 1
            if self.grad_live[i] and not self.parked[i]:
                if len(self.slots) < len(self.files):
                    s.writing = self._writer.submit(self._park, s, i)  # FIFO: after any earlier write
                    self.parked[i] = True  # a read of it waits for the slot's write (eviction does)
                else:
                    s.g_dirty = True
            self.cv.notify_all()

    def export(self, t: torch.Tensor) -> torch.Tensor:
        """A copy that outlives the pin (the slot is reused for other layers)."""
        return t.clone()

    def _must(self, i: int) -> _Slot:
        s = self.slot_of(i)
        if s is None:
            raise RuntimeError(f"layer {i} is not in the host cache")
        return s

    def _pin(self, i: int, need: frozenset[str], fresh: bool, stream: str | None) -> _Slot:
        hit = self._pin_cached(i, need, fresh, stream)
        if hit is not None:
            return self._settled(hit, fresh)
        d = _Demand(i, need, fresh)
        with self.cv:
            self.stats.misses += 1
            self._demands.append(d)
            self.cv.notify_all()
        self._wait(lambda: self._await(d))
        if d.error is not None:
            raise d.error
        assert d.slot is not None
        return self._settled(d.slot, fresh)

    def _pin_cached(self, i: int, need: frozenset[str], fresh: bool, stream: str | None) -> _Slot | None:
        """Pin layer i if the cache has what is needed (else None: it must be read, or a slot found)."""
        with self.cv:
            if self._closed:
                raise RuntimeError("the disk EPS is closed")
            self._follow(i, need, fresh)
            if stream is not None:
                self._note(stream, i, need)
            s = self.slot_of(i)
            if s is not None and (need <= s.valid or (fresh and not s.busy)):
                if fresh:
                    self._make_fresh(s, i, need - s.valid)
                self.stats.hits += 1
                s.pins += 1
                self._clock += 1
                s.used = self._clock
                self.cv.notify_all()
                return s
            return None

    def _settled(self, s: _Slot, fresh: bool) -> _Slot:
        """A slot about to be overwritten (a new gradient) once its last write (a parked gradient) is out."""
        writing = s.writing
        if fresh and writing is not None:
            self._wait(writing.result)
        return s

    def _await(self, d: _Demand) -> None:
        with self.cv:
            while not d.done:
                self.cv.wait()

    def _wait(self, fn: Any) -> None:
        """Block in ``fn``; on the compute thread that is exposed disk time (``disk_wait``)."""
        t0 = time.perf_counter()
        if threading.get_ident() != self._main:
            try:
                fn()
            finally:
                with self.cv:
                    self.stats.eps_wait_s += time.perf_counter() - t0
            return
        try:
            if self.timer is not None:
                with self.timer("disk_wait"):
                    fn()
            else:
                fn()
        finally:
            with self.cv:
                self.stats.wait_s += time.perf_counter() - t0

    def _make_fresh(self, s: _Slot, i: int, parts: frozenset[str] | set[str]) -> None:
        """Parts the caller is about to overwrite; a layer never written yet starts from zero moments."""
        for p in parts:
            if p in "mv" and self.latest[i] is None:
                s.f32[p].zero_()
            if p == "g":
                self.grad_live[i], self.parked[i], s.g_dirty = True, False, False
        s.valid |= set(parts)

    # ---- read-ahead: the layers the relay and the updates will use next -------------------------------

    def _follow(self, i: int, need: frozenset[str], fresh: bool) -> None:
        """Record this pin in the step's trace and move this thread's place in the last step's trace."""
        main = threading.get_ident() == self._main
        entry = (i, need, fresh, main)
        if not (fresh and "w" in need):  # building or loading the state is not part of a step
            self._trace.append(entry)
        start = self._cursor[main]
        if start is None:
            start = -1
        self._cursor[main] = next(
            (k for k in range(start + 1, len(self._plan)) if self._plan[k] == entry), None
        )

    def _note(self, name: str, i: int, parts: frozenset[str]) -> None:
        prev = self._streams.get(name)
        step = prev.step if prev else 1
        if prev is not None and i != prev.last:
            step = 1 if i > prev.last else -1
        self._clock += 1
        self._streams[name] = _Stream(i, step, parts, name == "relay", self._clock)

    def _walk(self, st: _Stream) -> list[int]:
        """The layers ``st`` uses next. The relay's last layer is on the device already, so its walk starts
        past it, and turns at the ends as L2L's step does: after the head, the backward goes down from the
        layer below it (the head runs forward and backward at once); after the embeddings' backward, the
        next step's forward starts with the embeddings again (they were updated). An update's walk starts
        at the layer being updated (it is held)."""
        n, j, d = len(self.files), st.last, st.step
        seq = [] if st.reflect else [j]
        while len(seq) < len(self.slots):
            nj = j + d
            if not 0 <= nj < n:
                if not st.reflect or n < 2:
                    break
                d = -d
                nj = j + d if d < 0 else j
            j = nj
            seq.append(j)
        return seq

    def _predicted(self) -> list[tuple[int, frozenset[str]]]:
        """The next layers to be used and the parts to read for them (none: a slot for a gradient), most
        urgent first, as many as the cache holds. From the last step's trace while the threads follow it
        (then the cache keeps exactly the layers used soonest, Belady's choice); else by the direction
        each stream walks the layers in."""
        k = len(self.slots)
        want: dict[int, set[str]] = {}
        if self._plan and self._cursor[True] is not None:
            plan = self._plan
            cur = {m: -1 if c is None else c for m, c in self._cursor.items()}
            first = min(cur.values()) + 1
            # the entries after each thread's place, then on into the next step (the trace again)
            this_step = ((True, n) for n in range(first, len(plan)))
            for now, n in itertools.chain(this_step, ((False, n) for n in range(len(plan)))):
                j, parts, fresh, main = plan[n]
                if now and n <= cur[main]:
                    continue
                if j not in want and len(want) == k:
                    break
                want.setdefault(j, set()).update(() if fresh else parts)
        else:
            for st in sorted(self._streams.values(), key=lambda s: -s.clock):
                for j in self._walk(st):
                    want.setdefault(j, set()).update(st.parts)
        return [(j, frozenset(p)) for j, p in list(want.items())[:k]]

    def _readable(self, j: int, parts: frozenset[str]) -> frozenset[str]:
        """What of ``parts`` can be read from disk for layer j now."""
        out = set(parts)
        if self.latest[j] is None:
            out -= set(STATE)
        if not self.parked[j]:
            out.discard("g")
        return frozenset(out)

    def _victim(self, avoid: set[int], later: dict[int, int]) -> _Slot | None:
        """An unpinned slot to reuse: empty, else one nobody will use soon (least recently used, clean
        before one whose gradient must be parked), else the one needed last."""
        free = [s for s in self.slots if s.pins == 0 and not s.busy and s.layer not in avoid]
        if not free:
            return None

        def cost(s: _Slot) -> tuple[int, float]:
            if s.layer is None:
                return (0, 0.0)
            if s.layer not in later:
                return (1 + int(s.g_dirty), float(s.used))
            return (3, -float(later[s.layer]))

        return min(free, key=cost)

    def _bind(self, s: _Slot, i: int, parts: frozenset[str], demand: _Demand | None) -> _Job:
        old = s.layer
        evict = (old, s.copies, s.writing, s.g_dirty and old is not None)
        s.layer, s.valid, s.copies, s.writing, s.g_dirty = i, set(), [], None, False
        s.busy = True
        return _Job(s, i, parts, demand, evict)

    def _next_job(self) -> _Job | None:
        want = self._predicted() if self._failed is None else []
        later = {j: k for k, (j, _) in enumerate(want)}
        for d in list(self._demands):
            s = self.slot_of(d.layer)
            if s is not None:
                if s.busy:
                    continue
                missing = frozenset() if d.fresh else d.need - s.valid
                if not missing:
                    self._grant(d, s)
                    continue
                s.busy = True
                return _Job(s, d.layer, missing, d)
            v = self._victim(set(), later)
            if v is None:
                continue  # every slot pinned: wait for an unpin
            return self._bind(v, d.layer, frozenset() if d.fresh else d.need, d)
        for k, (j, parts) in enumerate(want):
            parts = self._readable(j, parts)
            s = self.slot_of(j)
            if s is not None:
                missing = parts - s.valid
                if missing and not s.busy:
                    s.busy = True
                    return _Job(s, j, missing)
                continue
            v = self._victim({x for x, _ in want[: k + 1]}, {x: p for x, p in later.items() if p > k})
            if v is None:
                return None
            return self._bind(v, j, parts, None)
        return None

    def _grant(self, d: _Demand, s: _Slot) -> None:
        if d.fresh:
            self._make_fresh(s, d.layer, d.need - s.valid)
        s.pins += 1
        self._clock += 1
        s.used = self._clock
        d.slot, d.done = s, True
        self._demands.remove(d)

    def _read_loop(self) -> None:
        while True:
            with self.cv:
                job = None
                while job is None:
                    if self._closed:
                        return
                    job = self._next_job()
                    if job is None:
                        self.cv.wait()
            err: BaseException | None = None
            try:
                self._run(job)
            except BaseException as e:
                err = e
            with self.cv:
                s = job.slot
                s.busy = False
                if err is not None:
                    s.layer, s.valid = None, set()
                    if job.demand is not None:
                        job.demand.error, job.demand.done = err, True
                        self._demands.remove(job.demand)
                    else:
                        self._failed = err  # read-ahead stops; the next demand reports the error
                else:
                    s.valid |= set(job.parts)
                    if job.demand is not None:
                        self._grant(job.demand, s)
                self.cv.notify_all()

    def _run(self, job: _Job) -> None:
        """Evict the slot's previous layer (wait for its device copies and write-back; park a gradient that
        is on no disk yet), then read the wanted parts of the new one."""
        s, i = job.slot, job.layer
        if job.evict is not None:
            old, copies, writing, park = job.evict
            for h in copies:
                while not h.done():
                    time.sleep(5e-5)
            if writing is not None:
                writing.result()
            if park and old is not None:
                self._writer.submit(self._park, s, old).result()
                with self.cv:
                    self.parked[old] = True
        if not job.parts:
            return
        with self.cv:
            if job.demand is None:
                self.stats.ahead += 1
            else:
                self.stats.demand += 1
        if "g" in job.parts and not self.parked[i]:
            raise RuntimeError(f"layer {i}'s gradient is neither in RAM nor parked on disk")
        f = self.files[i]
        fd = self.io.open(f.path)
        try:
            for p in STATE:
                if p in job.parts:
                    self._timed_read(fd, s.mv(p, f.part_bytes), f.offset(self._latest(i), p))
            if "g" in job.parts:
                self._timed_read(fd, s.mv("g", f.part_bytes), f.offset(1 - self._latest(i), "w"))
        finally:
            os.close(fd)
        if "w" in job.parts and s.w_send is not None:
            s.w_send[: f.numel].copy_(s.f32["w"][: f.numel])

    def _latest(self, i: int) -> int:
        with self.cv:
            slot = self.latest[i]
        if slot is None:
            raise RuntimeError(f"layer {i} was never written")
        return slot

    def _timed_read(self, fd: int, mv: memoryview, offset: int) -> None:
        t0 = time.perf_counter()
        self.io.read(fd, mv, offset)
        with self.cv:
            self.stats.read_s += time.perf_counter() - t0
            self.stats.read_bytes += len(mv)

    # ---- write-back and commits (the writer thread, in submission order) ---------------------------------

    def _write_back(self, s: _Slot, i: int) -> None:
        """(Holding the lock.) Queue layer i's new state for the slot of its file that the last commit
        does not name; the state is the newest from now on, on disk once the write is done."""
        prev = self.latest[i]
        if self.committed is not None and prev != self.committed[i]:
            raise RuntimeError(
                f"layer {i} was updated twice between commits; the committed copy would be lost"
            )
        target = 0 if prev is None else 1 - prev
        parts = "w" if prev is None else STATE  # a new file's moments are zeros already (fallocate)
        self.latest[i], self.parked[i], self.grad_live[i], s.g_dirty = target, False, False, False
        s.valid.discard("g")  # applied: what is left in g is no gradient to keep
        s.writing = self._writer.submit(self._write, s, i, target, parts)

    def _write(self, s: _Slot, i: int, target: int, parts: str) -> None:
        f = self.files[i]
        t0 = time.perf_counter()
        fd = self.io.open(f.path)
        try:
            for k, p in enumerate(parts):
                self.io.write(fd, s.mv(p, f.part_bytes), f.offset(target, p))
                if k == 0:
                    _crash_point("write")  # a torn slot: w written, the moments not yet
            self.io.sync(fd, f.offset(target, parts[0]), len(parts) * f.part_bytes)
        finally:
            os.close(fd)
        with self.cv:
            self.stats.write_s += time.perf_counter() - t0
            self.stats.write_bytes += len(parts) * f.part_bytes

    def _park(self, s: _Slot, i: int) -> None:
        """Layer i's gradient to disk until its update: into the slot of its file the update will write."""
        f = self.files[i]
        t0 = time.perf_counter()
        fd = self.io.open(f.path)
        try:
            target = 1 - self._latest(i)
            self.io.write(fd, s.mv("g", f.part_bytes), f.offset(target, "w"))
            _crash_point("park")
            self.io.sync(fd, f.offset(target, "w"), f.part_bytes)
        finally:
            os.close(fd)
        with self.cv:
            self.stats.parks += 1
            self.stats.write_s += time.perf_counter() - t0
            self.stats.write_bytes += f.part_bytes

    def commit(self, step: int, trainer_state: dict[str, Any], ident: dict[str, Any] | None = None) -> None:
        """Make the state after ``step`` the one a restart finds: once the writes queued so far are on
        disk, ``commit.json`` is replaced atomically (write, fsync, rename, fsync the directory)."""
        if self._commit_job is not None and self._commit_job.done():
            self._commit_job.result()  # a failed commit surfaces here
        with self.cv:
            if any(x is None for x in self.latest):
                raise RuntimeError("commit before every layer was written")
            self.committed = list(self.latest)
            layers = [
                {"slot": self.latest[i], "step": self.layers[i].opt_step} for i in range(len(self.files))
            ]
        record = {"format": FORMAT, "step": step, "created": time.time(), **(ident or {}), "layers": layers,
                  "trainer": trainer_state}  # fmt: skip
        self._commit_job = self._writer.submit(self._write_record, record)
        self.commits += 1
        self.last_commit_step = step

    def _write_record(self, record: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        tmp = self.root / f".{COMMIT}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        _crash_point("commit")  # the new record written, not yet in place
        os.replace(tmp, self.root / COMMIT)
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        with self.cv:
            self.stats.write_s += time.perf_counter() - t0

    def restore(self, st: DiskLayer) -> None:
        """L2L-p's undo: read back the pre-update state, which the update did not overwrite on disk."""
        i = st.index
        with self.holding(i, STATE):
            s = self._must(i)
            if s.writing is not None:
                self._wait(s.writing.result)
            f = self.files[i]
            undo = st.undo_slot
            if undo is None:
                raise RuntimeError(f"layer {i} has no pre-update state to restore")

            def read() -> None:
                fd = self.io.open(f.path)
                try:
                    for p in STATE:
                        self._timed_read(fd, s.mv(p, f.part_bytes), f.offset(undo, p))
                finally:
                    os.close(fd)

            self._wait(read)
            with self.cv:
                self.latest[i] = undo
            st.opt_step = st.undo_step
            st.refresh_send()

    # ---- reporting and shutdown ---------------------------------------------------------------------------

    def host_parts(self) -> dict[str, int]:
        return {"eps_cache": sum(s.nbytes for s in self.slots)}

    def pop_step(self, timer: PhaseTimer, training: bool = True) -> dict[str, float]:
        """This step's disk I/O: background read/write seconds join the phases (``disk_wait``, the exposed
        part, is timed where it happens); bytes go to the step's metrics. A training step's trace of pins
        becomes the read-ahead plan of the next (``training=False``: an evaluation; not a plan)."""
        with self.cv:
            st, self.stats = self.stats, IoStats()
            self._streams.pop("update", None)
            if training and self._trace:
                self._plan = self._trace
            self._trace = []
            self._cursor = {True: -1, False: -1}
            self.totals.add(st)
        timer.add("disk_read", st.read_s)
        timer.add("disk_write", st.write_s)
        return {
            "disk_read_bytes": float(st.read_bytes), "disk_write_bytes": float(st.write_bytes),
            "disk_reads_ahead": float(st.ahead), "disk_reads_on_demand": float(st.demand),
            "disk_cache_hits": float(st.hits), "disk_cache_misses": float(st.misses),
        }  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """summary.json's ``eps_disk``: where, how much, how fast, and how much of it compute hid."""
        with self.cv:
            t = IoStats()
            t.add(self.totals)
            t.add(self.stats)
        io_s = t.read_s + t.write_s
        return {
            "path": str(self.root),
            "host_cache_layers": len(self.slots),
            "direct_io": self.io.direct,
            "file_bytes": sum(f.size for f in self.files),
            "read_bytes": t.read_bytes,
            "write_bytes": t.write_bytes,
            "read_s": t.read_s,
            "write_s": t.write_s,
            "read_gbps": t.read_bytes / t.read_s / 1e9 if t.read_s else None,
            "write_gbps": t.write_bytes / t.write_s / 1e9 if t.write_s else None,
            "wait_s": t.wait_s,
            "eps_thread_wait_s": t.eps_wait_s,
            "reads_ahead": t.ahead,
            "reads_on_demand": t.demand,
            "cache_hits": t.hits,
            "cache_misses": t.misses,
            "gradients_parked": t.parks,
            "hidden_share": max(0.0, min(1.0, 1.0 - t.wait_s / io_s)) if io_s else None,
            "commits": self.commits,
            "last_commit_step": self.last_commit_step,
        }

    def close(self) -> None:
        with self.cv:
            self._closed = True
            self.cv.notify_all()
        self._reader.join(timeout=60)
        self._writer.shutdown(wait=True)
        try:
            if self._commit_job is not None:
                self._commit_job.result()
        finally:
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)


# ---- the disk itself ------------------------------------------------------------------------------------


def measure_disk(root: Path, nbytes: int) -> dict[str, Any]:
    """Sequential write then read bandwidth of ``root``'s filesystem, the way the disk tier does its I/O
    (O_DIRECT where allowed, 64 MiB calls, fdatasync): a dd-style measurement of the same disk. Writes a
    temporary file of ``nbytes`` (rounded to 4 KiB) and removes it."""
    root.mkdir(parents=True, exist_ok=True)
    nbytes = max(ALIGN, _round(nbytes))
    io = _Io(probe_direct(root))
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
