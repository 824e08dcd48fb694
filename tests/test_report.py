"""``l2l report`` on real run directories: its numbers are the run files' numbers, OOM runs (a real
out-of-memory on the simulated device) and crashed runs are rows, plots are real images, bad input is
one line and exit code 2."""

from __future__ import annotations

import csv
import itertools
import json
import os
import shutil
from pathlib import Path

import pytest

from l2l_cli.report import build
from l2l_cli.report import main as report_main
from tests.util import TINY, l2l

# 3 steps of 4 samples: one epoch of the 12-sample synthetic task (so the report shows its accuracy).
# baseline keeps all layers, gradients and optimizer state on the device: 2 layers fit in 1.5 MiB, 6 do
# not; L2L with the stash in host memory needs the same ~0.7 MiB at any depth
BUDGET_GB = 1.5 / 1024
SWEEP = [
    "-m",
    *TINY,
    "mode=baseline,l2l_stash_cpu",
    "model.num_layers=2,6",
    "batch.size=4",
    "batch.ubatch_size=4",
    "trainer.max_steps=3",
    "task.num_train=12",
    "task.num_eval=8",
    "device=sim",
    f"sim.memory_gb={BUDGET_GB}",
]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real multirun: 4 jobs, one of them out of memory."""
    out = tmp_path_factory.mktemp("runs") / "sweep"
    r = l2l("train", *SWEEP, f"hydra.sweep.dir={out}")
    assert r.returncode == 0, r.stderr  # an OOM job is a result, not a failure of the sweep
    return out


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def md_rows(path: Path) -> list[dict[str, str]]:
    """The first markdown table of report.md, as header -> cell dicts."""
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    body = []
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split(" | ")]
        if len(cells) != len(header):
            break  # the next table
        body.append(dict(zip(header, cells, strict=True)))
    return body


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_report_numbers_are_the_run_files_numbers(sweep: Path, tmp_path: Path) -> None:
    assert report_main([str(sweep), "--out", str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "report.csv")
    assert [r["run"] for r in rows] == ["0", "1", "2", "3"]
    for row in rows:
        s = summary(sweep / row["run"])
        memory = json.loads((sweep / row["run"] / "memory.json").read_text())
        assert row["status"] == s["status"]
        assert int(row["device_peak_bytes"]) == s["device_peak_bytes"]
        assert int(row["device_budget_bytes"]) == memory["device"]["budget_bytes"]
        for key in ("method", "precision", "num_layers", "ubatch_size", "num_ubatches", "batch_size"):
            assert row[key] == str(s["config"][key])
        if s["status"] == "ok":
            assert float(row["samples_per_s"]) == s["samples_per_s"]
            assert float(row["step_time_s"]) == s["step_time_s"]
            assert int(row["params"]) == s["params"]
            assert float(row["eval_accuracy"]) == s["eval"]["accuracy"]
            for phase, seconds in s["time_breakdown_s"].items():
                assert float(row[f"time_{phase}_s"]) == seconds
            assert int(row["h2d_bytes"]) == memory["transfer"]["h2d_bytes"]

    table = md_rows(tmp_path / "report.md")
    assert len(table) == 4
    for cells in table:
        s = summary(sweep / cells["RUN"])
        if s["status"] == "ok":
            assert cells["THROUGHPUT (SAMPLES/S)"] == f"{s['samples_per_s']:.2f}"
            assert cells["MEMORY (MiB)"] == f"{s['device_peak_bytes'] / 2**20:.1f}"
            assert cells["ACCURACY (%)"] == f"{100 * s['eval']['accuracy']:.2f}"
        assert cells["#LAYER"] == str(s["config"]["num_layers"])


def test_oom_runs_are_oom_rows_and_the_stash_on_cpu_is_flat(sweep: Path, tmp_path: Path) -> None:
    report = build([str(sweep)], tmp_path, plots=False)
    by = {(r.get("method"), r.get("num_layers")): r for r in report.runs}
    assert by[("baseline", 2)].ok and by[("baseline", 6)].status == "oom"
    assert by[("l2l-stash-cpu", 2)].ok and by[("l2l-stash-cpu", 6)].ok
    assert by[("l2l-stash-cpu", 6)].peak_bytes == by[("l2l-stash-cpu", 2)].peak_bytes
    cells = {(c["METHOD"], c["#LAYER"]): c for c in md_rows(tmp_path / "report.md")}
    oom = cells[("baseline", "6")]
    assert oom["MEMORY (MiB)"] == "OOM" and oom["THROUGHPUT (SAMPLES/S)"] == "-"
    assert oom["NOTE"].startswith("oom: device out of memory")
    assert cells[("baseline", "2")]["NOTE"] == ""
    assert "## Out of memory and failed runs" in (tmp_path / "report.md").read_text()


def test_plots_are_written_and_are_images(sweep: Path, tmp_path: Path) -> None:
    import matplotlib.image

    report = build([str(sweep)], tmp_path)
    names = {name for name, _ in report.plots}
    assert names == {"vs_depth.png", "time_breakdown.png", "loss.png", "eval.png"}
    for name in names:
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        pixels = matplotlib.image.imread(png)
        assert pixels.std() > 0.05, f"{name} is blank"
        assert f"]({name})" in (tmp_path / "report.md").read_text()


def test_plots_name_model_task_and_mode_come_as_svg_too_at_200_dpi(sweep: Path, tmp_path: Path) -> None:
    from PIL import Image

    from l2l_cli.report.plots import style

    report = build([str(sweep)], tmp_path)
    for name, _ in report.plots:
        png, svg = tmp_path / name, (tmp_path / name).with_suffix(".svg")
        assert [round(d) for d in Image.open(png).info["dpi"]] == [200, 200], name
        text = svg.read_text()
        assert text.lstrip().startswith("<?xml") and "<svg" in text
        assert "bert-tiny · synthetic" in text, name  # what every run shares, in the title
    loss = (tmp_path / "loss.svg").read_text()
    for legend in ("baseline L2", "l2l-stash-cpu L2", "l2l-stash-cpu L6"):  # what differs, in the legend
        assert legend in loss
    assert "stroke-dasharray" in loss  # the second curve is dashed, not hidden under the first
    looks = [(style(i)["color"], style(i)["marker"], style(i)["linestyle"]) for i in range(8)]
    assert all(
        a[k] != b[k] for a, b in itertools.pairwise(looks) for k in range(3)
    )  # neighbours differ in all three
    assert len({m for _, m, _ in looks}) == 8


def test_crashed_and_config_failed_runs_are_error_rows(sweep: Path, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    crashed = root / "crashed"
    job = next(d for d in sorted(sweep.iterdir()) if d.is_dir() and summary(d)["config"]["mode"] == "l2l")
    shutil.copytree(job, crashed)  # an L2L job that "died" before writing its summary
    (crashed / "summary.json").unlink()
    with (crashed / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "loss": 0.6')  # torn by the crash
    refused = root / "refused"
    refused.mkdir()
    (refused / "summary.json").write_text(json.dumps({"status": "error", "error": "config: bad", "steps": 0}))
    report = build([str(root)], tmp_path / "out", plots=False)
    by = {r.name: r for r in report.runs}
    assert set(by) == {"crashed", "refused"}
    assert by["crashed"].status == "error" and "no summary.json" in (by["crashed"].error or "")
    expected = summary(job)["config"]
    for key in ("method", "num_layers", "precision", "batch_size", "ubatch_size", "seq_len"):  # from .hydra/
        assert by["crashed"].get(key) == expected[key]
    assert [m.step for m in by["crashed"].metrics] == [1, 2, 3]
    assert by["refused"].status == "error" and by["refused"].error == "config: bad"
    cells = {c["RUN"]: c for c in md_rows(tmp_path / "out" / "report.md")}
    assert cells["crashed"]["MEMORY (MiB)"] == "ERROR" and cells["crashed"]["METHOD"] == "l2l-stash-cpu"
    assert cells["refused"]["NOTE"] == "error: config: bad"


def test_a_folder_of_sweeps_and_single_runs(sweep: Path, tmp_path: Path) -> None:
    root = tmp_path / "outputs"
    shutil.copytree(sweep, root / "sweep")
    shutil.copytree(sweep / "0", root / "single")
    (root / "sweep" / "report").mkdir()  # an earlier report inside the sweep is not a run
    for n in (10, 9):  # numbered runs sort as numbers, not as text
        shutil.copytree(sweep / "1", root / "sweep" / str(n))
    report = build([str(root)])
    assert [r.name for r in report.runs] == [
        "single",
        "sweep/0",
        "sweep/1",
        "sweep/2",
        "sweep/3",
        "sweep/9",
        "sweep/10",
    ]
    assert report.out == root / "report" and (root / "report" / "report.csv").is_file()


def test_the_cli_prints_the_table(sweep: Path, tmp_path: Path) -> None:
    r = l2l("report", str(sweep), "--out", str(tmp_path), "--no-plots")
    assert r.returncode == 0, r.stderr
    for header in (
        "METHOD",
        "PRECISION",
        "UBATCH SIZE",
        "#UBATCHES",
        "DEVICE BATCH SIZE",
        "#LAYER",
        "#PARAMETERS",
        "THROUGHPUT (SAMPLES/S)",
        "MEMORY (MiB)",
    ):
        assert header in r.stdout
    assert "OOM" in r.stdout and "l2l-stash-cpu" in r.stdout and "wrote report.md, report.csv" in r.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{tmp}/nope"], "does not exist"),
        (["{tmp}/empty"], "no runs under"),
        (["{tmp}/file.txt"], "is not a directory"),
        ([], "the following arguments are required"),
        (["--bogus", "{tmp}"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args: list[str], message: str, tmp_path: Path, capsys) -> None:
    (tmp_path / "empty" / "deeper").mkdir(parents=True)
    (tmp_path / "file.txt").write_text("x")
    code = report_main([a.format(tmp=tmp_path) for a in args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("l2l: ") and message in err and err.count("\n") == 1


def test_bad_input_through_the_real_cli(tmp_path: Path) -> None:
    r = l2l("report", str(tmp_path / "nope"))
    assert r.returncode == 2 and r.stderr.startswith("l2l: ") and "Traceback" not in r.stderr


# --------------------------------------------------------------------------------------------------
# What `l2l plan --scaling` wrote: the figures linked and §7's limits, from the folder or a parent of it


@pytest.fixture(scope="module")
def scaling(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real `l2l plan --scaling` output (6 model sizes), one folder down from its parent."""
    from l2l_cli.plan.cli import main as plan_main

    out = tmp_path_factory.mktemp("plan") / "layered_ga_scaling"
    assert plan_main(["--scaling", "hardware=a100-80g", "plan.scaling_points=6", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("where", ["itself", "parent"])
def test_report_links_the_scaling_figures_and_gives_the_limits(
    scaling: Path, tmp_path: Path, where: str, capsys
) -> None:
    summary = json.loads((scaling / "scaling.json").read_text())
    target = scaling if where == "itself" else scaling.parent
    assert report_main([str(target), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "## Layered-GA scaling" in md and not (tmp_path / "report.csv").exists()  # no runs, no runs table
    for name in ("figure4", "figure5", "figure8"):
        png, svg = scaling / f"{name}.png", scaling / f"{name}.svg"
        assert f"]({os.path.relpath(png, tmp_path)})" in md and f"]({os.path.relpath(svg, tmp_path)})" in md
        assert (tmp_path / os.path.relpath(png, tmp_path)).resolve() == png.resolve()  # the link resolves
    assert f"[scaling.csv]({os.path.relpath(scaling / 'scaling.csv', tmp_path)})" in md
    rows = {r["figure"]: r for r in read_csv(tmp_path / "limits.csv")}
    assert set(rows) == {"figure4", "figure5", "figure8"}
    for fig, key in (("figure4", "limits"), ("figure5", "limits_figure5"), ("figure8", "limits_figure8")):
        for k, v in summary[key].items():
            assert rows[fig][k] == ("" if v is None else str(v))  # the plan's numbers, unchanged
    assert float(rows["figure8"]["ethernet_slowdown_x160"]) == summary["ethernet_slowdown_x160"]
    month = summary["limits"]["one_month_params"]
    assert f"| largest trained in one month | {month / 1e12:.3g} T |" in md
    out = capsys.readouterr().out
    assert "§7 limits" in out and "wrote report.md, limits.csv" in out


def test_report_of_runs_and_a_scaling_folder_together(sweep: Path, scaling: Path, tmp_path: Path) -> None:
    assert report_main([str(sweep), str(scaling), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "4 runs" in md and "## Layered-GA scaling" in md
    assert len(read_csv(tmp_path / "report.csv")) == 4 and len(read_csv(tmp_path / "limits.csv")) == 3


def test_long_names_keep_headers_whole_and_the_legend_off_the_curves(
    sweep: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """Issue 40 item 9h: runs with long names cut the table's headers to ``LO…`` at 240 columns, and the
    loss plot's legend (each checkpoint's full path) covered the curves."""
    from l2l_cli.report import columns, plots, print_tables

    runs = tmp_path / "runs"
    for i in ("0", "1", "3"):  # the runs that trained
        run = runs / f"run_{i}-with-a-rather-long-descriptive-name-of-the-experiment-and-its-settings-lr-3e-3"
        shutil.copytree(sweep / i, run)
        s = json.loads((run / "summary.json").read_text())
        s["config"]["model"] = f"pretrained:/home/someone/models/checkpoints/deep/folder/minilm-{i}"
        (run / "summary.json").write_text(json.dumps(s))
    seen: dict[str, tuple] = {}

    def save(fig, path: Path, tight: bool = True) -> None:
        fig.canvas.draw()
        ax = fig.axes[0]
        legend = ax.get_legend()
        if legend is not None:
            texts = [t.get_text() for t in legend.get_texts()]
            box, area = legend.get_window_extent(), ax.get_window_extent()
            seen[path.name] = (texts, box.x0 >= area.x1)

    monkeypatch.setattr(plots, "_save", save)
    report = build([str(runs)], tmp_path / "out")
    capsys.readouterr()
    print_tables(report)
    out = capsys.readouterr().out
    for c in columns(report.runs):
        assert c.header in out, c.header
    texts, outside = seen["loss.png"]
    assert outside and texts and all("/" not in t for t in texts), texts
    assert any("minilm-0" in t for t in texts)
