"""Optimizers (AdamW, LAMB), the learning-rate schedule, and gradient clipping / non-finite checks.

The baselines and the eager param-server use the same optimizer classes over the same parameter tensors
(the EPS passes views into its flat per-layer buffers), so every mode computes the same update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # torch is imported where an optimizer is built or a norm taken, so ``l2l plan`` reads
    import torch  # the registry (``OPTIMIZERS``) without it
    from torch import nn


def no_decay(name: str) -> bool:
    """BERT's rule, for every family: no weight decay on biases and normalization weights (BERT's
    ``LayerNorm``, GPT-2's ``ln_1``/``ln_f``, Llama's RMSNorm ``input_layernorm``/``norm``)."""
    owner = name.rpartition(".")[0].rpartition(".")[2]
    return name.endswith("bias") or "norm" in name.lower() or owner.startswith("ln_")


def param_groups(named: Iterable[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict[str, Any]]:
    decay, plain = [], []
    for n, p in named:
        (plain if no_decay(n) else decay).append(p)
    return [
        g
        for g in ({"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0})
        if g["params"]
    ]


@dataclass(frozen=True)
class OptimizerKind:
    """An optimizer ``optim.name`` selects: how to build it over parameter groups, and whether its update
    is elementwise, which the EPS and the pipeline rely on (one flat run per decay group for the fused
    kernel, the trailing update's early rows, a shard of a layer updated alone). LAMB's trust ratio is
    a norm over each whole parameter tensor, so it is not."""

    name: str
    build: Callable[[list[dict[str, Any]], OptimSettings], torch.optim.Optimizer]
    elementwise: bool


def _adamw(groups: list[dict[str, Any]], o: OptimSettings) -> torch.optim.Optimizer:
    import torch

    # torch's fused AdamW kernel runs on CPU too and is ~5x faster there than the default for-loop one
    return torch.optim.AdamW(
        groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, fused=True
    )


def _lamb(groups: list[dict[str, Any]], o: OptimSettings) -> torch.optim.Optimizer:
    from l2l_cli.engine.lamb import Lamb

    return Lamb(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


OPTIMIZERS: dict[str, OptimizerKind] = {
    k.name: k for k in (OptimizerKind("adamw", _adamw, elementwise=True), OptimizerKind("lamb", _lamb, False))
}


@dataclass(frozen=True)
class OptimSettings:
    """The optimizer and its schedule (``optim.*``), as the runners and the EPS take them."""

    name: str
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    warmup_ratio: float
    warmup_steps: int | None
    schedule: str

    @property
    def kind(self) -> OptimizerKind:
        return OPTIMIZERS[self.name]

    @property
    def elementwise(self) -> bool:
        return self.kind.elementwise

    @classmethod
    def from_cfg(cls, o: Any) -> OptimSettings:
        return cls(o.name, o.lr, o.weight_decay, o.beta1, o.beta2, o.eps, o.warmup_ratio, o.warmup_steps,
                   o.schedule)  # fmt: skip


def make_optimizer(groups: list[dict[str, Any]], o: OptimSettings) -> torch.optim.Optimizer:
    return o.kind.build(groups, o)


# ---- optimizers over flat buffers ----------------------------------------------------------------


class RunLayout(Protocol):
    """What ``optimizer_runs`` reads of a flat layer layout (engine/flat.py's ``FlatLayout``, which
    imports ``no_decay`` from here): its size, its weight-decayed prefix, and its tensors' entries."""

    numel: int
    n_decay: int

    @property
    def entries(self) -> Sequence[Any]: ...  # .name, .offset, .numel of each parameter tensor


def optimizer_runs(layout: RunLayout, elementwise: bool) -> list[tuple[str, int, int]]:
    """Where a layer's flat buffer splits into the optimizer's parameters, (name, start, end): an
    elementwise update (AdamW) takes two long runs, the weight-decayed prefix (``decay``) and the rest
    (``bias``), for the fused kernel; LAMB's trust ratio is a norm per parameter tensor, so one run per
    tensor, by its own name. A run may be empty; ``param_groups`` sorts runs into decay groups by name."""
    if elementwise:
        return [("decay", 0, layout.n_decay), ("bias", layout.n_decay, layout.numel)]
    return [(e.name, e.offset, e.offset + e.numel) for e in layout.entries]


def bind_flat(
    runs: Iterable[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]], o: OptimSettings
) -> torch.optim.Optimizer:
    """An optimizer working in place on flat buffers: each run (name, w, g, exp_avg, exp_avg_sq) is one
    parameter, a view of the weights whose ``.grad`` is a view of the gradient, and its moments are views
    too (they shard, gather and checkpoint as flat buffers). Weight decay by ``param_groups`` on the names."""
    import torch
    from torch import nn

    named, moments = [], []
    for name, w, g, m, v in runs:
        p = nn.Parameter(w)
        p.grad = g
        named.append((name, p))
        moments.append((p, m, v))
    optimizer = make_optimizer(param_groups(named, o.weight_decay), o)
    for p, m, v in moments:
        optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32), "exp_avg": m, "exp_avg_sq": v}
    return optimizer


def lr_at(step: int, total_steps: int, o: OptimSettings) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then linear decay to 0."""
    warmup = o.warmup_steps if o.warmup_steps is not None else int(o.warmup_ratio * total_steps)
    if warmup and step < warmup:
        return o.lr * (step + 1) / warmup
    if o.schedule == "constant":
        return o.lr
    return o.lr * max(0.0, (total_steps - step) / max(1, total_steps - warmup))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def layer_norms(layers: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """The L2 norm of each layer's gradients (one value per layer, float32)."""
    import torch

    out = []
    device = next((gs[0].device for gs in layers if len(gs)), None)
    for grads in layers:
        if not grads:  # a layer with nothing to train (a frozen base's embeddings, peft=lora)
            out.append(torch.zeros((), dtype=torch.float32, device=device))
        elif len(grads) == 1:
            out.append(torch.linalg.vector_norm(grads[0], dtype=torch.float32))
        else:
            out.append(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).float()))
    return torch.stack(out)


def clip_coefficients(norms: torch.Tensor, clip: str, max_norm: float) -> torch.Tensor | None:
    """Per-layer multipliers for ``clip`` (global: one shared coefficient from the total norm, as
    torch.nn.utils.clip_grad_norm_; layer: each layer by its own norm), or None for no clipping."""
    import torch

    if clip == "none":
        return None
    if clip == "global":
        total = torch.linalg.vector_norm(norms)
        return (max_norm / (total + 1e-6)).clamp(max=1.0).expand_as(norms)
    return (max_norm / (norms + 1e-6)).clamp(max=1.0)


def module_grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in module.parameters() if p.grad is not None]
