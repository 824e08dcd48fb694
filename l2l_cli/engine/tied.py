"""A tied LM head in the L2L engine: one master copy, two uses.

A decoder's output projection is often its input embedding (GPT-2, Llama-3.2-1B: ``tie_word_embeddings``).
The EPS keeps that tensor once, in the pre layer's flat master with its optimizer state; the post layer's
layout leaves it out. When the relay loads the post layer it copies the pre layer's current send copy of
the tensor into the slot right after the post layer's own parameters, so the head computes with it like
any other weight. When the post layer's gradient leaves the device, the part for the tied tensor lands in
a host buffer here, and the EPS adds it into the pre layer's gradient before it reduces, norms, clips and
updates that layer: the update sees the sum of both uses, exactly what autograd's accumulation into one
shared parameter gives the baselines. The head runs at the turn, long before the pre layer's backward, so
the add never waits in practice.
"""

from __future__ import annotations

import torch

from l2l_cli.engine.copies import DONE, CopyHandle
from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.models.base import POST, ModelSpec


class TiedWeights:
    """The post layer's parameters that are the pre layer's, and the post layer's gradient of them."""

    def __init__(
        self, spec: ModelSpec, pre: FlatLayout, acc: Accelerator, dtype: torch.dtype = torch.float32
    ):
        names = spec.tied_params()  # post layer name -> pre layer name
        self.layout = FlatLayout(spec.new_layer(POST, "meta"), only=names)
        owner = {e.name: e for e in pre.entries}
        # (offset in the pre layer's flat buffer, offset in this layout, numel) per tied tensor
        self.pieces: list[tuple[int, int, int]] = []
        for e in self.layout.entries:
            src = owner[names[e.name]]
            if src.shape != e.shape:
                raise ValueError(f"tied {e.name} {e.shape} is not the shape of {src.name} {src.shape}")
            self.pieces.append((src.offset, e.offset, e.numel))
        self.numel = self.layout.numel
        half = dtype != torch.float32
        self.g = acc.host_empty(self.numel, link=not half).zero_()  # the post layer's gradient of the tied
        # CMP: it crosses the link in the device's half type and is widened here, as every gradient is
        self.g_recv = acc.host_empty(self.numel, dtype, link=True) if half else None
        self.grad_in: CopyHandle = DONE

    def load(
        self, acc: Accelerator, dst: torch.Tensor, pre_send: torch.Tensor, after: object
    ) -> list[CopyHandle]:
        """Copy the pre layer's current tensors into ``dst`` (the slot, after the post layer's own)."""
        return [acc.h2d.copy(dst[o : o + n], pre_send[po : po + n], after=after) for po, o, n in self.pieces]

    def send_grads(self, acc: Accelerator, src: torch.Tensor, after: object) -> CopyHandle:
        """The post layer's gradient of the tied tensors, from its slot to the host."""
        self.grad_in = acc.d2h.copy(self.g if self.g_recv is None else self.g_recv, src, after=after)
        return self.grad_in

    def add_into(self, g_pre: torch.Tensor) -> None:
        """Sum the head's use into the pre layer's gradient (before it is reduced, normed and applied)."""
        self.grad_in.wait()
        if self.g_recv is not None:
            self.g.copy_(self.g_recv)
        for po, o, n in self.pieces:
            g_pre[po : po + n].add_(self.g[o : o + n])
