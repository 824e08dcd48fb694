"""The relay's device buffers: one weight and one gradient buffer shared by its two slots, a layer at each
end, sized for the largest pair of neighbouring layers rather than twice the largest layer; a pair that is
not neighbours (the head, then the next batch's embeddings) waits for the layer computing now, never
overwriting it."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
import torch

from l2l_cli.data.batches import TrainStream
from l2l_cli.engine.relay import aligned, pair_numel
from l2l_cli.models import POST, PRE
from l2l_cli.session import build
from tests.test_decoder import cfg_for, lm_data, write_checkpoint


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 with a tied head whose embeddings (2048 x 32) outweigh a block (8.5 K) eight times."""
    return write_checkpoint("gpt2", tmp_path_factory.mktemp("relay"))


def test_pair_numel_is_the_largest_neighbouring_pair_or_the_largest_layer() -> None:
    assert pair_numel([10, 3, 3, 3, 11], prefetch=True) == 14  # 3 + 11, not 2 x 11 nor 10 + 11
    assert pair_numel([10, 3, 3, 3, 11], prefetch=False) == 11  # one slot: the largest layer
    assert pair_numel([7], prefetch=True) == 7
    assert pair_numel([], prefetch=True) == 0


@pytest.mark.parametrize(("mode", "device"), [("l2l", "cpu"), ("l2l_p", "cpu"), ("l2l", "sim")])
def test_the_relay_holds_the_largest_pair_of_neighbours_and_never_waits_in_training(
    gpt2: Path, mode: str, device: str
) -> None:
    """The weight buffer is 4 B x (the embeddings + a block), each end 256 B-aligned, and so is the
    gradient buffer where copies run beside the compute (the simulator, CUDA); on a CPU device, whose
    copies are inline, the gradient buffer is the largest layer's: less than the two full slots of the
    largest layer before. The meter counts exactly them; no load in a training step waits for the layer
    computing (each is a neighbour's); each slot's module computes with its layer's weights as the EPS
    sends them."""
    cfg = cfg_for(gpt2, f"mode={mode}", "optim.clip=none", f"device={device}")
    data = lm_data(gpt2)
    with build(cfg, data=data) as s:
        runner = s.runner
        relay, eps = runner.relay, runner.eps  # type: ignore[union-attr]
        sizes = [eps.device_numel(st.kind) for st in eps.layers]
        pair = max(aligned(a) + aligned(b) for a, b in pairwise(sizes))  # each end starts 256 B-aligned
        # the embeddings and the first block, or the last block and the head with the tied tensor
        assert pair == max(aligned(sizes[0]) + aligned(sizes[1]), aligned(sizes[-2]) + aligned(sizes[-1]))
        assert pair < 2 * max(sizes)
        norms = 4 * len(relay.slots)  # each slot's gradient norm (FP32), sent beside its gradient
        assert relay.device_bytes == 4 * pair + 4 * (max(sizes) if device == "cpu" else pair) + norms
        assert relay.device_bytes < 2 * 2 * 4 * max(sizes)  # two slots of the largest layer, weights + grads
        it = TrainStream(data.train, cfg.batch.size, seed=0).batches()
        runner.step(next(it))  # type: ignore[union-attr]
        assert relay.waits == 0 and relay.loads > 0
        assert {(s.w.data_ptr() - relay.w.data_ptr()) % 256 for s in relay.slots} == {0}  # as the buffer
        for _ in range(2):
            runner.step(next(it))  # type: ignore[union-attr]
        # a later step's first load is the embeddings' new version beside their old one, which the
        # backward has just finished with: loaded once that is released, as it always was (their update
        # comes first); no other load waits
        assert relay.waits == 2
        assert runner.acc.meter.peak_parts["layer_slots"] == relay.device_bytes  # type: ignore[union-attr]
        runner.finish_updates()  # type: ignore[union-attr]
        for slot in relay.slots:
            if slot.layer is not None and slot.version == relay._version(slot.layer):
                st = eps[slot.layer]
                torch.testing.assert_close(slot.w[: st.layout.numel], st.send, rtol=0, atol=0)


def test_a_layer_that_does_not_fit_beside_the_one_computing_waits_and_the_head_is_forgotten(
    gpt2: Path,
) -> None:
    """The embeddings after the head (an evaluation's next batch): the prefetch declines (it would overwrite
    the head while it computes); the blocking load waits for the head's release, loads at the other end
    and forgets the head there, whose elements it took; the head comes back whole when asked again."""
    cfg = cfg_for(gpt2, "mode=l2l", "optim.clip=none")
    data = lm_data(gpt2)
    with build(cfg, data=data) as s:
        runner = s.runner
        relay, eps = runner.relay, runner.eps  # type: ignore[union-attr]
        runner.step(next(TrainStream(data.train, cfg.batch.size, seed=0).batches()))  # type: ignore[union-attr]
        runner.finish_updates()  # type: ignore[union-attr]
        head = len(eps) - 1
        assert eps[head].kind == POST and eps[0].kind == PRE
        relay.acquire(head - 1)
        relay.acquire(head, prefetch=0)
        assert relay._holding(0) is None and relay.waits == 0  # the prefetch declined
        head_slot = relay.current
        relay.acquire(0)
        assert relay.waits == 1 and relay.current is not head_slot
        assert head_slot.layer is None  # its elements are the embeddings' now
        torch.testing.assert_close(relay.current.w[: eps[0].layout.numel], eps[0].send, rtol=0, atol=0)
        relay.acquire(head)
        n = eps[head].layout.numel
        torch.testing.assert_close(relay.current.w[:n], eps[head].send, rtol=0, atol=0)
        tied = relay.current.w[n:].view(2048, 32)
        wte = dict(eps[0].layout.views(eps[0].send))["wte.weight"]
        torch.testing.assert_close(tied, wte, rtol=0, atol=0)
