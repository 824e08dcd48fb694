#!/usr/bin/env bash
# Does the CUDA path hold? One command on a machine with a GPU:
#  1. the product itself (scripts/gpu_check.py): `l2l train` end to end in every mode and precision, the disk
#     tier, data parallel and the 2-rank pipeline (baseline_ag and L2L stages, hardware=measure), a kill and
#     resume of each kind, `l2l generate`; one line per case with samples/s and the device peak (2-GPU cases
#     say they were skipped, and why, on a machine with one GPU);
#  2. the `gpu` tests (pytest -m gpu: equivalence on the device, copies overlapped on streams without host
#     waits, half-precision gradients over the link, allocator-measured memory; with two GPUs, a 2-rank
#     pipeline on NCCL);
#  3. the BERT-Large benchmark;
#  4. the scale cases (benchmarks/one_gpu_scale.py, issue 51): an 8B full fine-tune and a 70B QLoRA under a
#     24 GiB device budget, and FSDP2 with CPU offload on the 8B shape; one JSON line each;
#  all summarised in one JSON file (default outputs/gpu_check.json).
#   bash scripts/gpu_check.sh [--only NAME]... [out.json]
#   bash scripts/gpu_check.sh --only scale   # the scale cases alone (--only 70b: the QLoRA case; --only 2gpu)
#   bash scripts/gpu_check.sh --dry-run      # the cases' command lines and the scale cases' predictions;
#                                            # runs nothing, needs no GPU
# --only NAME (repeatable) runs the product cases and the scale cases whose name contains NAME, and skips the
# gpu tests and the BERT-Large benchmark. Without a CUDA device it says so in one line and exits 0 (nothing
# to check). Exit 1: a case, a test or a benchmark failed (the JSON says which).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
ONLY=()
DRY=0
OUT=outputs/gpu_check.json
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --only) shift; ONLY+=(--only "${1:?--only needs a NAME}") ;;
    --only=*) ONLY+=(--only "${1#--only=}") ;;
    -*) echo "gpu_check: unknown option $1; allowed: --only NAME, --dry-run, out.json" >&2; exit 2 ;;
    *) OUT=$1 ;;
  esac
  shift
done
# the scale cases (benchmarks/one_gpu_scale.py): exit 2 where --only matches none of them (nothing to run)
scale() {
  local rc=0
  PYTHONPATH=. "$PY" benchmarks/one_gpu_scale.py "$@" "${ONLY[@]}" || rc=$?
  if [ "$rc" = 2 ] && [ ${#ONLY[@]} -gt 0 ]; then rc=0; fi
  return "$rc"
}
if [ "$DRY" = 1 ]; then
  "$PY" scripts/gpu_check.py --dry-run "${ONLY[@]}" || exit $?
  scale --dry-run 2>/dev/null
  exit $?
fi
mkdir -p "$(dirname "$OUT")"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  torch_v=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null || echo "not installed")
  echo "gpu_check: no CUDA device (torch $torch_v): nothing to check"
  printf '{"cuda": false, "torch": "%s", "ok": true, "note": "no CUDA device"}\n' "$torch_v" > "$OUT"
  exit 0
fi

gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  echo "gpu_check: $gpus CUDA devices: the 2-rank NCCL pipeline test runs (tests/test_pipeline.py, marker gpu)"
else
  echo "gpu_check: $gpus CUDA device: the 2-rank NCCL pipeline test needs two and is skipped"
fi
echo "gpu_check: the product, case by case (scripts/gpu_check.py)"
"$PY" scripts/gpu_check.py --out "$(dirname "$OUT")/gpu_check_runs" "${ONLY[@]}" 2>&1 | tee "$TMP/cases.log"
cases_rc=${PIPESTATUS[0]}

tests_rc=0
bench_rc=0
if [ ${#ONLY[@]} -eq 0 ]; then
  echo "gpu_check: pytest -m gpu"
  "$PY" -m pytest -m gpu -q -rs --junitxml="$TMP/gpu.xml" tests 2>&1 | tee "$TMP/pytest.log"
  tests_rc=${PIPESTATUS[0]}

  echo "gpu_check: benchmarks/l2l_bert_large.py"
  (cd benchmarks && "$PY" l2l_bert_large.py --json "$TMP/bench.json") 2>&1 | tee "$TMP/bench.log"
  bench_rc=${PIPESTATUS[0]}
else
  echo "gpu_check: --only ${ONLY[*]}: pytest -m gpu and the BERT-Large benchmark skipped"
fi

echo "gpu_check: the scale cases (benchmarks/one_gpu_scale.py)"
scale --json "$TMP/scale.jsonl" 2>&1 | tee "$TMP/scale.log"
scale_rc=${PIPESTATUS[0]}

"$PY" - "$TMP" "$OUT" "$tests_rc" "$bench_rc" "$cases_rc" "$scale_rc" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
import torch
tmp, out, tests_rc, bench_rc = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cases_rc, scale_rc = int(sys.argv[5]), int(sys.argv[6])
case_lines = [ln for ln in (tmp / "cases.log").read_text().splitlines() if ln.startswith("gpu_check: ")]
tests = {"returncode": tests_rc}
if (tmp / "gpu.xml").is_file():
    suite = ET.parse(tmp / "gpu.xml").getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    tests.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
    tests["failed"] = [
        f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
bench = json.loads((tmp / "bench.json").read_text()) if (tmp / "bench.json").is_file() else None
scale = [json.loads(ln) for ln in (tmp / "scale.jsonl").read_text().splitlines()] if (tmp / "scale.jsonl").is_file() else []
summary = {
    "cuda": True, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
    "ok": tests_rc == 0 and bench_rc == 0 and cases_rc == 0 and scale_rc == 0, "tests": tests,
    "cases": {"returncode": cases_rc, "lines": case_lines},
    "benchmark": {"returncode": bench_rc, **(bench or {})},
    "scale": {"returncode": scale_rc, "cases": scale},
}
out.write_text(json.dumps(summary, indent=2) + "\n")
print(f"gpu_check: {'OK' if summary['ok'] else 'FAILED'}: cases exit {cases_rc}, tests {tests}, benchmark exit {bench_rc}, scale exit {scale_rc}; wrote {out}")
PYEOF
[ "$cases_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$scale_rc" -eq 0 ]
