"""The user's own data (``task=csv`` / ``task=json``): classification or regression from their files.

Files: CSV (``.csv``, comma) or TSV (``.tsv``, tab, quoting off as GLUE's), each with a header row; JSON lines
(one object per line) or a JSON array of objects. ``task.text_fields`` names one or two text columns (a
sentence, or a pair), ``task.label_field`` the target. Classification labels are the distinct values of the
training file, sorted (numbers numerically); ``task.regression`` unset means regression exactly when every
label is a number and not all are integers. ``task.files`` (and ``task.dev_files``) is a path or a list of
them, read in order; without ``task.dev_files`` a seeded, stratified 10% of the training examples is the
dev split.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from l2l_cli.config.schema import ModelConfig, TaskConfig
from l2l_cli.data.sources import as_list, data_error, json_records, kind_of, listed_files, text_lines
from l2l_cli.data.tasks import Example, TaskData, TaskKind, TaskSettings, TaskSpec
from l2l_cli.data.tokenize import encode_splits
from l2l_cli.problems import ConfigError, Problem

HOLDOUT = 0.1  # share of each label's training examples held out as dev when task.dev_files is unset
HOLDOUT_SEED = 0  # the held-out examples' shuffle (fixed: one dev split per set of files)
SPLITS = {"train": "task.files", "dev": "task.dev_files"}  # each split's key
log = logging.getLogger("l2l")


def read_records(path: Path, fmt: str, key: str = "task.files") -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) of a CSV/TSV file (``fmt`` csv: the line a row starts on) or of a JSON lines /
    JSON array file (``fmt`` json: the line, or the item's index in an array). Bad data is one line naming
    ``key``, the file and the line (:func:`l2l_cli.data.sources.check_file`'s errors)."""
    if fmt == "json":
        for n, obj in json_records(path, key):
            if not isinstance(obj, dict):
                raise data_error(key, path, n, f"{kind_of(obj)}, not a JSON object")
            yield n, obj
        return
    for _ in text_lines(path, key):  # UTF-8 throughout, or the line that is not
        pass
    tsv = path.suffix.lower() == ".tsv"
    with path.open(encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE) if tsv else csv.DictReader(f)
        try:
            for row in reader:
                yield reader.line_num, row
        except csv.Error as e:
            raise data_error(key, path, reader.line_num, f"not valid CSV ({e})") from None


def columns(path: Path, fmt: str, key: str = "task.files") -> list[str]:
    """The column names of a file: a CSV/TSV header, or the keys of a JSON file's first object."""
    if fmt == "json":
        first = next(read_records(path, fmt, key), None)
        return list(first[1]) if first else []
    for _ in text_lines(path, key):  # UTF-8 throughout, or the line that is not
        pass
    tsv = path.suffix.lower() == ".tsv"
    with path.open(encoding="utf-8-sig", newline="") as f:
        return next(
            csv.reader(
                f, delimiter="\t" if tsv else ",", quoting=csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL
            ),
            [],
        )


def check_columns(task: TaskConfig) -> list[Problem]:
    """Problems with ``task.files``, ``task.text_fields`` and ``task.label_field`` (before any work)."""
    fmt = task.name
    p: list[Problem] = []
    fields = as_list(task.text_fields)
    if not 1 <= len(fields) <= 2 or not all(isinstance(f, str) and f for f in fields):
        p.append(
            Problem(
                "task.text_fields",
                f"got {fields}; allowed: one or two column names, e.g. [text] or [question,answer]",
            )
        )
    if not split_files(task, "train"):
        return [
            *p,
            Problem("task.files", f"task={fmt} reads your files: set task.files (and task.dev_files)"),
        ]
    for split, key in SPLITS.items():
        for name in split_files(task, split):
            path = Path(name).expanduser()
            if not path.is_file():
                p.append(Problem(key, f"{name} is not a file"))
                continue
            try:
                have = columns(path, fmt, key)
            except ConfigError as e:
                p += e.problems
                continue
            except (OSError, UnicodeDecodeError, ValueError) as e:
                p.append(Problem(key, f"{name}: unreadable as {fmt} ({str(e).splitlines()[0]})"))
                continue
            if not have:
                p.append(Problem(key, f"{name} is empty"))
                continue
            listed = ", ".join(have[:12]) + (", ..." if len(have) > 12 else "")
            missing = [f for f in fields if isinstance(f, str) and f not in have]
            if missing:
                p.append(
                    Problem(
                        "task.text_fields",
                        f"{name} has no column {', '.join(missing)}; its columns: {listed}",
                    )
                )
            if task.label_field not in have:
                p.append(
                    Problem(
                        "task.label_field", f"{name} has no column {task.label_field}; its columns: {listed}"
                    )
                )
    return p


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int | float):
        return float(v)
    try:
        x = float(str(v).strip())
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def split_files(task: TaskConfig, split: str) -> list[str]:
    """The files of a split: ``task.files`` (train) or ``task.dev_files`` (dev), a path or a list."""
    return as_list(task.files if split == "train" else task.dev_files)


def _examples(
    paths: list[Path], task: TaskConfig, split: str
) -> tuple[list[tuple[str, str | None]], list[Any]]:
    texts: list[tuple[str, str | None]] = []
    labels: list[Any] = []
    for path in paths:
        t, v = _file_examples(path, task, split)
        texts, labels = texts + t, labels + v
    return texts, labels


def _file_examples(
    path: Path, task: TaskConfig, split: str
) -> tuple[list[tuple[str, str | None]], list[Any]]:
    fields, label = as_list(task.text_fields), task.label_field
    texts, labels = [], []
    key = SPLITS[split]
    try:
        for n, rec in read_records(path, task.name, key):
            raw = [rec.get(f) for f in fields]
            if any(t is None for t in raw) or rec.get(label) in (None, ""):
                raise data_error(key, path, n, f"lacks {', '.join(fields)} or {label}")
            for f, t in zip(fields, raw, strict=True):
                if not isinstance(t, str | int | float) or isinstance(t, bool):
                    raise data_error(key, path, n, f"{f} is {kind_of(t)}, not text")
            value = rec[label]
            if isinstance(value, bool) or not isinstance(
                value, str | int | float
            ):  # JSON true/false, a list, an object: no class name
                raise data_error(
                    key,
                    path,
                    n,
                    f"{label} is {json.dumps(value)[:40]} ({kind_of(value)}); "
                    "a label is a string or a number",
                )
            texts.append((str(raw[0]), str(raw[1]) if len(raw) > 1 else None))
            labels.append(value)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError([Problem(SPLITS[split], f"{path}: unreadable ({str(e).splitlines()[0]})")]) from e
    if not texts:
        raise ConfigError([Problem(SPLITS[split], f"{path} holds no examples")])
    return texts, labels


def label_space(task: TaskConfig, labels: list[Any]) -> tuple[bool, tuple[str, ...] | None]:
    """(regression, label names) from the training labels (see the module docstring)."""
    numbers = [_number(v) for v in labels]
    numeric = all(x is not None for x in numbers)
    regression = task.regression
    if regression is None:
        regression = numeric and not all(float(x).is_integer() for x in numbers)  # type: ignore[arg-type]
    if regression:
        if not numeric:
            bad = next(v for v, x in zip(labels, numbers) if x is None)
            raise ConfigError(
                [Problem("task.regression", f"labels must be numbers for regression; got {bad!r}")]
            )
        return True, None
    keys = sorted({_key(v) for v in labels}, key=lambda k: (k[0], k[1]))
    if len(keys) < 2:
        raise ConfigError(
            [
                Problem(
                    "task.label_field",
                    f"{task.label_field} has one value only; classification needs two or more",
                )
            ]
        )
    return False, tuple(k[2] for k in keys)


def _key(v: Any) -> tuple[int, Any, str]:
    """Sort numbers numerically, then strings; the label's name is its text (1.0 and 1 are one label)."""
    x = _number(v)
    if x is not None and x.is_integer():
        return (0, x, str(int(x)))
    return (1, str(v), str(v))


def load(task: TaskConfig) -> tuple[TaskSpec, list[Example], list[Example]]:
    """The task's spec and its train and dev examples (labels as ids, or floats for regression)."""
    train_paths = [Path(f).expanduser() for f in split_files(task, "train")]
    texts, raw = _examples(train_paths, task, "train")
    if split_files(task, "dev"):
        dev_texts, dev_raw = _examples([Path(f).expanduser() for f in split_files(task, "dev")], task, "dev")
    else:  # hold out a seeded, stratified 10% of the training examples
        keep, held = hold_out(raw, task, train_paths)
        texts, dev_texts = [texts[i] for i in keep], [texts[i] for i in held]
        raw, dev_raw = [raw[i] for i in keep], [raw[i] for i in held]
    regression, names = label_space(task, raw)
    spec = user_spec(task.name, names)

    def convert(pairs: list[tuple[str, str | None]], values: list[Any], split: str) -> list[Example]:
        if regression:
            return [Example(a, b, float(_number(v))) for (a, b), v in zip(pairs, values)]  # type: ignore[arg-type]
        index = {n: i for i, n in enumerate(names or ())}
        out = []
        for (a, b), v in zip(pairs, values):
            name = _key(v)[2]
            if name not in index:
                raise ConfigError(
                    [
                        Problem(
                            SPLITS[split],
                            f"label {v!r} is not among the training file's labels ({', '.join(index)})",
                        )
                    ]
                )
            out.append(Example(a, b, index[name]))
        return out

    return spec, convert(texts, raw, "train"), convert(dev_texts, dev_raw, "dev")


def hold_out(raw: list[Any], task: TaskConfig, paths: list[Path]) -> tuple[list[int], list[int]]:
    """(train, dev) indices of a dev split held out of the training examples: ``HOLDOUT`` of each label's
    examples (all examples for regression), picked by a seeded shuffle (the same split for every run, eval
    and predict of these files, whatever ``trainer.seed``), so a file sorted by label still gives a dev set
    of every label. Its size and label counts are logged; a dev set of one label is a warning."""
    regression, _ = label_space(task, raw)
    groups: dict[str, list[int]] = {}
    for i, v in enumerate(raw):
        groups.setdefault("" if regression else _key(v)[2], []).append(i)
    rng = random.Random(HOLDOUT_SEED)
    keep: list[int] = []
    held: list[int] = []
    for name in sorted(groups):
        idx = groups[name][:]
        rng.shuffle(idx)
        k = round(len(idx) * HOLDOUT)
        held += idx[:k]
        keep += idx[k:]
    if not held or not keep:
        where = ", ".join(map(str, paths))
        raise ConfigError(
            [
                Problem(
                    "task.dev_files", f"{where}: too few examples to hold out a dev split; set task.dev_files"
                )
            ]
        )
    keep.sort()
    held.sort()
    counts = {} if regression else {n: sum(1 for i in held if _key(raw[i])[2] == n) for n in sorted(groups)}
    shown = ", ".join(f"{n} {c}" for n, c in counts.items() if c)
    log.info(
        "dev split: %d of %d examples held out of task.files (seeded, stratified by label%s)",
        len(held),
        len(raw),
        f": {shown}" if shown else "",
    )
    if len([c for c in counts.values() if c]) == 1:
        log.warning(
            "the dev split holds one label only (%s): its accuracy says little; set task.dev_files", shown
        )
    return keep, held


def user_spec(name: str, label_names: tuple[str, ...] | None) -> TaskSpec:
    """The TaskSpec of a user task: accuracy (and F1 for two classes), or Pearson/Spearman for regression."""
    if label_names is None:
        return TaskSpec(
            name, "-", (), (), None, ("pearson", "spearmanr"), "spearmanr", file_format=name, kind="files"
        )
    metrics = ("accuracy", "f1") if len(label_names) == 2 else ("accuracy",)
    return TaskSpec(name, "-", (), (), label_names, metrics, "accuracy", file_format=name, kind="files")


def load_kind(spec: TaskSpec, task_cfg: TaskConfig, model_cfg: ModelConfig, train_split: bool) -> TaskData:
    spec, raw_train, raw_dev = load(task_cfg)
    source = f"{spec.file_format}:{','.join(split_files(task_cfg, 'train'))}"
    return encode_splits(spec, raw_train, raw_dev, source, task_cfg, model_cfg, train_split)


def validate(cfg: TaskSettings, check_files: bool) -> list[Problem]:
    """task.files / dev_files name readable files with the columns task.text_fields and task.label_field."""
    task, p = cfg.task, []
    if task.data_dir is not None:
        p.append(Problem("task.data_dir", f"task={task.name} reads task.files; leave task.data_dir unset"))
    shapes = [problem for key in ("files", "dev_files") if (problem := listed_files(task, key)[1])]
    p.extend(shapes)
    if check_files and not shapes:
        p.extend(check_columns(task))
        if not p:  # every record, read as the run will (bad data refused before a run dir exists)
            try:
                load(task)
            except ConfigError as e:
                p += e.problems
    return p


KIND = TaskKind(
    "files", load_kind, validate, keys=("files", "dev_files", "text_fields", "label_field", "regression")
)
