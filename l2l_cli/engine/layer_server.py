"""What every part of the eager param-server works on: the layers' host state in their tier, the EPS thread,
and the two things done to a layer, reducing its gradient and updating it.

:class:`~l2l_cli.engine.eps.EagerParamServer` is this plus the schedules built on it (L2L's update after the
backward, L2L-p's speculative update and trailing update) and its files; those parts take a
:class:`LayerServer`, so none of them imports the EPS and the EPS imports them all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist

from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.dist import DistContext
from l2l_cli.engine.eps_files import EpsFiles
from l2l_cli.engine.eps_worker import EpsWorker
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.frozen import FrozenBase
from l2l_cli.engine.layer_state import LayerState
from l2l_cli.engine.optim import OptimSettings
from l2l_cli.engine.tied import TiedWeights
from l2l_cli.engine.tiers import TierSettings, make_tier
from l2l_cli.models.base import BLOCK, POST, PRE, ModelSpec
from l2l_cli.models.lora import lora_of
from l2l_cli.profiling.timers import PhaseTimer

KINDS = (PRE, BLOCK, POST)


def grad_mult(scale: float, coef: torch.Tensor | None) -> torch.Tensor | float | None:
    """The one multiplier that unscales (``scale``: the loss scale times the ranks averaged over) and clips
    (``coef``) a gradient (None: as is)."""
    inv = 1.0 / scale
    if coef is None:
        return None if inv == 1.0 else inv
    return coef * inv


class LayerServer:
    """All layers' host state (built straight into its tier, layer by layer), the EPS thread, and the
    per-layer reduction and update."""

    def __init__(
        self, spec: ModelSpec, optim: OptimSettings, acc: Accelerator, device_dtype: torch.dtype, seed: int,
        dist: DistContext | None = None, eager_reduce: bool = True, tier: TierSettings | None = None,
        timer: PhaseTimer | None = None,
    ):  # fmt: skip
        self.spec, self.acc = spec, acc
        self.dist = dist or DistContext()
        # the EPS's own thread: reduces (and, for L2L-p, updates) each layer while the device computes
        self.worker = EpsWorker(acc)
        self.elementwise = optim.elementwise  # an update can be split by element (LAMB's can't)
        self.realtime: Any = None  # checkpoint.RealtimeWriter: saves each layer right after its update
        self.eager_reduce = eager_reduce
        lora = lora_of(spec)
        # adapters on a frozen base (peft=lora): the EPS's state is the trainable tensors only; the base
        # is held apart, once, in its own precision (engine/frozen.py), and never updated
        trainable = {k: spec.trainable_names(k) for k in KINDS} if lora else None  # type: ignore[attr-defined]
        self.layouts = {
            k: FlatLayout(spec.new_layer(k, "meta"), only=trainable[k] if trainable else None) for k in KINDS
        }  # fmt: skip
        # where the layers' buffers live: host RAM, or files with a few layers cached (eps.tier)
        self.tier = make_tier(tier or TierSettings(), spec, self.layouts, acc, device_dtype, optim, timer)
        # a tied LM head: its tensor lives once, in the pre layer's master (see engine/tied.py); with
        # adapters it is a frozen base tensor, kept once by the frozen base
        tied = spec.tied_params() if not lora else {}
        if not lora:
            self.layouts = {
                k: FlatLayout(spec.new_layer(k, "meta"), skip=tied if k == POST else ()) for k in KINDS
            }  # fmt: skip
        self.ties = TiedWeights(spec, self.layouts[PRE], acc, device_dtype) if tied else None
        self.base: FrozenBase | None = None
        self.frozen_layouts: dict[str, FlatLayout] = {}
        if lora and trainable is not None:
            self.frozen_layouts = {k: FlatLayout(spec.new_layer(k, "meta"), skip=trainable[k]) for k in KINDS}
            where = tier.path if tier is not None and tier.path else None  # a base on disk: under eps.path
            self.base = FrozenBase(
                spec, self.frozen_layouts, lora, Path(where) / "frozen_base" if where else None, seed
            )
        self.layers: list[LayerState] = []
        self.files = EpsFiles(spec, self.layers, self.tier)
        with acc.meter.paused():  # host tier
            for i in range(spec.num_all_layers):
                kind = spec.kind(i)
                st = self.tier.new_layer(i, kind, self.layouts[kind], acc, device_dtype, optim)
                if not self.tier.adopted or self.base is not None:  # (a disk tier continuing a run has its
                    layer = spec.build_layer(i, seed)  # state already) one layer's module at a time
                    if self.base is not None:
                        self.base.put(i, layer)
                if not self.tier.adopted:
                    with self.tier.holding(i, "wmv", fresh=True, dirty=True):
                        st.layout.pack(layer, st.w)
                        st.refresh_send()
                self.layers.append(st)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerState:
        return self.layers[i]

    def device_numel(self, kind: str) -> int:
        """Elements of a layer of ``kind`` in a device slot: its own, and the post layer's tied ones."""
        extra = self.ties.numel if self.ties is not None and kind == POST else 0
        return self.layouts[kind].numel + extra

    @property
    def max_layer_numel(self) -> int:
        return max(self.device_numel(k) for k in self.layouts)

    @property
    def max_frozen_numel(self) -> int:
        """Elements of the largest layer's frozen base (0: no frozen base)."""
        return max((lay.numel for lay in self.frozen_layouts.values()), default=0)

    def layer_job(self, fn: Any, i: int, *args: Any) -> None:
        """A background job on layer i's gradient; once it is done the tier may move the gradient out."""
        try:
            self.worker.timed(fn, i, *args)
        finally:
            self.tier.release_grad(i)

    def reduce(self, i: int) -> None:
        """Wait for layer i's gradient to land, then sum it over the data-parallel ranks."""
        st = self.layers[i]
        st.grad_in.wait()
        st.land_grad()
        if i == 0 and self.ties is not None:  # a tied LM head: add the head's use before anything reads g
            self.ties.add_into(st.g)
        if self.dist.enabled:
            torch_dist.all_reduce(st.g, group=self.dist.eps_group)

    def update_layer(self, i: int, lr: float, grad_mult: torch.Tensor | float | None) -> None:
        if self.realtime is not None:
            self.realtime.before_update(i)  # last step's file of this layer is complete
        with self.tier.holding(i, "wmvg", dirty=True):  # the disk tier writes the new state back
            self.layers[i].update(lr, grad_mult)
        if self.realtime is not None:
            self.realtime.layer_updated(i, *self.layer_file(i))

    def layer_file(self, i: int) -> tuple[str, Any]:
        """(file name, a function giving its tensors) of layer i's checkpoint file (see :class:`EpsFiles`)."""
        return self.files.layer_file(i)

    def close(self) -> None:
        self.worker.shutdown()
        self.tier.close()
        if self.base is not None:
            self.base.close()
