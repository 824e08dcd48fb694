"""Checkpoints: exact resume in every mode, verification before use, refusal of hostile or foreign files."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from l2l_cli import checkpoint as ckpt
from l2l_cli.checkpoint import CheckpointError
from l2l_cli.checkpoint import io as ckpt_io
from l2l_cli.train import run_job
from tests.util import TINY, l2l, tiny_cfg

RUN = [
    "trainer.max_steps=6",
    "trainer.save_every=3",
    "trainer.keep_checkpoints=5",
    "task.num_train=128",
    "task.num_eval=16",
    "model.dropout=0.1",
]


def _weights(step_dir: Path) -> dict:
    return {
        f"{f.name}:{k}": v for f in sorted(step_dir.glob("*.safetensors")) for k, v in load_file(f).items()
    }


def _assert_equal_dirs(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and len(wa) > 0
    for k in wa:
        assert (wa[k] == wb[k]).all(), k  # bitwise: the resumed run is the run that never stopped


@pytest.mark.parametrize("mode", ["baseline_ag", "l2l", "l2l_p"])
def test_resume_is_exact(tmp_path, mode: str) -> None:
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert run_job(tiny_cfg(f"mode={mode}", *RUN), full) == "ok"
    # a run stopped after step 3 leaves what this copy holds: the step-3 checkpoint and logs up to step 3
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_6")
    assert run_job(tiny_cfg(f"mode={mode}", *RUN, f"trainer.resume={cut}"), cut) == "ok"
    _assert_equal_dirs(full / "checkpoints" / "step_6", cut / "checkpoints" / "step_6")
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["resumed_from"]["step"] == 3 and summary["steps"] == 6
    steps = [json.loads(line)["step"] for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_l2l_and_l2l_p_share_a_layout_but_not_with_baselines(tmp_path, capsys) -> None:
    assert run_job(tiny_cfg("mode=l2l", *RUN), tmp_path) == "ok"
    cfg = tiny_cfg("mode=l2l_p", *RUN, "trainer.max_steps=7", f"trainer.resume={tmp_path}")
    assert run_job(cfg, tmp_path) == "ok"
    summary = (tmp_path / "summary.json").read_text()
    capsys.readouterr()
    # a refused resume says why on the console and leaves the run's files as they were
    assert run_job(tiny_cfg("mode=baseline_ag", *RUN, f"trainer.resume={tmp_path}"), tmp_path) == "config"
    err = capsys.readouterr().err
    assert "state layout (eps-flat-v1)" in err and "mode=baseline_ag (module-v1)" in err
    assert (
        run_job(tiny_cfg("mode=l2l", *RUN, "model.num_layers=4", f"trainer.resume={tmp_path}"), tmp_path)
        == "config"
    )
    assert "another model shape: num_layers 3 (checkpoint) vs 4 (this run)" in capsys.readouterr().err
    assert (tmp_path / "summary.json").read_text() == summary


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("saved")
    assert run_job(tiny_cfg("mode=l2l", *RUN, "trainer.max_steps=3"), run) == "ok"
    return run


def _copy(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved, tmp_path / "run")
    return tmp_path / "run"


def test_truncated_and_bit_flipped_files_are_refused(saved, tmp_path) -> None:
    run = _copy(saved, tmp_path)
    step = run / "checkpoints" / "step_3"
    ckpt.verify(step)
    data = bytearray((step / "layer_1.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x01
    (step / "layer_1.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum differs"):
        ckpt.verify(step)
    (step / "layer_1.safetensors").write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        ckpt.verify(step)
    r = l2l("train", *TINY, "mode=l2l", "trainer.max_steps=4", f"trainer.resume={run}")
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr
    assert "has no usable checkpoint" in r.stderr and "checksum differs" in r.stderr


def test_incomplete_checkpoint_and_escaping_names_are_refused(saved, tmp_path) -> None:
    run = _copy(saved, tmp_path)
    step = run / "checkpoints" / "step_3"
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"]["../../../etc/passwd"] = {"bytes": 1, "sha256": "0"}
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="must stay inside the checkpoint"):
        ckpt.verify(step)
    (step / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"no manifest\.json"):
        ckpt.verify(step)


class _Evil:
    def __reduce__(self):  # unpickling this would create the marker file
        return (Path.touch, (Path(__file__).parent / ".pwned",))


def test_a_pickle_that_would_run_code_is_never_executed(saved, tmp_path, capsys) -> None:
    marker = Path(__file__).parent / ".pwned"
    marker.unlink(missing_ok=True)
    payload = pickle.dumps(_Evil())
    # 1. an attacker rewrites a checkpoint file and its manifest entry consistently
    run = _copy(saved, tmp_path)
    step = run / "checkpoints" / "step_3"
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"]["layer_2.safetensors"] = ckpt.write_bytes(step / "layer_2.safetensors", payload)
    (step / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert run_job(tiny_cfg("mode=l2l", *RUN, f"trainer.resume={run}"), run) == "config"
    assert "not a valid safetensors file" in capsys.readouterr().err
    # 2. a "pretrained" model directory whose weights are a malicious pytorch_model.bin
    evil = tmp_path / "evil_model"
    evil.mkdir()
    (evil / "pytorch_model.bin").write_bytes(payload)
    cfg_json = {
        "num_hidden_layers": 3,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 512,
    }
    (evil / "config.json").write_text(json.dumps(cfg_json))
    out = tmp_path / "out"
    assert run_job(tiny_cfg("mode=l2l", f"model.pretrained={evil}", "trainer.max_steps=1"), out) == "config"
    assert "pytorch_model.bin: refused" in json.loads((out / "summary.json").read_text())["error"]
    assert not marker.exists()


def test_resume_latest_finds_the_newest_run(tmp_path) -> None:
    outputs = tmp_path / "outputs" / "2026-01-01"
    for name in ("a", "b"):
        assert run_job(tiny_cfg("mode=l2l", *RUN, "trainer.max_steps=3"), outputs / name) == "ok"
    assert ckpt.find_latest_run(tmp_path / "outputs") == outputs / "b"
    r = l2l("train", *TINY, "mode=l2l", *RUN, "trainer.resume=latest", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((outputs / "b" / "summary.json").read_text())["resumed_from"]["step"] == 3


@pytest.mark.slow  # the disk tier's resume from its commit: test_disk_tier's is the default one
def test_resume_latest_finds_a_disk_tier_run_by_its_commit_record(tmp_path) -> None:
    """A disk-tier run writes no checkpoints/: its commit record (eps/commit.json, replaced after every
    step) is its checkpoint, so ``trainer.resume=latest`` finds it when it is the newest run."""
    import time

    outputs = tmp_path / "outputs" / "2026-01-01"
    assert run_job(tiny_cfg("mode=l2l", *RUN, "trainer.max_steps=2"), outputs / "a") == "ok"
    time.sleep(0.05)  # (a newer mtime)
    disk = ["mode=l2l", "eps.tier=disk", "task.num_train=256"]
    r = l2l(
        "train", *TINY, *disk, "trainer.max_steps=2", f"hydra.run.dir={outputs / 'b'}"
    )  # (its config saved)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (outputs / "b" / "checkpoints").exists() and (outputs / "b" / "eps" / "commit.json").is_file()
    r = l2l("train", *TINY, *disk, "trainer.max_steps=3", "trainer.resume=latest", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    steps = [json.loads(x)["step"] for x in (outputs / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    from l2l_cli.inherit import find_latest_run

    assert find_latest_run(tmp_path / "outputs") == outputs / "b"


@pytest.mark.parametrize("where", ["disk", "shm"])
def test_streamed_layer_files_are_safetensors_and_checked_by_crc(tmp_path, where: str) -> None:
    """write_tensors (the real-time writer's path: O_DIRECT where the filesystem allows, plain writes on
    tmpfs) yields a file safetensors reads back bit for bit, spanning several staging chunks, and a
    flipped byte is refused through its crc32 manifest entry."""
    import torch

    root = tmp_path if where == "disk" else Path("/dev/shm")
    if not root.is_dir():
        pytest.skip("no /dev/shm")
    d = root / f"l2l-test-{tmp_path.name}"
    d.mkdir()
    try:
        g = torch.Generator().manual_seed(0)
        tensors = {
            "w": torch.randn(9_000_001, generator=g),  # > one 32 MiB chunk, not block-sized
            "m": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "empty": torch.zeros(0),
            "step": torch.tensor(7.0),
        }
        entry = ckpt.write_tensors(d / "layer_0.safetensors", tensors)
        back = load_file(d / "layer_0.safetensors")
        assert back.keys() == tensors.keys()
        assert all(torch.equal(back[k], tensors[k]) for k in tensors)
        manifest = {"files": {"layer_0.safetensors": entry}}
        assert ckpt.read_tensors(d, "layer_0.safetensors", manifest)["step"] == 7.0
        data = bytearray((d / "layer_0.safetensors").read_bytes())
        data[len(data) // 2] ^= 0x01
        (d / "layer_0.safetensors").write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match="checksum"):
            ckpt.read_tensors(d, "layer_0.safetensors", manifest)
    finally:
        shutil.rmtree(d, ignore_errors=True)


class _Runner:
    """The least a runner gives ``ckpt.save``: its state files."""

    def __init__(self, payload: bytes):
        self.payload = payload

    def state_files(self):
        yield "weights.bin", self.payload


def _crash_on(monkeypatch, target: str) -> None:
    """Make the os.replace that moves a directory onto ``target`` raise (a crash at that point)."""
    real = os.replace

    def replace(src, dst):
        if Path(dst).name == target and Path(src).name.startswith(".tmp-"):
            raise KeyboardInterrupt("crash")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("exchange", [True, False])
def test_a_checkpoint_saved_again_survives_a_crash_while_it_is_replaced(
    tmp_path, monkeypatch, exchange
) -> None:
    """Saving step_N where step_N already exists (a resumed run reaching the same step) never leaves
    neither: the old one stays readable until the new one is in place (an atomic exchange, or, where the
    system has none, a rename aside that the next read puts back)."""
    root = tmp_path / "run" / "checkpoints"
    ckpt.save(root, 3, _Runner(b"old"), {}, {}, keep=2, config_yaml="")
    if not exchange:
        monkeypatch.setattr(ckpt_io, "_exchange", lambda a, b: (_ for _ in ()).throw(OSError(38, "no")))
    _crash_on(monkeypatch, "step_3")
    try:
        ckpt.save(root, 3, _Runner(b"new"), {}, {}, keep=2, config_yaml="")
    except KeyboardInterrupt:
        assert not exchange  # the exchange path never moves a directory onto step_3 with os.replace
    monkeypatch.undo()
    path, manifest = ckpt.latest_valid(tmp_path / "run")
    assert path.name == "step_3" and manifest["step"] == 3
    data = (path / "weights.bin").read_bytes()
    assert data == (b"new" if exchange else b"old")
    assert not list(root.glob(".old-*"))


def test_resume_latest_finds_runs_outside_outputs(tmp_path, monkeypatch) -> None:
    """Issue 40 item 9g: ``trainer.resume=latest`` looked only under ``outputs/``. It also looks beside the
    command line's ``hydra.run.dir`` and under ``latest:<folder>``; the run found becomes the run dir."""
    import os

    from l2l_cli.cli import _resolve_resume

    runs = tmp_path / "scratch" / "runs"
    for age, name in enumerate(("newer", "older")):
        manifest = runs / name / "checkpoints" / "step_2" / "manifest.json"
        manifest.parent.mkdir(parents=True)
        manifest.write_text("{}")
        os.utime(manifest, (1e9 - age * 100, 1e9 - age * 100))
    monkeypatch.chdir(tmp_path)  # no outputs/ here
    newer = str((runs / "newer").resolve())
    for argv in (
        ["trainer.resume=latest", f"hydra.run.dir={runs / 'older'}"],
        [f"trainer.resume=latest:{runs}"],
    ):
        out, found = _resolve_resume(argv, multirun=False)
        assert (
            str(found) == newer
            and f"hydra.run.dir={newer}" in out
            and f"hydra.run.dir={runs / 'older'}" not in out
        )
    with pytest.raises(ValueError, match="no checkpoint under outputs"):
        _resolve_resume(["trainer.resume=latest"], multirun=False)
