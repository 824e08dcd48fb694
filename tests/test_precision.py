"""CMP: FP32 master in the EPS, pure half (bf16 on CPU) on the device, dynamic loss scaling."""

from __future__ import annotations

import statistics
from itertools import islice

import pytest
import torch

from tests.util import batches, built, tiny_cfg, train

LEARN = [
    "mode=l2l",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "task.max_seq_len=24",
    "batch.size=16",
    "batch.ubatch_size=8",
    "optim.lr=2e-3",
    "optim.warmup_ratio=0.05",
]


def test_cmp_trains_like_fp32() -> None:
    curves = {}
    for prec in ("fp32", "cmp"):
        losses = train(tiny_cfg(*LEARN, f"precision={prec}"), steps=100, total_steps=100)["losses"]
        curves[prec] = [statistics.mean(losses[i : i + 10]) for i in range(0, 100, 10)]
    assert curves["fp32"][-1] < 0.25 and curves["cmp"][-1] < 0.25  # both learned (chance is 0.69)
    for a, b in zip(curves["fp32"], curves["cmp"]):
        assert abs(a - b) < 0.12, curves


def test_cmp_keeps_half_on_device_and_fp32_master() -> None:
    with built(tiny_cfg("mode=l2l", "precision=cmp")) as runner:
        assert runner.relay.slots[0].w.dtype == torch.bfloat16
        assert all(
            st.w.dtype == torch.float32 and st.w_send.dtype == torch.bfloat16 for st in runner.eps.layers
        )
        assert runner.precision.scaler.dynamic


def test_overflow_skips_step_without_touching_master() -> None:
    cfg = tiny_cfg("mode=l2l", "precision=cmp", "precision.init_scale=1e38")
    with built(cfg) as runner:
        before = [st.w.clone() for st in runner.eps.layers]
        moments = [st.m.clone() for st in runner.eps.layers]
        report = runner.step(next(batches(cfg)))
        assert report.skipped
        assert runner.precision.scaler.scale == pytest.approx(0.5e38)
        for st, w, m in zip(runner.eps.layers, before, moments):
            assert torch.equal(st.w, w) and torch.equal(st.m, m)
        # a sane scale trains again
        runner.precision.scaler.scale = 1024.0
        assert not runner.step(next(batches(cfg, seed=2))).skipped
        assert not torch.equal(runner.eps.layers[1].w, before[1])


def test_cmp_gradients_cross_the_link_in_half_precision() -> None:
    """The gradient leaves the device in its half type (2 bytes per parameter over the link, counted as
    such, beside its FP32 norm: 4 bytes a layer) and the host's update reads it as it arrived: never
    widened into the FP32 buffer, never scaled in place. The FP32 master equals, bit for bit, what the
    update as torch ops makes of it (widened, unscaled, torch's fused AdamW, the half copy)."""
    ref_cfg = tiny_cfg("mode=l2l", "precision=cmp", "eps.update_kernel=torch")
    with built(ref_cfg) as ref:
        assert ref.eps.passes.kernel == "torch"
        for b in islice(batches(ref_cfg), 2):
            assert not ref.step(b).skipped
        want = [(st.w.clone(), st.m.clone(), st.v.clone(), st.w_send.clone()) for st in ref.eps.layers]
    cfg = tiny_cfg("mode=l2l", "precision=cmp")
    with built(cfg) as runner:
        layers = runner.eps.layers
        for b in islice(batches(cfg), 2):
            assert not runner.step(b).skipped
        params = sum(st.w.numel() for st in layers)
        assert runner.acc.d2h.bytes == 2 * (2 * params + 4 * sum(1 for st in layers if st.w.numel()))
        assert runner.eps.passes.kernel == "native" and runner.eps.passes.bytes.get("widen", 0) == 0
        for st, (w, m, v, send) in zip(layers, want):
            assert st.g_recv.dtype == torch.bfloat16 and st.w.dtype == torch.float32
            assert not st.widened and st.grad is st.g_recv
            for got, exp in ((st.w, w), (st.m, m), (st.v, v), (st.w_send, send)):
                assert torch.equal(got, exp)


def test_the_eps_norm_is_accurate_and_the_same_on_any_thread_count() -> None:
    """A layer's gradient norm in the EPS (``flat_norm``): within 1e-6 of a float64 sum at 4 M elements,
    where ATen's whole-tensor norm on CPU is off by ~7e-5 (one float chain); and bit-equal on 1 and 2
    threads, so a run resumed on another machine clips by the same factor."""
    from l2l_cli.engine.optim import flat_norm

    g = torch.randn(4_000_037, generator=torch.Generator().manual_seed(0)) * 1e-3
    ref = float(torch.linalg.vector_norm(g.double()))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = flat_norm(g)
        torch.set_num_threads(1)
        one = flat_norm(g)
    finally:
        torch.set_num_threads(threads)
    assert abs(float(two) - ref) / ref < 1e-6
    assert float(one) == float(two) and two.dtype == g.dtype
    small = torch.randn(1000)
    assert float(flat_norm(small)) == float(torch.linalg.vector_norm(small))  # small buffers: ATen's own
    strided = g[::3]  # (a view that rows cannot reshape: ATen's own too)
    assert float(flat_norm(strided)) == float(torch.linalg.vector_norm(strided))
