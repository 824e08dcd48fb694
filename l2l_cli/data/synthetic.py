"""The synthetic task's kind: generated examples, so a run needs no download and no files."""

from __future__ import annotations

import random

from l2l_cli.config.schema import ModelConfig, TaskConfig
from l2l_cli.data.batches import Encoded
from l2l_cli.data.tasks import TaskData, TaskKind, TaskSettings, TaskSpec
from l2l_cli.data.tokenize import CLS, SEP
from l2l_cli.problems import Problem

SYNTHETIC_MIN_VOCAB = 512
SYNTHETIC_MIN_LEN = 12


def synthetic(n: int, max_len: int, vocab_size: int = 30522, *, seed: int) -> Encoded:
    """Is token A more frequent than token B? Random filler tokens, 1..4 copies of each of A and B.

    The label depends on counts anywhere in the sequence, so the model must attend across positions;
    bert-tiny learns it to 100% dev accuracy within about 150 steps. Ids come from the top 202 of the
    vocabulary, so any model.vocab_size >= 512 works.
    """
    rng = random.Random(seed)
    a_id, b_id, lo, hi = vocab_size - 202, vocab_size - 201, vocab_size - 200, vocab_size
    ids, labels = [], []
    for _ in range(n):
        body_len = rng.randint(min(16, max_len - 2), max_len - 2)  # na + nb <= 7 < SYNTHETIC_MIN_LEN - 2
        na, nb = rng.sample(range(1, 5), 2)
        body = [rng.randrange(lo, hi) for _ in range(body_len - na - nb)] + [a_id] * na + [b_id] * nb
        rng.shuffle(body)
        ids.append([CLS, *body, SEP])
        labels.append(int(na > nb))
    return Encoded(ids, [[0] * len(x) for x in ids], labels, regression=False)


def load(spec: TaskSpec, task_cfg: TaskConfig, model_cfg: ModelConfig, train_split: bool) -> TaskData:
    n_train = task_cfg.num_train if train_split else 0
    train = synthetic(n_train, task_cfg.max_seq_len, model_cfg.vocab_size, seed=1234)
    dev = synthetic(task_cfg.num_eval, task_cfg.max_seq_len, model_cfg.vocab_size, seed=4321)
    return TaskData(spec, train, dev, "synthetic")


def validate(cfg: TaskSettings, check_files: bool) -> list[Problem]:
    task, p = cfg.task, []
    if task.max_seq_len < SYNTHETIC_MIN_LEN:
        p.append(
            Problem(
                "task.max_seq_len", f"got {task.max_seq_len}; the synthetic task needs >= {SYNTHETIC_MIN_LEN}"
            )
        )
    if cfg.model.vocab_size < SYNTHETIC_MIN_VOCAB:
        p.append(
            Problem(
                "model.vocab_size",
                f"got {cfg.model.vocab_size}; the synthetic task needs >= {SYNTHETIC_MIN_VOCAB}",
            )
        )
    if task.data_dir is not None:
        p.append(Problem("task.data_dir", "the synthetic task is generated; leave task.data_dir unset"))
    return p


KIND = TaskKind("synthetic", load, validate)
