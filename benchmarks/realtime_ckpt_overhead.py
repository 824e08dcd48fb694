"""Issue 7's benchmark: the step-time overhead of real-time checkpoints (trainer.realtime_ckpt=true: the
EPS writes every layer to disk right after its update, in the background). Target: <= 5% of step time.
Usage: python benchmarks/realtime_ckpt_overhead.py [--steps 6] [--model bert-large] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(extra: list[str], steps: int, model: str, layers: int) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "l2l_cli",
            "train",
            "mode=l2l_p",
            f"model={model}",
            f"model.num_layers={layers}",
            "task.max_seq_len=128",
            "task.pad_to_max=true",
            "batch.size=32",
            "batch.ubatch_size=16",
            f"trainer.max_steps={steps}",
            "task.num_eval=8",
            "trainer.progress=none",
            *extra,
            f"hydra.run.dir={tmp}",
        ]
        subprocess.run(cmd, check=True, capture_output=True)
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()][1:]
        written = (
            sum(f.stat().st_size for f in (Path(tmp) / "checkpoints").glob("**/*.safetensors"))
            if extra
            else 0
        )
        busy = statistics.median(r.get("realtime_ckpt_s", 0.0) for r in rows)
        return statistics.median(r["step_time_s"] for r in rows), written, busy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default="bert-large")
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    base, _, _ = run([], a.steps, a.model, a.layers)
    rt, size, busy = run(["trainer.realtime_ckpt=true"], a.steps, a.model, a.layers)
    print(
        f"step time without real-time checkpoints {base:.2f} s, with {rt:.2f} s: overhead "
        f"{rt / base - 1:+.1%} (target <= 5%)"
    )
    print(
        f"one real-time checkpoint on disk: {size / 2**20:.0f} MiB, rewritten every step; "
        f"the background writer is busy {busy:.2f} s per step ({size / 2**30 / max(busy, 1e-9):.1f} GiB/s)"
    )


if __name__ == "__main__":
    main()
