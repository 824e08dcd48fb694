"""LoRA adapters on a frozen base (``peft=lora``) as ``l2l plan`` counts them: the trainable and frozen
parameters of each layer, the bytes the base takes as it is stored (``peft.base_dtype``) and where it is
held (``peft.base_source``), and how often the relay reads it in a step.

The counts are the run's own: the adapted modules are the ones ``models/lora.py`` injects (its
``targets``, on the family's meta-device layers), each ``r·(in + out)`` parameters as PEFT's ``lora_A`` /
``lora_B`` hold them; the stored bytes follow ``engine/frozen.py``'s encodings tensor by tensor (torchao's
NF4 layout, int8's per-row scales, padding included). :func:`stored_bytes` needs no torch; building a
:class:`PeftShape` reads the meta layers (the config check has imported torch for them already).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# torchao's NF4Tensor as engine/frozen.py stores it: blocks of 64 weights, 4 bits each (two per uint8),
# one int8 block scale per block, double-quantized per 256 block scales with one fp32 factor each; per
# tensor its fp32 scaler mean and the 16-entry fp32 NF4 table; each tensor padded to whole scaler blocks
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
NF4_UNIT = NF4_BLOCK * NF4_SCALER_BLOCK
NF4_TENSOR_BYTES = 4 + 16 * 4  # scaler mean, the NF4 table
PLAIN_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
LOW_BIT_REST = 2  # a low-bit base keeps what it does not quantize (embeddings, norms, head) in bf16
READ_AHEAD = 2  # engine/frozen_disk.py's DiskSource(ahead=2): layers read ahead of the one in use
LORA_BACKWARD_SHARE = 0.5  # a frozen matmul's backward: the input's gradient only, no weight gradient


def nf4_bytes(numel: int) -> int:
    """Bytes of one tensor of ``numel`` elements in torchao's NF4 (padded to whole scaler blocks)."""
    padded = -(-numel // NF4_UNIT) * NF4_UNIT
    return padded // 2 + padded // NF4_BLOCK + 4 * (padded // NF4_UNIT) + NF4_TENSOR_BYTES


def nf4_bytes_per_param() -> float:
    """NF4's bytes per weight of a large tensor: 0.5 + 1/64 (int8 block scales) + 4/16384 (their factors)."""
    return 0.5 + 1 / NF4_BLOCK + 4 / NF4_UNIT


def stored_bytes(shape: tuple[int, ...], base_dtype: str, quantize: bool) -> int:
    """Bytes of one frozen tensor as ``engine/frozen.py``'s ``encode`` stores it (``quantize``: a block's
    linear weight, which a low-bit base quantizes)."""
    numel = 1
    for s in shape:
        numel *= s
    if base_dtype in PLAIN_BYTES:
        return PLAIN_BYTES[base_dtype] * numel
    if not quantize:
        return LOW_BIT_REST * numel
    if base_dtype == "int8":
        return numel + 4 * (shape[0] if shape else 1)  # int8 weights, one fp32 scale per row
    return nf4_bytes(numel)


@dataclass(frozen=True)
class LayerSplit:
    """One layer's parameters under LoRA: trained (adapters, ``modules_to_save``) and frozen (the base),
    the base's stored bytes, and the base's elements in a device slot (a tied head's included)."""

    trainable: int
    frozen: int
    stored: int  # bytes of the layer's own frozen tensors as stored (a tied head's are the pre layer's)
    slot: int  # frozen elements the relay dequantizes into a device slot for this layer
    tied_stored: int = 0  # bytes of the tied tensors the post layer loads from the pre layer's
    largest: int = 0  # elements of the largest quantized tensor (decoded to fp32 before the cast)


@dataclass(frozen=True)
class PeftShape:
    """A model's LoRA numbers for the planner (torch-free once built)."""

    r: int
    target_modules: tuple[str, ...] | str
    base_dtype: str
    base_source: str
    num_layers: int
    pre: LayerSplit
    block: LayerSplit
    post: LayerSplit

    def layers(self) -> list[LayerSplit]:
        """Every layer in order: the embeddings, the blocks, the head."""
        return [self.pre] + [self.block] * self.num_layers + [self.post]

    @property
    def on_disk(self) -> bool:
        from l2l_cli.config.schema import BASE_SOURCES

        return self.base_source == BASE_SOURCES[1]

    @property
    def trainable(self) -> int:
        return sum(x.trainable for x in self.layers())

    @property
    def frozen(self) -> int:
        return sum(x.frozen for x in self.layers())

    @property
    def stored(self) -> int:
        """Bytes of the whole frozen base as stored (in RAM, or in its files on disk)."""
        return sum(x.stored for x in self.layers())

    @property
    def max_trainable(self) -> int:
        return max(x.trainable for x in self.layers())

    @property
    def max_slot(self) -> int:
        return max(x.slot for x in self.layers())

    @property
    def max_stored(self) -> int:
        return max(x.stored + x.tied_stored for x in self.layers())

    @property
    def base_bytes_per_param(self) -> float:
        """The stored base's bytes per frozen parameter (block scales, padding and bf16 rest included)."""
        return self.stored / max(1, self.frozen)

    def readahead_bytes(self) -> float:
        """RAM of a base on disk: the layer being loaded and the ``READ_AHEAD`` read ahead of it (the largest
        layers, as a bound)."""
        return (READ_AHEAD + 1) * self.max_stored

    def loads(self, prefetch: bool) -> list[int]:
        """How often each layer's base is loaded into a device slot in a step: once in the forward and once
        for the backward (its recompute and backward run from that one load), but the head (still in its
        slot at the turn) and, with the relay's prefetch, the last block (still in the other slot)."""
        n = self.num_layers + 2
        out = [2] * n
        out[-1] = 1
        if prefetch and n >= 2:
            out[-2] = 1
        return out

    def bytes_loaded(self, prefetch: bool) -> float:
        """Stored bytes copied toward the device per step (the run's ``peft.base_bytes_loaded_per_step``)."""
        return sum(k * (x.stored + x.tied_stored) for k, x in zip(self.loads(prefetch), self.layers()))

    def bytes_read(self, prefetch: bool) -> float:
        """Bytes read from the base's files per step (``peft.base_bytes_read_per_step``): each load reads the
        layer's file; a tied head also reads the pre layer's whole file."""
        if not self.on_disk:
            return 0.0
        tied = self.pre.stored if self.post.tied_stored else 0
        return sum(k * x.stored for k, x in zip(self.loads(prefetch), self.layers())) + tied

    def dequant_bytes(self, compute_bytes: int) -> float:
        """Device bytes a load moves to dequantize one step's layers: the stored parts read, the decoded
        fp32 tensor written and read (torchao decodes to the input's fp32), the slot written in the compute
        type (a plain base: one cast copy). Per step, over every load."""
        per = []
        for x in self.layers():
            if self.base_dtype in PLAIN_BYTES:
                per.append(x.stored + compute_bytes * x.slot)
            else:
                per.append(x.stored + (8 + compute_bytes) * x.slot)
        return sum(k * b for k, b in zip(self.loads(True), per))

    def summary(self, total_params: int) -> dict[str, Any]:
        return {
            "r": self.r,
            "target_modules": list(
                (self.target_modules,) if isinstance(self.target_modules, str) else self.target_modules
            ),
            "base_dtype": self.base_dtype,
            "base_source": self.base_source,
            "base_on_disk": self.on_disk,
            "trainable_params": self.trainable,
            "frozen_params": self.frozen,
            "base_bytes": self.stored,
            "base_bytes_per_param": self.base_bytes_per_param,
            "per_layer": {k: vars(getattr(self, k)) for k in ("pre", "block", "post")},
            "total_params": total_params,
        }


def peft_shape(spec: Any, cfg_peft: Any) -> PeftShape:
    """The LoRA numbers of ``spec`` (the family's spec, no adapters) under ``peft.*``: what
    ``models/lora.py`` injects (its ``targets`` on the family's meta layers; PEFT's ``lora_A`` r×in and
    ``lora_B`` out×r per target) and what ``engine/frozen.py`` stores."""
    from l2l_cli.models.base import BLOCK, POST, PRE
    from l2l_cli.models.lora import LoraSettings, _matches, for_model, targets

    lora = for_model(spec, LoraSettings.from_cfg(cfg_peft))  # (a classifier's head trains: PEFT's rule)
    tied = spec.tied_params()
    split: dict[str, LayerSplit] = {}
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    for kind in (PRE, BLOCK, POST):
        layer = spec.new_layer(kind, "meta")
        mods = dict(layer.named_modules())
        adapted = set(targets(spec, kind, lora))
        adapters = 0
        for name in adapted:
            w = mods[name].weight
            fan_in, fan_out = (
                (w.shape[0], w.shape[1])
                if type(mods[name]).__name__ == "Conv1D"
                else (w.shape[1], w.shape[0])
            )
            adapters += lora.r * (fan_in + fan_out) + (fan_out if lora.use_dora else 0)  # (DoRA's magnitude)
        saved = 0
        frozen, stored, slot, largest = 0, 0, 0, 0
        params = dict(layer.named_parameters())
        shapes[kind] = {n: tuple(p.shape) for n, p in params.items()}
        for n, p in params.items():
            owner = n.rpartition(".")[0]
            if any(_matches(owner, t) or f".{t}." in f".{owner}." for t in lora.modules_to_save):
                saved += p.numel()
                continue
            slot += p.numel()
            if kind == POST and n in tied:
                continue
            frozen += p.numel()
            quantize = kind == BLOCK and owner in mods and _linear(mods[owner]) and n.endswith("weight")
            stored += stored_bytes(tuple(p.shape), lora.base_dtype, quantize)
            if quantize:
                largest = max(largest, p.numel())
        split[kind] = LayerSplit(adapters + saved, frozen, stored, slot, 0, largest)
    tied_stored = sum(stored_bytes(shapes[PRE][pre], lora.base_dtype, False) for pre in tied.values())
    post = split[POST]
    split[POST] = LayerSplit(post.trainable, post.frozen, post.stored, post.slot, tied_stored, post.largest)
    return PeftShape(
        lora.r,
        lora.target_modules,
        lora.base_dtype,
        lora.base_source,
        spec.num_layers,
        split[PRE],
        split[BLOCK],
        split[POST],
    )


def _linear(m: Any) -> bool:
    from torch import nn

    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
