"""The loop's usual controls (issue 40 item 8): a cosine schedule, the best checkpoint (``trainer.save_best``)
and early stopping (``trainer.early_stopping_patience``), as Hugging Face's Trainer and torchtune offer."""

from __future__ import annotations

import json
import math
from pathlib import Path

from l2l_cli.config.schema import OptimConfig
from l2l_cli.engine.optim import OptimSettings, lr_at
from tests.util import l2l

TINY = ["model=bert-tiny", "task.num_train=64", "task.num_eval=32", "batch.size=8", "batch.ubatch_size=4"]


def _settings(schedule: str, warmup: int) -> OptimSettings:
    cfg = OptimConfig(lr=1.0, schedule=schedule, warmup_steps=warmup)
    return OptimSettings(
        cfg.name,
        cfg.lr,
        cfg.weight_decay,
        cfg.beta1,
        cfg.beta2,
        cfg.eps,
        cfg.warmup_ratio,
        cfg.warmup_steps,
        cfg.schedule,
    )


def test_cosine_schedule_warms_up_then_follows_half_a_cosine_to_zero() -> None:
    o = _settings("cosine", warmup=2)
    assert [lr_at(s, 10, o) for s in (0, 1)] == [0.5, 1.0]
    assert lr_at(2, 10, o) == 1.0  # the first step after warmup: the peak
    assert math.isclose(lr_at(6, 10, o), 0.5)  # half way through the decay
    assert math.isclose(lr_at(10, 10, o), 0.0, abs_tol=1e-12)
    lin = _settings("linear", warmup=2)
    assert lr_at(6, 10, o) == lr_at(6, 10, lin)  # at the midpoint both are at half
    assert lr_at(4, 10, o) > lr_at(4, 10, lin)  # a cosine stays high longer


def test_a_run_logs_the_cosine_rates(tmp_path: Path) -> None:
    r = l2l(
        "train",
        *TINY,
        "optim.schedule=cosine",
        "optim.warmup_steps=1",
        "optim.lr=1e-3",
        "trainer.max_steps=5",
        f"hydra.run.dir={tmp_path}",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    o = _settings("cosine", warmup=1)
    assert [row["lr"] for row in rows] == [1e-3 * lr_at(s, 5, o) for s in range(5)]


def test_best_checkpoint_and_early_stopping(tmp_path: Path) -> None:
    """With a rate too small to change the predictions, accuracy never improves on the first evaluation: the
    run keeps best/ from step 1 and stops after ``patience`` evaluations without improvement."""
    r = l2l(
        "train",
        *TINY,
        "optim.lr=1e-12",
        "optim.schedule=constant",
        "optim.warmup_steps=0",
        "trainer.max_steps=20",
        "trainer.eval_every=1",
        "trainer.save_best=accuracy",
        "trainer.early_stopping_patience=2",
        f"hydra.run.dir={tmp_path}",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert summary["steps"] == 3  # evaluations at 1 (best), 2 and 3 (no better): stopped after step 3
    assert summary["best"]["metric"] == "accuracy" and summary["best"]["step"] == 1
    assert summary["best"]["early_stopped_at"] == 3
    assert (tmp_path / "best" / "model.safetensors").is_file() and (
        tmp_path / "best" / "config.json"
    ).is_file()
    assert "early stopping at step 3" in (tmp_path / "train.log").read_text()


def test_save_best_rules_are_one_line_each(tmp_path: Path) -> None:
    r = l2l("train", *TINY, "trainer.save_best=bleu", f"hydra.run.dir={tmp_path / 'a'}")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "l2l: config error: trainer.save_best: got 'bleu'; allowed: auto, accuracy"
    ]
    r = l2l("train", *TINY, "trainer.early_stopping_patience=2", f"hydra.run.dir={tmp_path / 'b'}")
    assert r.returncode == 2
    assert "trainer.early_stopping_patience: needs trainer.save_best" in r.stderr
    assert "needs trainer.eval_every > 0" in r.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_classifier_final_dir_is_self_contained_for_transformers_pipeline(tmp_path: Path) -> None:
    """final/ carries the tokenizer: ``pipeline("text-classification", model=final/)`` with no other argument
    gives the labels ``l2l predict`` gives (issue 40 item 2)."""
    from transformers import pipeline

    rows = ["text,label"] + [f"{w} film {i},{w}" for i in range(32) for w in ("great", "awful")]
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n")
    run = tmp_path / "run"
    r = l2l(
        "train",
        "task=csv",
        f"task.files={tmp_path / 'train.csv'}",
        "model=bert-tiny",
        "batch.size=8",
        "batch.ubatch_size=8",
        "task.max_seq_len=16",
        "trainer.max_steps=8",
        "trainer.save_final=true",
        f"hydra.run.dir={run}",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert (run / "final" / "tokenizer.json").is_file() or (run / "final" / "vocab.txt").is_file()
    texts = ["great film 3", "awful film 7", "great film 30", "awful film 1"]
    (tmp_path / "texts.csv").write_text("text\n" + "\n".join(texts) + "\n")
    r = l2l("predict", str(run), "--input", str(tmp_path / "texts.csv"))
    assert r.returncode == 0, r.stderr[-2000:]
    ours = [json.loads(line)["prediction"] for line in r.stdout.splitlines() if line.startswith("{")]
    clf = pipeline("text-classification", model=str(run / "final"), device="cpu")
    theirs = [out["label"] for out in clf(texts)]
    assert theirs == ours


def test_l2l_modes_default_to_auto_recompute_and_the_cpu_stash_keeps_full() -> None:
    """Issue 40 item 7: auto keeps the activations that fit (bit-identical weights); the CPU stash's reason to
    be is device memory constant in depth, so it recomputes every layer; the papers' recipes pin full."""
    from l2l_cli.compose import compose
    from l2l_cli.paths import recipes_dir

    assert compose(["mode=l2l"]).mode.recompute == "auto"
    assert compose(["mode=l2l_p"]).mode.recompute == "auto"
    assert compose(["mode=l2l_stash_cpu"]).mode.recompute == "full"
    for recipe in sorted(recipes_dir().glob("*.yaml")):
        text = recipe.read_text()
        if "mode" in text and recipe.stem != "layered_ga_scaling":
            assert "recompute: full" in text, recipe.name


def test_resume_with_max_steps_below_the_checkpoint_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    """Issue 40 item 5: the run's 4 steps must not silently become 1 (nor its status 'ok' at step 1)."""
    r = l2l("train", *TINY, "trainer.max_steps=4", "trainer.save_every=2", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    r = l2l("train", f"trainer.resume={tmp_path}", "trainer.max_steps=1")
    assert r.returncode == 2
    assert r.stderr.startswith("l2l: config error: trainer.max_steps: 1 is below step 4 of the checkpoint")
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before


def test_a_fine_tuning_rate_on_random_weights_is_announced(tmp_path: Path, minilm: str) -> None:
    """Issue 40 item 6: bert-tiny on a CSV at 5e-5 trains to chance without a word; now a warning says why."""
    from l2l_cli.preflight import preflight

    (tmp_path / "x.csv").write_text("text,label\n" + "".join(f"t {i},{i % 2}\n" for i in range(20)))
    base = ["task=csv", f"task.files={tmp_path / 'x.csv'}"]
    warn: list[str] = []
    assert preflight(base, False, warn) == []
    assert any("optim.lr=5e-05 is task=csv's fine-tuning rate" in w and "model.lr=0.001" in w for w in warn)
    for chosen in (["optim.lr=5e-5"], [f"model.pretrained={minilm}"]):
        warn = []
        assert preflight([*base, *chosen], False, warn) == []
        assert not any("fine-tuning rate" in w for w in warn), chosen


def test_a_chat_run_from_a_missing_checkpoint_is_one_config_line(tmp_path: Path) -> None:
    """Issue 40 item 1: task=chat names model.pretrained in one line, exit 2, as task=csv and task=lm do."""
    (tmp_path / "chat.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
    )
    for task in ("chat", "lm"):
        r = l2l(
            "train",
            f"task={task}",
            f"model.pretrained={tmp_path / 'nowhere'}",
            f"task.files={tmp_path / 'chat.jsonl'}",
            f"hydra.run.dir={tmp_path / task}",
        )
        assert r.returncode == 2, r.stderr[-2000:]
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("l2l: config error: model.pretrained: "), lines
        assert not (tmp_path / task).exists()
