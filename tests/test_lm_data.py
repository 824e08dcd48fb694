"""Task ``lm``: text files through datasets' local loaders, packing with EOS between documents, the dev
split, the cache, the bundled corpus, clear errors; and the offline smoke run through the real CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from omegaconf import DictConfig

from l2l_cli.data import lm
from l2l_cli.data.loading import load_task
from l2l_cli.problems import ConfigError
from l2l_cli.session import build
from tests.util import l2l, tiny_cfg

DOCS = ["The first document.", "A second one, a little longer than the first.", "Third!"]


def cfg_with(*overrides: str) -> DictConfig:
    return tiny_cfg("task=lm", "model=gpt2-tiny", "task.max_seq_len=8", *overrides)


def expected_stream(docs: list[str]) -> list[int]:
    tok = lm.load_tokenizer(str(lm.BUNDLED_TOKENIZER), "task.tokenizer")
    out: list[int] = []
    for d in docs:
        out += [*tok(d, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    return out


def as_paragraph(doc: str) -> str:
    """A .txt document is a paragraph: here, its first space becomes a line break (still one document)."""
    return doc.replace(" ", "\n", 1)


def write_corpus(tmp: Path, docs: list[str], fmt: str, field: str = "text") -> Path:
    if fmt == "txt":
        path = tmp / "c.txt"
        path.write_text("\n\n".join(as_paragraph(d) for d in docs) + "\n")
    elif fmt == "jsonl":
        path = tmp / "c.jsonl"
        path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp / "c.parquet"
        pq.write_table(pa.table({field: docs}), path)
    return path


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet"])
def test_documents_packed_with_eos_between_them(tmp_path: Path, fmt: str) -> None:
    """Every format: each document's tokens then EOS, in order, cut into full blocks; the last quarter of
    the blocks is the dev split."""
    docs = DOCS * 6
    field = "body" if fmt != "txt" else "text"
    path = write_corpus(tmp_path, docs, fmt, field)
    cfg = cfg_with(f"task.files=[{path}]", f"task.text_field={field}", "task.dev_fraction=0.25")
    data = load_task(cfg.task, cfg.model)
    stream = expected_stream([as_paragraph(d) for d in docs] if fmt == "txt" else docs)
    n = len(stream) // 8
    assert np.concatenate([data.train.blocks, data.dev.blocks]).reshape(-1).tolist() == stream[: n * 8]
    assert len(data.dev) == round(0.25 * n) and len(data.train) == n - len(data.dev)
    batch = data.train.collate([0, 1], 8)
    assert batch.input_ids.shape == (2, 8) and bool(batch.attention_mask.all())
    assert bool((batch.labels == batch.input_ids).all())  # the head shifts: position t predicts t+1


def test_dev_files_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train_path = write_corpus(tmp_path, DOCS * 8, "jsonl")
    dev_path = tmp_path / "dev.jsonl"
    dev_path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 2))
    cfg = cfg_with(f"task.files=[{train_path}]", f"task.dev_files=[{dev_path}]")
    first = load_task(cfg.task, cfg.model)
    assert first.dev.blocks.reshape(-1).tolist() == expected_stream(DOCS * 2)[: len(first.dev) * 8]

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("tokenized again: the cache was not used")

    monkeypatch.setattr(lm, "token_stream", boom)
    again = load_task(cfg.task, cfg.model)
    assert np.array_equal(again.train.blocks, first.train.blocks)
    assert np.array_equal(again.dev.blocks, first.dev.blocks)
    os.utime(train_path, ns=(1, 1))  # the file changed (its mtime): packed again
    with pytest.raises(AssertionError, match="tokenized again"):
        load_task(cfg.task, cfg.model)


def test_bundled_corpus_and_tokenizer_by_default() -> None:
    data = load_task(cfg_with("task.max_seq_len=128").task, cfg_with().model)
    assert data.source == "lm:bundled:rte_premises.txt"
    assert len(data.tokenizer) == 2048 and data.tokenizer.eos_token == "<|endoftext|>"
    assert len(data.train) > 1000 and len(data.dev) >= 50
    assert (lm.CORPUS / "SOURCE.md").is_file()


def test_errors_name_the_key(tmp_path: Path) -> None:
    path = write_corpus(tmp_path, DOCS, "jsonl", "body")
    cfg = cfg_with(f"task.files=[{path}]")  # the text is in "body", not "text"
    with pytest.raises(ConfigError, match=r"task.text_field: .* has no field 'text'; its fields: body, id"):
        load_task(cfg.task, cfg.model)
    cfg = cfg_with(f"task.files=[{path}]", "task.text_field=body", "task.max_seq_len=512")
    with pytest.raises(
        ConfigError, match=r"task.files: .*0 train and 0 dev block\(s\) of task.max_seq_len=512"
    ):
        load_task(cfg.task, cfg.model)
    cfg = cfg_with("model.vocab_size=512")  # the bundled tokenizer has 2048 ids
    with pytest.raises(ConfigError, match=r"model.vocab_size: the model has 512 token ids, the tokenizer"):
        build(cfg)


def test_offline_smoke_run_through_the_cli(tmp_path: Path) -> None:
    """``l2l train task=lm model=gpt2-tiny``, shrunk: loss and perplexity, tokens/s, an HF export."""
    run = tmp_path / "run"
    r = l2l(
        "train",
        "task=lm",
        "model=gpt2-tiny",
        "trainer.max_steps=3",
        "batch.size=4",
        "batch.ubatch_size=2",
        "task.max_seq_len=32",
        "task.max_eval_samples=8",
        "trainer.save_final=true",
        "trainer.progress=plain",
        f"hydra.run.dir={run}",
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["config"]["task"] == "lm" and summary["config"]["family"] == "gpt2"
    assert summary["eval"]["perplexity"] == pytest.approx(np.exp(summary["eval"]["loss"]), rel=1e-6)
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 32, rel=1e-6)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(row["tokens_per_s"] > 0 and row["perplexity"] > 1 for row in rows)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in (run / "final").iterdir()
    }
    assert "tokens/s" in r.stdout
