"""Issues 14 and 23's benchmark: the pipeline bubble, measured against two predictions: the layered-GA paper's
(appendix C: a step lengthened by (P-1)/n_mu of its compute; §4: divided by L/P for the modular pipeline;
messages free) and the pre-run model (``plan.simulate``): each rank's actions, read off torch's schedule, run
in dependency order, every chunk lasting its stage's measured forward or backward, every action
``hardware.pipe_action_us``, every message latency + bytes over the link after both ends posted it. With
``hardware=measure`` both constants are timed once on the pipeline's group (the action fitted to a stand-in
schedule with no real compute: ``parallel/pipeline/calibrate.py``), not on the configuration being predicted.
Each row also splits the ranks' step (means): compute, blocked on a recv, the schedule's own work between
chunks (posting, send waits, bookkeeping) and the fill/drain idle; and the throughput, for modular vs
contiguous placement x breadth-first vs 1F1B x n_mu in {P, 2P, 4P}, on a bert-mini-shaped model (width 256, 4
heads; a 2k vocabulary, as the recipe) with 8 layers and P = 2 ranks.
One process group runs every configuration (starting ranks costs seconds).
Usage: python benchmarks/pipeline_bubble.py [--steps 6] [--seq 128] [--ubatch 4] [--layers 8]
       [--mode baseline_ag] [--json out.json]
``--mode l2l``: L2L stages (breadth-first only). Acceptance (issue 23): every row's measured bubble within
5 points of the pre-run model's prediction.

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


def jobs(
    layers: int, seq: int, ubatch: int, mode: str = "baseline_ag"
) -> list[tuple[tuple[str, str, int], list[str]]]:
    model = [
        "model=bert-mini",
        f"model.num_layers={layers}",
        "model.vocab_size=2048",
        "model.dropout=0.0",
        f"task.max_seq_len={seq}",
        "task.pad_to_max=true",
        "task.num_train=512",
        "task.num_eval=8",
        "trainer.progress=none",
        "hardware=measure",
    ]
    out = []
    for n in (P, 2 * P, 4 * P):
        for placement, schedule in CONFIGS:
            if mode != "baseline_ag" and schedule != "breadth_first":
                continue  # L2L stages run breadth-first only
            ov = [
                *model,
                f"mode={mode}",
                f"dist.nproc={P}",
                f"dist.pipeline={P}",
                f"dist.placement={placement}",
                f"dist.schedule={schedule}",
                f"batch.ubatch_size={ubatch}",
                f"batch.size={n * ubatch}",
            ]
            out.append(((placement, schedule, n), ov))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="steps per configuration; the first is not timed")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--ubatch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--mode", default="baseline_ag", help="what each stage runs: baseline_ag | l2l")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    plan = jobs(args.layers, args.seq, args.ubatch, args.mode)
    results = run_jobs(P, [ov for _, ov in plan], args.steps)[0]
    rows = []
    print(
        f"{'placement':11s} {'schedule':17s} {'n_mu':>4s} {'bubble':>7s} {'pre-run':>7s} {'paper':>7s} "
        f"{'compute':>8s} {'recv':>7s} {'overhd':>7s} {'idle':>7s} {'actions':>7s} {'action':>7s} "
        f"{'wake':>7s} {'samples/s':>9s} "
        f"within 5 points"
    )
    for (placement, schedule, n), res in zip([k for k, _ in plan], results, strict=True):
        pipe = res["sections"]["pipeline"]
        sps = statistics.median(s / t for s, t in zip(res["samples"][1:], res["step_time_s"][1:]))
        close = abs(pipe["bubble_measured"] - pipe["bubble_predicted"]) <= 0.05
        row = {
            "placement": placement,
            "schedule": schedule,
            "num_ubatches": n,
            "bubble_measured": pipe["bubble_measured"],
            "bubble_predicted": pipe["bubble_predicted"],
            "bubble_predicted_paper": pipe["bubble_predicted_paper"],
            "exchange_s": pipe["exchange_s"],
            "action_s": pipe["action_s"],
            "wake_s": pipe["wake_s"],
            "actions_per_rank": pipe["actions_per_rank"],
            "within_5_points": close,
            "samples_per_s": sps,
            "ranks": pipe["ranks"],
        }
        split = {
            k: statistics.mean(r.get(k) or 0.0 for r in pipe["ranks"])
            for k in ("compute_s", "recv_wait_s", "overhead_s", "idle_s")
        }
        row.update(split=split)
        rows.append(row)
        ms = [f"{1e3 * v:.0f}ms" for v in split.values()]
        print(
            f"{placement:11s} {schedule:17s} {n:4d} {pipe['bubble_measured']:7.3f} "
            f"{pipe['bubble_predicted']:7.3f} "
            f"{pipe['bubble_predicted_paper']:7.3f} {ms[0]:>8s} {ms[1]:>7s} {ms[2]:>7s} {ms[3]:>7s} "
            f"{max(pipe['actions_per_rank']):7d} {1e6 * pipe['action_s']:5.0f}us "
            f"{1e6 * pipe['wake_s']:5.0f}us {sps:9.1f} "
            f"{'yes' if close else 'NO'}"
        )
    for n in (P, 2 * P, 4 * P):
        by = {(r["placement"], r["schedule"]): r for r in rows if r["num_ubatches"] == n}
        mod, con = (
            by[("modular", "breadth_first")],
            by.get(("contiguous", "1f1b"), by[("contiguous", "breadth_first")]),
        )
        print(
            f"n_mu={n}: contiguous 1F1B / modular breadth-first bubble = "
            f"{con['bubble_measured'] / mod['bubble_measured']:.2f} (pre-run model "
            f"{con['bubble_predicted'] / mod['bubble_predicted']:.2f}; the paper's "
            f"{con['bubble_predicted_paper'] / mod['bubble_predicted_paper']:.2f} = L/P = {args.layers // P})"
        )
    print(
        f"rows within 5 points of the pre-run model: {sum(r['within_5_points'] for r in rows)} of {len(rows)}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
