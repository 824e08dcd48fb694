"""The native 8-bit AdamW kernel's quantization maps (``qmap_t`` in ``csrc/host_update.c``): each map's
values, its midpoints and the lookup table the kernel builds from them (the quantizer's slots, the
dequantizer's byte planes), and the kernel's quantizer and dequantizer alone, which the tests hold against
``torch.bucketize`` and the map; on the library :mod:`~l2l_cli.engine.host_passes` loads, which runs the
update."""

from __future__ import annotations

import ctypes
from typing import Any

import torch


class _QMap(ctypes.Structure):
    """A quantization map as the 8-bit AdamW kernel reads it (``qmap_t``)."""

    _fields_ = [("values", ctypes.c_void_p), ("mids", ctypes.c_void_p), ("base", ctypes.c_void_p)]


class QMap:
    """A quantization map for the native 8-bit AdamW: its values, its midpoints (a NaN after the last), the
    lookup table the kernel built from them, and the C struct pointing at the three (kept alive here)."""

    def __init__(self, values: torch.Tensor, mids: torch.Tensor, table: torch.Tensor):
        self.values, self.mids, self.table = values, mids, table
        self.args = _QMap(values.data_ptr(), mids.data_ptr(), table.data_ptr())


def native_qmap(lib: Any, values: torch.Tensor, mids: torch.Tensor) -> QMap | None:
    """A 256-entry quantization map (``values`` ascending, FP32; ``mids``: the 255 midpoints) as the native
    8-bit AdamW kernel reads it, or None: no native kernels here (``lib``, ``HostPasses.lib``, None), or a
    map too dense for its one-comparison lookup (it then runs as torch ops)."""
    if lib is None:
        return None
    table = torch.empty(int(lib.l2l_qmap_table_bytes()), dtype=torch.uint8)
    padded = torch.cat([mids.float().cpu(), torch.full((1,), float("nan"))]).contiguous()
    values = values.float().cpu().contiguous()
    if lib.l2l_qmap_init(values.data_ptr(), padded.data_ptr(), table.data_ptr()) > 1:
        return None
    return QMap(values, padded, table)


def codec(lib: Any, t: torch.Tensor, scale: float, qmap: QMap) -> torch.Tensor:
    """The native kernel's quantizer alone on FP32 ``t``: its codes of ``t / scale``, which must be
    ``torch.bucketize(t / scale, mids, right=True)``'s for every float; or its dequantizer alone on uint8
    codes ``t``: ``values[t] * scale`` (``lib``: ``HostPasses.lib``)."""
    assert lib is not None and t.is_contiguous() and t.dtype in (torch.float32, torch.uint8)
    quantize = t.dtype == torch.float32
    out = torch.empty(t.numel(), dtype=torch.uint8 if quantize else torch.float32)
    fn = lib.l2l_quantize if quantize else lib.l2l_dequantize
    fn(t.data_ptr(), scale, ctypes.byref(qmap.args), out.data_ptr(), t.numel())
    return out
