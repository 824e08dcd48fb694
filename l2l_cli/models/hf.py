"""Hugging Face weights in: a checkpoint (safetensors, one file or shards, or a legacy ``pytorch_model.bin``)
streamed tensor by tensor into whatever holds the model (a runner: the device, the eager param-server or a
pipeline's stages), through its ``load_hf(tensors) -> missing names``.

Reading a checkpoint is the model's business, not the run's: the files and names are the family's, while
where each tensor lands is the runner's, so the runner comes in as a duck-typed ``HFLoader``.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

import torch

from l2l_cli.checkpoint import CheckpointError
from l2l_cli.models.registry import resolve_pretrained

log = logging.getLogger("l2l")

SHARD_INDEX = "model.safetensors.index.json"  # a checkpoint saved in shards (7B and larger)


class HFLoader(Protocol):
    """What takes a checkpoint's tensors by Hugging Face name (every runner)."""

    def load_hf(self, tensors: Any) -> list[str]:
        """Copy in the tensors it knows; returns the names it left at their initialization."""
        ...


def load_pretrained(runner: HFLoader, ref: str) -> list[str]:
    """Stream a Hugging Face checkpoint's tensors in: safetensors (one file, or shards listed by
    ``model.safetensors.index.json``), or a legacy ``pytorch_model.bin`` read with
    ``torch.load(weights_only=True)``, which refuses anything but tensors (no code runs from a file).
    Returns the names it left at their initialization."""
    from safetensors import SafetensorError, safe_open

    root = resolve_pretrained(ref)
    if (root / "model.safetensors").is_file() or (root / SHARD_INDEX).is_file():
        try:
            with ExitStack() as stack:
                files = (
                    [root / "model.safetensors"]
                    if (root / "model.safetensors").is_file()
                    else shard_files(root)
                )
                handles = [stack.enter_context(safe_open(str(p), framework="pt")) for p in files]
                missing = runner.load_hf(SafeTensors(*handles))
        except SafetensorError as e:  # a truncated or damaged file: one line naming it
            raise CheckpointError(f"{root}: unreadable safetensors ({str(e).splitlines()[0]})") from e
    else:
        try:
            tensors = torch.load(root / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"{root}/pytorch_model.bin: refused ({str(e).splitlines()[0]})") from e
        missing = runner.load_hf(tensors)
    log.info("loaded %s; newly initialized: %s", ref, ", ".join(missing) or "none")
    return missing


def load_exported(runner: HFLoader, path: Path) -> None:
    """A model directory this model was exported to (a run's ``final/``, for ``l2l eval``): unlike a
    pretrained start, whose head may be new, every weight must be there."""
    missing = load_pretrained(runner, str(path))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{path} lacks {', '.join(missing[:3])}{more}: not the weights of this model")


def load_adapter(runner: HFLoader, spec: Any, path: Path) -> None:
    """A LoRA run's adapter directory (PEFT's layout: its ``final/``) into a runner whose base is already
    in place: every trainable tensor must be there."""
    from l2l_cli.models import lora

    if not lora.is_adapter_dir(path):
        raise CheckpointError(
            f"{path} has no {lora.ADAPTER_CONFIG} and {lora.ADAPTER_WEIGHTS}: not an adapter"
        )
    tensors = lora.read_adapter(path)
    lacking = [n for n in lora.trainable_hf_names(spec) if n not in tensors]
    if lacking:
        more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
        raise CheckpointError(f"{path} lacks {', '.join(lacking[:3])}{more}: not the adapter of this model")
    runner.load_hf(tensors)
    log.info("loaded the adapter in %s", path)


def weight_files(root: Path) -> list[Path]:
    """The files a checkpoint's model is read from (:func:`load_pretrained`): its config.json and its
    weights (one safetensors file; or the shard index and its shards; or a legacy pytorch_model.bin)."""
    if (root / "model.safetensors").is_file():
        weights = [root / "model.safetensors"]
    elif (root / SHARD_INDEX).is_file():
        weights = [root / SHARD_INDEX, *shard_files(root)]
    else:
        weights = [root / "pytorch_model.bin"]
    return [p for p in (root / "config.json", *weights) if p.is_file()]


def base_fingerprint(ref: str) -> dict[str, Any]:
    """The checkpoint ``ref`` (a dir or hub id) as a LoRA run's base: its fingerprint
    (checkpoint/fingerprint.py: each file it is read from, by size and xxh3-128), and how PEFT names it in
    ``adapter_config.json`` (``name_or_path``: the directory, or the hub id and the ``revision`` of the
    snapshot it was read from)."""
    from l2l_cli.checkpoint import fingerprint

    root = resolve_pretrained(ref)
    local = Path(ref).expanduser().is_dir()
    revision = root.name if not local and root.parent.name == "snapshots" else None
    name = str(root.resolve()) if local else ref
    return {**fingerprint(ref, weight_files(root)), "name_or_path": name, "revision": revision}


def shard_files(root: Path) -> list[Path]:
    """The shard files an index names: plain file names inside ``root`` (no path may lead out of it)."""
    try:
        names = sorted(set(json.loads((root / SHARD_INDEX).read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{root}/{SHARD_INDEX}: unreadable ({e})") from e
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"{root}/{SHARD_INDEX}: shard {name!r} is not a file name in that folder")
        if not (root / name).is_file():
            raise CheckpointError(f"{root}/{SHARD_INDEX}: shard {name} is missing")
    return [root / n for n in names]


class SafeTensors:
    """Safetensors handles (one file, or a checkpoint's shards) read one tensor at a time, never the
    whole checkpoint at once."""

    def __init__(self, *handles: Any):
        self._where = {k: h for h in handles for k in h.keys()}  # noqa: SIM118  (handles have keys(), not iter)

    def keys(self) -> set[str]:
        return set(self._where)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.get_tensor(name)
