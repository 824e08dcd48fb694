"""The disk tier's cache slots sized per layer without a deadlock: dedicated slots for the layers larger
than a block, shared block-sized ones for the rest (``layout.cache_slots``). GPT-2's tied head pins the
embeddings while it loads; a block must never sit in the embeddings' slot."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from l2l_cli.data.batches import TrainStream
from l2l_cli.engine.tiers.disk.layout import SHARED_MIN, aligned, cache_slots
from tests.test_decoder import cfg_for, lm_data, write_checkpoint
from tests.util import batches, built, tiny_cfg, train, weights


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("gpt2", tmp_path_factory.mktemp("slots"))


def _bytes(slots: list[tuple[int, int | None]]) -> int:
    return sum(aligned(4 * n) for n, _ in slots)


def test_the_slot_rule_dedicates_the_large_layers_and_never_takes_more_than_uniform_slots() -> None:
    pre, block, post = 68000, 8500, 64
    gpt2 = [pre, *[block] * 20, post]
    assert cache_slots(gpt2, 4) == [(pre, 0), *[(block, None)] * 4]
    # few slots: at least SHARED_MIN shared ones beside the dedicated one (3 slots for k=2)
    assert cache_slots(gpt2, 2) == [(pre, 0), *[(block, None)] * SHARED_MIN]
    # no layer larger than a block: uniform slots
    assert cache_slots([block] * 6, 3) == [(block, None)] * 3
    # two large layers and few slots: the dedicated rule would take more than k slots of the largest,
    # so the k uniform slots stay
    untied = [pre, block, block, block, pre - 1]
    assert cache_slots(untied, 2) == [(pre, None)] * 2
    assert cache_slots(untied, 5)[:2] == [(pre, 0), (pre - 1, 4)]
    for numels in (gpt2, untied, [block] * 6, [pre, block, post]):
        for k in range(1, 8):
            slots = cache_slots(numels, k)
            uniform = min(k, len(numels)) * aligned(4 * max(numels))
            assert _bytes(slots) <= uniform, (numels, k)
            owners = [o for _, o in slots if o is not None]
            assert len(owners) == len(set(owners))
            shared = [n for n, o in slots if o is None]
            # every layer has a slot it may take: its own, or a shared one large enough
            for i, n in enumerate(numels):
                assert i in owners or any(s >= n for s in shared), (numels, k, i)
            assert not owners or len(shared) >= SHARED_MIN


def _pin(tier: Any, i: int, parts: str, done: dict[int, bool]) -> threading.Thread:
    def run() -> None:
        tier.pin(i, parts)
        done[i] = True

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _pin_fresh(tier: Any, i: int, done: dict[int, bool]) -> threading.Thread:
    def run() -> None:
        tier.pin(i, "g", fresh=True)
        done[i] = True

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_tied_heads_pin_of_the_embeddings_is_served_while_blocks_hold_every_shared_slot(gpt2: Path) -> None:
    """The pin sequence that starved slots sized per layer: the blocks' gradients hold every block-sized
    slot, the head's pin waits for one, and the embeddings' pin (the tied tensors) must still be served
    at once: its slot is its own, so no block (and not the waiting head) can be in it."""
    cfg = cfg_for(gpt2, "mode=l2l", "eps.tier=disk", "eps.host_cache_layers=3")
    with built(cfg, data=lm_data(gpt2)) as runner:
        tier = runner.eps.tier
        n = len(tier.store.files)
        shared = [s for s in tier.slots if s.owner is None]
        assert [s.owner for s in tier.slots if s.owner is not None] == [0], [s.owner for s in tier.slots]
        assert len(shared) == 3 and n == 5  # 3 blocks, the post layer (ln_f: the head's tensor is wte)
        for i in (1, 2):  # gradient pins, as the relay hands them to the EPS's jobs
            tier.pin(i, "g", fresh=True)
        done: dict[int, bool] = {}
        block = _pin_fresh(tier, 3, done)  # takes the last shared slot
        block.join(timeout=30)
        assert done.get(3)
        head = _pin(tier, n - 1, "w", done)  # the post layer (the size of a block): waits for a shared slot
        head.join(timeout=1.0)
        assert not done.get(n - 1), "the head took a slot while every shared one is pinned"
        emb = _pin(tier, 0, "w", done)  # the tied tensors: the embeddings' slot is theirs alone
        emb.join(timeout=30)
        assert done.get(0), "the embeddings' pin waited behind the blocks' pins"
        tier.unpin(0)
        tier.unpin(1)
        head.join(timeout=30)
        assert done.get(n - 1)
        for i in (n - 1, 2, 3):
            tier.unpin(i)


def _train(path: Path, *over: str, steps: int = 3) -> dict[str, Any]:
    cfg = cfg_for(path, *over)
    data = lm_data(path)
    with built(cfg, data=data) as runner:
        it = TrainStream(data.train, cfg.batch.size, seed=0).batches()
        losses = [runner.step(next(it)).loss for _ in range(steps)]
        tier = getattr(runner.eps, "tier", None)
        summary = tier.summary() if tier is not None and hasattr(tier, "summary") else None
        slots = [(s.numel, s.owner) for s in tier.slots] if summary is not None else None
        return {"losses": losses, "weights": weights(runner), "summary": summary, "slots": slots}


CASES = [
    pytest.param("l2l_p", "cmp", id="l2l_p-cmp"),
    pytest.param("l2l_p", "fp32", id="l2l_p-fp32", marks=pytest.mark.slow),
    pytest.param("l2l", "cmp", id="l2l-cmp", marks=pytest.mark.slow),
    pytest.param("l2l", "fp32", id="l2l-fp32", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("mode", "precision"), CASES)
def test_tied_gpt2_on_dedicated_slots_trains_as_the_host_tier_in_less_ram(
    gpt2: Path, mode: str, precision: str
) -> None:
    """GPT-2 (tied head) on the disk tier with the per-layer slots: no hang, the host tier's weights bit for
    bit, and the cache takes less than ``host_cache_layers`` slots of the embeddings' size."""
    prec = ["precision=cmp", "precision.dtype=bf16"] if precision == "cmp" else []
    over = (f"mode={mode}", *prec, "optim.clip=global", "optim.max_grad_norm=0.05")
    disk = _train(gpt2, *over, "eps.tier=disk", "eps.host_cache_layers=4")
    host = _train(gpt2, *over)
    assert disk["losses"] == host["losses"]
    for k, t in host["weights"].items():
        assert torch.equal(disk["weights"][k], t), k
    s, slots = disk["summary"], disk["slots"]
    largest = max(n for n, _ in slots)
    assert slots[0] == (largest, 0) and all(o is None and n < largest for n, o in slots[1:]), slots
    per_param = 16 + (2 if precision == "cmp" else 0)
    uniform = 4 * per_param * largest
    assert s["resident_bytes_peak"] <= s["resident_bytes_bound"] < uniform, (s, uniform)


def _disk_run(*over: str) -> dict[str, Any]:
    cfg = tiny_cfg("model.num_layers=5", "mode=l2l", "eps.tier=disk", "eps.grad_ram_layers=0", *over)
    with built(cfg) as runner:
        it = batches(cfg)
        reports = [runner.step(next(it)) for _ in range(3)]
        s = runner.eps.tier.summary()
        rollbacks = runner.speculation.rollbacks
        return {
            "losses": [r.loss for r in reports],
            "weights": weights(runner),
            "s": s,
            "rollbacks": rollbacks,
        }


def test_kept_gradients_stay_in_their_cache_slot_unless_it_is_reused_before_the_verdict() -> None:
    """Under global clipping (``eps.clip_redo=keep``) each speculative update keeps its gradient for a redo.
    With no RAM pool (``eps.grad_ram_layers=0``) it stays in the layer's cache slot: written to
    ``kept_grads.eps`` only when the slot is reused before the step's verdict. A cache holding every layer
    writes none; a smaller one writes some, fewer than every kept gradient (4 B per parameter of the updated
    layers)."""
    every = _disk_run("optim.max_grad_norm=1e9", "eps.host_cache_layers=7", "eps.clip_redo=keep")
    b = every["s"]["bytes_per_param_step"]
    assert b["write_park"] == 0 and every["s"]["gradients_parked"] == 0, every["s"]
    few = _disk_run("optim.max_grad_norm=1e9", "eps.host_cache_layers=3", "eps.clip_redo=keep")
    b = few["s"]["bytes_per_param_step"]
    # (the embeddings' update comes after the verdict, the embeddings' slot is their own: neither is written)
    assert 0 < b["write_park"] < 3.0, few["s"]
    assert b["read_grad"] == 0, few["s"]  # no redo: nothing read back


@pytest.mark.parametrize("cache", [3, 7])
def test_a_redo_from_gradients_kept_in_slots_or_on_disk_equals_the_host_tier(cache: int) -> None:
    """max_grad_norm 0.24: the first step's norm crosses it at the last layers, the speculative updates are
    rolled back and redone from the kept gradients (in their slots, or on disk for the slots reused): the
    host tier's weights bit for bit."""
    over = ("model.num_layers=5", "mode=l2l", "optim.max_grad_norm=0.24")
    got = _disk_run("optim.max_grad_norm=0.24", f"eps.host_cache_layers={cache}")
    assert got["rollbacks"] >= 1
    ref = train(tiny_cfg(*over))
    assert got["losses"] == ref["losses"]
    for k, t in ref["weights"].items():
        assert torch.equal(got["weights"][k], t), k
    if cache == 7:
        assert got["s"]["gradients_parked"] == 0, got["s"]
