"""``l2l plan --search`` / ``--scaling``: layered-GA §5's selection reproduces Tables 6.1-6.3 and §7's limits;
the search and the per-config model are one model; the command's JSON, figures and command lines."""

from __future__ import annotations

import csv
import json
import math
import shlex
import time
from dataclasses import replace

import numpy as np
import pytest

from l2l_cli.compose import compose
from l2l_cli.plan import candidates as C
from l2l_cli.plan import figures as F
from l2l_cli.plan import scaling as ga
from l2l_cli.plan import search as S
from l2l_cli.plan.cli import main
from l2l_cli.plan.hardware import GiB
from l2l_cli.preflight import preflight

X160 = C.Target(ga.x_family(160), ga.x_critical_batch_size(160))
MONTH = 365.25 / 12

# Table 6.1 (the paper, quoted): Parallelism, Method, Offload, b, b_mu, n_mu, n_gpu, n_b, n_l, n_a,
# Efficiency, Time;
# with Table 6.2's memory (GB): State, Checkpoint, Buffers, Activations, Offloadable, Non-offloadable.
#   None Baseline ✓2416 4 604 1 1 1 1 1.00 630 y          | 14.1 K 47.2 K 43.9 24.9 61.2 K 68.8
#   Data Baseline ✓2415 5 1 483 483 1 1 1.00 1.3 y        | 14.1 K 97.7 43.9 31.1 14.2 K 75.1
#   Data Partitioned ✓2415 5 1 483 483 1 1 1.00 1.3 y     | 29.1 97.7 43.9 31.1 127 75.1
#   Data + pipe Baseline ✓2412 4 201 480 3 160 1 0.56 2.4 y | 87.9 98.1 43.9 24.9 186 68.8
#   Data + pipe Improved ✗2415 1 5 2415 483 5 1 0.94 100 d | 5.82 19.5 43.9 6.23 25.4 50.2
#   Data + tensor Baseline ✓2415 5 1 7728 483 1 16 0.93 32 d | 879 6.10 2.75 1.95 885 4.69
#   Data + tensor Partitioned ✗2415 5 1 7728 483 1 16 0.93 32 d | 1.82 6.10 2.75 1.95 7.92 4.69
#   3d Baseline ✗2408 1 172 35840 14 160 16 0.48 13 d     | 5.49 1.31 2.75 0.389 6.81 3.14
#   3d Improved ✗2415 1 5 38640 483 5 16 0.88 6.8 d       | 0.364 1.22 2.75 0.389 1.58 3.14
# (mix, method, (offload, b, b_mu, n_mu, n_b, n_l, n_a), efficiency, days, memory)
TABLE_6_1 = [
    (
        "none",
        "baseline",
        (True, 2416, 4, 604, 1, 1, 1),
        1.00,
        630 * 365,
        (14.1e3, 47.2e3, 43.9, 24.9, 61.2e3, 68.8),
    ),
    (
        "data",
        "baseline",
        (True, 2415, 5, 1, 483, 1, 1),
        1.00,
        1.3 * 365,
        (14.1e3, 97.7, 43.9, 31.1, 14.2e3, 75.1),
    ),
    (
        "data",
        "partitioned",
        (True, 2415, 5, 1, 483, 1, 1),
        1.00,
        1.3 * 365,
        (29.1, 97.7, 43.9, 31.1, 127, 75.1),
    ),
    (
        "data+pipe",
        "baseline",
        (True, 2412, 4, 201, 3, 160, 1),
        0.56,
        2.4 * 365,
        (87.9, 98.1, 43.9, 24.9, 186, 68.8),
    ),
    (
        "data+pipe",
        "improved",
        (False, 2415, 1, 5, 483, 5, 1),
        0.94,
        100,
        (5.82, 19.5, 43.9, 6.23, 25.4, 50.2),
    ),
    ("data+tensor", "baseline", (True, 2415, 5, 1, 483, 1, 16), 0.93, 32, (879, 6.10, 2.75, 1.95, 885, 4.69)),
    (
        "data+tensor",
        "partitioned",
        (False, 2415, 5, 1, 483, 1, 16),
        0.93,
        32,
        (1.82, 6.10, 2.75, 1.95, 7.92, 4.69),
    ),
    ("3d", "baseline", (False, 2408, 1, 172, 14, 160, 16), 0.48, 13, (5.49, 1.31, 2.75, 0.389, 6.81, 3.14)),
    ("3d", "improved", (False, 2415, 1, 5, 483, 5, 16), 0.88, 6.8, (0.364, 1.22, 2.75, 0.389, 1.58, 3.14)),
]


def printed(ours: float, paper: float, digits: int = 3) -> bool:
    """``ours`` rounds to the paper's printed value (see tests/test_plan.py)."""
    import math

    unit = 10 ** (math.floor(math.log10(abs(paper))) - digits + 1)
    return abs(ours - paper) <= 0.52 * unit


def config(c: ga.Parallel) -> tuple:
    return (c.offload, c.b, c.b_mu, c.n_mu, c.n_b, c.n_l, c.n_a)


@pytest.mark.parametrize("row", TABLE_6_1, ids=lambda r: f"{r[0]}/{r[1]}")
def test_table_6_1_search_finds_the_papers_configuration(row: tuple) -> None:
    """Acceptance 1: every row within 0.05 efficiency and 15% time. The search picks the paper's exact
    configuration in all nine rows: the reduction (eqs. 5, 7, 9), the offload and PCIe links (eqs. 13-14,
    §5's shared PCIe) set b_mu or n_mu, the critical batch sets n_b, n_mu >= n_l the modular pipeline's
    depth. Two rows tie and take the tie-breaks: one device (None/Baseline) takes the same time at any b,
    and the paper's b = 2416 is the largest batch with the smallest micro-batch the offload link allows; the
    baseline's pipeline is the deepest (§5), though n_l = 32 would be ~9% faster for Data + pipe."""
    mix, method, cfg, eff, days, _ = row
    f = S.search_one(X160, C.Bounds(), method, mix)
    assert isinstance(f, S.Found), f
    assert config(f.config) == cfg
    assert abs(f.efficiency - eff) <= 0.05
    assert f.time_s / C.DAY == pytest.approx(days, rel=0.15)
    assert printed(f.efficiency, eff, digits=2)


@pytest.mark.parametrize("row", TABLE_6_1, ids=lambda r: f"{r[0]}/{r[1]}")
def test_table_6_2_memory_of_the_papers_configurations(row: tuple) -> None:
    _, method, (off, b, b_mu, n_mu, n_b, n_l, n_a), _, _, paper = row
    mem = ga.memory(ga.x_family(160), ga.Parallel(method, b, b_mu, n_mu, n_b, n_l, n_a, off))
    keys = ("state", "checkpoints", "buffers", "activations", "offloadable", "non_offloadable")
    for key, value in zip(keys, paper):
        assert printed(mem[key] / GiB, value), (key, mem[key] / GiB, value)


def test_table_6_1_binding_constraints_are_explained() -> None:
    rows = {(f.mix, f.method): " ; ".join(f.binding) for f in S.search(X160, C.Bounds())[0]}
    assert "critical batch" in rows[("3d", "improved")] and "reduction" in rows[("3d", "improved")]
    assert "bubble: n_l <= n_mu = 5" in rows[("3d", "improved")]
    assert "tensor link: n_a <= 16 (node size 16" in rows[("data+tensor", "partitioned")]
    assert "pcie: b_mu >= 5" in rows[("data", "baseline")] and "memory" in rows[("data", "baseline")]
    assert "offload link: b_mu >= 4" in rows[("none", "baseline")]
    assert "depth: n_l = d_l = 160" in rows[("3d", "baseline")]


def test_the_documented_x160_search_prints_table_6_1() -> None:
    """Issue 53, acceptance 1: the command docs/planner.md documents, run as a reader runs it (``l2l plan``
    in its own process, ``--json``), gives Table 6.1's nine configurations with the paper's efficiencies
    (±0.05) and times (±15%): the X family declares the paper's question (``models/papers.py``: 100,000
    steps at the critical batch, timed at peak × efficiency, offload with no host-memory bound), and the
    title names that budget."""
    import subprocess
    import sys

    argv = ["plan", "--search", "model=x", "model.x=160", "hardware=a100-80g", "--json"]
    run = subprocess.run([sys.executable, "-m", "l2l_cli", *argv], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    assert out["budget"] == "100,000 steps at the critical batch 2416 (layered-GA §6)"
    assert out["rate"].startswith("312 TFLOP/s = 100% of 312 peak (layered-GA §6")
    rows = {(r["parallelism"], r["method"]): r for r in out["search"]}
    for mix, method, cfg, eff, days, _ in TABLE_6_1:
        r = rows[(mix, method)]
        assert (r["offload"], r["b"], r["b_mu"], r["n_mu"], r["n_b"], r["n_l"], r["n_a"]) == cfg, (
            mix,
            method,
        )
        assert abs(r["efficiency"] - eff) <= 0.05, (mix, method, r["efficiency"])
        assert r["days"] == pytest.approx(days, rel=0.15), (mix, method, r["days"])


def test_a_budget_or_machine_the_command_line_gives_wins_over_the_papers(capsys) -> None:
    """For X[x], a budget on the command line (``batch.size``, ``plan.steps``, ``plan.tokens``) is the
    question and the title names it; ``hardware.mfu`` and ``hardware.host_memory_gb`` given replace the
    paper's efficiency and unbounded offload."""
    base = ["--search", "--json", "model=x", "model.x=160", "hardware=a100-80g"]

    def days(*extra: str) -> tuple[str, dict]:
        assert main([*base, *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        return out["budget"], {(r["parallelism"], r["method"]): r["days"] for r in out["search"]}

    label, paper = days()
    b_c = ga.x_critical_batch_size(160)
    label, small = days("batch.size=32")
    assert label == "100,000 steps of batch 32 (plan.train_steps)"
    assert small[("3d", "improved")] == pytest.approx(paper[("3d", "improved")] * 32 / b_c, rel=1e-9)
    label, _ = days("plan.steps=1000")
    assert label == "1,000 steps of batch 32 (plan.steps)"
    label, _ = days("plan.tokens=1e9")
    assert label == "1B tokens (plan.tokens)"
    _, half = days("hardware.mfu=0.5")
    assert half[("3d", "improved")] == pytest.approx(2 * paper[("3d", "improved")], rel=1e-9)
    _, bounded = days("hardware.host_memory_gb=1024")  # 64 GB a GPU: the offloading rows go
    assert ("none", "baseline") in paper and ("none", "baseline") not in bounded


# Table 6.3 (quoted): Parallelism, Method, b, n_a, n_gpu, Offloadable, Non-offloadable, Efficiency, Time
#   Data + tensor Partitioned 2415 16 7728 7.92 4.69 0.93 32 d
#   3d Baseline 2416 16 10240 10.1 3.14 0.73 31 d
#   3d Improved 2220 4 7400 7.76 12.5 0.97 32 d
#   Data + tensor Partitioned 1660 8 1328 35.0 9.38 0.97 180 d
#   Pipe + tensor Baseline 2416 8 1280 47.9 6.27 0.91 199 d
#   3d Improved 792 2 1320 22.4 25.1 0.97 180 d
#   Data + pipe Improved 1572 1 1310 34.2 50.2 0.98 180 d
#   3d Improved 102 16 1360 11.8 3.14 0.91 186 d
# (mix, method, target days, pinned n_a, paper n_gpu, paper efficiency)
TABLE_6_3 = [
    ("data+tensor", "partitioned", MONTH, 0, 7728, 0.93),  # a month is not reachable: the fastest, 32 d
    # the deepest pipeline moves in steps of 160 x 16 = 2560 GPUs: 4 instances take 30.6 d, a hair over a
    # month (30.4 d), and the paper prints this row at 31 d: its "one month" admits it, so we search at 31 d
    ("3d", "baseline", 31, 0, 10240, 0.73),
    ("3d", "improved", MONTH, 0, 7400, 0.97),  # ours: 7840 (n_a = 5; the paper's 7400 GPUs take 32 d)
    ("data+tensor", "partitioned", 6 * MONTH, 0, 1328, 0.97),  # ours n_a = 4: 1284 GPUs, 0.99
    # "Pipe + tensor" is 3d with n_b = 1: 160 x n_a GPUs, and n_a = 8 takes 199 d (the paper's time; at
    # 182.6 d the next step is n_a = 10, 1600 GPUs)
    ("3d", "baseline", 199, 0, 1280, 0.91),
    ("3d", "improved", 6 * MONTH, 0, 1320, 0.97),  # ours: n_l = 2, n_a = 2, 1276 GPUs, 0.99
    ("data+pipe", "improved", 6 * MONTH, 0, 1310, 0.98),  # with offload, as the paper's
    ("3d", "improved", 186, 16, 1360, 0.91),  # the paper's example of n_a = 16 at a small batch
]


@pytest.mark.parametrize("row", TABLE_6_3, ids=lambda r: f"{r[0]}/{r[1]}/{r[2]:.0f}d/{r[3]}")
def test_table_6_3_clusters_for_one_and_six_months(row: tuple) -> None:
    """Acceptance 2: the fewest GPUs that train X160 within the target: GPU count within 15%, efficiency
    within 0.05."""
    mix, method, days, n_a, n_gpu, eff = row
    f = S.search_one(X160, C.Bounds(max_days=days, n_a=n_a), method, mix)
    assert isinstance(f, S.Found), f
    assert f.config.n_gpu == pytest.approx(n_gpu, rel=0.15)
    assert abs(f.efficiency - eff) <= 0.05
    assert f.meets_days or f.time_s / C.DAY == pytest.approx(32.0, rel=0.01)  # only row 1 misses a month
    if mix == "data+pipe":
        assert f.config.offload and f.config.n_a == 1


def test_the_search_and_the_per_config_model_agree() -> None:
    """Acceptance 4: one model. Every candidate the search costs (a random sample of its arrays) gives the
    same efficiency, memory and time as ``scaling.analyze`` on that one configuration."""
    rng = np.random.default_rng(0)
    b = C.Bounds()
    for method, mix in (
        ("baseline", "3d"),
        ("partitioned", "data+tensor"),
        ("improved", "3d"),
        ("baseline", "data"),
    ):
        c = C.candidates(X160, b, method, mix, prune=False)
        r = C.evaluate(X160, b, method, mix, c)
        for i in rng.choice(c["b_mu"].size, 40, replace=False):
            n_b = int(max(r["n_b"][i], 1))
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
            a = ga.analyze(X160.model, cfg, X160.links, samples=b.steps * X160.b_c)
            assert a["efficiency"] == pytest.approx(float(r["efficiency"][i]), rel=1e-12)
            assert a["train_time_s"] == pytest.approx(float(r["time_s"][i]), rel=1e-12)
            for k in ("state", "checkpoints", "buffers", "activations"):
                assert a["memory_bytes"][k] == pytest.approx(float(r["memory"][k][i]), rel=1e-12)


@pytest.mark.slow
def test_pruning_is_exact_without_a_gpu_cap() -> None:
    """The sweep keeps only the largest n_l and n_a each constraint allows (module doc): same answer as the
    whole grid, for sizes around the interesting range."""
    for x in (64, 160, 300):
        t = C.Target(ga.x_family(x), ga.x_critical_batch_size(x))
        for mix, method in C.PAIRS:
            a = S.search_one(t, C.Bounds(whole=False), method, mix, prune=True)
            b = S.search_one(t, C.Bounds(whole=False), method, mix, prune=False)
            if isinstance(a, str):
                assert isinstance(b, str)
                continue
            assert a.time_s == pytest.approx(b.time_s, rel=1e-9), (x, mix, method, a.config, b.config)


def test_the_config_view_uses_the_same_formulas() -> None:
    """``l2l plan``'s per-config layered-GA view (``for_config``) is ``analyze`` of the same numbers, at the
    rate of the config's precision where the command line names ``hardware.mfu`` (fp32 here: the preset's
    TF32 78 TFLOP/s, 25% of the 312 peak), else, for X[x], at the paper's (peak × efficiency)."""
    from l2l_cli.plan.budget import command_keys
    from l2l_cli.plan.planner import make_plan

    args = [
        "model=x",
        "model.x=16",
        "hardware=a100-80g",
        "batch.size=8",
        "batch.ubatch_size=2",
        "plan.data_parallel=4",
        "plan.pipeline_parallel=2",
        "plan.tensor_parallel=2",
    ]
    assert make_plan(compose(args), given=command_keys(args))["layered_ga"]["mfu"] == 1.0
    args.append("hardware.mfu=0.5")
    ga_view = make_plan(compose(args), given=command_keys(args))["layered_ga"]
    assert ga_view["mfu"] == pytest.approx(78 / 312)
    m = ga.x_family(16)
    for row in ga_view["methods"]:
        c = ga.Parallel(row["method"], 32, 2, 4, 4, 2, 2)
        a = ga.analyze(m, c, ga.Links(mfu=78 / 312), 100_000)
        assert row["efficiency"] == pytest.approx(a["efficiency"], rel=1e-12)
        assert row["train_time_s"] == pytest.approx(a["train_time_s"], rel=1e-12)


# --------------------------------------------------------------------------------------------------
# §7 limits and Figures 4, 5, 8


@pytest.fixture(scope="module")
def figure4() -> list:
    return F.sweep(ga.Links(), F.sizes(36))


def test_section_7_limits(figure4: list) -> None:
    """Acceptance 3, §7 (improved method, Figure 4): "80 GB is enough to train models up to 280 trillion
    parameters, with offloading being required above 90 trillion ... one month, and ... one year ... limits
    of about 4.5 and 50 trillion parameters". Ours: 4.57T and 37.7T for the time limits (within 25%), and
    202T / 65T for the memory ones (28% below; see the xfail below for why)."""
    lim = F.limits(figure4, ga.Links())
    assert lim["one_month_params"] == pytest.approx(4.5e12, rel=0.25)
    assert lim["one_year_params"] == pytest.approx(50e12, rel=0.25)
    assert lim["fits_80gb_params"] == pytest.approx(202e12, rel=0.05)
    assert lim["offload_above_params"] == pytest.approx(65e12, rel=0.05)
    assert lim["offload_above_params"] < lim["fits_80gb_params"]


def test_section_7_memory_limits_are_set_by_the_tensor_cap_over_infiniband() -> None:
    """Why the memory limits miss (the xfail below). Near 1e14 parameters the non-offloadable memory is the
    two parameter buffers and the gradient buffer, 6·p_l/n_a = 72·x⁴/n_a bytes (C.3), and n_a beyond the
    16-GPU node runs over InfiniBand, where eq. 12's overhead ν_net/ν_a = 5.81k·(n_a - 1)/(4·x²) must stay
    within ε = 25%: n_a - 1 <= ε·x²/5.81k, so the buffers are ~72·5.81k·x²/ε and the largest x that fits
    grows as ε^(1/2), p = 12·x⁵ as ε^(5/2). A 10% looser ε is +27% in p, the whole gap.

    The paper's own sentences put its ε over InfiniBand there, not at 25%. §5: "We impose a maximum
    overhead of 25%, which for large models (above ∼50 billion parameters) allows the practical limit
    n_a = 16" holds at 25% over NVLink (484·15/(4·x²) <= 0.25 from x = 86: 56B). But "At extreme scales
    (25 trillion parameters) it becomes possible to efficiently use tensor parallelism over InfiniBand
    with n_a > 16": at 25T (x = 291) n_a = 17 costs 5811·16/(4·291²) = 27.4%; at 25% it is allowed only
    from x = 305 (31T). With ε = 27-28% our search gives the paper's 280T and 90T; no rule of the paper
    that we found (per-term vs combined caps, GB vs GiB, the node's NVLink kept, the PCIe link's 63 GB/s
    for the network's 50: 360T) yields that ε, so we keep 25% as the paper states it, and check the
    sensitivity here. (The head count does not bind: n_a ~ x²/5810 over InfiniBand is 34 at x = 442,
    against 221 heads. The one-year limit does not move with this cap: 37.7T at 25% and at 28%.)"""
    x, nvlink, ib = 291, ga.Links().threshold(600.0), ga.Links().threshold(50.0)
    assert nvlink * 15 / (4 * 86**2) <= 0.25 < nvlink * 15 / (4 * 85**2)  # the 50B sentence, at 25%
    assert ga.x_params(86) == pytest.approx(50e9, rel=0.15)
    assert ib * 16 / (4 * x**2) == pytest.approx(0.274, abs=0.001)  # the 25T sentence: 27.4%
    assert ga.x_params(x) == pytest.approx(25e12, rel=0.03)
    xs = F.sizes(36)
    for cap, fits, offload in ((0.25, 202e12, 65e12), (0.28, 280e12, 90e12)):
        b = C.Bounds(whole=False, max_overhead=cap)
        lim = F.limits(F.sweep(ga.Links(), xs, b), ga.Links(), b)
        assert lim["fits_80gb_params"] == pytest.approx(fits, rel=0.1), cap
        assert lim["offload_above_params"] == pytest.approx(offload, rel=0.1), cap


def test_section_7_memory_statements_all_put_the_infiniband_tensor_cap_near_28_percent() -> None:
    """The readings of §7's memory limits tried beside the tensor cap (the test above), and the paper's other
    memory statements, which all point the same way:

    - "limits of about 4.5 and 50 trillion parameters, with total memory usages of 13 and 62 GB": at 4.5T
      (n_a = 16 in the node, no cap question) ours is 12.8-13.3 GB, the paper's 13. At 50T (X334) ours is
      70.2 GB with n_a = 20, the most the 25% cap allows over InfiniBand; the paper's 62 GB needs n_a = 22-23
      there, an overhead of 27.3-28.7% (eq. 12 at 5.81k flop/B) - as the 25T sentence (27.4%) and 280T / 90T
      (28%) do.
    - The curve's crossing vs the largest size that fits: with integer n_a the memory is a sawtooth (each
      step of n_a = 1 + floor(ε·4x²/ν_net) drops it ~3%), so X446 (212T) fits while X444 (202T is X442)
      and X448 do not. "80 GB is enough to train models up to" is every size below, 202T; the last tooth
      would be 212T, just inside 25% of 280T, but offload is still needed from X354 (66.7T) on, 26% below
      90T, and no size above fits without it.
    - Non-offloadable memory is buffers + layer activations, as Table 6.2's column (1.58 + 3.14 GB for
      X160's 3d improved row, checked in test_table_6_2...); checkpoints are offloadable (C.3).
    - What else could lower the memory near 1e14 does not: n_a is the only divisor of the buffers
      (6·p_l/n_a), b_mu = 1 already, the head count (x/2 = 221) is far above n_a ~ 34, and GB for GiB or
      the combined overheads under one cap only make the cap stricter."""
    lk = ga.Links()

    def best(x: int, **kw) -> S.Found | None:
        t = C.Target(ga.x_family(x), ga.x_critical_batch_size(x), lk)
        return S.fastest(t, replace(F.PAPER, **kw), "improved")

    def total(f: S.Found) -> float:
        return (f.memory_bytes["offloadable"] + f.memory_bytes["non_offloadable"]) / GiB

    assert [round(total(best(x)), 1) for x in (206, 208)] == [12.8, 13.3]
    assert ga.x_params(206) < 4.5e12 < ga.x_params(208)
    x = 334  # 50T
    assert ga.x_params(x) == pytest.approx(50e12, rel=0.01)
    f = best(x)
    assert f.config.n_a == 20 and total(f) == pytest.approx(70.2, abs=0.1)
    for n_a, gb in ((22, 63.8), (23, 61.0)):
        mem = ga.memory(ga.x_family(x), replace(f.config, n_a=n_a))
        assert (mem["offloadable"] + mem["non_offloadable"]) / GiB == pytest.approx(gb, abs=0.1)
    assert [round(lk.threshold(50.0) * (n - 1) / (4 * x * x), 3) for n in (20, 21, 22, 23)] == [
        0.247,
        0.260,
        0.273,
        0.287,
    ]
    # the sawtooth
    assert [best(x) is not None for x in (442, 444, 446, 448)] == [True, False, True, False]
    assert (best(446).config.n_a, best(442).config.n_a) == (35, 34)
    assert best(352, offload=False) is not None and best(354, offload=False) is None
    assert all(best(x, offload=False) is None for x in range(356, 392, 4))
    assert 0.75 * 280e12 <= ga.x_params(446) < 0.76 * 280e12  # just inside 25%
    assert ga.x_params(352) < ga.x_params(354) < 0.75 * 90e12


def test_section_7_time_statements_hold_only_if_the_tensor_overhead_is_not_charged(monkeypatch) -> None:
    """A pattern in the paper's time statements, and why it is not a reading we may adopt. Where n_a sits at
    the tensor cap, our times are ~1.4x the paper's: one year at 37.7T (paper ~50T), X474 (287T) in 5.7
    years ("would take up to four years"), Figure 5's 32T / 721T (paper 40T / 900T). Leaving the tensor
    overhead out of the training time (eq. 12 still caps n_a) brings Figure 5 to 42T / 954T and Figure 4's
    year to 43T; with a 28% cap as well, all four of §7's numbers come out (275T, 85.5T, 4.74T, 49.4T). But
    §5 counts "the measurable overheads from the pipeline bubble and non-overlapped data transfers" (eq. 12's
    are never overlapped), and Table 6.1 prints them: data + tensor 0.93 = 1/(1 + 7.1%), 3d improved 0.88;
    without it they would be 1.00 and 0.94, off by more than acceptance 1's 0.05. So the paper's text and
    Table 6.1 do not give §7's numbers, and we keep the stated model."""
    # the other tests' grids (F.sizes(36) and F.sizes(14, 1e12, 1e16)) around the limits: the same numbers
    base4 = [x for x in F.sizes(36) if 1e12 <= ga.x_params(x) <= 1e15]
    base5 = [x for x in F.sizes(14, 1e12, 1e16) if 1e13 <= ga.x_params(x) <= 3e15]
    fig5 = ga.Links(node_size=0)
    t = C.Target(ga.x_family(474), ga.x_critical_batch_size(474))
    over = S.fastest(replace(t, links=replace(t.links, device_memory_gib=1e12)), F.PAPER, "improved")
    assert over.time_s / C.DAY / 365.25 == pytest.approx(5.69, abs=0.01)
    assert ga.x_params(474) == pytest.approx(280e12, rel=0.03)

    def lim(links: ga.Links, xs: list[int], cap: float = 0.25) -> dict:
        b = replace(F.PAPER, max_overhead=cap)
        return {k: v / 1e12 for k, v in F.limits(F.sweep(links, xs, b), links, b).items()}

    assert lim(ga.Links(), base4)["one_year_params"] == pytest.approx(37.6, abs=0.3)
    assert lim(fig5, base5)["one_month_params"] == pytest.approx(31.9, abs=0.3)
    orig = ga.overheads_of

    def uncharged(m, method, n_mu, n_l, tr):  # the tensor overhead left out of the time, not the cap
        return {**orig(m, method, n_mu, n_l, tr), "tensor": np.zeros(np.shape(tr["tensor"]["value"]))}

    monkeypatch.setattr(ga, "overheads_of", uncharged)
    l5, l4, l4c = lim(fig5, base5), lim(ga.Links(), base4), lim(ga.Links(), base4, 0.28)
    assert (l5["one_month_params"], l5["one_year_params"]) == pytest.approx((42.2, 954), rel=0.01)
    assert l4["one_year_params"] == pytest.approx(43.4, rel=0.01)
    assert (l4["fits_80gb_params"], l4["offload_above_params"]) == pytest.approx((202, 64.8), rel=0.01)
    assert [
        l4c[k] for k in ("fits_80gb_params", "offload_above_params", "one_month_params", "one_year_params")
    ] == pytest.approx([275, 85.5, 4.74, 49.4], rel=0.01)
    effs = {
        mix: S.search_one(X160, C.Bounds(), m, mix).efficiency
        for mix, m in (("data+tensor", "partitioned"), ("3d", "improved"))
    }
    assert effs == pytest.approx({"data+tensor": 1.0, "3d": 0.94}, abs=0.005)


@pytest.mark.xfail(
    strict=True,
    reason="§7's 280T / 90T need a ~28% tensor cap over InfiniBand; the paper states 25% (see the tests "
    "above)",
)
def test_section_7_memory_limits_within_25_percent(figure4: list) -> None:
    """Acceptance 3's memory half. Not met, and we find no reading of the paper that meets it: the three
    tests above show the limits are set by eq. 12's cap on tensor parallelism over InfiniBand (p grows as
    the cap^2.5), that all four of the paper's memory statements (25T, 50T's 62 GB, 90T, 280T) put that cap
    at 27-29% where §5 states 25%, and that the other readings (largest size that fits vs the crossing,
    what the non-offloadable memory holds, GB vs GiB, combined caps, the time-side pattern) do not close
    the gap while keeping Table 6.1."""
    lim = F.limits(figure4, ga.Links())
    assert lim["fits_80gb_params"] == pytest.approx(280e12, rel=0.25)
    assert lim["offload_above_params"] == pytest.approx(90e12, rel=0.25)


def test_figure_8_ethernet_slowdown_for_x160() -> None:
    """§8.3: "We assume the nodes are equipped with a 400 Gb/s Ethernet connection, which amounts to 25 Gb/s
    per GPU ... For the trillion-parameter model, this slows down training by about 4%". Ours: +41%. Table
    A.1 gives Ethernet (25 Gb/s) 6.25 GB/s in + out, ν_net = 46.5k flop/B (8x InfiniBand's 5.81k; appendix
    A's footnote 10: the ring's use of the whole node's Ethernet is ignored "for simplicity"), and we keep
    the node's NVLink for n_a = 16. The improved reduction (eq. 9, ν = b·d_s/(2·n_b) >= 46.5k) then needs
    b/n_b >= 37 samples, so n_b <= 65 instead of 483; the modular pipeline can only make up
    n_l <= n_mu/(1 + ν_net/ν_l) = 37/1.30 = 28 of it (eq. 11, C.4.2), with a 13% bubble."""
    slow = F.ethernet_slowdown(ga.Links(), 50.0, 6.25)
    assert slow == pytest.approx(0.407, abs=0.01)
    eth = S.fastest(
        replace(X160, links=replace(X160.links, network_gbps=6.25)), C.Bounds(whole=False), "improved"
    )
    assert (eth.config.n_b, eth.config.n_mu) == (65, 37)


def test_figure_8_no_configuration_is_within_4_percent() -> None:
    """Why "about 4%" is out of reach under the paper's own equations (the xfail below): even with the
    modular pipeline's transfers free (no eq. 11 cost, any n_l <= n_mu), every X160 configuration over
    Ethernet that keeps the reduction (eq. 9) compute-bound is >= 15% slower than the InfiniBand optimum.
    Time is the fixed work over n_gpu·peak·efficiency; n_b·n_mu <= b_c forces n_mu >= 37 with n_b <= 65, and
    n_l up to n_mu = 37 brings the bubble (n_l - 1)·n_l/(n_mu·d_l) to 22.5% (§4). The slowdown in Figure 8
    at 1T parameters cannot be read from the extracted text; "about 4%" may be a misprint of ~40%, which
    is ours. The other readings (no partition, partial overlap, 1e12, other methods): the next test."""
    m, links = X160.model, replace(X160.links, network_gbps=6.25)
    best = 0.0
    for n_b in range(1, 484):
        n_mu = math.floor(X160.b_c) // n_b
        n_l = np.arange(1, min(n_mu, m.d_l) + 1)
        tr = ga.transfers(m, "improved", 1, n_mu, n_b, n_l, 16, False, links)
        if tr["data"]["threshold"] > tr["data"]["value"]:
            continue  # the reduction is data-bound
        ov = ga.overheads_of(m, "improved", n_mu, n_l, tr)
        ov.pop("pipeline")  # free, as if overlapped at any n_l
        best = max(best, float(np.max(n_b * n_l * 16 * ga.efficiency_of(ov))))
    ib = S.search_one(X160, C.Bounds(), "improved", "3d")
    assert ib.config.n_gpu * ib.efficiency / best - 1 == pytest.approx(0.156, abs=0.005)
    # Nor does the other reading of "slows down": Table 6.1's InfiniBand configuration kept as it is over
    # Ethernet (n_b = 483, b/n_b = 5: eq. 9's ν = 5·2560/2 = 6400 flop/B against 46.5k) is 9x slower
    same = ga.analyze(X160.model, ib.config, links)["train_time_s"]
    assert same / ga.analyze(X160.model, ib.config, ga.Links())["train_time_s"] == pytest.approx(
        9.12, abs=0.01
    )


def _x160_best_over(links: ga.Links, eq: int, pipe: str) -> tuple[float, tuple[int, int, int]]:
    """The largest n_gpu·efficiency of X160's improved 3d configurations (n_a = 16 on NVLink, b_mu = 1: a
    larger b_mu only lowers n_mu for the same b/n_b, and the bubble with it) whose reduction is compute-bound,
    over every (n_mu, n_l <= n_mu) with n_b = floor(b_c / n_mu). ``eq``: 9 (partitioned state, ν =
    b·d_s/(2·n_b)) or 8 (no partition, ν = 3·b·d_s/(4·n_b), 1.5x eq. 9). ``pipe``: the modular pipeline's
    transfers (eq. 11) by the search's rule ("ours": free when n_mu >= n_l·(1 + ν_net/ν_l), C.4.2, else
    exposed), exposed in proportion to the micro-batches missing ("partial": max(0, n_l·(1 + ν_net/ν_l)/n_mu -
    1)), or "free"."""
    m, B = X160.model, math.floor(X160.b_c)
    n_mu, n_l = np.meshgrid(np.arange(1, B + 1), np.arange(1, m.d_l + 1), indexing="ij")
    n_b = B // n_mu
    tr = ga.transfers(m, "improved", 1, n_mu, n_b, n_l, 16, False, links)
    nu_d = tr["data"]["value"] * (1.5 if eq == 8 else 1.0)
    ok = (n_l <= n_mu) & (nu_d >= tr["data"]["threshold"])
    r = np.where(n_l > 1, tr["pipeline"]["threshold"] / tr["pipeline"]["value"], 0.0)
    exposed = {
        "ours": np.where(tr["pipeline"]["overlapped"], 0.0, r),
        "partial": np.maximum(0.0, n_l * (1 + r) / n_mu - 1),
        "free": 0.0,
    }[pipe]
    tensor = tr["tensor"]["threshold"] / tr["tensor"]["value"]
    eff = 1.0 / ((1 + ga.bubble_of(m, "improved", n_mu, n_l)) * (1 + exposed) * (1 + tensor))
    thr = np.where(ok, n_b * n_l * 16 * eff, 0.0)
    i = np.unravel_index(int(np.argmax(thr)), thr.shape)
    return float(thr[i]), (int(n_b[i]), int(n_mu[i]), int(n_l[i]))


def test_figure_8_readings_tried() -> None:
    """The readings of §8.3 / Figure 8 tried beside the one above, none within "about 4%" (1-7%):

    - Figure 8's legend has a "No partition" line ("For the smallest models, the partition can be avoided
      to further reduce the training time at a minimal memory cost (dotted line)"): the improved method
      with eq. 8 (ν = 3·b·d_s/(4·n_b)) instead of eq. 9 needs b/n_b >= 25 instead of 37. Our search has no
      such method; by the same formulas it gives +35.1% (n_b = 96, n_mu = 25, n_l = 19, and its
      unpartitioned state fits 80 GB), and >= +8.8% even with the pipeline's transfers free.
    - C.4.2's "adding a small number of extra micro-batches, approximately given by ν_l/ν_net·n_mu" read
      as a partial exposure (the micro-batches missing, not all or nothing): +39.8%. The bubble is counted
      with the extra micro-batches (``bubble_of`` takes the n_mu searched), and b = n_b·n_mu >= n_b·n_l.
    - The best of all methods: over Ethernet the baseline takes 16.4 d and the partitioned 238 d, against
      9.58 d for the improved, so the improved line is the one to compare.
    - Reading the curve at 1e12 parameters (X152) instead of X160: +45%; the slowdown falls with size
      (+19% at 9.6T, +14% at 29T), so "little difference" holds for larger models, not at 1T.
    - Footnote 10 (a data-parallel ring gets the node's whole Ethernet) is ignored by the paper "for
      simplicity" and does not apply with n_a = 16 per node anyway. The per-GPU bandwidth at which X160
      slows by ~4% is ~30 GB/s in + out, 4.8x Table A.1's 6.25 GB/s for 25 Gb/s (25 GB/s gives 7.0%).
    So "about 4%" does not follow from the paper's equations under any of these readings."""
    eth = replace(X160.links, network_gbps=6.25)
    ib = S.search_one(X160, C.Bounds(), "improved", "3d")
    ib_thr = ib.config.n_gpu * ib.efficiency
    slow = {
        (eq, pipe): ib_thr / _x160_best_over(eth, eq, pipe)[0] - 1
        for eq in (9, 8)
        for pipe in ("ours", "partial", "free")
    }
    assert slow[9, "ours"] == pytest.approx(F.ethernet_slowdown(ga.Links(), 50.0, 6.25), abs=1e-9)
    assert slow[9, "free"] == pytest.approx(0.156, abs=0.005)
    assert slow[9, "partial"] == pytest.approx(0.398, abs=0.005)
    assert slow[8, "ours"] == pytest.approx(0.351, abs=0.005)
    assert slow[8, "free"] == pytest.approx(0.088, abs=0.005)
    assert min(slow.values()) > 0.07
    # the no-partition configuration fits without offload: state 12p/(n_l·n_a) and the rest (C.3)
    n_b, n_mu, n_l = _x160_best_over(eth, 8, "ours")[1]
    assert (n_b, n_mu, n_l) == (96, 25, 19)
    mem = ga.memory(X160.model, ga.Parallel("baseline", n_b * n_mu, 1, n_mu, n_b, n_l, 16))
    assert mem["offloadable"] + mem["non_offloadable"] < 80 * GiB
    # the other methods over Ethernet, and X152 (1e12 parameters)
    et = replace(X160, links=eth)
    days = {k: S.fastest(et, F.PAPER, k).time_s / C.DAY for k in ("baseline", "partitioned", "improved")}
    assert days["improved"] < days["baseline"] < days["partitioned"]
    t152 = C.Target(ga.x_family(152), ga.x_critical_batch_size(152))
    assert ga.x_params(152) == pytest.approx(1e12, rel=0.03)
    e152 = S.fastest(replace(t152, links=replace(t152.links, network_gbps=6.25)), F.PAPER, "improved")
    assert e152.time_s / S.fastest(t152, F.PAPER, "improved").time_s - 1 == pytest.approx(0.451, abs=0.005)
    assert F.ethernet_slowdown(ga.Links(), 50.0, 30.0) == pytest.approx(0.043, abs=0.003)
    assert F.ethernet_slowdown(ga.Links(), 50.0, 25.0) == pytest.approx(0.070, abs=0.003)


@pytest.mark.xfail(
    strict=True,
    reason="the paper's ~4% Ethernet slowdown is not reachable (>= 8.8% under any reading tried; ours 41%)",
)
def test_figure_8_about_four_percent() -> None:
    """Acceptance 3's Figure 8 half. Not met: test_figure_8_no_configuration_is_within_4_percent and
    test_figure_8_readings_tried show no reading of eqs. 8, 9, 11 and §4's bubble comes within 7%."""
    assert F.ethernet_slowdown(ga.Links(), 50.0, 6.25) == pytest.approx(0.04, abs=0.03)


def test_figure_4_sweep_is_fast() -> None:
    """Acceptance 5: >= 30 sizes × 3 methods × all their mixes well under 10 s (2 shared cores)."""
    xs = F.sizes(36)
    assert len(xs) >= 30
    t0 = time.perf_counter()
    rows = F.sweep(ga.Links(), xs)
    assert time.perf_counter() - t0 < 10
    assert len(rows) == 3 * len(xs)


@pytest.mark.slow
def test_scaling_writes_the_figures_csv_and_limits(capsys, tmp_path) -> None:
    """Acceptance 4: the three figures (PNG + SVG) and the CSV, with the limits in --json."""
    out = tmp_path / "scaling"
    assert (
        main(["--scaling", "--json", "hardware=a100-80g", "plan.scaling_points=12", "--out", str(out)]) == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert set(res["limits"]) == {
        "fits_80gb_params",
        "offload_above_params",
        "one_month_params",
        "one_year_params",
    }
    for name in ("figure4", "figure5", "figure8"):
        assert (out / f"{name}.png").stat().st_size > 20_000
        assert (out / f"{name}.svg").read_text().count("<path") > 50
    svg = (out / "figure4.svg").read_text()
    for label in ("One month", "One year", "80 GB", "1 TB (offload)", "3d Improved", "2d Partitioned"):
        assert label in svg
    with (out / "scaling.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["figure"] for r in rows} == {"figure4", "figure5", "figure8"}
    assert {r["method"] for r in rows} == {"baseline", "partitioned", "improved"}


# --------------------------------------------------------------------------------------------------
# The command


ROW_FIELDS = {
    "parallelism",
    "method",
    "offload",
    "b",
    "b_mu",
    "n_mu",
    "n_gpu",
    "n_b",
    "n_l",
    "n_a",
    "efficiency",
    "days",
    "memory",
    "binding",
    "command",
    "l2l_runs",
    "steps",
}
MEM_FIELDS = {"state", "checkpoint", "buffers", "activations", "offloadable", "non_offloadable"}


@pytest.mark.parametrize(
    "model", [["model=bert-large"], ["model=llama-7b", "task=lm"]], ids=["bert", "llama"]
)
def test_search_for_a_model_of_the_tool_answers_fast_with_a_runnable_command(
    capsys, model: list[str]
) -> None:
    """Acceptance 5: under 2 s with a command line that ``l2l train`` accepts. Timed after the model's
    shape is read once: importing the package (torch) is the command's start-up, not its answer
    (docs/benchmarks.md has the times)."""
    from l2l_cli.plan.choose import search_plan, target_for

    args = [*model, "hardware=a100-80g", "plan.max_gpus=8"]
    cfg = compose(args)
    target_for(cfg)
    t0 = time.perf_counter()
    out = search_plan(cfg, args)
    assert time.perf_counter() - t0 < 2.0
    assert out["search"] and all(
        set(r) == ROW_FIELDS and set(r["memory"]) == MEM_FIELDS for r in out["search"]
    )
    assert all(r["n_gpu"] <= 8 for r in out["search"])
    commands = [r["command"] for r in out["search"] if r["command"]]
    assert commands
    for cmd in commands:
        argv = shlex.split(cmd)
        assert (argv[:2] == ["l2l", "train"] and "dist.nproc=8" in argv) or "dist.nproc" not in cmd
        assert preflight(argv[2:], False, []) == [], cmd
    assert main(["--search", "--json", *args]) == 0
    assert json.loads(capsys.readouterr().out)["search"] == json.loads(json.dumps(out["search"]))


def test_search_restricts_to_a_mix_and_a_method(capsys) -> None:
    args = ["model=x", "model.x=160", "hardware=a100-80g", "plan.parallelism=3d", "plan.method=improved"]
    assert main(["--search", "--json", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    (row,) = out["search"]
    assert (row["parallelism"], row["method"], row["n_gpu"], row["n_l"], row["n_a"]) == (
        "3d",
        "improved",
        38640,
        5,
        16,
    )
    assert row["command"] is None and "tensor parallelism" in " ".join(out["notes"])
    assert main(["--search", "model=x", "model.x=160", "hardware=a100-80g"]) == 0
    text = capsys.readouterr().out
    assert "Table 6.1" in text and "Table 6.2" in text and "38640" in text


def test_search_bad_input_is_one_line_per_problem(capsys) -> None:
    assert main(["--search", "plan.parallelism=4d", "plan.network=wifi", "plan.max_gpus=-1"]) == 2
    err = capsys.readouterr().err
    assert "plan.parallelism: got '4d'; allowed: all, none, data, data+pipe, data+tensor, 3d" in err
    assert "plan.network" in err and "plan.max_gpus" in err and "Traceback" not in err
    assert main(["--search", "--scaling"]) == 2
    assert main(["--out", "x"]) == 2
    assert "--out applies to --scaling" in capsys.readouterr().err


def test_a_multi_node_row_runs_under_torchrun() -> None:
    from l2l_cli.plan.choose import command

    f = S.search_one(X160, C.Bounds(), "improved", "data+pipe")
    cmd, why = command(f, ["model=x", "model.x=160"], 16, 2560)
    assert cmd is None and "2415 ranks do not fill 151 nodes of 16" in why
    g = replace(f, config=replace(f.config, n_b=96, b=96 * 5))  # 480 ranks: 30 nodes
    cmd, _ = command(g, ["model=x", "model.x=160"], 16, 2560)
    assert cmd.startswith("torchrun --nnodes=30 --nproc-per-node=16 ") and "dist.nproc=480" in cmd
    assert (
        "dist.pipeline=5 dist.placement=modular dist.schedule=breadth_first dist.partition_state=true" in cmd
    )


def test_plan_takes_a_plan_recipe_and_refuses_a_training_sweep(capsys) -> None:
    """``l2l plan --scaling recipe=layered_ga_scaling`` composes the recipe (its machine and bounds); a
    training recipe's sweep is not one config."""
    cfg = compose(["recipe=layered_ga_scaling"])
    assert (cfg.hardware.name, cfg.plan.network, cfg.plan.max_overhead) == ("a100-80g", "infiniband", 0.25)
    assert (
        main(
            [
                "--search",
                "--json",
                "recipe=layered_ga_scaling",
                "model=x",
                "model.x=160",
                "plan.parallelism=3d",
                "plan.method=improved",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["search"][0]["n_gpu"] == 38640
    assert main(["recipe=l2l_v2_table2"]) == 2
    assert "a sweep of 4 jobs (run it with l2l train)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=llama-tiny"],
        ["model=llama-tiny", "model.num_kv_heads=1", "model.tie_word_embeddings=true"],
        ["model=llama-7b"],
        ["model=gpt2-tiny"],
        ["model=gpt2-tiny", "model.tie_word_embeddings=false", "model.intermediate_size=48"],
    ],
)
def test_decoder_closed_form_counts_equal_the_meta_count(overrides: list[str]) -> None:
    """``l2l plan`` counts a decoder built from ``model.*`` by its family's formula (no ``transformers``
    import: acceptance 5's < 2 s); it must be the meta-device count of the layers ``l2l train`` builds."""
    from l2l_cli.models import FAMILIES
    from l2l_cli.models.decoder import _param_counts

    m = compose([*overrides, "task=lm"]).model
    spec = FAMILIES[m.family].from_config(m, 2)
    assert spec.formula_counts() is not None
    assert spec.formula_counts() == _param_counts(spec)
    assert spec.param_counts() == _param_counts(spec)


@pytest.mark.parametrize(
    "model", [["model=bert-large"], ["model=llama-7b", "task=lm"]], ids=["bert-large", "llama-7b"]
)
def test_search_imports_neither_torch_nor_transformers(model: list[str]) -> None:
    """Acceptance 5: ``l2l plan --search`` answers in < 2 s for an encoder and a decoder, so it imports
    neither ``transformers`` nor ``torch`` (seconds each to import): the families' specs, the registries and
    the rules are read without them (the layers' modules load when a run builds them). The config is composed
    once (preflight's), and the answer holds a runnable ``l2l train`` command line."""
    import json
    import subprocess
    import sys

    code = (
        "import sys, io, contextlib, json\n"
        "from l2l_cli.cli import main\n"
        "import l2l_cli.compose as c\n"
        "calls = []\n"
        "orig = c.hydra_compose\n"
        "c.hydra_compose = lambda *a, **k: calls.append(1) or orig(*a, **k)\n"
        "out = io.StringIO()\n"
        "try:\n"
        "    with contextlib.redirect_stdout(out):\n"
        f"        main(['plan', '--search', '--json', *{model!r}, 'hardware=a100-80g', 'plan.max_gpus=8'])\n"
        "except SystemExit as e:\n"
        "    rc = e.code\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print(json.dumps([rc, heavy, len(calls), out.getvalue()]))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    rc, heavy, composed, answer = json.loads(run.stdout.splitlines()[-1])
    assert (rc, heavy, composed) == (0, [], 1), run.stderr
    commands = [r["command"] for r in json.loads(answer)["search"] if r.get("command")]
    assert commands and all(c.startswith("l2l train ") for c in commands)


def test_figure_5_without_the_node_limit() -> None:
    """§7, Figure 5 (no 16-GPU node limit): "there is enough memory for models up to 100 quadrillion
    parameters, while the training time reduces the limit to 40 trillion (one month) or 900 trillion
    parameters (one year)". Ours, with the paper's sweep (no head bound on n_a: the text says tensor
    parallelism "only requires a ring topology, which is easy to scale to an arbitrary size"): 110P, 32T and
    721T, all within 25%.

    Why no head bound: at 1e17 (x = 1527, d_a = 763 heads) the 25% NVLink cap allows n_a - 1 <=
    0.25·4·x²/484 = 4818, and the buffers 6·p_l/n_a = 72·x⁴/n_a are 75 GB at n_a = 4818 but 480 GB at
    n_a = 763: with n_a <= d_a the memory limit falls to 4.8P and the one-year limit to 340T (62% low)."""
    links = ga.Links(node_size=0)
    x = 1527
    assert ga.x_params(x) == pytest.approx(1e17, rel=0.01)
    assert 0.25 * 4 * x**2 / links.threshold(600.0) == pytest.approx(4818, rel=0.001)
    assert 72 * x**4 / 4818 / GiB < 80 < 72 * x**4 / (x // 2) / GiB
    xs = F.sizes(14, 1e12, 1e16)
    lim = F.limits(F.sweep(links, xs), links)
    assert lim["fits_80gb_params"] == pytest.approx(100e15, rel=0.25)
    assert lim["one_month_params"] == pytest.approx(40e12, rel=0.25)
    assert lim["one_year_params"] == pytest.approx(900e12, rel=0.25)
    capped = replace(F.PAPER, heads=True)
    lim_heads = F.limits(F.sweep(links, xs, capped), links, capped)
    assert lim_heads["fits_80gb_params"] == pytest.approx(4.8e15, rel=0.05)
    assert lim_heads["one_year_params"] < 0.75 * 900e12
    # with 16-GPU nodes the network's tensor cap binds long before the heads: Figure 4 is the same either way
    for x in (160, 300, 442):
        t = C.Target(ga.x_family(x), ga.x_critical_batch_size(x))
        assert S.fastest(t, F.PAPER, "improved").config == S.fastest(t, capped, "improved").config


@pytest.mark.parametrize(
    ("x", "b_c", "pins"),
    [(160, 64.0, {"n_l": 16}), (64, 16.0, {"n_l": 32}), (32, 8.0, {"n_l": 8}), (160, 2416.0, {"n_a": 20})],
)
def test_the_pruned_search_keeps_the_pinned_degrees(x: int, b_c: float, pins: dict[str, int]) -> None:
    """``plan.pipeline_parallel`` / ``plan.tensor_parallel`` pin n_l / n_a: the pruned search gives the
    full search's answer, a row at the pinned degree or why there is none (it used to fall back to 1)."""
    t = C.Target(ga.x_family(x), b_c)
    b = C.Bounds(whole=False, **pins)
    for method in ("baseline", "improved"):
        for mix in ("data+pipe", "3d") if "n_l" in pins else ("data+tensor", "3d"):
            pruned = S.search_one(t, b, method, mix, prune=True)
            full = S.search_one(t, b, method, mix, prune=False)
            if isinstance(full, str):
                assert pruned == full
                continue
            assert isinstance(pruned, S.Found), pruned
            assert pruned.config == full.config
            for k, v in pins.items():
                assert getattr(pruned.config, k) == v


def test_a_critical_batch_below_one_sample_says_so(capsys) -> None:
    """A small model at a long sequence has b_c < 1: each mix says so in one line (not a numpy error)."""
    t = C.Target(ga.x_family(4), 0.5)
    for mix, method in C.PAIRS:
        got = S.search_one(t, C.Bounds(), method, mix)
        assert got == f"{method} with {mix}: no candidate (the critical batch 0.5 is below one sample)"
    assert main(["--search", "--json", "model=bert-tiny", "model.seq_len=65536", "hardware=a100-80g"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not out["search"] and any("is below one sample" in m for m in out["not_found"]), out
