"""The disk tier's cache holds k layers' weights and gradients, not k layers' moments: a slot is [w | g],
and the moments are read for the update alone, into one update buffer (``layout.cache_bytes``). The tier
allocates what ``l2l plan`` predicts, the weights stay equal to the host tier's bit for bit, and no more
bytes are read or written than with moments in every slot."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from l2l_cli.engine.tiers.disk.format import digest
from l2l_cli.engine.tiers.disk.layout import (
    MOMENTS,
    UPDATE_BUFFERS,
    aligned,
    cache_bytes,
    cache_slots,
    update_buffer_bytes,
)
from l2l_cli.plan.planner import make_plan
from tests.util import batches, built, tiny_cfg, weights


def _run(*over: str, steps: int = 3) -> dict[str, Any]:
    """A tiny run's losses, weights, the disk tier's summary and cache bytes, and every moment-holding
    pin's count of slots holding moments at once (sampled from inside the pins)."""
    cfg = tiny_cfg(*over)
    with built(cfg) as runner:
        tier = runner.eps.tier
        holders: list[int] = []
        if getattr(tier, "cache", None) is not None:  # the disk tier: sample inside each update
            real = tier.holding

            def holding(i: int, parts: str = "wmv", **kw: Any) -> Any:
                cm = real(i, parts, **kw)

                class Sampled:
                    def __enter__(self) -> None:
                        cm.__enter__()
                        with tier.cv:
                            holders.append(sum(1 for s in tier.cache.slots if s.mom is not None))
                            s = tier.cache.bound_slot(i)
                            if set(parts) & set(MOMENTS):
                                assert s.mom is not None and s.mv_pins > 0, (i, parts)

                    def __exit__(self, *exc: Any) -> Any:
                        return cm.__exit__(*exc)

                return Sampled()

            tier.holding = holding
        it = batches(cfg)
        reports = [runner.step(next(it)) for _ in range(steps)]
        out = {"losses": [r.loss for r in reports], "weights": weights(runner), "holders": holders}
        if getattr(tier, "cache", None) is not None:
            out["summary"] = tier.summary()
            out["cache"] = tier.cache.nbytes
            out["parts"] = runner.host_parts()
            out["numels"] = [f.numel for f in tier.store.files]
            out["slots"] = len(tier.cache.slots)
    return out


def _identical(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert got["losses"] == ref["losses"]
    for k in ref["weights"]:
        assert torch.equal(got["weights"][k], ref["weights"][k]), k


@pytest.mark.parametrize(
    "over",
    [
        ("mode=l2l", "optim.max_grad_norm=1e9"),  # speculative updates, gradients kept for the verdict
        ("mode=l2l_p", "precision=cmp", "precision.dtype=bf16"),  # format 2: hi / lo planes
    ],
    ids=["l2l-fp32", "l2l_p-cmp-bf16"],
)
def test_slots_hold_weights_and_gradients_and_one_update_buffer_the_moments(over: tuple[str, ...]) -> None:
    """Each slot is [w | g] (8 bytes per parameter, and the half copies under CMP): half of what a slot of
    the whole state took (16 bytes per parameter); one update buffer holds the moments of the layer being
    updated. What it allocates is ``layout.cache_bytes``, which the
    plan uses too; every update holds the moments (and only one slot holds them at a time), and the
    weights equal the host tier's."""
    ref = _run(*over)
    got = _run(*over, "eps.tier=disk", "eps.host_cache_layers=2")
    _identical(got, ref)
    numels = got["numels"]
    cmp = "precision=cmp" in over
    assert got["cache"] == cache_bytes(numels, 2, 2 if cmp else 4, cmp) == got["parts"]["eps_cache"]
    slots = cache_slots(numels, 2)
    whole = sum(4 * aligned(4 * n) for n, _ in slots)  # FP32 [w | m | v | g] slots, as before
    moments = UPDATE_BUFFERS * update_buffer_bytes(max(n for n, _ in slots))
    halves = sum(6 * n for n, _ in slots) if cmp else 0  # (2 half copies and the lo plane: 2 B each)
    assert got["cache"] - moments - halves == whole // 2, (got["cache"], whole)
    assert got["holders"] and max(got["holders"]) <= UPDATE_BUFFERS, got["holders"]
    s = got["summary"]
    assert s["resident_bytes_peak"] <= s["resident_bytes_bound"], s
    # l2l plan predicts the same bytes (the same function)
    plan = make_plan(tiny_cfg(*over, "eps.tier=disk", "eps.host_cache_layers=2"))
    assert plan["memory_bytes"]["host"]["parts"]["eps_cache"] == got["cache"]


def test_an_update_waits_for_the_buffer_its_moments_go_to() -> None:
    """The update buffer passes from one layer's slot to the next layer's update only once the write-back
    that reads it is done: with the writer held up, the next update's pin waits (it does not read into a
    buffer being written), then proceeds once the write is out; the weights equal the host tier's."""
    over = ("mode=l2l", "optim.max_grad_norm=1e9")
    ref = _run(*over, steps=2)
    cfg = tiny_cfg(*over, "eps.tier=disk", "eps.host_cache_layers=2")
    with built(cfg) as runner:
        tier = runner.eps.tier
        real = tier.writer._write
        seen: list[tuple[int, bool]] = []

        def slow_write(i: int, target: int, parts: str, views: Any, split: Any, setup: bool) -> None:
            if not setup and "m" in views:  # a step's write-back of the moments: held a while
                before = digest(views["m"]), digest(views["v"])
                time.sleep(0.05)
                # no other layer's moments were read into the buffer while this write reads it
                seen.append((i, (digest(views["m"]), digest(views["v"])) == before))
            real(i, target, parts, views, split, setup)

        tier.writer._write = slow_write
        it = batches(cfg)
        reports = [runner.step(next(it)) for _ in range(2)]
        got = {"losses": [r.loss for r in reports], "weights": weights(runner)}
    assert seen and all(ok for _, ok in seen), seen
    _identical(got, ref)


def test_each_layers_moments_are_read_once_a_step(monkeypatch: Any) -> None:
    """The read-ahead reads the moments of the next update only (the one buffer would otherwise go to a
    later update and be taken back by the next one: its moments read twice). From the second step on (the
    plan is the last step's trace), each layer's moments are read once a step, ahead of its update."""
    from l2l_cli.engine.tiers.disk import reader

    reads: list[tuple[int, bool]] = []
    real = reader.Reader._run

    def run(self: Any, job: Any) -> None:
        if set(job.parts) & set(MOMENTS):
            reads.append((job.layer, job.demand is None))
        real(self, job)

    monkeypatch.setattr(reader.Reader, "_run", run)
    over = (
        "mode=l2l",
        "model.num_layers=6",
        "optim.max_grad_norm=1e4",
        "batch.size=2",
        "batch.ubatch_size=1",
    )
    cfg = tiny_cfg(*over, "eps.tier=disk", "eps.host_cache_layers=4")
    with built(cfg) as runner:
        it = batches(cfg)
        runner.step(next(it))
        for _ in range(2):
            reads.clear()
            runner.step(next(it))
            layers = [i for i, _ in reads]
            assert sorted(layers) == list(range(len(runner.eps.layers))), reads  # once each
            assert sum(ahead for _, ahead in reads) >= len(layers) - 1, reads  # (read ahead)


def test_a_new_gradient_lands_while_its_updates_moments_are_read(monkeypatch: Any) -> None:
    """The moments are read into the update buffer, not the slot's own ``w | g``: the backward's new
    gradient for a layer lands in its slot while the read of that layer's moments (for its update) still
    runs, instead of waiting for it (that wait was most of the compute thread's disk time). Slowed reads
    of the moments make it happen; the weights equal the host tier's."""
    from l2l_cli.engine.tiers.disk import reader

    real_run = reader.Reader._run

    def slow_moments(self: Any, job: Any) -> None:
        if job.parts and set(job.parts) <= set(MOMENTS) and job.evict is None:
            time.sleep(0.1)
        real_run(self, job)

    monkeypatch.setattr(reader.Reader, "_run", slow_moments)
    over = ("mode=l2l", "optim.max_grad_norm=1e9")
    ref = _run(*over, steps=2)
    cfg = tiny_cfg(*over, "eps.tier=disk", "eps.host_cache_layers=4")
    beside: list[int] = []
    with built(cfg) as runner:
        tier = runner.eps.tier
        real_pin = tier._pin_cached

        def pin_cached(i: int, need: frozenset[str], fresh: bool, stream: Any) -> Any:
            s = real_pin(i, need, fresh, stream)
            if s is not None and fresh and need == {"g"}:
                with tier.cv:
                    if s.busy:  # granted while a job reads into the slot: only the moments', never w | g
                        assert s.reading and s.reading <= set(MOMENTS), s.reading
                        beside.append(i)
            return s

        monkeypatch.setattr(tier, "_pin_cached", pin_cached)
        it = batches(cfg)
        reports = [runner.step(next(it)) for _ in range(2)]
        got = {"losses": [r.loss for r in reports], "weights": weights(runner)}
    assert beside, "no gradient landed beside a read of the moments"
    _identical(got, ref)
