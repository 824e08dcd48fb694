"""The EPS's host update against this machine's own memory bandwidth (issue 50), in one run.

One AdamW update of ``--params`` parameters as the EPS runs it (the received gradient in its type, the unscale
multiply, AdamW, the device's half copy: one pass, ``eps.update_kernel=auto``), beside STREAM's triad over
buffers of the same size on the same threads, and beside the passes torch ops take for the same update (widen,
multiply, torch's fused AdamW, the half copy). GB/s counts what each pass must read and write (no
write-allocate), so the update's floor is 28 B/param under CMP (26 with an FP32 gradient and no half copy).

    python benchmarks/host_update.py                      # 134 M params (8 BERT-Large layers), CMP bf16
    python benchmarks/host_update.py --grad fp32 --send none --json   # one JSON line
    python benchmarks/host_update.py --beside   # L2L-p's update: read one state set, write the other

Target (issue 50): the update's GB/s at least 0.7x the triad's.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from harness import timeit

from l2l_cli.engine.host_passes import AdamwStep, HostPasses
from l2l_cli.engine.native import native_available

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "none": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=134e6, help="parameters (default 134 M)")
    ap.add_argument("--grad", choices=["fp32", "bf16", "fp16"], default="bf16", help="received gradient")
    ap.add_argument("--send", choices=["bf16", "fp16", "fp32", "none"], default="bf16", help="half copy")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads (default: all cores)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--beside", action="store_true", help="write a second state set (L2L-p's), not in place")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = int(args.params)
    gdt, sdt = DTYPES[args.grad], DTYPES[args.send]
    passes = HostPasses(args.threads)
    w, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g = (torch.randn(n) * 1e-3).to(gdt)
    send = torch.empty(n, dtype=sdt) if sdt is not None else None
    hp = AdamwStep(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10.0)
    mult = 0.5  # an unscale factor (the multiply the update must fold in)

    out_set = (torch.empty(n), torch.empty(n), torch.empty(n)) if args.beside else (w, m, v)
    upd_s = timeit(lambda: passes.adamw(g, (w, m, v), out_set, send, mult, hp), args.repeats)
    out_set = ()  # (the second set freed)
    upd_bytes = n * (g.element_size() + 24 + (send.element_size() if send is not None else 0))
    abc = [torch.empty(n), torch.randn(n), torch.randn(n)]
    triad_s = timeit(lambda: passes.triad(*abc, 3.0), args.repeats)
    triad_bytes = 12 * n
    abc.clear()  # (the triad's buffers freed before the torch passes run)

    # the same update as separate torch ops, as the EPS ran it before (widen, multiply, fused AdamW, copy)
    g32 = torch.empty(n)
    p = torch.nn.Parameter(w)
    p.grad = g32
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, fused=True)

    def torch_passes() -> None:
        g32.copy_(g)
        g32.mul_(mult)
        opt.step()
        if send is not None:
            send.copy_(w)

    torch_s = timeit(torch_passes, args.repeats)
    upd_gbps, triad_gbps = upd_bytes / upd_s / 1e9, triad_bytes / triad_s / 1e9
    out = {
        "params": n,
        "grad": args.grad,
        "send": args.send,
        "threads": args.threads,
        "beside": args.beside,
        "kernel": passes.kernel,
        "update_s": upd_s,
        "update_bytes_per_param": upd_bytes / n,
        "update_gbps": upd_gbps,
        "triad_gbps": triad_gbps,
        "ratio": upd_gbps / triad_gbps,
        "torch_passes_s": torch_s,
        "speedup_vs_torch_passes": torch_s / upd_s,
    }
    passes.close()
    if args.json:
        print(json.dumps(out))
        return
    ok, why = native_available()
    print(f"{n / 1e6:.0f} M params, gradient {args.grad}, send copy {args.send}, {args.threads} threads")
    print(f"kernel: {passes.kernel}" + ("" if ok else f" ({why})"))
    print(f"{'pass':34s} {'ms':>8s} {'B/param':>8s} {'GB/s':>7s}")
    name = "update (one pass, beside)" if args.beside else "update (one pass)"
    print(f"{name:34s} {upd_s * 1e3:8.1f} {upd_bytes / n:8.1f} {upd_gbps:7.1f}")
    print(f"{'triad a = b + s*c':34s} {triad_s * 1e3:8.1f} {12.0:8.1f} {triad_gbps:7.1f}")
    print(f"{'torch ops (widen, mul, AdamW, copy)':34s} {torch_s * 1e3:8.1f}")
    print(
        f"\nupdate / triad GB/s: {out['ratio']:.2f} (target >= 0.7); one pass vs torch ops: "
        f"{out['speedup_vs_torch_passes']:.2f}x faster"
    )


if __name__ == "__main__":
    main()
