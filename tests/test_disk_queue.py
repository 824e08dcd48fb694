"""The planner's disk-tier step (``plan/diskqueue.py``): the structure of its queue model, no absolute times.
A deeper host cache never exposes more, one layer read ahead is the old one-layer window, I/O slower than
the compute is exposed by the difference, and write-backs a full cache never waits for are hidden."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from l2l_cli.compose import compose
from l2l_cli.plan import estimate as est
from l2l_cli.plan.diskqueue import Disk, Use, exposed_wait
from l2l_cli.plan.hardware import resolve
from l2l_cli.plan.planner import model_shape

FREE = Disk(1.0, 1.0, 1.0)  # reads and writes on their own queues, each at its own rate


def _step(rnd: random.Random, n: int) -> list[Use]:
    """A step of n layers: a forward that reads weights, a backward that reads weights then moments,
    updates and writes back."""
    fwd = [Use(rnd.uniform(0.1, 1.0), rnd.uniform(0.0, 2.0)) for _ in range(n)]
    bwd = [
        Use(
            rnd.uniform(0.1, 2.0),
            rnd.uniform(0.0, 2.0),
            rnd.uniform(0.0, 3.0),
            rnd.uniform(0.0, 0.5),
            rnd.uniform(0.0, 3.0),
        )
        for _ in range(n)
    ]
    return fwd + bwd


@pytest.mark.parametrize("seed", range(4))
def test_a_deeper_cache_never_exposes_more(seed: int) -> None:
    rnd = random.Random(seed)
    deeper_helped = 0
    for _ in range(25):
        uses = _step(rnd, rnd.randint(2, 7))
        waits = [exposed_wait(uses, k, FREE) for k in range(2, len(uses) + 2)] + [
            exposed_wait(uses, None, FREE)
        ]
        assert all(b <= a + 1e-9 for a, b in itertools.pairwise(waits)), waits
        deeper_helped += waits[-1] < waits[0] - 1e-6
    assert deeper_helped >= 5  # (the cases do expose waits that a deeper cache hides)


def test_one_layer_read_ahead_is_the_old_one_layer_window() -> None:
    """Two slots (the layer in use and the one read ahead): each read hides behind the one layer before it,
    the pass's first read is waited for: the closed form the planner used before."""
    rnd = random.Random(7)
    for _ in range(50):
        n = rnd.randint(1, 10)
        c = [rnd.uniform(0.0, 1.0) for _ in range(n)]
        r = [rnd.uniform(0.0, 1.0) for _ in range(n)]
        old = r[0] + sum(max(0.0, r[j] - c[j - 1]) for j in range(1, n))
        got = exposed_wait([Use(a, b) for a, b in zip(c, r)], 2, FREE, steps=1)
        assert got == pytest.approx(old, abs=1e-9)
        if n > 1:
            assert exposed_wait([Use(a, b) for a, b in zip(c, r)], 6, FREE, steps=1) <= got + 1e-12


@pytest.mark.parametrize("slots", [2, 4, 8])
def test_io_slower_than_the_compute_is_exposed_by_the_difference(slots: int) -> None:
    n, c = 6, 0.3
    reads = [Use(c, 0.5) for _ in range(n)]  # reads of 0.5 s behind 0.3 s of compute
    assert exposed_wait(reads, slots, FREE) == pytest.approx(n * (0.5 - c))
    fast = [Use(c, 0.2) for _ in range(n)]
    assert exposed_wait(fast, slots, FREE) == pytest.approx(0.0, abs=1e-12)
    # write-backs of 0.5 s: the slots wait for them; a cache holding every layer never does
    writes = [Use(c, 0.0, write=0.5) for _ in range(n)]
    assert exposed_wait(writes, slots, FREE) == pytest.approx(n * (0.5 - c))
    assert exposed_wait(writes, None, FREE) == 0.0


def test_a_shared_disk_takes_the_sum_of_its_read_and_write_times() -> None:
    """Without a mixed rate both queues run at half their rate while the other runs: a read and a write of
    one second each, at once, take two (``Rates.disk_time``'s sum); on their own queues, one."""
    uses = [Use(0.0, 1.0, write=1.0), Use(0.0, 1.0)]  # the second read runs beside the first write-back
    assert exposed_wait(uses, None, FREE, steps=1) == pytest.approx(1.0 + 1.0)
    assert exposed_wait(uses, None, Disk(1.0, 1.0, 0.5), steps=1) == pytest.approx(1.0 + 2.0)


def test_the_planner_exposes_less_disk_wait_as_the_cache_deepens() -> None:
    """The plan's disk-tier step on BERT-Base with a disk that moves a step's 28 B/param in about the
    step's compute: the wait falls as eps.host_cache_layers grows, the old one-layer window the worst."""
    cfg = compose(["model=bert-base", "mode=l2l", "hardware=a100-80g", "eps.tier=disk"])
    shape, _ = model_shape(cfg)
    s = est.Setup.from_cfg(cfg)
    rates = resolve(cfg, shape)
    compute = sum(p.exposed for k, p in est.step_time(shape, s, rates).items() if k != "disk_wait")
    bps = 28 * shape.total_params / compute  # the step's bytes in the step's compute (the times add up)
    r = replace(rates, disk_read=2 * bps, disk_write=2 * bps, disk_mixed=0.0)
    waits = [est.step_time(shape, s.but(cache_layers=k), r)["disk_wait"].exposed for k in (2, 3, 4, 8, 16)]
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(waits)), waits
    assert waits[-1] < 0.5 * waits[0]
