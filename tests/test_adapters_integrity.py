"""An adapter run trusts nothing it reads back unverified (issue 54): its ``final/`` and ``best/``, the
frozen base's layer files, the base checkpoint it was trained on (its fingerprint), the encoded base a
resume reuses, and the keys a resume may not change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from l2l_cli import evaluate, export, generate
from l2l_cli.train import run_job
from tests.util import TINY, tiny_cfg

LORA = ["peft=lora", "peft.r=4", "optim.schedule=constant", "optim.warmup_steps=0", "logger=none"]
LM = [
    "model=llama-tiny",
    "model.vocab_size=2048",
    "task=lm",
    "task.num_eval=8",
    "batch.size=4",
    "batch.ubatch_size=2",
]


def csv_task(tmp: Path) -> list[str]:
    """A tiny text task (predict needs text): 32 rows of two labels."""
    rows = ["review,sentiment"] + [f"{w} film {i},{w}" for i in range(16) for w in ("good", "bad")]
    (tmp / "train.csv").write_text("\n".join(rows) + "\n")
    return [
        *TINY,
        "model.vocab_size=30522",
        "task=csv",
        f"task.files={tmp / 'train.csv'}",
        "task.text_fields=review",
        "task.label_field=sentiment",
        "task.max_seq_len=8",
    ]


def train_run(run: Path, *overrides: str) -> Any:
    """A finished in-process run with ``final/`` and its config where Hydra writes it."""
    cfg = tiny_cfg("trainer.max_steps=2", "trainer.save_final=true", *overrides)
    assert run_job(cfg, run) == "ok", (run / "summary.json").read_text()
    (run / ".hydra").mkdir(exist_ok=True)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    return cfg


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def one_line(capsys: Any) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("l2l:")]
    assert len(lines) == 1, lines
    return lines[0]


# ---- item 1: a LoRA final/ is verified against its checksums.json --------------------------------------


def test_a_damaged_lora_final_is_refused_by_predict_eval_generate_and_export(tmp_path: Path, capsys) -> None:
    """One flipped byte in ``final/adapter_model.safetensors`` (listed with its sha256 in checksums.json):
    ``predict``, ``eval``, ``generate`` and ``export --merge`` each exit 2 with one line naming the file."""
    cls, lm = tmp_path / "cls", tmp_path / "lm"
    train_run(cls, *csv_task(tmp_path), *LORA)
    train_run(lm, *LM, *LORA)
    (tmp_path / "in.txt").write_text("a good film\na bad film\n")
    for run in (cls, lm):
        flip_last_byte(run / "final" / "adapter_model.safetensors")
    named = "final/adapter_model.safetensors: size or checksum differs"
    calls = [
        lambda: evaluate.main("predict", [str(cls), "--input", str(tmp_path / "in.txt")]),
        lambda: evaluate.main("eval", [str(cls)]),
        lambda: export.main([str(cls), "--merge"]),
        lambda: evaluate.main("eval", [str(lm)]),
        lambda: generate.main([str(lm), "--prompt", "The", "--max-new-tokens", "2"]),
        lambda: generate.main([str(lm), "--prompt", "The", "--max-new-tokens", "2", "--layered"]),
        lambda: export.main([str(lm), "--merge"]),
    ]
    for call in calls:
        assert call() == 2
        assert named in one_line(capsys)
    assert not (cls / "merged").exists() and not (lm / "merged").exists()


# ---- item 2: the frozen base's layer files are checked on every read -----------------------------------

NF4_DISK = ["mode=l2l", "peft.base_dtype=nf4", "peft.base_source=disk"]


def test_a_flipped_byte_in_a_frozen_base_file_stops_the_step_naming_the_file(tmp_path: Path) -> None:
    """Block 0's NF4 layer file, changed after it was encoded: the next read of it (on the reader's thread)
    is refused naming the file, before anything computes with it."""
    from l2l_cli.checkpoint import CheckpointError
    from tests.test_adapters import lm_batches
    from tests.util import built

    cfg = tiny_cfg(*LM, *LORA, *NF4_DISK, f"eps.path={tmp_path / 'eps'}")
    batches = lm_batches(cfg, n=2)
    with built(cfg) as runner:
        runner.step(batches[0])
        block0 = tmp_path / "eps" / "frozen_base" / "base_1.safetensors"
        flip_last_byte(block0)
        with pytest.raises(CheckpointError, match=rf"{block0}: checksum mismatch"):
            runner.step(batches[1])


# ---- item 3: the base checkpoint's fingerprint, recorded and checked ------------------------------------

TOKENIZER = Path(__file__).resolve().parent.parent / "l2l_cli" / "data" / "corpus" / "tokenizer"


def pretrained_llama(root: Path, *overrides: str) -> Path:
    """A tiny Llama checkpoint (config.json, model.safetensors, the bundled tokenizer) to train on
    (``overrides``: other ``model.*`` sizes)."""
    import shutil

    from l2l_cli.models import LayeredModel
    from l2l_cli.models.lora import base_spec
    from l2l_cli.session import build

    cfg = tiny_cfg(*LM, *overrides)
    with build(cfg) as s:
        spec = base_spec(s.model)
    spec.save_hf(root, LayeredModel(spec, seed=3).hf_state_dict().items())
    for f in TOKENIZER.iterdir():
        shutil.copy(f, root / f.name)
    return root


def change_in_place(path: Path) -> None:
    """One tensor of a safetensors file scaled, written back under the same name."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    name = sorted(k for k in tensors if k.endswith("q_proj.weight"))[0]
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_a_changed_base_is_refused_by_eval_and_resume_naming_model_pretrained(tmp_path: Path, capsys) -> None:
    """The run records its base's fingerprint (summary.json, checkpoints, final/); after the weights under
    ``model.pretrained`` change in place, ``l2l eval`` and ``trainer.resume`` (the CLI's preflight, and the
    trainer's own check) refuse in one line naming ``model.pretrained`` and the file that differs;
    ``peft.allow_base_change=true`` evaluates anyway."""
    import json

    from tests.util import l2l

    base, run = pretrained_llama(tmp_path / "base"), tmp_path / "run"
    cfg = train_run(run, *LM, *LORA, f"model.pretrained={base}", "trainer.save_every=1")
    recorded = json.loads((run / "final" / "base_fingerprint.json").read_text())
    assert set(recorded["files"]) == {"config.json", "model.safetensors"}
    assert json.loads((run / "summary.json").read_text())["peft"]["base_fingerprint"] == recorded
    assert json.loads((run / "checkpoints" / "step_1" / "manifest.json").read_text())["base"] == recorded
    assert evaluate.main("eval", [str(run)]) == 0
    capsys.readouterr()

    change_in_place(base / "model.safetensors")
    differs = "model.safetensors: its contents differ"
    assert evaluate.main("eval", [str(run)]) == 2
    line = one_line(capsys)
    assert line.startswith(f"l2l: config error: model.pretrained: {base} is not the base") and differs in line
    assert evaluate.main("eval", [str(run), "--checkpoint", "step_1"]) == 2
    assert differs in one_line(capsys)
    assert evaluate.main("eval", [str(run), "peft.allow_base_change=true"]) == 0
    capsys.readouterr()

    before = (run / "checkpoints" / "step_2" / "manifest.json").read_bytes()
    resumed = cfg.copy()
    resumed.trainer.resume, resumed.trainer.max_steps = str(run), 3
    assert run_job(resumed, run) == "config"  # the trainer's check (the session's path)
    line = one_line(capsys)
    assert line.startswith("l2l: config error: model.pretrained:") and differs in line
    r = l2l("train", f"trainer.resume={run}", "trainer.max_steps=3")  # the CLI refuses before any work
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("l2l:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("l2l: config error: model.pretrained:") and differs in lines[0]
    assert (run / "checkpoints" / "step_2" / "manifest.json").read_bytes() == before
    assert not (run / "checkpoints" / "step_3").exists()


# ---- item 4: the encoded base is reused by a resume, removed at the end of a finished run ---------------


def test_a_resume_reuses_the_encoded_base_and_a_damaged_one_stops_the_run_in_one_line(
    tmp_path: Path, capsys, caplog
) -> None:
    """An NF4 base on disk from a checkpoint: a finished run removes its encoded base (the default); one
    with ``peft.keep_encoded_base=true`` keeps it and its resume adopts the files without encoding anything
    (train.log says so). A byte flipped in a kept layer file stops the next resume in one line naming the
    file (exit 2), its checkpoint intact; the resume after it encodes the base afresh, and the adapter
    equals an uninterrupted run's bit for bit."""
    import logging

    from safetensors.torch import load_file

    caplog.set_level(logging.INFO, logger="l2l")
    base = pretrained_llama(tmp_path / "base")
    common = [*LM, *LORA, *NF4_DISK, f"model.pretrained={base}", "trainer.save_every=1"]
    full, half = tmp_path / "full", tmp_path / "half"
    train_run(full, *common, "trainer.max_steps=4")
    assert not (full / "eps" / "frozen_base").exists()  # finished: removed
    cfg = train_run(half, *common, "peft.keep_encoded_base=true")
    files = half / "eps" / "frozen_base"
    assert (files / "frozen_base.json").is_file()
    written = {p.name: p.stat().st_mtime_ns for p in files.glob("base_*.safetensors")}

    def resume(steps: int) -> str:
        again = cfg.copy()
        again.trainer.resume, again.trainer.max_steps = str(half), steps
        caplog.clear()
        return run_job(again, half)

    assert resume(3) == "ok"
    assert "frozen base: reused the encoded layer files" in caplog.text
    assert {p.name: p.stat().st_mtime_ns for p in files.glob("base_*.safetensors")} == written
    capsys.readouterr()

    flip_last_byte(files / "base_1.safetensors")
    step3 = (half / "checkpoints" / "step_3" / "manifest.json").read_bytes()
    assert resume(4) == "config"
    assert one_line(capsys).startswith(
        f"l2l: config error: {files / 'base_1.safetensors'}: checksum mismatch"
    )
    assert (half / "checkpoints" / "step_3" / "manifest.json").read_bytes() == step3
    assert not (half / "checkpoints" / "step_4").exists() and not (files / "frozen_base.json").exists()

    assert resume(4) == "ok"
    assert "reused the encoded" not in caplog.text  # encoded afresh
    a = load_file(full / "final" / "adapter_model.safetensors")
    b = load_file(half / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch_equal(a[k], b[k]) for k in a)


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return torch.equal(a, b)


# ---- item 5: what a resume may not change, and eps.path, each one line --------------------------------


def test_a_resume_refuses_another_base_dtype_and_peft_none_and_announces_another_base_source(
    tmp_path: Path,
) -> None:
    """``peft.base_dtype`` (the adapter was trained on that base's rounding) and ``peft=none`` (the
    checkpoints hold an adapter, no base weights) are refused in one line naming the key, exit 2, the run
    untouched; ``peft.base_source`` (the same numbers) resumes, saying so on the console."""
    from tests.util import l2l

    run = tmp_path / "run"
    train_run(run, *LM, *LORA, *NF4_DISK, "trainer.save_every=1")
    step2 = (run / "checkpoints" / "step_2" / "manifest.json").read_bytes()
    for change, key, says in (
        ("peft.base_dtype=int8", "peft.base_dtype", "int8 here, nf4 in the run being resumed"),
        ("peft=none", "peft.name", "none here, lora in the run being resumed"),
    ):
        r = l2l("train", f"trainer.resume={run}", "trainer.max_steps=3", change)
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("l2l:")]
        assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
        assert lines[0].startswith(f"l2l: config error: {key}: {says}") and "Traceback" not in r.stderr
        assert (run / "checkpoints" / "step_2" / "manifest.json").read_bytes() == step2
    r = l2l("train", f"trainer.resume={run}", "trainer.max_steps=3", "peft.base_source=host")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "l2l: note: resume with peft.base_source=host (was disk): the same base" in r.stderr


def test_an_eps_path_that_cannot_hold_the_frozen_base_is_one_line_naming_it(
    tmp_path: Path, monkeypatch
) -> None:
    """A folder that cannot be created (under a file) and one that cannot be written (a read-only file
    system, simulated: the tests run as root) are one ``eps.path`` line each before any work, no traceback."""
    import os

    from l2l_cli.config.validate import validate
    from tests.util import l2l

    (tmp_path / "a_file").write_text("")
    run = tmp_path / "run"
    eps = tmp_path / "a_file" / "eps"
    r = l2l("train", *LM, *LORA, *NF4_DISK, f"eps.path={eps}", f"hydra.run.dir={run}")
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("l2l:")]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert lines[0].startswith(f"l2l: config error: eps.path: {eps} cannot be created") and not run.exists()

    real = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if str(p).startswith(str(tmp_path)) else real(p, mode)
    )
    cfg = tiny_cfg(*LM, *LORA, *NF4_DISK, f"eps.path={tmp_path / 'ro'}")
    assert [str(p) for p in validate(cfg) if p.key == "eps.path"] == [
        f"eps.path: {tmp_path / 'ro'} is not writable (read-only file system or permissions); the frozen "
        "base's layer files (peft.base_source=disk) go in its frozen_base/"
    ]
