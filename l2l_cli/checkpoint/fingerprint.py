"""The fingerprint of the checkpoint a LoRA run's frozen base comes from (``model.pretrained``): an adapter
means nothing without the exact base it was trained on, so a run records its base's fingerprint (in every
checkpoint's manifest, in ``final/`` and ``best/``, in summary.json's ``peft`` section) and what reads the
adapter back (a resume, ``l2l eval``/``predict``/``generate``/``export``) refuses a base that differs.

Method: each file the base is loaded from (``config.json`` and the weights: ``model.safetensors``, or the
shard index and its shards, or ``pytorch_model.bin``) by name, size and xxh3-128 of its bytes. Whole files,
not tensor digests: one sequential read at disk speed (xxh3 hashes several GB/s a core, faster than the
disk reads), independent of any family's tensor names, and it catches every change, a header's or a
tensor's; the line that refuses names the file. A command hashes the base once (the same files within
one process are not hashed twice unless they changed: size, mtime, ctime and inode are its key).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import xxhash

from l2l_cli.checkpoint.manifest import CheckpointError

FINGERPRINT_FILE = "base_fingerprint.json"  # beside a LoRA run's adapter (final/, best/)
METHOD = "xxh3_128 of each file"
_CHUNK = 8 << 20
_SEEN: dict[tuple[str, int, int, int, int], str] = {}  # (path, size, mtime, ctime, inode) -> digest


def file_digest(path: Path) -> str:
    """xxh3-128 of a file's bytes (once per process for an unchanged file)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if key not in _SEEN:
        h = xxhash.xxh3_128()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        _SEEN[key] = h.hexdigest()
    return _SEEN[key]


def fingerprint(ref: str, files: list[Path]) -> dict[str, Any]:
    """The fingerprint of a checkpoint given as ``ref`` (what the user wrote) whose base is read from
    ``files``: ``{"pretrained", "method", "files": {name: {"bytes", "xxh3_128"}}}``."""
    return {
        "pretrained": ref,
        "method": METHOD,
        "files": {p.name: {"bytes": os.path.getsize(p), "xxh3_128": file_digest(p)} for p in files},
    }


def recorded(path: Path, manifest: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The base fingerprint recorded with the weights in ``path``: a checkpoint's (its ``manifest``), or an
    adapter directory's file (None: none recorded)."""
    if manifest is not None:
        return manifest.get("base")
    file = path / FINGERPRINT_FILE
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: unreadable ({e})") from e
