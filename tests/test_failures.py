"""Runtime failures as a user meets them: bad input found only at run time (an unreachable hub model or
dataset) exits 2 with one line naming the key and no table of empty fields; an internal failure exits 1 with
one console line and its traceback in train.log. A start that cannot happen leaves no run dir behind, or one
whose summary.json says why."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.util import REPO, TINY, l2l

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # tests never touch the network


def test_an_unreachable_hub_model_is_one_line_naming_the_key_and_no_run_dir(tmp_path) -> None:
    run = tmp_path / "run"
    r = l2l("train", *TINY, "model.pretrained=bert-large-uncsed", f"hydra.run.dir={run}", env=OFFLINE)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("l2l: config error: model.pretrained: bert-large-uncsed cannot be fetched")
    assert "None" not in r.stdout + r.stderr and "Traceback" not in r.stdout + r.stderr
    assert not run.exists()  # refused before the run dir was made


def test_a_dataset_the_hub_cannot_give_marks_the_run_failed_with_the_reason(tmp_path) -> None:
    run = tmp_path / "run"
    r = l2l("train", *TINY, "task=rte", "optim.lr=1e-3", f"hydra.run.dir={run}", env=OFFLINE)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(
        "l2l: config error: task.data_dir: unset, and GLUE rte cannot be loaded from the hub"
    )
    assert "l2l run:" not in r.stdout and "None" not in r.stdout  # no table of a run that never started
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "error" and summary["exit_code"] == 2 and "task.data_dir" in summary["error"]
    assert not (run / "memory.json").exists()


BOOM = """
import sys
from l2l_cli import loop
real = loop.Trainer.account
def account(self, report, step, *args):
    if step == 2:
        raise RuntimeError("boom at step 2")
    real(self, report, step, *args)
loop.Trainer.account = account
from l2l_cli.cli import main
main(sys.argv[1:])
"""


def test_an_internal_failure_is_one_line_with_the_traceback_in_train_log(tmp_path) -> None:
    run = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            BOOM,
            "train",
            *TINY,
            "trainer.max_steps=4",
            "task.num_train=64",
            "task.num_eval=16",
            f"hydra.run.dir={run}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 1
    (line,) = r.stderr.strip().splitlines()
    assert line == f"l2l: error: RuntimeError: boom at step 2 (traceback in {run}/train.log)"
    log = (run / "train.log").read_text()
    assert "Traceback (most recent call last)" in log and "boom at step 2" in log
    assert "Traceback" not in r.stdout and "None" not in r.stdout
    assert "l2l run: error" in r.stdout  # the run had started: its table holds real numbers
    assert json.loads((run / "summary.json").read_text())["status"] == "error"
