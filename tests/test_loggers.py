"""Experiment loggers (``logger=``): what each writes into the run dir, ``none``, a missing optional one, and
train.log's record of skipped steps. The CSV and TensorBoard contents of a real run are checked in
test_user_session.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from l2l_cli.compose import compose
from l2l_cli.config.validate import validate
from l2l_cli.rundir import RunFiles, installed, logger_names, make_loggers
from l2l_cli.train import run_job
from tests.util import tiny_cfg

SMALL = ["trainer.max_steps=2", "task.num_train=64", "task.num_eval=16"]


def test_logger_names() -> None:
    """auto: csv and tensorboard (a dependency); none: only train.log's text logger (metrics.jsonl and
    eval.jsonl are the run dir's contract, written whatever the loggers)."""
    assert logger_names("auto") == ["csv", "tensorboard"] and logger_names("none") == []
    assert logger_names(["csv", "wandb"]) == ["csv", "wandb"]
    kinds = [type(x).__name__ for x in make_loggers("none", RunFiles(Path("."), enabled=False))]
    assert kinds == ["TextLogger"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("foo", "logger: got 'foo'; allowed: auto, csv, tensorboard, wandb, none"),
        ("[none,csv]", "none cannot be combined"),
        ("[csv,csv]", "a logger is named twice"),
    ],
)
def test_bad_logger_values_are_one_line(value: str, message: str) -> None:
    assert any(message in str(p) for p in validate(compose([f"logger={value}"])))


@pytest.mark.skipif(installed("wandb"), reason="wandb is installed here")
def test_wandb_without_the_package_is_refused_before_the_run() -> None:
    (problem,) = validate(compose(["logger=[csv,wandb]"]))
    assert (
        str(problem)
        == "logger: wandb is not installed (pip install wandb); choose csv or none, or install it"
    )


def test_skipped_steps_are_in_train_log(tmp_path, caplog) -> None:
    cfg = tiny_cfg(
        *SMALL, "optim.lr=1e30", "optim.warmup_ratio=0", "trainer.max_steps=6", "trainer.max_bad_steps=2"
    )
    with caplog.at_level(logging.INFO, logger="l2l"):
        assert run_job(cfg, tmp_path) == "error"
    skipped = [r.getMessage() for r in caplog.records if "skipped: non-finite" in r.getMessage()]
    assert len(skipped) == 2 and skipped[0].startswith("step ")
    assert any("run ended: error" in r.getMessage() for r in caplog.records)  # and the summary


def test_wandb_gets_every_logged_step_and_eval(tmp_path, monkeypatch) -> None:
    """The wandb logger against a stand-in for the package (no account, no network): it is initialised once
    with the run's config, gets each logged step and the evaluation at their steps, and is finished."""
    import importlib.machinery
    import sys
    import types

    calls: list[tuple] = []

    class Run:
        def log(self, values: dict, step: int) -> None:
            calls.append(("log", step, values))

        def finish(self) -> None:
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    assert run_job(tiny_cfg(*SMALL, "logger=wandb"), tmp_path) == "ok"
    (init,) = [c for c in calls if c[0] == "init"]
    assert init[1]["project"] == "l2l" and init[1]["config"]["model"]["num_layers"] == 3
    steps = [(c[1], sorted(c[2])) for c in calls if c[0] == "log"]
    assert (
        [s for s, _ in steps] == [1, 2, 2]
        and "train/loss" in steps[0][1]
        and steps[2][1] == ["eval/accuracy"]
    )
    assert calls[-1] == ("finish",)
    written = {p.name for p in tmp_path.iterdir()}  # wandb alone: no CSV, no event files; the contract stays
    assert {"metrics.jsonl", "eval.jsonl", "summary.json"} <= written and not written & {
        "metrics.csv",
        "tensorboard",
    }


def test_csv_and_tensorboard_carry_tokens_per_s_and_perplexity(tmp_path: Path) -> None:
    """metrics.csv holds what metrics.jsonl holds (tokens_per_s, a language model's perplexity), and so do
    TensorBoard's train/* scalars (docs/runs.md)."""
    import csv

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from l2l_cli.rundir import CsvLogger, TensorBoardLogger
    from l2l_cli.runfiles import MetricsRow

    files = RunFiles(tmp_path)
    row = MetricsRow(
        step=1, loss=2.0, lr=1e-3, samples_per_s=4.0, tokens_per_s=512.0, extra={"perplexity": 7.5}
    )
    for logger in (CsvLogger(files), TensorBoardLogger(files)):
        logger.log_step(row)
        logger.close()
    with (tmp_path / "metrics.csv").open(newline="") as f:
        got = next(csv.DictReader(f))
    assert float(got["tokens_per_s"]) == 512.0 and float(got["perplexity"]) == 7.5
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/tokens_per_s", "train/perplexity"} <= set(tags), tags
    assert events.Scalars("train/tokens_per_s")[0].value == 512.0
