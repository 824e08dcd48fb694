"""The search space of layered-GA §5 and its costing: what the search may use (``Bounds``), what it trains
(``Target``), every candidate configuration of a method and mix as numpy arrays, their costs through
:func:`scaling.transfers` and :func:`scaling.memory_parts`, the constraints each breaks, and the best
feasible one. ``search.py`` runs it per method and mix (its docstring states the constraints and why the
candidate set is small enough).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from l2l_cli.plan import scaling as ga
from l2l_cli.plan.scaling import (
    GA_BASELINE,
    GA_PARTITIONED,
    METHODS,
    MODULAR,
    PARTITIONED,
    GiB,
    Links,
    Transformer,
)

DAY = 86400.0
# (data, pipeline, tensor) each mix may use
MIXES: dict[str, tuple[bool, bool, bool]] = {
    "none": (False, False, False),
    "data": (True, False, False),
    "data+pipe": (True, True, False),
    "data+tensor": (True, False, True),
    "3d": (True, True, True),
}
# The (mix, method) pairs §5 considers: the partition without a pipeline only, and on one device the
# partitioned method is the baseline.
PAIRS: list[tuple[str, str]] = [
    (mix, method)
    for mix in MIXES
    for method in METHODS
    if not (method == GA_PARTITIONED and (MIXES[mix][1] or mix == "none"))
]
MEMORY_KEYS = ("state", "checkpoint", "buffers", "activations", "offloadable", "non_offloadable")


@dataclass(frozen=True)
class Bounds:
    """What the search may use. 0 means no bound."""

    max_gpus: int = 0
    max_days: float = 0.0  # > 0: the fewest GPUs that train within it, instead of the fastest
    max_overhead: float = 0.25  # cap on each exposed overhead (the paper's 25%)
    whole: bool = True  # n_l divides d_l and n_a divides d_a (what a runner can split evenly)
    # n_a <= d_a: Megatron-LM splits attention by heads. False (only with whole=False): tensor parallelism
    # is bounded by its link alone, as §7's Figure 5 takes it ("only requires a ring topology, which is
    # easy to scale to an arbitrary size")
    heads: bool = True
    n_l: int = 0  # > 0: pin the pipeline degree
    n_a: int = 0  # > 0: pin the tensor degree
    offload: bool = True  # may offload the state and checkpoints to CPU memory
    steps: int = 100_000  # training = steps × b_c samples (the paper's 100k steps at the critical batch)
    samples: float = 0.0  # > 0: training = this many samples (a budget in tokens / d_s), instead


@dataclass(frozen=True)
class Target:
    """A model and the machine it trains on."""

    model: Transformer
    b_c: float  # critical batch size (samples)
    links: Links = field(default_factory=Links)


def _allowed(n: int, whole: bool) -> np.ndarray:
    """Degrees a dimension of size n can take: its divisors, or (free) every integer up to n."""
    if whole:
        return np.array([k for k in range(1, n + 1) if n % k == 0], dtype=np.int64)
    return np.arange(1, n + 1, dtype=np.int64)


def _largest_leq(allowed: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """The largest allowed value <= limit (0 where none)."""
    i = np.searchsorted(allowed, np.floor(limit + 1e-9), side="right") - 1
    return np.where(i >= 0, allowed[np.maximum(i, 0)], 0)


def _pairs(B: int, bmu_max: int, full: bool) -> tuple[np.ndarray, np.ndarray]:
    """(b_mu, n_mu) with b_mu·n_mu <= B. ``full``: every n_mu; else the small ones and those that end a
    run of equal floor(B / (b_mu·n_mu)): for a given n_b the largest n_mu is the most efficient (bubble
    and intensities improve with it), so the others only matter where memory would stop it."""
    bm, nm = [], []
    for b_mu in range(1, min(B, bmu_max) + 1):
        top = B // b_mu
        if full or top <= 256:
            n = np.arange(1, top + 1)
        else:
            k = np.arange(1, top + 1)
            n = np.unique(np.concatenate([np.arange(1, 129), top // k]))
            n = n[n >= 1]
        bm.append(np.full(n.size, b_mu))
        nm.append(n)
    return np.concatenate(bm), np.concatenate(nm)


def _tensor_ok(t: Target, n_a: np.ndarray, cap: float) -> np.ndarray:
    """Tensor degrees whose exposed overhead (eq. 12) is within the cap, on the link they would use."""
    tr = ga.transfers(t.model, GA_BASELINE, 1, 1, 1, 1, n_a, False, t.links)["tensor"]
    return (n_a == 1) | (tr["threshold"] / tr["value"] <= cap)


def tensor_limit(t: Target, b: Bounds) -> int:
    """The largest n_a to consider: the head count, or without that bound (``Bounds.heads``) the largest
    the tensor cap allows on the fastest link it may use (eq. 12: n_a - 1 <= cap·ν_a·(n_a - 1) / ν_net)."""
    m = t.model
    if b.heads or b.whole:
        return m.d_a
    links = t.links
    gbps = links.tensor_gbps if links.tensor_gbps > 0 else links.network_gbps  # (beyond a node: slower)
    per = (4 + 2 * m.n_I) * m.d_m / 3.0  # ν_a·(n_a - 1)
    return max(m.d_a, 1 + math.floor(b.max_overhead * per / links.threshold(gbps) + 1e-9))


def candidates(t: Target, b: Bounds, method: str, mix: str, prune: bool) -> dict[str, np.ndarray]:
    m, links = t.model, t.links
    _, pipe, tensor = MIXES[mix]
    B = math.floor(t.b_c + 1e-9)
    budget = links.device_memory_gib * GiB
    n_a_set = _allowed(tensor_limit(t, b), b.whole) if tensor else np.array([1])
    n_a_set = n_a_set[_tensor_ok(t, n_a_set, b.max_overhead)]
    n_l_set = _allowed(m.d_l, b.whole) if pipe else np.array([1])
    if b.n_a:
        n_a_set = n_a_set[n_a_set == b.n_a]
    if b.n_l:
        n_l_set = n_l_set[n_l_set == b.n_l]
    if b.max_gpus:
        n_a_set, n_l_set = n_a_set[n_a_set <= b.max_gpus], n_l_set[n_l_set <= b.max_gpus]
    if B < 1 or not n_a_set.size or not n_l_set.size:
        return {k: np.zeros(0, dtype=np.int64) for k in ("b_mu", "n_mu", "n_l", "n_a", "offload")}
    # micro-batches: at most what the activations and buffers leave room for at the widest tensor split,
    # and no larger than the transfers could need (4x the largest threshold / d_s: the reduction's eq. 7
    # needs 2x, the PCIe link's sum ~2.3x); a larger one only shrinks n_b, as b_mu·n_mu is what counts
    per_sample = m.d_s * m.m0 / n_a_set.max()
    bmu_max = int(max(1, (budget - 6.0 * m.p_l / n_a_set.max()) // per_sample))
    thr = max(links.threshold(g) for g in (links.network_gbps, links.offload_gbps, links.pcie_gbps) if g > 0)
    bmu_max = min(bmu_max, math.ceil(4.0 * thr / m.d_s) + 2)
    bmu, nmu = _pairs(B, bmu_max, full=False)
    if prune:
        # the largest n_a on the tensor link and the largest over the network; the largest n_l with the
        # pipeline overlapped and the largest without (see the module doc); where none is, the smallest
        # allowed (1, or the pinned degree: ``plan.pipeline_parallel`` / ``plan.tensor_parallel``)
        in_node = (n_a_set <= links.node_size) | (links.node_size <= 0)
        n_a_c = np.unique([n_a_set[in_node].max(initial=n_a_set.min()), n_a_set.max()])
        lo = n_l_set.min()
        if pipe:
            net = links.threshold(links.network_gbps)
            c = (2 + m.n_I) * m.d_m * (1.0 if method in MODULAR else m.d_l)
            # overlapped: n_mu >= n_l·(1 + net·n_l^k / c), k = 0 (eq. 11) or 1 (eq. 10)
            if method in MODULAR:
                lim_ov = nmu / (1.0 + net / c)
            else:
                lim_ov = (np.sqrt(1.0 + 4.0 * net / c * nmu) - 1.0) / (2.0 * net / c)
            l1 = _largest_leq(n_l_set, lim_ov)
            l2 = _largest_leq(n_l_set, nmu.astype(float)) if method in MODULAR else l1
            n_l_pair = np.stack([np.maximum(l1, lo), np.maximum(l2, lo), np.full_like(l1, lo)], axis=1)
            k = n_l_pair.shape[1]
            bmu, nmu, n_l = np.repeat(bmu, k), np.repeat(nmu, k), n_l_pair.reshape(-1)
        else:
            n_l = np.ones_like(bmu)
        grid = {"b_mu": bmu, "n_mu": nmu, "n_l": n_l}
        n_a_grid = n_a_c
    else:
        P, L = bmu.size, n_l_set.size
        grid = {"b_mu": np.repeat(bmu, L), "n_mu": np.repeat(nmu, L), "n_l": np.tile(n_l_set, P)}
        n_a_grid = n_a_set
    # × n_a × offload
    P, A = grid["b_mu"].size, n_a_grid.size
    out = {k: np.tile(np.repeat(v, A), 2) for k, v in grid.items()}
    out["n_a"] = np.tile(np.tile(n_a_grid, P), 2)
    out["offload"] = np.repeat(np.array([False, True]), P * A)
    if pipe or not b.offload:  # a pipeline needs n_mu >= n_l; drop the rest before costing
        keep = (out["n_mu"] >= out["n_l"]) & (b.offload | ~out["offload"])
        out = {k: v[keep] for k, v in out.items()}
    return out


def evaluate(t: Target, b: Bounds, method: str, mix: str, c: dict[str, np.ndarray]) -> dict[str, Any]:
    """Cost every candidate (n_b derived) and say which are feasible."""
    m, links = t.model, t.links
    data = MIXES[mix][0]
    B = math.floor(t.b_c + 1e-9)
    bmu, nmu, n_l, n_a, off = c["b_mu"], c["n_mu"], c["n_l"], c["n_a"], c["offload"]
    la = n_l * n_a
    n_b_max = B // (bmu * nmu) if data else np.ones_like(bmu)
    if b.max_gpus:
        n_b_max = np.minimum(n_b_max, b.max_gpus // la)
    total = ga.batch_flops(b.samples or t.b_c * b.steps, m.d_s, m.p)
    n_b = n_b_max
    if b.max_days > 0 and data:
        # the fewest data-parallel instances that train within max_days (and whose state fits)
        eff0 = costs(t, method, bmu, nmu, np.maximum(n_b_max, 1), n_l, n_a, off)["efficiency"]
        need = np.ceil(total / (b.max_days * DAY * links.rate * eff0 * la) - 1e-9)
        if method in PARTITIONED:  # the partitioned state shrinks with n_b
            ck = 2.0 * bmu * nmu * m.d_s * m.d_m * m.d_l / la
            rest = np.where(
                off,
                links.host_per_gpu(n_b_max * la) - ck,
                links.device_memory_gib * GiB - ck - 6.0 * m.p_l / n_a - bmu * m.d_s * m.m0 / n_a,
            )
            need = np.maximum(need, np.ceil(12.0 * m.p / (la * np.maximum(rest, 1.0)) - 1e-9))
        n_b = np.minimum(np.maximum(need, 1), n_b_max).astype(np.int64)
    n_b = np.maximum(n_b, 0)
    r = costs(t, method, bmu, nmu, np.maximum(n_b, 1), n_l, n_a, off)
    r["n_b"] = n_b
    r["time_s"] = ga.train_seconds(total, np.maximum(n_b, 1) * la, links.rate, r["efficiency"])
    r["violations"] = violations(t, b, method, c, r)
    r["feasible"] = (n_b >= 1) & ~np.any(np.stack(list(r["violations"].values())), axis=0)
    if b.max_days > 0:
        r["meets_days"] = r["time_s"] <= b.max_days * DAY * (1 + 1e-9)
    return r


def costs(t: Target, method: str, bmu: Any, nmu: Any, n_b: Any, n_l: Any, n_a: Any, off: Any) -> dict:
    m = t.model
    tr = ga.transfers(m, method, bmu, nmu, n_b, n_l, n_a, off, t.links)
    ov = ga.overheads_of(m, method, nmu, n_l, tr)
    mem = ga.memory_parts(m, method in PARTITIONED, bmu * nmu * n_b, bmu, n_b * n_l * n_a, n_l, n_a)
    return {
        "transfers": tr,
        "ratios": ga.ratios(tr),
        "overheads": ov,
        "efficiency": ga.efficiency_of(ov),
        "memory": mem,
    }


def violations(t: Target, b: Bounds, method: str, c: dict[str, Any], r: dict[str, Any]) -> dict[str, Any]:
    """Each constraint of §5 (module doc), True where a candidate breaks it."""
    links, m = t.links, t.model
    tr, rat, mem = r["transfers"], r["ratios"], r["memory"]
    n_b = np.maximum(r["n_b"], 1)
    cap = b.max_overhead
    off = c["offload"]
    eps = 1e-9

    def over(k: str) -> Any:  # an overlapped transfer that is data-bound, or an exposed one above the cap
        return tr[k]["active"] & np.where(tr[k]["overlapped"], rat[k] > 1 + eps, rat[k] > cap + eps)

    budget, host = links.device_memory_gib * GiB, links.host_per_gpu(n_b * c["n_l"] * c["n_a"])
    fits = np.where(
        off,
        (mem["non_offloadable"] <= budget) & (mem["offloadable"] <= host),
        mem["offloadable"] + mem["non_offloadable"] <= budget,
    )
    B = math.floor(t.b_c + 1e-9)
    v = {
        "critical batch": c["b_mu"] * c["n_mu"] * n_b > B,
        "max_gpus": (n_b * c["n_l"] * c["n_a"] > b.max_gpus) if b.max_gpus else np.zeros_like(off),
        "memory": ~fits,
        "reduction": over("data"),
        "pipeline link": over("pipeline")
        | ((method == GA_BASELINE) & tr["pipeline"]["active"] & ~tr["pipeline"]["overlapped"]),
        "bubble": (c["n_l"] > 1) & (c["n_mu"] < c["n_l"]),
        "tensor link": over("tensor"),
        "offload link": over("offload"),
        "pcie": over("pcie"),
        "depth": c["n_l"] > m.d_l,
        "heads": (c["n_a"] > m.d_a) if b.heads or b.whole else np.zeros_like(off),
    }
    return v


def pick(r: dict[str, Any], c: dict[str, np.ndarray], b: Bounds, method: str, mix: str) -> int | None:
    ok = r["feasible"]
    if not ok.any():
        return None
    if method == GA_BASELINE and MIXES[mix][1]:
        # §5: "In the baseline, we select the highest possible pipeline parallelism". (The fastest is not
        # always the deepest: for X160 with data + pipe, n_l = 32 is ~9% faster than the paper's 160.)
        ok = ok & (c["n_l"] == c["n_l"][ok].max())
    if b.max_days > 0 and (ok & r["meets_days"]).any():
        ok = ok & r["meets_days"]
        first = "n_gpu"
    else:
        first = "time"
    idx = np.flatnonzero(ok)
    time = r["time_s"][idx]
    tq = np.round(time / time.min(), 9)
    n_gpu = (r["n_b"] * c["n_l"] * c["n_a"])[idx]
    mem = (r["memory"]["offloadable"] + r["memory"]["non_offloadable"])[idx]
    # ties: no offload, the smallest micro-batch (§5), the larger batch (the paper trains "at or slightly
    # below the critical batch size"; on one device the time does not depend on it), less memory
    b = -(c["b_mu"] * c["n_mu"] * r["n_b"])[idx]
    tail = (mem, b, c["b_mu"][idx], c["offload"][idx])
    keys = (*tail, tq, n_gpu) if first == "n_gpu" else (*tail, n_gpu, tq)
    return int(idx[np.lexsort(keys)[0]])
