"""AdamW with 8-bit optimizer states (``optim=adamw8bit``): block-wise quantized moments, as bitsandbytes'
8-bit Adam and torchao's ``AdamW8bit`` keep them (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization"), so the EPS holds about 10 bytes per parameter instead of 16.

Each moment is one uint8 code per element and one FP32 absmax per block of :data:`BLOCK` (256) elements:
a value is ``qmap[code] * absmax`` of its block. The first moment uses the signed dynamic map, the second
(never negative) the unsigned one, both bitsandbytes' ``create_dynamic_map`` (256 entries; the same map
torchao builds). An update dequantizes a chunk of the moments to FP32, applies AdamW's update with them in
FP32 (torch's order of operations), quantizes the new moments back (round to nearest) and moves on:
vectorized torch ops over the whole flat buffer, chunk by chunk, never a Python loop over its elements or
blocks, and FP32 temporaries of one chunk only.

Why our own and not torchao's ``AdamW8bit``: torchao 0.18's works on CPU with torch 2.13, but compiles a
kernel per parameter shape with ``torch.compile`` on the first step (minutes on a small CPU:
docs/benchmarks.md), keeps tensors of fewer than 4096 elements or not a multiple of the block in FP32, needs
the learning rate as a tensor, and creates its state lazily as a tensor subclass. The EPS binds its optimizer
to views of flat per-layer buffers that it checkpoints, undoes and shards as plain tensors, so it needs the
codes and absmaxes as such; the quantizer is a few lines of torch.
"""

from __future__ import annotations

import math
from typing import Any

import torch

BLOCK = 256  # elements per absmax (bitsandbytes' and torchao's block size)
CHUNK = 1 << 20  # elements dequantized at a time: 4 MiB FP32 temporaries per moment, a multiple of BLOCK


def dynamic_map(signed: bool) -> list[float]:
    """bitsandbytes' dynamic quantization map (``create_dynamic_map(signed, 7, 8)``, without its zero
    padding, as torchao has it): 256 sorted values in [-1, 1] (signed) or [0, 1], each decade of 10^-6..1
    split into more fractions the larger it is, plus 0 and 1."""
    data: list[float] = []
    for i in range(7):  # exponents 10^-6 .. 10^0
        items = 2**i + 1 if signed else 2 ** (i + 1) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += (10 ** (-6 + i) * means).tolist()  # in FP32, as the reference builds it
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 256
    return sorted(data)


class QuantMap:
    """A 256-entry map on one device: its values (dequantize: a lookup) and the midpoints between
    neighbours (quantize: a binary search, ``bucketize``; a value on a midpoint rounds up)."""

    def __init__(self, signed: bool, device: torch.device):
        self.values = torch.tensor(dynamic_map(signed), dtype=torch.float32, device=device)
        self.mids = (self.values[:-1] + self.values[1:]) / 2.0


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, qmap: QuantMap) -> torch.Tensor:
    """FP32 values of ``codes`` (uint8, a flat run starting at a block boundary) and its blocks' absmax."""
    n = codes.numel()
    out = qmap.values.index_select(0, codes.reshape(-1).int())
    full = n - n % BLOCK
    out[:full].view(-1, BLOCK).mul_(absmax[: full // BLOCK, None])
    if full < n:
        out[full:].mul_(absmax[-1])
    return out


def quantize_(x: torch.Tensor, qmap: QuantMap, codes: torch.Tensor, absmax: torch.Tensor) -> None:
    """Write ``x`` (FP32, flat, starting at a block boundary) into ``codes`` and ``absmax`` (one per block,
    the last one partial): each element's nearest map value after dividing by its block's absmax."""
    n = x.numel()
    full = n - n % BLOCK
    torch.amax(x[:full].view(-1, BLOCK).abs(), dim=1, out=absmax[: full // BLOCK])
    if full < n:
        absmax[-1] = x[full:].abs().amax()
    scale = absmax.clamp(min=torch.finfo(torch.float32).tiny)  # an all-zero block divides 0 by it: code of 0
    y = torch.empty_like(x)
    torch.div(x[:full].view(-1, BLOCK), scale[: full // BLOCK, None], out=y[:full].view(-1, BLOCK))
    if full < n:
        torch.div(x[full:], scale[-1], out=y[full:])
    codes.copy_(torch.bucketize(y, qmap.mids, out_int32=True, right=True))


def state_numel(numel: int) -> dict[str, tuple[int, torch.dtype]]:
    """The state a parameter of ``numel`` elements gets: codes per element, an absmax per block."""
    blocks = -(-numel // BLOCK)
    return {
        "exp_avg": (numel, torch.uint8),
        "exp_avg_sq": (numel, torch.uint8),
        "exp_avg_absmax": (blocks, torch.float32),
        "exp_avg_sq_absmax": (blocks, torch.float32),
    }


class AdamW8bit(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction; torch's update order) whose moments are stored
    block-wise quantized to 8 bits. The state of a parameter ``p``: ``step`` (a 0-d FP32 tensor),
    ``exp_avg`` / ``exp_avg_sq`` (uint8 codes, ``p.numel()`` each, flat) and ``exp_avg_absmax`` /
    ``exp_avg_sq_absmax`` (FP32, one per block of 256 of ``p`` flattened, the last one partial). The
    state may be given (views of the EPS's flat buffers: :func:`~l2l_cli.engine.optim.bind_flat`) or is
    created zeroed on the first step (the baselines). Its blocks start at each parameter's first
    element, so the EPS (two long runs per layer) and the baselines (one per tensor) block differently and
    agree to the quantization's tolerance, not bit for bit."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self._maps: dict[torch.device, tuple[QuantMap, QuantMap]] = {}

    def maps(self, device: torch.device) -> tuple[QuantMap, QuantMap]:
        """The (signed, unsigned) maps on ``device``, built once."""
        if device not in self._maps:
            self._maps[device] = (QuantMap(True, device), QuantMap(False, device))
        return self._maps[device]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    for key, (n, dtype) in state_numel(p.numel()).items():
                        st[key] = torch.zeros(n, dtype=dtype, device=p.device)
                st["step"] += 1
                t = float(st["step"])
                self._update(p.view(-1), p.grad.view(-1), st, lr, b1, b2, eps, wd, t)

    def _update(
        self,
        w: torch.Tensor,
        g: torch.Tensor,
        st: dict[str, torch.Tensor],
        lr: float,
        b1: float,
        b2: float,
        eps: float,
        wd: float,
        t: float,
    ) -> None:
        signed, unsigned = self.maps(w.device)
        step_size = lr / (1 - b1**t)
        bc2_sqrt = math.sqrt(1 - b2**t)
        for lo in range(0, w.numel(), CHUNK):
            hi = min(lo + CHUNK, w.numel())
            blo, bhi = lo // BLOCK, -(-hi // BLOCK)
            codes_m, codes_v = st["exp_avg"].view(-1)[lo:hi], st["exp_avg_sq"].view(-1)[lo:hi]
            absmax_m, absmax_v = st["exp_avg_absmax"][blo:bhi], st["exp_avg_sq_absmax"][blo:bhi]
            m = dequantize(codes_m, absmax_m, signed)
            v = dequantize(codes_v, absmax_v, unsigned)
            gc, wc = g[lo:hi], w[lo:hi]
            if wd:
                wc.mul_(1 - lr * wd)
            m.lerp_(gc, 1 - b1)
            v.mul_(b2).addcmul_(gc, gc, value=1 - b2)
            quantize_(m, signed, codes_m, absmax_m)
            quantize_(v, unsigned, codes_v, absmax_v)
            denom = v.sqrt_().div_(bc2_sqrt).add_(eps)
            wc.addcdiv_(m, denom, value=-step_size)
