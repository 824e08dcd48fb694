"""benchmarks/recompute.py's statistic (issue 25's acceptance 1): every run is judged alike, its warm-up
steps dropped and the median of the rest taken, and a step's CPU load tells this process's CPU from what
other processes took meanwhile (a timing they disturbed is visible as such)."""

from __future__ import annotations

import importlib.util
import sys
import time

from tests.util import REPO


def _bench():
    sys.path.insert(0, str(REPO))
    spec = importlib.util.spec_from_file_location("recompute_bench", REPO / "benchmarks" / "recompute.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_steady_drops_the_warm_up_and_takes_the_median() -> None:
    bench = _bench()
    steps = [
        {"wall_s": w, "cpu_s": 2 * w, "others_cpu_s": o, "faults": f, "steal_s": 0.0}
        for w, o, f in [(20.0, 0.0, 900), (15.0, 0.0, 800), (8.0, 0.1, 4), (9.0, 2.5, 6), (4.0, 0.0, 2)]
    ]
    r = bench.steady(steps, batch=16)
    assert bench.WARMUP == 2
    assert r["walls"] == [8.0, 9.0, 4.0]  # the two warm-up steps are not counted
    assert r["samples_per_s"] == 16 / 8.0  # the median step, not the mean (7.0) nor the best
    assert r["cpu_s"] == 16.0
    assert r["others_cpu_s"] == 2.5  # the worst step's contention is reported
    assert r["faults"] == 4


def test_step_load_counts_this_process_apart_from_the_rest_of_the_machine() -> None:
    from benchmarks.harness import cpu_mark, step_load

    a = cpu_mark()
    t = time.process_time()
    while time.process_time() - t < 0.3:  # 0.3 s of this process's CPU
        pass
    load = step_load(a, cpu_mark())
    assert load["cpu_s"] >= 0.29
    assert load["wall_s"] >= load["cpu_s"] - 0.05  # one thread: no more CPU than wall time
    assert load["others_cpu_s"] >= 0.0 and load["faults"] >= 0
    # two marks with made-up readings: the machine busy 5 s, this process 3 s -> others 2 s
    assert step_load((0.0, 1.0, 10.0, 5, 0.0), (4.0, 4.0, 15.0, 9, 0.5)) == {
        "wall_s": 4.0,
        "cpu_s": 3.0,
        "others_cpu_s": 2.0,
        "faults": 4,
        "steal_s": 0.5,
    }
