"""Digest of the final weights of every mode x precision after 3 steps on the bert-tiny synthetic config,
plus LAMB and 8-bit AdamW, the disk tier, the GPT-2 and Llama decoders (task=lm), 2-rank data parallel and
the modular pipeline.

A change that should not change numbers must leave these bit-identical (torchtitan's rule): record the
digests on the commit before the change, then check after it, on the same machine.

    python scripts/weights_digest.py --out /tmp/before.json            # on the old commit
    python scripts/weights_digest.py --out /tmp/after.json --check /tmp/before.json

Runs the real CLI (``python -m l2l_cli train``) so it works across refactors of the Python API.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file

MODES = ["baseline", "baseline_ag", "l2l", "l2l_p", "l2l_stash_cpu"]
PRECISIONS = ["fp32", "amp", "cmp", "mixed"]
COMMON = ["trainer.max_steps=3", "trainer.save_final=true", "trainer.progress=none", "task.num_eval=64"]


def combos() -> list[tuple[str, list[str]]]:
    out = []
    for mode in MODES:
        for prec in PRECISIONS:
            if prec == "cmp" and mode.startswith("baseline"):
                continue  # refused by the config: CMP needs the EPS
            extra = ["batch.ubatch_size=32"] if mode == "baseline" else []
            out.append((f"{mode}/{prec}", [f"mode={mode}", f"precision={prec}", *extra]))
    out.append(("l2l/fp32/lamb", ["mode=l2l", "optim=lamb"]))
    out.append(("baseline_ag/fp32/lamb", ["mode=baseline_ag", "optim=lamb"]))
    for mode, prec in (("l2l", "fp32"), ("l2l_p", "cmp"), ("baseline_ag", "fp32")):
        out.append((f"{mode}/{prec}/adamw8bit", [f"mode={mode}", f"precision={prec}", "optim=adamw8bit"]))
    # the disk tier, the decoders, data parallel and the modular pipeline (2 ranks each)
    out.append(("l2l/fp32/disk", ["mode=l2l", "eps.tier=disk"]))
    out.append(("l2l_p/cmp/disk", ["mode=l2l_p", "precision=cmp", "eps.tier=disk"]))
    for family in ("gpt2-tiny", "llama-tiny"):
        for mode in ("baseline_ag", "l2l", "l2l_p"):
            out.append((f"{mode}/fp32/{family}", [f"mode={mode}", f"model={family}", "task=lm"]))
    out.append(("l2l_p/fp32/dp2", ["mode=l2l_p", "dist.nproc=2"]))
    out.append(("baseline_ag/fp32/dp2", ["mode=baseline_ag", "dist.nproc=2"]))
    out.append(("baseline_ag/fp32/pipeline2", ["mode=baseline_ag", "dist.nproc=2", "dist.pipeline=2"]))
    out.append(
        (
            "baseline_ag/fp32/pipeline2x2-partitioned",
            ["mode=baseline_ag", "dist.nproc=4", "dist.pipeline=2", "dist.partition_state=true"],
        )
    )
    return out


def digest(final: Path) -> dict[str, str]:
    tensors = load_file(str(final / "model.safetensors"))
    return {k: hashlib.sha256(tensors[k].numpy().tobytes()).hexdigest()[:16] for k in sorted(tensors)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--check", help="a previous --out to compare against (exit 1 on any difference)")
    ap.add_argument(
        "--only", help="comma-separated parts of names (e.g. disk,dp2): run only the combinations naming one"
    )
    args = ap.parse_args()
    only = [x for x in (args.only or "").split(",") if x]
    chosen = [(n, o) for n, o in combos() if not only or any(x in n for x in only)]
    if not chosen:
        print(f"--only {args.only}: no combination matches (names: {', '.join(n for n, _ in combos())})")
        return 2
    results: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in chosen:
            run_dir = Path(tmp) / name.replace("/", "-")
            cmd = [sys.executable, "-m", "l2l_cli", "train", *overrides, *COMMON, f"hydra.run.dir={run_dir}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
                return 1
            results[name] = digest(run_dir / "final")
            print(
                f"{name}: {hashlib.sha256(json.dumps(results[name]).encode()).hexdigest()[:16]}", flush=True
            )
    Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    if args.check:
        before = json.loads(Path(args.check).read_text())
        if only:  # (a full --out checked against a partial run: the combinations run)
            before = {k: v for k, v in before.items() if k in results}
        bad = [k for k in before if before[k] != results.get(k)]
        for k in bad:
            diff = [t for t in before[k] if before[k][t] != results.get(k, {}).get(t)]
            print(f"DIFFERS {k}: {len(diff)} tensors, e.g. {diff[:3]}")
        print(f"{len(before) - len(bad)}/{len(before)} combinations bit-identical")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
