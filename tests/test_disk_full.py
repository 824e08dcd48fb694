"""A full disk: a run whose checkpoint, disk-EPS or metrics write is refused with ENOSPC (injected with
``L2L_FAULT_ENOSPC=<path part>[@n]``) stops with exit 1 and one line naming the path and the free space;
the last committed state loads and the resumed run ends bit-identical to an uninterrupted one."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.util import TINY, l2l

COMMON = [
    *TINY,
    "trainer.max_steps=6",
    "trainer.save_every=1",
    "trainer.save_final=true",
    "task.num_train=256",
    "task.num_eval=16",
]
# what fills the disk -> (the fault, the run's overrides); one reference: the disk tier's weights equal the
# host tier's bit for bit (tests/test_disk_tier.py), and L2L-p's equal L2L's (tests/test_l2l_p.py)
CASES = {
    "checkpoint": ("tmp-step_4", ["mode=l2l_p"]),
    "metrics": ("metrics.jsonl@4", ["mode=l2l"]),
    "eps commit": ("eps/commit.json@4", ["mode=l2l", "eps.tier=disk"]),
}


@cache
def reference(root: str) -> dict[str, torch.Tensor]:
    run = Path(root) / "ref"
    r = l2l("train", *COMMON, "mode=l2l", f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr[-2000:]
    return load_file(str(run / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def ref_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("disk-full-ref")


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c == "metrics" else c for c in CASES]
)  # metrics.jsonl's guard is the checkpoint's guard (problems.py); -m slow runs it too
def test_a_full_disk_stops_in_one_line_and_the_run_resumes_bit_for_bit(tmp_path, ref_root, case: str) -> None:
    fault, overrides = CASES[case]
    run = tmp_path / "run"
    r = l2l("train", *COMMON, *overrides, f"hydra.run.dir={run}", env={"L2L_FAULT_ENOSPC": fault})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith(f"l2l: error: disk full: no space left writing {run}/")
    assert fault.split("@")[0] in lines[0] and " free there)" in lines[0] and "Traceback" not in r.stderr
    assert not list((run / "checkpoints").glob(".tmp-*"))  # the partial checkpoint is gone
    r = l2l("train", f"trainer.resume={run}")
    assert r.returncode == 0, r.stderr[-2000:]
    got, ref = load_file(str(run / "final" / "model.safetensors")), reference(str(ref_root))
    assert got.keys() == ref.keys()
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == []
