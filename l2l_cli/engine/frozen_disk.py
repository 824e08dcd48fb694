"""The frozen base on disk (``peft.base_source=disk``): each layer's base, in its stored precision, is one
safetensors file written once as the layer is built (or loaded from a checkpoint), then read back whenever
the relay needs the layer, a couple of layers ahead on a thread of its own. Nothing of the base is ever
written back, and at most ``ahead + 1`` layers of it are in RAM at once, so resident memory stays flat in
the model's depth.

Each file's checksum (xxh3, 64 bits, as the disk tier's slots: ``engine/tiers/disk/format.py``) is taken
from its bytes as they are written and checked on every read, on the reader's thread, before a tensor is
made of them: a file changed or corrupted on disk stops the run in one line naming it (a CheckpointError,
exit 2), before anything computes with it, and the run's checkpoints stay as they were.

Once every layer is stored, ``frozen_base.json`` lists the files, their checksums and what they encode
(``key``: the base checkpoint's files by hash, ``peft.base_dtype``, the model and its frozen tensors, and
the seed where a tensor was built from it). A later run on the same folder whose key matches adopts the
files as they are (``reused``) instead of encoding the base again: a resume, or a new run given the same
``eps.path``. The list is removed before any file is rewritten and when a file fails its checksum, so a
list on disk always describes whole, intact files, and a damaged base is encoded afresh at the next start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash
from safetensors.torch import load, save

from l2l_cli.checkpoint import CheckpointError
from l2l_cli.problems import WriteFailed, writing

log = logging.getLogger("l2l")

DIR = "frozen_base"  # the base's folder under eps.path (engine/eps.py places it)
LIST = "frozen_base.json"  # the files of a whole encoded base and what they encode
FORMAT = 1


def remove_encoded(eps_path: str | Path | None) -> None:
    """The encoded base under ``eps_path`` removed (a finished run's, unless ``peft.keep_encoded_base``)."""
    if eps_path is None or not (Path(eps_path) / DIR).is_dir():
        return
    shutil.rmtree(Path(eps_path) / DIR, ignore_errors=True)
    log.info("removed the encoded frozen base in %s (peft.keep_encoded_base=false)", Path(eps_path) / DIR)
    with contextlib.suppress(OSError):
        Path(eps_path).rmdir()  # the folder it was alone in (a disk EPS's files stay)


class DiskSource:
    """Layer files under ``root`` (a temporary folder when None, removed at ``close``)."""

    def __init__(self, root: Path | None, make: Any, key: dict[str, Any] | None = None, ahead: int = 2):
        """``make(how, shape)``: an empty stored tensor (engine/frozen.py's ``Frozen``, passed in so the two
        modules do not import each other). ``key``: what the files must encode to be reused (with a seed,
        which counts only where the stored base was built from one)."""
        self.make = make
        self.own = root is None
        self.root = Path(tempfile.mkdtemp(prefix="l2l-base-")) if root is None else root
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # (the config's check names eps.path first; this is the race after it)
            raise WriteFailed(self.root, e.errno or 0, e.strerror or str(e)) from e
        self.ahead = ahead
        self.meta: dict[int, dict[str, tuple[str, tuple[int, ...]]]] = {}  # layer -> name -> (how, shape)
        self.sums: dict[int, int] = {}  # layer -> its file's xxh3, taken as it was written
        self.key = json.loads(json.dumps(key)) if key is not None else None  # as the list holds it
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l2l-base-read")
        self.pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._last = -1
        self.bytes_read = 0
        self.reads = 0
        self.writes = 0  # layer files written (0 for a base reused as it was)
        self.reused = not self.own and self.key is not None and self._adopt()

    def path(self, i: int) -> Path:
        return self.root / f"base_{i}.safetensors"

    # ---- the list of a whole base, and its reuse ---------------------------------------------------------

    def _adopt(self) -> bool:
        """Take the files of an earlier run if its list matches ``key`` and every file is there at its size
        (their contents are checked as they are read); else drop the list: the base is encoded afresh."""
        path = self.root / LIST
        try:
            listed = json.loads(path.read_text())
            have, want = dict(listed["key"]), dict(self.key or {})
            seeds = have.pop("seed", None), want.pop("seed", None)
            layers = {int(i): e for i, e in listed["layers"].items()}
            ok = (
                listed["format"] == FORMAT
                and have == want
                and (not listed["seeded"] or seeds[0] == seeds[1])
                and bool(layers)
                and all(self.path(i).stat().st_size == e["bytes"] for i, e in layers.items())
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:
            self._unlist()
            return False
        for i, e in layers.items():
            self.sums[i] = int(e["xxh3"], 16)
            self.meta[i] = {name: (how, tuple(shape)) for name, (how, shape) in e["tensors"].items()}
        return True

    def seal(self, seeded: bool) -> None:
        """Every layer is stored: write the list that lets a later run reuse the files (``seeded``: some
        tensor was built from the seed, which must then match too)."""
        if self.own or self.key is None:
            return
        layers = {
            str(i): {
                "bytes": os.path.getsize(self.path(i)),
                "xxh3": f"{self.sums[i]:016x}",
                "tensors": {name: [how, list(shape)] for name, (how, shape) in self.meta[i].items()},
            }
            for i in sorted(self.meta)
        }
        body = {"format": FORMAT, "key": self.key, "seeded": seeded, "layers": layers}
        tmp = self.root / f"{LIST}.tmp"
        with writing(tmp), open(tmp, "w") as f:
            f.write(json.dumps(body, indent=1))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.root / LIST)

    def _unlist(self) -> None:
        with contextlib.suppress(OSError):  # a read-only folder: the write that follows says so
            (self.root / LIST).unlink(missing_ok=True)

    # ---- the layer files --------------------------------------------------------------------------------

    def write(self, i: int, layer: dict[str, Any]) -> None:
        """Layer i's stored tensors to its file (the build, or a checkpoint's tensors re-encoded)."""
        with self._lock:
            self.pending.pop(i, None)
        self._unlist()  # the list describes whole bases only
        self.reused = False
        tensors = {f"{name}::{k}": t.contiguous() for name, f in layer.items() for k, t in f.parts.items()}
        data = save(tensors)
        tmp = self.path(i).with_suffix(".tmp")
        try:
            with writing(tmp), open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(self.path(i))
        except WriteFailed:
            raise
        except OSError as e:  # a read-only or vanished folder: one line naming the file, not a traceback
            raise WriteFailed(tmp, e.errno or 0, e.strerror or str(e)) from e
        self.sums[i] = xxhash.xxh3_64_intdigest(data)
        self.meta[i] = {name: (f.how, f.shape) for name, f in layer.items()}
        self.writes += 1

    def read(self, i: int) -> dict[str, Any]:
        """Layer i's stored tensors, read now (outside the read-ahead's order)."""
        return self._read(i)

    def _read(self, i: int) -> dict[str, Any]:
        """Layer i's file, checked against the checksum it was written with (on the calling thread: the
        reader's, for a read ahead)."""
        path = self.path(i)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{path}: unreadable frozen base layer file ({e.strerror or e})") from e
        if xxhash.xxh3_64_intdigest(data) != self.sums.get(i):
            self._unlist()  # the next start encodes the base afresh
            raise CheckpointError(
                f"{path}: checksum mismatch in the frozen base's layer {i}: the file was changed or the "
                "disk corrupted it; it was not trained on (resume from the last checkpoint: the base is "
                "encoded afresh)"
            )
        raw = load(data)
        del data
        out = {name: self.make(how, shape) for name, (how, shape) in self.meta[i].items()}
        n = 0
        for key, t in raw.items():
            name, _, part = key.rpartition("::")
            out[name].parts[part] = t
            n += t.nbytes
        with self._lock:
            self.bytes_read += n
            self.reads += 1
        return out

    def prefetch(self, i: int) -> None:
        with self._lock:
            if i in self.pending or i not in self.meta:
                return
            self.pending[i] = self.pool.submit(self._read, i)

    def layer(self, i: int) -> dict[str, Any]:
        """Layer i's stored tensors: read ahead already, or read now; the next layers in the direction the
        passes are going are read ahead."""
        with self._lock:
            job = self.pending.pop(i, None)
            step = 1 if i >= self._last else -1
            self._last = i
            for j in list(self.pending):  # read-ahead the other way is of no use now
                if (j - i) * step < 0:
                    self.pending.pop(j)
        got = job.result() if job is not None else self._read(i)
        for k in range(1, self.ahead + 1):
            self.prefetch(i + k * step)
        return got

    def host_bytes(self) -> int:
        """Bytes of the base in RAM: none kept, beyond the layers in flight (not counted)."""
        return 0

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.pending.clear()
        if self.own:
            shutil.rmtree(self.root, ignore_errors=True)
