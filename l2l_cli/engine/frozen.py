"""The frozen base of a LoRA run (``peft=lora``): every layer's base weights, held once in the precision
``peft.base_dtype`` asks for, in host RAM or in files (``peft.base_source``), and dequantized into a device
slot when the relay loads the layer. It has no gradient, no master, no moments and is never written after
it is built: the EPS's :class:`~l2l_cli.engine.layer_state.LayerState` holds the adapters only.

Encodings (one per tensor, :class:`Frozen`):
- ``fp32`` / ``bf16`` / ``fp16``: the tensor in that type;
- ``int8``: the blocks' linear weights per output row, symmetric absmax scales (8.03 bits per weight);
- ``nf4``: the blocks' linear weights in QLoRA's 4-bit NormalFloat with double-quantized block scales
  (blocks of 64, the scales in int8 per 256 with an fp32 factor: 4.13 bits per weight), by torchao's
  ``NF4Tensor`` (the implementation torchtune's QLoRA uses; pure PyTorch, so the same code dequantizes on
  a CPU device and on CUDA). Everything else of a low-bit base (embeddings, norms, biases, the LM head)
  stays bf16, as QLoRA keeps it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from l2l_cli.engine.flat import FlatLayout
from l2l_cli.models.base import BLOCK, POST, ModelSpec
from l2l_cli.models.lora import LoraSettings

NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
PLAIN = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Frozen:
    """One frozen tensor as stored: its encoding and the tensors it is made of (all plain tensors, so they
    copy to a device and save to a file as they are)."""

    how: str  # plain | int8 | nf4
    shape: tuple[int, ...]
    parts: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.parts.values())

    def decode(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The tensor in ``dtype`` on ``device`` (the low-bit parts are copied there, then dequantized)."""
        parts = {k: v.to(device, non_blocking=True) for k, v in self.parts.items()}
        if self.how == "plain":
            return parts["w"].to(dtype)
        if self.how == "int8":
            return (parts["q"].to(dtype) * parts["scale"].to(dtype)[:, None]).reshape(self.shape)
        numel = 1
        for s in self.shape:
            numel *= s
        return _nf4_decode(parts, device)[:numel].to(dtype).reshape(self.shape)


def encode(t: torch.Tensor, base_dtype: str, quantize: bool) -> Frozen:
    """``t`` (fp32, CPU) in the base's precision; ``quantize``: a linear weight a low-bit base quantizes."""
    t = t.detach().to("cpu", torch.float32).contiguous()
    if base_dtype in PLAIN or not quantize:
        dtype = PLAIN.get(base_dtype, torch.bfloat16)
        return Frozen("plain", tuple(t.shape), {"w": t.to(dtype).clone()})
    if base_dtype == "int8":
        rows = t.reshape(t.shape[0], -1)
        scale = rows.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return Frozen("int8", tuple(t.shape), {"q": q, "scale": scale})
    return Frozen("nf4", tuple(t.shape), _nf4_encode(t))


def _nf4_encode(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """torchao's NF4 of ``t`` flattened, padded to whole scaler blocks with a repeat of its own values
    (zeros would add all-zero blocks to the scales' statistics)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    flat = t.flatten()
    unit = NF4_BLOCK * NF4_SCALER_BLOCK
    pad = -flat.numel() % unit
    if pad:
        flat = torch.cat([flat, flat.repeat(pad // flat.numel() + 1)[:pad]])
    q = NF4Tensor.from_tensor(flat, NF4_BLOCK, NF4_SCALER_BLOCK)
    return {
        "data": q.quantized_data, "scalers": q.quantized_scalers, "factor": q.quantization_factor,
        "mean": q.scaler_mean.reshape(1), "nf4": q.nf4,
    }  # fmt: skip


def _nf4_decode(parts: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """torchao's ``NF4Tensor.get_original_weight`` of the stored parts (flat, padded)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs

    data = parts["data"]
    numel = data.numel() * 2
    meta = SubclassTensorArgs(torch.Size([numel]), (1,), 0, parts["nf4"].dtype, device, False)
    q = NF4Tensor(
        meta, NF4_BLOCK, numel // NF4_BLOCK, NF4_SCALER_BLOCK, parts["scalers"], parts["factor"],
        parts["mean"].reshape(()), data, parts["nf4"],
    )  # fmt: skip
    return q.get_original_weight()


def quantized_names(spec: ModelSpec, kind: str, layer: nn.Module) -> set[str]:
    """The parameters a low-bit base quantizes in a layer of ``kind``: the blocks' linear weights."""
    if kind != BLOCK:
        return set()
    out = set()
    for name, m in layer.named_modules():
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D":
            out.add(f"{name}.weight" if name else "weight")
    return out


class FrozenBase:
    """Every layer's frozen base tensors in ``lora.base_dtype``: built from each layer's module as the EPS
    builds it, replaced from a checkpoint (``load_hf``), dequantized into a device slot (``load``)."""

    def __init__(
        self, spec: ModelSpec, layouts: dict[str, FlatLayout], lora: LoraSettings, root: Path | None = None
    ):
        """``root``: where a base on disk (``lora.base_on_disk``) keeps its layer files (None: a temporary
        folder)."""
        self.spec, self.layouts, self.lora = spec, layouts, lora
        self.tied = spec.tied_params()
        self.layers: list[dict[str, Frozen]] = []  # in RAM (a base on disk: empty dicts)
        self._quantized = {k: quantized_names(spec, k, spec.new_layer(k, "meta")) for k in layouts}
        self.bytes_loaded = 0  # bytes of frozen layers copied toward the device (all time)
        self.source: Any = None  # the layer files of a base on disk (engine/frozen_disk.py)
        if lora.base_on_disk:
            from l2l_cli.engine.frozen_disk import DiskSource

            self.source = DiskSource(root, Frozen)
        self._lock = threading.Lock()

    # ---- building ------------------------------------------------------------------------------------

    def _own(self, i: int) -> list[str]:
        """Layer i's frozen tensors it holds itself (a tied LM head's is the pre layer's)."""
        kind = self.spec.kind(i)
        return [e.name for e in self.layouts[kind].entries if not (kind == POST and e.name in self.tied)]

    def put(self, i: int, layer: nn.Module) -> None:
        """Layer i's frozen tensors from its module (layers are put in order, 0 first)."""
        kind = self.spec.kind(i)
        params = dict(layer.named_parameters())
        q = self._quantized[kind]
        entry = {n: encode(params[n], self.lora.base_dtype, n in q) for n in self._own(i)}
        assert len(self.layers) == i
        if self.source is not None:  # straight to its file: the base is never whole in RAM
            self.source.write(i, entry)
            entry = {}
        self.layers.append(entry)

    @torch.no_grad()
    def load_hf(self, tensors: Any) -> list[str]:
        """Re-encode each frozen tensor the checkpoint has; returns the names it left as built."""
        missing = []
        for i in range(len(self.layers)):
            kind = self.spec.kind(i)
            found = {}
            for name in self._own(i):
                full = self.spec.hf_name(i, name)
                t = self.spec.lookup_hf(tensors, full)
                if t is None:
                    missing.append(full)
                else:
                    found[name] = encode(t, self.lora.base_dtype, name in self._quantized[kind])
            if self.source is None:
                self.layers[i].update(found)
            elif found:  # one layer at a time: its file rewritten with the checkpoint's tensors
                self.source.write(i, {**self.source.read(i), **found})
        return missing

    # ---- reading -------------------------------------------------------------------------------------

    def layer(self, i: int) -> dict[str, Frozen]:
        """Layer i's stored tensors (a disk source reads them, ahead of use)."""
        if self.source is not None:
            return self.source.layer(i)
        return self.layers[i]

    def prefetch(self, i: int) -> None:
        """Layer i will be loaded soon (a disk source starts reading it)."""
        if self.source is not None and 0 <= i < self.spec.num_all_layers:
            self.source.prefetch(i)

    @torch.no_grad()
    def load(self, i: int, out: torch.Tensor) -> None:
        """Dequantize layer i's frozen tensors into ``out`` (a device slot's flat buffer, its layout)."""
        kind = self.spec.kind(i)
        layout = self.layouts[kind]
        own = self.layer(i)
        n, tied = 0, None
        for name, view in layout.views(out):
            if kind == POST and name in self.tied:  # a tied LM head: the pre layer's tensor
                if tied is None:
                    tied = self.layers[0] if self.source is None else self.source.read(0)
                f = tied[self.tied[name]]
            else:
                f = own[name]
            n += f.nbytes
            view.copy_(f.decode(view.device, view.dtype))
        with self._lock:
            self.bytes_loaded += n

    def tensors(self, i: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Layer i's frozen tensors dequantized to fp32 on the CPU, by layer name."""
        layout = self.layouts[self.spec.kind(i)]
        flat = torch.empty(layout.numel)
        self.load(i, flat)
        yield from ((n, v.clone()) for n, v in layout.views(flat))

    def host_bytes(self) -> int:
        """Bytes of the base held in RAM (a disk source: only the layers it has read ahead)."""
        if self.source is not None:
            return self.source.host_bytes()
        return sum(f.nbytes for layer in self.layers for f in layer.values())

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
