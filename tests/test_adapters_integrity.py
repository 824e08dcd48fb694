"""An adapter run trusts nothing it reads back unverified (issue 54): its ``final/`` and ``best/``, the
frozen base's layer files, the base checkpoint it was trained on (its fingerprint), the encoded base a
resume reuses, and the keys a resume may not change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from l2l_cli import evaluate, export, generate
from l2l_cli.train import run_job
from tests.util import TINY, tiny_cfg

LORA = ["peft=lora", "peft.r=4", "optim.schedule=constant", "logger=none"]
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
    cfg = tiny_cfg(*overrides, "trainer.max_steps=2", "trainer.save_final=true")
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
