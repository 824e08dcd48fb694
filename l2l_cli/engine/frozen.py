"""The frozen base of a LoRA run (``peft=lora``): every layer's base weights, held once in the precision
``peft.base_dtype`` asks for, in host RAM or in files (``peft.base_source``), and dequantized into a device
slot when the relay loads the layer. It has no gradient, no master, no moments and is never written after
it is built: the EPS's :class:`~l2l_cli.engine.layer_state.LayerState` holds the adapters only.

Encodings (one per tensor, :class:`Frozen`):
- ``fp32`` / ``bf16`` / ``fp16``: the tensor in that type;
- ``int8``: the blocks' linear weights per output channel (a Conv1D's columns), symmetric absmax scales
  applied in fp32 (8.03 bits per weight);
- ``nf4``: the blocks' linear weights in QLoRA's 4-bit NormalFloat with double-quantized block scales
  (blocks of 64, the scales in int8 per 256 with an fp32 factor: 4.13 bits per weight), by torchao's
  ``NF4Tensor`` (the implementation torchtune's QLoRA uses; pure PyTorch, so the same code dequantizes on
  a CPU device and on CUDA). Everything else of a low-bit base (embeddings, norms, biases, the LM head)
  stays bf16, as QLoRA keeps it.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from l2l_cli.engine.flat import FlatLayout
from l2l_cli.models.base import BLOCK, POST, ModelSpec
from l2l_cli.models.lora import LoraSettings

log = logging.getLogger("l2l")

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
        if self.how == "int8":  # the scale applied in fp32, then rounded once to ``dtype``
            scale = parts["scale"].float()
            scale = scale if scale.dim() == 2 else scale[:, None]  # (1, out): a Conv1D's columns; else rows
            return (parts["q"].float() * scale).to(dtype).reshape(self.shape)
        numel = 1
        for s in self.shape:
            numel *= s
        return _nf4_decode(parts, device)[:numel].to(dtype).reshape(self.shape)


def encode(t: torch.Tensor, base_dtype: str, quantize: bool, out_axis: int = 0) -> Frozen:
    """``t`` (fp32, CPU) in the base's precision; ``quantize``: a linear weight a low-bit base quantizes;
    ``out_axis``: its output channels' dimension (0: ``nn.Linear``'s (out, in); 1: GPT-2's Conv1D's
    (in, out)), over which int8 keeps one scale per channel."""
    t = t.detach().to("cpu", torch.float32).contiguous()
    if base_dtype in PLAIN or not quantize:
        dtype = PLAIN.get(base_dtype, torch.bfloat16)
        return Frozen("plain", tuple(t.shape), {"w": t.to(dtype).clone()})
    if base_dtype == "int8":
        w = t.reshape(t.shape[0], -1)
        if out_axis == 1:  # per column: stored (1, out)
            scale = w.abs().amax(dim=0, keepdim=True).clamp(min=1e-12) / 127.0
            q = torch.round(w / scale)
        else:  # per row: stored (out,)
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
            q = torch.round(w / scale[:, None])
        return Frozen("int8", tuple(t.shape), {"q": q.clamp(-127, 127).to(torch.int8), "scale": scale})
    return Frozen("nf4", tuple(t.shape), _nf4_encode(t))


def _nf4_encode(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """torchao's NF4 of ``t`` flattened (``NF4Tensor.from_tensor``'s parts, bit for bit), padded to whole
    scaler blocks with a repeat of its own values (zeros would add all-zero blocks to the scales'
    statistics). The scales are torchao's own; the codes are :func:`_nf4_codes`, torchao's nearest-code rule
    computed without its 16-fold temporary (docs/adapters.md gives the time it saves)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    flat = t.flatten()
    unit = NF4_BLOCK * NF4_SCALER_BLOCK
    pad = -flat.numel() % unit
    if pad:
        flat = torch.cat([flat, flat.repeat(pad // flat.numel() + 1)[:pad]])
    scalers, factor, mean = NF4Tensor.double_quantize_scalers(flat, NF4_BLOCK, NF4_SCALER_BLOCK)
    nf4 = torch.tensor(NF4_CODES, dtype=flat.dtype, device=flat.device)
    return {
        "data": _nf4_codes(flat, nf4),
        "scalers": scalers,
        "factor": factor,
        "mean": mean.reshape(1),
        "nf4": nf4,
    }


# torchao's NF4 code book (``NF4Tensor.from_tensor``'s), ascending
NF4_CODES = (
    -1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0,
)  # fmt: skip  # a table of 16 codes, 8 a line
_CHUNK = 1 << 20  # elements per chunk of the code / decode loops (bounds their temporaries)


def _nf4_thresholds(nf4: torch.Tensor) -> torch.Tensor:
    """Per pair of neighbouring codes, the smallest ``v`` (in the codes' dtype) that torchao's
    ``quantize_tensor_nearest`` gives the upper one: ``|v - hi| < |v - lo|`` as computed in that dtype (a
    tie goes to the lower index). Both distances are monotone in ``v``, so this one boundary decides every
    value between the two codes exactly as torchao's 16-way comparison does."""
    out = []
    for lo, hi in itertools.pairwise(nf4):
        v = ((lo + hi) / 2).to(nf4.dtype)

        def upper(x: torch.Tensor, lo: torch.Tensor = lo, hi: torch.Tensor = hi) -> bool:
            return bool((x - hi).abs() < (x - lo).abs())

        while upper(v) and upper(torch.nextafter(v, lo)):
            v = torch.nextafter(v, lo)
        while not upper(v):
            v = torch.nextafter(v, hi)
        out.append(v)
    return torch.stack(out)


def _nf4_codes(flat: torch.Tensor, nf4: torch.Tensor) -> torch.Tensor:
    """The packed 4-bit codes of ``flat`` (whole blocks): each element divided by its block's absmax, then
    the index of the nearest code exactly as torchao's ``quantize_tensor_nearest`` picks it (index 0 for
    NaN, an all-zero block), by one search in :func:`_nf4_thresholds` instead of its 16-fold temporary
    (docs/adapters.md); two codes a byte, the first in the high nibble."""
    bounds = _nf4_thresholds(nf4)
    out = torch.empty(flat.numel() // 2, dtype=torch.uint8, device=flat.device)
    for s in range(0, flat.numel(), _CHUNK):
        blocks = flat[s : s + _CHUNK].view(-1, NF4_BLOCK)
        v = (blocks / blocks.abs().amax(dim=1, keepdim=True)).flatten()
        q = torch.bucketize(v, bounds, right=True, out_int32=True)
        q.masked_fill_(v.isnan(), 0)
        out[s // 2 : (s + v.numel()) // 2] = (q[::2] << 4 | q[1::2]).to(torch.uint8)
    return out


def _nf4_decode(parts: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """torchao's ``NF4Tensor.get_original_weight`` of the stored parts (flat, padded), bit for bit: each
    byte's two codes looked up at once (a 256-entry table) and multiplied by their block's dequantized
    scale (the same one product per element), in chunks (no int64 index of the whole tensor)."""
    data, nf4 = parts["data"], parts["nf4"]
    table = torch.stack([nf4.repeat_interleave(16), nf4.repeat(16)], dim=1)  # byte -> (high, low) code
    scales = (parts["scalers"].view(-1, NF4_SCALER_BLOCK) / parts["factor"].unsqueeze(-1)).flatten().to(
        nf4.dtype
    ) + parts["mean"].reshape(())
    out = torch.empty(data.numel() * 2, dtype=nf4.dtype, device=device)
    pairs, blocks = out.view(-1, 2), out.view(-1, NF4_BLOCK)
    half = NF4_BLOCK // 2  # bytes per block
    for s in range(0, data.numel(), _CHUNK // 2):
        chunk = data[s : s + _CHUNK // 2]
        torch.index_select(table, 0, chunk.to(torch.int32), out=pairs[s : s + chunk.numel()])
        b0, b1 = s // half, (s + chunk.numel()) // half
        blocks[b0:b1].mul_(scales[b0:b1].unsqueeze(-1))
    return out


def quantized_names(spec: ModelSpec, kind: str, layer: nn.Module) -> dict[str, int]:
    """The parameters a low-bit base quantizes in a layer of ``kind`` (the blocks' linear weights), each
    with its output channels' dimension (a Conv1D stores its weight (in, out): 1)."""
    if kind != BLOCK:
        return {}
    out = {}
    for name, m in layer.named_modules():
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D":
            out[f"{name}.weight" if name else "weight"] = 1 if type(m).__name__ == "Conv1D" else 0
    return out


class FrozenBase:
    """Every layer's frozen base tensors in ``lora.base_dtype``: built from each layer's module as the EPS
    builds it, replaced from a checkpoint (``load_hf``), dequantized into a device slot (``load``)."""

    def __init__(
        self,
        spec: ModelSpec,
        layouts: dict[str, FlatLayout],
        lora: LoraSettings,
        root: Path | None = None,
        seed: int | None = None,
        link: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        """``root``: where a base on disk (``lora.base_on_disk``) keeps its layer files (None: a temporary
        folder). ``seed``: the model's; with ``lora.base_from_checkpoint`` a layer is stored when the
        checkpoint's tensors arrive (``load_hf``), and one they never reach is built from the seed, as
        without a checkpoint, when it is first used. ``link``: the accelerator's (``Accelerator.link``): a
        layer held in RAM is page-locked at its first load onto the device, so that copy and every later
        one is asynchronous DMA (on an H200 a 70B QLoRA step took 8.6 s at 20 layers, its base copied
        from pageable memory on the compute thread, where the planner expected 4.4)."""
        self.spec, self.layouts, self.lora = spec, layouts, lora
        self.seed, self.link = seed, link
        self._linked: set[int] = set()  # layers held in RAM already page-locked
        self.unfilled: set[int] = set()  # layers not stored yet (waiting for the checkpoint)
        self.tied = spec.tied_params()
        self.layers: list[dict[str, Frozen]] = []  # in RAM (a base on disk: empty dicts)
        self._quantized = {k: quantized_names(spec, k, spec.new_layer(k, "meta")) for k in layouts}
        self.bytes_loaded = 0  # bytes of frozen layers copied toward the device (all time)
        self.source: Any = None  # the layer files of a base on disk (engine/frozen_disk.py)
        self.seeded = False  # a stored tensor was built from the seed (a reuse must have the same seed)
        if lora.base_on_disk:
            from l2l_cli.engine.frozen_disk import DiskSource

            self.source = DiskSource(root, Frozen, self._reuse_key())
        # the encoded files of an earlier run on the same base, adopted as they are: nothing is encoded
        self.reused = self.source is not None and self.source.reused
        if self.reused:
            log.info(
                "frozen base: reused the encoded layer files in %s (the same base files, peft.base_dtype=%s "
                "and model): nothing re-encoded",
                root,
                lora.base_dtype,
            )
        self._lock = threading.Lock()

    def _reuse_key(self) -> dict[str, Any] | None:
        """What layer files must encode to be reused (engine/frozen_disk.py): the checkpoint's files by
        hash, the precision, the model and its frozen tensors, the seed; None: never (a checkpoint without
        a fingerprint)."""
        fp = self.lora.base_fingerprint
        if self.lora.base_from_checkpoint and fp is None:
            return None
        frozen = {
            k: [[e.name, list(e.shape)] for e in lay.entries] for k, lay in sorted(self.layouts.items())
        }
        return {
            "base": fp["files"] if fp is not None else None,
            "base_dtype": self.lora.base_dtype,
            "model": {k: v for k, v in self.spec.identity().items() if k != "peft"},
            "frozen": frozen,
            "seed": self.seed,
        }

    # ---- building ------------------------------------------------------------------------------------

    def _own(self, i: int) -> list[str]:
        """Layer i's frozen tensors it holds itself (a tied LM head's is the pre layer's)."""
        kind = self.spec.kind(i)
        return [e.name for e in self.layouts[kind].entries if not (kind == POST and e.name in self.tied)]

    def put(self, i: int, layer: nn.Module) -> None:
        """Layer i's frozen tensors from its module (layers are put in order, 0 first)."""
        assert len(self.layers) == i
        self.layers.append({})
        if self.reused:  # the files of an earlier run encode this base already
            return
        if self.lora.base_from_checkpoint and self.seed is not None:  # encoded once, from the checkpoint
            self.unfilled.add(i)
            return
        self.seeded = True
        self._store(i, self._encoded(i, layer, self._own(i)))

    def _encoded(self, i: int, layer: nn.Module, names: list[str]) -> dict[str, Frozen]:
        params = dict(layer.named_parameters())
        q = self._quantized[self.spec.kind(i)]
        return {n: encode(params[n], self.lora.base_dtype, n in q, q.get(n, 0)) for n in names}

    def _store(self, i: int, entry: dict[str, Frozen]) -> None:
        if self.source is not None:  # straight to its file: the base is never whole in RAM
            self.source.write(i, entry)
        else:
            self.layers[i] = entry
        self.unfilled.discard(i)
        self._seal()

    def _seal(self) -> None:
        """A base on disk whose every layer is stored lists its files for reuse (engine/frozen_disk.py)."""
        if self.source is not None and not self.unfilled and len(self.layers) == self.spec.num_all_layers:
            self.source.seal(self.seeded)

    def _fill(self, i: int, found: dict[str, Frozen]) -> None:
        """Store an unfilled layer i: the checkpoint's tensors ``found``, the rest built from the seed."""
        missing = [n for n in self._own(i) if n not in found]
        if missing:
            assert self.seed is not None
            self.seeded = True
            found = {**found, **self._encoded(i, self.spec.build_layer(i, self.seed), missing)}
        self._store(i, found)

    def _filled(self, i: int) -> None:
        if i in self.unfilled:
            self._fill(i, {})

    @torch.no_grad()
    def load_hf(self, tensors: Any) -> list[str]:
        """Re-encode each frozen tensor the checkpoint has; returns the names it left as built (none for a
        base reused from the files that encode this checkpoint already)."""
        if self.reused:
            return []
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
                    q = self._quantized[kind]
                    found[name] = encode(t, self.lora.base_dtype, name in q, q.get(name, 0))
            if i in self.unfilled:
                if found:
                    self._fill(i, found)
            elif self.source is None:
                self.layers[i].update(found)
            elif found:  # one layer at a time: its file rewritten with the checkpoint's tensors
                self.source.write(i, {**self.source.read(i), **found})
        self._seal()
        return missing

    # ---- reading -------------------------------------------------------------------------------------

    def layer(self, i: int) -> dict[str, Frozen]:
        """Layer i's stored tensors (a disk source reads them, ahead of use)."""
        self._filled(i)
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
        if self.link is not None and self.source is None and i not in self._linked:
            self._linked.add(i)
            for f in own.values():
                for t in f.parts.values():
                    self.link(t)
        n, tied = 0, None
        for name, view in layout.views(out):
            if kind == POST and name in self.tied:  # a tied LM head: the pre layer's tensor
                if tied is None:
                    self._filled(0)
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
