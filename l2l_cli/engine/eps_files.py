"""The EPS's state as files: its own checkpoint (one file per layer: w, m, v, step, and the optimizer's other
state, 8-bit AdamW's m_absmax and v_absmax; the same for full and real-time checkpoints) and the model's
weights in Hugging Face names, in and out.

Apart from the EPS because it is I/O, not training: it reads the layers through their tier (a disk tier
pins each layer while it is read or written) and never touches the EPS's thread or its updates.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from l2l_cli.checkpoint import CheckpointError, read_tensors, tensors_bytes
from l2l_cli.engine.layer_state import LayerState
from l2l_cli.engine.tiers import Tier
from l2l_cli.models.base import ModelSpec


class EpsFiles:
    """Reads and writes the state of ``layers`` (held in ``tier``)."""

    def __init__(self, spec: ModelSpec, layers: list[LayerState], tier: Tier):
        self.spec, self.layers, self.tier = spec, layers, tier
        # the model's number of each of these layers, which names its file (a pipeline rank's EPS holds some
        # of the model's layers; its files are one process's, so either resumes the other's); None: all
        self.numbers: list[int] | None = None

    def file_name(self, i: int) -> str:
        """Layer i's checkpoint file, by the model's layer number."""
        return f"layer_{i if self.numbers is None else self.numbers[i]}.safetensors"

    # ---- checkpoints: one file per layer (w, m, v, step), the same for full and real-time ones --------

    def layer_file(self, i: int) -> tuple[str, Any]:
        """(file name, a function giving its tensors): views of the live buffers, taken when called."""
        st = self.layers[i]

        def payload() -> dict[str, torch.Tensor]:
            step = next(iter(st.optimizer.state.values()))["step"]
            return {"w": st.w, **st.moments, "step": step.reshape(())}

        return self.file_name(i), payload

    def state_files(self) -> Iterator[tuple[str, bytes]]:
        for i in range(len(self.layers)):
            name, payload = self.layer_file(i)
            with self.tier.holding(i, "wmv"):
                data = tensors_bytes(payload())
            yield name, data

    @torch.no_grad()
    def load_state(self, ckpt: Any, manifest: dict[str, Any]) -> None:
        for st in self.layers:
            t = read_tensors(ckpt, self.file_name(st.index), manifest)
            with self.tier.holding(st.index, "wmv", fresh=True, dirty=True):
                for key, buf in (("w", st.w), *st.moments.items()):
                    if key not in t or t[key].shape != buf.shape or t[key].dtype != buf.dtype:
                        raise CheckpointError(f"{ckpt}: layer {st.index} {key} does not match this model")
                    buf.copy_(t[key])
                st.set_step(float(t["step"]))
                st.version += 1
                st.refresh_send()

    # ---- checkpoints in Hugging Face names ---------------------------------------------------------

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for st in self.layers:
            with self.tier.holding(st.index, "w"):
                named = [
                    (self.spec.hf_name(st.index, n), self.tier.export(t)) for n, t in st.layout.views(st.w)
                ]
            yield from named

    @torch.no_grad()
    def load_hf(self, tensors: Any) -> list[str]:
        """Stream matching tensors into the masters (one tensor at a time); returns names left at init."""
        missing = []
        for st in self.layers:
            with self.tier.holding(st.index, "wmv", dirty=True):
                for name, view in st.layout.views(st.w):
                    full = self.spec.hf_name(st.index, name)
                    t = self.spec.lookup_hf(tensors, full)
                    if t is None:
                        missing.append(full)
                    else:
                        view.copy_(t.reshape(view.shape))
                st.version += 1
                st.refresh_send()
        return missing
