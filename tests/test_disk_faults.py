"""The disk tier under failed writes (issue 36): a write, park or commit record refused (ENOSPC or EIO,
injected with ``L2L_FAULT_ENOSPC`` / ``L2L_FAULT_EIO=<path part>[@n]``) stops the run with one line, and the
state a resume finds is the last one whose every write succeeded: resumed, the run ends bit-identical to an
uninterrupted one, with no checkpoint of its own (``trainer.save_every=0``, the default)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from l2l_cli import problems
from l2l_cli.compose import compose
from l2l_cli.engine.tiers.disk import writeback
from l2l_cli.train import run_job
from tests.util import TINY

STEPS = 4
# 5 layers, 3 of them in RAM, no RAM for gradients and clipping certain: every step writes layer files
# (updates), parks gradients on disk and writes the commit record
COMMON = [*TINY, "mode=l2l", "eps.tier=disk", f"trainer.max_steps={STEPS}", "trainer.save_final=true",
          "task.num_train=256", "task.num_eval=16", "eps.host_cache_layers=3", "eps.grad_ram_gb=0",
          "optim.max_grad_norm=1e-9"]  # fmt: skip


def _run(run: Path, *extra: str) -> str:
    return run_job(compose([*COMMON, *extra]), run)


@functools.cache
def _reference(root: str) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """The uninterrupted run's final weights, and the path of every write the tier made, in order."""
    run = Path(root) / "ref"
    seen: list[str] = []
    real = writeback.writing

    def counted(path: Any) -> Any:
        seen.append(str(path))
        return real(path)

    writeback.writing = counted  # type: ignore[assignment]
    try:
        assert _run(run) == "ok"
    finally:
        writeback.writing = real  # type: ignore[assignment]
    return load_file(run / "final" / "model.safetensors"), tuple(seen)


@pytest.fixture(scope="module")
def ref_root(tmp_path_factory: Any) -> Path:
    return tmp_path_factory.mktemp("disk-faults-ref")


def _faulted(monkeypatch: Any, capsys: Any, run: Path, kind: str, fault: str, *extra: str) -> list[str]:
    """A run with the ``kind`` fault (ENOSPC | EIO) at ``fault``; its stderr lines."""
    monkeypatch.setattr(problems, "_FAULT" if kind == "ENOSPC" else "_FAULT_EIO", fault)
    monkeypatch.setattr(problems, "_fault_seen", [0])
    capsys.readouterr()
    status = _run(run, *extra)
    monkeypatch.undo()
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == "error", (status, lines)
    return lines


def _resumed_equals_the_reference(run: Path, ref: dict[str, torch.Tensor], capsys: Any) -> None:
    status = _run(run, f"trainer.resume={run}")
    err = capsys.readouterr().err
    assert status == "ok", err[-2000:]
    got = load_file(run / "final" / "model.safetensors")
    assert got.keys() == ref.keys()
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == []


def test_a_failed_commit_record_is_never_adopted_as_if_it_had_succeeded(
    tmp_path: Path, ref_root: Path, monkeypatch: Any, capsys: Any
) -> None:
    """Item 1: the 4th commit record (step 3) finds the disk full; with no checkpoint to fall back on
    (save_every=0), step 4 must not overwrite the slots the record of step 2 names, and the run stops naming
    commit.json. Resumed from the record of step 2, it ends bit-identical to the uninterrupted run."""
    ref, _ = _reference(str(ref_root))
    run = tmp_path / "run"
    lines = _faulted(monkeypatch, capsys, run, "ENOSPC", f"{run}/eps/commit.json@4")
    assert len(lines) == 1 and lines[0].startswith(
        f"l2l: error: disk full: no space left writing {run}/eps/"
    ), lines
    assert "commit.json" in lines[0]
    _resumed_equals_the_reference(run, ref, capsys)
