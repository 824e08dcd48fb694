"""The whole model resident in one place (how the baselines, Alg. 1 and 2, hold it): pre · blocks · post
built from a family's :class:`~l2l_cli.models.base.ModelSpec`. Apart from ``base.py`` because it is torch's
``nn.Module`` and the spec is read without torch (``l2l plan``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from l2l_cli.models.base import ModelSpec


class LayeredModel(nn.Module):
    """The whole model, resident in one place: how the baselines (Alg. 1 and 2) hold it."""

    def __init__(self, spec: ModelSpec, seed: int = 0, device: torch.device | str | None = None):
        super().__init__()
        self.spec = spec
        self.pre = spec.build_layer(0, seed, device)
        self.blocks = nn.ModuleList(spec.build_layer(i, seed, device) for i in range(1, spec.num_layers + 1))
        self.post = spec.build_layer(spec.num_layers + 1, seed, device)
        self.tied = spec.tied_params()
        for post_name, pre_name in self.tied.items():  # a tied LM head: the post layer uses pre's tensor
            owner, _, leaf = post_name.rpartition(".")
            self.post.get_submodule(owner)._parameters[leaf] = self.pre.get_parameter(pre_name)

    def layers(self) -> Iterator[tuple[int, nn.Module]]:
        """(global index, module) for pre, blocks, post."""
        yield 0, self.pre
        yield from enumerate(self.blocks, start=1)
        yield self.spec.num_layers + 1, self.post

    def forward(
        self, batch: Any, seed_fn: Callable[[int], None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(loss, logits) of a (micro-)batch. ``seed_fn(layer)`` reseeds dropout before each layer, so a
        layer-by-layer runner can reproduce the exact dropout masks."""
        spec = self.spec
        if seed_fn:
            seed_fn(0)
        x = spec.run_layer(self.pre, 0, None, batch, None)
        side = spec.side_inputs(batch, x.dtype)
        for i, block in enumerate(self.blocks, start=1):
            if seed_fn:
                seed_fn(i)
            x = spec.run_layer(block, i, x, batch, side)
        if seed_fn:
            seed_fn(spec.num_layers + 1)
        return spec.run_head(self.post, x, batch)

    def own_parameters(self, index: int, layer: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """Layer ``index``'s parameters, less the tied ones it borrows from the pre layer (counted, clipped,
        saved and loaded once: as the pre layer's)."""
        skip = self.tied if index == self.spec.num_layers + 1 else {}
        return [(n, p) for n, p in layer.named_parameters() if n not in skip]

    def hf_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter by Hugging Face name (``trainable_only``: those that train, where a frozen base
        carries adapters; all of them otherwise)."""
        return {
            self.spec.hf_name(i, n): p
            for i, layer in self.layers()
            for n, p in self.own_parameters(i, layer)
            if p.requires_grad or not trainable_only
        }

    @torch.no_grad()
    def load_hf_state_dict(self, tensors: Any) -> list[str]:
        """Copy matching HF tensors in; returns the names left at their initialization."""
        missing = []
        for i, layer in self.layers():
            for n, p in self.own_parameters(i, layer):
                t = self.spec.lookup_hf(tensors, self.spec.hf_name(i, n))
                if t is None:
                    missing.append(self.spec.hf_name(i, n))
                else:
                    p.copy_(t)
        return missing
