"""Budgeted and selective recompute for the L2L runners (``mode.recompute``, ``mode.keep_layers``).

L2L stashes each layer's input and recomputes the layer in backward (``full``): a quarter of the step when
the device had room for the activations anyway. Here the spare device budget buys back that time:

- kept layers (the last ``keep_layers`` blocks, which backward meets first) keep their autograd graph from
  forward to backward and are not recomputed at all (``none`` keeps every block);
- ``selective`` runs the other blocks under torch's selective activation checkpointing (Korthikanti et al.
  2022): the matmul outputs are saved in forward, the cheap memory-heavy rest (softmax, dropout, GELU,
  LayerNorm) is recomputed in backward, with the forward's RNG state restored (dropout replays).

``auto`` measures one block's saved bytes per micro-batch for each policy (:func:`measure_block`) and picks
(:func:`choose`) the choice that recomputes least within the device budget. Every choice computes the same
numbers: a kept graph and a checkpoint's replay run the forward's own ops on the same inputs and RNG.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from l2l_cli.engine.recompute_plan import (  # noqa: F401  (the choice, without torch: re-exported here)
    DEFAULT_CPU_SHARE,
    GRAPH_POLICIES,
    MARGIN,
    POLICIES,
    SELECTIVE_SHARE,
    LayerBytes,
    RecomputePlan,
    RecomputeSettings,
    choose,
    default_cpu_budget,
)

_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "linear", "matmul")


def _saved_by_policy(op: Any) -> bool:
    """The ops whose outputs ``selective`` saves: matmuls and fused attention (compute-heavy, per FLOP
    small), so the replay runs only the elementwise rest."""
    name = str(getattr(op, "__name__", op)).split(".")[0]  # aten.addmm.default -> "addmm.default"
    return name in _MATMULS or name.startswith("_scaled_dot_product")


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if _saved_by_policy(op) else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> Any:
    """torch's selective-checkpoint context pair for :func:`_policy` (a fresh cache per call)."""
    return create_selective_checkpoint_contexts(_policy)


def run_selective(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` under selective activation checkpointing: the matmul outputs kept, the rest replayed in
    backward with the forward's RNG state (``preserve_rng_state``: dropout draws the same masks)."""
    return checkpoint(fn, x, use_reentrant=False, context_fn=selective_contexts, preserve_rng_state=True)


class _Storages:
    """Bytes of distinct storages, each counted once when first seen, whether or not it is still alive.
    Storages are told apart by their (preserved) Python objects, held weakly: an address is no identity,
    the caching allocator hands a freed block's address to the next tensor."""

    def __init__(self, skip: Collection[torch.Tensor] = ()) -> None:
        self.live: weakref.WeakKeyDictionary[Any, None] = weakref.WeakKeyDictionary()
        self.bytes = 0
        for t in skip:
            self.live[t.untyped_storage()] = None  # seen: never counted

    def add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st not in self.live:
            self.live[st] = None
            self.bytes += st.nbytes()


class _OpOutputs(TorchDispatchMode):
    """Sums the bytes of the distinct storages that the policy's ops output."""

    def __init__(self) -> None:
        super().__init__()
        self.storages = _Storages()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if _saved_by_policy(func):
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor):
                    self.storages.add(t)
        return out


def measure_pre(
    run: Callable[[], torch.Tensor], params: Collection[torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """The embeddings' forward (``run``, from the token ids) under autograd: its output, detached, and the
    bytes its graph saves (the weights, storages of ``params``, excluded): what keeping it costs."""
    saved = _Storages(skip=params)

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(t)
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = run()
    return y.detach(), saved.bytes


def measure_block(
    run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Collection[torch.Tensor]
) -> LayerBytes:
    """One block's bytes per micro-batch for each policy, from one forward on ``x``: what autograd saves
    (``none``; the weights, storages of ``params``, excluded), what the policy's ops output plus the input
    (``selective``), the input alone (``full``)."""
    inp = x.untyped_storage().nbytes()
    saved = _Storages(skip=params)

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(t)
        return t

    x_in = x.detach().requires_grad_()
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = run(x_in)
    saved.add(x)
    del y
    outputs = _OpOutputs()
    with torch.no_grad(), outputs:
        run(x)
    return LayerBytes(full=inp, selective=inp + outputs.storages.bytes, none=saved.bytes)
