"""The product on GPUs, end to end: ``l2l train`` in every mode and precision, the disk tier, data parallel
and the 2-rank pipeline (baseline_ag and L2L stages, ``hardware=measure``), a kill and a resume of each
kind, and ``l2l generate``; one line per case with samples/s and the device peak.

    python scripts/gpu_check.py [--out outputs/gpu_check] [--steps 20] [--jobs 1] [--only NAME] [--dry-run]

``--dry-run`` prints each case's command line and runs nothing (no GPU needed). Without a CUDA device the
check says so and exits 0; with one GPU the 2-GPU cases are skipped, each saying why. Exit 1: a case failed.
``--jobs N`` runs N one-GPU cases at once (a GPU run of limited time checks more; their samples/s then
share the card and the host's cores, so compare throughput only from ``--jobs 1``).
Each case is what a user types: ``python -m l2l_cli train <overrides>`` (device=auto picks CUDA, and
dist.backend=auto NCCL between the GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# BERT-base on synthetic data: big enough that a GPU's numbers mean something, 20 steps in seconds
MODEL = [
    "model=bert-base",
    "task=synthetic",
    "task.num_train=2048",
    "task.num_eval=64",
    "task.max_seq_len=128",
    "task.pad_to_max=true",
    "batch.size=32",
    "batch.ubatch_size=8",
    "trainer.progress=none",
]
# (the baseline runs the minibatch whole: its micro-batch is the batch, MODEL[-2] replaced)
DECODER = [
    "model=llama-tiny",
    "task=lm",
    "task.max_seq_len=64",
    "batch.size=16",
    "batch.ubatch_size=4",
    "trainer.progress=none",
]
MODES = ("baseline", "baseline_ag", "l2l", "l2l_p")
PRECISIONS = {"baseline": ("fp32", "amp"), "baseline_ag": ("fp32", "amp")}  # cmp: the EPS modes only
PIPE = ["dist.nproc=2", "dist.pipeline=2", "hardware=measure"]


@dataclass
class Case:
    """One check: ``overrides`` for ``l2l train`` on ``gpus`` GPUs; ``kill``: SIGKILL after a checkpoint,
    then resume; ``generate``: then sample from the run with ``l2l generate``."""

    name: str
    overrides: list[str]
    gpus: int = 1
    kill: bool = False
    generate: bool = False
    result: dict = field(default_factory=dict)

    def train_argv(self, run: Path, steps: int) -> list[str]:
        save = [f"trainer.save_every={max(1, steps // 2)}"] if self.kill else []
        return [
            sys.executable,
            "-m",
            "l2l_cli",
            "train",
            *self.overrides,
            f"trainer.max_steps={steps}",
            *save,
            f"hydra.run.dir={run}",
        ]


def cases() -> list[Case]:
    out = []
    for mode in MODES:
        for prec in PRECISIONS.get(mode, ("fp32", "amp", "cmp")):
            model = [*MODEL[:-2], "batch.ubatch_size=32", MODEL[-1]] if mode == "baseline" else MODEL
            out.append(Case(f"1gpu {mode} {prec}", [*model, f"mode={mode}", f"precision={prec}"]))
    out.append(Case("1gpu l2l disk tier", [*MODEL, "mode=l2l", "precision=cmp", "eps.tier=disk"]))
    out.append(Case("1gpu baseline_ag kill+resume", [*MODEL, "mode=baseline_ag", "precision=amp"], kill=True))
    out.append(Case("1gpu l2l_p kill+resume", [*MODEL, "mode=l2l_p", "precision=cmp"], kill=True))
    decoder = [
        *DECODER,
        "mode=l2l",
        "precision=cmp",
        "trainer.save_final=true",
    ]  # final/: what generate reads
    out.append(Case("1gpu decoder l2l + generate", decoder, generate=True))
    out.append(Case("2gpu data parallel baseline_ag", [*MODEL, "mode=baseline_ag", "dist.nproc=2"], gpus=2))
    out.append(Case("2gpu data parallel l2l", [*MODEL, "mode=l2l", "precision=cmp", "dist.nproc=2"], gpus=2))
    out.append(Case("2gpu pipeline baseline_ag", [*MODEL, "mode=baseline_ag", *PIPE], gpus=2))
    out.append(Case("2gpu pipeline l2l stages", [*MODEL, "mode=l2l", "precision=cmp", *PIPE], gpus=2))
    out.append(
        Case(
            "2gpu data parallel kill+resume", [*MODEL, "mode=baseline_ag", "dist.nproc=2"], gpus=2, kill=True
        )
    )
    out.append(
        Case("2gpu pipeline baseline_ag kill+resume", [*MODEL, "mode=baseline_ag", *PIPE], gpus=2, kill=True)
    )
    out.append(
        Case("2gpu pipeline l2l kill+resume", [*MODEL, "mode=l2l", "precision=cmp", *PIPE], gpus=2, kill=True)
    )
    return out


def _logged(run: Path) -> int:
    path = run / "metrics.jsonl"
    return sum(1 for ln in path.read_text().splitlines() if ln.endswith("}")) if path.is_file() else 0


def _tail(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def run_case(case: Case, root: Path, steps: int) -> dict:
    """Train (and kill and resume, or generate) as a user would; what summary.json says of the run."""
    run = root / case.name.replace(" ", "_").replace("+", "_")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.perf_counter()
    argv = case.train_argv(run, steps)
    if case.kill:
        p = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        deadline = time.time() + 900
        while p.poll() is None and _logged(run) < steps // 2 + 1 and time.time() < deadline:
            time.sleep(0.2)
        if p.poll() is not None:
            return {
                "ok": False,
                "why": f"ended before the kill (exit {p.returncode}): {_tail(p.stderr.read())}",
            }
        os.killpg(p.pid, signal.SIGKILL)  # the launcher and its ranks
        p.wait()
        argv = [sys.executable, "-m", "l2l_cli", "train", f"trainer.resume={run}"]  # on, in its own dir
    r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    run.mkdir(parents=True, exist_ok=True)
    (run / "gpu_check.stderr").write_text(r.stderr)  # the whole story of a failed case, beside its run
    if r.returncode != 0:
        return {"ok": False, "why": f"exit {r.returncode}: {_tail(r.stderr)}"}
    summary = json.loads((run / "summary.json").read_text())
    out = {
        "ok": summary.get("status") == "ok",
        "samples_per_s": summary.get("samples_per_s"),
        "device_peak_bytes": summary.get("device_peak_bytes"),
        "device": summary.get("device"),
    }
    if case.kill:
        out["resumed_from"] = (summary.get("resumed_from") or {}).get("step")
        out["ok"] = out["ok"] and out["resumed_from"] is not None
    if case.generate:
        g = subprocess.run(
            [
                sys.executable,
                "-m",
                "l2l_cli",
                "generate",
                str(run),
                "--prompt",
                "The",
                "--max-new-tokens",
                "8",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        out["generate"] = (
            g.stdout.strip()[:80] if g.returncode == 0 else f"exit {g.returncode}: {_tail(g.stderr)}"
        )
        out["ok"] = out["ok"] and g.returncode == 0
        if g.returncode != 0:
            out["why"] = f"l2l generate: {out['generate']}"
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def line(case: Case) -> str:
    r = case.result
    if r.get("skipped"):
        return f"gpu_check: {case.name}: skipped ({r['skipped']})"
    if not r.get("ok"):
        return f"gpu_check: {case.name}: FAILED {r.get('why', '')}"
    sps, peak = r.get("samples_per_s"), r.get("device_peak_bytes")
    extra = f", resumed from step {r['resumed_from']}" if "resumed_from" in r else ""
    extra += f", generated {r['generate']!r}" if "generate" in r else ""
    return (
        f"gpu_check: {case.name}: ok {sps or 0:.1f} samples/s, device peak {(peak or 0) / 2**30:.2f} GiB "
        f"({r['wall_s']} s){extra}"
    )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "outputs" / "gpu_check"), help="run dirs and cases.json")
    ap.add_argument("--steps", type=int, default=20, help="training steps per case (20)")
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once (1: throughput comparable)")
    ap.add_argument("--only", action="append", default=[], help="run the cases whose name contains this")
    ap.add_argument("--dry-run", action="store_true", help="print each case's command; run nothing")
    a = ap.parse_args(argv)
    all_cases = [c for c in cases() if not a.only or any(o in c.name for o in a.only)]
    if a.dry_run:
        for c in all_cases:
            print(f"{c.name} [{c.gpus} gpu{'s' if c.gpus > 1 else ''}]: l2l train {shlex.join(c.overrides)}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}): nothing to check")
        return 0
    gpus = torch.cuda.device_count()
    root = Path(a.out) / time.strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True)
    print(f"gpu_check: {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}; runs in {root}")

    def check(c: Case) -> Case:
        if c.gpus > gpus:
            c.result = {"skipped": f"needs {c.gpus} GPUs, this machine has {gpus}"}
            return c
        try:
            c.result = run_case(c, root, a.steps)
        except Exception as e:  # a case's failure is its line; the others still run
            c.result = {"ok": False, "why": f"{type(e).__name__}: {e}"}
        return c

    with ThreadPoolExecutor(max(1, a.jobs)) as pool:  # each case is its own process: threads only wait
        for done in as_completed([pool.submit(check, c) for c in all_cases]):
            print(line(done.result()), flush=True)
    (root / "cases.json").write_text(json.dumps({c.name: c.result for c in all_cases}, indent=1) + "\n")
    failed = [c.name for c in all_cases if not c.result.get("ok") and not c.result.get("skipped")]
    print(
        f"gpu_check: {len(all_cases) - len(failed)} of {len(all_cases)} cases ok or skipped; "
        f"{'failed: ' + ', '.join(failed) if failed else 'none failed'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
