"""Optimizers (AdamW, LAMB, 8-bit AdamW), the learning-rate schedule, gradient clipping, non-finite checks.

The baselines and the eager param-server use the same optimizer classes over the same parameter tensors
(the EPS passes views into its flat per-layer buffers), so every mode computes the same update.
"""

from __future__ import annotations

import math
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


MIN_8BIT = 4096  # bitsandbytes' ``min_8bit_size``: a smaller tensor keeps FP32 moments under 8-bit AdamW
QBLOCK = 256  # elements per absmax of 8-bit AdamW's moments (bitsandbytes' and torchao's block)


@dataclass(frozen=True)
class StateBuffer:
    """One buffer of an optimizer's state per parameter tensor: ``key`` in the optimizer's state (and the
    checkpoint's module layout, ``<name>.<key>``), ``short`` its name in the EPS's layer files, its dtype
    (a torch dtype's name: the registry is read without torch), ``per``: parameter elements per entry (1:
    one per element; 256: one per block), and the tensors that hold it: those of at least ``min_numel``
    elements and, with ``below``, of fewer than ``below`` (8-bit AdamW keeps a small tensor's moments in
    FP32 under the same keys: of the buffers with one key, a tensor holds exactly one)."""

    key: str
    short: str
    dtype: str
    per: int = 1
    min_numel: int = 0
    below: int | None = None

    def holds(self, n: int) -> bool:
        """Whether a parameter tensor (or flat run) of ``n`` elements keeps this buffer."""
        return n >= self.min_numel and (self.below is None or n < self.below)

    def numel(self, n: int) -> int:
        """Entries for a parameter tensor (or flat run) of ``n`` elements: 0 where it does not hold it."""
        return -(-n // self.per) if self.holds(n) else 0

    @property
    def bytes_per_param(self) -> float:
        return ITEMSIZE[self.dtype] / self.per

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def moment(self) -> str:
        """The moment this buffer belongs to, ``m`` or ``v`` (its short name's first word): the disk tier's
        layer files keep each moment's buffers together, in one file part."""
        return self.short.partition("_")[0]


ITEMSIZE = {"float32": 4, "uint8": 1}  # bytes of a state buffer's entry, by its dtype
ADAM_FP32 = (StateBuffer("exp_avg", "m", "float32"), StateBuffer("exp_avg_sq", "v", "float32"))
# 8-bit AdamW: codes and per-block absmaxes for a tensor of MIN_8BIT elements or more, each tensor its own
# blocks; FP32 moments, as AdamW's, for a smaller one (a bias, a norm)
ADAM_8BIT = (
    StateBuffer("exp_avg", "m", "uint8", min_numel=MIN_8BIT),
    StateBuffer("exp_avg_sq", "v", "uint8", min_numel=MIN_8BIT),
    StateBuffer("exp_avg_absmax", "m_absmax", "float32", QBLOCK, min_numel=MIN_8BIT),
    StateBuffer("exp_avg_sq_absmax", "v_absmax", "float32", QBLOCK, min_numel=MIN_8BIT),
    StateBuffer("exp_avg", "m_fp32", "float32", below=MIN_8BIT),
    StateBuffer("exp_avg_sq", "v_fp32", "float32", below=MIN_8BIT),
)


@dataclass(frozen=True)
class OptimizerKind:
    """An optimizer ``optim.name`` selects: how to build it over parameter groups, and whether its update
    is elementwise, which the EPS and the pipeline rely on (the trailing update's early rows, a shard of
    a layer updated alone). LAMB's trust ratio is a norm over each whole parameter tensor, so it is not;
    nor is 8-bit AdamW's (its moments are quantized per block). ``flat_runs``: the EPS binds it to two long
    runs per layer (decayed, not) rather than one parameter per tensor. ``state``: the buffers it keeps per
    parameter, which the EPS allocates flat (and the planner counts, :attr:`state_bytes_per_param`).
    ``one_pass``: the EPS runs its update as one host pass (``engine/host_passes.py``: AdamW's math, bit
    for bit), the torch optimizer keeping only its step counts and hyper-parameters. ``tensor_pass``: the
    EPS calls the optimizer's own ``update(w, g, state, hp, mult, send)`` per parameter tensor, one pass
    that reads the gradient as it arrived, folds in the unscale/clip factor and writes the send copy
    (8-bit AdamW), leaving the gradient as it was. ``host_update_cost``: its EPS update's time per parameter
    against AdamW's one pass on the same host, what the planner charges it where the machine is not
    measured (``benchmarks/optimizers.py`` measures it: docs/optimizers.md)."""

    name: str
    build: Callable[[list[dict[str, Any]], OptimSettings], torch.optim.Optimizer]
    elementwise: bool
    flat_runs: bool
    state: tuple[StateBuffer, ...] = ADAM_FP32
    one_pass: bool = False
    tensor_pass: bool = False
    host_update_cost: float = 1.0

    @property
    def state_bytes_per_param(self) -> float:
        """Host (or device) bytes of optimizer state per parameter of a large tensor: 8 for FP32 moments,
        ~2.03 for 8-bit (whose tensors under ``MIN_8BIT`` elements, biases and norms, keep 8: a share of a
        model's parameters too small to count)."""
        return sum(b.bytes_per_param for b in self.state if b.below is None)

    @property
    def fp32_moments(self) -> bool:
        """Two FP32 moments per element: the layout the pipeline's stages hold, and the disk tier's files
        of formats 1 and 2 (another optimizer's state is format 3, with an FP32 master)."""
        return self.state == ADAM_FP32


def _adamw(groups: list[dict[str, Any]], o: OptimSettings) -> torch.optim.Optimizer:
    import torch

    # torch's fused AdamW kernel runs on CPU too, several times faster than the default for-loop one
    return torch.optim.AdamW(
        groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, fused=True
    )


def _lamb(groups: list[dict[str, Any]], o: OptimSettings) -> torch.optim.Optimizer:
    from l2l_cli.engine.lamb import Lamb

    return Lamb(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


# 8-bit AdamW's one-pass update time per parameter over AdamW's, both native (``benchmarks/optimizers.py``;
# the measurement behind it is in docs/optimizers.md)
ADAMW8BIT_HOST_COST = 2.4


def _adamw8bit(groups: list[dict[str, Any]], o: OptimSettings) -> torch.optim.Optimizer:
    from l2l_cli.engine.adamw8bit import AdamW8bit

    return AdamW8bit(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


OPTIMIZERS: dict[str, OptimizerKind] = {
    k.name: k
    for k in (
        OptimizerKind("adamw", _adamw, elementwise=True, flat_runs=True, one_pass=True),
        OptimizerKind("lamb", _lamb, elementwise=False, flat_runs=False),
        OptimizerKind(
            "adamw8bit",
            _adamw8bit,
            elementwise=False,
            flat_runs=False,
            state=ADAM_8BIT,
            tensor_pass=True,
            host_update_cost=ADAMW8BIT_HOST_COST,
        ),
    )
}


def state_of(name: str) -> tuple[StateBuffer, ...]:
    """The state buffers ``optim.name`` keeps (FP32 moments for a name not registered: its own check says
    so): what the disk tier's files and the planner's bytes hold."""
    kind = OPTIMIZERS.get(name)
    return kind.state if kind is not None else ADAM_FP32


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

    @property
    def flat_runs(self) -> bool:
        return self.kind.flat_runs

    @classmethod
    def from_cfg(cls, o: Any) -> OptimSettings:
        return cls(
            o.name, o.lr, o.weight_decay, o.beta1, o.beta2, o.eps, o.warmup_ratio, o.warmup_steps, o.schedule
        )


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


def optimizer_runs(layout: RunLayout, flat_runs: bool) -> list[tuple[str, int, int]]:
    """Where a layer's flat buffer splits into the optimizer's parameters, (name, start, end): AdamW
    (``OptimizerKind.flat_runs``) takes two long runs, the weight-decayed prefix (``decay``) and the rest
    (``bias``), for the fused kernel; LAMB's trust ratio is a norm per parameter tensor and 8-bit AdamW
    quantizes each tensor in its own blocks, so one run per tensor, by its own name. A run may be empty;
    ``param_groups`` sorts runs into decay groups by name."""
    if flat_runs:
        return [("decay", 0, layout.n_decay), ("bias", layout.n_decay, layout.numel)]
    return [(e.name, e.offset, e.offset + e.numel) for e in layout.entries]


def bind_flat(
    runs: Iterable[tuple[str, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]], o: OptimSettings
) -> torch.optim.Optimizer:
    """An optimizer working in place on flat buffers: each run (name, w, g, state) is one parameter, a
    view of the weights whose ``.grad`` is a view of the gradient, and its state ({key: tensor} of the
    kind's :class:`StateBuffer` keys: AdamW's ``exp_avg``, ``exp_avg_sq``) is views too (they shard,
    gather and checkpoint as flat buffers). Weight decay by ``param_groups`` on the names."""
    from torch import nn

    named, states = [], []
    for name, w, g, state in runs:
        p = nn.Parameter(w)
        p.grad = g
        named.append((name, p))
        states.append((p, state))
    optimizer = make_optimizer(param_groups(named, o.weight_decay), o)
    for p, state in states:
        optimizer.state[p] = {"step": state_step(optimizer, p), **state}
    return optimizer


def state_step(optimizer: torch.optim.Optimizer, p: torch.Tensor, value: Any = 0.0) -> torch.Tensor:
    """A parameter's optimizer ``step`` (float32 scalar, ``value``: a number or a checkpoint's tensor) where
    torch keeps it: on the parameter's device for the fused and capturable kernels, which refuse a step on
    another device (torch's own ``load_state_dict`` moves it there); on the host otherwise (a host step
    is read without a device sync)."""
    import torch

    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    on_device = bool(group.get("fused") or group.get("capturable"))
    device = p.device if on_device else "cpu"
    return torch.full((), float(value), dtype=torch.float32, device=device)  # a float32 is exact in a float


def lr_at(step: int, total_steps: int, o: OptimSettings) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then ``optim.schedule``: constant,
    linear decay to 0, or cosine decay to 0 (half a cosine over the steps after warmup, as Hugging Face's and
    torchtune's ``get_cosine_schedule_with_warmup``)."""
    warmup = o.warmup_steps if o.warmup_steps is not None else int(o.warmup_ratio * total_steps)
    if warmup and step < warmup:
        return o.lr * (step + 1) / warmup
    if o.schedule == "constant":
        return o.lr
    if o.schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return o.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    return o.lr * max(0.0, (total_steps - step) / max(1, total_steps - warmup))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


NORM_ROWS = 64  # flat_norm's rows: a fixed count, so the sum's order never depends on the thread count


def flat_norm(x: torch.Tensor) -> torch.Tensor:
    """The L2 norm of a large flat buffer (a layer's gradient), accumulated in FP32 whatever its type, as 64
    row norms and the norm of those on a CPU. ATen's whole-tensor norm on CPU runs at one core's speed (a
    GPU step of BERT-Large waited ~48 ms per step for it on 16 cores) and sums in one float chain
    (relative error ~1e-3 at 25 M elements); rows spread over every core and keep the error near 1e-6, and
    a half buffer's norm equals its FP32 copy's bit for bit. Float32 (or the buffer's wider type)."""
    import torch

    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else None
    n = x.numel()
    if x.device.type != "cpu" or n < 1 << 16 or x.dim() != 1 or not x.is_contiguous():
        return torch.linalg.vector_norm(x, dtype=acc)
    r = n - n % NORM_ROWS
    rows = torch.linalg.vector_norm(x[:r].view(NORM_ROWS, -1), dim=1, dtype=acc)
    if r < n:
        rows = torch.cat([rows, torch.linalg.vector_norm(x[r:], dtype=acc).view(1)])
    return torch.linalg.vector_norm(rows)


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
