"""The model as one rank of a pipeline of L2L stages sees it: its stages' layers only."""

from __future__ import annotations

from typing import Any

from torch import nn

from l2l_cli.models.base import ModelSpec


class RankLayers:
    """The model as this rank's EPS, relay and stash see it: only its stages' layers, numbered 0..k-1 in
    model order (local index j is the model's layer ``index[j]``); everything else is the model's."""

    def __init__(self, spec: ModelSpec, index: list[int]):
        self.spec, self.index = spec, index

    def __getattr__(self, name: str) -> Any:
        return getattr(self.spec, name)

    @property
    def num_all_layers(self) -> int:
        return len(self.index)

    def kind(self, j: int) -> str:
        return self.spec.kind(self.index[j])

    def build_layer(self, j: int, seed: int, device: Any = None) -> nn.Module:
        return self.spec.build_layer(self.index[j], seed, device)  # the model's seeded init of that layer

    def init_layer(self, module: nn.Module, j: int, seed: int) -> nn.Module:
        return self.spec.init_layer(module, self.index[j], seed)

    def hf_name(self, j: int, name: str) -> str:
        return self.spec.hf_name(self.index[j], name)

    def rows_read(self, j: int, batch: Any) -> Any:
        return self.spec.rows_read(self.index[j], batch)

    def tied_params(self) -> dict[str, str]:
        return {}  # a tied head is refused with dist.pipeline > 1 (settings.py)
