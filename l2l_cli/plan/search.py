"""Layered-GA §5 "Optimal configuration" as a search: the fastest configuration that fits, per method and
parallelism mix, from the same formulas that cost one typed configuration (``plan/scaling.py``).

For each method (baseline | partitioned | improved) and mix (none | data | data+pipe | data+tensor | 3d) we
enumerate the micro-batch b_mu, the micro-batch count n_mu, the pipeline and tensor degrees n_l and n_a and
offload, derive the data-parallel degree n_b, cost every candidate at once (numpy arrays through
:func:`scaling.transfers` and :func:`scaling.memory_parts`) and keep the best feasible one:

- b = b_mu·n_mu·n_b <= the critical batch b_c (appendix B, eq. 2); the work is fixed at ``steps`` steps of b_c
  samples, so a smaller batch takes proportionally more steps and the time is work / (n_gpu·peak·efficiency);
- transfers that overlap the compute must not be data-bound ("the smallest micro-batch size that does not
  cause a communication bottleneck"): the reduction (eqs. 5, 7, 9), the CPU-GPU link (eqs. 13-14) and,
  with offload, the PCIe link they share with the network; exposed ones cost ν_net/ν each, at most
  ``max_overhead`` (the paper's 25%): the pipelined baseline's reduction (eq. 6), tensor parallelism
  (eq. 12), the modular pipeline's transfers when not overlapped (eq. 11);
- a pipeline needs n_mu >= n_l; the baseline's also enough extra micro-batches to overlap its transfers
  (§5, C.4.2); the partitioned method runs without a pipeline (§5: it "leads to worse results");
- memory (C.3) fits the device, or with offload its non-offloadable part does and the rest fits the host;
- n_gpu <= ``max_gpus``; with ``max_days`` the objective becomes the fewest GPUs that train within it
  (Table 6.3's question), else the shortest time (Table 6.1's); ties: fewer GPUs, no offload, less memory.

Why the candidate set is small enough: n_b never needs enumerating (the intensities depend on b/n_b only, so
the most data parallelism the batch allows is the fastest, or the fewest that meet the time target), and
without a GPU cap the fastest n_l and n_a are the largest each constraint allows (throughput n_l/(1+bubble)
and n_a/(1+tensor overhead) grow with them on the feasible range), so ``prune`` keeps only those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from l2l_cli.plan import scaling as ga
from l2l_cli.plan.scaling import (
    GA_BASELINE,
    GA_IMPROVED,
    GA_NO_PARTITION,
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
_PARTS = {"checkpoint": "checkpoints"}  # the row's name -> scaling.memory_parts' name


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


def _tensor_limit(t: Target, b: Bounds) -> int:
    """The largest n_a to consider: the head count, or without that bound (``Bounds.heads``) the largest
    the tensor cap allows on the fastest link it may use (eq. 12: n_a - 1 <= cap·ν_a·(n_a - 1) / ν_net)."""
    m = t.model
    if b.heads or b.whole:
        return m.d_a
    links = t.links
    gbps = links.tensor_gbps if links.tensor_gbps > 0 else links.network_gbps  # (beyond a node: slower)
    per = (4 + 2 * m.n_I) * m.d_m / 3.0  # ν_a·(n_a - 1)
    return max(m.d_a, 1 + math.floor(b.max_overhead * per / links.threshold(gbps) + 1e-9))


def _candidates(t: Target, b: Bounds, method: str, mix: str, prune: bool) -> dict[str, np.ndarray]:
    m, links = t.model, t.links
    _, pipe, tensor = MIXES[mix]
    B = math.floor(t.b_c + 1e-9)
    budget = links.device_memory_gib * GiB
    n_a_set = _allowed(_tensor_limit(t, b), b.whole) if tensor else np.array([1])
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


def _evaluate(t: Target, b: Bounds, method: str, mix: str, c: dict[str, np.ndarray]) -> dict[str, Any]:
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
        eff0 = _costs(t, method, bmu, nmu, np.maximum(n_b_max, 1), n_l, n_a, off)["efficiency"]
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
    r = _costs(t, method, bmu, nmu, np.maximum(n_b, 1), n_l, n_a, off)
    r["n_b"] = n_b
    r["time_s"] = ga.train_seconds(total, np.maximum(n_b, 1) * la, links.rate, r["efficiency"])
    r["violations"] = _violations(t, b, method, c, r)
    r["feasible"] = (n_b >= 1) & ~np.any(np.stack(list(r["violations"].values())), axis=0)
    if b.max_days > 0:
        r["meets_days"] = r["time_s"] <= b.max_days * DAY * (1 + 1e-9)
    return r


def _costs(t: Target, method: str, bmu: Any, nmu: Any, n_b: Any, n_l: Any, n_a: Any, off: Any) -> dict:
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


def _violations(t: Target, b: Bounds, method: str, c: dict[str, Any], r: dict[str, Any]) -> dict[str, Any]:
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


def _pick(r: dict[str, Any], c: dict[str, np.ndarray], b: Bounds, method: str, mix: str) -> int | None:
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


@dataclass
class Found:
    """One chosen configuration, with what the search knows about it."""

    mix: str
    method: str
    config: ga.Parallel
    efficiency: float
    time_s: float
    memory_bytes: dict[str, float]
    overheads: dict[str, float]
    binding: list[str]
    meets_days: bool | None = None
    over_memory: bool = False  # chosen without the device-memory bound, as nothing fits (figures only)

    def row(self) -> dict[str, Any]:
        """The ``--json`` row: exactly the issue's fields (memory in the paper's GB, i.e. GiB)."""
        c = self.config
        return {
            "parallelism": self.mix,
            "method": self.method,
            "offload": c.offload,
            "b": c.b,
            "b_mu": c.b_mu,
            "n_mu": c.n_mu,
            "n_gpu": c.n_gpu,
            "n_b": c.n_b,
            "n_l": c.n_l,
            "n_a": c.n_a,
            "efficiency": self.efficiency,
            "days": self.time_s / DAY,
            "memory": {k: self.memory_bytes[_PARTS.get(k, k)] / GiB for k in MEMORY_KEYS},
            "binding": "; ".join(self.binding),
            "command": None,
        }


def search_one(t: Target, b: Bounds, method: str, mix: str, prune: bool | None = None) -> Found | str:
    """The best configuration of one method and mix, or why there is none."""
    if (mix, method) not in PAIRS and (mix, GA_IMPROVED if method == GA_NO_PARTITION else "") not in PAIRS:
        return f"{method} with {mix}: not considered (§5: the partitioned method runs without a pipeline)"
    if prune is None:  # exact without a GPU cap or time target (module doc)
        prune = not b.max_gpus and not b.max_days
    c = _candidates(t, b, method, mix, prune)
    if math.floor(t.b_c + 1e-9) < 1:
        return f"{method} with {mix}: no candidate (the critical batch {t.b_c:.4g} is below one sample)"
    if c["b_mu"].size == 0:
        pins = ", ".join(
            f"{k} = {v}" for k, v in (("n_l", b.n_l), ("n_a", b.n_a), ("max_gpus", b.max_gpus)) if v
        )
        why = f"the bounds ({pins}) leave" if pins else "the critical batch and the links leave"
        return f"{method} with {mix}: no candidate ({why} none)"
    r = _evaluate(t, b, method, mix, c)
    i = _pick(r, c, b, method, mix)
    if i is None:
        counts = {k: int(v.sum()) for k, v in r["violations"].items()}
        worst = sorted((k for k in counts if counts[k]), key=lambda k: -counts[k])[:3]
        return f"{method} with {mix}: nothing fits ({', '.join(worst)} rule out every candidate)"
    n_b = int(r["n_b"][i])
    cfg = ga.Parallel(
        method,
        int(c["b_mu"][i] * c["n_mu"][i] * n_b),
        int(c["b_mu"][i]),
        int(c["n_mu"][i]),
        n_b,
        int(c["n_l"][i]),
        int(c["n_a"][i]),
        bool(c["offload"][i]),
    )
    mem = {k: float(v[i]) for k, v in r["memory"].items()}
    ov = {
        k: float(v[i])
        for k, v in r["overheads"].items()
        if k == "bubble" or bool(r["transfers"][k]["active"][i])
    }
    found = Found(mix, method, cfg, float(r["efficiency"][i]), float(r["time_s"][i]), mem, ov, [])
    if b.max_days > 0:
        found.meets_days = bool(r["meets_days"][i])
    found.binding = binding(t, b, found)
    return found


def search(
    t: Target, b: Bounds, methods: tuple[str, ...] = METHODS, mixes: tuple[str, ...] = tuple(MIXES)
) -> tuple[list[Found], list[str]]:
    """Every considered (mix, method) of the selection, in Table 6.1's order: the rows, and why others
    have none."""
    rows, missing = [], []
    for mix, method in PAIRS:
        if mix in mixes and method in methods:
            f = search_one(t, b, method, mix)
            (rows if isinstance(f, Found) else missing).append(f)
    return rows, missing


def fastest(t: Target, b: Bounds, method: str, mixes: tuple[str, ...] = tuple(MIXES)) -> Found | None:
    """The fastest configuration of one method over the mixes (§7's "the fastest configuration for each")."""
    best = None
    for mix in mixes:
        f = search_one(t, b, method, mix)
        if isinstance(f, Found) and (
            best is None or (f.time_s, f.config.n_gpu) < (best.time_s, best.config.n_gpu)
        ):
            best = f
    return best


# --------------------------------------------------------------------------------------------------
# Why this configuration: the constraint each neighbour breaks


def _check(t: Target, b: Bounds, method: str, mix: str, cfg: ga.Parallel) -> list[str]:
    """The constraints one configuration breaks (the search's own rules, on one candidate)."""
    c = {k: np.array([getattr(cfg, k)]) for k in ("b_mu", "n_mu", "n_l", "n_a", "offload")}
    r = _costs(t, method, c["b_mu"], c["n_mu"], np.array([cfg.n_b]), c["n_l"], c["n_a"], c["offload"])
    r["n_b"] = np.array([cfg.n_b])
    return [k for k, v in _violations(t, b, method, c, r).items() if bool(v[0])]


def binding(t: Target, b: Bounds, f: Found) -> list[str]:
    """What stops each dimension from growing (or b_mu from shrinking): the constraint the next step
    breaks."""
    from dataclasses import replace

    c, m, mix = f.config, t.model, f.mix
    data, pipe, tensor = MIXES[mix]
    out: list[str] = []
    net = f"{t.links.network_gbps:g} GB/s"

    def why(alt: ga.Parallel) -> list[str]:
        return _check(t, b, f.method, mix, alt)

    if b.max_days > 0 and f.meets_days:
        out.append(f"max_days: the fewest GPUs that train in {b.max_days:g} days")
    elif b.max_days > 0:
        out.append(f"max_days: {b.max_days:g} days not reachable; the fastest takes {f.time_s / DAY:.3g}")
    if data and not (b.max_days > 0 and f.meets_days):
        nxt = replace(c, n_b=c.n_b + 1, b=c.b + c.b_mu * c.n_mu)
        w = why(nxt)
        if "critical batch" in w:
            out.append(f"critical batch: b = {c.b} of b_c = {t.b_c:.5g}")
        elif "max_gpus" in w:
            out.append(f"max_gpus: {c.n_gpu} GPUs of {b.max_gpus}")
    elif not data:
        out.append(f"no data parallelism: b = b_mu·n_mu = {c.b} of b_c = {t.b_c:.5g}")
    if c.b_mu > 1:
        w = why(replace(c, b_mu=c.b_mu - 1, b=(c.b_mu - 1) * c.n_mu * c.n_b))
        names = [k for k in w if k in ("reduction", "offload link", "pcie", "tensor link")]
        if names:
            eq = {
                "reduction": f"eq. {5 if c.n_l == 1 and f.method == GA_BASELINE else 7} at {net}",
                "offload link": f"eqs. 13-14 at {t.links.offload_gbps:g} GB/s",
                "pcie": f"network + offload on PCIe {t.links.pcie_gbps:g} GB/s",
            }
            out.append(f"{names[0]}: b_mu >= {c.b_mu} ({eq.get(names[0], '')})")
    elif f.method in MODULAR and data and c.n_mu > 1:
        w = why(replace(c, n_mu=c.n_mu - 1, b=c.b_mu * (c.n_mu - 1) * c.n_b))
        if "reduction" in w:
            out.append(f"reduction: b_mu·n_mu >= {c.b_mu * c.n_mu} (eq. 9 at {net})")
    if pipe:
        bigger = [k for k in range(c.n_l + 1, m.d_l + 1) if not b.whole or m.d_l % k == 0]
        if not bigger:
            out.append(f"depth: n_l = d_l = {m.d_l}")
        else:
            w = why(replace(c, n_l=bigger[0]))
            if "bubble" in w:
                out.append(f"bubble: n_l <= n_mu = {c.n_mu}")
            elif "pipeline link" in w:
                out.append(
                    f"pipeline link: n_mu = {c.n_mu} overlaps n_l <= {c.n_l} (eq. "
                    f"{11 if f.method in MODULAR else 10})"
                )
            elif f.overheads.get("bubble", 0) > 0 and not [x for x in w if x not in ("max_gpus", "memory")]:
                out.append(f"bubble: n_l = {c.n_l} balances the bubble against the pipeline's transfers")
    if tensor:
        bigger = [k for k in range(c.n_a + 1, _tensor_limit(t, b) + 2) if not b.whole or m.d_a % k == 0]
        if b.heads or b.whole:
            bigger = [k for k in bigger if k <= m.d_a]
        node = t.links.node_size
        if not bigger:
            out.append(f"heads: n_a = d_a = {m.d_a}")
        elif "tensor link" in why(replace(c, n_a=bigger[0])):
            over = node and bigger[0] > node >= c.n_a
            out.append(
                f"tensor link: n_a <= {c.n_a}"
                + (
                    f" (node size {node}; beyond it the network)"
                    if over
                    else f" (eq. 12, {b.max_overhead:.0%} cap)"
                )
            )
    if c.offload:
        w = why(replace(c, offload=False))
        if "memory" in w:
            tot = (f.memory_bytes["offloadable"] + f.memory_bytes["non_offloadable"]) / GiB
            out.append(f"memory: {tot:.3g} GB without offload > {t.links.device_memory_gib:g} GB")
    return out
