"""The real command line, as a user runs it: run directories, real GLUE data, pretrained checkpoints,
sweeps."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.util import REPO, TINY, l2l

METRICS_KEYS = {"step", "loss", "lr", "samples_per_s", "step_time_s", "device_peak_bytes"}
SUMMARY_KEYS = {"status", "steps", "samples_per_s", "device_peak_bytes", "time_breakdown_s", "eval", "params"}


def read(run: Path) -> tuple[list[dict], dict, dict]:
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return (
        metrics,
        json.loads((run / "memory.json").read_text()),
        json.loads((run / "summary.json").read_text()),
    )


def test_default_run_writes_the_run_dir_contract(tmp_path) -> None:
    r = l2l("train", "trainer.max_steps=6", "trainer.log_every=2", f"hydra.run.dir={tmp_path}", fresh=True)
    assert r.returncode == 0, r.stderr
    metrics, memory, summary = read(tmp_path)
    assert [m["step"] for m in metrics] == [2, 4, 6] and all(m.keys() >= METRICS_KEYS for m in metrics)
    assert summary.keys() >= SUMMARY_KEYS and summary["status"] == "ok" and summary["steps"] == 6
    assert summary["config"]["method"] == "l2l" and summary["config"]["model"] == "bert-tiny"
    assert set(summary["time_breakdown_s"]) >= {"forward", "backward", "optimizer", "transfer"}
    assert summary["recompute"]["policy"] in {"full", "selective", "none"}  # mode.recompute=auto's choice
    assert set(summary["eval"]) == {"accuracy"} and summary["params"] > 4_000_000
    assert (
        memory["device"]["method"] == "torch_dispatch_storage_tracking" and memory["device"]["peak_bytes"] > 0
    )
    assert memory["device"]["peak_bytes"] == summary["device_peak_bytes"] == metrics[-1]["device_peak_bytes"]
    assert {"master", "grads", "optimizer_state"} <= set(memory["host"]["parts"])
    assert (tmp_path / ".hydra" / "config.yaml").is_file() and (tmp_path / "train.log").is_file()
    assert "l2l run: ok" in r.stdout and "eval accuracy" in r.stdout


def test_rte_from_glue_files_with_baseline_ag(glue, tmp_path) -> None:
    r = l2l(
        "train",
        "task=rte",
        f"task.data_dir={glue / 'RTE'}",
        "model=bert-tiny",
        "mode=baseline_ag",
        "batch.size=32",
        "batch.ubatch_size=8",
        "trainer.max_steps=3",
        "trainer.save_final=true",
        f"hydra.run.dir={tmp_path}",
    )
    assert r.returncode == 0, r.stderr
    _, _, summary = read(tmp_path)
    assert summary["config"]["data_source"].startswith("tsv:") and 0.3 < summary["eval"]["accuracy"] < 0.7
    assert (tmp_path / "final" / "config.json").is_file() and (
        tmp_path / "final" / "model.safetensors"
    ).is_file()
    assert json.loads((tmp_path / "final" / "config.json").read_text())["id2label"] == {
        "0": "entailment",
        "1": "not_entailment",
    }


def test_mrpc_with_l2l_from_pretrained_minilm(glue, minilm, tmp_path) -> None:
    r = l2l(
        "train",
        "task=mrpc",
        f"task.data_dir={glue / 'MRPC'}",
        "mode=l2l",
        f"model.pretrained={minilm}",
        "batch.size=16",
        "batch.ubatch_size=8",
        "trainer.max_steps=2",
        "task.max_train_samples=64",
        "task.max_eval_samples=64",
        f"hydra.run.dir={tmp_path}",
    )
    assert r.returncode == 0, r.stderr
    _, _, summary = read(tmp_path)
    assert set(summary["eval"]) == {"accuracy", "f1"}
    assert summary["config"]["num_layers"] == 6 and summary["params"] > 22_000_000
    log = (tmp_path / "train.log").read_text()
    assert "newly initialized: classifier" in log
    # issue 40 item 9e: the checkpoint by its own name, not the model group's default (bert-tiny)
    assert "model     nreimers/MiniLM-L6-H384-uncased (bert, pretrained): 6 layers" in log
    assert "bert-tiny" not in log


def test_sweep_runs_every_job_and_a_failed_job_does_not_stop_the_others(tmp_path) -> None:
    r = l2l(
        "train",
        "-m",
        "mode=baseline,baseline_ag",
        "batch.ubatch_size=4,8",
        "batch.size=8",
        *TINY[:5],
        "trainer.max_steps=2",
        "trainer.progress=none",
        "logger=none",
        cwd=tmp_path,
    )
    assert r.returncode == 1  # one job could not run
    assert "will fail" in r.stderr
    # the sweep says where it writes, at the start and at the end (its ${now:} resolved once, for both)
    first, last = r.stdout.strip().splitlines()[0], r.stdout.strip().splitlines()[-1]
    assert first.startswith("l2l: sweep of 4 jobs into outputs/multirun/")
    sweep = first.split(" into ")[1].rstrip("/")
    assert last == f"l2l: sweep done (3 ok, 1 bad config) in {sweep}/; tables and plots: l2l report {sweep}"
    tmp_path = tmp_path / sweep
    jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and (p / "summary.json").exists())
    statuses = {}
    for job in jobs:
        s = json.loads((job / "summary.json").read_text())
        statuses[(s.get("config", {}).get("mode") or "baseline", job.name)] = s["status"]
    assert len(jobs) == 4 and sorted(statuses.values()) == ["error", "ok", "ok", "ok"]


def test_oom_exit_code_and_message(tmp_path) -> None:
    r = l2l(
        "train", *TINY, "mode=baseline_ag", "device=sim", "sim.memory_gb=0.0001", f"hydra.run.dir={tmp_path}"
    )
    assert r.returncode == 3
    assert "Traceback" not in r.stdout + r.stderr
    assert (
        "mode.stash=cpu" in r.stdout
        and json.loads((tmp_path / "summary.json").read_text())["status"] == "oom"
    )


def test_help_lists_groups_and_options() -> None:
    r = l2l("train", "--help")
    assert r.returncode == 0
    for text in (
        "model: bert-base, bert-large",
        "mode: baseline, baseline_ag, l2l",
        "precision: amp, cmp, fp32",
        "batch:",
    ):
        assert text in r.stdout
    top = l2l("--help")
    assert top.returncode == 0 and "train" in top.stdout and "report" in top.stdout


def test_version() -> None:
    r = l2l("--version", fresh=True)
    assert r.returncode == 0 and r.stdout.startswith("l2l 0.1.0 (python ") and "torch 2." in r.stdout


def test_train_help_describes_every_key_and_option() -> None:
    from l2l_cli.config.help import describe

    r = l2l("train", "--help")
    assert r.returncode == 0
    keys = describe()
    assert len(keys) > 90 and all(text for _, _, text in keys), [k for k, _, t in keys if not t]
    for key, _, text in keys:
        section = r.stdout.split("Keys (key=value")[1]  # (a wrapped group description may start "task.x=")
        line = next((ln for ln in section.splitlines() if ln.strip().startswith(f"{key}=")), "")
        assert line.endswith(text), key  # one line each: key=default, then what it does
    assert "bert-large       BERT-Large (Devlin et al. 2019" in r.stdout
    assert "csv              Your own CSV/TSV files" in r.stdout


@pytest.mark.slow
def test_readme_default_run_learns(tmp_path) -> None:
    """README's main job: `l2l train` on the built-in default (about a minute on 2 cores)."""
    r = l2l("train", f"hydra.run.dir={tmp_path}", timeout=600)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["eval"]["accuracy"] > 0.9


def test_installed_wheel_finds_its_config(tmp_path) -> None:
    """A non-editable install carries conf/ and recipes/ inside the package."""
    import subprocess
    import sys

    wheel_dir, site = tmp_path / "wheel", tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheel_dir), str(REPO)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot build a wheel here: {r.stderr[-300:]}")
    (wheel,) = wheel_dir.glob("l2l-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
    )
    assert (site / "l2l_cli" / "conf" / "config.yaml").is_file() and (site / "l2l_cli" / "recipes").is_dir()
    env = {"PYTHONPATH": str(site)}
    code = "import l2l_cli.paths as p; print(p.conf_dir())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**__import__("os").environ, **env},
    )
    assert out.stdout.strip() == str(site / "l2l_cli" / "conf")
    r = l2l("train", "--help", cwd=tmp_path, env=env)
    assert r.returncode == 0 and "mode: baseline, baseline_ag, l2l" in r.stdout


def test_train_help_wraps_descriptions_at_word_boundaries() -> None:
    """Issue 40 item 9i: ``l2l train --help`` cut group options' descriptions mid-word ("about a minut...");
    each is its whole first sentence, wrapped at spaces under its text."""
    from l2l_cli.cli import train_help
    from l2l_cli.compose import GROUPS, group_description, group_options

    text = train_help()
    groups = text.split("Keys (key=value")[0]
    assert not re.search(r"\w\.\.\.$", groups, re.M)  # no word cut short ("minut...")
    flat = " ".join(groups.split())
    for group in GROUPS:
        for option in group_options(group):
            description = group_description(group, option)
            assert description and " ".join(description.split()) in flat, (group, option)  # split at spaces
    assert "bert-tiny        BERT-Tiny (Turc et al. 2019): 2 layers, hidden 128." in text
