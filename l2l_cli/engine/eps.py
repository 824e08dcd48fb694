"""The eager param-server (EPS): the only owner of training state in the L2L modes.

Per layer it holds, in host memory, one contiguous FP32 master buffer (pinned when CUDA is present), the
gradient that arrives from the device, the optimizer moments, and a half-precision send copy under CMP;
and the host optimizer that updates that layer. It is built layer by layer straight into these buffers
(random init or streamed from a checkpoint), so no second full copy of the model ever exists: a model
whose training state fits in host RAM trains, however deep. It also holds the CPU activation stash.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from l2l_cli.engine.device import DONE, Accelerator, CopyHandle
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.optim import clip_coefficients, make_optimizer, param_groups, set_lr
from l2l_cli.engine.precision import LossScaler
from l2l_cli.models.bert import BLOCK, POST, PRE, ModelSpec, build_layer, hf_name, lookup_hf, new_layer
from l2l_cli.profiling.timers import PhaseTimer


class LayerState:
    """One layer's training state in host memory, and the optimizer that updates it."""

    def __init__(
        self, index: int, kind: str, layout: FlatLayout, acc: Accelerator, send_dtype: torch.dtype, cfg: Any
    ):
        n = layout.numel
        self.index, self.kind, self.layout = index, kind, layout
        self.w = acc.host_empty(n)  # FP32 master
        self.g = acc.host_empty(n).zero_()  # this step's gradient (copied from the device, reduced)
        self.m = acc.host_empty(n).zero_()  # optimizer moments (AdamW / LAMB)
        self.v = acc.host_empty(n).zero_()
        self.w_send = acc.host_empty(n, send_dtype) if send_dtype != torch.float32 else None
        self.version = 0  # bumped by every update; the relay reloads a layer whose version moved on
        self.grad_in: CopyHandle = DONE  # the device->host copy of this step's gradient
        named = []
        grads, ms, vs = dict(layout.views(self.g)), dict(layout.views(self.m)), dict(layout.views(self.v))
        for name, view in layout.views(self.w):
            p = nn.Parameter(view)
            p.grad = grads[name]
            named.append((name, p))
        self.optimizer = make_optimizer(param_groups(named, cfg.optim.weight_decay), cfg)
        for name, p in named:  # the moments live in the flat buffers (checkpointable per layer as 4 tensors)
            self.optimizer.state[p] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": ms[name],
                "exp_avg_sq": vs[name],
            }

    @property
    def send(self) -> torch.Tensor:
        """What crosses the link to the device: the master, or its half copy under CMP."""
        return self.w if self.w_send is None else self.w_send

    def refresh_send(self) -> None:
        if self.w_send is not None:
            self.w_send.copy_(self.w)

    def update(self, lr: float, grad_mult: torch.Tensor | float | None) -> None:
        """Apply this step's gradient (times ``grad_mult``: unscale and clip) to the master."""
        if grad_mult is not None:
            self.g.mul_(grad_mult)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.version += 1
        self.refresh_send()

    def nbytes(self) -> dict[str, int]:
        return {
            "master": self.w.nbytes,
            "grads": self.g.nbytes,
            "optimizer_state": self.m.nbytes + self.v.nbytes,
            "send_copy": self.w_send.nbytes if self.w_send is not None else 0,
        }


class EagerParamServer:
    """All layers' host state, the host update, and the CPU activation stash."""

    def __init__(self, spec: ModelSpec, cfg: Any, acc: Accelerator, device_dtype: torch.dtype, seed: int):
        self.spec, self.acc = spec, acc
        self.layouts = {k: FlatLayout(new_layer(spec, k, "meta")) for k in (PRE, BLOCK, POST)}
        self.layers: list[LayerState] = []
        with acc.meter.paused():  # host tier
            for i in range(spec.num_all_layers):
                kind = spec.kind(i)
                st = LayerState(i, kind, self.layouts[kind], acc, device_dtype, cfg)
                st.layout.pack(build_layer(spec, i, seed), st.w)  # one layer's module at a time
                st.refresh_send()
                self.layers.append(st)
        self.stash_bytes = 0

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerState:
        return self.layers[i]

    @property
    def max_layer_numel(self) -> int:
        return max(layout.numel for layout in self.layouts.values())

    # ---- the update (Alg. 3: for l in layers: w_l = optimizer(w_l, g_l)) --------------------------

    def grad_norms(self, scaler: LossScaler) -> torch.Tensor:
        """Unscaled L2 norm of each layer's gradient."""
        return torch.stack([torch.linalg.vector_norm(st.g) for st in self.layers]) / scaler.scale

    def step(
        self, lr: float, scaler: LossScaler, clip: str, max_norm: float, timer: PhaseTimer
    ) -> tuple[bool, float]:
        """Wait for every layer's gradient, skip the step on a non-finite one, clip, update every layer."""
        with timer("transfer"):
            for st in self.layers:
                st.grad_in.wait()
        with timer("optimizer"), self.acc.meter.paused():
            norms = self.grad_norms(scaler)
            finite = bool(torch.isfinite(norms).all())
            scaler.update(not finite)
            if finite:
                coefs = clip_coefficients(norms, clip, max_norm)
                for i, st in enumerate(self.layers):
                    st.update(lr, self.grad_mult(scaler, None if coefs is None else coefs[i]))
        return finite, float(torch.linalg.vector_norm(norms))

    @staticmethod
    def grad_mult(scaler: LossScaler, coef: torch.Tensor | None) -> torch.Tensor | float | None:
        """The one multiplier that unscales and clips a layer's gradient (None: leave it as is)."""
        inv = 1.0 / scaler.scale
        if coef is None:
            return None if inv == 1.0 else inv
        return coef * inv

    # ---- checkpoints in Hugging Face names ---------------------------------------------------------

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for st in self.layers:
            for name, view in st.layout.views(st.w):
                yield hf_name(self.spec, st.index, name), view

    @torch.no_grad()
    def load_hf(self, tensors: Any) -> list[str]:
        """Stream matching tensors into the masters (one tensor at a time); returns names left at init."""
        missing = []
        for st in self.layers:
            for name, view in st.layout.views(st.w):
                full = hf_name(self.spec, st.index, name)
                t = lookup_hf(tensors, full)
                if t is None:
                    missing.append(full)
                else:
                    view.copy_(t.reshape(view.shape))
            st.version += 1
            st.refresh_send()
        return missing

    def host_parts(self) -> dict[str, int]:
        parts: dict[str, int] = {}
        for st in self.layers:
            for k, v in st.nbytes().items():
                parts[k] = parts.get(k, 0) + v
        parts["cpu_stash"] = self.stash_bytes
        return {k: v for k, v in parts.items() if v}

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for the CPU activation stash (counted in host memory)."""
        buf = self.acc.host_empty(numel, dtype)
        self.stash_bytes += buf.nbytes
        return buf
