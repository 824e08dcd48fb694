"""Device-tier memory, measured: constant in depth with the CPU stash, growing by the stash on the device,
growing with everything for the baseline; OOM rows on the simulated accelerator (L2L v2 Table 4 shape)."""

from __future__ import annotations

import json

import pytest
import torch

from l2l_cli.models import make_spec
from l2l_cli.profiling.memory import CudaMeter, DeviceOutOfMemory, StorageMeter
from l2l_cli.train import run_job
from tests.util import batches, built, tiny_cfg, train

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
        f"mode={mode}",
        "model.num_layers=48",
        "model.hidden_size=64",
        "model.intermediate_size=256",
        "device=sim",
        "sim.memory_gb=0.01",
        "trainer.max_steps=2",
        "task.num_train=64",
        "task.num_eval=16",
    )
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


@pytest.mark.parametrize(("mode", "status"), [("baseline_ag", "oom"), ("l2l_stash_cpu", "ok")])
def test_a_cpu_device_budget_is_enforced_as_the_sims(tmp_path, mode: str, status: str) -> None:
    """``device.memory_gb`` on a CPU device tier: the meter enforces it op by op as ``device=sim`` does its
    ``sim.memory_gb`` (an out-of-memory past it; the CPU's copies stay inline), and memory.json reports it
    beside the peak."""
    cfg = tiny_cfg(
        f"mode={mode}",
        "model.num_layers=48",
        "model.hidden_size=64",
        "model.intermediate_size=256",
        "device=cpu",
        "device.memory_gb=0.01",
        "trainer.max_steps=2",
        "task.num_train=64",
        "task.num_eval=16",
    )
    assert run_job(cfg, tmp_path) == status
    summary = json.loads((tmp_path / "summary.json").read_text())
    memory = json.loads((tmp_path / "memory.json").read_text())
    assert memory["device"]["budget_bytes"] == int(0.01 * 2**30) and summary["device"].startswith("cpu (0.01")
    if status == "ok":
        assert memory["device"]["peak_bytes"] <= memory["device"]["budget_bytes"]
        assert memory["device"].get("note") is None  # every op metered: a budget is not sampled


# ---- the meter: sampled vs every op, windows, CUDA's parts ---------------------------------------------


@pytest.mark.parametrize("mode", ["l2l", "baseline_ag"])
def test_sampled_meter_reads_what_the_every_op_meter_reads(mode: str) -> None:
    """The same run (batches of varying length) under both meters: the same peak and parts, while the
    sampled one counted op by op in only some of the steps."""
    runs = {}
    for sample in (True, False):
        cfg = tiny_cfg(
            f"mode={mode}",
            f"profile.memory_sample={str(sample).lower()}",
            "batch.ubatch_size=4",
            "task.max_seq_len=32",
        )
        with built(cfg) as runner:
            it = batches(cfg)
            shapes = []
            for _ in range(6):
                b = next(it)
                shapes.append(b.input_ids.shape[1])
                runner.step(b)
            meter = runner.acc.meter
            runs[sample] = (meter.peak_bytes, meter.peak_parts, meter.note)
    assert len(set(shapes)) > 1  # lengths vary, so sampling had shapes to decide on
    (p_s, parts_s, note), (p_x, parts_x, none) = runs[True], runs[False]
    assert p_s == pytest.approx(p_x, rel=0.02) and parts_s.keys() == parts_x.keys()
    for k in parts_x:
        assert parts_s[k] == pytest.approx(parts_x[k], rel=0.02, abs=1024), k
    metered, total = (int(x) for x in note.split(": ")[1].split(" windows")[0].split(" of "))
    assert total >= 7 and metered < total - 2 and none is None  # building the runner + 6 steps


def test_meter_counts_inside_windows_and_allocation_points_only() -> None:
    m = StorageMeter(sample=True)
    outside = torch.zeros(1000)  # host work between windows (batch collation, say): not counted
    with m.window():
        a = torch.zeros(2000)
    owned = torch.empty(500)
    m.count(owned, "layer_slots")  # an allocation point a runner owns: counted wherever it happens
    assert m.current_bytes == 8000 + 2000 and m.peak_parts == {"workspace": 8000, "layer_slots": 2000}
    for _ in range(3):  # the same shape again and again: metered twice, then skipped
        with m.window(("train", (8, 16))):
            torch.ones(100)
    with m.window(("train", (8, 32))):  # a longer sequence than any metered: metered
        torch.ones(100)
    with m.window(("train", (4, 16))):  # fewer rows, no longer: skipped
        torch.ones(100)
    assert m.note is not None and m.note.startswith("sampled: 4 of 6 windows")
    del outside, a


def test_l2l_p_host_work_is_not_device_memory() -> None:
    """L2L-p's trailing update and speculative bookkeeping run on the compute thread too, but are host work:
    the device peak and its parts equal L2L's."""
    common = ["optim.max_grad_norm=0.24", "profile.memory_sample=false"]  # a rollback in step 1
    a, b = train(tiny_cfg("mode=l2l", *common)), train(tiny_cfg("mode=l2l_p", *common))
    assert a["peak"] == b["peak"] and a["parts"] == b["parts"]


class FakeAllocator:
    """engine/device.py's CudaAllocator, its counters in ``alloc`` (``now``, ``peak``), set by the test."""

    def __init__(self, alloc: dict[str, int]):
        self.alloc = alloc

    def allocated(self) -> int:
        return self.alloc["now"]

    def max_allocated(self) -> int:
        return self.alloc["peak"]

    def reset_peak(self) -> None:
        self.alloc.update(peak=self.alloc["now"])


def test_cuda_meter_parts_are_the_owned_tensors_at_the_peak(monkeypatch) -> None:
    """CudaMeter's logic with the allocator's counters faked: the parts at the peak are the tensors the
    runner counted as they stood when the peak was marked, the rest of the peak is workspace."""
    alloc = {"now": 1000, "peak": 1000}
    m = CudaMeter(torch.device("cuda", 0), FakeAllocator(alloc))
    slots = torch.empty(250)  # stands for a device tensor: the meter only reads its storage's size
    m.count(slots, "layer_slots")
    stash = torch.empty(100)
    m.tag(stash, "stash")
    with m.window(("train", (8, 16))):
        alloc.update(now=1000 + 1400 + 5000, peak=1000 + 1400 + 5000)  # slots + stash + 5000 of workspace
    del stash  # freed after the peak: the parts at the peak keep it
    alloc.update(now=1000 + 1000)
    m.mark()
    assert m.peak_bytes == 6400
    assert m.peak_parts == {"layer_slots": 1000, "stash": 400, "workspace": 5000}


def test_cuda_meter_forgets_an_earlier_runs_peak_in_the_same_process() -> None:
    """The caching allocator's peak is per process: a second run in one process (an ``-m`` sweep, a test
    session) must not report the first run's peak, nor its own parts as they stood before that peak."""
    alloc = {"now": 1000, "peak": 9_000_000}  # an earlier run peaked at 9 MB and freed it all
    m = CudaMeter(torch.device("cuda", 0), FakeAllocator(alloc))
    assert m.peak_bytes == 0
    weights = torch.empty(100)
    m.count(weights, "weights")
    with m.window(("train", (8, 16))):
        alloc.update(now=1000 + 400, peak=1000 + 400 + 600)
    moments = torch.empty(200)  # counted after the first peak: a later, higher one includes them
    m.count(moments, "optimizer_state")
    with m.window(("train", (8, 16))):
        alloc.update(now=1000 + 1200, peak=1000 + 1200 + 600)
    assert m.peak_bytes == 1800
    assert m.peak_parts == {"weights": 400, "optimizer_state": 800, "workspace": 600}
