"""The disk tier's slots as a state machine, driven at random (issue 36): seeded sequences of pins, unpins,
gradients landing, parked and kept, updates, L2L-p rollbacks, step ends and commits, with write faults
injected, run against the real tier (its reader and writer threads, files on disk) and checked against a
plain model of each layer's weights, moments and gradient:

- a layer never has two slots, an update buffer has one holder, pins never go negative (after every op);
- a slot is rebound only unpinned and idle (the slot table asserts it; a failed assertion on the reader
  thread fails the next pin);
- every read sees the model's current version of what it pinned (never torn, never stale);
- after the run (or the fault that stopped it), ``commit.json`` names, for every layer, a file slot whose
  bytes are the model's state at the record's step: a commit names only completed writes.

A few seeds run in the default suite; the sweep is ``@pytest.mark.slow``."""

from __future__ import annotations

import errno
import faulthandler
import json
import os
import random
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from l2l_cli.engine.tiers.disk.format import DiskIo
from l2l_cli.engine.tiers.disk.layout import MOMENTS
from l2l_cli.engine.tiers.disk.tier import DiskTier
from l2l_cli.profiling.timers import PhaseTimer
from tests.util import built, tiny_cfg

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # w, m, v


@dataclass
class Model:
    """What each layer holds, as the tier should: its state now, the gradient waiting for its update,
    the pre-update state of this step's speculative updates, and the state at each commit."""

    state: list[State]
    grad: dict[int, torch.Tensor] = field(default_factory=dict)  # landed, not yet applied
    undo: dict[int, tuple[State, torch.Tensor]] = field(default_factory=dict)  # speculative: (before, g)
    updated: set[int] = field(default_factory=set)  # updated since the last commit
    commits: dict[int, list[State]] = field(default_factory=dict)  # step -> every layer's state


def _clone(s: State) -> State:
    return (s[0].clone(), s[1].clone(), s[2].clone())


def _apply(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> None:
    """The update the test makes (the same ops on the tier's buffers and the model's: bit-identical)."""
    m.mul_(0.5).add_(g)
    v.addcmul_(g, g)
    w.add_(m, alpha=-0.25)


def _invariants(tier: DiskTier) -> None:
    with tier.cv:
        layers = [s.layer for s in tier.cache.slots if s.layer is not None]
        assert len(layers) == len(set(layers)), f"a layer in two slots: {layers}"
        for s in tier.cache.slots:
            assert s.pins >= 0 and 0 <= s.mv_pins <= s.pins, (s.layer, s.pins, s.mv_pins)
            if s.mom is not None:
                assert s.mom.holder is s, f"layer {s.layer}'s update buffer names another holder"
        holders = [b.holder for b in tier.cache.moms if b.holder is not None]
        assert len(holders) == len({id(h) for h in holders})


def _drive(tier: DiskTier, rng: random.Random, ops: int, fault_at: int | None) -> Model:
    """``ops`` random operations on ``tier``; a write fault from write ``fault_at`` on (None: none). Returns
    the model (its ``commits``: the states a commit record may name)."""
    n = len(tier.store)
    layers = tier.layers
    model = Model([])
    for i in range(n):  # the state as built (read once, pinned)
        with tier.holding(i, "wmv"):
            st = layers[i]
            model.state.append((st.w.clone(), st.m.clone(), st.v.clone()))
    timer = PhaseTimer()
    step = 0
    tier.commit(step, {})
    model.commits[step] = [_clone(s) for s in model.state]

    def check(i: int, parts: str) -> None:
        st = layers[i]
        w, m, v = model.state[i]
        assert torch.equal(st.w, w), f"layer {i}: stale or torn weights"
        if set(parts) & set(MOMENTS):
            assert torch.equal(st.m, m) and torch.equal(st.v, v), f"layer {i}: stale or torn moments"
        if "g" in parts and i in model.grad:
            assert torch.equal(st.g, model.grad[i]), f"layer {i}: stale or torn gradient"

    def land(i: int) -> None:
        """A gradient lands (the relay's fresh pin), then waits in RAM, the pool, or parked on disk."""
        g = torch.randn(layers[i].layout.numel, generator=gen)
        tier.pin(i, "g", fresh=True)
        try:
            layers[i].g.copy_(g)
        finally:
            tier.release_grad(i)
        model.grad[i] = g

    def update(i: int, speculative: bool) -> None:
        st = layers[i]
        if speculative:
            st.reserve_redo()  # (its gradient is kept until the step's verdict)
            st.save_undo(tier.acc)
        before = _clone(model.state[i])
        with tier.holding(i, "wmvg", dirty=True):
            check(i, "wmvg")
            _apply(st.w, st.m, st.v, st.g)
            if speculative:
                tier.keep_grad(i, st.g)
                st.kept_grad = True
        g = model.grad.pop(i)
        w, m, v = model.state[i]
        _apply(w, m, v, g)
        if speculative:
            model.undo[i] = (before, g)
        model.updated.add(i)

    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    writes = [0]
    real_write = DiskIo.write

    def faulty_write(self: DiskIo, fd: int, mv: memoryview, offset: int) -> None:
        writes[0] += 1
        if fault_at is not None and writes[0] >= fault_at:
            raise OSError(errno.EIO, "injected by the state-machine test")
        real_write(self, fd, mv, offset)

    DiskIo.write = faulty_write  # type: ignore[method-assign]
    try:
        for _ in range(ops):
            _invariants(tier)
            op = rng.choice(["fwd", "fwd", "land", "update", "spec", "rollback", "end", "commit"])
            free = [i for i in range(n) if i not in model.updated and i not in model.grad]
            if op == "fwd":  # the relay: weights in, a pin held while another is taken
                i, j = rng.randrange(n), rng.randrange(n)
                tier.pin(i, "w")
                try:
                    check(i, "w")
                    if j != i and rng.random() < 0.3:
                        tier.pin(j, "w")
                        check(j, "w")
                        tier.unpin(j)
                finally:
                    tier.unpin(i)
            elif op == "land" and free:
                land(rng.choice(free))
            elif op in ("update", "spec"):
                ready = [i for i in model.grad if i not in model.updated]
                if ready:
                    update(rng.choice(ready), op == "spec")
            elif op == "rollback" and model.undo:  # the verdict: redo this step's speculative updates
                for i, (before, g) in sorted(model.undo.items()):
                    layers[i].restore_undo()
                    model.state[i] = before
                    model.grad[i] = g
                    model.updated.discard(i)
                model.undo.clear()
                for i in sorted(model.grad):
                    if rng.random() < 0.5:
                        update(i, False)
            elif op == "end" and not model.grad:  # the step's verdict is in: kept gradients are dropped
                tier.pop_step(timer)
                model.undo.clear()
            elif op == "commit" and not model.grad:
                tier.pop_step(timer)
                model.undo.clear()
                step += 1
                tier.commit(step, {})
                model.commits[step] = [_clone(s) for s in model.state]
                model.updated.clear()
        _invariants(tier)
        tier.writer.flush()
    except (OSError, RuntimeError) as e:  # a fault stops the sequence, as it stops a run
        if fault_at is None or not _caused_by_fault(e):
            raise
    finally:
        DiskIo.write = real_write  # type: ignore[method-assign]
    return model


def _caused_by_fault(e: BaseException | None) -> bool:
    while e is not None:
        if "injected by the state-machine test" in str(e) or (
            isinstance(e, OSError) and e.errno == errno.EIO
        ):
            return True
        e = e.__cause__ or e.__context__
    return False


def _check_record(root: Path, tier: DiskTier, model: Model) -> int:
    """commit.json names, for every layer, a file slot holding the model's state at the record's step."""
    rec = json.loads((root / "commit.json").read_text())
    step = int(rec["step"])
    assert step in model.commits, (step, sorted(model.commits))
    want = model.commits[step]
    for i, entry in enumerate(rec["layers"]):
        f = tier.store.files[i]
        fd = os.open(f.path, os.O_RDONLY)
        try:
            for k, p in enumerate("wmv"):
                raw = os.pread(fd, 4 * f.numel, f.offset(entry["slot"], p))
                got = torch.frombuffer(bytearray(raw), dtype=torch.float32)
                assert torch.equal(got, want[i][k]), f"layer {i}'s {p} in slot {entry['slot']} at step {step}"
        finally:
            os.close(fd)
    return step


def _run(seed: int, ops: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    cache = rng.choice([2, 3])
    pool = rng.choice([0, 1, 2])
    fault_at = rng.randrange(5, 60) if rng.random() < 0.5 else None
    root = tmp_path / f"eps-{seed}"
    cfg = tiny_cfg(
        "mode=l2l",
        "eps.tier=disk",
        f"eps.path={root}",
        f"eps.host_cache_layers={cache}",
        f"eps.grad_ram_layers={pool}",
    )
    done: dict[str, Any] = {}

    def body() -> None:
        try:
            with built(cfg) as runner:
                tier = runner.eps.tier
                assert isinstance(tier, DiskTier)
                done["model"] = _drive(tier, rng, ops, fault_at)
                done["tier"] = tier
                try:
                    tier.writer.flush()
                except OSError:
                    assert fault_at is not None
        except OSError as e:  # (closing a tier whose writer failed raises its failure)
            if fault_at is None or not _caused_by_fault(e):
                done["error"] = e
        except BaseException as e:
            done["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(120)
    if t.is_alive():
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        pytest.fail(f"seed {seed}: the sequence hung (every thread's stack above)")
    if "error" in done:
        raise done["error"]
    _check_record(root, done["tier"], done["model"])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_slot_transitions_keep_the_invariants(seed: int, tmp_path: Path) -> None:
    _run(seed, 60, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 140))
def test_random_slot_transitions_keep_the_invariants_sweep(seed: int, tmp_path: Path) -> None:
    _run(seed, 200, tmp_path)
