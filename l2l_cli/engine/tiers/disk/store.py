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
from l2l_cli.engine.tiers.disk.format import COMMIT, FORMAT, STATE, DiskIo, LayerFile, probe_direct
from l2l_cli.engine.tiers.disk.pool import GradPool
from l2l_cli.engine.tiers.disk.stats import IoCounts
from l2l_cli.models.base import ModelSpec


class LayerStore:
    """One file per layer in ``settings.path`` (else a temporary directory), and each layer's place in it.
    ``latest``, ``committed``, ``parked`` and ``grad_live`` are guarded by the tier's lock ``cv``."""

    def __init__(
        self, settings: TierSettings, spec: ModelSpec, layouts: dict[str, FlatLayout], cv: threading.Condition,
        counts: IoCounts,
    ):  # fmt: skip
        self._tmp = None if settings.path else tempfile.mkdtemp(prefix="l2l-eps-")
        self.root = Path(settings.path or self._tmp or ".")
        self.root.mkdir(parents=True, exist_ok=True)
        self.cv, self.counts = cv, counts
        n = spec.num_all_layers
        kinds = [spec.kind(i) for i in range(n)]
        self.files = [LayerFile(self.root, i, kinds[i], layouts[kinds[i]].numel) for i in range(n)]
        self.io = DiskIo(probe_direct(self.root))
        self.latest: list[int | None] = [None] * n  # the file slot holding each layer's newest version
        self.committed: list[int | None] | None = None  # what commit.json names (None: no commit yet)
        self.parked = [False] * n  # the layer's gradient waits on disk (the slot the update will write)
        self.grad_live = [False] * n  # the cache's g holds this step's gradient, not yet applied
        self.w_seen: set[int] = set()  # layers whose weights were read this step (for the byte breakdown)
        self.pool = GradPool(settings.grad_ram_bytes)  # gradients waiting in RAM instead of on disk
        self.adopted = False
        self.record: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.files)

    # ---- a new state, or the one committed before ---------------------------------------------------

    def create(self) -> None:
        if (self.root / COMMIT).exists():
            raise CheckpointError(
                f"{self.root} already holds a disk EPS; continue it with trainer.resume=<its run dir>, or set "
                f"eps.path to an empty directory"
            )
        for f in self.files:
            f.create()

    def adopt(self) -> None:
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

    # ---- where a layer's parts are --------------------------------------------------------------------

    def newest(self, i: int) -> int:
        """The file slot holding layer i's newest version."""
        with self.cv:
            slot = self.latest[i]
        if slot is None:
            raise RuntimeError(f"layer {i} was never written")
        return slot

    def readable(self, j: int, parts: frozenset[str]) -> frozenset[str]:
        """What of ``parts`` can be read from disk for layer j now."""
        out = set(parts)
        if self.latest[j] is None:
            out -= set(STATE)
        if not self.parked[j]:
            out.discard("g")
        return frozenset(out)

    def make_fresh(self, s: CacheSlot, i: int, parts: frozenset[str] | set[str]) -> None:
        """(Holding the lock.) Parts the caller is about to overwrite; a layer never written yet starts from
        zero moments."""
        for p in parts:
            if p in "mv" and self.latest[i] is None:
                s.f32[p].zero_()
            if p == "g":
                self.grad_live[i], self.parked[i], s.g_dirty = True, False, False
                self.pool.live.discard(i)
        s.valid |= set(parts)

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
