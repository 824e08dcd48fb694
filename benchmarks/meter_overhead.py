"""Issue 17's meter benchmark: what the device-memory meter (profile.memory) costs in throughput, counting
every op of every step (before: ``profile.memory_sample=false``) and sampled (after: the default), on the
8-layer BERT-Large-shaped config (batch 16, ubatch 4, seq 128, fp32), with the peaks both meters read.

    python benchmarks/meter_overhead.py                       # the real numbers: run it alone (~15 min)
    python benchmarks/meter_overhead.py --tiny --steps 3      # a smoke run (seconds)

Each configuration runs ``--steps`` steps; throughput is steady state like summary.json's (the first step
excluded, every other step counted, metered or not). Configurations are interleaved ``--repeats`` times and
the median taken, so a drift in the machine's load hits all three alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from harness import BERT_LARGE_8, gib

from l2l_cli.compose import compose
from l2l_cli.data.batches import TrainStream
from l2l_cli.data.synthetic import synthetic
from l2l_cli.data.tasks import TASKS, TaskData
from l2l_cli.session import build

METERS = {
    "off": ["profile.memory=false"],
    "every op (before)": ["profile.memory=true", "profile.memory_sample=false"],
    "sampled (after)": ["profile.memory=true", "profile.memory_sample=true"],
}
TINY = [
    "model=bert-tiny",
    "model.num_layers=2",
    "task.max_seq_len=64",
    "task.pad_to_max=true",
    "trainer.progress=none",
]


def run(overrides: list[str], steps: int) -> dict[str, Any]:
    """Steady-state samples/s (steps 2..n: total samples over total time) and the meter's peak."""
    cfg = compose([*overrides, "trainer.max_steps=100"])
    data = synthetic(
        max(64, cfg.batch.size * (steps + 1)), cfg.task.max_seq_len, cfg.model.vocab_size, seed=1
    )
    stream = TrainStream(data, cfg.batch.size, seed=0, pad_to_max=cfg.task.max_seq_len)
    with build(cfg, data=TaskData(TASKS["synthetic"], data, data, "synthetic")) as session:
        runner = session.runner
        assert runner is not None
        it = stream.batches()
        times = []
        for _ in range(steps):
            batch = next(it)
            t0 = time.perf_counter()
            runner.step(batch)
            times.append(time.perf_counter() - t0)
        peak, note = runner.acc.meter.peak_bytes, runner.acc.meter.note
    steady = times[1:] or times
    return {"sps": cfg.batch.size * len(steady) / sum(steady), "peak": peak, "note": note}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", default="baseline_ag,l2l")
    ap.add_argument("--tiny", action="store_true", help="bert-tiny, 2 layers: a smoke run")
    args = ap.parse_args()
    base = TINY if args.tiny else [*BERT_LARGE_8, "batch.size=16", "batch.ubatch_size=4"]
    if args.tiny:
        base = [*base, "batch.size=16", "batch.ubatch_size=4"]
    print(f"{'mode':12s} {'meter':20s} {'samples/s':>10s} {'vs off':>7s} {'device peak':>12s}")
    for mode in args.modes.split(","):
        got: dict[str, list[dict[str, Any]]] = {k: [] for k in METERS}
        for _ in range(args.repeats):
            for name, ov in METERS.items():
                got[name].append(run([*base, f"mode={mode}", *ov], args.steps))
        sps = {k: statistics.median(r["sps"] for r in v) for k, v in got.items()}
        for name, runs in got.items():
            peak = runs[-1]["peak"]
            print(
                f"{mode:12s} {name:20s} {sps[name]:10.3f} {sps[name] / sps['off']:7.3f} "
                f"{gib(peak) if peak else '-':>12s}",
                flush=True,
            )
        before, after = got["every op (before)"][-1]["peak"], got["sampled (after)"][-1]["peak"]
        print(
            f"{mode:12s} meter overhead: every op {1 - sps['every op (before)'] / sps['off']:+.1%}, sampled "
            f"{1 - sps['sampled (after)'] / sps['off']:+.1%} (target < 3%); peaks differ by "
            f"{abs(after - before) / before:.2%} (target < 2%); {got['sampled (after)'][-1]['note']}\n"
        )


if __name__ == "__main__":
    main()
