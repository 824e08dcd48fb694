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
from dataclasses import dataclass
from typing import Any

import numpy as np

from l2l_cli.plan import scaling as ga
from l2l_cli.plan.candidates import (
    DAY,
    MEMORY_KEYS,
    MIXES,
    PAIRS,
    Bounds,
    Target,
    candidates,
    costs,
    evaluate,
    pick,
    tensor_limit,
    violations,
)
from l2l_cli.plan.scaling import (
    GA_BASELINE,
    GA_IMPROVED,
    GA_NO_PARTITION,
    METHODS,
    MODULAR,
    GiB,
)

_PARTS = {"checkpoint": "checkpoints"}  # the row's name -> scaling.memory_parts' name


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
    c = candidates(t, b, method, mix, prune)
    if math.floor(t.b_c + 1e-9) < 1:
        return f"{method} with {mix}: no candidate (the critical batch {t.b_c:.4g} is below one sample)"
    if c["b_mu"].size == 0:
        pins = ", ".join(
            f"{k} = {v}" for k, v in (("n_l", b.n_l), ("n_a", b.n_a), ("max_gpus", b.max_gpus)) if v
        )
        why = f"the bounds ({pins}) leave" if pins else "the critical batch and the links leave"
        return f"{method} with {mix}: no candidate ({why} none)"
    r = evaluate(t, b, method, mix, c)
    i = pick(r, c, b, method, mix)
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


def _check(t: Target, b: Bounds, method: str, mix: str, cfg: ga.Parallel) -> list[str]:
    """The constraints one configuration breaks (the search's own rules, on one candidate)."""
    c = {k: np.array([getattr(cfg, k)]) for k in ("b_mu", "n_mu", "n_l", "n_a", "offload")}
    r = costs(t, method, c["b_mu"], c["n_mu"], np.array([cfg.n_b]), c["n_l"], c["n_a"], c["offload"])
    r["n_b"] = np.array([cfg.n_b])
    return [k for k, v in violations(t, b, method, c, r).items() if bool(v[0])]


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
        bigger = [k for k in range(c.n_a + 1, tensor_limit(t, b) + 2) if not b.whole or m.d_a % k == 0]
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
