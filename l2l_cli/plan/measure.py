"""``hardware=measure``: time the primitives of a step on this machine, for the config's shapes.

What is timed (median of ``plan.measure_repeats`` after a warm-up), each as the runners execute it:
- one transformer block, the embeddings and the head on one micro-batch: forward without autograd (L2L's
  forward pass), forward with autograd (the baselines' forward, L2L's recompute), and backward;
- the host optimizer on one block's flat FP32 buffers (the EPS update: norm, clip, AdamW/LAMB step), and
  the device-resident optimizer on one block's separate tensors (the baselines' update), per parameter;
- a host->device copy of one block's device copy (a plain memcpy when the device tier is the CPU);
- the disk the EPS's disk tier would use (``eps.path``, else ``outputs/``): sequential O_DIRECT write and
  read of one block's state, both at once (the tier's read-ahead and write-behind), and its free space.

The plan then scales these by the layer counts and micro-batches; nothing else is calibrated.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from l2l_cli.engine.device import cuda_available, synchronize
from l2l_cli.modes import run_precision
from l2l_cli.plan import PlanError
from l2l_cli.plan.shapes import ModelShape, act_bytes
from l2l_cli.plan.times import LayerTimes, MeasuredTimes, physical_memory


def _device(cfg: Any) -> torch.device:
    if cfg.device.name == "cuda" or (cfg.device.name == "auto" and cuda_available()):
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _sync(device: torch.device) -> Callable[[], None]:
    return lambda: synchronize(device)


def _median_s(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls, after two warm-up calls (allocator, kernels,
    lazy optimizer state)."""
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _fwd_bwd(
    run: Callable[[bool], torch.Tensor],
    grad_of: Callable[[torch.Tensor], torch.Tensor],
    repeats: int,
    sync: Callable[[], None],
) -> tuple[float, float, float]:
    """(forward without autograd, forward with autograd, backward) medians of one layer call."""
    with torch.no_grad():
        f = _median_s(lambda: run(False), repeats, sync)
    fg = _median_s(lambda: run(True), repeats, sync)
    samples = []
    for i in range(repeats + 2):
        y = run(True)
        g = grad_of(y)
        sync()
        t0 = time.perf_counter()
        y.backward(g)
        sync()
        if i >= 2:  # the first two are warm-ups
            samples.append(time.perf_counter() - t0)
        del y
    return f, fg, statistics.median(samples)


def _fit(small: tuple[int, float], large: tuple[int, float]) -> tuple[float, float]:
    """(fixed seconds per call, seconds per parameter) through two (parameters, seconds) points."""
    (n1, t1), (n2, t2) = sorted([small, large])
    if n2 <= n1 or t2 <= t1:
        return 0.0, max(t1, t2) / max(n2, 1)
    per = (t2 - t1) / (n2 - n1)
    return max(0.0, t1 - per * n1), per


def available_memory() -> float:
    """Bytes this machine can still allocate (MemAvailable), or its RAM when that is unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return physical_memory()


def measure_bytes(cfg: Any, shape: ModelShape) -> float:
    """What timing the layers and the updates needs here: a block's and the embeddings' weights,
    gradients and moments twice (the host and the device-resident optimizer), the head, and one
    micro-batch's activations."""
    ub, seq = cfg.batch.ubatch_size, cfg.task.max_seq_len
    state = 2 * 16.0 * (shape.block_params + shape.pre_params) + 8.0 * shape.post_params
    acts = ub * (
        shape.block_working_bytes(seq, run_precision(cfg)) + 4 * seq * shape.hidden * act_bytes("fp32")
    )
    return state + 2 * acts


def eps_disk_dir(cfg: Any) -> Path:
    """Where a disk EPS of this config would live: eps.path, else outputs/ (where run dirs go); the
    nearest folder of it that exists (the measurement creates none)."""
    path = Path(cfg.eps.path).expanduser() if cfg.eps.path else Path("outputs")
    while not path.is_dir() and path != path.parent:
        path = path.parent if path.parent != Path("") else Path(".")
    return path


def measure_eps_disk(cfg: Any, shape: ModelShape) -> dict[str, Any] | None:
    """The disk EPS tier's filesystem: sequential write and read of one block's state (w, m, v: 12 bytes
    per parameter, 64 MiB to 1 GiB), as the tier does its I/O. None where it cannot be written."""
    from l2l_cli.engine.tiers.disk import measure_disk

    nbytes = int(min(max(12 * shape.block_params, 64 << 20), 1 << 30))
    try:
        return measure_disk(eps_disk_dir(cfg), nbytes)
    except OSError:
        return None


def measure(cfg: Any, shape: ModelShape) -> MeasuredTimes:
    """Time this machine for ``cfg`` (see the module doc)."""
    need, free = measure_bytes(cfg, shape), available_memory()
    if need > 0.5 * free:
        raise PlanError(
            f"hardware=measure would need ~{need / 2**30:.1f} GiB to time one layer of this model here "
            f"(available {free / 2**30:.1f} GiB); use an analytic hardware (hardware=a100-80g, ...) or a "
            f"smaller batch.ubatch_size / model"
        )
    from l2l_cli.data.batches import Batch
    from l2l_cli.engine.flat import FlatLayout
    from l2l_cli.engine.optim import OptimSettings, flat_norm, make_optimizer, param_groups
    from l2l_cli.models import BLOCK, PRE
    from l2l_cli.modes import MODES
    from l2l_cli.profiling.memory import MemoryMeter, StorageMeter

    device = _device(cfg)
    repeats = int(cfg.plan.measure_repeats)
    sync = _sync(device)

    def median_s(fn: Callable[[], Any]) -> float:
        return _median_s(fn, repeats, sync)

    prec = run_precision(cfg)
    half = torch.float16 if device.type == "cuda" else torch.bfloat16
    if cfg.precision.dtype in ("bf16", "fp16"):
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision.dtype]
    dtype = half if prec == "cmp" else torch.float32
    autocast = (lambda: torch.autocast(device.type, dtype=half)) if prec == "amp" else nullcontext
    ub, seq = cfg.batch.ubatch_size, cfg.task.max_seq_len
    spec = shape.spec
    optim = OptimSettings.from_cfg(cfg.optim)
    ids = torch.randint(0, spec.vocab_size, (ub, seq), device=device)
    if len(spec.logits_shape(ub, seq)) == 3:  # a language model's labels are its tokens
        labels = ids.clone()
    else:
        labels = torch.zeros(ub, dtype=torch.float32 if shape.num_labels == 1 else torch.long, device=device)
    batch = Batch(ids, torch.zeros_like(ids), torch.ones_like(ids), labels)
    torch.manual_seed(0)
    # a CPU device tier runs under the storage meter (profile.memory; always for device=sim): time with it
    metered = device.type == "cpu" and (cfg.profile.memory or cfg.device.name == "sim")
    meter = StorageMeter() if metered else MemoryMeter()

    # -- layers ------------------------------------------------------------------------------------
    block = spec.build_layer(1, 0).to(device, dtype)
    x = torch.randn(ub, seq, shape.hidden, device=device, dtype=dtype)
    side = spec.side_inputs(batch, dtype)

    def run_block(grad: bool) -> torch.Tensor:
        with autocast():
            return spec.run_layer(block, 1, x.detach().requires_grad_(grad), batch, side)

    with meter:
        blk = _fwd_bwd(run_block, torch.ones_like, repeats, sync)

    pre = spec.build_layer(0, 0).to(device, dtype)

    def run_pre(grad: bool) -> torch.Tensor:
        with autocast():
            return spec.run_layer(pre, 0, None, batch, None)

    with meter:
        emb = _fwd_bwd(run_pre, torch.ones_like, repeats, sync)

    post = spec.build_layer(shape.num_layers + 1, 0).to(device, dtype)

    def run_post(grad: bool) -> torch.Tensor:
        with autocast():
            return spec.run_head(post, x.detach().requires_grad_(grad), batch)[0]

    with meter:
        head = _fwd_bwd(run_post, lambda y: torch.ones((), device=device, dtype=y.dtype), repeats, sync)
    layers = LayerTimes(emb[0], emb[1], emb[2], blk[0], blk[1], blk[2], head[1], head[2], ub)

    # -- the EPS update: a layer's flat FP32 buffers (engine/layer_state.py), for two layer sizes ------------
    mode = MODES[cfg.mode.name]

    def host_update_fn(kind: str) -> tuple[int, Callable[[], None]]:
        layout = FlatLayout(spec.new_layer(kind, "meta"))
        n = layout.numel
        w, g = torch.randn(n) * 0.02, torch.randn(n) * 1e-3
        m, v = torch.zeros(n), torch.zeros(n)
        grads = dict(layout.views(g))
        named = []
        for name, view in layout.views(w):
            p = nn.Parameter(view)
            p.grad = grads[name]
            named.append((name, p))
        opt = make_optimizer(param_groups(named, optim.weight_decay), optim)
        w_send = torch.empty(n, dtype=dtype) if prec == "cmp" else None
        undo = [torch.empty(n) for _ in range(3)] if mode.undo_log else []

        def update() -> None:  # norm, clip (unscale), [L2L-p: undo copy], step, refresh the half send copy
            norm = flat_norm(g)
            g.mul_(1.0 / (1.0 + float(norm)))
            for dst, src in zip(undo, (w, m, v)):
                dst.copy_(src)
            opt.step()
            if w_send is not None:
                w_send.copy_(w)

        return n, update

    def host_update_s(kind: str) -> tuple[int, float]:
        n, update = host_update_fn(kind)
        if mode.overlapped_update:  # on the EPS thread, outside the compute thread's meter
            return n, median_s(update)
        with meter, meter.paused():  # on the compute thread, the meter paused (engine/eps.py step)
            return n, median_s(update)

    host_fixed, host_per = _fit(host_update_s(BLOCK), host_update_s(PRE))

    # -- L2L-p on a CPU device tier: the update of layer l+1 runs on the EPS thread while layer l runs
    #    recompute + backward over the micro-batches; on shared cores it costs more than it hides
    overlap_cost = None
    if mode.overlapped_update and device.type == "cpu":
        u = max(1, cfg.batch.size // ub)
        _, update = host_update_fn(BLOCK)

        def window() -> None:
            for _ in range(u):
                y = run_block(True)
                y.backward(torch.ones_like(y))

        def overlapped() -> None:
            t = threading.Thread(target=update)
            t.start()
            window()
            t.join()

        with meter:
            alone = median_s(window)
            together = median_s(overlapped)
        upd = median_s(update)
        overlap_cost = max(0.0, together - alone) / max(upd, 1e-9)

    # -- the baselines' update: a layer's separate tensors on the device (modes/base.py) --------------
    def device_update_s(index: int) -> tuple[int, float]:
        layer = spec.build_layer(index, 0).to(device)
        for p in layer.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        params = list(layer.named_parameters())
        opt = make_optimizer(param_groups(params, optim.weight_decay), optim)
        grads = [p.grad for _, p in params]

        def update() -> None:  # per-layer norms, clip, one step over all tensors
            norms = torch.stack(torch._foreach_norm(grads))
            torch._foreach_mul_(grads, float(1.0 / (1.0 + torch.linalg.vector_norm(norms))))
            opt.step()

        with meter:
            return sum(p.numel() for _, p in params), median_s(update)

    dev_fixed, dev_per = _fit(device_update_s(1), device_update_s(0))

    # -- a host->device copy of the largest layer's device copy --------------------------------------
    n = shape.max_layer_params
    pin = device.type == "cuda"
    src = torch.randn(n).to(dtype)
    if pin:
        src = src.pin_memory()
    dst = torch.empty(n, dtype=dtype, device=device)
    copy_s = median_s(lambda: dst.copy_(src, non_blocking=pin))
    return MeasuredTimes(
        disk=measure_eps_disk(cfg, shape),
        layers=layers,
        host_s_per_param=host_per,
        device_s_per_param=dev_per,
        host_fixed_s=host_fixed,
        overlap_cost=overlap_cost,
        device_fixed_s=dev_fixed,
        memcpy_bytes_per_s=src.nbytes / max(copy_s, 1e-9),
        repeats=repeats,
        threads=torch.get_num_threads(),
    )


def _exchange_rank(rank: int, store_path: str, nbytes: list[int], repeats: int, out: Any) -> None:
    """One of two gloo processes timing exchanges (a message out to the other, one in) of each size, and
    then what one pipeline schedule action costs (``calibrate.action_seconds``, a 2-rank pipeline)."""
    import torch.distributed as dist

    from l2l_cli.parallel.pipeline.calibrate import action_seconds, time_exchange

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        cpu = torch.device("cpu")
        res = [time_exchange(None, None, cpu, (1 - rank, 1 - rank), n, repeats) for n in nbytes]
        group = dist.new_group([0, 1], backend="gloo")
        res.extend(action_seconds(group, group, cpu, "gloo", nbytes=nbytes[-1]))
        if rank == 0:
            out.put(res)
    finally:
        dist.destroy_process_group()


def measure_exchange(nbytes: float, repeats: int = 7) -> tuple[float, float, float, float]:
    """(latency s, bytes/s input + output, s per schedule action, s a message waits for its computing
    sender) between two processes on this machine (gloo, as a CPU pipeline's ranks exchange hidden
    states): exchanges of 4 bytes and of ``nbytes``, medians; one action of a 2-rank schedule beyond its
    compute and latency, and the wake (``calibrate.action_seconds``)."""
    import tempfile

    import torch.multiprocessing as mp

    sizes = [4, max(8, int(nbytes))]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _exchange_rank,
            args=(f"{tmp}/store", sizes, repeats, out),
            nprocs=2,
            join=True,
            start_method="spawn",
        )
        small, big, action, wake = out.get()
    return small, 2.0 * sizes[1] / max(big - small, 1e-9), action, wake
