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

GiB = 2**30
# The layered-GA paper's §5 methods (how a 3d configuration places the training state), not l2l modes.
GA_BASELINE, GA_PARTITIONED, GA_IMPROVED = METHODS = ("baseline", "partitioned", "improved")

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
    """Device peak and bandwidths (input + output, the paper's "GB/s", taken as GiB/s)."""

    peak_flops: float = 312e12
    network_gbps: float = 50.0  # InfiniBand 200 Gb/s per GPU (Table A.1)
    tensor_gbps: float = 600.0  # NVLink
    offload_gbps: float = 31.5  # CPU-GPU through the shared PCIe switch
    device_memory_gib: float = 80.0

    def threshold(self, gbps: float) -> float:
        """The arithmetic intensity (flop/B) above which a transfer hides behind compute (eq. 3)."""
        return self.peak_flops / (gbps * GiB) if gbps > 0 else math.inf


def memory(m: Transformer, c: Parallel) -> dict[str, float]:
    """C.3, bytes per device: state (12p: FP32 weights and Adam's moments, split over the model-parallel
    devices, or all devices when partitioned), checkpoints (2·b·d_s·d_m·d_l over all devices), buffers
    (two parameter and one gradient buffer of a layer, 6·p_l over n_a), layer activations
    (b_mu·d_s·m0 over n_a). The first two are offloadable."""
    state = 12.0 * m.p / (c.n_gpu if c.partitioned else c.n_l * c.n_a)
    checkpoints = 2.0 * c.b * m.d_s * m.d_m * m.d_l / c.n_gpu
    buffers = 6.0 * m.p_l / c.n_a
    activations = c.b_mu * m.d_s * m.m0 / c.n_a
    return {
        "state": state,
        "checkpoints": checkpoints,
        "buffers": buffers,
        "activations": activations,
        "offloadable": state + checkpoints,
        "non_offloadable": buffers + activations,
    }


def intensities(m: Transformer, c: Parallel) -> dict[str, dict[str, Any]]:
    """C.4-C.5: arithmetic intensity (flop/B) of each transfer the configuration needs, and whether it
    overlaps the compute. Entries appear only for the dimensions in use."""
    out: dict[str, dict[str, Any]] = {}
    bds = c.b * m.d_s
    if c.n_b > 1:
        if c.method == GA_BASELINE and c.n_l > 1:
            out["data"] = {"eq": 6, "value": bds / c.n_b, "overlapped": False}
        elif c.method == GA_BASELINE:
            out["data"] = {"eq": 5, "value": 3 * bds / (4 * c.n_b * c.n_mu), "overlapped": True}
        elif c.method == "partitioned":
            out["data"] = {"eq": 7, "value": bds / (2 * c.n_b * c.n_mu), "overlapped": True}
        else:
            out["data"] = {"eq": 9, "value": bds / (2 * c.n_b), "overlapped": True}
    if c.n_l > 1:
        if c.method == "improved":
            out["pipeline"] = {"eq": 11, "value": (2 + m.n_I) * m.d_m, "overlapped": False}
        else:
            out["pipeline"] = {"eq": 10, "value": (2 + m.n_I) * m.d_m * m.d_l / c.n_l, "overlapped": True}
    if c.n_a > 1:
        out["tensor"] = {"eq": 12, "value": (4 + 2 * m.n_I) * m.d_m / (3 * (c.n_a - 1)), "overlapped": False}
    if c.offload:
        if c.method == "improved":
            v = bds if c.partitioned else bds / c.n_b
        else:
            v = bds / c.n_mu if c.partitioned else bds / (c.n_mu * c.n_b)
        out["offload"] = {"eq": 13, "value": v, "overlapped": True}
        out["checkpoint_offload"] = {"eq": 14, "value": (4 + 2 * m.n_I) * m.d_m, "overlapped": True}
    return out


def bubble(m: Transformer, c: Parallel) -> float:
    """Pipeline bubble, relative: (n_l − 1)/n_mu (§2.4); the modular pipeline divides it by d_l/n_l (§4)."""
    if c.n_l <= 1:
        return 0.0
    f = (c.n_l - 1) / c.n_mu
    return f * c.n_l / m.d_l if c.method == "improved" else f


def efficiency(m: Transformer, c: Parallel, links: Links) -> dict[str, Any]:
    """Computational efficiency: each overhead multiplies the time by (1 + overhead) — the bubble, and for
    each transfer ν_net/ν_op when it cannot overlap (eq. 4's relative overhead), or its excess over the
    compute, ν_net/ν_op − 1, when it overlaps but is data-bound."""
    nets = {"data": links.network_gbps, "pipeline": links.network_gbps, "tensor": links.tensor_gbps or links.network_gbps,
            "offload": links.offload_gbps, "checkpoint_offload": links.offload_gbps}  # fmt: skip
    overheads = {"bubble": bubble(m, c)}
    detail = intensities(m, c)
    for k, d in detail.items():
        nu_net = links.threshold(nets[k])
        d["threshold"] = nu_net
        ratio = nu_net / d["value"]
        overheads[k] = ratio if not d["overlapped"] else max(0.0, ratio - 1.0)
    factor = math.prod(1.0 + v for v in overheads.values())
    return {"efficiency": 1.0 / factor, "overheads": overheads, "intensities": detail}


def analyze(m: Transformer, c: Parallel, links: Links, steps: int = 100_000) -> dict[str, Any]:
    """Memory, efficiency and training time of one configuration."""
    mem = memory(m, c)
    eff = efficiency(m, c, links)
    flops = batch_flops(c.b, m.d_s, m.p)
    time_s = steps * flops / (c.n_gpu * links.peak_flops * eff["efficiency"])
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
        "steps": steps,
    }


# Table 6.1 / 6.2: X160's fastest configurations (b, b_mu, n_mu, n_b, n_l, n_a, offload), and the paper's
# memory breakdown in GB (state, checkpoint, buffers, activations, offloadable, non-offloadable),
# efficiency and time (days).
X160_TABLE: list[dict[str, Any]] = [
    {"row": "None / Baseline", "c": Parallel("baseline", 2416, 4, 604, 1, 1, 1, True),
     "mem": (14.1e3, 47.2e3, 43.9, 24.9, 61.2e3, 68.8), "eff": 1.00, "days": 630 * 365},
    {"row": "Data / Baseline", "c": Parallel("baseline", 2415, 5, 1, 483, 1, 1, True),
     "mem": (14.1e3, 97.7, 43.9, 31.1, 14.2e3, 75.1), "eff": 1.00, "days": 1.3 * 365},
    {"row": "Data / Partitioned", "c": Parallel("partitioned", 2415, 5, 1, 483, 1, 1, True),
     "mem": (29.1, 97.7, 43.9, 31.1, 127, 75.1), "eff": 1.00, "days": 1.3 * 365},
    {"row": "Data + pipe / Baseline", "c": Parallel("baseline", 2412, 4, 201, 3, 160, 1, True),
     "mem": (87.9, 98.1, 43.9, 24.9, 186, 68.8), "eff": 0.56, "days": 2.4 * 365},
    {"row": "Data + pipe / Improved", "c": Parallel("improved", 2415, 1, 5, 483, 5, 1, False),
     "mem": (5.82, 19.5, 43.9, 6.23, 25.4, 50.2), "eff": 0.94, "days": 100},
    {"row": "Data + tensor / Baseline", "c": Parallel("baseline", 2415, 5, 1, 483, 1, 16, True),
     "mem": (879, 6.10, 2.75, 1.95, 885, 4.69), "eff": 0.93, "days": 32},
    {"row": "Data + tensor / Partitioned", "c": Parallel("partitioned", 2415, 5, 1, 483, 1, 16, False),
     "mem": (1.82, 6.10, 2.75, 1.95, 7.92, 4.69), "eff": 0.93, "days": 32},
    {"row": "3d / Baseline", "c": Parallel("baseline", 2408, 1, 172, 14, 160, 16, False),
     "mem": (5.49, 1.31, 2.75, 0.389, 6.81, 3.14), "eff": 0.48, "days": 13},
    {"row": "3d / Improved", "c": Parallel("improved", 2415, 1, 5, 483, 5, 16, False),
     "mem": (0.364, 1.22, 2.75, 0.389, 1.58, 3.14), "eff": 0.88, "days": 6.8},
]  # fmt: skip


def for_config(cfg: Any, shape: Any, links: Links) -> dict[str, Any]:
    """The layered-GA analysis of the config: d_s = model.seq_len (the model's context, as the paper's
    X[x] and BERT rows use), b = batch.size × plan.data_parallel, b_mu = batch.ubatch_size."""
    m = Transformer(
        shape.num_layers, shape.hidden, shape.heads, int(cfg.model.seq_len), shape.intermediate / shape.hidden
    )
    nb, nl, na = cfg.plan.data_parallel, cfg.plan.pipeline_parallel, cfg.plan.tensor_parallel
    b, bmu = cfg.batch.size * nb, cfg.batch.ubatch_size
    rows = []
    for method in METHODS:
        c = Parallel(method, b, bmu, cfg.batch.size // bmu, nb, nl, na)
        rows.append(analyze(m, c, links, cfg.plan.train_steps))
    return {
        "d_s": m.d_s,
        "params": m.p,
        "params_per_layer": m.p_l,
        "critical_batch_size": m.critical_batch_size,
        "batch": b,
        "batch_vs_critical": b / m.critical_batch_size,
        "flops_per_batch": batch_flops(b, m.d_s, m.p),
        "methods": rows,
    }
