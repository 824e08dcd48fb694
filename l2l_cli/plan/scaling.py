"""The layered-GA paper's resource model (Lamy-Poirier 2021, §5 and appendices B-C).

- X[x] model family (B, eq. 1) and parameter counts (Table B.1),
- critical batch size (B, eq. 2),
- compute (C.1): 8·b·d_s·p FLOPs per batch (forward, recompute, and the two backward products),
- memory per device (C.3): training state, activation checkpoints, parameter + gradient buffers (mixed
  buffering, C.2), layer activations; the first two can be offloaded to CPU memory,
- network arithmetic intensities (C.4, eqs. 5-12) and CPU-GPU transfers (C.5, eqs. 13-14),
- 3d-parallel configurations (data n_b, pipeline n_l, tensor n_a) for the three training methods:
  ``baseline`` (standard data + pipeline parallelism), ``partitioned`` (training state partitioned over
  the data-parallel devices), ``improved`` (layered gradient accumulation + modular pipeline, partitioned).

Units follow the paper: its GB are binary (Table 6.2's 14.1K GB state of X160 is 12p / 2^30, and Table
A.1's 484 flop/B for NVLink is 312e12 / (600·2^30)), so memory here is bytes reported in GiB and link
bandwidths given "in GB/s" are taken as GiB/s. Symbols: p parameters (transformer layers only), p_l per
layer, b batch, b_mu micro-batch, n_mu micro-batches, d_s sequence, d_m width, d_a heads, d_l layers,
n_I = d_I / d_m.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

GiB = 2**30
# The layered-GA paper's §5 methods (how a 3d configuration places the training state), not l2l modes.
GA_BASELINE, GA_PARTITIONED, GA_IMPROVED = METHODS = ("baseline", "partitioned", "improved")
# §8.3's "No partition" (Figure 8's dotted line): the improved method (layered GA, modular pipeline) with the
# state not partitioned, eq. 8 for its reduction. Not one of §5's methods: the figures draw it beside them.
GA_NO_PARTITION = "no_partition"
MODULAR = (GA_IMPROVED, GA_NO_PARTITION)  # layered GA and the modular pipeline
PARTITIONED = (GA_PARTITIONED, GA_IMPROVED)  # the state partitioned over the data-parallel devices

# The layer-activation memory per token, m0 (C.3). The extracted paper text lost its formula; Table 6.2
# fixes it for X160 at 102·d_m bytes (all five activation entries agree to 3 digits). We keep Megatron-LM's
# attention term, 5·d_a·d_s (half-precision softmax and its output + a one-byte dropout mask), and put the
# rest on d_m: for the X[x] family d_a·d_s = 8·d_m, so m0 = 62·d_m + 5·d_a·d_s = 102·d_m there.
M0_PER_WIDTH = 62.0
M0_PER_SCORE = 5.0
CRITICAL_TOKENS = 573.0  # b_c·d_s = 573·p^(1/3) tokens: GPT-3 at its critical batch of 3.2M tokens (eq. 2)


@dataclass(frozen=True)
class Transformer:
    """The paper's transformer: d_l layers of width d_m = d_a·d_h, MLP n_I·d_m, sequence d_s."""

    d_l: int
    d_m: int
    d_a: int
    d_s: int
    n_I: float = 4.0

    @property
    def d_h(self) -> float:
        return self.d_m / self.d_a

    @property
    def p_l(self) -> float:
        """Parameters per layer: (4 + 2·n_I)·d_m² weights and (9 + n_I)·d_m biases and LayerNorm
        (12·d_m² + 13·d_m for n_I = 4, Table B.1's 12x⁵ + 13x³ over x layers)."""
        return (4 + 2 * self.n_I) * self.d_m**2 + (9 + self.n_I) * self.d_m

    @property
    def p(self) -> float:
        """Parameters, excluding the embeddings and the head (as Table B.1)."""
        return self.p_l * self.d_l

    @property
    def critical_batch_size(self) -> float:
        return critical_batch_size(self.p, self.d_s)

    @property
    def m0(self) -> float:
        """Layer-activation bytes per token (activations and their gradients, half precision)."""
        return M0_PER_WIDTH * self.d_m + M0_PER_SCORE * self.d_a * self.d_s


def x_family(x: int) -> Transformer:
    """Eq. 1: d_a = x/2, d_h = 2x, d_l = x, d_s = 16x, d_m = x², d_I = 4x²."""
    if x < 2 or x % 2:
        raise ValueError(f"X[x] needs an even x >= 2 (heads = x/2), got {x}")
    return Transformer(d_l=x, d_m=x * x, d_a=x // 2, d_s=16 * x)


def x_params(x: int) -> int:
    """Table B.1: p = 12x⁵ + 13x³."""
    return 12 * x**5 + 13 * x**3


def critical_batch_size(p: float, d_s: int) -> float:
    """Eq. 2: b_c ≈ 573·p^(1/3) / d_s samples (a critical batch in tokens that scales as p^(1/3))."""
    return CRITICAL_TOKENS * p ** (1.0 / 3.0) / d_s


def x_critical_batch_size(x: int) -> float:
    """Eq. 2 for X[x] (p ≈ 12x⁵, d_s = 16x): b_c ≈ 573·12^(1/3)/16·x^(2/3), printed as 82.0·x^(2/3)."""
    return CRITICAL_TOKENS * 12 ** (1.0 / 3.0) / 16.0 * x ** (2.0 / 3.0)


# Table B.1's named models (d_s, d_a, d_h, d_m, d_l), with the paper's p and b_c for comparison.
NAMED_MODELS: dict[str, dict[str, Any]] = {
    "BERT": {"model": Transformer(24, 1024, 16, 512), "p": 301e6, "b_c": 751},
    "Megatron-LM": {"model": Transformer(72, 3072, 32, 1024), "p": 8.15e9, "b_c": 1130},
    "T-NLG": {"model": Transformer(78, 4256, 28, 1024), "p": 17.0e9, "b_c": 1440},
    "GPT-3": {"model": Transformer(96, 12288, 96, 2048), "p": 174e9, "b_c": 1560},
}


def batch_flops(b: float, d_s: int, p: float) -> float:
    """C.1: 8·b·d_s·p FLOPs per batch: 2 per token and parameter forward, 3× that for the recompute
    and the two backward products."""
    return 8.0 * b * d_s * p


# --------------------------------------------------------------------------------------------------
# 3d-parallel configurations
#
# The formulas below take numbers or numpy arrays alike (the search in ``plan/search.py`` evaluates
# thousands of configurations at once through them), so one configuration typed by the user and one found
# by the search are costed by the same code.


@dataclass(frozen=True)
class Parallel:
    """A training configuration: batch b split into n_b data-parallel instances × n_mu micro-batches of
    b_mu samples; n_l pipeline and n_a tensor-parallel devices per instance."""

    method: str  # baseline | partitioned | improved
    b: int
    b_mu: int
    n_mu: int
    n_b: int = 1
    n_l: int = 1
    n_a: int = 1
    offload: bool = False

    @property
    def n_gpu(self) -> int:
        return self.n_b * self.n_l * self.n_a

    @property
    def partitioned(self) -> bool:
        return self.method in ("partitioned", "improved")


@dataclass(frozen=True)
class Links:
    """Device peak and bandwidths (input + output, the paper's "GB/s", taken as GiB/s). Defaults: the
    paper's A100 80 GB in a 16-GPU HGX node with InfiniBand (appendix A, Table A.1)."""

    peak_flops: float = 312e12
    network_gbps: float = 50.0  # InfiniBand 200 Gb/s per GPU (Table A.1); Ethernet 25 Gb/s: 6.25
    tensor_gbps: float = 600.0  # NVLink (0: none, tensor parallelism goes over the network)
    offload_gbps: float = 31.5  # CPU-GPU through the shared PCIe switch
    device_memory_gib: float = 80.0
    # The GPU's own PCIe link (Table A.1: 63 GB/s), which both the network and the CPU-GPU transfers cross
    # (§5: "an additional bottleneck in the PCI-express connection which is shared between CPU and
    # InfiniBand transfers"). 0: no such shared link.
    pcie_gbps: float = 63.0
    # GPUs one tensor link joins; tensor parallelism beyond it uses the network (0: no limit)
    node_size: int = 16
    # The share of peak_flops a training step achieves (hardware.mfu): the paper computes at peak × each
    # configuration's efficiency, i.e. 1.0; l2l plan's own questions use the hardware's published figure.
    mfu: float = 1.0
    # Offload budget per GPU (0: no limit). The paper sets none: Table 6.2 offloads 61.2K GB from one GPU;
    # Figure 4 only draws a "1 TB (offload)" line for reference.
    host_memory_gib: float = 0.0
    # The tool's machine (hardware.host_memory_gb, hardware.gpus_per_node): a node's host memory, shared by
    # the GPUs of a job on it (0: no such bound)
    node_host_memory_gib: float = 0.0
    gpus_per_node: int = 1
    # The pipeline's messages between stages that share a node (n_l·n_a <= node_size) take its tensor link
    # (NVLink), as a placement that keeps a pipeline's stages inside one node does; False: the network, as
    # the paper's Tables take every pipeline transfer.
    pipe_in_node: bool = False

    def host_per_gpu(self, n_gpu: Any) -> Any:
        """Offload bytes one GPU may use: ``host_memory_gib``, and its share of a node's host memory among
        the job's GPUs on that node (inf where neither bounds it)."""
        per = self.host_memory_gib * GiB if self.host_memory_gib > 0 else math.inf
        if self.node_host_memory_gib > 0:
            on_node = np.clip(n_gpu, 1, max(1, self.gpus_per_node))
            per = np.minimum(per, self.node_host_memory_gib * GiB / on_node)
        return per

    @property
    def rate(self) -> float:
        """FLOP/s one device achieves on the counted work: peak × mfu."""
        return self.peak_flops * self.mfu

    def threshold(self, gbps: Any) -> Any:
        """The arithmetic intensity (flop/B) above which a transfer hides behind compute (eq. 3). At peak, not
        peak × mfu: the matmuls a transfer overlaps run near peak (the mfu's loss is elsewhere: kernels
        between them, launches, the step's edges), so the search's choices do not depend on the mfu."""
        if np.ndim(gbps) == 0:
            return self.peak_flops / (gbps * GiB) if gbps > 0 else math.inf
        return self.peak_flops / (np.asarray(gbps, dtype=float) * GiB)


def memory_parts(m: Transformer, partitioned: Any, b: Any, b_mu: Any, n_gpu: Any, n_l: Any, n_a: Any) -> dict:
    """C.3, bytes per device: state (12p: FP32 weights and Adam's moments, split over the model-parallel
    devices, or all devices when partitioned), checkpoints (2·b·d_s·d_m·d_l over all devices), buffers
    (two parameter and one gradient buffer of a layer, 6·p_l over n_a), layer activations
    (b_mu·d_s·m0 over n_a). The first two are offloadable."""
    state = 12.0 * m.p / np.where(partitioned, n_gpu, np.multiply(n_l, n_a))
    checkpoints = 2.0 * np.multiply(b, m.d_s * m.d_m * m.d_l) / n_gpu
    buffers = 6.0 * m.p_l / np.asarray(n_a, dtype=float)
    activations = np.multiply(b_mu, m.d_s * m.m0) / n_a
    return {
        "state": state,
        "checkpoints": checkpoints,
        "buffers": buffers,
        "activations": activations,
        "offloadable": state + checkpoints,
        "non_offloadable": buffers + activations,
    }


def memory(m: Transformer, c: Parallel) -> dict[str, float]:
    """:func:`memory_parts` of one configuration."""
    parts = memory_parts(m, c.partitioned, c.b, c.b_mu, c.n_gpu, c.n_l, c.n_a)
    return {k: float(v) for k, v in parts.items()}


def transfers(
    m: Transformer,
    method: str,
    b_mu: Any,
    n_mu: Any,
    n_b: Any,
    n_l: Any,
    n_a: Any,
    offload: Any,
    links: Links,
) -> dict[str, dict[str, Any]]:
    """C.4-C.5: for each link a configuration uses, the arithmetic intensity ν (flop/B) of its transfers,
    the link's threshold ν_net (eq. 3), whether the transfer overlaps the compute, and whether it is in use.

    - ``data`` (the network): eq. 5 (baseline, overlapped with the last micro-batch's backward), eq. 6
      (baseline with a pipeline: in practice not overlapped), eq. 7 (partitioned: every micro-batch),
      eq. 9 (improved: layered GA spreads it over the whole backward). They depend on b/n_b = b_mu·n_mu only.
    - ``pipeline`` (the network): eq. 10, or eq. 11 for the modular pipeline. It overlaps the compute when
      there are enough extra micro-batches, n_mu >= n_l·(1 + ν_net/ν) (C.4.2); else it is exposed.
    - ``tensor``: eq. 12, never overlapped; over the tensor link within a node, over the network beyond.
    - ``offload`` (CPU-GPU): the state, eq. 13, and the activation checkpoints, eq. 14, on one link.
    - ``pcie``: with offload, the GPU's PCIe link carries the offload and the overlapped network transfers.
    """
    d_s = m.d_s
    net = links.threshold(links.network_gbps)
    n_b, n_l, n_a, n_mu, b_mu = (np.asarray(v) for v in (n_b, n_l, n_a, n_mu, b_mu))
    # data parallel
    if method == GA_BASELINE:
        piped = n_l > 1
        nu_d = np.where(piped, b_mu * n_mu * d_s, 0.75 * b_mu * d_s)
        eq_d, ov_d = np.where(piped, 6, 5), ~piped
    elif method == GA_PARTITIONED:
        nu_d, eq_d, ov_d = 0.5 * b_mu * d_s, 7, np.True_
    elif method == GA_NO_PARTITION:
        nu_d, eq_d, ov_d = 0.75 * b_mu * n_mu * d_s, 8, np.True_
    else:
        nu_d, eq_d, ov_d = 0.5 * b_mu * n_mu * d_s, 9, np.True_
    # pipeline: over the network, or inside a node over its tensor link (``Links.pipe_in_node``)
    nu_p = (2 + m.n_I) * m.d_m * (1.0 if method in MODULAR else m.d_l / n_l)
    thr_p = net
    if links.pipe_in_node and links.tensor_gbps > 0:
        inside = (n_l * n_a <= links.node_size) | (links.node_size <= 0)
        thr_p = np.where(inside, links.threshold(links.tensor_gbps), net)
    ov_p = n_mu >= n_l * (1.0 + thr_p / nu_p)
    # tensor: the tensor link within a node, the network beyond it
    in_node = (n_a <= links.node_size) | (links.node_size <= 0)
    thr_a = np.where(in_node & (links.tensor_gbps > 0), links.threshold(links.tensor_gbps or 1.0), net)
    nu_a = (4 + 2 * m.n_I) * m.d_m / (3.0 * np.maximum(n_a - 1, 1))
    # offload: the state (eq. 13) and the checkpoints (eq. 14) over the CPU-GPU link
    bds_per_instance = b_mu * n_mu * d_s  # b·d_s / n_b
    nu_s = {
        GA_BASELINE: b_mu * d_s,  # b·d_s / (n_mu·n_b): every micro-batch, the instance's replica
        GA_PARTITIONED: b_mu * n_b * d_s,  # b·d_s / n_mu
        GA_IMPROVED: bds_per_instance * n_b,  # b·d_s: once per batch, the device's partition
        GA_NO_PARTITION: bds_per_instance,  # b·d_s / n_b: once per batch, the instance's replica
    }[method]
    nu_c = (4 + 2 * m.n_I) * m.d_m
    nu_o = 1.0 / (1.0 / nu_s + 1.0 / nu_c)
    offload = np.asarray(offload, dtype=bool)
    data_on, pipe_on = n_b > 1, n_l > 1
    # PCIe: offload plus the network transfers that overlap it
    over_net = np.asarray(thr_p) == net  # a pipeline inside a node does not cross the GPU's PCIe link
    inv = (
        1.0 / nu_o
        + np.where(data_on & ov_d, 1.0 / nu_d, 0.0)
        + np.where(pipe_on & ov_p & over_net, 1.0 / nu_p, 0.0)
    )
    pcie_thr = links.threshold(links.pcie_gbps)
    return {
        "data": {"eq": eq_d, "value": nu_d, "threshold": net, "overlapped": ov_d, "active": data_on},
        "pipeline": {
            "eq": 11 if method in MODULAR else 10,
            "value": nu_p,
            "threshold": thr_p,
            "overlapped": ov_p,
            "active": pipe_on,
        },
        "tensor": {"eq": 12, "value": nu_a, "threshold": thr_a, "overlapped": np.False_, "active": n_a > 1},
        "offload": {
            "eq": 13,
            "value": nu_o,
            "threshold": links.threshold(links.offload_gbps),
            "overlapped": np.True_,
            "active": offload,
            "state": nu_s,
            "checkpoints": nu_c,
        },
        "pcie": {
            "eq": None,
            "value": 1.0 / inv,
            "threshold": pcie_thr,
            "overlapped": np.True_,
            "active": offload & (data_on | pipe_on) & (links.pcie_gbps > 0),
        },
    }


def ratios(t: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """ν_net/ν for each link in use (0 where unused): above 1 an overlapped transfer is data-bound."""
    return {k: np.where(d["active"], d["threshold"] / d["value"], 0.0) for k, d in t.items()}


def bubble_of(m: Transformer, method: str, n_mu: Any, n_l: Any) -> Any:
    """Pipeline bubble, relative: (n_l − 1)/n_mu (§2.4); the modular pipeline divides it by d_l/n_l (§4)."""
    f = (np.asarray(n_l) - 1.0) / n_mu
    return f * n_l / m.d_l if method in MODULAR else f


def overheads_of(m: Transformer, method: str, n_mu: Any, n_l: Any, t: dict[str, dict[str, Any]]) -> dict:
    """Relative overheads: the bubble, and for each transfer ν_net/ν when it cannot overlap (eq. 4's
    relative overhead), or its excess over the compute, ν_net/ν − 1, when it overlaps but is data-bound."""
    r = ratios(t)
    out = {"bubble": bubble_of(m, method, n_mu, n_l)}
    for k, d in t.items():
        out[k] = np.where(d["overlapped"], np.maximum(r[k] - 1.0, 0.0), r[k])
    return out


def efficiency_of(overheads: dict[str, Any]) -> Any:
    """Each overhead multiplies the step time by (1 + overhead)."""
    factor = 1.0
    for v in overheads.values():
        factor = factor * (1.0 + v)
    return 1.0 / factor


def intensities(m: Transformer, c: Parallel, links: Links | None = None) -> dict[str, dict[str, Any]]:
    """C.4-C.5 for one configuration: the transfers it uses, with their intensity and whether they
    overlap the compute."""
    t = transfers(m, c.method, c.b_mu, c.n_mu, c.n_b, c.n_l, c.n_a, c.offload, links or Links())
    out: dict[str, dict[str, Any]] = {}
    for k, d in t.items():
        if bool(d["active"]):
            eq = None if d["eq"] is None else int(d["eq"])
            out[k] = {"eq": eq, "value": float(d["value"]), "overlapped": bool(d["overlapped"])}
            out[k]["threshold"] = float(d["threshold"])
    if c.offload:  # the two parts of the offload link
        out["offload"]["state"] = float(t["offload"]["state"])
        out["offload"]["checkpoints"] = float(t["offload"]["checkpoints"])
    return out


def bubble(m: Transformer, c: Parallel) -> float:
    return float(bubble_of(m, c.method, c.n_mu, c.n_l)) if c.n_l > 1 else 0.0


def efficiency(m: Transformer, c: Parallel, links: Links) -> dict[str, Any]:
    """Computational efficiency of one configuration (:func:`overheads_of`)."""
    t = transfers(m, c.method, c.b_mu, c.n_mu, c.n_b, c.n_l, c.n_a, c.offload, links)
    ov = {k: float(v) for k, v in overheads_of(m, c.method, c.n_mu, c.n_l, t).items()}
    ov = {k: v for k, v in ov.items() if k == "bubble" or bool(t[k]["active"])}
    return {"efficiency": float(efficiency_of(ov)), "overheads": ov, "intensities": intensities(m, c, links)}


def train_seconds(total_flops: Any, n_gpu: Any, rate: float, efficiency: Any) -> Any:
    """Training time: the work over the cluster's rate (peak × mfu) times the efficiency (§5 "Resource
    usage")."""
    return total_flops / (np.multiply(n_gpu, rate) * efficiency)


def analyze(
    m: Transformer, c: Parallel, links: Links, steps: int = 100_000, samples: float | None = None
) -> dict[str, Any]:
    """Memory, efficiency and training time of one configuration: ``steps`` steps of its batch, or
    ``samples`` samples when given (the paper trains 100k steps' worth of samples at the critical batch,
    so that a smaller batch takes proportionally more steps, §2.1)."""
    mem = memory(m, c)
    eff = efficiency(m, c, links)
    flops = batch_flops(c.b, m.d_s, m.p)
    total = flops * (steps if samples is None else samples / c.b)
    time_s = float(train_seconds(total, c.n_gpu, links.rate, eff["efficiency"]))
    budget = links.device_memory_gib * GiB
    return {
        "method": c.method,
        "config": {k: getattr(c, k) for k in ("b", "b_mu", "n_mu", "n_b", "n_l", "n_a", "offload")}
        | {"n_gpu": c.n_gpu},
        "memory_bytes": mem,
        "fits_without_offload": mem["offloadable"] + mem["non_offloadable"] <= budget,
        "fits_with_offload": mem["non_offloadable"] <= budget,
        "flops_per_batch": flops,
        "efficiency": eff["efficiency"],
        "overheads": eff["overheads"],
        "intensities": eff["intensities"],
        "train_time_s": time_s,
        "steps": steps if samples is None else samples / c.b,
    }
