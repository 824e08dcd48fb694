"""``l2l predict`` on a plain text file (issue 40 item 9j): an input per line, each prediction carrying the
input it answers."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from l2l_cli import evaluate
from l2l_cli.train import run_job
from tests.util import tiny_cfg


def test_predict_reads_plain_text_and_echoes_each_input(tmp_path: Path, capsys) -> None:
    rows = ["review,sentiment"] + [f"{w} film {i},{w}" for i in range(16) for w in ("good", "bad")]
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n")
    run = tmp_path / "run"
    cfg = tiny_cfg(
        "model.vocab_size=30522",
        "task=csv",
        f"task.files={tmp_path / 'train.csv'}",
        "task.text_fields=review",
        "task.label_field=sentiment",
        "task.max_seq_len=8",
        "batch.size=8",
        "batch.ubatch_size=8",
        "trainer.max_steps=1",
        "trainer.save_final=true",
        "trainer.progress=none",
    )
    assert run_job(cfg, run) == "ok"
    (run / ".hydra").mkdir()
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")  # (what Hydra writes for l2l train)
    texts = ["a good film", "", "a bad film really", "good good"]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n")
    assert evaluate.main("predict", [str(run), "--input", str(tmp_path / "in.txt")]) == 0
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [p["input"] for p in got] == [t for t in texts if t]  # blank lines skipped, each input echoed
    assert [p["index"] for p in got] == [0, 1, 2] and {p["prediction"] for p in got} <= {"good", "bad"}
