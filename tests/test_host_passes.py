"""The EPS's host update at its floor (issue 50): one pass per layer update, bit for bit torch's fused AdamW,
L2L-p's undo without copies, every host pass counted, and what summary.json says of them."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest
import torch

from l2l_cli.engine.host_passes import AdamwStep, HostPasses
from l2l_cli.engine.native import native_available
from tests.util import batches, built, l2l, tiny_cfg

HP = AdamwStep(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=4.0)


def torch_update(g: torch.Tensor, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, mult, hp: AdamwStep):
    """Today's passes as torch ops: widen, multiply, torch.optim.AdamW(fused=True), the half copy."""
    p = torch.nn.Parameter(w.clone())
    p.grad = g.float().clone()
    if mult is not None:
        p.grad.mul_(mult)
    opt = torch.optim.AdamW(
        [p], lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay, fused=True
    )
    opt.state[p] = {"step": torch.tensor(hp.step - 1), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    opt.step()
    return p.data, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]


@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n", [5, 16, 1000, 70_001, 1 << 20])
def test_the_one_pass_update_is_torchs_fused_adamw_bit_for_bit(gdt: torch.dtype, n: int) -> None:
    """Native AdamW from a gradient in the type it arrived in, times the unscale factor, out of place and
    in place, on one and two threads, with a send copy of each type or none: the same bits as torch's fused
    AdamW after a separate widen and multiply, the gradient and the source state left as they were."""
    ok, why = native_available()
    assert ok, why
    gen = torch.Generator().manual_seed(n)
    w, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    v, g = torch.rand(n, generator=gen) * 1e-4, (torch.randn(n, generator=gen) * 1e-1).to(gdt)
    g0, src = g.clone(), (w.clone(), m.clone(), v.clone())
    for mult in (None, float(torch.tensor(0.37)), 2.0**-12):
        want = torch_update(g, w, m, v, mult, HP)
        for threads in (1, 2):
            passes = HostPasses(threads)
            for sdt in (None, torch.bfloat16, torch.float16, torch.float32):
                beside = (torch.empty(n), torch.empty(n), torch.empty(n))
                inplace = tuple(t.clone() for t in src)
                for into in (beside, inplace):
                    send = None if sdt is None else torch.empty(n, dtype=sdt)
                    passes.adamw(g, inplace if into is inplace else (w, m, v), into, send, mult, HP)
                    assert passes.kernel == "native"
                    for got, exp in zip(into, want):
                        assert torch.equal(got, exp)
                    assert send is None or torch.equal(send, want[0].to(sdt)), sdt
            passes.close()
        assert torch.equal(g, g0) and all(torch.equal(a, b) for a, b in zip((w, m, v), src))


def test_the_torch_kernel_is_the_same_update_in_more_passes() -> None:
    """``eps.update_kernel=torch`` (no compiler): the same numbers, from torch ops."""
    n = 10_007
    gen = torch.Generator().manual_seed(1)
    w, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    g = torch.randn(n, generator=gen).bfloat16()
    native, plain = HostPasses(1), HostPasses(1, "torch")
    assert plain.kernel == "torch"
    a = tuple(t.clone() for t in (w, m, v))
    b = tuple(t.clone() for t in (w, m, v))
    native.adamw(g, a, a, None, 0.5, HP)
    plain.adamw(g, b, b, None, 0.5, HP)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(
    ("mode", "precision", "limit"),
    [("l2l", "fp32", 30.0), ("l2l", "cmp", 30.0), ("l2l_p", "cmp", 32.0)],
)
def test_a_step_reads_and_writes_one_pass_of_bytes_per_parameter(
    mode: str, precision: str, limit: float
) -> None:
    """Per trained parameter per step, the host's passes move one AdamW pass: 28 B (FP32 gradient: 4 + 24;
    CMP: 2 + 24 + the half copy's 2), no widening, no norm pass (the device takes it), no unscale pass,
    no undo copy (L2L-p's undo is the other state set). Dynamic loss scaling and global clipping are on.
    L2L-p's embeddings trail the step: the rows a batch reads are previewed and the send copy refreshed
    once the update is in (issue 50's limits: 30 B for L2L, 32 for L2L-p CMP)."""
    cfg = tiny_cfg(f"mode={mode}", f"precision={precision}", "optim.clip=global", "optim.max_grad_norm=1e9")
    with built(cfg) as runner:
        for b in islice(batches(cfg), 3):
            assert not runner.step(b).skipped
        eps = runner.sections()["eps"]
    by = eps["host_traffic_by_pass"]
    assert set(by) <= {"update", "refresh", "preview"}, by  # no widen, norm, scale, undo, reduce pass
    if mode == "l2l":
        assert by == {"update": pytest.approx(28.0, abs=1e-6)}
    assert by["update"] <= 28.0 + 1e-6
    assert eps["host_traffic_bytes_per_param"] <= limit
    assert eps["update_kernel"] == "native" and eps["update_gbps"] > 0
    link = 2 * (2 if precision == "cmp" else 4)  # the weights in and the gradient out, once each
    assert eps["transfer_bytes_per_param"] >= link


def test_l2l_p_undo_is_a_switch_and_a_rollback_is_exact() -> None:
    """L2L-p whose first step clips only once its last gradient is in (max_grad_norm 0.24, see
    test_l2l_p.CASES): the speculative updates are undone and redone with the factor. The undo is the other
    state set (no bytes copied for it), and the weights equal L2L's (Alg. 3: the factor known before any
    update) bit for bit."""
    common = ("optim.clip=global", "optim.max_grad_norm=0.24")
    ref_cfg = tiny_cfg("mode=l2l", *common)
    with built(ref_cfg) as ref:
        for b in islice(batches(ref_cfg), 3):
            ref.step(b)
        want = [st.w.clone() for st in ref.eps.layers]
    cfg = tiny_cfg("mode=l2l_p", *common)
    with built(cfg) as runner:
        for b in islice(batches(cfg), 3):
            runner.step(b)
        runner.finish_updates()
        assert runner.speculation.rollbacks >= 1
        assert "undo" not in runner.eps.passes.bytes
        for st, w in zip(runner.eps.layers, want):
            assert torch.equal(st.w, w)
        assert runner.host_parts()["undo_log"] > 0  # the second set, kept in place of the copies


def test_summary_reports_the_host_traffic(tmp_path: Path) -> None:
    """``l2l train``'s summary.json: ``eps.host_traffic_bytes_per_param`` (the code's own count),
    ``eps.transfer_bytes_per_param`` (the link, apart) and ``eps.update_gbps``."""
    run = tmp_path / "run"
    r = l2l(
        "train",
        "mode=l2l_p",
        "precision=cmp",
        "trainer.max_steps=3",
        "trainer.progress=none",
        "task.num_train=64",
        "task.num_eval=8",
        f"hydra.run.dir={run}",
    )
    assert r.returncode == 0, r.stderr
    eps = json.loads((run / "summary.json").read_text())["eps"]
    for key in ("host_traffic_bytes_per_param", "transfer_bytes_per_param", "update_gbps"):
        assert eps[key] > 0, key
    assert eps["update_kernel"] in ("native", "torch")


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("eps.update_kernel=fast", "eps.update_kernel: got 'fast'; allowed: auto, native, torch"),
        ("eps.threads=-1", "eps.threads"),
    ],
)
def test_bad_update_settings_are_one_config_line(override: str, line: str) -> None:
    r = l2l("train", override)
    assert r.returncode == 2 and line in r.stderr and "Traceback" not in r.stderr


def test_a_step_ends_with_its_updates_still_running_and_stays_exact() -> None:
    """L2L-p judges a finite step that needs no rollback on the norms the device sent, without waiting for
    the EPS thread: a slow update of the top block is still running when ``step`` returns, the next step's
    forward waits for that layer alone, and the weights equal a run whose updates were not slowed."""
    import threading

    cfg = tiny_cfg("mode=l2l_p")
    with built(cfg) as ref:
        for b in islice(batches(cfg), 3):
            ref.step(b)
        ref.finish_updates()
        want = [st.w.clone() for st in ref.eps.layers]
    with built(cfg) as runner:
        eps, top = runner.eps, runner.head - 1
        update, release = eps.update_layer, threading.Event()

        def slow(i: int, *args: object) -> None:
            if i == top and threading.current_thread() is not threading.main_thread():
                release.wait(5)
            update(i, *args)

        eps.update_layer = slow  # type: ignore[method-assign]
        it = islice(batches(cfg), 3)
        runner.step(next(it))
        assert eps.worker.host_busy(top)  # the step returned with the top block's update still running
        assert runner.speculation.verdicts_early == 1
        release.set()
        for b in it:
            runner.step(b)
        runner.finish_updates()
        for st, w in zip(eps.layers, want):
            assert torch.equal(st.w, w)


def test_a_gpus_compute_thread_leaves_the_hosts_cores_to_the_eps(monkeypatch) -> None:
    """On CUDA a training step's own torch ops run on one core and its passes over EPS buffers queue on the
    EPS's pool: with torch's full team of its own the compute thread spun against the EPS's threads (on an
    H200's 16-core host the update ran at half speed, and a step's preview of the embeddings' rows took
    40-87 ms instead of 6). Every runner's step enters it; an evaluation does not; a CPU device, which
    computes on its cores, keeps them."""
    from l2l_cli.engine import host_passes
    from l2l_cli.engine.device import Accelerator, CudaAccelerator

    acc = CudaAccelerator.__new__(CudaAccelerator)  # (its fields only: no CUDA here)
    acc.eps_threads, acc.cores = 0, 16
    before = torch.get_num_threads()
    with acc.launching():
        assert torch.get_num_threads() == 1 and host_passes._LOCAL.threads == 15
    assert torch.get_num_threads() == before and getattr(host_passes._LOCAL, "threads", None) is None

    entered: list[str] = []
    real = Accelerator.launching
    monkeypatch.setattr(Accelerator, "launching", lambda self: entered.append("step") or real(self))
    cfg = tiny_cfg("mode=l2l_p", "precision=cmp")
    with built(cfg) as runner:
        it = batches(cfg)
        runner.step(next(it))
        runner.step(next(it))
        runner.predict(next(it))
    assert entered == ["step", "step"]
