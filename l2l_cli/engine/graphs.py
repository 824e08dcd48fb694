"""CUDA graphs of a block's forward and of its recompute-and-backward, per micro-batch shape
(``mode.cuda_graphs``).

At small micro-batches a block's kernels are short and the host launching them one at a time sets the
pace: tens of kernels per block forward, about twice that in backward, each a few microseconds on the
compute thread, which shares the host with the EPS's threads. The relay holds every layer of a kind at the
same addresses (one module per slot end and kind, its parameters views of the slot's buffers), so one graph
captured per (module, shapes) serves every layer that lands there: a replay reads whichever layer the relay
loaded, and accumulates into the slot's gradient buffer in place as the eager backward does. Dropout reads
the generator's seed and offset at each replay (torch's graph-safe RNG), so the per-(layer, micro-batch)
seeds give the eager masks. Inputs are copied into a graph's static buffers and outputs cloned out (the
next replay reuses them): two activation-sized device copies against a block's launches.

Every graph is checked once, when captured: its first replay against the eager block on the same
micro-batch (output; in backward the input's gradient and the slot's accumulated gradients), bit for bit.
A difference turns graphs off for the run (the log and summary.json's ``cuda_graphs`` say so) and that
micro-batch keeps its eager result: no number ever comes from an unchecked graph.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from l2l_cli.engine.device import (
    capture_graph,
    cuda_rng_state,
    graph_pool,
    on_side_stream,
    set_cuda_rng_state,
)

log = logging.getLogger("l2l")

# auto: graphs where a block's forward on a micro-batch is at most this many FLOPs (2 x tokens x its weights):
# ~0.5 ms on an H100-class GPU, where a block's few dozen launches (~5 us each) are a share worth taking back
# (BERT-Large at 8 x 512 tokens: 1.0e11; a Llama-3-8B block at 2048 tokens: 8.9e11, compute-bound, and its
# graphs' memory pool would be room the budget does not have)
AUTO_MAX_FLOPS = 2e11
MAX_SHAPES = 4  # graphs per module and pass: a shape past these (variable padding) runs eagerly
WARMUP = 2  # eager runs on a side stream before a capture (lazy initialisation stays out of the graph)


class Backend(Protocol):
    """How graphs are made and replayed: CUDA's, or the eager stand-in the CPU tests run."""

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        """Capture ``fn``: (its replay, its outputs: the static tensors each replay rewrites)."""
        ...

    def warmup(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` eagerly, as many times as the backend needs before a capture."""
        ...


class CudaBackend:
    """CUDA graphs (made by engine/device.py), every graph of a run in one memory pool: they run one
    at a time on one stream, and what outlives a replay is their static tensors alone."""

    def __init__(self, device: torch.device):
        self.device, self.pool = device, graph_pool()

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        return capture_graph(fn, self.pool)

    def warmup(self, fn: Callable[[], Any]) -> None:
        on_side_stream(self.device, lambda: [fn() for _ in range(WARMUP)])


class CudaRng:
    """A CUDA device's dropout generator state, as the graphs save and restore it."""

    def __init__(self, device: torch.device):
        self.device = device

    def get_state(self) -> torch.Tensor:
        state = cuda_rng_state(self.device)
        assert state is not None
        return state

    def set_state(self, state: torch.Tensor) -> None:
        set_cuda_rng_state(state, self.device)


class EagerBackend:
    """The CPU stand-in (tests): a capture runs ``fn`` once and keeps its outputs as the static tensors; a
    replay runs it again and copies its new outputs into them. What it checks is the plumbing around a
    graph (static inputs and outputs, gradients in place, seeds, the capture-time check), not CUDA."""

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        out = fn()

        def replay() -> None:
            for static, new in zip(leaves(out), leaves(fn()), strict=True):
                static.copy_(new)

        return replay, out

    def warmup(self, fn: Callable[[], Any]) -> None:
        fn()


def backend_for(kind: str, device: torch.device) -> Backend | None:
    """The graph backend of an accelerator kind (None: graphs do not exist there)."""
    return CudaBackend(device) if kind == "cuda" else None


def supported(kind: str) -> bool:
    """Whether ``mode.cuda_graphs=on`` can run on an accelerator of this kind."""
    return kind == "cuda"


def wanted(setting: str, kind: str, block_flops: float) -> bool:
    """``mode.cuda_graphs`` resolved: ``on`` (validated for the device), ``off``, or ``auto``: on CUDA where
    a block's forward on a micro-batch (``block_flops``) is short enough for its launches to matter."""
    if setting == "auto":
        return supported(kind) and block_flops <= AUTO_MAX_FLOPS
    return setting == "on"


def leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors in a tensor, a tuple or list, or a dataclass of them (a block's side inputs: torch's
    pytree walks a dataclass only once registered, and ``DecoderSide``'s module stays free of torch)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in leaves(o)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in leaves(getattr(obj, f.name))]
    return []


def rebuild(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with each of its tensors replaced by ``fn`` of it (the same structure as ``leaves``)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(rebuild(o, fn) for o in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: rebuild(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **fields)
    return obj


def shapes(*objs: Any) -> tuple[Any, ...]:
    return tuple((tuple(t.shape), t.dtype) for o in objs for t in leaves(o))


class Graph:
    """One captured pass: its static inputs, its replay, its static outputs."""

    def __init__(self, inputs: list[torch.Tensor], replay: Callable[[], None], out: Any):
        self.inputs, self.replay, self.out = inputs, replay, out

    def __call__(self, *args: Any) -> Any:
        with torch.no_grad():  # (a backward graph's input is a leaf that requires grad)
            for static, t in zip(self.inputs, leaves(args), strict=True):
                static.copy_(t)
        self.replay()
        return rebuild(self.out, torch.Tensor.clone)


Run = Callable[[nn.Module, int, torch.Tensor, Any], torch.Tensor]


class BlockGraphs:
    """The graphs of one runner's blocks. ``run(layer, index, x, side)``: block ``index``'s forward as the
    runner runs it (autocast included); ``generator``: the dropout generator the runner seeds per layer and
    micro-batch (``get_state``, ``set_state``); ``variant(index)``: what else a block's code reads of its
    index (a sliding-window layer's mask), part of a graph's key."""

    def __init__(self, backend: Backend, run: Run, generator: Any, variant: Callable[[int], Any]):
        self.backend, self.run, self.generator, self.variant = backend, run, generator, variant
        self.graphs: dict[tuple[Any, ...], Graph | None] = {}  # None: a shape past MAX_SHAPES, eager
        self.captured = self.replays = 0
        self.off_reason: str | None = None

    @property
    def on(self) -> bool:
        return self.off_reason is None

    def section(self) -> dict[str, Any]:
        """summary.json's ``cuda_graphs``: graphs captured, replays, and why they were turned off."""
        return {"captured": self.captured, "replays": self.replays, "off_reason": self.off_reason}

    def _slot(self, key: tuple[Any, ...]) -> tuple[bool, Graph | None]:
        """(whether ``key`` is new and may be captured, its graph if it has one)."""
        if not self.on:
            return False, None
        if key in self.graphs:
            return False, self.graphs[key]
        mine = sum(1 for k in self.graphs if k[:3] == key[:3])
        if mine >= MAX_SHAPES:
            if None not in self.graphs.values():  # (said once a run)
                log.info(
                    "cuda graphs: %d shapes captured per relay slot and pass; blocks of other shapes run "
                    "eagerly (task.pad_to_max=true keeps one shape)",
                    MAX_SHAPES,
                )
            self.graphs[key] = None
            return False, None
        return True, None

    @torch.no_grad()
    def forward(self, layer: nn.Module, i: int, x: torch.Tensor, side: Any) -> torch.Tensor:
        """Block ``i``'s forward without autograd (the forward pass, whose input is stashed)."""
        key = ("forward", id(layer), self.variant(i), layer.training, shapes(x, side))
        new, graph = self._slot(key)
        if graph is not None:
            self.replays += 1
            return graph(x, side)
        if not new:
            return self.run(layer, i, x, side)
        rng = self.generator.get_state()
        want = self.run(layer, i, x, side)
        static = [t.clone() for t in leaves((x, side))]
        sx, sside = rebuild((x, side), _take(static))

        def fn() -> torch.Tensor:
            return self.run(layer, i, sx, sside)

        graph = self._capture(key, static, fn, rng)
        got = None if graph is None else self._first(key, graph, rng, x, side)
        return got if got is not None and self._agrees(key, [got], [want]) else want

    def backward(
        self, layer: nn.Module, i: int, x: torch.Tensor, side: Any, gy: torch.Tensor
    ) -> torch.Tensor:
        """Block ``i``'s recompute and backward: the parameters' gradients accumulate in place (into the
        slot's buffer); returns the input's gradient."""
        key = ("backward", id(layer), self.variant(i), layer.training, shapes(x, side, gy))
        new, graph = self._slot(key)
        if graph is not None:
            self.replays += 1
            return graph(x, side, gy)
        params = [p for p in layer.parameters() if p.requires_grad] if new else []
        if not new or any(p.grad is None for p in params):  # (a gradient not bound in place: eager)
            return _eager_backward(self.run, layer, i, x, side, gy)
        rng = self.generator.get_state()
        before = [p.grad.clone() for p in params]
        x_e = x.detach().requires_grad_()
        with torch.enable_grad():
            y = self.run(layer, i, x_e, side)
            got = torch.autograd.grad(y, [x_e, *params], gy, allow_unused=True)
        want_dx, want = got[0], [b if d is None else b.clone().add_(d) for b, d in zip(before, got[1:])]
        static = [t.detach().clone() for t in leaves((x, side, gy))]
        sx, sside, sgy = rebuild((x, side, gy), _take(static))
        sx.requires_grad_()

        def fn() -> torch.Tensor:
            sx.grad = None
            with torch.enable_grad():
                torch.autograd.backward(self.run(layer, i, sx, sside), sgy)
            return sx.grad

        def warm() -> Any:
            with torch.enable_grad():
                return torch.autograd.grad(
                    self.run(layer, i, sx, sside), [sx, *params], sgy, allow_unused=True
                )

        grads = [p.grad for p in params]  # the slot's gradient buffer, which the relay sends
        graph = self._capture(key, static, fn, rng, warm, params, before)
        if graph is not None and any(p.grad is not g for p, g in zip(params, grads)):
            self.turn_off("a captured backward replaced a parameter's gradient instead of adding to it")
        elif graph is not None:
            dx = self._first(key, graph, rng, x, side, gy)
            if dx is not None and self._agrees(key, [dx, *grads], [want_dx, *want]):
                return dx
        for p, g, w in zip(params, grads, want):  # the eager result stands, in the slot's buffer
            p.grad = g
            g.copy_(w)
        return want_dx

    def _capture(
        self,
        key: tuple[Any, ...],
        static: list[torch.Tensor],
        fn: Callable[[], Any],
        rng: torch.Tensor,
        warm: Callable[[], Any] | None = None,
        params: list[nn.Parameter] | None = None,
        grads: list[torch.Tensor] | None = None,
    ) -> Graph | None:
        """Warm up and capture ``fn``; the parameters' gradients are put back as they were (``grads``)."""
        try:
            self.backend.warmup(warm or fn)
            self.generator.set_state(rng)
            replay, out = self.backend.capture(fn)
        except Exception as e:
            self.turn_off(f"{key[0]} could not be captured: {type(e).__name__}: {e}".splitlines()[0])
            return None
        finally:
            for p, g in zip(params or [], grads or []):
                p.grad.copy_(g)
        self.graphs[key] = Graph(static, replay, out)
        self.captured += 1
        return self.graphs[key]

    def _first(self, key: tuple[Any, ...], graph: Graph, rng: torch.Tensor, *args: Any) -> Any:
        """A new graph's first replay, from the generator state the eager block started from (None: it
        failed, and graphs are off)."""
        try:
            self.generator.set_state(rng)
            return graph(*args)
        except Exception as e:  # (the run goes on eagerly)
            self.turn_off(f"a {key[0]} graph's first replay failed: {type(e).__name__}: {e}".splitlines()[0])
            return None

    def _agrees(self, key: tuple[Any, ...], got: list[Any], want: list[Any]) -> bool:
        same = all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(got, want, strict=True)
        )
        if not same:
            self.turn_off(f"a {key[0]} graph's first replay differs from the eager block")
        return same

    def turn_off(self, reason: str) -> None:
        self.off_reason = reason
        self.graphs.clear()
        log.warning("cuda graphs off for this run (mode.cuda_graphs): %s; the blocks run eagerly", reason)


def _take(static: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """For ``rebuild``: the static tensors in order, one per leaf."""
    it = iter(static)
    return lambda _: next(it)


def _eager_backward(run: Run, layer: nn.Module, i: int, x: torch.Tensor, side: Any, gy: Any) -> torch.Tensor:
    x_in = x.detach().requires_grad_()
    with torch.enable_grad():
        torch.autograd.backward(run(layer, i, x_in, side), gy)
    assert x_in.grad is not None
    return x_in.grad


def for_runner(setting: str, acc: Any, block_flops: float, spec: Any, precision: Any) -> BlockGraphs | None:
    """A layer-by-layer runner's block graphs (``acc``: its accelerator; ``spec``: its model;
    ``block_flops``: a block's forward on its longest micro-batch), or None: ``mode.cuda_graphs`` off, or
    ``auto`` where graphs do not pay."""
    backend = backend_for(acc.kind, acc.device) if wanted(setting, acc.kind, block_flops) else None
    if backend is None:
        return None

    def run(layer: nn.Module, i: int, x: torch.Tensor, side: Any) -> torch.Tensor:
        with precision.autocast():
            return spec.run_layer(layer, i, x, None, side)

    rng = CudaRng(acc.device) if acc.device.type == "cuda" else torch.random.default_generator
    return BlockGraphs(backend, run, rng, spec.block_variant)
