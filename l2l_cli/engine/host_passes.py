"""Every pass the host's CPU makes over the EPS's buffers, done in as few passes as the math allows and
counted.

On a GPU the EPS, not the device, sets L2L's pace, and it is bound by host memory bandwidth: so the measure is
bytes per parameter per step. The floor of one AdamW update is one pass: read the received gradient (4 B
FP32, 2 B half), read w, m, v (12), write w, m, v (12) and, under CMP, the device's half copy (2). The native
kernel (``csrc/host_update.c``, built with the machine's C compiler on first use and cached: ``native``)
does exactly that, in one loop over each thread's range, on ``threads`` threads; where no compiler is found
the same update runs as torch ops in more passes (``kernel`` says which), with the same numbers.

Every pass, native or not, is counted by the code that makes it (:meth:`HostPasses.count`): what it read
and wrote, and its seconds, by what it was for (``update``, ``widen``, ``norm``, ``undo``, ...). summary.json
reports them per trained parameter per step (``eps.host_traffic_bytes_per_param``) and the update's own
GB/s (``eps.update_gbps``); the relay's DMA copies are counted apart (``eps.transfer_bytes_per_param``).
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from l2l_cli.engine.native import AdamwArgs, library

if TYPE_CHECKING:
    from l2l_cli.engine.qmaps import QMap

log = logging.getLogger("l2l")

ALIGN = 64  # elements: a thread's range starts on a cache line (FP32) and a whole vector
_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
QBLOCK = 256  # elements per absmax of the 8-bit kernel (csrc's QBLOCK, engine/optim.py's)


def _vector_width() -> int:
    """Floats per vector in ATen's CPU kernels here (its fused AdamW's scalar tail is the last
    ``numel % width`` elements of a parameter)."""
    cap = torch.backends.cpu.get_cpu_capability()
    return 16 if cap.startswith("AVX512") else 8 if cap == "AVX2" else 1


@dataclass(frozen=True)
class AdamwStep:
    """One AdamW update's hyper-parameters (a param group's, and the step count it takes)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: float  # the step count after this update (bias correction)

    def scalars(self) -> dict[str, Any]:
        """The per-update constants as ATen's fused AdamW computes them (in double; cast to float)."""
        bc1 = 1 - math.pow(self.beta1, self.step)
        bc2 = 1 - math.pow(self.beta2, self.step)
        return {
            "decay": 1 - self.lr * self.weight_decay,
            "has_decay": int(self.weight_decay != 0.0),
            "lerp_w": 1 - self.beta1,
            "beta2": self.beta2,
            "c2": 1 - self.beta2,
            "bc2_sqrt": math.sqrt(bc2),
            "eps": self.eps,
            "step_size": self.lr / bc1,
        }


_LOCAL = threading.local()


def set_thread_share(threads: int) -> None:
    """The calling thread's passes run on ``threads`` threads (the EPS thread's share of the cores; a
    thread that never calls this, the compute thread, takes torch's intra-op thread count: it runs host
    work only while the device waits for it)."""
    _LOCAL.threads = max(1, threads)


@contextmanager
def compute_threads(torch_threads: int, share: int) -> Iterator[None]:
    """For the block, the calling thread's torch ops run on ``torch_threads`` and its passes over EPS
    buffers on ``share`` threads of the pool the EPS's use (so the two queue there, never oversubscribe)."""
    before, shared = torch.get_num_threads(), getattr(_LOCAL, "threads", None)
    torch.set_num_threads(torch_threads)
    _LOCAL.threads = max(1, share)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        _LOCAL.threads = shared


class HostPasses:
    """The host's passes over EPS buffers: the native kernels on the calling thread's share of the cores
    (``set_thread_share``; ``threads``: the EPS thread's), or torch ops (see ``kernel``); and the count of
    every pass's bytes and seconds by purpose."""

    def __init__(self, threads: int, kernel: str = "auto"):
        self.threads = max(1, threads)
        lib, why = library() if kernel != "torch" else (None, "eps.update_kernel=torch")
        if kernel == "native" and lib is None:
            raise RuntimeError(f"eps.update_kernel=native: the native kernels are unavailable ({why})")
        self.lib, self.why = lib, why
        self.vec = _vector_width()
        most = max(self.threads, torch.get_num_threads())
        self._pool = ThreadPoolExecutor(most - 1, "l2l-host") if most > 1 else None
        self._lock = threading.Lock()
        self.bytes: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        if kernel == "auto" and lib is not None and not _matches_torch(self):
            self.lib, self.why = None, "the native AdamW differs from torch's fused AdamW on this machine"
        self.kernel = "native" if self.lib is not None else "torch"
        if self.kernel == "torch" and kernel == "auto":
            log.info("the EPS's host update runs as torch ops, in several passes: %s", self.why)

    # ---- counting ---------------------------------------------------------------------------------------

    def count(self, what: str, nbytes: int, seconds: float = 0.0) -> None:
        """A pass over host buffers for ``what`` read and wrote ``nbytes`` in ``seconds``."""
        with self._lock:
            self.bytes[what] = self.bytes.get(what, 0) + int(nbytes)
            self.seconds[what] = self.seconds.get(what, 0.0) + seconds

    def snapshot(self) -> tuple[dict[str, int], dict[str, float]]:
        with self._lock:
            return dict(self.bytes), dict(self.seconds)

    # ---- the kernels ------------------------------------------------------------------------------------

    def _split(self, n: int, fn: Callable[[int, int], None], align: int = ALIGN, each: int = 1) -> None:
        """``fn(lo, hi)`` over [0, n) cut into one contiguous range per thread, the caller's included, each
        starting at a multiple of ``align`` (``each``: elements per unit of n)."""
        share = getattr(_LOCAL, "threads", None) or torch.get_num_threads()
        t = min(share, max(1, n * each // (1 << 15)))  # small runs: one thread (a dispatch costs ~20 us)
        if t == 1 or self._pool is None:
            fn(0, n)
            return
        step = -(-n // t)
        step = -(-step // align) * align
        cuts = [(lo, min(n, lo + step)) for lo in range(0, n, step)]
        jobs = [self._pool.submit(fn, lo, hi) for lo, hi in cuts[1:]]
        fn(*cuts[0])
        for j in jobs:
            j.result()

    def adamw(
        self,
        g: torch.Tensor,
        state_in: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        state_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        send: torch.Tensor | None,
        mult: float | None,
        hp: AdamwStep,
    ) -> None:
        """One AdamW run (a parameter of the fused kernel): ``g`` (FP32/BF16/FP16, left as it is) times
        ``mult`` (None: 1) applied to ``state_in`` = (w, m, v), written to ``state_out`` (the same tensors:
        in place), and the new w narrowed into ``send`` (None: no send copy). ``hp``: its hyper-parameters."""
        n = g.numel()
        if n == 0:
            return
        w0, m0, v0 = state_in
        w1, m1, v1 = state_out
        for t in (w0, m0, v0, w1, m1, v1):
            assert t.dtype == torch.float32 and t.is_contiguous() and t.numel() == n
        if self.lib is None:
            self._adamw_torch(g, state_in, state_out, send, mult, hp)
            return
        body = n - n % self.vec  # ATen's vector loop; the rest is its scalar tail's: torch's own kernel
        if body:
            args = _kernel_args(mult, hp)
            gt, st = _TYPES[g.dtype], (_TYPES[send.dtype] if send is not None else -1)
            ptrs = [t.data_ptr() for t in (w0, m0, v0, w1, m1, v1)]
            gp, sp, ap = g.data_ptr(), (send.data_ptr() if send is not None else None), ctypes.byref(args)
            lib = self.lib

            def run(lo: int, hi: int) -> None:
                lib.l2l_adamw(gp, gt, *ptrs, sp, st, lo, hi, ap)

            self._split(body, run)
        if body < n:
            rest = slice(body, n)
            self._adamw_torch(
                g[rest],
                tuple(t[rest] for t in state_in),  # type: ignore[arg-type]
                tuple(t[rest] for t in state_out),  # type: ignore[arg-type]
                None if send is None else send[rest],
                mult,
                hp,
            )

    def adamw_rows(
        self,
        g: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        send: torch.Tensor,
        width: int,
        rows: torch.Tensor,
        mult: float | None,
        hp: AdamwStep,
    ) -> None:
        """What an AdamW run (``adamw``'s arguments, in place) would make of ``rows`` (row indices, each
        ``width`` elements) of it, written into those rows of ``send`` only: the state is left alone. Native
        kernels only (``kernel == "native"``); rows the run leaves to torch's kernel (its last
        ``len % vec`` elements) are the caller's."""
        assert self.lib is not None and rows.dtype == torch.int64 and rows.is_contiguous()
        w, m, v = state
        args = _kernel_args(mult, hp)
        gt, st = _TYPES[g.dtype], _TYPES[send.dtype]
        ptrs = [t.data_ptr() for t in (g, w, m, v, send, rows)]
        ap, lib = ctypes.byref(args), self.lib

        def run(r0: int, r1: int) -> None:
            lib.l2l_adamw_rows(ptrs[0], gt, *ptrs[1:4], ptrs[4], st, width, ptrs[5], r0, r1, ap)

        self._split(rows.numel(), run, align=1, each=width)

    def _adamw_torch(
        self,
        g: torch.Tensor,
        state_in: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        state_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        send: torch.Tensor | None,
        mult: float | None,
        hp: AdamwStep,
    ) -> None:
        """The same update as torch ops (no compiler here): the state copied to its new set, then updated."""
        for src, dst in ((a, b) for a, b in zip(state_in, state_out) if a.data_ptr() != b.data_ptr()):
            dst.copy_(src)
        adamw_torch(g, *state_out, hp, mult, send)

    def adamw8bit(
        self,
        g: torch.Tensor,
        w: torch.Tensor,
        codes: tuple[torch.Tensor, torch.Tensor],
        absmax: tuple[torch.Tensor, torch.Tensor],
        send: torch.Tensor | None,
        mult: float | None,
        hp: AdamwStep,
        maps: tuple[QMap, QMap],
        n: int,
    ) -> None:
        """The native 8-bit AdamW over the first ``n`` elements of one parameter tensor (whole blocks of 256,
        or up to its end): ``g`` (FP32/BF16/FP16, left as it is) times ``mult`` (None: 1), the FP32 master
        ``w``, the moments' uint8 ``codes`` (m, v) and their blocks' FP32 ``absmax`` (m, v), all updated in
        place, the new w narrowed into ``send`` (None: none); ``maps``: the (signed, unsigned) maps from
        :meth:`qmap`. The caller checks that the kernels exist (``lib``) and what this pass counts."""
        assert self.lib is not None
        cm, cv = codes
        am, av = absmax
        assert w.dtype == torch.float32 and cm.dtype == cv.dtype == torch.uint8
        assert all(t.is_contiguous() for t in (g, w, cm, cv, am, av))
        total = w.numel()
        args = _kernel_args(mult, hp)
        gt, st = _TYPES[g.dtype], (_TYPES[send.dtype] if send is not None else -1)
        ptrs = [t.data_ptr() for t in (w, cm, cv, am, av)]
        gp, sp = g.data_ptr(), (send.data_ptr() if send is not None else None)
        ap, mp, vp = ctypes.byref(args), ctypes.byref(maps[0].args), ctypes.byref(maps[1].args)
        lib = self.lib

        def run(lo: int, hi: int) -> None:
            lib.l2l_adamw8bit(gp, gt, *ptrs, sp, st, total, lo // QBLOCK, -(-hi // QBLOCK), ap, mp, vp)

        self._split(n, run, QBLOCK)

    def convert(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst.copy_(src)`` between FP32/BF16/FP16 host buffers, on every thread."""
        n = src.numel()
        if self.lib is None or n < 1 << 15:
            dst.copy_(src)
            return
        lib, sp, st, dp, dt = self.lib, src.data_ptr(), _TYPES[src.dtype], dst.data_ptr(), _TYPES[dst.dtype]
        self._split(n, lambda lo, hi: lib.l2l_convert(sp, st, dp, dt, lo, hi))

    def triad(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, s: float) -> None:
        """STREAM's triad ``a = b + s*c`` on the update's threads (the bandwidth to measure it by)."""
        if self.lib is None:
            torch.add(b, c, alpha=s, out=a)
            return
        lib, ap, bp, cp = self.lib, a.data_ptr(), b.data_ptr(), c.data_ptr()
        self._split(a.numel(), lambda lo, hi: lib.l2l_triad(ap, bp, cp, s, lo, hi))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


_EXACT: dict[int, bool] = {}


def _kernel_args(mult: float | None, hp: AdamwStep) -> AdamwArgs:
    """What every element of one native update shares: the factor (None: none, no multiply) and ``hp``."""
    return AdamwArgs(mult=1.0 if mult is None else mult, has_mult=int(mult is not None), **hp.scalars())


def _matches_torch(passes: HostPasses) -> bool:
    """Whether the native AdamW equals torch's fused AdamW bit for bit on this machine (once per process):
    the same update in the same math is the promise, and a compiler or CPU that breaks it falls back."""
    if passes.vec in _EXACT:
        return _EXACT[passes.vec]
    gen = torch.Generator().manual_seed(0)
    n = 4096 + 3 * passes.vec + 5  # a vector body and a scalar tail
    ok = True
    for gdt in (torch.float32, torch.bfloat16):
        w, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
        v, g = torch.rand(n, generator=gen) * 1e-4, (torch.randn(n, generator=gen) * 1e-1).to(gdt)
        hp = AdamwStep(1e-3, 0.9, 0.999, 1e-8, 0.01, 3.0)
        ref = [t.clone() for t in (w, m, v)]
        passes._adamw_torch(g, tuple(ref), tuple(ref), None, 0.37, hp)  # type: ignore[arg-type]
        out = (torch.empty(n), torch.empty(n), torch.empty(n))
        send = torch.empty(n, dtype=torch.bfloat16)
        passes.adamw(g, (w, m, v), out, send, 0.37, hp)
        ok = ok and all(torch.equal(a, b) for a, b in zip(out, ref)) and torch.equal(send, ref[0].bfloat16())
    _EXACT[passes.vec] = ok
    return ok


def timed(passes: HostPasses, what: str, nbytes: int) -> Any:
    """``with timed(passes, "norm", n * 4): ...``: one pass counted with its seconds."""
    return _Timed(passes, what, nbytes)


class _Timed:
    __slots__ = ("nbytes", "passes", "t0", "what")

    def __init__(self, passes: HostPasses, what: str, nbytes: int):
        self.passes, self.what, self.nbytes = passes, what, nbytes

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.passes.count(self.what, self.nbytes, time.perf_counter() - self.t0)


def adamw_torch(
    g: torch.Tensor,
    w: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    hp: AdamwStep,
    mult: float | None,
    send: torch.Tensor | None,
) -> None:
    """torch's fused AdamW over FP32 ``w``, ``m``, ``v`` in place, from ``g`` widened and multiplied into a
    temporary (``g`` is left as it is), and the send copy from the master: the native kernel's reference
    and its fallback where it cannot build."""
    grad = g.clone() if g.dtype == torch.float32 else g.float()
    if mult is not None:
        grad.mul_(mult)
    kw = {"lr": hp.lr, "beta1": hp.beta1, "beta2": hp.beta2, "weight_decay": hp.weight_decay, "eps": hp.eps}
    step = [torch.tensor(float(hp.step))]
    torch._fused_adamw_([w], [grad], [m], [v], [], step, amsgrad=False, maximize=False, **kw)
    if send is not None:
        send.copy_(w)
