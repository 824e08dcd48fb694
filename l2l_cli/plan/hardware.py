"""The machine a plan is for: rates from ``conf/hardware`` (or measured here), and per-micro-batch layer
times derived from them.

Units inside the plan: seconds, bytes, FLOP/s and bytes/s. Memory sizes in the configs are GiB (as
``sim.memory_gb`` is); link rates are GB/s (1e9 bytes), as ``sim.link_gbps`` and the papers' PCIe are.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from l2l_cli.engine.optim import OPTIMIZERS
from l2l_cli.modes import run_precision
from l2l_cli.plan.shapes import (
    ADAMW_BYTES_PER_PARAM,
    ADAMW_FLOP_PER_PARAM,
    EMBED_GRAD_BYTES_PER_PARAM,
    OPT_FLOP_PER_PARAM,
    ModelShape,
)
from l2l_cli.plan.times import GB, GiB, LayerTimes, MeasuredTimes, physical_memory
from l2l_cli.problems import fmt_bytes


@dataclass(frozen=True)
class Rates:
    """Resolved hardware: what the time and memory models consume."""

    name: str
    device_flops: float  # effective, for the config's precision
    backward_factor: float
    peak_flops: float
    mfu: float  # the share of peak_flops a training step achieves: the one efficiency of every view
    device_memory: float  # bytes (the budget the plan checks against)
    device_optim_flops: float
    host_flops: float
    host_memory: float
    h2d: float  # bytes/s per direction
    network: float  # bytes/s, input + output
    tensor_link: float  # bytes/s, input + output (0: none)
    offload: float  # bytes/s, input + output
    async_copy: bool
    p2p_latency: float = 10e-6  # seconds: a message between pipeline ranks, before its bytes
    p2p_bytes_per_s: float = 12.5e9  # bytes/s, input + output, of pipeline messages (the network's)
    pipe_action: float = 100e-6  # seconds: one pipeline schedule action beyond compute and bytes
    pipe_wake: float = 0.0  # seconds: a message's wait for its computing sender's core (gloo on a CPU)
    disk_read: float = 3e9  # the disk EPS tier: bytes/s, sequential
    disk_write: float = 2e9
    disk_mixed: float = 0.0  # bytes/s read + written while both run (0: unknown, the times add up)
    disk_free: float = float("inf")  # bytes the disk EPS may take
    device_bandwidth: float = 900e9  # device memory, bytes/s (the on-device update reads and writes it)
    gpus_per_node: int = 1  # ranks sharing one node's host memory (host_memory is per node)
    host_shares_device: bool = False  # the EPS update competes with device compute (a CPU device tier)
    host_update_cost: float = 1.0  # the run's optimizer's host update against AdamW's (OptimizerKind's)
    measured: MeasuredTimes | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def layer_times(self, shape: ModelShape, seq: int, ubatch: int) -> LayerTimes:
        """Per-micro-batch layer times: measured ones (scaled to ``ubatch``), or FLOPs / throughput; the
        embeddings' backward by the bytes of its dense gradient over the device memory's bandwidth (none
        where they are frozen, ``peft=lora``)."""
        if self.measured is not None:
            return self.measured.layers.scaled(ubatch)
        f_blk = ubatch * shape.block_flops(seq) / self.device_flops
        f_post = ubatch * shape.post_flops(seq) / self.device_flops
        bwd = self.backward_factor
        b_pre = (
            0.0
            if shape.peft is not None
            else EMBED_GRAD_BYTES_PER_PARAM * shape.pre_params / self.device_bandwidth
        )
        return LayerTimes(0.0, 0.0, b_pre, f_blk, f_blk, bwd * f_blk, f_post, bwd * f_post, ubatch)

    def copy_time(self, nbytes: float) -> float:
        """Host<->device copy of ``nbytes`` in one direction."""
        if self.measured is not None:
            return max(nbytes / self.measured.memcpy_bytes_per_s, nbytes / self.h2d)
        return nbytes / self.h2d

    def host_update_time(self, params: float) -> float:
        """The EPS (host) optimizer over ``params`` parameters: measured with the run's optimizer, or AdamW's
        rate times the run's optimizer's ``host_update_cost``."""
        if self.measured is not None:
            return self.measured.host_fixed_s + params * self.measured.host_s_per_param
        return params * OPT_FLOP_PER_PARAM / self.host_flops * self.host_update_cost

    def device_update_time(self, params: float) -> float:
        """The baselines' optimizer over ``params`` parameters, on the device."""
        if self.measured is not None:
            return self.measured.device_fixed_s + params * self.measured.device_s_per_param
        return params * max(
            ADAMW_FLOP_PER_PARAM / self.device_optim_flops, ADAMW_BYTES_PER_PARAM / self.device_bandwidth
        )

    def ranks_on_node(self, nproc: int) -> int:
        """How many of a job's ``nproc`` ranks share one node's host memory."""
        return max(1, min(nproc, self.gpus_per_node))

    @property
    def rate_label(self) -> str:
        """The compute rate every view uses, and where it comes from."""
        src = "measured" if self.measured is not None else "hardware.mfu"
        peak = self.peak_flops / 1e12
        return f"{self.device_flops / 1e12:.3g} TFLOP/s = {self.mfu:.0%} of {peak:.4g} peak ({src})"

    def disk_time(self, read_bytes: float, write_bytes: float) -> float:
        """The disk EPS tier's I/O: reads and writes share one disk. They run on their own queues (read-ahead,
        write-behind) at once: with a measured mixed rate, the slower of each alone and both at that rate;
        else their times add up."""
        alone = read_bytes / self.disk_read, write_bytes / self.disk_write
        if self.disk_mixed > 0:
            return max(*alone, (read_bytes + write_bytes) / self.disk_mixed)
        return sum(alone)

    def disk_share(self) -> float:
        """The share of its own rate a read keeps while a write runs (and the write while a read runs): with a
        mixed rate, what makes both together move ``disk_mixed`` bytes/s (never more than alone); else half,
        so that equal reads and writes take the sum of their times, as ``disk_time`` says."""
        if self.disk_mixed > 0:
            return min(1.0, self.disk_mixed / (self.disk_read + self.disk_write))
        return 0.5

    def summary(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "device_tflops": self.device_flops / 1e12,
            "peak_tflops": self.peak_flops / 1e12,
            "mfu": self.mfu,
            "rate": self.rate_label,
            "device_memory_gib": self.device_memory / GiB,
            "device_optim_gflops": self.device_optim_flops / 1e9,
            "host_gflops": self.host_flops / 1e9,
            "host_memory_gib": self.host_memory / GiB,
            "gpus_per_node": self.gpus_per_node,
            "h2d_gbps": self.h2d / GB,
            "async_copy": self.async_copy,
            "host_shares_device": self.host_shares_device,
            "disk_read_gbps": self.disk_read / GB,
            "disk_write_gbps": self.disk_write / GB,
            "disk_mixed_gbps": self.disk_mixed / GB,
            "disk_free_gib": self.disk_free / GiB,
        }
        if self.measured is not None:
            out["measured"] = self.measured.summary()
        if self.notes:
            out["notes"] = list(self.notes)
        return out


def resolve(cfg: Any, shape: ModelShape) -> Rates:
    """Rates for the composed config. ``device=sim`` takes the device budget and the link from ``sim.*``
    (the accelerator being simulated); ``hardware=measure`` times this machine for the config's shapes."""
    hw = cfg.hardware
    half = run_precision(cfg) in ("amp", "cmp")
    notes: list[str] = []
    flops = (half_tflops(hw) if half else hw.device_tflops) * 1e12
    rates = Rates(
        name=hw.name,
        device_flops=flops,
        backward_factor=hw.backward_factor,
        peak_flops=hw.device_peak_tflops * 1e12,
        mfu=flops / (hw.device_peak_tflops * 1e12),
        device_bandwidth=hw.device_memory_gbps * GB,
        gpus_per_node=gpus_per_node(hw),
        device_memory=hw.device_memory_gb * GiB,
        device_optim_flops=hw.device_optim_gflops * 1e9,
        host_flops=hw.host_gflops * 1e9,
        host_memory=hw.host_memory_gb * GiB,
        h2d=hw.h2d_gbps * GB,
        network=hw.network_gbps * GB,
        p2p_latency=hw.p2p_latency_us * 1e-6,
        pipe_action=hw.pipe_action_us * 1e-6,
        pipe_wake=hw.pipe_wake_us * 1e-6,
        p2p_bytes_per_s=hw.network_gbps * GB,
        tensor_link=hw.tensor_link_gbps * GB,
        offload=hw.offload_gbps * GB,
        async_copy=hw.async_copy,
        disk_read=hw.disk_read_gbps * GB,
        disk_write=hw.disk_write_gbps * GB,
        disk_mixed=hw.disk_mixed_gbps * GB,
        disk_free=hw.disk_free_gb * GiB,
        host_update_cost=OPTIMIZERS[cfg.optim.name].host_update_cost if cfg.optim.name in OPTIMIZERS else 1.0,
    )
    if hw.measured:
        from l2l_cli.plan.measure import measure

        measured = measure(cfg, shape)
        on_cpu = cfg.device.name in ("cpu", "sim") or (cfg.device.name == "auto" and not _cuda())
        ram = physical_memory()
        measured_flops = ubatch_flops(shape, cfg, measured.layers)
        rates = replace(
            rates,
            name="measure",
            measured=measured,
            device_flops=measured_flops,
            mfu=measured_flops / rates.peak_flops,
            gpus_per_node=max(1, cfg.dist.nproc),  # every rank here, on this machine
            device_memory=ram if on_cpu else _cuda_memory(),
            host_memory=ram,
            h2d=measured.memcpy_bytes_per_s,
            host_flops=block_update_flops(shape) / measured_update(measured, shape, host=True),
            device_optim_flops=block_update_flops(shape) / measured_update(measured, shape, host=False),
            async_copy=not on_cpu
            or cfg.device.name == "sim",  # device=cpu copies inline; the sim's are threads
            host_shares_device=on_cpu,
        )
        notes.append(f"measured on this machine ({measured.threads} threads, median of {measured.repeats})")
        if cfg.dist.pipeline > 1:  # the pipeline's messages: an exchange between two processes here
            from l2l_cli.plan.measure import measure_exchange

            hidden = 4.0 * cfg.batch.ubatch_size * cfg.task.max_seq_len * shape.hidden
            latency, bw, action, wake = measure_exchange(hidden, cfg.plan.measure_repeats)
            rates = replace(
                rates, p2p_latency=latency, p2p_bytes_per_s=bw, pipe_action=action, pipe_wake=wake
            )
            notes.append(
                f"pipeline messages measured between two gloo processes: {latency * 1e6:.0f} µs, "
                f"{bw / GB:.2f} GB/s; a schedule action {action * 1e6:.0f} µs beyond compute, a message "
                f"{wake * 1e6:.0f} µs later while its sender computes"
            )
        if measured.disk is not None:
            d = measured.disk
            rates = replace(
                rates,
                disk_read=d["read_gbps"] * GB,
                disk_write=d["write_gbps"] * GB,
                disk_mixed=d.get("mixed_gbps", 0.0) * GB,
                disk_free=d["free_bytes"],
            )
            notes.append(
                f"disk for eps.tier=disk measured at {d['path']}: {d['read_gbps']:.2f} GB/s read, "
                f"{d['write_gbps']:.2f} GB/s write, {d.get('mixed_gbps', 0.0):.2f} GB/s both at once "
                f"({'O_DIRECT' if d['direct_io'] else 'buffered'}, "
                f"{fmt_bytes(d['bytes'])}), {fmt_bytes(d['free_bytes'])} free"
            )
        if on_cpu:
            notes.append(
                "the device tier is this CPU: the EPS update shares its cores, so what L2L-p's overlapped "
                "update costs is measured, not assumed hidden"
            )
    if cfg.device.memory_gb is not None and cfg.device.name != "sim":  # the run's own cap on its device
        rates = replace(rates, device_memory=min(rates.device_memory, cfg.device.memory_gb * GiB))
        notes.append(f"device.memory_gb: the run may use {cfg.device.memory_gb:g} GiB of its device")
    if cfg.device.name == "sim":
        rates = replace(
            rates, device_memory=cfg.sim.memory_gb * GiB, h2d=cfg.sim.link_gbps * GB, async_copy=True
        )
        notes.append(
            f"device=sim: budget {cfg.sim.memory_gb:g} GiB and link {cfg.sim.link_gbps:g} GB/s from sim.*"
        )
    return replace(rates, notes=tuple(notes))


def half_tflops(hw: Any) -> float:
    """The half-precision rate every view uses: ``device_tflops_half`` when set, else peak × ``mfu``."""
    return hw.device_tflops_half if hw.device_tflops_half is not None else hw.device_peak_tflops * hw.mfu


def gpus_per_node(hw: Any) -> int:
    """Ranks that share one node's host memory: ``hardware.gpus_per_node``, else ``hardware.node_size``."""
    return int(hw.gpus_per_node if hw.gpus_per_node is not None else hw.node_size)


def block_update_flops(shape: ModelShape) -> float:
    return OPT_FLOP_PER_PARAM * shape.block_params


def measured_update(m: MeasuredTimes, shape: ModelShape, host: bool) -> float:
    """Seconds to update one block (for display as an effective GFLOP/s)."""
    if host:
        return max(m.host_fixed_s + shape.block_params * m.host_s_per_param, 1e-12)
    return max(m.device_fixed_s + shape.block_params * m.device_s_per_param, 1e-12)


def ubatch_flops(shape: ModelShape, cfg: Any, lt: LayerTimes) -> float:
    """The effective FLOP/s a measured block forward achieved (for display)."""
    return lt.ubatch * shape.block_flops(cfg.task.max_seq_len) / max(lt.block_fwd_grad, 1e-12)


def _cuda_memory() -> float:
    from l2l_cli.engine.device import cuda_total_memory

    return cuda_total_memory(0)


def _cuda() -> bool:
    try:
        from l2l_cli.engine.device import cuda_available

        return cuda_available()
    except Exception:
        return False
