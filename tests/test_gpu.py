"""The CUDA path (``pytest -m gpu``; skipped where no CUDA device is present): equivalence on the GPU,
copies that overlap compute without host waits, half-precision gradients over the link, and memory
measured by the allocator. ``scripts/gpu_check.sh`` runs these and the BERT-Large benchmark."""

from __future__ import annotations

import statistics
import threading

import pytest
import torch

from tests.util import assert_same_weights, batches, built, tiny_cfg, train, weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

CUDA = ["device=cuda"]
# big enough that a layer's copy takes as long as some of its compute, small enough for any GPU
WIDE = [
    "model.num_layers=6",
    "model.hidden_size=1024",
    "model.num_heads=16",
    "model.intermediate_size=4096",
    "model.vocab_size=30522",
    "task.max_seq_len=128",
    "task.pad_to_max=true",
    "batch.size=32",
]


@pytest.fixture(autouse=True)
def _exact_fp32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # FP32 equivalence: no TF32 matmuls
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("mode", ["l2l", "l2l_p", "l2l_stash_cpu"])
def test_l2l_modes_equal_baseline_ag_on_the_gpu(mode: str) -> None:
    ref = train(tiny_cfg("mode=baseline_ag", *CUDA))
    got = train(tiny_cfg(f"mode={mode}", *CUDA))
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4)
    assert_same_weights(got["weights"], ref["weights"], rtol=1e-3)


def test_l2l_p_equals_l2l_under_cmp_fp16_with_clipping() -> None:
    common = [*CUDA, "precision=cmp", "optim.max_grad_norm=0.24"]
    ref, got = train(tiny_cfg("mode=l2l", *common)), train(tiny_cfg("mode=l2l_p", *common))
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert_same_weights(got["weights"], ref["weights"])


def test_cmp_gradients_cross_the_link_in_half_precision() -> None:
    """Per step each layer goes down once per pass (forward, backward; the last block is reused at the
    turn) and its gradient comes back once, in fp16: 2 bytes per parameter each way, and beside each
    gradient its norm, one fp32 scalar (taken on the device: no host norm pass)."""
    cfg = tiny_cfg("mode=l2l", *CUDA, "precision=cmp")
    with built(cfg) as runner:
        d2h0 = runner.acc.d2h.bytes
        runner.step(next(batches(cfg)))
        params = sum(st.w.numel() for st in runner.eps.layers)
        norms = sum(st.w.numel() > 0 for st in runner.eps.layers)
        assert runner.acc.d2h.bytes - d2h0 == 2 * params + 4 * norms
        assert all(st.g_recv is not None and st.g_recv.dtype == torch.float16 for st in runner.eps.layers)


def test_only_the_links_host_buffers_are_pinned() -> None:
    """What crosses the link is pinned, to its size (the half send copy, the gradient's receive buffer, the
    stash); under CMP the FP32 master never crosses it and stays pageable."""
    cfg = tiny_cfg("mode=l2l_stash_cpu", *CUDA, "precision=cmp")
    with built(cfg) as runner:
        runner.step(next(batches(cfg)))
        for st in runner.eps.layers:
            assert st.send.is_pinned() and st.recv.is_pinned() and not st.w.is_pinned()
        assert all(buf.is_pinned() for buf in runner.stash._host.values())


def test_a_step_never_waits_on_the_device_from_the_compute_thread(monkeypatch) -> None:
    """Copies and compute are ordered by events on streams: the compute thread does not synchronize with
    the GPU per layer or per micro-batch (the EPS thread does, to read each gradient: that is its job).
    Per step it waits once for an event, the last layer's gradient, which the step's verdict (global norm,
    finite or not) needs; and once for the loss it reports (an .item(), not counted here)."""
    cfg = tiny_cfg("mode=l2l_p", *CUDA, "mode.stash=cpu", "precision=cmp")
    main = threading.get_ident()
    calls: list[str] = []
    event_sync, device_sync = torch.cuda.Event.synchronize, torch.cuda.synchronize

    def on_event(ev: torch.cuda.Event) -> None:
        if threading.get_ident() == main:
            calls.append("event.synchronize")
        event_sync(ev)

    def on_device(*a: object, **kw: object) -> None:
        if threading.get_ident() == main:
            calls.append("torch.cuda.synchronize")
        device_sync(*a, **kw)

    with built(cfg) as runner:
        it = batches(cfg)
        runner.step(next(it))
        monkeypatch.setattr(torch.cuda.Event, "synchronize", on_event)
        monkeypatch.setattr(torch.cuda, "synchronize", on_device)
        runner.step(next(it))
        step = list(calls)  # (not the accelerator's close: it synchronizes before it unpins its buffers)
    assert "torch.cuda.synchronize" not in step and step.count("event.synchronize") <= 1, step


def exposed_transfer(*extra: str) -> float:
    # a small vocabulary: the embeddings' copy (no compute of theirs to hide it) would otherwise be a
    # third of the bytes, and the first layer's load has nothing before it to overlap with
    r = train(tiny_cfg("mode=l2l", *CUDA, *WIDE, "model.vocab_size=2048", *extra), steps=4)
    return statistics.median(rep.phases.get("transfer", 0.0) for rep in r["reports"][1:])


def test_prefetch_on_the_copy_stream_hides_layer_copies() -> None:
    """With profile.sync_timers the phases are exact: the copy of layer l+1 runs on the copy stream while
    layer l computes, so waiting for loads takes far less time than copying every layer in line."""
    sync = "profile.sync_timers=true"
    hidden = exposed_transfer(sync, "batch.ubatch_size=8")
    inline = exposed_transfer(sync, "batch.ubatch_size=8", "mode.prefetch=false")
    assert hidden < 0.5 * inline, (hidden, inline)


def test_l2l_p_hides_the_update_on_the_gpu() -> None:
    """The host updates layer l+1 while the GPU runs layer l's backward: the update time the step waits
    for is what that backward cannot cover, not the whole update. The cover is measured in the same run
    (``profile.sync_timers``: the compute stream's kernel time per phase), so the check holds on any pair of
    GPU and host; the batch is large enough that backward covers much of the update on a fast GPU too.
    (The small vocabulary keeps the embeddings' update, which no backward follows, out of the way.)"""
    cfg = tiny_cfg(
        "mode=l2l_p",
        *CUDA,
        *WIDE,
        "model.vocab_size=2048",
        "batch.size=256",
        "batch.ubatch_size=32",
        "optim.max_grad_norm=1e9",
        "profile.sync_timers=true",
    )
    reports = train(cfg, steps=4)["reports"][1:]
    update = sum(r.extra["eps_update_s"] for r in reports)
    waited = sum(r.extra["optimizer_wait_s"] for r in reports)
    cover = sum(r.phases.get("backward", 0.0) + r.phases.get("recompute", 0.0) for r in reports)
    assert waited <= max(0.0, update - cover) + 0.35 * update, (waited, update, cover)


def test_cuda_memory_is_constant_in_depth_with_the_cpu_stash_and_parts_add_up() -> None:
    peaks = []
    for layers in (2, 8):
        r = train(tiny_cfg("mode=l2l_stash_cpu", *CUDA, *WIDE, f"model.num_layers={layers}"), steps=2)
        peaks.append(r["peak"])
        assert sum(r["parts"].values()) == r["peak"] and r["parts"]["layer_slots"] > 0
    assert peaks[1] <= 1.05 * peaks[0], peaks


def test_baseline_memory_parts_name_weights_grads_and_optimizer_state() -> None:
    r = train(tiny_cfg("mode=baseline_ag", *CUDA), steps=2)
    parts = r["parts"]
    assert "optimizer_state" in parts, parts
    assert (
        parts["weights"] > 0 and parts["grads"] > 0 and parts["optimizer_state"] >= 2 * parts["grads"] * 0.99
    )
    assert sum(parts.values()) == r["peak"]


@pytest.mark.parametrize("name", ["1gpu l2l cmp", "1gpu baseline_ag kill+resume", "2gpu pipeline l2l stages"])
def test_the_product_runs_on_the_gpu(tmp_path, name: str) -> None:
    """A sample of ``scripts/gpu_check.py``'s cases (the script runs them all): ``l2l train`` as a user runs
    it, on the GPU(s), to a summary that says ok (a kill and resume goes on from its checkpoint)."""
    import sys

    from tests.util import REPO

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    case = next(c for c in gpu_check.cases() if c.name == name)
    if case.gpus > torch.cuda.device_count():
        pytest.skip(f"needs {case.gpus} GPUs, this machine has {torch.cuda.device_count()}")
    result = gpu_check.run_case(case, tmp_path, steps=6)
    assert result["ok"], result
    assert str(result["device"]).startswith("cuda"), result  # summary.json: the accelerator it ran on


@pytest.mark.parametrize(
    "case",
    [["mode=l2l", "model.dropout=0.1"], ["mode=l2l_p", "precision=cmp", "mode.stash=cpu"]],
    ids=["l2l-fp32-dropout", "l2l_p-cmp"],
)
def test_cuda_graphs_train_to_the_eager_blocks_weights_bit_for_bit(case: list[str]) -> None:
    """``mode.cuda_graphs=on``: every block's forward and recompute-and-backward replayed from its CUDA
    graph (dropout from the graph-safe generator) gives the eager blocks' losses and weights bit for bit,
    every graph passed its capture-time check, and the replays outnumber the captures."""
    over = [*CUDA, *case, "task.pad_to_max=true", "batch.ubatch_size=2"]

    def run(graphs: str) -> tuple[dict[str, torch.Tensor], list[float], dict | None]:
        cfg = tiny_cfg(*over, f"mode.cuda_graphs={graphs}")
        with built(cfg) as runner:
            it = batches(cfg)
            losses = [runner.step(next(it)).loss for _ in range(3)]
            return weights(runner), losses, runner.sections().get("cuda_graphs")

    eager_w, eager_loss, _ = run("off")
    graph_w, graph_loss, section = run("on")
    print("cuda graphs:", section)
    assert section is not None and section["off_reason"] is None, section
    assert section["replays"] > 10 * section["captured"] > 0
    assert graph_loss == eager_loss
    assert all(torch.equal(eager_w[k], graph_w[k]) for k in eager_w)
