"""``l2l export --merge``, streamed: a LoRA run's base with its adapter merged in, one layer at a time, into
safetensors shards and ``model.safetensors.index.json`` as transformers' ``save_pretrained`` writes them.

Why layer by layer: building the whole model to merge it needs the model's size in RAM, in FP32 (a 7B merge
~27 GiB). Here one layer's module is in memory at a time: its base read from the checkpoint's files
(``model.pretrained``, tensor by tensor with plain reads, so no mapped file stays resident), the trained
tensors (the adapter, DoRA's magnitudes, ``modules_to_save``) put over it, PEFT's own ``merge`` applied in
FP32, and each tensor cast to the export's dtype and appended to its shard. A shard's header is written
before its tensors: the names, shapes and dtypes come from the layers built on the meta device.

The base is always the checkpoint's own weights: a run that held its base in NF4 or int8 trained its
adapter on the rounded copy, but the merge goes into the original tensors, never the dequantized ones.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from l2l_cli.models.base import POST, ModelSpec

if TYPE_CHECKING:
    import torch

SHARD_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype's choices, torch's names
_ST_CODES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
_ST_NAMES = {v: k for k, v in _ST_CODES.items()}


# ---- reading a checkpoint one tensor at a time --------------------------------------------------------


class TensorFiles:
    """A Hugging Face checkpoint's safetensors files read tensor by tensor with ``readinto`` (a fresh
    buffer per tensor, freed with it): unlike a memory map held open, nothing read stays in the process's
    resident set. ``keys()`` / ``get_tensor()`` as a safetensors handle has them (``ModelSpec.lookup_hf``)."""

    def __init__(self, files: list[Path]):
        self._where: dict[str, tuple[Path, str, list[int], int, int]] = {}
        for path in files:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                self._where[name] = (path, info["dtype"], list(info["shape"]), 8 + n + begin, end - begin)

    def keys(self) -> set[str]:
        return set(self._where)

    def get_tensor(self, name: str) -> torch.Tensor:
        import torch

        path, code, shape, offset, size = self._where[name]
        buf = torch.empty(size, dtype=torch.uint8)
        with open(path, "rb") as f:
            f.seek(offset)
            if f.readinto(memoryview(buf.numpy())) != size:
                raise OSError(f"{path}: {name} is cut short")
        return buf.view(getattr(torch, _ST_CODES[code])).reshape(shape)

    def main_dtype(self) -> str | None:
        """The floating type holding most of the checkpoint's bytes (torch's name), None if it has none."""
        counts: dict[str, int] = {}
        for _, code, _, _, size in self._where.values():
            if _ST_CODES.get(code, "").startswith(("float", "bfloat")):
                counts[_ST_CODES[code]] = counts.get(_ST_CODES[code], 0) + size
        return max(counts, key=lambda k: counts[k]) if counts else None


def checkpoint_files(root: Path) -> TensorFiles | None:
    """A checkpoint directory's safetensors (one file or its shards); None for a legacy .bin checkpoint."""
    from l2l_cli.models.hf import shard_files

    if (root / SINGLE_FILE).is_file():
        return TensorFiles([root / SINGLE_FILE])
    if (root / SHARD_INDEX).is_file():
        return TensorFiles(shard_files(root))
    return None


# ---- the merged layers --------------------------------------------------------------------------------


def layer_names(spec: ModelSpec, index: int) -> list[tuple[str, list[int]]]:
    """(checkpoint name, shape) of layer ``index``'s tensors in a merged export: the family's own layer's
    parameters (built on the meta device), a tied head's tensor left to the embedding."""
    from l2l_cli.models.lora import base_spec

    base, kind = base_spec(spec), spec.kind(index)
    tied = spec.tied_params()
    return [
        (base.hf_name(index, n), list(p.shape))
        for n, p in base.new_layer(kind, "meta").named_parameters()
        if not (kind == POST and n in tied)
    ]


def merged_layers(
    spec: ModelSpec,
    base: Any,
    trained: dict[str, torch.Tensor],
    seed: int,
) -> Iterator[tuple[int, list[tuple[str, torch.Tensor]]]]:
    """Per layer, its merged tensors in FP32 (by checkpoint name, in :func:`layer_names`' order).
    ``base``: the checkpoint's tensors by HF name (None: the family's seeded init, ``seed``);
    ``trained``: the run's trained tensors by ``hf_name`` (adapters, magnitudes, modules to save). A base
    tensor the checkpoint lacks keeps the seeded init the run started from, as the runner's does."""
    import torch

    from l2l_cli.models.lora import merged_tensors

    for i in range(spec.num_all_layers):
        layer = spec.new_layer(spec.kind(i), "cpu")
        params = dict(layer.named_parameters())
        missing = []
        with torch.no_grad():
            for n, p in params.items():
                full = spec.hf_name(i, n)
                t = trained.get(full)
                if t is None and base is not None and not spec.trainable(n):  # type: ignore[attr-defined]
                    t = spec.lookup_hf(base, full)
                if t is None:
                    missing.append(n)
                else:
                    p.copy_(t.reshape(p.shape))
                    del t
            if missing:  # the seeded init, then everything read over it again
                seeded = dict(spec.build_layer(i, seed, "cpu").named_parameters())
                for n in missing:
                    params[n].copy_(seeded[n])
                del seeded
        yield i, list(merged_tensors(spec, [(i, layer)]))
        del layer, params
        _give_back_freed()


def _give_back_freed() -> None:
    """Return the heap's freed pages to the system after a layer (glibc's ``malloc_trim``): its arenas keep
    a freed layer's memory otherwise, and the resident set creeps up layer after layer toward the model's
    size. A no-op where there is no glibc."""
    import contextlib
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


# ---- writing shards -----------------------------------------------------------------------------------


@dataclass
class Shard:
    """One output file: its tensors (name, shape) in the order they are written, and their bytes."""

    layers: list[int] = field(default_factory=list)
    tensors: list[tuple[str, list[int]]] = field(default_factory=list)
    nbytes: int = 0


def plan_shards(spec: ModelSpec, itemsize: int, max_shard_bytes: int) -> list[Shard]:
    """Whole layers, in order, into shards of at most ``max_shard_bytes`` (a layer larger alone in one), as
    transformers fills its shards tensor by tensor up to ``max_shard_size``."""
    shards = [Shard()]
    for i in range(spec.num_all_layers):
        names = layer_names(spec, i)
        size = sum(itemsize * _numel(s) for _, s in names)
        if shards[-1].layers and shards[-1].nbytes + size > max_shard_bytes:
            shards.append(Shard())
        sh = shards[-1]
        sh.layers.append(i)
        sh.tensors.extend(names)
        sh.nbytes += size
    return shards


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _header(tensors: list[tuple[str, list[int]]], code: str, itemsize: int) -> bytes:
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        size = itemsize * _numel(shape)
        meta[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text


def write_shards(
    spec: ModelSpec,
    layers: Iterator[tuple[int, list[tuple[str, torch.Tensor]]]],
    out_dir: Path,
    dtype: torch.dtype,
    max_shard_bytes: int,
    on_layer: Callable[[int], None] | None = None,
) -> list[Path]:
    """The merged ``layers`` (in order) into ``model.safetensors``, or ``model-0000k-of-0000n.safetensors``
    shards and ``model.safetensors.index.json`` when they exceed ``max_shard_bytes``; each tensor cast to
    ``dtype`` and written as it comes. Returns the files written."""
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    code = _ST_NAMES[str(dtype).removeprefix("torch.")]
    shards = plan_shards(spec, itemsize, max_shard_bytes)
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for shard, name in zip(shards, names, strict=True):
        expected = iter(shard.tensors)
        with open(out_dir / name, "wb") as f:
            f.write(_header(shard.tensors, code, itemsize))
            for _ in shard.layers:
                i, tensors = next(layers)
                for hf, t in tensors:
                    want, shape = next(expected)
                    if (hf, list(t.shape)) != (want, shape):  # the plan and the layer disagree: a bug
                        raise RuntimeError(
                            f"merge: layer {i} gave {hf} {list(t.shape)}, planned {want} {shape}"
                        )
                    f.write(memoryview(t.to(dtype).contiguous().view(-1).view(torch.uint8).numpy()))
                    weight_map[hf] = name
                if on_layer is not None:
                    on_layer(i)
    if len(shards) > 1:
        total = sum(s.nbytes for s in shards)
        params = sum(_numel(shape) for s in shards for _, shape in s.tensors)
        index = {
            "metadata": {"total_size": total, "total_parameters": params},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out_dir / SHARD_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [out_dir / n for n in names] + ([out_dir / SHARD_INDEX] if len(shards) > 1 else [])


def parse_size(text: str) -> int:
    """``--max-shard-size``: bytes, or a number with KB/MB/GB (10**3 steps) or KiB/MiB/GiB, as transformers'
    ``max_shard_size`` reads it."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    t = text.strip().upper()
    for unit, mult in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)
