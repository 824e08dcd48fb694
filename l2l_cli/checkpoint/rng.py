"""The trainer's RNG states in plain JSON (no pickle anywhere): torch's (CPU and CUDA), Python's, NumPy's."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from l2l_cli.engine.device import cuda_rng_states, set_cuda_rng_states


def rng_state() -> dict[str, Any]:
    """Every RNG state in plain JSON (torch's are byte lists; no pickle anywhere)."""
    state: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state().tolist(),
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": _numpy_state(),
    }
    if (cuda := cuda_rng_states()) is not None:
        state["torch_cuda"] = [s.tolist() for s in cuda]
    return state


def _numpy_state() -> list[Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch_cpu"], dtype=torch.uint8))
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    kind, keys, pos, has_gauss, g = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, g))
    if "torch_cuda" in state:
        set_cuda_rng_states([torch.tensor(s, dtype=torch.uint8) for s in state["torch_cuda"]])
