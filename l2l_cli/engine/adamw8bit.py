"""AdamW with 8-bit optimizer states (``optim=adamw8bit``): block-wise quantized moments, as bitsandbytes'
8-bit Adam and torchao's ``AdamW8bit`` keep them (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization"), so the EPS holds about 10 bytes per parameter instead of 16.

Each moment of a parameter tensor of at least :data:`~l2l_cli.engine.optim.MIN_8BIT` (4096) elements is
one uint8 code per element and one FP32 absmax per block of :data:`BLOCK` (256) elements, the tensor's own
blocks (its first element starts one): a value is ``qmap[code] * absmax`` of its block. A smaller tensor (a
bias, a norm) keeps FP32 moments and AdamW's own update, as bitsandbytes (``min_8bit_size``) and torchao
do: its few bytes are not worth the quantization error. The first moment uses the signed dynamic map, the
second (never negative) the unsigned one, both bitsandbytes' ``create_dynamic_map`` (256 entries; the same
map torchao builds).

An update of a tensor dequantizes its moments to FP32, applies torch's fused AdamW to them in FP32 (its
arithmetic bit for bit, scalar tail included), and quantizes the new moments back to the nearest code (a
value on a midpoint rounds up). On a CPU it is one pass over memory (:meth:`HostPasses.adamw8bit
<l2l_cli.engine.host_passes.HostPasses.adamw8bit>`, a C kernel: per block of 256 in cache, the quantizer a
table lookup on the float's bits), reading the gradient as it arrived (FP32 or half) times the
unscale/clip factor and writing the device's half copy: about 16 bytes per parameter. Elsewhere, or without
a C compiler, the same update runs as torch ops chunk by chunk (:func:`update_torch`), with the same bits:
the kernel is checked against them once per process and left unused if it differs.

Why our own and not torchao's ``AdamW8bit``: torchao 0.18's works on CPU with torch 2.13, but compiles a
kernel per parameter shape with ``torch.compile`` on the first step (minutes on a small CPU:
docs/benchmarks.md), keeps tensors of fewer than 4096 elements or not a multiple of the block in FP32, needs
the learning rate as a tensor, and creates its state lazily as a tensor subclass. The EPS binds its optimizer
to views of flat per-layer buffers that it checkpoints, undoes and shards as plain tensors, so it needs the
codes and absmaxes as such.
"""

from __future__ import annotations

import logging
import threading
from functools import cache
from itertools import chain
from typing import Any

import torch

from l2l_cli.engine.host_passes import AdamwStep, HostPasses, adamw_torch
from l2l_cli.engine.qmaps import QMap, native_qmap

log = logging.getLogger("l2l")

# (engine/optim.py's QBLOCK and MIN_8BIT, which size the EPS's buffers; optim imports this module to build
# the optimizer, so it does not import optim; a test holds them equal)
BLOCK = 256  # elements per absmax (bitsandbytes' and torchao's block size)
MIN_8BIT = 4096  # bitsandbytes' min_8bit_size: a smaller tensor keeps FP32 moments
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


def new_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """The zeroed state of a parameter the optimizer has not stepped yet (the baselines'; the EPS binds views
    of its flat buffers instead, optim.ADAM_8BIT's): a tensor of at least ``MIN_8BIT`` elements, codes
    shaped as the parameter and an absmax per block; a smaller one, FP32 moments."""
    out = {"step": torch.zeros((), dtype=torch.float32)}
    if p.numel() < MIN_8BIT:
        for key in ("exp_avg", "exp_avg_sq"):
            out[key] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return out
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
        out[f"{key}_absmax"] = torch.zeros(-(-p.numel() // BLOCK), dtype=torch.float32, device=p.device)
    return out


class AdamW8bit(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction; torch's fused AdamW's arithmetic) whose moments are
    stored block-wise quantized to 8 bits. The state of a parameter ``p`` of at least ``MIN_8BIT``
    elements: ``step`` (a 0-d FP32 tensor), ``exp_avg`` / ``exp_avg_sq`` (uint8 codes, shaped as ``p``)
    and ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (FP32, one per block of 256 of ``p`` flattened, the
    last one partial); of a smaller one, ``exp_avg`` / ``exp_avg_sq`` in FP32, updated as torch's fused
    AdamW. The state may be given (views of the EPS's flat buffers: :func:`~l2l_cli.engine.optim.bind_flat`)
    or is created zeroed on the first step (the baselines): both block each tensor alike, so every mode
    computes the same update. ``passes``: the host passes a CPU tensor's update runs on (the EPS's; None:
    one shared by the process, on torch's thread count)."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        passes: HostPasses | None = None,
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.passes = passes
        self._maps: dict[torch.device, tuple[QuantMap, QuantMap]] = {}

    def maps(self, device: torch.device) -> tuple[QuantMap, QuantMap]:
        """The (signed, unsigned) maps on ``device``, built once."""
        if device not in self._maps:
            self._maps[device] = (QuantMap(True, device), QuantMap(False, device))
        return self._maps[device]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, but each state tensor keeps its own dtype (torch casts every tensor of
        a floating-point parameter's state to the parameter's dtype: the uint8 codes would become floats);
        it is only moved to the parameter's device."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(ids, params):
            for key, t in saved.get(pid, {}).items():
                if key != "step" and isinstance(t, torch.Tensor):
                    self.state[p][key] = t.to(device=p.device)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p.numel() == 0:
                    continue
                st = self.state[p]
                if not st:
                    st.update(new_state(p))
                st["step"] += 1
                self.update(p.view(-1), p.grad.view(-1), st, hyper(group, st))

    @torch.no_grad()
    def update(
        self,
        w: torch.Tensor,
        g: torch.Tensor,
        st: dict[str, torch.Tensor],
        hp: AdamwStep,
        mult: float | None = None,
        send: torch.Tensor | None = None,
    ) -> None:
        """One parameter tensor's update, flat: ``w`` (its weights) from ``g`` (its gradient, any float type,
        left as it is) times ``mult`` (None: 1), its state ``st`` (whose step ``hp`` counts already), and
        the new weights narrowed into ``send`` (None: none). ``step`` calls it per parameter; the EPS
        calls it itself, with the gradient as it crossed the link, the unscale/clip factor and the
        device's half copy, so that the whole update is one pass."""
        if "exp_avg_absmax" not in st:  # under MIN_8BIT: FP32 moments, AdamW's own update
            m, v = st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1)
            if _host_fp32(w, m, v):
                self._passes().adamw(g, (w, m, v), (w, m, v), send, mult, hp)
            else:
                adamw_torch(g, w, m, v, hp, mult, send)
            return
        n, done = w.numel(), 0
        passes = self._passes() if _host_fp32(w) and g.is_contiguous() else None
        maps = None if passes is None else _native_maps(passes)
        if passes is not None and maps is not None:
            # torch's fused AdamW leaves a tensor's last numel % vector-width elements to a scalar loop whose
            # arithmetic its compiler chose: that block runs as torch ops (below), the rest in the kernel
            done = n if n % passes.vec == 0 else (n - 1) // BLOCK * BLOCK
            codes = (st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1))
            absmax = (st["exp_avg_absmax"], st["exp_avg_sq_absmax"])
            if done:
                passes.adamw8bit(g, w, codes, absmax, send, mult, hp, maps, done)
        if done < n:
            update_torch(w, g, st, hp, mult, send, self.maps(w.device), done)

    def _passes(self) -> HostPasses:
        if self.passes is None:
            self.passes = _process_passes()
        return self.passes


def hyper(group: dict[str, Any], st: dict[str, torch.Tensor]) -> AdamwStep:
    """A parameter's update's hyper-parameters: its group's, at its state's step count."""
    b1, b2 = group["betas"]
    return AdamwStep(group["lr"], b1, b2, group["eps"], group["weight_decay"], float(st["step"]))


def update_torch(
    w: torch.Tensor,
    g: torch.Tensor,
    st: dict[str, torch.Tensor],
    hp: AdamwStep,
    mult: float | None,
    send: torch.Tensor | None,
    maps: tuple[QuantMap, QuantMap],
    lo: int = 0,
) -> None:
    """The update of a tensor's elements [lo, n) (``lo`` a block boundary) as torch ops, on any device,
    chunk by chunk (FP32 temporaries of one chunk): the moments dequantized, the gradient widened and
    multiplied, torch's fused AdamW over the chunk, the moments quantized back, the send copy narrowed.
    A chunk is a multiple of the vector width, so the fused kernel's scalar tail is the tensor's own."""
    signed, unsigned = maps
    cm, cv = st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1)
    am, av = st["exp_avg_absmax"], st["exp_avg_sq_absmax"]
    n = w.numel()
    for a in range(lo, n, CHUNK):
        b = min(a + CHUNK, n)
        ba, bb = a // BLOCK, -(-b // BLOCK)
        m = dequantize(cm[a:b], am[ba:bb], signed)
        v = dequantize(cv[a:b], av[ba:bb], unsigned)
        wc = w[a:b] if w.dtype == torch.float32 else w[a:b].float()
        adamw_torch(g[a:b], wc, m, v, hp, mult, None)
        if wc.data_ptr() != w[a:b].data_ptr():
            w[a:b].copy_(wc)
        quantize_(m, signed, cm[a:b], am[ba:bb])
        quantize_(v, unsigned, cv[a:b], av[ba:bb])
        if send is not None:
            send[a:b].copy_(wc)


def _host_fp32(*ts: torch.Tensor) -> bool:
    """Whether these are contiguous FP32 CPU tensors, what the host passes take."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in ts)


@cache
def _process_passes() -> HostPasses:
    """The host passes of an optimizer given none (a baseline's on the CPU): one per process."""
    return HostPasses(torch.get_num_threads())


_NATIVE: dict[int, tuple[QMap, QMap] | None] = {}  # by vector width: the kernel's maps, None: torch ops
_LOCK = threading.Lock()


def _native_maps(passes: HostPasses) -> tuple[QMap, QMap] | None:
    """The native kernel's (signed, unsigned) maps, or None where it is unavailable or, checked once per
    process, its update differs from :func:`update_torch`'s by a bit (then torch ops run, said in the log)."""
    if passes.lib is None:
        return None
    with _LOCK:
        if passes.vec not in _NATIVE:
            cpu = torch.device("cpu")
            signed, unsigned = QuantMap(True, cpu), QuantMap(False, cpu)
            a, b = (
                native_qmap(passes.lib, signed.values, signed.mids),
                native_qmap(passes.lib, unsigned.values, unsigned.mids),
            )
            maps = None if a is None or b is None else (a, b)
            if maps is not None and not _matches_torch(passes, maps, (signed, unsigned)):
                maps = None
                log.info("8-bit AdamW runs as torch ops: its native kernel differs from them on this machine")
            _NATIVE[passes.vec] = maps
        return _NATIVE[passes.vec]


def _matches_torch(passes: HostPasses, maps: tuple[QMap, QMap], ref: tuple[QuantMap, QuantMap]) -> bool:
    """The native update against :func:`update_torch` on moments over many decades, a gradient in each type
    with a factor, a partial last block and an all-zero one: the same codes, absmaxes, weights and send
    copy."""
    gen = torch.Generator().manual_seed(0)
    n = 7 * BLOCK + 3 * passes.vec  # whole blocks and a partial one, all in the kernel's body
    ok = True
    for gdt in (torch.float32, torch.bfloat16, torch.float16):
        w = torch.randn(n, generator=gen)
        g = (torch.randn(n, generator=gen) * torch.logspace(-8, 0, n)[torch.randperm(n, generator=gen)]).to(
            gdt
        )
        g[BLOCK : 2 * BLOCK] = 0.0
        st = {
            "exp_avg": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen),
            "exp_avg_sq": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen),
            "exp_avg_absmax": torch.rand(-(-n // BLOCK), generator=gen) * 1e-2,
            "exp_avg_sq_absmax": torch.rand(-(-n // BLOCK), generator=gen) * 1e-4,
        }
        st["exp_avg_absmax"][1] = st["exp_avg_sq_absmax"][1] = 0.0
        st["exp_avg"][BLOCK : 2 * BLOCK] = 127  # (the signed map's zero)
        st["exp_avg_sq"][BLOCK : 2 * BLOCK] = 0
        hp = AdamwStep(1e-3, 0.9, 0.999, 1e-8, 0.01, 7.0)
        want = {k: t.clone() for k, t in st.items()}
        w_want, s_want = w.clone(), torch.empty(n, dtype=torch.bfloat16)
        update_torch(w_want, g, want, hp, 0.37, s_want, ref)
        send = torch.empty(n, dtype=torch.bfloat16)
        codes = (st["exp_avg"], st["exp_avg_sq"])
        passes.adamw8bit(
            g, w, codes, (st["exp_avg_absmax"], st["exp_avg_sq_absmax"]), send, 0.37, hp, maps, n
        )
        same = all(torch.equal(st[k], want[k]) for k in st)
        ok = ok and same and torch.equal(w, w_want) and torch.equal(send, s_want)
    return ok
