"""Device-tier memory, measured: constant in depth with the CPU stash, growing by the stash on the device,
growing with everything for the baseline; OOM rows on the simulated accelerator (L2L v2 Table 4 shape)."""

from __future__ import annotations

import json

import pytest
import torch

from l2l_cli.models import make_spec
from l2l_cli.profiling.memory import DeviceOutOfMemory, StorageMeter
from l2l_cli.train import run_job
from tests.util import tiny_cfg, train

FIXED = ["task.pad_to_max=true", "task.max_seq_len=16", "batch.size=8", "batch.ubatch_size=2"]  # 4 ubatches


def peak(mode: str, layers: int, *extra: str) -> tuple[int, dict[str, int]]:
    r = train(tiny_cfg(f"mode={mode}", f"model.num_layers={layers}", *FIXED, *extra), steps=2)
    return r["peak"], r["parts"]


def test_storage_meter_counts_allocations_once_and_frees() -> None:
    m = StorageMeter()
    with m:
        a = torch.zeros(1000)  # 4000 bytes
        b = a.view(10, 100)  # a view: not new memory
        a.add_(1)  # in place: not new memory
        c = a * 2
        assert m.current_bytes == 8000
        del c
        assert m.current_bytes == 4000 and m.peak_bytes == 8000
        with m.paused():
            d = torch.ones(10_000)  # host-tier work: not counted
        assert m.current_bytes == 4000
    del a, b, d
    assert m.current_bytes == 0


def test_budget_raises_device_oom() -> None:
    m = StorageMeter(budget_bytes=10_000)
    with m, pytest.raises(DeviceOutOfMemory, match="device out of memory"):
        torch.zeros(100_000)
    assert m.current_bytes == 0


def test_stash_cpu_device_memory_constant_in_depth() -> None:
    peaks = [peak("l2l_stash_cpu", n)[0] for n in (4, 16, 64)]
    assert max(peaks) <= 1.05 * min(peaks), peaks


def test_stash_device_grows_by_one_layer_output_per_ubatch_per_layer() -> None:
    (p4, parts4), (p16, parts16) = peak("l2l", 4), peak("l2l", 16)
    cfg = tiny_cfg()
    layer_output = 2 * 16 * cfg.model.hidden_size * 4  # ubatch x seq x hidden x fp32
    per_layer = (p16 - p4) / 12
    assert per_layer == pytest.approx(4 * layer_output, rel=0.15), (p4, p16)
    assert parts16["stash"] - parts4["stash"] == pytest.approx(12 * 4 * layer_output, rel=0.01)
    assert parts4["layer_slots"] == parts16["layer_slots"]  # two slots (w + grad), whatever the depth


def test_baseline_grows_with_weights_grads_optimizer_and_activations() -> None:
    (b4, parts4), (b16, parts16) = peak("baseline_ag", 4), peak("baseline_ag", 16)
    spec = make_spec(tiny_cfg().model, 2)
    block = sum(p.numel() for p in spec.new_layer("block", "meta").parameters())
    state = 12 * block * 4 * 4  # 12 more blocks: weights, grads, two Adam moments, fp32
    assert b16 - b4 >= state
    for part in ("weights", "grads", "optimizer_state"):
        assert parts16[part] - parts4[part] == pytest.approx(
            12 * block * 4 * (2 if part == "optimizer_state" else 1), rel=0.02
        )
    l2l_growth = peak("l2l", 16)[0] - peak("l2l", 4)[0]
    assert b16 - b4 > 3 * l2l_growth


@pytest.mark.parametrize(("mode", "status"), [("baseline_ag", "oom"), ("l2l_stash_cpu", "ok")])
def test_sim_budget_baseline_ooms_while_l2l_stash_cpu_trains(tmp_path, mode: str, status: str) -> None:
    cfg = tiny_cfg(
        f"mode={mode}", "model.num_layers=48", "model.hidden_size=64", "model.intermediate_size=256",
        "device=sim", "sim.memory_gb=0.01", "trainer.max_steps=2", "task.num_train=64", "task.num_eval=16",
    )  # fmt: skip
    assert run_job(cfg, tmp_path) == status
    summary = json.loads((tmp_path / "summary.json").read_text())
    memory = json.loads((tmp_path / "memory.json").read_text())
    assert summary["status"] == status
    assert memory["device"]["budget_bytes"] == int(0.01 * 2**30)
    if status == "oom":
        assert "mode=l2l" in summary["error"] and "mode.stash=cpu" in summary["error"]
        assert summary["steps"] == 0
    else:
        assert summary["steps"] == 2 and memory["device"]["peak_bytes"] <= memory["device"]["budget_bytes"]
        assert set(memory["host"]["parts"]) >= {"master", "grads", "optimizer_state", "cpu_stash"}
        assert set(memory["device"]["parts"]) >= {"layer_slots", "workspace"}
