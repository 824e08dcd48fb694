"""benchmarks/one_gpu_scale.py (issue 51): the scale cases through the same code on this CPU (``--tiny``), and
the dry run of the full-size cases with the planner's predictions and the host RAM each needs."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import pytest

from tests.util import REPO

GiB = 2**30


def bench() -> Any:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import one_gpu_scale
    finally:
        sys.path.pop(0)
    return one_gpu_scale


def json_lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]


def lines(out: str) -> list[dict[str, Any]]:
    """The cases' lines (not the line each depth prints as it ends)."""
    return [ln for ln in json_lines(out) if "runner" in ln]


def test_the_dry_run_lists_the_full_size_cases_with_predictions_and_host_ram(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every full-size case, the l2l ones with ``l2l train``'s command line and the planner's prediction
    under the 24 GiB budget at each depth they run and at full depth, and every case's host RAM."""
    b = bench()
    assert b.main(["--dry-run"]) == 0
    got = {ln["case"]: ln for ln in lines(capsys.readouterr().out)}
    assert set(got) == {c.name for c in b.cases(tiny=False)}
    for case in b.cases(tiny=False):
        line, full = got[case.name], case.shape.layers
        need = {int(d): v for d, v in line["host_need_bytes"].items()}
        assert sorted(need) == sorted({*case.depths, full})
        assert all(need[d] < need[e] for d, e in zip(sorted(need), sorted(need)[1:]))  # grows with depth
        if case.runner == "fsdp2":  # fp32 weights, gradients and AdamW's moments: 16 bytes a parameter
            params = full * case.shape.block_params() + 2 * case.shape.vocab * case.shape.hidden
            assert need[full] == pytest.approx(16 * params, rel=1e-3)
            continue
        assert line["command"].startswith("l2l train ") and "device.memory_gb=24.0" in line["command"]
        for d in need:
            p = line["plans"][str(d)]
            assert p["fits"] and p["device_bytes"] <= 24 * GiB and p["host_bytes"] == need[d]
            assert p["tokens_per_s"] == pytest.approx(case.batch * case.seq / p["step_s"])


def check_tiny_line(line: dict[str, Any], case: Any) -> None:
    """A --tiny case's line: the issue's fields, from both depths, within the device budget."""
    assert line["extrapolated"] and len(line["depths"]) == 2 and case.shape.layers > max(case.depths)
    a, b = sorted(int(d) for d in line["depths"])
    step = {int(d): v["step_s"] for d, v in line["depths"].items()}
    per_layer = (step[b] - step[a]) / (b - a)
    assert line["per_layer_s"] == pytest.approx(per_layer)
    assert line["step_s"] == pytest.approx(step[b] + (case.shape.layers - b) * per_layer)
    assert line["tokens_per_s"] == pytest.approx(case.batch * case.seq / line["step_s"])
    assert line["mfu"] == pytest.approx(
        case.flops_per_token(case.shape.layers) * line["tokens_per_s"] / (line["peak_tflops"] * 1e12)
    )
    assert "measured bf16 matmul" in line["peak_source"] and line["host_rss_anon_peak_bytes"] > 0
    assert all(math.isfinite(x) for d in line["depths"].values() for x in d["losses"])  # the weights train
    assert f"ran {a} and {b} of {case.shape.layers} layers" in line["note"]
    if case.runner == "l2l":  # the CPU meter's peak, under the budget it enforced; the planner beside it
        assert 0 < line["device_peak_bytes"] <= line["device_budget_bytes"] == int(case.budget_gb * GiB)
        assert line["plan"]["tokens_per_s"] > 0
        assert line["plan_error"] == pytest.approx(line["plan"]["tokens_per_s"] / line["tokens_per_s"] - 1)


@pytest.mark.slow  # the dry-run test is the default one
def test_the_qlora_case_runs_on_this_cpu_through_the_same_code(capsys: pytest.CaptureFixture[str]) -> None:
    """The 70B QLoRA case at a CPU's size: LoRA on an NF4 base (its codes and scales drawn directly), two
    depths, the fields of the issue; a JSON line, then the table."""
    b = bench()
    (case,) = [c for c in b.cases(tiny=True) if "qlora" in c.name]
    assert b.main(["--tiny", "--only", "qlora", "--steps", "2", "--hardware", "cpu-eps"]) == 0
    out = capsys.readouterr().out
    (line,) = lines(out)
    check_tiny_line(line, case)
    assert line["case"] in out.split(b.HEADER, 1)[1]
    # each depth printed as it ended, so a run cut short keeps what it measured
    depths = [ln for ln in json_lines(out) if "runner" not in ln]
    assert [(d["case"], d["layers"]) for d in depths] == [(case.name, n) for n in case.depths]
    assert all(d["step_s"] == line["depths"][str(d["layers"])]["step_s"] for d in depths)


@pytest.mark.slow
def test_every_case_runs_on_this_cpu_through_the_same_code(capsys: pytest.CaptureFixture[str]) -> None:
    """Acceptance 2: ``--tiny`` runs every case (l2l_p CMP, FSDP2 with CPU offload, QLoRA) and prints the
    fields."""
    b = bench()
    assert b.main(["--tiny", "--steps", "2", "--hardware", "cpu-eps"]) == 0
    got = {ln["case"]: ln for ln in lines(capsys.readouterr().out)}
    for case in b.cases(tiny=True):
        check_tiny_line(got[case.name], case)
