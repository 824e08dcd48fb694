"""The trainer's RNG states in plain JSON (no pickle anywhere): torch's (CPU and this rank's own CUDA
device), Python's, NumPy's. Every rank draws from its own generators (dropout on its own device), so a
checkpoint of several ranks keeps each rank's (``rng_ranks``) and each rank restores its own."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from l2l_cli.engine.device import cuda_rng_state, own_cuda_index, set_cuda_rng_state


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's RNG states in plain JSON (torch's are byte lists), its CUDA generator that of its own
    device (``device``, the accelerator's; None: the current CUDA device) only."""
    state: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state().tolist(),
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": _numpy_state(),
    }
    if (cuda := cuda_rng_state(device)) is not None:
        state["torch_cuda_device"] = cuda.tolist()
    return state


def _numpy_state() -> list[Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]


def rank_rng(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s RNG states in a trainer state (``state.json``): its own where the checkpoint holds
    every rank's, else the writer's (a checkpoint of one rank, or of fewer ranks than resume it)."""
    ranks = state.get("rng_ranks") or []
    return ranks[rank] if rank < len(ranks) else state["rng"]


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore ``state`` (:func:`rng_state`'s) in this process, the CUDA generator on its own device only. A
    checkpoint written before per-device states (``torch_cuda``: every visible device's) gives the entry
    of this device's index, where it has one."""
    torch.set_rng_state(torch.tensor(state["torch_cpu"], dtype=torch.uint8))
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    kind, keys, pos, has_gauss, g = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, g))
    own = state.get("torch_cuda_device")
    index = own_cuda_index(device)
    if own is None and state.get("torch_cuda") and index is not None:
        old = state["torch_cuda"]
        own = old[index] if index < len(old) else None
    if own is not None:
        set_cuda_rng_state(torch.tensor(own, dtype=torch.uint8), device)
