"""Where a task's examples come from, by its kind: the hub or an original GLUE TSV directory
(:mod:`~l2l_cli.data.glue`), generated (:mod:`~l2l_cli.data.synthetic`), the user's text files
(:mod:`~l2l_cli.data.lm`), conversations (:mod:`~l2l_cli.data.chat`) or labelled files
(:mod:`~l2l_cli.data.files`). Each kind's file holds its loader and the rules of the ``task.*`` keys it
reads; this module lists the kinds and runs them. Its two entry points take the config's nodes as
composed (or already typed) and hand every kind typed settings (:mod:`l2l_cli.config.settings`)."""

from __future__ import annotations

import logging
from typing import Any

from l2l_cli.config.schema import ModelConfig, TaskConfig, TrainerConfig
from l2l_cli.config.settings import typed
from l2l_cli.data import chat, files, glue, lm, synthetic
from l2l_cli.data.tasks import TASKS, TaskData, TaskKind, TaskSettings, TaskSpec
from l2l_cli.problems import Problem

log = logging.getLogger(__name__)

KINDS: dict[str, TaskKind] = {k.name: k for k in (glue.KIND, synthetic.KIND, lm.KIND, chat.KIND, files.KIND)}


def kind_of(spec: TaskSpec) -> TaskKind:
    return KINDS[spec.kind]


def load_task(task_cfg: TaskConfig | Any, model_cfg: ModelConfig | Any, train_split: bool = True) -> TaskData:
    """The task's train and dev splits, tokenized (``train_split`` False: an empty train split, for
    evaluation and prediction). ``task_cfg``/``model_cfg``: the config's ``task``/``model`` nodes, typed
    here (a composed node is converted once; the kinds read dataclasses)."""
    task_cfg, model_cfg = typed(task_cfg, TaskConfig), typed(model_cfg, ModelConfig)
    spec = TASKS[task_cfg.name]
    data = kind_of(spec).load(spec, task_cfg, model_cfg, train_split)
    data.train = data.train.subset(task_cfg.max_train_samples)
    data.dev = data.dev.subset(task_cfg.max_eval_samples)
    log.info(
        "task %s from %s: %d train, %d dev examples",
        data.spec.name,
        data.source,
        len(data.train),
        len(data.dev),
    )
    return data


def task_problems(config: Any, check_files: bool) -> list[Problem]:
    """The task kind's own rules, and its keys set under a task of another kind (the run would ignore
    them): ``task.text_field`` is lm's, ``task.label_field`` the file tasks', and so on. ``config``: the
    composed config (or :class:`~l2l_cli.config.schema.L2LConfig`); the kind's checks get it typed."""
    cfg = TaskSettings(
        typed(config.task, TaskConfig), typed(config.model, ModelConfig), typed(config.trainer, TrainerConfig)
    )
    spec = TASKS[cfg.task.name]
    kind = kind_of(spec)
    p = kind.validate(cfg, check_files)
    defaults = TaskConfig()
    for key in sorted({k for other in KINDS.values() for k in other.keys} - set(kind.keys)):
        if getattr(cfg.task, key) != getattr(defaults, key):
            owners = [t.name for t in TASKS.values() if key in KINDS[t.kind].keys]
            where = owners[0] if len(owners) == 1 else f"{', '.join(owners[:-1])} or {owners[-1]}"
            p.append(Problem(f"task.{key}", f"applies to task={where}, not task={spec.name}; leave it unset"))
    return p
