"""Measured and modelled times of a step's primitives, and this machine's memory: the types the hardware
model (:mod:`l2l_cli.plan.hardware`) and the measurement (:mod:`l2l_cli.plan.measure`) share."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

GiB = 2**30
GB = 1e9


@dataclass(frozen=True)
class LayerTimes:
    """Seconds for one layer on one micro-batch: forward without autograd (L2L's forward pass), forward
    with autograd (the baselines' forward, L2L's recompute), and backward; per layer kind."""

    pre_fwd: float
    pre_fwd_grad: float
    pre_bwd: float
    block_fwd: float
    block_fwd_grad: float
    block_bwd: float
    post_fwd_grad: float
    post_bwd: float
    ubatch: int  # the micro-batch size these are for

    def scaled(self, ubatch: int) -> LayerTimes:
        """The same per-sample cost at another micro-batch size (linear in the samples)."""
        k = ubatch / self.ubatch
        vals = {f: getattr(self, f) * k for f in self.__dataclass_fields__ if f != "ubatch"}
        return LayerTimes(**vals, ubatch=ubatch)


@dataclass(frozen=True)
class MeasuredTimes:
    """What ``hardware=measure`` timed on this machine (medians), for the config's shapes."""

    layers: LayerTimes
    host_s_per_param: float
    device_s_per_param: float
    memcpy_bytes_per_s: float
    repeats: int
    threads: int
    host_fixed_s: float = 0.0  # per layer update (Python and kernel launches), beside the per-parameter cost
    device_fixed_s: float = 0.0  # per optimizer step
    # L2L-p on shared cores: step time an update run beside recompute + backward costs, per second of the
    # update alone (0: fully hidden, 1: as if serial, > 1: it also slows the compute it overlaps)
    overlap_cost: float | None = None
    # the disk EPS tier's filesystem (eps.path, else outputs/): sequential O_DIRECT bandwidth and free space
    disk: dict[str, Any] | None = None

    def summary(self) -> dict[str, Any]:
        lt = self.layers
        return {
            "ubatch": lt.ubatch,
            "block_forward_s": lt.block_fwd,
            "block_forward_grad_s": lt.block_fwd_grad,
            "block_backward_s": lt.block_bwd,
            "embeddings_forward_s": lt.pre_fwd,
            "embeddings_backward_s": lt.pre_bwd,
            "head_forward_s": lt.post_fwd_grad,
            "head_backward_s": lt.post_bwd,
            "host_update_ns_per_param": self.host_s_per_param * 1e9,
            "host_update_fixed_s": self.host_fixed_s,
            "device_update_ns_per_param": self.device_s_per_param * 1e9,
            "device_update_fixed_s": self.device_fixed_s,
            "memcpy_gbps": self.memcpy_bytes_per_s / GB,
            "l2l_p_overlap_cost": self.overlap_cost,
            "disk": self.disk,
            "repeats": self.repeats,
            "threads": self.threads,
        }


def physical_memory() -> float:
    """This machine's RAM in bytes (the device budget of a CPU device tier)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16.0 * GiB
