"""Issue 25's acceptance: what budgeted and selective recompute buy back (``mode.recompute``,
``mode.keep_layers``), against plain PyTorch gradient accumulation from ``compare_peers.py`` (same run).

    python benchmarks/recompute.py                   # 8 BERT-Large layers, batch 16, ubatch 4, seq 128, fp32
    python benchmarks/recompute.py --tiny --steps 2  # a smoke run (bert-tiny widths)

Prints samples/s and the device peak of: plain PyTorch GA (``compare_peers.py --peers pytorch-ga``, its own
process); ``mode=l2l mode.recompute=auto`` with a budget that holds every activation (target >= 0.95x
plain); ``full`` and ``selective`` (target: selective >= 1.12x full) and ``auto`` on a budget between
selective's and every layer kept's (it must not hold the full activations: auto picks selective and stays
under it); the table for keep_layers 0, L/4, L/2, L. On a CPU the budget is ``mode.activation_budget_gb``;
on CUDA it is the free memory, so the constrained row is left to the CPU. Run it alone on the machine:
ratios under contention mean nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import gib, measure

BERT_LARGE = ["model=bert-large", "task.max_seq_len=128", "task.pad_to_max=true", "trainer.progress=none"]
TINY = ["model=bert-tiny", "task.max_seq_len=32", "task.pad_to_max=true", "trainer.progress=none"]


def plain_ga(args: argparse.Namespace) -> dict[str, Any] | None:
    """compare_peers.py's plain PyTorch GA (every activation kept), in its own process, same settings."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peers.json"
        cmd = [sys.executable, str(Path(__file__).parent / "compare_peers.py"), "--peers", "pytorch-ga",
               "--steps", str(args.steps), "--layers", str(args.layers), "--batch", str(args.batch),
               "--ubatch", str(args.ubatch), "--device", args.device, "--json", str(out),
               *(["--tiny"] if args.tiny else [])]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not out.is_file():
            print(f"recompute: pytorch-ga failed: {(proc.stderr or proc.stdout)[-500:]}", flush=True)
            return None
        r = json.loads(out.read_text())["pytorch-ga"]
        return {"samples_per_s": r["samples_per_s"], "peak_bytes": r["device_peak_bytes"], "plan": "-"}


WARMUP = 2  # steps discarded per run: a kept layer's first two steps still fault in fresh pages (0 after)


def _plan(s: Any) -> dict[str, Any]:
    """The runner's recompute choice and, built but before a step, the device bytes (the relay's slots)."""
    return {"plan": s.runner.recompute.describe(), "slot_bytes": s.acc.meter.current_bytes}


def l2l(base: list[str], steps: int, *extra: str) -> dict[str, Any]:
    """harness.measure of mode=l2l with ``extra``, plus the runner's recompute choice (the same build)."""
    return measure(["mode=l2l", *base, *extra], steps=steps, warmup=WARMUP, probe=_plan)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help=f"steps per run (the first {WARMUP} a warm-up)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ubatch", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="bert-tiny widths: a smoke run")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument(
        "--only",
        default="",
        choices=["", "hold-all"],
        help="acceptance 1 alone: 'hold-all' runs pytorch-ga and auto (budget holds all)",
    )
    args = ap.parse_args()
    L = args.layers
    base = [
        *(TINY if args.tiny else BERT_LARGE), f"model.num_layers={L}", f"batch.size={args.batch}",
        f"batch.ubatch_size={args.ubatch}", f"device={args.device}", "precision=fp32",
        "model.dropout=0.0", "optim.schedule=constant", "optim.warmup_steps=0",  # compare_peers' settings
    ]  # fmt: skip
    cpu = args.device == "cpu"
    print(f"{L} layers, batch {args.batch}, ubatch {args.ubatch}, fp32, device {args.device}, "
          f"{args.steps} steps each (the first {WARMUP} a warm-up), {torch.get_num_threads()} threads", flush=True)  # fmt: skip
    rows: dict[str, dict[str, Any]] = {}
    ga = plain_ga(args)
    if ga:
        rows["pytorch-ga (compare_peers)"] = ga
    measure(["mode=l2l", *base], steps=2)  # discarded: the process's one-time costs, not the first row's
    roomy = ["mode.activation_budget_gb=1000"] if cpu else []
    rows["l2l auto, budget holds all"] = l2l(base, args.steps, "mode.recompute=auto", *roomy)
    if args.only == "hold-all":
        return report(rows, ga, args)
    full = rows["l2l full"] = l2l(base, args.steps, "mode.recompute=full")
    sel = rows["l2l selective"] = l2l(base, args.steps, "mode.recompute=selective")
    kept = {0: full}
    for k in sorted({L // 4, L // 2, L} - {0}):
        kept[k] = rows[f"l2l full, keep_layers {k}"] = l2l(base, args.steps, f"mode.keep_layers={k}")
    if cpu:  # an activation budget between selective's and every layer kept's: no room for all of them
        mid = 0.5 * (sel["peak_bytes"] + kept[L]["peak_bytes"]) - sel["slot_bytes"]
        budget = mid / 2**30
        rows[f"l2l auto, budget {budget:.3g} GiB"] = r = l2l(
            base, args.steps, "mode.recompute=auto", f"mode.activation_budget_gb={budget}"
        )
        r["budget_bytes"] = mid + sel["slot_bytes"]  # the peak counts the slots too

    return report(rows, ga, args, full=full, sel=sel, kept=kept)


def report(
    rows: dict[str, dict[str, Any]], ga: dict[str, Any] | None, args: argparse.Namespace,
    full: dict[str, Any] | None = None, sel: dict[str, Any] | None = None, kept: dict[int, Any] | None = None,
) -> int:  # fmt: skip
    """The table, the ratios against the targets, the keep_layers table (what was run)."""
    print(f"\n{'run':34s} {'samples/s':>10s} {'device peak':>12s}  choice")
    for name, r in rows.items():
        peak = gib(r["peak_bytes"]) if r.get("peak_bytes") else "-"
        print(f"{name:34s} {r['samples_per_s']:10.3f} {peak:>12s}  {r['plan']}")

    def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
        return f"{a['samples_per_s'] / b['samples_per_s']:.3f}" if a and b else "-"

    print(
        f"\nauto (budget holds all) / plain pytorch-ga: {ratio(rows['l2l auto, budget holds all'], ga)}  (target >= 0.95)"
    )
    if sel and full:
        print(f"selective / full:                         {ratio(sel, full)}  (target >= 1.12)")
    for name, r in rows.items():
        if "budget_bytes" in r:
            under = r["peak_bytes"] <= r["budget_bytes"]
            print(
                f"{name}: peak {gib(r['peak_bytes'])} {'<=' if under else '>'} budget {gib(r['budget_bytes'])}"
            )
    if kept:
        print("\nkeep_layers  samples/s  x full  device peak")
    for k, r in (kept or {}).items():
        print(f"{k:11d} {r['samples_per_s']:10.3f} {ratio(r, full):>7s}  {gib(r['peak_bytes']):>11s}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({k: {**v} for k, v in rows.items()}, indent=2, default=str) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
