"""What CUDA and NCCL would refuse, caught on the CPU (issue 35).

On a CPU every tensor is on one device and gloo takes anything: these tests make the difference visible.
``tests/strict_dist.py`` declares each process group's backend and refuses a host tensor on an NCCL group (and
a device tensor on gloo); ``FakeTensorMode`` makes tensors that say ``device="cuda"`` on a machine without
one, to check where optimizer state lands.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.strict_dist import DEVICE, StrictDistError, strict
from tests.util import tiny_cfg

# ---- 1: the trainer's per-step collective ------------------------------------------------------------


def test_the_step_collective_and_the_memory_gather_run_on_gloo_beside_an_nccl_default_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dist.backend=auto`` on CUDA makes the default group NCCL; the loss and stop flag each step are a
    host tensor, which NCCL refuses: they go over a gloo group of their own."""
    from l2l_cli.engine.dist import from_env

    with strict(pretend_nccl=True) as shim:
        dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", world_size=1, rank=0)
        try:
            monkeypatch.setenv("WORLD_SIZE", "2")  # a rank of two, alone in its group: the calls are real
            monkeypatch.setenv("RANK", "0")
            ctx = from_env(tiny_cfg())
            assert ctx.backend == "nccl"
            _, stop = ctx.mean_and_any(3.0, 0)
            assert stop is False
            assert ctx.gather({"rank": 0})[0] == {"rank": 0}
            # the shim refuses what NCCL would: a host tensor on the default group
            with pytest.raises(StrictDistError, match=r"host tensor .* declared nccl"):
                dist.all_reduce(torch.zeros(2))
            dist.all_reduce(torch.zeros(2, device=DEVICE))  # a device tensor is fine there
        finally:
            dist.destroy_process_group()
    assert shim.counts["gloo all_reduce host"] == 1 and shim.counts["nccl all_reduce device"] == 1


# ---- 2, 3: AdamW's step on the parameters' device ----------------------------------------------------


def test_flat_adamw_state_lives_on_the_parameters_device() -> None:
    """Fused AdamW refuses a step on another device than its parameter: a pipeline stage's optimizer
    (``bind_flat``) keeps every state tensor on the stage's device."""
    from l2l_cli.engine.optim import OptimSettings, bind_flat

    o = OptimSettings.from_cfg(tiny_cfg().optim)
    with FakeTensorMode(allow_non_fake_inputs=True):
        w, g, m, v = (torch.zeros(8, device="cuda") for _ in range(4))
        runs = [
            (name, *(t.narrow(0, a, b - a) for t in (w, g, m, v)))
            for name, a, b in (("decay", 0, 6), ("bias", 6, 8))
        ]
        opt = bind_flat(runs, o)
        devices = {(k, t.device.type) for st in opt.state.values() for k, t in st.items()}
    assert devices == {("step", "cuda"), ("exp_avg", "cuda"), ("exp_avg_sq", "cuda")}
    # on the CPU nothing changes: a float32 zero on the CPU, as before
    opt = bind_flat([("decay", torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4))], o)
    step = next(iter(opt.state.values()))["step"]
    assert step.device.type == "cpu" and step.dtype == torch.float32 and float(step) == 0.0


def test_resumed_adamw_state_lives_on_the_parameters_device(tmp_path: Path) -> None:
    """A baseline checkpoint's ``step`` is a host tensor; resumed into fused AdamW on CUDA parameters it
    moves to their device (as torch's own ``load_state_dict`` does)."""
    from l2l_cli.checkpoint import verify
    from l2l_cli.modes.base import DeviceResident
    from l2l_cli.session import build
    from tests.util import tiny_data

    cfg = tiny_cfg("mode=baseline_ag")
    with build(cfg, tmp_path, data=tiny_data(cfg)) as s:
        assert s.runner is not None and s.stream is not None and s.trainer is not None
        s.runner.step(next(s.stream.batches()))
        s.trainer.save()
        shapes = {name: tuple(p.shape) for name, p in s.runner.model.hf_state_dict().items()}  # type: ignore[attr-defined]
    ckpt = tmp_path / "checkpoints" / "step_1"
    manifest = verify(ckpt)
    # parameters on a device other than the host: ``meta`` (a fake CUDA tensor cannot take a copy from the
    # host on a build without CUDA); fused, as AdamW is on CUDA (its constructor refuses meta)
    named = {name: nn.Parameter(torch.zeros(shape, device="meta")) for name, shape in shapes.items()}
    opt = torch.optim.AdamW(list(named.values()))
    opt.param_groups[0]["fused"] = True
    runner = SimpleNamespace(model=SimpleNamespace(hf_state_dict=lambda: named), optimizer=opt)
    DeviceResident.load_state(runner, ckpt, manifest)  # type: ignore[arg-type]
    assert len(opt.state) == len(named)
    where = {(k, t.device.type) for st in opt.state.values() for k, t in st.items()}
    assert where == {("step", "meta"), ("exp_avg", "meta"), ("exp_avg_sq", "meta")}


# ---- 6: selective recompute's saved bytes ------------------------------------------------------------


def test_selective_bytes_count_every_matmul_output_even_where_an_address_is_reused() -> None:
    """The outputs a selective checkpoint keeps are counted once each, not by address: an allocator hands
    a freed output's block to the next one (the caching allocator on CUDA does so on purpose)."""
    from l2l_cli.engine.recompute import measure_block

    w = torch.randn(64, 64) / 8
    n = 6

    def run(x: torch.Tensor) -> torch.Tensor:
        for _ in range(n):
            x = torch.relu(x @ w)  # the matmul's output freed once relu has read it (no graph)
        return x

    x = torch.randn(16, 64)
    b = measure_block(run, x, [w])
    out = 16 * 64 * 4
    assert b.full == out and b.selective == out + n * out
    assert b.none >= b.selective  # autograd keeps every matmul output and more
