"""The GLUE tasks' kind: examples from the hub (``nyu-mll/glue``) or from an original GLUE TSV directory
(``task.data_dir``: train.tsv and the task's dev file, read with quoting off)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from l2l_cli.config.schema import ModelConfig, TaskConfig
from l2l_cli.data.tasks import TASKS, Example, TaskData, TaskKind, TaskSettings, TaskSpec
from l2l_cli.data.tokenize import encode_splits
from l2l_cli.problems import ConfigError, Problem


def load(spec: TaskSpec, task_cfg: TaskConfig, model_cfg: ModelConfig, train_split: bool) -> TaskData:
    if task_cfg.data_dir is not None:
        root = Path(task_cfg.data_dir).expanduser()
        raw_train, raw_dev = spec.read_tsv(root / "train.tsv"), spec.read_tsv(root / spec.dev_file)
        source = f"tsv:{root}"
    else:
        raw_train, raw_dev = _from_hub(spec)
        source = f"hub:nyu-mll/glue/{spec.name}"
    return encode_splits(spec, raw_train, raw_dev, source, task_cfg, model_cfg, train_split)


def _from_hub(spec: TaskSpec) -> tuple[list[Example], list[Example]]:
    import datasets

    try:
        ds = datasets.load_dataset("nyu-mll/glue", spec.name)
    except Exception as e:  # network, auth, missing dataset: say what to do instead
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(
            [
                Problem(
                    "task.data_dir",
                    (
                        f"unset, and GLUE {spec.name} cannot be loaded from the hub "
                        f"({type(e).__name__}: {first}); point task.data_dir at a local GLUE "
                        f"{spec.glue_dir}/ folder (train.tsv, {spec.dev_file})"
                    ),
                )
            ]
        ) from e

    def convert(split: Any) -> list[Example]:
        cols = spec.hub
        b = cols[1] if len(cols) == 3 else None
        return [Example(r[cols[0]], r[b] if b else None, r[cols[-1]]) for r in split]

    return convert(ds["train"]), convert(ds[spec.hub_dev_split])


def validate(cfg: TaskSettings, check_files: bool) -> list[Problem]:
    """task.data_dir: a folder in the GLUE layout with the task's columns (checked with ``check_files``)."""
    return TASKS[cfg.task.name].check_source(cfg.task.data_dir) if check_files else []


KIND = TaskKind("glue", load, validate)
