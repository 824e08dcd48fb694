"""Modes and model families are registries: a mode is one file, a family comes from config.json's
model_type, no mode name is compared outside the registry, and the typed run files read old runs."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from l2l_cli.cli import train as cli_train
from l2l_cli.data.batches import Batch
from l2l_cli.modes import DeviceResident, ModeSpec, StepReport, register_mode, unregister_mode
from l2l_cli.report import build as report_build
from l2l_cli.runfiles import SCHEMA_VERSION, MemoryReport, MetricsRow, Summary
from tests.util import REPO, TINY, l2l

PACKAGE = REPO / "l2l_cli"


# ---- a mode is one file ---------------------------------------------------------------------------


class ReversedAGRunner(DeviceResident):
    """Gradient accumulation with the micro-batches taken last to first: the same update as baseline_ag."""

    def step(self, minibatch: Batch) -> StepReport:
        t0, lr = time.perf_counter(), self.lr()
        ubatches = self.to_device(minibatch).split(self.num_ubatches)
        loss = 0.0
        for u in reversed(range(self.num_ubatches)):
            loss = loss + self.forward_backward(ubatches[u], u, 1.0 / self.num_ubatches) / self.num_ubatches
        with self.timer("optimizer"):
            applied, norm = self.update()
        return self.finish(loss, len(minibatch), t0, lr, skipped=not applied, grad_norm=norm)


@pytest.fixture
def reversed_ag():
    spec = register_mode(
        ModeSpec(name="reversed_ag", label="reversed-ag", runner=ReversedAGRunner, description="test mode")
    )
    yield spec
    unregister_mode("reversed_ag")


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


def test_a_mode_registered_from_a_test_file_trains_through_l2l_train(reversed_ag, tmp_path) -> None:
    common = [
        *TINY,
        "trainer.max_steps=3",
        "trainer.save_final=true",
        "task.num_eval=32",
        "task.num_train=256",
    ]
    assert (
        cli_train(["mode=baseline_ag", "mode.name=reversed_ag", *common, f"hydra.run.dir={tmp_path / 'new'}"])
        == 0
    )
    assert cli_train(["mode=baseline_ag", *common, f"hydra.run.dir={tmp_path / 'ref'}"]) == 0
    summary = json.loads((tmp_path / "new" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 3
    assert summary["config"]["method"] == "reversed-ag" and summary["config"]["mode"] == "reversed_ag"
    rows = [json.loads(x) for x in (tmp_path / "new" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    new, ref = _final_weights(tmp_path / "new"), _final_weights(tmp_path / "ref")
    assert new.keys() == ref.keys()
    for k in ref:  # the same sum of micro-batch gradients, in another order
        torch.testing.assert_close(new[k], ref[k], rtol=1e-4, atol=1e-6)
    # the registry, not a list of names, decides what is valid: unknown modes are refused with the list
    assert cli_train(["mode=baseline_ag", "mode.name=nope", *common, f"hydra.run.dir={tmp_path / 'x'}"]) == 2


# registry -> (its names, where they may be compared: the files that register them)
REGISTRIES = {
    "mode": (("baseline", "baseline_ag", "l2l", "l2l_p"), ("modes/",)),
    "family": (("bert", "gpt2", "llama", "mistral", "qwen2"), ("models/",)),
    "task": (
        (
            "glue",
            "synthetic",
            "lm",
            "files",
            "csv",
            "json",
            "cola",
            "sst2",
            "mrpc",
            "qqp",
            "stsb",
            "mnli",
            "qnli",
            "rte",
            "wnli",
        ),
        ("data/",),
    ),
    "tier": (("host", "disk"), ("engine/tiers/",)),
    "optimizer": (("adamw", "lamb"), ("engine/optim.py",)),
    "logger": (("csv", "tensorboard", "wandb"), ("rundir.py",)),
}


def name_comparisons(root: Path, names: tuple[str, ...], allowed: tuple[str, ...]) -> list[str]:
    """Lines outside ``allowed`` that compare something with one of ``names`` (``x == "l2l_p"``,
    ``x in ("host", ...)``, ``mode.name != ...``) or key a dispatch table by them."""
    alt = "|".join(names)
    patterns = [
        re.compile(r"(==|!=)\s*[\"'](" + alt + r")[\"']"),  # x == "l2l_p"
        re.compile(r"[\"'](" + alt + r")[\"']\s*(==|!=)"),  # "disk" != x
        re.compile(r"\bin\s*[(\[{]\s*[\"'](" + alt + r")[\"']"),  # x in ("l2l", "l2l_p")
    ]
    if "l2l_p" in names:  # the mode registry: any test of mode.name, whatever it is compared with
        patterns.append(re.compile(r"mode(\.name)?\s*(==|!=|in)\s"))  # mode.name == ..., s.mode in (...)
    offenders = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(allowed):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if any(p.search(code) for p in patterns):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    return offenders


@pytest.mark.parametrize("registry", sorted(REGISTRIES))
def test_no_registered_name_is_compared_outside_its_registry(registry: str) -> None:
    """Dispatch on a mode, model family, task kind, tier, optimizer or logger *name* lives only in the
    file(s) that register it; everything else reads the spec (ModeSpec, ModelFamily, TaskKind, ...)."""
    names, allowed = REGISTRIES[registry]
    assert len(list(PACKAGE.rglob("*.py"))) > 40  # the walk saw the package
    assert name_comparisons(PACKAGE, names, allowed) == []


def test_the_name_check_finds_a_comparison(tmp_path) -> None:
    """A probe package with one comparison per registry is caught, in the file and line it is on."""
    probe = tmp_path / "probe"
    (probe / "modes").mkdir(parents=True)
    (probe / "modes" / "l2l.py").write_text('ok = mode.name == "l2l"\n')  # a mode file may
    (probe / "x.py").write_text(
        'a = 1  # mode == "l2l" in a comment is fine\n'
        'if cfg.mode.name == "l2l_p": pass\n'
        'if m.family != "bert": pass\n'
        'if tier in ("host", "disk"): pass\n'
        'if opt.name == "adamw": pass\n'
        'if spec.kind == "synthetic": pass\n'
    )
    found = {r: name_comparisons(probe, *REGISTRIES[r]) for r in REGISTRIES}
    assert found["mode"] == ['x.py:2: if cfg.mode.name == "l2l_p": pass']
    assert found["family"] == ['x.py:3: if m.family != "bert": pass']
    assert found["tier"] == ['x.py:4: if tier in ("host", "disk"): pass']
    assert found["optimizer"] == ['x.py:5: if opt.name == "adamw": pass']
    assert found["task"] == ['x.py:6: if spec.kind == "synthetic": pass']


# ---- model families ---------------------------------------------------------------------------------


def _fake_checkpoint(root: Path, model_type: str) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 32}))
    save_file({"w": torch.zeros(2)}, str(root / "model.safetensors"))
    return root


@pytest.mark.parametrize("model_type", ["roberta", "t5"])
def test_a_checkpoint_no_family_loads_is_refused_in_one_line(tmp_path, model_type: str) -> None:
    ckpt = _fake_checkpoint(tmp_path / model_type, model_type)
    r = l2l(
        "train", *TINY, f"model.pretrained={ckpt}", "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"
    )
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "model.pretrained" in lines[0]
    assert f"'{model_type}'" in lines[0] and "supported: bert" in lines[0]
    assert "Traceback" not in r.stderr and not (tmp_path / "run" / "summary.json").exists()


def test_the_family_comes_from_the_checkpoint(minilm) -> None:
    from l2l_cli.compose import compose
    from l2l_cli.models import make_spec

    spec = make_spec(compose([f"model.pretrained={minilm}"]).model, 2)
    assert spec.family == "bert" and (spec.num_layers, spec.hidden_size) == (6, 384)


# ---- typed run files ------------------------------------------------------------------------------------


def test_run_files_round_trip_through_their_types() -> None:
    s = Summary(status="ok", steps=3, eval={"accuracy": 0.5}, sections={"pipeline": {"bubble_measured": 0.2}})
    obj = s.to_json()
    assert obj["schema_version"] == SCHEMA_VERSION and obj["pipeline"] == {"bubble_measured": 0.2}
    assert "error" not in obj  # optional fields are left out until set
    back = Summary.from_json(json.loads(json.dumps(obj)))
    assert back == s
    m = MemoryReport()
    assert MemoryReport.from_json(m.to_json()) == m
    row = MetricsRow(step=1, loss=0.5, extra={"eps_background_s": 0.1})
    assert row.to_json()["eps_background_s"] == 0.1 and MetricsRow.from_json(row.to_json()) == row


def test_report_reads_runs_written_before_the_schema_version(tmp_path) -> None:
    """tests/data/runs_v1 was written by the commit before typed run files (no schema_version)."""
    v1 = REPO / "tests" / "data" / "runs_v1"
    assert "schema_version" not in json.loads((v1 / "ok" / "summary.json").read_text())
    report = report_build([str(v1)], tmp_path / "out", plots=False)
    by = {r.name: r for r in report.runs}
    assert set(by) == {"ok", "oom"}
    ok, oom = by["ok"], by["oom"]
    assert ok.status == "ok" and ok.summary.schema_version == 1 and ok.get("method") == "l2l"
    assert ok.throughput == pytest.approx(204.22911524987785) and ok.summary.eval == {"accuracy": 0.453125}
    assert ok.memory is not None and ok.memory.device.method == "torch_dispatch_storage_tracking"
    assert [m.step for m in ok.metrics] == [1, 2, 3] and ok.breakdown["recompute"] > 0
    assert oom.status == "oom" and "OOM" in (tmp_path / "out" / "report.md").read_text()


def test_the_registries_are_read_without_torch() -> None:
    """``l2l plan`` reads the modes, tiers, optimizers and task kinds (their names, specs and rules) to check
    a config; none of them may import torch (a second or more) for that: the runners, the tiers' I/O and the
    optimizers' kernels are imported when a run builds them; so do the model families (their layers'
    modules load when a run builds a layer) and the config's whole check."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from l2l_cli.modes import MODES\n"
        "from l2l_cli.engine.tiers import TIERS\n"
        "from l2l_cli.engine.optim import OPTIMIZERS\n"
        "from l2l_cli.data.loading import KINDS\n"
        "from l2l_cli.engine.recompute_plan import choose\n"
        "from l2l_cli.models import FAMILIES\n"
        "import l2l_cli.config.validate\n"
        "print('torch' in sys.modules, len(MODES), len(TIERS), len(OPTIMIZERS), len(KINDS), len(FAMILIES))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "4", "2", "3", "5", "3"]
