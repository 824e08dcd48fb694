"""Where the rows of ``task=lm`` and ``task=chat`` come from: the user's files (``task.files``), or a
dataset named by ``task.dataset`` (a hub id, or a local folder of parquet/JSON files), read whole or as a
stream (``task.streaming``). Both go through ``datasets.load_dataset``, so what a local folder does in the
tests is what a hub dataset does for a user; :class:`RowStream` keeps the stream's position for an exact
resume."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from l2l_cli.config.schema import TaskConfig
from l2l_cli.data.tasks import TaskSettings
from l2l_cli.problems import ConfigError, Problem

FILE_FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}


def as_list(value: Any) -> list[str]:
    """``task.files`` / ``task.dev_files``: one path or a list of them (None: none)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def listed_files(task: TaskConfig, key: str) -> tuple[list[str], Problem | None]:
    """``task.files`` / ``task.dev_files`` as a list of paths, or the problem with its shape."""
    value = getattr(task, key)
    if value is None:
        return [], None
    is_list = OmegaConf.is_list(value) or isinstance(value, list | tuple)
    if not (isinstance(value, str) or is_list) or not as_list(value):
        return [], Problem(
            f"task.{key}", f"got {value!r}; expected a file or a list of files ([a.txt,b.jsonl])"
        )
    return as_list(value), None


# ---- one data-error path for every task kind: a file's first problem, with its line -----------------

TEXT_SUFFIXES = (".txt", ".text", ".md", ".csv", ".tsv")


def text_lines(path: Path, key: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 file (a BOM dropped), one line at a time; bytes that are not UTF-8
    are a :class:`ConfigError` naming ``key``, the file and the line."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if n == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise data_error(
                    key,
                    path,
                    n,
                    f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                    f"{e.start + 1}); save the file as UTF-8",
                ) from None


def kind_of(value: Any) -> str:
    """A JSON value's kind, for a message: ``a number``, ``a boolean``, ``a list``, ``an object``, ..."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object", type(None): "null"}.get(
        type(value), f"a {type(value).__name__}"
    )


def data_error(key: str, path: Path, line: int | None, msg: str) -> ConfigError:
    """Bad data, one line: ``<key>: <file> line <n>: <what>`` (exit 2, like every config error)."""
    return ConfigError([Problem(key, f"{path}{f' line {line}' if line else ''}: {msg}")])


def json_records(path: Path, key: str) -> Iterator[tuple[int, Any]]:
    """(line number, value) of a JSON-lines file, or of a JSON array (the line each item starts on is not
    known: its index + 1); a line that is not JSON is named by its line in the file."""
    first = ""
    for _, text in text_lines(path, key):
        if text.strip():
            first = text.lstrip()
            break
    if first.startswith("["):
        text = "".join(t for _, t in text_lines(path, key))
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise data_error(key, path, e.lineno, f"not valid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(data, list):
            raise data_error(key, path, None, "a JSON file holds an array of objects, or one object per line")
        yield from enumerate(data, start=1)
        return
    for n, text in text_lines(path, key):
        if not text.strip():
            continue
        try:
            yield n, json.loads(text)
        except json.JSONDecodeError as e:
            raise data_error(key, path, n, f"not valid JSON ({e.msg}, column {e.colno})") from None


def check_file(path: Path, key: str, text_field: str | None = None) -> None:
    """Raise the first problem of a data file (any task kind's): unreadable, not UTF-8, empty, a JSON line
    that does not parse or is not an object, a ``text_field`` that is not text, a broken parquet file;
    each named by ``key``, the file and its line. What passes reads through ``datasets`` or ``csv``."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                rows = pq.read_metadata(str(path)).num_rows
            except Exception as e:
                raise data_error(
                    key, path, None, f"not a parquet file ({str(e).splitlines()[0][:200]})"
                ) from None
            if rows == 0:
                raise data_error(key, path, None, "empty (no rows)")
            return
        if suffix in (".jsonl", ".json"):
            seen = False
            for n, obj in json_records(path, key):
                seen = True
                if not isinstance(obj, dict):
                    raise data_error(key, path, n, f"{kind_of(obj)}, not a JSON object")
                value = obj.get(text_field) if text_field else None
                if value is not None and not isinstance(value, str):
                    raise data_error(key, path, n, f"{text_field} is {kind_of(value)}, not text")
            if not seen:
                raise data_error(key, path, None, "empty (no records)")
            return
        if not sum(bool(t.strip()) for _, t in text_lines(path, key)):  # every line read: all UTF-8
            raise data_error(key, path, None, "empty (no text)")
    except OSError as e:
        raise data_error(key, path, None, f"cannot be read ({e.strerror})") from None


def dataset_problems(cfg: TaskSettings) -> list[Problem]:
    """The dataset keys (task=lm and chat): task.dataset or task.files, the keys that only a dataset
    reads, and a stream's fixed length."""
    task, p = cfg.task, []
    if task.dataset is not None and (task.files is not None or task.dev_files is not None):
        p.append(Problem("task.dataset", "set task.dataset or task.files/dev_files, not both"))
    if task.dataset is None:
        for key in ("dataset_config", "dev_split"):
            if getattr(task, key) is not None:
                p.append(Problem(f"task.{key}", "applies to task.dataset; leave it unset with task.files"))
    if not task.split:
        p.append(Problem("task.split", "must name the dataset's training split (e.g. train)"))
    if task.streaming and cfg.trainer.max_steps < 1:
        p.append(
            Problem(
                "trainer.max_steps",
                f"got {cfg.trainer.max_steps}; task.streaming=true needs a fixed "
                "number of steps (a stream has no epochs)",
            )
        )
    return p


def quiet_datasets() -> Any:
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def open_files(
    paths: list[Path],
    cache_dir: Path,
    streaming: bool = False,
    key: str = "task.files",
    text_field: str | None = None,
) -> Any:
    """The rows of local files (one format, in order) through ``datasets``' loader for it; each file is
    checked first (:func:`check_file`), and what ``datasets`` still refuses (columns whose type changes
    between rows, say) is one line naming ``key`` and the files."""
    datasets = quiet_datasets()
    fmt = FILE_FORMATS[paths[0].suffix.lower()]
    for path in paths:
        check_file(path, key, text_field if fmt == "json" else None)
    extra = {"sample_by": "paragraph"} if fmt == "text" else {}
    files = [str(p) for p in paths]
    try:
        if streaming:
            return datasets.load_dataset(fmt, data_files=files, split="train", streaming=True, **extra)
        return datasets.load_dataset(fmt, data_files=files, split="train", cache_dir=str(cache_dir), **extra)
    except Exception as e:
        raise data_error(
            key, Path(",".join(files)), None, f"cannot be read as {fmt} ({root_cause(e)})"
        ) from e


def root_cause(e: BaseException) -> str:
    """The first line of the innermost cause of ``e`` (``datasets`` wraps pyarrow's message in its own)."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:200]


def open_dataset(task: TaskConfig, split: str, cache_dir: Path, streaming: bool) -> Any:
    """``datasets.load_dataset(task.dataset, task.dataset_config, split=split, streaming=...)``; a failure
    (offline, a typo, no such split) is bad input naming ``task.dataset``."""
    datasets = quiet_datasets()
    kw: dict[str, Any] = {"split": split, "streaming": streaming}
    if not streaming:
        kw["cache_dir"] = str(cache_dir)
    try:
        return datasets.load_dataset(str(task.dataset), task.dataset_config, **kw)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            [
                Problem(
                    "task.dataset",
                    f"cannot load {task.dataset} (config {task.dataset_config}, split {split}): "
                    f"{first[:200]}",
                )
            ]
        ) from e


def describe(task: TaskConfig) -> str:
    """The data's name for logs and the summary's data_source."""
    if task.dataset:
        cfg = f"/{task.dataset_config}" if task.dataset_config else ""
        return f"{task.dataset}{cfg}:{task.split}"
    return ",".join(
        Path(str(f)).name for f in (task.files if not isinstance(task.files, str) else [task.files])
    )


class RowStream:
    """The rows of a streamed dataset, one at a time, and where it stands: the dataset's own
    ``state_dict`` (shard and offset, so a resume does not re-read what was used), the rows read and the
    pass over the data (a stream that ends starts again). ``open_ds()`` opens the stream at its start."""

    def __init__(self, open_ds: Callable[[], Any]):
        self.open_ds = open_ds
        self.ds = open_ds()
        self.rows = 0  # rows yielded in this pass
        self.passes = 0
        self._it: Iterator[Any] | None = None

    def state(self) -> dict[str, Any]:
        return {"dataset": self.ds.state_dict(), "rows": self.rows, "passes": self.passes}

    def seek(self, state: dict[str, Any]) -> None:
        self.ds = self.open_ds()
        self.ds.load_state_dict(state["dataset"])
        self.rows, self.passes = int(state["rows"]), int(state["passes"])
        self._it = iter(self.ds)

    def next(self) -> tuple[int, dict[str, Any]]:
        """(the row's index in the data, the row)."""
        if self._it is None:
            self._it = iter(self.ds)
        try:
            row = next(self._it)
        except StopIteration:
            if self.rows == 0:
                raise ConfigError([Problem("task.dataset", "the stream has no rows")]) from None
            self.passes, self.rows = self.passes + 1, 0
            self.ds = self.open_ds()
            self._it = iter(self.ds)
            row = next(self._it)
        self.rows += 1
        return self.rows - 1, row
