"""Issue 25's acceptance: what budgeted and selective recompute buy back (``mode.recompute``,
``mode.keep_layers``), against plain PyTorch gradient accumulation from ``compare_peers.py`` (same run).

    python benchmarks/recompute.py                   # 8 BERT-Large layers, batch 16, ubatch 4, seq 128, fp32
    python benchmarks/recompute.py --tiny --steps 2  # a smoke run (bert-tiny widths)

Every run is a fresh child process (nothing of an earlier run's heap or threads), its first ``WARMUP`` steps
discarded, the median of the rest reported. Acceptance 1 runs in rounds, interleaved (plain PyTorch GA from
``compare_peers.py``, then ``mode=l2l mode.recompute=auto`` with a budget that holds every activation, then
``selective``; ``--pairs`` rounds): each round's ratio auto / GA, their median and spread (target: median
>= 0.95), the same ratio by CPU seconds per step, and each step's time and the CPU other processes took
meanwhile (a timing with others running is under contention). Then ``full`` (target: selective >= 1.12x
full), the table for keep_layers 0, L/4, L/2, L, and ``auto`` on a budget between selective's and every
layer kept's (it must not hold the full activations: auto picks selective and stays under it). On a CPU
the budget is ``mode.activation_budget_gb``; on CUDA it is the free memory, so the constrained row is left
to the CPU. Run it alone on the machine: ratios under contention mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.compare_peers import run_peer
from benchmarks.harness import cpu_mark, gib, measure, step_load

BERT_LARGE = ["model=bert-large", "task.max_seq_len=128", "task.pad_to_max=true", "trainer.progress=none"]
TINY = ["model=bert-tiny", "task.max_seq_len=32", "task.pad_to_max=true", "trainer.progress=none"]


WARMUP = 2  # steps discarded per run: a kept layer's first two steps still fault in fresh pages (0 after)


def _plan(s: Any) -> dict[str, Any]:
    """The runner's recompute choice and, built but before a step, the device bytes (the relay's slots)."""
    return {"plan": s.runner.recompute.describe(), "slot_bytes": s.acc.meter.current_bytes}


def steady(loads: list[dict[str, float]], batch: int) -> dict[str, Any]:
    """A run's statistic, the same for every row: the median of its steps after the warm-up (samples/s
    and CPU seconds), each step's wall time, and the most CPU the rest of the machine took in one step."""
    rest = loads[WARMUP:] or loads
    return {
        "samples_per_s": batch / statistics.median(x["wall_s"] for x in rest),
        "cpu_s": statistics.median(x["cpu_s"] for x in rest),
        "walls": [round(x["wall_s"], 3) for x in rest],
        "others_cpu_s": max(x["others_cpu_s"] for x in rest),
        "faults": int(statistics.median(x["faults"] for x in rest)),
    }


def child(args: argparse.Namespace, base: list[str]) -> int:
    """One configuration in this (fresh) process: compare_peers.py's plain PyTorch GA, or mode=l2l with
    ``--set`` overrides; writes its result to ``--out``."""
    if args.child == "ga":
        r = run_peer("pytorch-ga", base, args.steps, args.device, mark=cpu_mark)
        loads = [step_load(a, b) for a, b in r["marks"]]
        out: dict[str, Any] = {"peak_bytes": r["device_peak_bytes"], "plan": "-"}
    else:
        out = measure(["mode=l2l", *base, *args.set], steps=args.steps, warmup=WARMUP, probe=_plan, load=True)
        loads = out.pop("steps")
    out.update(steady(loads, args.batch))
    Path(args.out).write_text(json.dumps(out, default=str))
    return 0


def run(args: argparse.Namespace, kind: str, *extra: str) -> dict[str, Any] | None:
    """``child`` in a fresh process (nothing of an earlier row's heap, threads or page cache state)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [
            sys.executable,
            __file__,
            "--child",
            kind,
            "--out",
            str(out),
            "--steps",
            str(args.steps),
            "--layers",
            str(args.layers),
            "--batch",
            str(args.batch),
            "--ubatch",
            str(args.ubatch),
            "--device",
            args.device,
            *(["--tiny"] if args.tiny else []),
            *(a for e in extra for a in ("--set", e)),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not out.is_file():
            print(
                f"recompute: {kind} {' '.join(extra)} failed: {(proc.stderr or proc.stdout)[-500:]}",
                flush=True,
            )
            return None
        return json.loads(out.read_text())


def line(name: str, r: dict[str, Any] | None) -> None:
    """One run as it finishes: median samples/s, each measured step's seconds, CPU seconds, contention."""
    if r is None:
        return
    print(
        f"  {name:30s} {r['samples_per_s']:7.3f} samples/s  steps {r['walls']} s  cpu {r['cpu_s']:.2f} s  "
        f"others' cpu <= {r['others_cpu_s']:.2f} s  faults {r['faults']}",
        flush=True,
    )


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' runs of one configuration as one table row: their median samples/s."""
    row = dict(runs[0])
    row["samples_per_s"] = statistics.median(r["samples_per_s"] for r in runs)
    row["plan"] = f"{row['plan']} (median of {len(runs)} runs)"
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help=f"steps per run (the first {WARMUP} a warm-up)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ubatch", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="bert-tiny widths: a smoke run")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--pairs", type=int, default=3, help="acceptance 1's rounds: plain GA, auto, selective")
    ap.add_argument(
        "--only",
        default="",
        choices=["", "hold-all"],
        help="acceptance 1 alone: 'hold-all' runs the rounds of pytorch-ga and auto (budget holds all)",
    )
    ap.add_argument("--child", choices=["ga", "l2l"], help=argparse.SUPPRESS)  # internal: one run
    ap.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    L = args.layers
    base = [
        *(TINY if args.tiny else BERT_LARGE),
        f"model.num_layers={L}",
        f"batch.size={args.batch}",
        f"batch.ubatch_size={args.ubatch}",
        f"device={args.device}",
        "precision=fp32",
        "model.dropout=0.0",
        "optim.schedule=constant",
        "optim.warmup_steps=0",  # compare_peers' settings
    ]
    if args.child:
        return child(args, base)
    cpu = args.device == "cpu"
    print(
        f"{L} layers, batch {args.batch}, ubatch {args.ubatch}, fp32, device {args.device}, "
        f"{args.steps} steps per run (the first {WARMUP} a warm-up), {torch.get_num_threads()} threads, "
        "every run in a fresh process",
        flush=True,
    )
    roomy = ["mode.activation_budget_gb=1000"] if cpu else []
    rounds: list[dict[str, Any]] = []
    for p in range(1, args.pairs + 1):  # interleaved: drift of the machine hits both sides of a pair alike
        print(f"round {p}:", flush=True)
        rnd = {"ga": run(args, "ga")}
        line("pytorch-ga (compare_peers)", rnd["ga"])
        rnd["auto"] = run(args, "l2l", "mode.recompute=auto", *roomy)
        line("l2l auto, budget holds all", rnd["auto"])
        if args.only != "hold-all":
            rnd["sel"] = run(args, "l2l", "mode.recompute=selective")
            line("l2l selective", rnd["sel"])
        rounds.append(rnd)

    def runs(key: str) -> list[dict[str, Any]]:
        return [r[key] for r in rounds if r.get(key)]

    rows: dict[str, dict[str, Any]] = {}
    ga = median_row(runs("ga")) if runs("ga") else None
    if ga:
        rows["pytorch-ga (compare_peers)"] = ga
    if runs("auto"):
        rows["l2l auto, budget holds all"] = median_row(runs("auto"))
    if args.only == "hold-all":
        return report(rows, ga, args, rounds)
    full = rows["l2l full"] = run(args, "l2l", "mode.recompute=full")
    sel = rows["l2l selective"] = median_row(runs("sel")) if runs("sel") else None
    kept = {0: full}
    for k in sorted({L // 4, L // 2, L} - {0}):
        kept[k] = rows[f"l2l full, keep_layers {k}"] = run(args, "l2l", f"mode.keep_layers={k}")
    if cpu and sel and kept[L]:  # an activation budget between selective's and every layer kept's
        mid = 0.5 * (sel["peak_bytes"] + kept[L]["peak_bytes"]) - sel["slot_bytes"]
        budget = mid / 2**30
        r = rows[f"l2l auto, budget {budget:.3g} GiB"] = run(
            args, "l2l", "mode.recompute=auto", f"mode.activation_budget_gb={budget}"
        )
        if r:
            r["budget_bytes"] = mid + sel["slot_bytes"]  # the peak counts the slots too

    return report({k: v for k, v in rows.items() if v}, ga, args, rounds, full=full, sel=sel, kept=kept)


def report(
    rows: dict[str, dict[str, Any]],
    ga: dict[str, Any] | None,
    args: argparse.Namespace,
    rounds: list[dict[str, Any]],
    full: dict[str, Any] | None = None,
    sel: dict[str, Any] | None = None,
    kept: dict[int, Any] | None = None,
) -> int:
    """Acceptance 1 round by round (each pair's ratio, their median and spread), the table, the ratios
    against the targets, the keep_layers table (what was run)."""

    def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str = "samples_per_s") -> float | None:
        return a[key] / b[key] if a and b else None

    def fmt(x: float | None) -> str:
        return f"{x:.3f}" if x is not None else "-"

    pairs = [ratio(r.get("auto"), r.get("ga")) for r in rounds]
    pairs_f = [x for x in pairs if x is not None]
    # CPU seconds per step, GA's over auto's: the same comparison without the time other processes took
    cpu = [
        x
        for x in (1 / x if x else None for x in (ratio(r.get("auto"), r.get("ga"), "cpu_s") for r in rounds))
        if x
    ]
    sels = [ratio(r.get("sel"), r.get("auto")) for r in rounds if r.get("sel")]
    print("\nacceptance 1, round by round (auto with a budget that holds every layer / plain pytorch-ga):")
    for p, r in enumerate(rounds, 1):
        print(
            f"  round {p}: {fmt(r['auto']['samples_per_s'] if r.get('auto') else None)} / "
            f"{fmt(r['ga']['samples_per_s'] if r.get('ga') else None)} = {fmt(pairs[p - 1])}"
            + (
                f"   selective / auto = {fmt(ratio(r['sel'], r['auto']))}"
                if r.get("sel") and r.get("auto")
                else ""
            )
        )
    if pairs_f:
        print(
            f"auto (budget holds all) / plain pytorch-ga: median {statistics.median(pairs_f):.3f} over "
            f"{len(pairs_f)} pairs (spread {min(pairs_f):.3f} .. {max(pairs_f):.3f})  (target >= 0.95)"
        )
    if cpu:
        print(
            f"  the same by CPU seconds per step (GA's / auto's): median {statistics.median(cpu):.3f} "
            f"(spread {min(cpu):.3f} .. {max(cpu):.3f})"
        )
    if sels:
        print(
            f"selective / auto (every layer kept): median {statistics.median(sels):.3f} "
            f"(spread {min(sels):.3f} .. {max(sels):.3f})"
        )

    print(f"\n{'run':34s} {'samples/s':>10s} {'device peak':>12s}  choice")
    for name, r in rows.items():
        peak = gib(r["peak_bytes"]) if r.get("peak_bytes") else "-"
        print(f"{name:34s} {r['samples_per_s']:10.3f} {peak:>12s}  {r['plan']}")
    if sel and full:
        print(f"\nselective / full:                         {fmt(ratio(sel, full))}  (target >= 1.12)")
    for name, r in rows.items():
        if "budget_bytes" in r:
            under = r["peak_bytes"] <= r["budget_bytes"]
            print(
                f"{name}: peak {gib(r['peak_bytes'])} {'<=' if under else '>'} budget "
                f"{gib(r['budget_bytes'])}"
            )
    if kept:
        print("\nkeep_layers  samples/s  x full  device peak")
    for k, r in (kept or {}).items():
        if r:
            print(
                f"{k:11d} {r['samples_per_s']:10.3f} {fmt(ratio(r, full)):>7s}  {gib(r['peak_bytes']):>11s}"
            )
    if args.json:
        out = {"rows": rows, "rounds": rounds, "pairs": pairs, "cpu_pairs": cpu, "selective_over_auto": sels}
        Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
