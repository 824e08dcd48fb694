"""What a checkpoint is: its manifest (format, identity, every file's size and checksum), the checks before
anything is read (well formed, intact, the same model shape, state layout and optimizer), and reading a
file of it checked against the manifest."""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load

FORMAT = 1
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class CheckpointError(Exception):
    """A checkpoint that cannot be used (corrupt, truncated, tampered with, or for another model/mode)."""


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


def identity(model: Any, mode: Any, optimizer: str) -> dict[str, Any]:
    """What must match for a checkpoint to load: the model's family and shape (``ModelSpec.identity``), the
    mode's state layout (``ModeSpec.state_layout``: modes sharing one resume each other's) and optimizer;
    and a LoRA model's ``base``, the fingerprint of its frozen base (:func:`check_base`)."""
    out = {
        "model": model.identity(),
        "family": model.family,
        "state_layout": mode.state_layout,
        "optimizer": optimizer,
        "mode": mode.name,
    }
    base = model.base_fingerprint()
    if base is not None:
        out["base"] = base
    return out


def check_identity(
    ckpt: Path, manifest: dict[str, Any], want: dict[str, Any], allow_base_change: bool = False
) -> None:
    """The checkpoint's model shape, state layout and optimizer are ``want``'s, and a LoRA adapter's base
    is the one it was trained on (unless ``allow_base_change``: ``peft.allow_base_change``)."""
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
            f"{ckpt} holds mode={manifest.get('mode')}'s state layout ({manifest.get('state_layout')}); "
            "this run is "
            f"mode={want['mode']} ({want['state_layout']}): resume with a mode of the same family"
        )
    if manifest.get("optimizer") != want["optimizer"]:
        raise CheckpointError(
            f"{ckpt} holds {manifest.get('optimizer')} state; this run uses optim={want['optimizer']}"
        )
    if not allow_base_change:
        check_base(manifest.get("base"), want.get("base"), ckpt)


class BaseChanged(CheckpointError):
    """The base under ``model.pretrained`` is not the one a LoRA adapter was trained on."""


def differences(then: dict[str, Any], now: dict[str, Any] | None) -> list[str]:
    """What differs between the recorded fingerprint ``then`` and ``now`` (None: no base now), one phrase
    each; the place of the checkpoint does not count, only its files."""
    if now is None:
        return [f"this run has no model.pretrained; the adapter was trained on {then.get('pretrained')}"]
    a, b = then.get("files", {}), now.get("files", {})
    out = [f"{n}: missing now" for n in sorted(a) if n not in b]
    out += [f"{n}: not in the base the adapter was trained on" for n in sorted(b) if n not in a]
    for n in sorted(set(a) & set(b)):
        if a[n].get("bytes") != b[n].get("bytes"):
            out.append(f"{n}: {a[n].get('bytes')} bytes when trained, {b[n].get('bytes')} now")
        elif a[n].get("xxh3_128") != b[n].get("xxh3_128"):
            was, new = a[n].get("xxh3_128"), b[n].get("xxh3_128")
            out.append(f"{n}: its contents differ (xxh3-128 {was} when trained, {new} now)")
    return out


def check_base(then: dict[str, Any] | None, now: dict[str, Any] | None, where: Path | str) -> None:
    """Refuse (:class:`BaseChanged`) a base ``now`` (checkpoint/fingerprint.py) whose files differ from
    ``then``, the fingerprint recorded with the adapter in ``where`` (None: recorded before fingerprints,
    or a base built from the seed)."""
    if then is None:
        return
    diff = differences(then, now)
    if diff:
        more = f" (and {len(diff) - 2} more)" if len(diff) > 2 else ""
        ref = now.get("pretrained") if now is not None else None
        raise BaseChanged(
            f"{ref or '(none)'} is not the base {where} was trained on: {'; '.join(diff[:2])}{more}; "
            "give the run's base, or peft.allow_base_change=true to use this one anyway"
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
