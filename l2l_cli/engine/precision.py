"""Precision policies, as objects (possibly no-ops) so a runner never branches on dtype.

- FP32: everything in float32.
- AMP: float32 weights on the device, autocast compute (fp16 with dynamic loss scaling on CUDA; bf16 on
  CPU, where fp16 is unusable and bf16's range needs no scaling).
- CMP (L2L v2 §2.3): the device copy of each layer in half precision, pure half forward and backward, the
  FP32 master and the update in the eager param-server, dynamic loss scaling with skip on overflow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from l2l_cli.engine.device import Accelerator


class LossScaler:
    """Dynamic loss scaling: multiply the loss by ``scale``; on a non-finite gradient skip the step and
    halve the scale; after ``growth_interval`` good steps in a row double it. ``dynamic=False`` keeps the
    scale fixed (1.0 for FP32 and bf16), but non-finite gradients are still detected and skipped."""

    def __init__(self, scale: float = 1.0, dynamic: bool = False, growth_interval: int = 2000):
        self.scale = float(scale)
        self.dynamic = dynamic
        self.growth_interval = growth_interval
        self.good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.scale != 1.0 else loss

    def update(self, found_nonfinite: bool) -> None:
        if not self.dynamic:
            return
        if found_nonfinite:
            self.scale = max(self.scale / 2.0, 1.0)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= 2.0
                self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "dynamic": self.dynamic}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])


@dataclass
class Precision:
    name: str
    device_dtype: torch.dtype  # dtype of the layer weights on the device
    autocast_dtype: torch.dtype | None  # autocast compute dtype (AMP), None = run in device_dtype
    scaler: LossScaler
    acc: Accelerator

    def autocast(self) -> Any:
        return self.acc.autocast(self.autocast_dtype)

    @property
    def label(self) -> str:
        if self.name == "fp32":
            return "fp32"
        half = self.autocast_dtype or self.device_dtype
        return f"{self.name} ({str(half).removeprefix('torch.')})"


def make_precision(
    name: str,
    acc: Accelerator,
    *,
    dtype: str = "auto",
    loss_scale: str = "dynamic",
    init_scale: float = 65536.0,
    growth_interval: int = 2000,
) -> Precision:
    """The policy for ``name`` (fp32 | amp | cmp: precision.name as the mode runs it). ``dtype``: the
    half type (auto: the accelerator's); loss scaling is dynamic for fp16, and for CMP, whose gradients
    are half."""
    half = {"auto": acc.half_dtype, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    dynamic = loss_scale == "dynamic" and (half == torch.float16 or name == "cmp")
    if name == "fp32":
        return Precision("fp32", torch.float32, None, LossScaler(), acc)
    scaler = LossScaler(init_scale, True, growth_interval) if dynamic else LossScaler()
    if name == "amp":
        return Precision("amp", torch.float32, half, scaler, acc)
    return Precision("cmp", half, None, scaler, acc)
