"""Task ``chat``: fine-tuning a decoder on conversations or instruction/response pairs, with the loss on
the assistant's tokens only (what torchtune's chat datasets, TRL's SFT and axolotl do).

Rows come from ``task.files`` (.jsonl/.json/.parquet) or ``task.dataset`` (a hub id or a local folder,
``task.streaming`` to stream it), in one of three shapes (``task.format``, ``auto`` picks by the fields):
``messages`` (a list of {role, content}), ``instruction`` (``instruction``, optional ``input``,
``output``) and ``prompt_completion`` (``prompt``/``completion``, text or message lists). The last two
become messages (a user turn, an assistant turn), so every shape renders alike.

A conversation is rendered with the tokenizer's chat template (``task.chat_template`` overrides it) and
tokenized once. Which tokens are the assistant's: a template with ``{% generation %}`` blocks says so
itself (``return_assistant_tokens_mask``); otherwise the text is rendered incrementally: the characters
that rendering assistant turn i adds after ``messages[:i]`` with the generation prompt (its content and
end-of-turn marker, not the role header) are the answer, and a token counts when it starts inside them.
That needs a template that renders a conversation's prefix as a prefix of the whole (those that rewrite
earlier turns are refused, naming the example). ``task.train_on=all`` trains on every token instead.

Rows are cut at ``task.max_seq_len`` (how many were cut is logged and put in the summary); with
``task.packing`` whole examples share rows, numbered so attention stays inside each and positions restart
(``models/decoder.py``). Bad data (a missing field, an unknown role, an answer cut away) is one line
naming the key and the example index, found before the run starts: the rendered splits are cached, so the
check and the run render once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from l2l_cli.config.schema import ModelConfig, TaskConfig
from l2l_cli.data import sources
from l2l_cli.data.chat_render import Encoder, make_encoder, template_problem
from l2l_cli.data.chat_rows import ROLES, Fields, detect, messages_of
from l2l_cli.data.lm import cache_root, dataset_key, file_key, tokenizer_fingerprint
from l2l_cli.data.rows import IGNORE, Encoded, RowMaker, Rows, StreamedTrain, pack_examples
from l2l_cli.data.sources import RowStream, as_list, listed_files
from l2l_cli.data.tasks import TaskData, TaskKind, TaskSettings, TaskSpec
from l2l_cli.data.templates import named
from l2l_cli.problems import ConfigError, Problem

log = logging.getLogger(__name__)

FORMATS = ("auto", "messages", "instruction", "prompt_completion")
TRAIN_ON = ("assistant", "all")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
CACHE_VERSION = 2  # 2: an answer's span ends at its end-of-turn token
STREAM_CHECK_ROWS = 16  # a streamed dataset: rows checked before the run starts
STREAM_DEV_ROWS = 64  # a streamed dataset without a dev source: its first rows (default) are the dev split


# ---- splits ---------------------------------------------------------------------------------------------


def line_of(path: Path | None, index: int) -> int | None:
    """The line of a .jsonl file that holds its example ``index`` (blank lines skipped), else None."""
    if path is None or path.suffix.lower() != ".jsonl":
        return None
    seen = -1
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, text in enumerate(f, start=1):
            seen += bool(text.strip())
            if seen == index:
                return n
    return None


def encode_rows(
    ds: Any, enc: Encoder, fmt: str, name: str, first: int = 0, path: Path | None = None
) -> list[Encoded]:
    """Every row of an in-memory dataset, encoded (``first``: the index of its first row in the data;
    ``path``: the file the rows come from, so a ``task.fields`` mapping's error names the line)."""

    def line(i: int) -> str | None:
        n = line_of(path, i)
        return f"{name} line {n}" if n is not None else None

    shape = detect(list(ds.column_names), line(first) or name, enc.fields) if fmt == "auto" else fmt
    out = []
    for i, row in enumerate(ds, start=first):
        where = f"{name} example {i}"
        try:
            messages = messages_of(row, shape, where, enc.fields)
        except ConfigError as e:  # the mapping's error: again, with the file's line (read only now)
            if not any(q.key.startswith("task.fields") for q in e.problems) or line(i) is None:
                raise
            messages = messages_of(row, shape, where, enc.fields, line(i))
        out.append(enc.encode(messages, where))
    return out


def read_split(
    task: TaskConfig, enc: Encoder, key: str, split: str | None, cache: Path
) -> list[Encoded] | None:
    """The examples of task.files / task.dev_files (``key``) or of the dataset's ``split``."""
    if task.dataset:
        if split is None:
            return None
        return encode_rows(
            sources.open_dataset(task, split, cache, False), enc, task.format, f"{task.dataset}:{split}"
        )
    paths = [Path(f).expanduser() for f in as_list(getattr(task, key))]
    if not paths:
        return None
    out: list[Encoded] = []
    for p in paths:  # one file at a time: the example index is the file's
        out += encode_rows(
            sources.open_files([p], cache, key=f"task.{key}"), enc, task.format, p.name, path=p
        )
    return out


def cache_key(task: TaskConfig, enc: Encoder) -> str:
    if task.dataset:
        data: Any = dataset_key(task)
    else:
        data = [
            file_key([Path(f).expanduser() for f in as_list(task.files)]),
            file_key([Path(f).expanduser() for f in as_list(task.dev_files)]),
        ]
    return hashlib.sha256(
        json.dumps(
            {
                "v": CACHE_VERSION,
                "data": data,
                "tokenizer": tokenizer_fingerprint(enc.tok),
                "template": enc.template,
                "format": task.format,
                "train_on": task.train_on,
                "seq": enc.max_len,
                "packing": bool(task.packing),
                "dev_fraction": float(task.dev_fraction),
                "fields": enc.fields.key(),
            },
            sort_keys=True,
            default=str,
        ).encode()
    ).hexdigest()[:24]


def save_rows(path: Path, splits: dict[str, Rows], stats: dict[str, int]) -> None:
    arrays: dict[str, np.ndarray] = {"stats": np.asarray(json.dumps(stats))}
    for name, rows in splits.items():
        lens = np.asarray([len(r[0]) for r in rows.rows], dtype=np.int64)
        arrays[f"{name}_lens"] = lens
        for j, part in enumerate(("ids", "labels", "docs")):
            parts = [r[j] for r in rows.rows]
            arrays[f"{name}_{part}"] = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.stem}.{os.getpid()}.npz"
    np.savez(tmp, **arrays)  # type: ignore[arg-type]
    os.replace(tmp, path)  # atomic: data-parallel ranks may render at the same time


def load_rows(path: Path) -> tuple[dict[str, Rows], dict[str, int]]:
    with np.load(path) as z:
        out = {}
        for name in ("train", "dev"):
            cuts = np.cumsum(z[f"{name}_lens"])[:-1]
            parts = [np.split(z[f"{name}_{p}"], cuts) for p in ("ids", "labels", "docs")]
            out[name] = Rows([(a, b, c) for a, b, c in zip(*parts)] if len(z[f"{name}_lens"]) else [])
        return out, json.loads(str(z["stats"]))


def prepare(task: TaskConfig, model: ModelConfig) -> tuple[Rows, Rows, dict[str, int], Encoder, str]:
    """(train rows, dev rows, truncation stats, encoder, tokenizer ref) of an in-memory chat dataset,
    from the cache when it has them."""
    enc, ref = make_encoder(task, model)
    cached = cache_root() / "chat" / f"{cache_key(task, enc)}.npz"
    if cached.is_file():
        splits, stats = load_rows(cached)
        return splits["train"], splits["dev"], stats, enc, ref
    hf_cache = cache_root() / "datasets"
    train = read_split(task, enc, "files", task.split, hf_cache) or []
    dev = read_split(task, enc, "dev_files", task.dev_split, hf_cache)
    if dev is None:
        n_dev = max(1, round(task.dev_fraction * len(train))) if len(train) > 1 else 0
        train, dev = train[: len(train) - n_dev], train[len(train) - n_dev :]
    if not train or not dev:
        raise ConfigError(
            [
                Problem(
                    "task.files" if not task.dataset else "task.dataset",
                    f"{len(train)} train and {len(dev)} dev examples; both splits need one",
                )
            ]
        )
    seq, packing = enc.max_len, bool(task.packing)
    tr, dv = Rows(pack_examples(train, seq, packing)), Rows(pack_examples(dev, seq, packing))
    stats = {
        "examples": enc.examples,
        "truncated": enc.truncated,
        "train_rows": len(tr),
        "dev_rows": len(dv),
        "answer_tokens": int(sum((r[1] != IGNORE).sum() for r in tr.rows)),
    }
    save_rows(cached, {"train": tr, "dev": dv}, stats)
    return tr, dv, stats, enc, ref


# ---- streaming ------------------------------------------------------------------------------------------


def stream_encoder(enc: Encoder, fmt: str, name: str) -> Callable[[int, dict[str, Any]], Encoded]:
    shape: list[str] = []

    def encode(index: int, row: dict[str, Any]) -> Encoded:
        if not shape:
            shape.append(detect(list(row), name, enc.fields) if fmt == "auto" else fmt)
        where = f"{name} example {index}"
        return enc.encode(messages_of(row, shape[0], where, enc.fields), where)

    return encode


def open_stream(task: TaskConfig, key: str, split: str) -> tuple[RowStream, str]:
    if task.dataset:
        return RowStream(lambda: sources.open_dataset(task, split, cache_root() / "datasets", True)), (
            f"{task.dataset}:{split}"
        )
    paths = [Path(f).expanduser() for f in as_list(getattr(task, key))]
    return RowStream(
        lambda: sources.open_files(paths, cache_root() / "datasets", True, f"task.{key}")
    ), ",".join(p.name for p in paths)


def streamed(
    task: TaskConfig, model: ModelConfig, limit: int | None = None
) -> tuple[Any, Rows, Encoder, str]:
    """(a factory of the training stream, the dev rows, encoder, tokenizer ref) of a streamed dataset.
    Without a dev source, the stream's first rows are the dev split and training starts after them."""
    enc, ref = make_encoder(task, model)
    how = "packed" if task.packing else "padded"
    train_src, name = open_stream(task, "files", task.split)
    maker = RowMaker(train_src, stream_encoder(enc, task.format, name), enc.max_len, how)
    n_dev = limit or task.max_eval_samples or STREAM_DEV_ROWS
    if task.dev_files or task.dev_split:
        dev_src, dev_name = open_stream(task, "dev_files", task.dev_split or task.split)
        dev_maker = RowMaker(dev_src, stream_encoder(enc, task.format, dev_name), enc.max_len, how)
        dev = Rows([dev_maker.row() for _ in range(n_dev)])
    else:
        dev = Rows([maker.row() for _ in range(n_dev)])
    return maker, dev, enc, ref


# ---- the kind ----------------------------------------------------------------------------------------------


def load(spec: TaskSpec, task: TaskConfig, model: ModelConfig, train_split: bool) -> TaskData:
    if task.streaming:
        maker, dev, enc, ref = streamed(task, model)
        source = f"chat:stream:{sources.describe(task)}"

        def stream(batch_size: int, world: int, rank: int, pad_to_max: int | None) -> StreamedTrain:
            return StreamedTrain(maker, batch_size, world=world, rank=rank, pad_to_max=pad_to_max)

        log.info("task chat: %s streamed, rendered by %s; %d dev rows", source, ref, len(dev))
        return TaskData(spec, Rows([]), dev, source, enc.tok, stream=stream)
    train, dev, stats, enc, ref = prepare(task, model)
    source = f"chat:{sources.describe(task)}"
    log.info(
        "task chat: %s rendered by %s: %d examples (%d cut at task.max_seq_len=%d), %d train and %d dev "
        "rows, %d answer tokens",
        source,
        ref,
        stats["examples"],
        stats["truncated"],
        enc.max_len,
        stats["train_rows"],
        stats["dev_rows"],
        stats["answer_tokens"],
    )
    if stats["truncated"]:
        log.warning(
            "task chat: %d of %d examples were longer than task.max_seq_len=%d tokens and were cut",
            stats["truncated"],
            stats["examples"],
            enc.max_len,
        )
    return TaskData(spec, train if train_split else Rows([]), dev, source, enc.tok, stats=stats)


def validate(cfg: TaskSettings, check_files: bool) -> list[Problem]:
    """The keys, then (``check_files``) the data itself: rendered whole (a streamed dataset: its first
    rows), so bad data is refused before a run dir exists."""
    task, p = cfg.task, []
    if task.format not in FORMATS:
        p.append(Problem("task.format", f"got {task.format!r}; allowed: {', '.join(FORMATS)}"))
    if task.train_on not in TRAIN_ON:
        p.append(Problem("task.train_on", f"got {task.train_on!r}; allowed: {', '.join(TRAIN_ON)}"))
    if task.data_dir is not None:
        p.append(
            Problem("task.data_dir", "task=chat reads task.files or task.dataset; leave task.data_dir unset")
        )
    template = None if named(task.chat_template) else template_problem(task.chat_template)
    if template is not None:
        p.append(template)
    for speaker, role in Fields.of(task).roles:
        if role not in ROLES:
            p.append(Problem(f"task.fields.roles.{speaker}", f"got {role!r}; allowed: {', '.join(ROLES)}"))
    p += source_problems(cfg, FILE_SUFFIXES, check_files)
    if p or not check_files:
        return p
    try:
        if task.streaming:
            streamed(task, cfg.model, limit=STREAM_CHECK_ROWS)
        else:
            prepare(task, cfg.model)
    except ConfigError as e:
        p += e.problems
    return p


def source_problems(cfg: TaskSettings, suffixes: tuple[str, ...], check_files: bool) -> list[Problem]:
    """task.files / task.dev_files (chat's formats) or task.dataset, and the dataset keys."""
    task, p = cfg.task, []
    files, problem = listed_files(task, "files")
    dev_files, dev_problem = listed_files(task, "dev_files")
    p += [x for x in (problem, dev_problem) if x is not None]
    if check_files and not task.dataset and not files:
        p.append(
            Problem("task.files", "task=chat needs task.files (.jsonl, .json, .parquet) or task.dataset")
        )
    for key, names in (("files", files), ("dev_files", dev_files)):
        for f in names:
            suffix = Path(f).suffix.lower()
            if suffix not in suffixes:
                p.append(
                    Problem(
                        f"task.{key}",
                        f"{f}: unsupported format {suffix or '(none)'}; allowed: {', '.join(suffixes)}",
                    )
                )
            elif check_files and not Path(f).expanduser().is_file():
                p.append(Problem(f"task.{key}", f"{f} is not a file"))
    if not (0.0 <= task.dev_fraction < 1.0):
        p.append(Problem("task.dev_fraction", f"got {task.dev_fraction}; must be in [0, 1)"))
    return p + sources.dataset_problems(cfg)


KIND = TaskKind(
    "chat",
    load,
    validate,
    keys=(
        "files",
        "dev_files",
        "dev_fraction",
        "format",
        "chat_template",
        "fields",
        "train_on",
        "packing",
        "dataset",
        "dataset_config",
        "split",
        "dev_split",
        "streaming",
    ),
)
