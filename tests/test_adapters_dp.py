"""LoRA with 2-rank data parallel (issue 38, acceptance 1): each rank trains on its half of the global batch,
the per-layer reduction covers the adapters only, and the adapter after 3 steps equals PEFT's
``get_peft_model`` trained by a plain PyTorch loop on the whole batch, from the same adapter initialization
and data; each rank's frozen base is byte-identical before and after."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from l2l_cli.models.lora import peft_key
from tests.test_adapters import FAMILY, R8, base_tensors, lm_batches, reference
from tests.util import built, tiny_cfg

WORLD = 2


def _ranks_main(jobs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """One rank (spawned by the elastic launcher): per (family, mode) job, 3 steps on this rank's rows of
    the reference's global batches. Returns the trained adapter (rank 0) and whether the base stayed."""
    from l2l_cli.compose import setup

    setup()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    out = []
    for family, mode in jobs:
        whole = tiny_cfg(*FAMILY[family], *R8)  # the reference's config: its batch is the global one
        per_rank = f"batch.size={whole.batch.size // WORLD}"
        cfg = tiny_cfg(*FAMILY[family], *R8, f"mode={mode}", f"dist.nproc={WORLD}", per_rank)
        with built(cfg) as runner:
            before = base_tensors(runner)
            for batch in lm_batches(whole):
                runner.step(batch.split(WORLD)[rank])
            after = base_tensors(runner)
            adapter = {peft_key(n): t.detach().float().clone() for n, t in runner.hf_tensors()}
        kept = bool(before) and before.keys() == after.keys()
        kept = kept and all(torch.equal(v, after[k]) for k, v in before.items())
        out.append({"adapter": adapter if rank == 0 else None, "base_kept": kept})
    return out


def _check(jobs: list[tuple[str, str]], tmp: Path) -> None:
    from l2l_cli.engine.dist import launch

    results = launch(WORLD, _ranks_main, (jobs,))
    for k, (family, mode) in enumerate(jobs):
        assert all(results[r][k]["base_kept"] for r in range(WORLD)), (family, mode)
        got, ref = results[0][k]["adapter"], reference(family, tmp / family)
        assert got.keys() == ref.keys(), (family, mode)
        for name, v in ref.items():
            torch.testing.assert_close(got[name], v, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        assert any("lora_B" in n and v.abs().max() > 0 for n, v in got.items())  # the adapters trained


@pytest.mark.slow  # the 2-rank adapter (tests/README.md)
def test_two_ranks_of_each_family_equal_peft_reference(tmp_path: Path) -> None:
    """Llama, GPT-2 and BERT (r 8, fp32, dropout 0), mode l2l, 2 ranks: PEFT's reference, per family."""
    _check([("llama", "l2l"), ("gpt2", "l2l"), ("bert", "l2l")], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["l2l_p", "baseline_ag"])
def test_two_ranks_in_other_modes_equal_peft_reference(mode: str, tmp_path: Path) -> None:
    _check([("llama", mode), ("gpt2", mode), ("bert", mode)], tmp_path)
