"""Issue 14's benchmark: the pipeline bubble, measured against the layered-GA paper's prediction (appendix
C: a step lengthened by (P-1)/n_mu of its compute; §4: divided by L/P for the modular pipeline), and the
throughput, for modular vs contiguous placement x breadth-first vs 1F1B x n_mu in {P, 2P, 4P}, on a
bert-mini-shaped model (width 256, 4 heads; a 2k vocabulary, as the recipe) with 8 layers and P = 2 ranks.
One process group runs every configuration (starting ranks costs seconds).
Usage: python benchmarks/pipeline_bubble.py [--steps 6] [--seq 128] [--ubatch 4] [--layers 8] [--json out.json]

Run it alone on the machine: the two ranks need a core each, or the bubble is the scheduler's.
"""

from __future__ import annotations

import argparse
import json
import statistics

from l2l_cli.launch import run_jobs

P = 2
CONFIGS = [  # (placement, schedule): contiguous runs one stage per rank, so its 1F1B is torch's Schedule1F1B
    ("modular", "breadth_first"),
    ("modular", "interleaved_1f1b"),
    ("contiguous", "breadth_first"),
    ("contiguous", "1f1b"),
]


def jobs(layers: int, seq: int, ubatch: int) -> list[tuple[tuple[str, str, int], list[str]]]:
    model = ["model=bert-mini", f"model.num_layers={layers}", "model.vocab_size=2048", "model.dropout=0.0",
             f"task.max_seq_len={seq}", "task.pad_to_max=true", "task.num_train=512", "task.num_eval=8",
             "trainer.progress=none"]  # fmt: skip
    out = []
    for n in (P, 2 * P, 4 * P):
        for placement, schedule in CONFIGS:
            ov = [*model, "mode=baseline_ag", f"dist.nproc={P}", f"dist.pipeline={P}", f"dist.placement={placement}",
                  f"dist.schedule={schedule}", f"batch.ubatch_size={ubatch}", f"batch.size={n * ubatch}"]  # fmt: skip
            out.append(((placement, schedule, n), ov))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="steps per configuration; the first is not timed")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--ubatch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    plan = jobs(args.layers, args.seq, args.ubatch)
    results = run_jobs(P, [ov for _, ov in plan], args.steps)[0]
    rows = []
    print(
        f"{'placement':11s} {'schedule':17s} {'n_mu':>4s} {'bubble':>7s} {'predicted':>9s} {'samples/s':>9s}"
    )
    for (placement, schedule, n), res in zip([k for k, _ in plan], results, strict=True):
        pipe = res["sections"]["pipeline"]
        sps = statistics.median(s / t for s, t in zip(res["samples"][1:], res["step_time_s"][1:]))
        row = {"placement": placement, "schedule": schedule, "num_ubatches": n, "bubble_measured":
               pipe["bubble_measured"], "bubble_predicted": pipe["bubble_predicted"], "samples_per_s": sps,
               "ranks": pipe["ranks"]}  # fmt: skip
        rows.append(row)
        print(
            f"{placement:11s} {schedule:17s} {n:4d} {pipe['bubble_measured']:7.3f} {pipe['bubble_predicted']:9.3f} {sps:9.1f}"
        )
    for n in (P, 2 * P, 4 * P):
        by = {(r["placement"], r["schedule"]): r for r in rows if r["num_ubatches"] == n}
        mod, con = by[("modular", "breadth_first")], by[("contiguous", "1f1b")]
        print(f"n_mu={n}: contiguous 1F1B / modular breadth-first bubble = "
              f"{con['bubble_measured'] / mod['bubble_measured']:.2f} (predicted "
              f"{con['bubble_predicted'] / mod['bubble_predicted']:.2f}; the paper's L/P = {args.layers // P})")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
