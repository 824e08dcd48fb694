"""GLUE files (original TSV layout, quoting off), the hub path, metrics, and minibatch streams."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import DictConfig
from scipy.stats import pearsonr, spearmanr

from l2l_cli.config.schema import TaskConfig
from l2l_cli.config.settings import typed
from l2l_cli.data.batches import TrainStream
from l2l_cli.data.loading import load_task
from l2l_cli.data.metrics import compute
from l2l_cli.data.synthetic import synthetic
from l2l_cli.data.tasks import TASKS
from tests.util import tiny_cfg

ROWS = {
    "cola": (8551, 1043),
    "mrpc": (3668, 408),
    "rte": (2490, 277),
    "sst2": (67349, 872),
    "wnli": (635, 71),
}
DIRS = {"cola": "CoLA", "mrpc": "MRPC", "rte": "RTE", "sst2": "SST-2", "wnli": "WNLI", "qnli": "QNLI"}


@pytest.mark.parametrize("task", sorted(ROWS))
def test_real_glue_tsv_row_counts(glue, task: str) -> None:
    spec = TASKS[task]
    train, dev = (
        spec.read_tsv(glue / DIRS[task] / "train.tsv"),
        spec.read_tsv(glue / DIRS[task] / spec.dev_file),
    )
    assert (len(train), len(dev)) == ROWS[task]
    assert {e.label for e in dev} == set(range(spec.num_labels))
    assert all(e.text_a for e in dev) and ((dev[0].text_b is None) == (len(spec.tsv) == 2))


def test_qnli_dev_only_dir_is_refused(glue) -> None:
    problems = TASKS["qnli"].check_source(str(glue / "QNLI"))
    assert len(problems) == 1 and "has no train.tsv" in problems[0].message
    assert len(TASKS["qnli"].read_tsv(glue / "QNLI" / "dev.tsv")) == 5463


def _write(path, header, rows) -> None:
    path.write_text("\n".join(["\t".join(header), *("\t".join(map(str, r)) for r in rows)]) + "\n")


def test_generated_stsb_mnli_qqp_layouts(tmp_path) -> None:
    sts = [
        "index",
        "genre",
        "filename",
        "year",
        "old_index",
        "source1",
        "source2",
        "sentence1",
        "sentence2",
        "score",
    ]
    _write(tmp_path / "s.tsv", sts, [[0, "g", "f", "y", 0, "a", "b", 'He said "hi', "she ran", "3.8"]])
    (ex,) = TASKS["stsb"].read_tsv(tmp_path / "s.tsv")
    assert ex.label == pytest.approx(3.8) and ex.text_a == 'He said "hi'  # an unbalanced quote stays text
    mnli = [
        "index",
        "promptID",
        "pairID",
        "genre",
        "s1bp",
        "s2bp",
        "s1p",
        "s2p",
        "sentence1",
        "sentence2",
        "label1",
        "gold_label",
    ]
    _write(tmp_path / "m.tsv", mnli, [[0, 1, 2, "g", "", "", "", "", "p", "h", "neutral", "neutral"]])
    assert TASKS["mnli"].read_tsv(tmp_path / "m.tsv")[0].label == 1
    _write(
        tmp_path / "q.tsv",
        ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
        [[0, 1, 2, "a?", "b?", 1]],
    )
    assert TASKS["qqp"].read_tsv(tmp_path / "q.tsv")[0].label == 1


def test_malformed_rows_are_an_error(tmp_path) -> None:
    rows = [[i, "a", "b", "entailment" if i % 2 else "maybe"] for i in range(20)]
    _write(tmp_path / "train.tsv", ["index", "sentence1", "sentence2", "label"], rows)
    with pytest.raises(ValueError, match="10 malformed rows of 20"):
        TASKS["rte"].read_tsv(tmp_path / "train.tsv")


def test_metrics_are_sklearn_and_scipy() -> None:
    rng = np.random.default_rng(0)
    y, p = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
    got = compute(["accuracy", "f1", "mcc"], p, y)
    tp, fp, fn = ((p == 1) & (y == 1)).sum(), ((p == 1) & (y == 0)).sum(), ((p == 0) & (y == 1)).sum()
    assert got["accuracy"] == pytest.approx((p == y).mean())
    assert got["f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn))
    assert -1 <= got["mcc"] <= 1
    s, t = rng.normal(size=50), rng.normal(size=50)
    reg = compute(["pearson", "spearmanr"], s, t)
    assert reg["pearson"] == pytest.approx(pearsonr(s, t)[0]) and reg["spearmanr"] == pytest.approx(
        spearmanr(s, t)[0]
    )


def test_hub_path_uses_datasets(monkeypatch, minilm) -> None:
    import datasets

    rows = {"sentence1": ["a cat", "a dog"] * 8, "sentence2": ["an animal", "a car"] * 8, "label": [0, 1] * 8}
    fake = datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(rows), "validation": datasets.Dataset.from_dict(rows)}
    )
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append(a) or fake)
    cfg = tiny_cfg("task=rte", "task.max_seq_len=16")
    data = load_task(cfg.task, cfg.model)
    assert calls == [("nyu-mll/glue", "rte")] and data.source == "hub:nyu-mll/glue/rte"
    assert len(data.train) == 16 and data.train.input_ids[0][0] == 101  # [CLS] of the bundled vocabulary


def test_synthetic_is_deterministic_and_balanced() -> None:
    a, b = synthetic(500, 32, 512, seed=3), synthetic(500, 32, 512, seed=3)
    assert a.input_ids == b.input_ids and 0.4 < np.mean(a.labels) < 0.6
    assert max(max(x) for x in a.input_ids) < 512 and max(len(x) for x in a.input_ids) <= 32


def test_ranks_see_the_slices_of_the_single_process_minibatch() -> None:
    data = synthetic(256, 32, 512, seed=1)
    one = TrainStream(data, 16, seed=5).batches()
    two = [TrainStream(data, 8, seed=5, world=2, rank=r).batches() for r in (0, 1)]
    for _ in range(5):
        full, r0, r1 = next(one), next(two[0]), next(two[1])
        assert torch.equal(full.input_ids, torch.cat([r0.input_ids, r1.input_ids]))
        assert torch.equal(full.labels, torch.cat([r0.labels, r1.labels]))


def test_stream_resumes_at_a_step() -> None:
    data = synthetic(100, 32, 512, seed=1)
    s = TrainStream(data, 8, seed=2)
    it = s.batches()
    seq = [next(it) for _ in range(20)]  # crosses the epoch boundary (12 steps per epoch)
    later = s.batches(start_step=13)
    assert torch.equal(next(later).input_ids, seq[13].input_ids)
    ub = seq[0].split(4)
    assert (
        len(ub) == 4
        and all(len(u) == 2 for u in ub)
        and torch.equal(torch.cat([u.input_ids for u in ub]), seq[0].input_ids)
    )


def test_user_files_json_lines_arrays_labels_and_holdout(tmp_path) -> None:
    """task=json|csv: labels come from the training file (sorted, numbers numerically), regression when the
    labels are numbers that are not all integers, dev = a seeded 10% of the training file when unset."""
    import json

    from l2l_cli.compose import compose
    from l2l_cli.config.validate import validate
    from l2l_cli.data import files
    from l2l_cli.problems import ConfigError

    rows = [
        {"q": f"question {i}", "a": f"answer {i}", "grade": [10, 2, 1][i % 3], "score": i / 7}
        for i in range(30)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "dev.json").write_text(json.dumps(rows[:6]))
    base = ["task=json", f"task.files={tmp_path / 'train.jsonl'}", "task.text_fields=[q,a]"]
    cfg = compose([*base, f"task.dev_files={tmp_path / 'dev.json'}", "task.label_field=grade"])
    assert validate(cfg) == []
    spec, train, dev = files.load(_task(cfg))
    assert spec.label_names == ("1", "2", "10") and spec.metrics == ("accuracy",) and len(dev) == 6
    assert (train[0].text_a, train[0].text_b, train[0].label) == ("question 0", "answer 0", 2)  # grade 10
    spec, train, dev = files.load(_task(compose([*base, "task.label_field=score"])))  # no dev file: held out
    assert (
        spec.is_regression and spec.metrics == ("pearson", "spearmanr") and (len(train), len(dev)) == (27, 3)
    )
    assert sorted(d.label for d in [*train, *dev]) == [i / 7 for i in range(30)]
    assert [d.label for d in dev] != [27 / 7, 28 / 7, 29 / 7]  # a seeded shuffle, not the file's tail
    # integers are classes unless told otherwise
    assert files.load(_task(compose([*base, "task.label_field=grade", "task.regression=true"])))[
        0
    ].is_regression
    problems = [str(p) for p in validate(compose([*base, "task.text_fields=[q,b]", "task.label_field=mark"]))]
    assert (
        problems[0].startswith("task.text_fields: ")
        and "has no column b; its columns: q, a, grade, score" in problems[0]
    )
    assert problems[1].startswith("task.label_field: ") and "has no column mark" in problems[1]
    (tmp_path / "dev.json").write_text(json.dumps([{**rows[0], "grade": 7}]))
    cfg = compose([*base, f"task.dev_files={tmp_path / 'dev.json'}", "task.label_field=grade"])
    with pytest.raises(ConfigError, match=r"label 7 is not among the training file's labels \(1, 2, 10\)"):
        files.load(_task(cfg))


def test_a_held_out_dev_split_is_shuffled_and_stratified(tmp_path, caplog) -> None:
    """Issue 40 item 3: a file sorted by label gave a one-class dev set (accuracy 1.0 after one step); the
    dev split now holds 10% of each label, the same for every run of these files, and says so."""
    import logging

    from l2l_cli.compose import compose
    from l2l_cli.data import files

    rows = (
        ["text,label"] + [f"good text {i},pos" for i in range(40)] + [f"bad text {i},neg" for i in range(40)]
    )
    (tmp_path / "sorted.csv").write_text("\n".join(rows) + "\n")
    cfg = compose(["task=csv", f"task.files={tmp_path / 'sorted.csv'}"])
    with caplog.at_level(logging.INFO, logger="l2l"):
        spec, train, dev = files.load(_task(cfg))
    assert (len(train), len(dev)) == (72, 8)
    assert sorted(spec.label_names[d.label] for d in dev) == ["neg"] * 4 + ["pos"] * 4
    assert "dev split: 8 of 80 examples held out" in caplog.text and "neg 4, pos 4" in caplog.text
    assert [d.text_a for d in files.load(_task(cfg))[2]] == [d.text_a for d in dev]  # one split per file
    rows = (
        ["text,label"] + [f"good text {i},pos" for i in range(40)] + [f"bad text {i},neg" for i in range(3)]
    )
    (tmp_path / "rare.csv").write_text("\n".join(rows) + "\n")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="l2l"):
        files.load(_task(compose(["task=csv", f"task.files={tmp_path / 'rare.csv'}"])))
    assert "the dev split holds one label only" in caplog.text


def test_one_text_field_may_be_given_as_a_name(tmp_path) -> None:
    """Issue 40 item 9b: ``task.text_fields=sentence`` (a string, not ``[sentence]``) was an OmegaConf type
    error; it is the one-element list."""
    from l2l_cli.compose import compose
    from l2l_cli.config.validate import validate
    from l2l_cli.data import files

    rows = ["sentence,label"] + [f"text number {i},{'pos' if i % 2 else 'neg'}" for i in range(20)]
    (tmp_path / "a.csv").write_text("\n".join(rows) + "\n")
    one = compose(["task=csv", f"task.files={tmp_path / 'a.csv'}", "task.text_fields=sentence"])
    listed = compose(["task=csv", f"task.files={tmp_path / 'a.csv'}", "task.text_fields=[sentence]"])
    assert validate(one) == []
    got, want = files.load(_task(one)), files.load(_task(listed))
    assert [e.text_a for e in got[1]] == [e.text_a for e in want[1]] and got[1][0].text_b is None


def _task(cfg: DictConfig) -> TaskConfig:
    """The composed config's ``task`` as the file kind reads it: typed (what ``load_task`` hands it)."""
    return typed(cfg.task, TaskConfig)
