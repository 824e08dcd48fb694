"""Every mode against the reference: baseline_ag weights after 3 steps (FP32, fixed seeds)."""

from __future__ import annotations

import functools

import pytest
import torch

from l2l_cli.models import LayeredModel, make_spec
from l2l_cli.modes.base import ubatch_seed
from tests.util import assert_same_weights, batches, built, tiny_cfg, train

UBATCHES = {1: 8, 2: 4, 4: 2}  # #ubatches -> ubatch size, batch.size 8


@functools.cache
def reference(num_ubatches: int, optim: str) -> dict:
    return train(
        tiny_cfg("mode=baseline_ag", f"batch.ubatch_size={UBATCHES[num_ubatches]}", f"optim={optim}")
    )


@pytest.mark.parametrize("num_ubatches", [1, 2, 4])
def test_baseline_ag_matches_baseline(num_ubatches: int) -> None:
    base = train(tiny_cfg("mode=baseline", "batch.ubatch_size=8"))
    ag = reference(num_ubatches, "adamw")
    assert base["losses"][0] == pytest.approx(ag["losses"][0], rel=1e-5)
    assert_same_weights(base["weights"], ag["weights"])


@pytest.mark.parametrize("optim", ["adamw", "lamb"])
@pytest.mark.parametrize("stash", ["device", "cpu"])
@pytest.mark.parametrize("num_ubatches", [1, 2, 4])
def test_l2l_matches_baseline_ag(num_ubatches: int, stash: str, optim: str) -> None:
    got = train(
        tiny_cfg(
            "mode=l2l", f"mode.stash={stash}", f"batch.ubatch_size={UBATCHES[num_ubatches]}", f"optim={optim}"
        )
    )
    ref = reference(num_ubatches, optim)
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert_same_weights(got["weights"], ref["weights"])


def test_weights_actually_change() -> None:
    """Guards the equivalence tests: three steps move the weights well beyond the tolerance."""
    cfg = tiny_cfg("mode=l2l")
    with built(cfg) as runner:
        before = {n: t.clone() for n, t in runner.hf_tensors()}
    after = train(cfg)["weights"]
    moved = [n for n in before if not torch.allclose(before[n], after[n], rtol=1e-4, atol=1e-6)]
    assert len(moved) > 0.9 * len(before)


def test_l2l_dropout_gradients_equal_autograd_with_same_masks() -> None:
    """Dropout 0.1: the recompute reproduces each layer's masks, so the gradients L2L hands to the EPS equal
    those of one ordinary autograd pass over the whole model that draws the same masks."""
    cfg = tiny_cfg(
        "mode=l2l", "model.dropout=0.1", "optim.clip=none", "batch.ubatch_size=2", "mode.stash=cpu"
    )
    mb = next(batches(cfg))
    with built(cfg) as runner:
        runner.step(mb)
        got = {
            runner.spec.hf_name(st.index, n): v.clone()
            for st in runner.eps.layers
            for n, v in st.layout.views(st.g)
        }
    spec = make_spec(cfg.model, 2)
    model = LayeredModel(spec, seed=cfg.trainer.seed).train()
    n = cfg.batch.size // cfg.batch.ubatch_size
    for u, ub in enumerate(mb.split(n)):

        def seed_fn(layer: int, u: int = u) -> None:
            torch.random.default_generator.manual_seed(ubatch_seed(cfg.trainer.seed, 0, layer, u))

        loss, _ = model(ub, seed_fn=seed_fn)
        (loss / n).backward()
    ref = {name: p.grad for name, p in model.hf_state_dict().items()}
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
    # and the masks matter: without reseeding the reference differs
    model.zero_grad()
    for ub in mb.split(n):
        loss, _ = model(ub)
        (loss / n).backward()
    assert not all(
        torch.allclose(got[k], p.grad, rtol=1e-5, atol=1e-7) for k, p in model.hf_state_dict().items()
    )
