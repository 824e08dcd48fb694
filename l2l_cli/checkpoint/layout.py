"""The module layout: weights and optimizer moments by Hugging Face name (``ModeSpec.state_layout``
``module-v1``), every runner's that is not the EPS's (the EPS writes one file per layer:
engine/eps_files.py)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from l2l_cli.checkpoint.io import tensors_bytes
from l2l_cli.checkpoint.manifest import CheckpointError, read_tensors

WEIGHTS_FILE, MOMENTS_FILE = "model.safetensors", "optimizer.safetensors"


def module_state_files(
    weights: Mapping[str, torch.Tensor], moments: Mapping[str, Mapping[str, Any]]
) -> Iterator[tuple[str, bytes]]:
    """The module layout (``ModeSpec.state_layout`` ``module-v1``), every runner's that is not the EPS's:
    ``model.safetensors`` holds the weights by Hugging Face name; ``optimizer.safetensors``, for each
    parameter the optimizer has stepped, ``<name>.exp_avg``, ``<name>.exp_avg_sq`` and ``<name>.step``,
    and any other tensor of its state as ``<name>.<key>`` (8-bit AdamW: uint8 codes in the moments and
    ``exp_avg_absmax``, ``exp_avg_sq_absmax``). ``moments``: {name: its optimizer state (``step``: a
    tensor or a number)}. Written by name, not by rank or stage, so any runner resumes from any other's (a
    pipeline resharded)."""
    yield WEIGHTS_FILE, tensors_bytes(dict(weights))
    flat: dict[str, torch.Tensor] = {}
    for name, st in moments.items():
        flat |= {f"{name}.{k}": t for k, t in st.items() if k != "step"}
        flat[f"{name}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(())
    yield MOMENTS_FILE, tensors_bytes(flat)


class ModuleState:
    """A verified checkpoint's module layout, read once; ``load`` copies it into a runner's tensors."""

    def __init__(self, ckpt: Path, manifest: dict[str, Any]):
        self.ckpt = ckpt
        self.weights = read_tensors(ckpt, WEIGHTS_FILE, manifest)
        self.moments = read_tensors(ckpt, MOMENTS_FILE, manifest)

    @torch.no_grad()
    def load(
        self, params: Iterable[tuple[str, torch.Tensor]], *, whole: bool = False
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Copy each (HF name, tensor)'s weights in place; returns the optimizer state of those the
        checkpoint has moments for, {name: {exp_avg, exp_avg_sq, step, and any other key}} (on the CPU,
        not copied).
        ``whole``: the checkpoint must hold exactly these names (a runner with the whole model); otherwise
        any superset (a pipeline rank's layers)."""
        params = list(params)
        if whole and set(self.weights) != {name for name, _ in params}:
            raise CheckpointError(f"{self.ckpt}: {WEIGHTS_FILE} does not hold this model's parameters")
        out = {}
        keys: dict[str, list[str]] = {}  # parameter name -> its state's keys
        for full in self.moments:
            name, _, key = full.rpartition(".")
            keys.setdefault(name, []).append(key)
        for name, t in params:
            if name not in self.weights:
                raise CheckpointError(f"{self.ckpt}: {WEIGHTS_FILE} has no {name}")
            w = self.weights[name]
            if w.shape != t.shape:
                raise CheckpointError(
                    f"{self.ckpt}: {name} has shape {tuple(w.shape)}, expected {tuple(t.shape)}"
                )
            t.copy_(w)
            if f"{name}.exp_avg" in self.moments:
                out[name] = {k: self.moments[f"{name}.{k}"] for k in keys[name]}
        return out
