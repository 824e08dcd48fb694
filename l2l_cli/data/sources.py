"""Where the rows of ``task=lm`` and ``task=chat`` come from: the user's files (``task.files``), or a
dataset named by ``task.dataset`` (a hub id, or a local folder of parquet/JSON files), read whole or as a
stream (``task.streaming``). Both go through ``datasets.load_dataset``, so what a local folder does in the
tests is what a hub dataset does for a user; :class:`RowStream` keeps the stream's position for an exact
resume."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from l2l_cli.problems import ConfigError, Problem

FILE_FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json",
                ".parquet": "parquet"}  # fmt: skip


def as_list(value: Any) -> list[str]:
    """``task.files`` / ``task.dev_files``: one path or a list of them (None: none)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def listed_files(task: Any, key: str) -> tuple[list[str], Problem | None]:
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


def dataset_problems(cfg: Any) -> list[Problem]:
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
        p.append(Problem("trainer.max_steps", f"got {cfg.trainer.max_steps}; task.streaming=true needs a fixed "
                         "number of steps (a stream has no epochs)"))  # fmt: skip
    return p


def quiet_datasets() -> Any:
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def open_files(paths: list[Path], cache_dir: Path, streaming: bool = False) -> Any:
    """The rows of local files (one format, in order) through ``datasets``' loader for it."""
    datasets = quiet_datasets()
    fmt = FILE_FORMATS[paths[0].suffix.lower()]
    extra = {"sample_by": "paragraph"} if fmt == "text" else {}
    files = [str(p) for p in paths]
    if streaming:
        return datasets.load_dataset(fmt, data_files=files, split="train", streaming=True, **extra)
    return datasets.load_dataset(fmt, data_files=files, split="train", cache_dir=str(cache_dir), **extra)


def open_dataset(task: Any, split: str, cache_dir: Path, streaming: bool) -> Any:
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
        raise ConfigError([Problem(
            "task.dataset", f"cannot load {task.dataset} (config {task.dataset_config}, split {split}): {first[:200]}"
        )]) from e  # fmt: skip


def describe(task: Any) -> str:
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
