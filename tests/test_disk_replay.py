"""``eps.clip_redo``: the disk tier need not write each speculative update's gradient for a redo. A step
whose global clipping nobody foresaw is rolled back and run again with the factor known (``replay``); the
weights equal the host tier's bit for bit, and a step that does not clip writes no kept gradient."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from l2l_cli.config.validate import validate
from l2l_cli.engine.speculative import AUTO_NEAR, AUTO_STEPS, Speculation
from tests.util import batches, built, tiny_cfg, train, weights

# (2 shared cache slots for the tiny model's layers, no RAM pool: a kept gradient is written to disk)
DISK = ("eps.tier=disk", "eps.host_cache_layers=2", "eps.grad_ram_layers=0")


@functools.cache
def _host(*over: str) -> dict[str, Any]:
    return train(tiny_cfg(*over))


def _disk(*over: str, steps: int = 3) -> dict[str, Any]:
    cfg = tiny_cfg(*over, *DISK)
    with built(cfg, 10) as runner:
        it = batches(cfg)
        reports = [runner.step(next(it)) for _ in range(steps)]
        return {
            "losses": [r.loss for r in reports],
            "norms": [r.grad_norm for r in reports],
            "reports": reports,
            "weights": weights(runner),
            "summary": runner.eps.tier.summary(),
            "sections": runner.sections(),
        }


@pytest.mark.parametrize(
    "mode,extra",
    [
        ("l2l", ()),
        ("l2l_p", ()),
        ("l2l", ("precision=cmp", "precision.dtype=bf16")),
        ("l2l_p", ("optim=lamb",)),
    ],
    ids=["l2l", "l2l_p", "l2l-cmp-bf16", "l2l_p-lamb"],
)
def test_a_clipped_step_with_no_gradient_kept_is_replayed_equal_to_the_host_tier(
    mode: str, extra: tuple[str, ...]
) -> None:
    """At max_grad_norm 0.24 the first step clips (norm 0.247, crossed only at the last layers): with
    ``eps.clip_redo=replay`` no gradient was kept, so its updates are undone and the step runs again with
    the factor; the weights and losses equal the host tier's (which redoes from the gradients in RAM)."""
    over = (f"mode={mode}", "optim.max_grad_norm=0.24", *extra)
    ref = _host(*over)
    got = _disk(*over, "eps.clip_redo=replay")
    assert got["losses"] == ref["losses"]
    for k in ref["weights"]:
        assert torch.equal(got["weights"][k], ref["weights"][k]), k
    replayed = [r.extra.get("replayed", 0.0) for r in got["reports"]]
    assert replayed[0] == 1.0 and got["sections"]["speculation"]["replayed_steps"] == sum(replayed)
    # the second step clips from its first layers on: held for the factor (parked), as with ``keep``; the
    # first step's gradients were not written, ``keep`` writes them
    kept = _disk(*over, "eps.clip_redo=keep")
    assert [r.extra.get("replayed") for r in kept["reports"]] == [None] * 3 and kept["losses"] == ref[
        "losses"
    ]
    park = {
        k: v["summary"]["bytes_per_param_step"]["write_park"] for k, v in (("replay", got), ("keep", kept))
    }
    assert park["replay"] < park["keep"], park


def test_a_step_that_does_not_clip_writes_no_kept_gradient_unless_asked() -> None:
    """With a limit far above the norms, ``auto`` keeps the gradients in the first step (no norm seen yet)
    and none after; ``keep`` writes each one every step (4 B per parameter beyond the RAM pool)."""
    over = ("mode=l2l", "optim.max_grad_norm=1e9")
    keep = _disk(*over, "eps.clip_redo=keep")
    auto = _disk(*over, "eps.clip_redo=auto")
    wrote = {
        k: [r.extra["disk_write_bytes"] for r in v["reports"]] for k, v in (("keep", keep), ("auto", auto))
    }
    assert wrote["auto"][0] == wrote["keep"][0], wrote
    assert all(a < k for a, k in zip(wrote["auto"][1:], wrote["keep"][1:])), wrote
    assert auto["losses"] == keep["losses"]
    for k in keep["weights"]:
        assert torch.equal(auto["weights"][k], keep["weights"][k]), k
    assert auto["sections"]["speculation"] == {"clip_redo": "auto", "replayed_steps": 0}


def test_auto_keeps_while_a_recent_norm_came_near_the_limit() -> None:
    """``auto``: keep with no norm seen, or while one of the last steps' norms reached AUTO_NEAR of the
    limit; ``keep`` and ``replay`` as they say; a runner that cannot replay always keeps."""
    eps = SimpleNamespace(worker=None, tier=SimpleNamespace(clip_redo="auto"))
    spec = Speculation(eps, replay=True)  # type: ignore[arg-type]
    assert spec.keeps(1.0)
    spec._recent.extend([0.1, 0.2])
    assert not spec.keeps(1.0)
    spec._recent.append(AUTO_NEAR)
    assert spec.keeps(1.0)
    spec._recent.extend([0.1] * AUTO_STEPS)  # the near one is no longer recent
    assert not spec.keeps(1.0)
    eps.tier.clip_redo = "keep"
    assert spec.keeps(1.0)
    eps.tier.clip_redo = "replay"
    assert not spec.keeps(1e-9)
    assert Speculation(eps).keeps(1e9)  # type: ignore[arg-type]


def test_clip_redo_takes_three_values() -> None:
    problems = [
        str(p) for p in validate(tiny_cfg("eps.tier=disk", "eps.clip_redo=sometimes"), check_files=False)
    ]
    assert problems == ["eps.clip_redo: got 'sometimes'; allowed: auto, keep, replay"]
