"""Soak: train bert-tiny for many steps in l2l, l2l_p and on the disk tier, and watch the process for leaks.

Each configuration runs as its own ``l2l train`` process; this script samples it from /proc every ``--every``
steps (as its metrics.jsonl reaches them): resident memory (VmRSS), open file descriptors and threads. After
the first ``--every`` steps (warm-up: allocator pools, thread pools, caches) RSS must not grow by more than 2%
(the last quarter's median against the first quarter's: a leak is a trend, a sample that caught a layer's
buffer in flight is not) and the descriptors and threads must stay constant (their floor: the disk tier opens
a layer file per write and closes it after, so a sample may catch one open).

    python benchmarks/soak.py                      # 2,000 steps each (~5 min per configuration, 2 cores)
    python benchmarks/soak.py --steps 300 --json   # the slow test's length
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {
    "l2l": ["mode=l2l"],
    "l2l_p": ["mode=l2l_p"],
    "disk": ["mode=l2l", "eps.tier=disk"],
}
COMMON = [
    "model=bert-tiny",
    "task=synthetic",
    "task.num_train=4096",
    "batch.size=16",
    "batch.ubatch_size=4",
    "trainer.progress=none",
    "trainer.eval_every=0",
    "logger=csv",
]
RSS_GROWTH = 0.02


def _proc(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(ln.split()[1]) * 1024 for ln in status.splitlines() if ln.startswith("VmRSS:"))
    return {
        "rss": rss,
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": len(os.listdir(f"/proc/{pid}/task")),
    }


def soak(name: str, steps: int, every: int, out: Path) -> dict:
    """Run one configuration for ``steps`` steps; sample it at every ``every``-th step."""
    run = out / name
    cmd = [
        sys.executable,
        "-m",
        "l2l_cli",
        "train",
        *COMMON,
        *CONFIGS[name],
        f"trainer.max_steps={steps}",
        "trainer.epochs=1000",
        f"hydra.run.dir={run}",
    ]
    log = (out / f"{name}.stderr").open("w+")  # a file, not a pipe: a full pipe would stall the run
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    samples: list[dict[str, int]] = []
    metrics = run / "metrics.jsonl"
    next_step = every
    try:
        while proc.poll() is None and next_step < steps:
            done = metrics.read_text().count("\n") if metrics.exists() else 0
            if done >= next_step:
                try:
                    samples.append({"step": done, **_proc(proc.pid)})
                except (OSError, StopIteration):
                    break
                print(
                    f"{name:6s} step {done:5d}: RSS {samples[-1]['rss'] / 2**20:7.1f} MiB, "
                    f"{samples[-1]['fds']} open files, {samples[-1]['threads']} threads",
                    flush=True,
                )
                next_step += every
            time.sleep(0.05)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.seek(0)
        err = log.read()
        log.close()
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}: {err[-2000:]}")
    base, rest = samples[0], samples[1:]
    # RSS: a leak is a trend, so the last quarter's median against the first quarter's (from step
    # ``every`` on); one sample that caught a layer's buffer in flight is not growth
    quarter = max(1, len(samples) // 4)
    first, last = (
        statistics.median(s["rss"] for s in part) for part in (samples[:quarter], samples[-quarter:])
    )
    growth = last / first - 1 if rest else 0.0
    # descriptors and threads: a leak raises the floor; a sample taken while the disk tier's writer has a
    # layer file open (opened per write, closed after) is a transient, not a leak
    late = rest[len(rest) // 2 :] or rest
    fds_ok = not late or min(s["fds"] for s in late) <= base["fds"]
    threads_ok = not late or min(s["threads"] for s in late) <= base["threads"]
    return {
        "config": name,
        "steps": steps,
        "samples": samples,
        "rss_growth": growth,
        "fds_constant": fds_ok,
        "threads_constant": threads_ok,
        "ok": growth <= RSS_GROWTH and fds_ok and threads_ok,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="l2l-soak-") as tmp:
        for name in args.configs.split(","):
            results.append(soak(name, args.steps, args.every, Path(tmp)))
    for r in results:
        print(
            f"{r['config']:6s}: RSS growth from step {args.every} on (median, first vs last quarter): "
            f"{100 * r['rss_growth']:+.2f}% "
            f"(limit {100 * RSS_GROWTH:.0f}%), open files constant: {r['fds_constant']}, threads constant: "
            f"{r['threads_constant']} -> {'ok' if r['ok'] else 'LEAK'}"
        )
    if args.json:
        print(json.dumps(results))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
