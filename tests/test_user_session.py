"""A new user's session, through the real CLI: a finished bert-tiny run, then what users do with it: resume it
(with its own settings; a refused resume leaves it untouched), read its logs (train.log, CSV, TensorBoard),
evaluate it again (``l2l eval`` reproduces its metrics), train on their own CSV files from it and predict."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import pytest

from l2l_cli.preflight import preflight
from l2l_cli.report import build as report
from tests.util import l2l

# bert-tiny on a small synthetic task: 4 steps, an evaluation and a checkpoint every 2, final/ at the end
FINISHED = [
    "model=bert-tiny",
    "task.num_train=96",
    "task.num_eval=40",
    "task.max_seq_len=16",
    "batch.size=16",
    "batch.ubatch_size=8",
    "trainer.max_steps=4",
    "trainer.eval_every=2",
    "trainer.save_every=2",
    "trainer.keep_checkpoints=5",
    "trainer.save_final=true",
    "trainer.progress=plain",
]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A finished run (and its console output); tests copy it before changing it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    r = l2l("train", *FINISHED, f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr
    return run, r.stdout


def _copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_refused_resume_leaves_the_run_as_it_was(finished, tmp_path) -> None:
    run = _copy(finished[0], tmp_path)
    before = _files(run)
    r = l2l("train", f"trainer.resume={run}", "mode=baseline_ag", "model.num_layers=3", "trainer.max_steps=6")
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert any(ln.startswith("l2l: config error: mode: baseline_ag here, l2l in the run") for ln in lines)
    assert any(
        ln.startswith("l2l: config error: model.num_layers: 3 here, 2 in the run being resumed")
        for ln in lines
    )
    assert _files(run) == before  # summary.json, memory.json, .hydra/, train.log, metrics: all unchanged
    (row,) = report([str(run)], tmp_path / "report", plots=False).runs
    assert row.status == "ok" and row.get("method") == "l2l"


def test_resume_inherits_the_runs_settings_and_logs_every_save(finished, tmp_path) -> None:
    run = _copy(finished[0], tmp_path)
    # only what changes is on the command line: the model, batch, data and trainer.save_every=2 are the run's
    r = l2l("train", f"trainer.resume={run}", "trainer.max_steps=8", "trainer.log_every=2")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [f"step_{k}" for k in (2, 4, 6, 8)]
    assert _steps(run) == [1, 2, 3, 4, 6, 8]  # the command line's log_every from the resumed step on
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["resumed_from"]["step"] == 4
    assert summary["config"]["batch_size"] == 16 and summary["config"]["train_samples"] == 96
    log = (run / "train.log").read_text()
    for step in (6, 8):
        saved = f"saved checkpoint step {step} to {run}/checkpoints/step_{step} in "
        assert saved in log and saved in r.stdout
    assert "resume: trainer.max_steps=8 (was 4)" in log
    # the next resume inherits this one's settings (the run's config was updated once the resume loaded)
    assert "max_steps: 8" in (run / ".hydra" / "config.yaml").read_text()


def test_train_log_carries_the_header_saves_evals_and_summary(finished) -> None:
    run, stdout = finished
    log = (run / "train.log").read_text()
    for text in (
        "run ",
        "  mode      l2l (fp32",
        "  model     bert-tiny: 2 layers",
        "  task      synthetic",
        "saved checkpoint step 2",
        "eval at step 2: accuracy",
        "eval at step 4: accuracy",
        "saved final/",
        "run ended: ok",
        "l2l run: ok",
        "eval accuracy",
    ):
        assert text in log, text
    # (mode.recompute=auto, l2l's default, names its choice in the header)
    assert stdout.startswith("l2l · bert-tiny (4.4M params) · synthetic")
    assert stdout.splitlines()[0].endswith(": 4 steps")
    assert "eval 3/3 batches" in stdout  # the evaluation's progress


def test_csv_and_tensorboard_logs_hold_the_logged_metrics(finished) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = finished
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    with (run / "metrics.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [int(t["step"]) for t in table] == [r["step"] for r in rows] == [1, 2, 3, 4]
    for t, r in zip(table, rows, strict=True):
        assert float(t["loss"]) == r["loss"] and float(t["lr"]) == r["lr"]
        assert float(t["time_forward_s"]) == r["phases"]["forward"]
    with (run / "eval.csv").open() as f:
        assert [{k: float(v) for k, v in e.items()} for e in csv.DictReader(f)] == evals
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/samples_per_s", "time/forward_s", "eval/accuracy"} <= set(
        scalars
    )
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [s for s, _ in loss] == [1, 2, 3, 4]
    assert all(math.isclose(v, r["loss"], rel_tol=1e-6) for (_, v), r in zip(loss, rows, strict=True))
    acc = [(e.step, e.value) for e in events.Scalars("eval/accuracy")]
    assert acc == [(e["step"], pytest.approx(e["accuracy"])) for e in evals]


def test_eval_reproduces_the_runs_final_metrics(finished) -> None:
    run, _ = finished
    summary = json.loads((run / "summary.json").read_text())
    r = l2l("eval", str(run), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["weights"] == str(run / "final") and out["examples"] == 40
    assert out["metrics"] == summary["eval"]  # the same dev set, weights and forward: the same numbers


def test_eval_of_any_checkpoint_and_bad_input(finished, capsys) -> None:
    from l2l_cli.evaluate import main

    run, _ = finished
    # the evaluation the run made at step 2, again, from its step-2 checkpoint (in-process: the same code)
    at_2 = next(json.loads(ln) for ln in (run / "eval.jsonl").read_text().splitlines() if '"step": 2' in ln)
    capsys.readouterr()
    assert main("eval", [str(run), "--checkpoint", "step_2", "task.max_eval_samples=40", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"] == {k: v for k, v in at_2.items() if k != "step"}
    for args, message in (
        (["--checkpoint", "step_3"], "l2l: --checkpoint step_3: no checkpoint (checkpoints/step_<k>)"),
        (["task.nope=1"], "l2l: config error: task.nope: unknown key"),
        (["model.num_layers=3"], "l2l: config error: model.num_layers: 3 here, 2 in the run being evaluated"),
    ):
        assert main("eval", [str(run), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1, err


def _write_reviews(path: Path, n: int, seed: int) -> None:
    import random

    rng = random.Random(seed)
    good, bad = ["great", "lovely", "superb", "fine"], ["awful", "dull", "poor", "bad"]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "review", "sentiment"])
        for i in range(n):
            label = rng.choice(["positive", "negative"])
            words = (
                rng.sample(good if label == "positive" else bad, 2)
                + ["film", "plot", "acting"][: rng.randint(1, 3)]
            )
            rng.shuffle(words)
            w.writerow([i, ", ".join(words), label])


def test_own_csv_data_from_a_pretrained_run_then_predict(finished, minilm, tmp_path) -> None:
    final = finished[0] / "final"
    _write_reviews(tmp_path / "train.csv", 64, seed=1)
    _write_reviews(tmp_path / "dev.csv", 24, seed=2)
    data = [
        f"task.files={tmp_path / 'train.csv'}",
        f"task.dev_files={tmp_path / 'dev.csv'}",
        "task.text_fields=[review]",
        "task.label_field=sentiment",
    ]
    bad = preflight(["task=csv", *data[:2], "task.text_fields=[text]", "task.label_field=stars"], False)
    assert [p.key for p in bad] == [
        "task.text_fields",
        "task.label_field",
        "task.text_fields",
        "task.label_field",
    ]
    assert "train.csv has no column text; its columns: id, review, sentiment" in bad[0].message
    run = tmp_path / "csv-run"
    r = l2l(
        "train",
        "task=csv",
        *data,
        f"model.pretrained={final}",
        f"task.tokenizer={minilm}",
        "task.max_seq_len=16",
        "batch.size=16",
        "batch.ubatch_size=8",
        "trainer.max_steps=3",
        "trainer.save_final=true",
        "trainer.progress=plain",
        f"hydra.run.dir={run}",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(
        f"l2l · pretrained {final} (4.4M params) · csv"
    )  # the header names the checkpoint
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["eval"]) == {"accuracy", "f1"} and summary["config"]["train_samples"] == 64
    labels = json.loads((run / "final" / "config.json").read_text())["id2label"]
    assert labels == {"0": "negative", "1": "positive"}  # the training file's labels, sorted
    out = tmp_path / "predictions.jsonl"
    r = l2l("predict", str(run), "--input", str(tmp_path / "dev.csv"), "--output", str(out))
    assert r.returncode == 0, r.stderr
    preds = [json.loads(line) for line in out.read_text().splitlines()]
    assert [p["index"] for p in preds] == list(range(24))
    for p in preds:
        assert p["prediction"] == labels[str(p["label_id"])]
        assert math.isclose(sum(p["probabilities"].values()), 1.0, abs_tol=1e-4)
    # predictions agree with the run's own evaluation of the same file
    with (tmp_path / "dev.csv").open() as f:
        truth = [row["sentiment"] for row in csv.DictReader(f)]
    accuracy = sum(p["prediction"] == t for p, t in zip(preds, truth, strict=True)) / len(truth)
    assert accuracy == pytest.approx(summary["eval"]["accuracy"])


def test_a_fresh_start_into_a_finished_run_is_refused_and_writes_nothing(finished, tmp_path) -> None:
    """A start owns the directory it writes: a fresh run into a finished (or killed) run's dir is refused
    in one line pointing to trainer.resume, before Hydra writes .hydra/; the first run stays as it was. A
    sweep into a directory that holds a sweep is refused the same way."""
    run = _copy(finished[0], tmp_path)
    before = _files(run)
    r = l2l("train", *FINISHED, "trainer.seed=7", "optim.lr=0.5", f"hydra.run.dir={run}")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"l2l: config error: hydra.run.dir: {run} holds a run already")
    assert f"trainer.resume={run}" in lines[0]
    assert _files(run) == before
    sweep = tmp_path / "sweep"
    shutil.copytree(run, sweep / "0")
    before = _files(sweep)
    r = l2l("train", "-m", *FINISHED, "trainer.seed=1,2", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 2 and r.stderr.strip().startswith(
        f"l2l: config error: hydra.sweep.dir: {sweep} holds a run already (0/)"
    ), r.stderr
    assert _files(sweep) == before


def test_a_resume_verifies_the_saved_config_against_the_run(finished, tmp_path) -> None:
    """``.hydra/config.yaml`` edited by hand (task.max_seq_len, trainer.seed) is refused in one line naming
    the file: against the checksum the run noted, and, without it, the keys the checkpoint depends on
    against the checkpoint's own config."""
    from omegaconf import OmegaConf

    run = _copy(finished[0], tmp_path)
    saved = run / ".hydra" / "config.yaml"
    for key, value, drop_sum in (("task.max_seq_len", 24, False), ("trainer.seed", 7, True)):
        original = saved.read_bytes()
        if drop_sum:
            (run / ".hydra" / "config.sha256").unlink()
        cfg = OmegaConf.load(saved)
        OmegaConf.update(cfg, key, value)
        OmegaConf.save(cfg, saved)
        before = _files(run)
        r = l2l("train", f"trainer.resume={run}", "trainer.max_steps=6")
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert lines[0].startswith(f"l2l: config error: trainer.resume: {saved} was changed by hand"), lines
        assert key in lines[0] and _files(run) == before
        saved.write_bytes(original)


def test_eval_verifies_final_and_names_a_damaged_file(finished, tmp_path, capsys) -> None:
    """One flipped bit in final/'s weights, or a truncated file: one line naming it, never a metric of
    damaged weights nor a SafetensorError traceback (also for a final/ without checksums.json)."""
    from l2l_cli.evaluate import main

    run = _copy(finished[0], tmp_path)
    weights = run / "final" / "model.safetensors"
    good = weights.read_bytes()
    data = bytearray(good)
    data[-5] ^= 0x40  # an exponent bit of the last weight
    for damaged, drop_sums in ((bytes(data), False), (good[: len(good) // 2], False), (good[:100], True)):
        weights.write_bytes(damaged)
        if drop_sums:
            (run / "final" / "checksums.json").unlink()
        capsys.readouterr()
        assert main("eval", [str(run)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(run / "final") in err and "Traceback" not in err, err
        assert ("size or checksum differs" in err) != drop_sums


def test_resuming_a_finished_or_damaged_run(finished, tmp_path) -> None:
    """A finished run resumed as it is keeps its final loss and logs no evaluation twice; with its newest
    checkpoint corrupt and a torn last metrics line it resumes from the older one, warning of both."""
    run = _copy(finished[0], tmp_path)
    summary, evals = json.loads((run / "summary.json").read_text()), (run / "eval.jsonl").read_text()
    r = l2l("train", f"trainer.resume={run}")
    assert r.returncode == 0, r.stderr[-2000:]
    again = json.loads((run / "summary.json").read_text())
    assert again["final_loss"] == summary["final_loss"] is not None and again["eval"] == summary["eval"]
    assert (run / "eval.jsonl").read_text() == evals
    state = sorted((run / "checkpoints" / "step_4").glob("*.safetensors"))[0]
    data = bytearray(state.read_bytes())
    data[-3] ^= 0x01
    state.write_bytes(bytes(data))
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 0.')  # a disk that filled during the append
    r = l2l("train", f"trainer.resume={run}")
    assert r.returncode == 0, r.stderr[-2000:]
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("l2l: warning: ")]
    assert any(
        "skipped a corrupt checkpoint" in w and str(run / "checkpoints" / "step_4") in w for w in warnings
    )
    assert any("metrics.jsonl" in w and "not whole records" in w for w in warnings), r.stderr
    assert _steps(run) == [1, 2, 3, 4]
