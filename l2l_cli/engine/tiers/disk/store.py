"""The disk tier's layer files and what each holds: which of a file's two slots has the layer's newest
version, which one the last commit names, whether a gradient is parked in the other.

An update is written to the slot that does not hold the layer's current version; ``commit.json`` names each
layer's current slot. A ``kill -9`` at any point therefore leaves every layer readable at the last committed
step. The slot that does not hold the current version doubles as L2L-p's undo log (the pre-update state is
still on disk) and, in L2L, as the place a layer's gradient waits for the update (it is *parked*).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from l2l_cli.checkpoint import CheckpointError
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.tiers.base import TierSettings
from l2l_cli.engine.tiers.disk.cache import CacheSlot
from l2l_cli.engine.tiers.disk.format import (
    COMMIT,
    FORMAT_SPLIT,
    FORMAT_STATE,
    FORMATS,
    STATE,
    DiskIo,
    LayerFile,
    Piece,
    digest,
    format_of,
    join_master,
    probe_direct,
    record_digest,
)
from l2l_cli.engine.tiers.disk.pool import GradPool
from l2l_cli.engine.tiers.disk.spill import KeptGrads
from l2l_cli.engine.tiers.disk.stats import IoCounts
from l2l_cli.models.base import ModelSpec


class LayerStore:
    """One file per layer in ``settings.path`` (else a temporary directory), and each layer's place in it.
    ``latest``, ``committed``, ``parked`` and ``grad_live`` are guarded by the tier's lock ``cv``."""

    def __init__(
        self,
        settings: TierSettings,
        spec: ModelSpec,
        layouts: dict[str, FlatLayout],
        cv: threading.Condition,
        counts: IoCounts,
        split: bool = False,
        pieces: dict[str, dict[str, list[Piece]]] | None = None,
    ):
        self._tmp = None if settings.path else tempfile.mkdtemp(prefix="l2l-eps-")
        self.root = Path(settings.path or self._tmp or ".")
        self.root.mkdir(parents=True, exist_ok=True)
        self.cv, self.counts = cv, counts
        n = spec.num_all_layers
        kinds = [spec.kind(i) for i in range(n)]
        # format 2 (the master in bf16 hi / lo planes) where the device computes in bf16; a run resumed from
        # a format-1 directory keeps format 1 (``adopt``)
        self.split, self.can_split = split, split
        # format 3 (8-bit AdamW): each kind's state buffers in its moment parts (None: FP32 moments)
        self.pieces = pieces
        self.files = [
            LayerFile(self.root, i, k, layouts[k].numel, split, pieces[k] if pieces else None)
            for i, k in enumerate(kinds)
        ]
        self.io = DiskIo(probe_direct(self.root))
        self.latest: list[int | None] = [None] * n  # the file slot holding each layer's newest version
        self.committed: list[int | None] | None = None  # what commit.json names (None: no commit yet)
        self.parked = [False] * n  # the layer's gradient waits on disk (the slot the update will write)
        self.grad_live = [False] * n  # the cache's g holds this step's gradient, not yet applied
        # per layer and file slot, the checksum of each part as last written (``g``: a parked gradient);
        # every read of a part whose checksum is known is checked against it (empty: not known)
        self.sums: list[tuple[dict[str, int], dict[str, int]]] = [({}, {}) for _ in range(n)]
        self.w_seen: set[int] = set()  # layers whose weights were read this step (for the byte breakdown)
        # gradients waiting in RAM instead of on disk, for at most eps.grad_ram_layers layers at a time
        self.pool = GradPool(
            settings.grad_ram_bytes, min(settings.grad_ram_layers, n), [f.numel for f in self.files]
        )
        # speculatively applied gradients kept for a redo that the pool has no room for (``kept_on_disk``)
        self.kept = KeptGrads(self.root, [f.part_bytes for f in self.files])
        self.kept_on_disk = [False] * n
        self.resumed = False
        self.record: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.files)

    # ---- a new state, or the one committed before ---------------------------------------------------

    def create(self) -> None:
        if (self.root / COMMIT).exists():
            raise CheckpointError(
                f"{self.root} already holds a disk EPS; continue it with trainer.resume=<its run dir>, "
                f"or set eps.path to an empty directory"
            )
        for f in self.files:
            f.create()

    def load_committed(self) -> None:
        """Continue from the state ``commit.json`` names (``trainer.resume``), checking every file first."""
        path = self.root / COMMIT
        if not path.is_file():
            return
        try:
            rec = json.loads(path.read_text())
            layers = rec["layers"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: unreadable commit record ({e})") from e
        if "checksum" in rec and rec["checksum"] != record_digest(rec):  # (records before checksums: none)
            raise CheckpointError(
                f"{path}: the commit record does not match its checksum (edited or corrupted); nothing was "
                f"trained on it"
            )
        fmt = rec.get("format")
        if fmt not in FORMATS or len(layers) != len(self.files):
            raise CheckpointError(
                f"{path}: a disk EPS of {len(layers)} layers (format {fmt}); this model has "
                f"{len(self.files)} (format {', '.join(map(str, FORMATS))}): resume with the same model and "
                f"l2l, or set eps.path to an empty directory"
            )
        if (fmt == FORMAT_STATE) != bool(self.pieces):
            held, run = ("8-bit", "FP32") if fmt == FORMAT_STATE else ("FP32", "8-bit")
            raise CheckpointError(
                f"{path}: a disk EPS of {held} AdamW moments (format {fmt}); this run's optimizer keeps "
                f"{run} ones: resume it with the optim.name it was written with, or set eps.path to an empty "
                "directory"
            )
        if fmt == FORMAT_SPLIT and not self.can_split:
            raise CheckpointError(
                f"{path}: a disk EPS in format {FORMAT_SPLIT} (bf16 CMP: the master as bf16 + 16-bit "
                f"planes); resume it with precision=cmp precision.dtype=bf16, or set eps.path to an empty "
                f"directory"
            )
        self.split = fmt == FORMAT_SPLIT  # a format-1 directory is read as it is (FP32 weights)
        self.files = [
            LayerFile(self.root, f.index, f.kind, f.numel, self.split, f.pieces) for f in self.files
        ]
        for f, entry in zip(self.files, layers):
            problem = f.problem()
            if problem is None and entry.get("slot") not in (0, 1):
                problem = f"commit record names slot {entry.get('slot')!r} for layer {f.index}"
            if problem:
                raise CheckpointError(f"{self.root}: {problem}")
        self.latest = [int(e["slot"]) for e in layers]
        for i, e in enumerate(layers):
            sums = e.get("sums") if isinstance(e.get("sums"), dict) else {}
            self.sums[i][self.latest[i]].update({p: int(str(h), 16) for p, h in sums.items()})
        self.committed = list(self.latest)
        self.record, self.resumed = rec, True

    @property
    def format(self) -> int:
        """The files' format (the commit record names it): 1 FP32, 2 bf16 planes, 3 8-bit AdamW's state."""
        return format_of(self.split, self.pieces)

    # ---- where a layer's parts are --------------------------------------------------------------------

    def newest(self, i: int) -> int:
        """The file slot holding layer i's newest version."""
        with self.cv:
            slot = self.latest[i]
        if slot is None:
            raise RuntimeError(f"layer {i} was never written")
        return slot

    def expand(self, parts: frozenset[str]) -> frozenset[str]:
        """The parts a pin of ``parts`` reads: under format 2 the master, m and v come together (the master's
        tie bits are in v's sign bits, and an update needs all three anyway)."""
        if self.split and parts & set(STATE):
            return parts | set(STATE)
        return parts

    def readable(self, j: int, parts: frozenset[str]) -> frozenset[str]:
        """What of ``parts`` can be read from disk for layer j now."""
        out = set(parts)
        if self.latest[j] is None:
            out -= {*STATE, "h"}
        if not self.parked[j]:
            out.discard("g")
        return frozenset(out)

    def make_fresh(self, s: CacheSlot, i: int, parts: frozenset[str] | set[str]) -> None:
        """(Holding the lock.) Parts the caller is about to overwrite (the slot table's ``fresh`` marks them
        current): a layer never written yet starts from zero moments; a new gradient is live, neither
        parked nor kept anywhere."""
        for p in parts:
            if p in "mv" and self.latest[i] is None:
                s.f32[p].zero_()  # (the whole part: FP32 moments, or 8-bit codes, absmaxes and FP32 ones)
            if p == "g":
                self.grad_live[i], self.parked[i] = True, False
                self.kept_on_disk[i] = False
                self.pool.drop(i)

    def read_state(self, fd: int, s: CacheSlot, i: int, slot: int, parts: list[str], what: str) -> None:
        """Layer i's ``parts`` (of ``h`` and STATE) from file slot ``slot`` into cache slot ``s``. Format 2:
        ``h`` into the send copy; ``w`` is read as its lo plane (and hi, unless the send copy holds it) and
        joined, with ``v`` (required with it, see :meth:`expand`); FP32 weights are converted to the send
        copy here (the send copy is what the device loads)."""
        f = self.files[i]
        if not self.split:
            for p in STATE:
                if p in parts:
                    self.read_part(fd, s.mv(p, f.nbytes(p)), i, slot, p, what)
            if "w" in parts and s.w_send is not None:
                s.w_send[: f.numel].copy_(s.f32["w"][: f.numel])
            return
        w = "w" in parts
        assert w or "v" not in parts, "format 2: v is read with the master (its tie marks are cleared then)"
        need = [
            p for p in f.parts if p in parts or (w and p == "l") or (w and p == "h" and "h" not in s.valid)
        ]
        for p in need:
            self.read_part(fd, s.mv(p, f.nbytes(p)), i, slot, p, what)
        if "w" in parts:
            assert s.w_send is not None and s.lo is not None and "v" in parts
            n = f.numel
            join_master(s.w_send[:n], s.lo[:n], s.f32["v"][:n], s.f32["w"][:n])

    def read_part(self, fd: int, mv: memoryview, i: int, slot: int, part: str, what: str) -> None:
        """Part ``part`` of layer i's file slot ``slot`` (``g``: the gradient parked there), checked against
        the checksum it was written with: a part that does not match is refused naming the file, before
        anything computes with it."""
        f = self.files[i]
        self.read(fd, mv, f.park_offset(slot) if part == "g" else f.offset(slot, part), what)
        with self.cv:
            want = self.sums[i][slot].get(part)
        if want is not None and digest(mv) != want:
            raise CheckpointError(
                f"{f.path}: checksum mismatch in slot {slot} ({part}) of layer {i}: the file was changed or "
                f"the disk corrupted it; it was not trained on (resume from a checkpoint, or start afresh)"
            )

    def read(self, fd: int, mv: memoryview, offset: int, what: str) -> None:
        """One read, counted in the step's I/O (``what``: what it is for, a key of ``stats.READS``)."""
        t0 = time.perf_counter()
        self.io.read(fd, mv, offset)
        with self.cv:
            st = self.counts.step
            st.read_s += time.perf_counter() - t0
            st.read_bytes += len(mv)
            setattr(st, f"read_{what}", getattr(st, f"read_{what}") + len(mv))

    def weights_read(self, i: int) -> str:
        """(Holding the lock.) What a read of layer i's weights alone is for: the step's first read of
        them is the forward's, a later one the backward's."""
        if i in self.w_seen:
            return "bwd"
        self.w_seen.add(i)
        return "fwd"

    @property
    def file_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def remove_temporary(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
