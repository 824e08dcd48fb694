"""Task registry: the nine GLUE tasks, the built-in synthetic task, ``lm`` (causal language modelling on
the user's text files), ``chat`` (conversations, the loss on the answers) and ``csv``/``json`` (the user's
labelled files).

A task (:class:`TaskSpec`) knows its labels and official metrics, and names its *kind*: the family of
tasks that share where examples come from and which ``task.*`` keys they read (:class:`TaskKind`: ``glue``
in :mod:`~l2l_cli.data.glue`, ``synthetic``, ``lm``, ``chat``, ``files``; each kind's file holds its loader
and its own rules, and :mod:`~l2l_cli.data.loading` lists them). Parsing follows the GLUE TSV layout with
quoting off, as the transformers GLUE processors do (several files contain unbalanced quotes).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from l2l_cli.config.schema import ModelConfig, TaskConfig, TrainerConfig
from l2l_cli.problems import Problem

csv.field_size_limit(1 << 24)


# What a task trains a model to do, and so which model families can train it (ModelFamily.objective)
CLASSIFY = "classify"  # a head over the sequence: GLUE, synthetic, the user's labelled files
LM = "lm"  # next-token prediction: a decoder


def counts_tokens(task_name: str | None) -> bool:
    """Whether a run's throughput is best read in tokens (a language model's)."""
    spec = TASKS.get(task_name or "")
    return spec is not None and spec.objective == LM


@dataclass(frozen=True)
class Example:
    text_a: str
    text_b: str | None
    label: float | int


@dataclass(frozen=True)
class TaskSpec:
    name: str
    glue_dir: str  # folder name in the GLUE download ("RTE")
    hub: tuple[str, ...]  # hub columns: text_a, [text_b], label
    tsv: tuple[str | int, ...]  # TSV columns (header names, or indices when there is no header)
    label_names: tuple[str, ...] | None  # None: regression
    metrics: tuple[str, ...]
    main_metric: str
    dev_file: str = "dev.tsv"
    hub_dev_split: str = "validation"
    tsv_label_map: dict[str, int] = field(default_factory=dict)  # TSV label string -> id (default int())
    objective: str = CLASSIFY  # CLASSIFY (a head over the sequence) | LM (next-token prediction)
    file_format: str | None = None  # "csv" | "json": the user's own files (task.files, data/files.py)
    kind: str = "glue"  # its TaskKind: where examples come from and which task.* keys it reads

    @property
    def num_labels(self) -> int:
        return 1 if self.label_names is None else len(self.label_names)

    @property
    def is_regression(self) -> bool:
        return self.label_names is None and self.objective == CLASSIFY

    def step_metrics(self, loss: float) -> dict[str, float]:
        """What a training step's loss also says (a language model's perplexity)."""
        if self.objective == LM and math.isfinite(loss):
            return {"perplexity": math.exp(min(loss, 700.0))}
        return {}

    @property
    def generated(self) -> bool:
        """Examples made by the tool (the synthetic task): their count is task.num_train."""
        return self.kind == "synthetic"

    @property
    def has_header(self) -> bool:
        return not isinstance(self.tsv[0], int)

    def parse_label(self, raw: str) -> float | int:
        raw = raw.strip()
        if self.is_regression:
            return float(raw)
        if self.tsv_label_map:
            return self.tsv_label_map[raw]
        value = int(raw)
        if not 0 <= value < self.num_labels:
            raise ValueError(f"label {raw!r} out of range")
        return value

    def check_source(self, data_dir: str | None) -> list[Problem]:
        """Problems with a GLUE task.data_dir (missing folder, files, or columns); empty when usable."""
        if data_dir is None:
            return []
        root = Path(data_dir).expanduser()
        if not root.is_dir():
            return [
                Problem("task.data_dir", f"{data_dir} is not a directory (expected GLUE's {self.glue_dir}/)")
            ]
        problems = []
        for fname in ("train.tsv", self.dev_file):
            path = root / fname
            if not path.is_file():
                problems.append(
                    Problem("task.data_dir", f"{data_dir} has no {fname} (GLUE {self.glue_dir} layout)")
                )
                continue
            msg = self._check_columns(path)
            if msg:
                problems.append(Problem("task.data_dir", f"{path}: {msg}"))
        return problems

    def _check_columns(self, path: Path) -> str | None:
        try:
            with path.open(encoding="utf-8-sig", newline="") as f:
                first = f.readline().rstrip("\r\n").split("\t")
        except (OSError, UnicodeDecodeError) as e:
            return f"unreadable ({e})"
        if self.has_header:
            missing = [c for c in self.tsv if c not in first]
            if missing:
                return (
                    f"malformed header: missing column(s) {', '.join(map(str, missing))} for task {self.name}"
                )
        elif len(first) <= max(self.tsv):  # type: ignore[type-var]
            return f"malformed row: expected at least {max(self.tsv) + 1} tab-separated columns"  # type: ignore[operator]
        return None

    def read_tsv(self, path: Path) -> list[Example]:
        """Read one GLUE TSV split. Rows that do not parse are counted; more than 1% of them is an error."""
        examples: list[Example] = []
        bad = 0
        with path.open(encoding="utf-8-sig", newline="") as f:
            rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            if self.has_header:
                header = next(rows)
                cols = [header.index(c) for c in self.tsv]  # type: ignore[arg-type]
            else:
                cols = list(self.tsv)  # type: ignore[arg-type]
            for row in rows:
                try:
                    text_b = row[cols[1]] if len(cols) == 3 else None
                    examples.append(Example(row[cols[0]], text_b, self.parse_label(row[cols[-1]])))
                except (IndexError, ValueError, KeyError):
                    bad += 1
        if bad > max(1, len(examples) // 100):
            raise ValueError(f"{path}: {bad} malformed rows of {bad + len(examples)} for task {self.name}")
        return examples


@dataclass
class TaskData:
    spec: TaskSpec
    train: Any  # Encoded (classification) | lm.Packed (token blocks)
    dev: Any
    source: str  # "synthetic", "tsv:<dir>", "hub:glue/<name>", "lm:<files>"
    tokenizer: Any = None  # the texts' tokenizer, saved with final/ (lm: its vocabulary must fit the model's)
    stream: Callable[..., Any] | None = (
        None  # task.streaming: (batch size, world, rank, pad) -> its train stream
    )
    stats: dict[str, int] | None = None  # what loading found (chat: examples cut at task.max_seq_len)


@dataclass(frozen=True)
class TaskSettings:
    """What a task kind's checks read, typed: ``task.*``, ``model.*`` (its tokenizer and vocabulary) and
    ``trainer.*`` (a stream's fixed length)."""

    task: TaskConfig
    model: ModelConfig
    trainer: TrainerConfig


@dataclass(frozen=True)
class TaskKind:
    """A family of tasks: where their examples come from and which ``task.*`` keys they read.

    ``keys``: the task keys only this kind reads; set under a task of another kind they are refused (the
    run would ignore them). ``validate(settings, check_files)`` checks those keys (and the files they name,
    with ``check_files``); ``load(spec, task.*, model.*, train_split)`` reads and tokenizes the splits.
    """

    name: str
    load: Callable[[TaskSpec, TaskConfig, ModelConfig, bool], TaskData]
    validate: Callable[[TaskSettings, bool], list[Problem]]
    keys: tuple[str, ...] = ()


_BIN = ("0", "1")

TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        TaskSpec(
            "cola", "CoLA", ("sentence", "label"), (3, 1), ("unacceptable", "acceptable"), ("mcc",), "mcc"
        ),
        TaskSpec(
            "sst2",
            "SST-2",
            ("sentence", "label"),
            ("sentence", "label"),
            ("negative", "positive"),
            ("accuracy",),
            "accuracy",
        ),
        TaskSpec(
            "mrpc",
            "MRPC",
            ("sentence1", "sentence2", "label"),
            ("#1 String", "#2 String", "Quality"),
            ("not_equivalent", "equivalent"),
            ("accuracy", "f1"),
            "f1",
        ),
        TaskSpec(
            "qqp",
            "QQP",
            ("question1", "question2", "label"),
            ("question1", "question2", "is_duplicate"),
            ("not_duplicate", "duplicate"),
            ("accuracy", "f1"),
            "f1",
        ),
        TaskSpec(
            "stsb",
            "STS-B",
            ("sentence1", "sentence2", "label"),
            ("sentence1", "sentence2", "score"),
            None,
            ("pearson", "spearmanr"),
            "spearmanr",
        ),
        TaskSpec(
            "mnli",
            "MNLI",
            ("premise", "hypothesis", "label"),
            ("sentence1", "sentence2", "gold_label"),
            ("entailment", "neutral", "contradiction"),
            ("accuracy",),
            "accuracy",
            dev_file="dev_matched.tsv",
            hub_dev_split="validation_matched",
            tsv_label_map={"entailment": 0, "neutral": 1, "contradiction": 2},
        ),
        TaskSpec(
            "qnli",
            "QNLI",
            ("question", "sentence", "label"),
            ("question", "sentence", "label"),
            ("entailment", "not_entailment"),
            ("accuracy",),
            "accuracy",
            tsv_label_map={"entailment": 0, "not_entailment": 1},
        ),
        TaskSpec(
            "rte",
            "RTE",
            ("sentence1", "sentence2", "label"),
            ("sentence1", "sentence2", "label"),
            ("entailment", "not_entailment"),
            ("accuracy",),
            "accuracy",
            tsv_label_map={"entailment": 0, "not_entailment": 1},
        ),
        TaskSpec(
            "wnli",
            "WNLI",
            ("sentence1", "sentence2", "label"),
            ("sentence1", "sentence2", "label"),
            ("not_entailment", "entailment"),
            ("accuracy",),
            "accuracy",
        ),
        TaskSpec("synthetic", "-", (), (), ("b_more", "a_more"), ("accuracy",), "accuracy", kind="synthetic"),
        TaskSpec("lm", "-", (), (), None, ("loss", "perplexity"), "perplexity", objective=LM, kind="lm"),
        # conversations / instructions, the loss on the answers (data/chat.py)
        TaskSpec("chat", "-", (), (), None, ("loss", "perplexity"), "perplexity", objective=LM, kind="chat"),
        # the user's files: labels (and whether it is a regression) come from the data when it loads
        TaskSpec("csv", "-", (), (), ("0", "1"), ("accuracy",), "accuracy", file_format="csv", kind="files"),
        TaskSpec(
            "json", "-", (), (), ("0", "1"), ("accuracy",), "accuracy", file_format="json", kind="files"
        ),
    )
}
