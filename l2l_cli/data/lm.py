"""Task ``lm``: causal language modelling on the user's own text.

``task.files`` (.txt, .jsonl/.json with the text in ``task.text_field``, .parquet) are read with
``datasets``' local loaders, tokenized with the checkpoint's tokenizer (or ``task.tokenizer``), and
packed GPT-style: every document followed by the tokenizer's EOS, the stream cut into blocks of
``task.max_seq_len`` tokens (the incomplete tail dropped), so every block is full and no token is padding.
The dev split is ``task.dev_files``, or the last ``task.dev_fraction`` of the blocks. The packed blocks
are cached (``$L2L_CACHE_DIR``, default ``~/.cache/l2l``) under a key of the files' paths, sizes and
modification times, the tokenizer and the packing settings, so a second run starts at once.

In a .txt file a document is a paragraph (text between blank lines); in .jsonl/.parquet, a row. Without
``task.files`` the bundled corpus is used (``corpus/``: GLUE RTE's premises and a byte-level BPE of 2048
ids trained on them), so ``l2l train task=lm model=gpt2-tiny`` runs offline.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from l2l_cli.config.schema import ModelConfig, TaskConfig
from l2l_cli.data.batches import Batch
from l2l_cli.data.rows import RowMaker, Rows, StreamedTrain
from l2l_cli.data.sources import (
    RowStream,
    as_list,
    check_file,
    dataset_problems,
    describe,
    listed_files,
    open_dataset,
    open_files,
)
from l2l_cli.data.tasks import TaskData, TaskKind, TaskSettings, TaskSpec
from l2l_cli.models import PretrainedUnavailable, resolve_pretrained
from l2l_cli.problems import ConfigError, Problem

log = logging.getLogger(__name__)

CORPUS = Path(__file__).resolve().parent / "corpus"
BUNDLED_FILES = (CORPUS / "rte_premises.txt",)
BUNDLED_TOKENIZER = CORPUS / "tokenizer"
FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
CACHE_VERSION = 1
CHUNK = 1000  # documents per tokenizer call
STREAM_DEV_BLOCKS = 64  # a stream without a dev source: its first blocks (default) are the dev split


@dataclass
class Packed:
    """One split's token blocks: ``blocks`` [N, S] (every row a full window of the packed stream). Read by
    ``TrainStream`` and ``eval_batches`` like the classification tasks' ``Encoded``; a block's labels are
    its own ids (the LM head shifts them: position t predicts token t+1)."""

    blocks: np.ndarray  # int32 [N, S]

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def input_ids(self) -> np.ndarray:
        return self.blocks

    @property
    def seq_len(self) -> int:
        return int(self.blocks.shape[1])

    @property
    def num_tokens(self) -> int:
        return int(self.blocks.size)

    def subset(self, n: int | None) -> Packed:
        return self if n is None or n >= len(self) else Packed(self.blocks[:n])

    def collate(self, idx: list[int], pad_to: int) -> Batch:
        """The blocks ``idx`` as a batch (``pad_to`` is moot: every block is already full)."""
        import torch  # here, not at the top: l2l plan reads the task kinds without torch

        ids = torch.from_numpy(self.blocks[np.asarray(idx, dtype=np.int64)].astype(np.int64))
        return Batch(ids, torch.zeros_like(ids), torch.ones_like(ids), ids.clone())


def cache_root() -> Path:
    return Path(os.environ.get("L2L_CACHE_DIR") or Path.home() / ".cache" / "l2l")


# ---- the tokenizer -----------------------------------------------------------------------------------


def has_tokenizer(path: Path) -> bool:
    return any((path / f).is_file() for f in TOKENIZER_FILES)


def tokenizer_ref(task_cfg: TaskConfig, model_cfg: ModelConfig) -> tuple[str, str]:
    """(where the tokenizer comes from, the key that chose it): ``task.tokenizer``, else the checkpoint's
    (``model.pretrained``), else the bundled byte-level BPE."""
    if task_cfg.tokenizer:
        return str(task_cfg.tokenizer), "task.tokenizer"
    if model_cfg.pretrained:
        try:  # a missing dir or an unreachable hub id: the key's one line, as every task kind says it
            root = resolve_pretrained(model_cfg.pretrained)
        except PretrainedUnavailable as e:
            raise ConfigError([Problem("model.pretrained", str(e))]) from e
        if not has_tokenizer(root):
            raise ConfigError(
                [
                    Problem(
                        "task.tokenizer",
                        f"unset, and model.pretrained={model_cfg.pretrained} has no tokenizer files "
                        f"({', '.join(TOKENIZER_FILES[:3])}); set task.tokenizer=<a tokenizer dir or hub id>",
                    )
                ]
            )
        return str(root), "model.pretrained"
    return str(BUNDLED_TOKENIZER), "bundled"


def load_tokenizer(ref: str, key: str) -> Any:
    """The tokenizer at ``ref`` (a dir or hub id); ``key``: the config key that named it, for errors."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(ref)
    except Exception as e:  # offline hub id, not a tokenizer dir
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError([Problem(key, f"cannot load a tokenizer from {ref} ({first[:200]})")]) from e
    if tok.eos_token_id is None:
        raise ConfigError(
            [Problem(key, f"the tokenizer {ref} has no eos_token (packing puts one between documents)")]
        )
    return tok


def tokenizer_fingerprint(tok: Any) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---- reading, tokenizing, packing --------------------------------------------------------------------


def documents(path: Path, text_field: str, cache_dir: Path, key: str = "task.files") -> Iterator[list[str]]:
    """The documents of one file, in chunks, through ``datasets``' local loader for its format (the file
    checked first: bad data is one line naming ``key``, the file and its line)."""
    fmt = FORMATS[path.suffix.lower()]
    ds = open_files([path], cache_dir, key=key, text_field=text_field)
    column = "text" if fmt == "text" else text_field
    if column not in ds.column_names:
        raise ConfigError(
            [
                Problem(
                    "task.text_field",
                    f"{path} has no field {column!r}; its fields: {', '.join(ds.column_names)}",
                )
            ]
        )
    for rows in ds.iter(batch_size=CHUNK):
        yield [t for t in rows[column] if isinstance(t, str) and t.strip()]


def token_stream(
    files: list[Path], tok: Any, text_field: str, cache_dir: Path, key: str = "task.files"
) -> np.ndarray:
    """Every document's tokens followed by EOS, all files in order, as one int32 array."""
    eos = tok.eos_token_id
    parts: list[np.ndarray] = []
    for path in files:
        for docs in documents(path, text_field, cache_dir, key):
            if not docs:
                continue
            for ids in tok(docs, add_special_tokens=False)["input_ids"]:
                parts.append(np.asarray([*ids, eos], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def pack(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """[N, seq_len] blocks of the stream (the tail shorter than a block is dropped)."""
    n = len(stream) // seq_len
    return stream[: n * seq_len].reshape(n, seq_len)


def file_key(paths: list[Path]) -> list[Any]:
    out = []
    for p in paths:
        st = p.stat()
        out.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    return out


def dataset_key(task_cfg: TaskConfig) -> list[Any]:
    """``task.dataset``'s part of a rendered-data cache key: its id, config and splits and, for a local
    folder (or file), every file's size and mtime, so that an edited local dataset is read again rather
    than its stale rendering reused."""
    key: list[Any] = [task_cfg.dataset, task_cfg.dataset_config, task_cfg.split, task_cfg.dev_split]
    local = Path(str(task_cfg.dataset)).expanduser()
    if local.exists():
        key.append(
            file_key(sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local])
        )
    return key


def dataset_stream(task_cfg: TaskConfig, split: str, tok: Any, cache_dir: Path) -> np.ndarray:
    """The tokens of a dataset split (``task.dataset``) read whole, documents followed by EOS."""
    ds = open_dataset(task_cfg, split, cache_dir, False)
    field = task_cfg.text_field
    if field not in ds.column_names:
        raise ConfigError(
            [
                Problem(
                    "task.text_field",
                    f"{task_cfg.dataset}:{split} has no field {field!r}; "
                    f"its fields: {', '.join(ds.column_names)}",
                )
            ]
        )
    eos, parts = tok.eos_token_id, []
    for rows in ds.iter(batch_size=CHUNK):
        docs = [t for t in rows[field] if isinstance(t, str) and t.strip()]
        for ids in tok(docs, add_special_tokens=False)["input_ids"] if docs else []:
            parts.append(np.asarray([*ids, eos], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def load_lm(task_cfg: TaskConfig, model_cfg: ModelConfig) -> tuple[Packed, Packed, str, Any]:
    """(train blocks, dev blocks, source, tokenizer) of ``task=lm``, from the cache when it has them."""
    ref, chosen_by = tokenizer_ref(task_cfg, model_cfg)
    tok = load_tokenizer(ref, "task.tokenizer" if chosen_by == "task.tokenizer" else "model.pretrained")
    hub = task_cfg.dataset is not None
    files = [] if hub else [Path(f).expanduser() for f in as_list(task_cfg.files)] or list(BUNDLED_FILES)
    dev_files = [Path(f).expanduser() for f in as_list(task_cfg.dev_files)]
    seq = int(task_cfg.max_seq_len)
    data = dataset_key(task_cfg) if hub else []
    key = hashlib.sha256(
        json.dumps(
            {
                "v": CACHE_VERSION,
                "files": file_key(files),
                "dev_files": file_key(dev_files),
                "text_field": task_cfg.text_field,
                "tokenizer": tokenizer_fingerprint(tok),
                "seq": seq,
                "dev_fraction": float(task_cfg.dev_fraction),
                **({"dataset": data} if hub else {}),
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()[:24]
    root = cache_root() / "lm"
    cached = root / f"{key}.npz"
    names = describe(task_cfg) if hub else ",".join(p.name for p in files)
    source = f"lm:{names}" if task_cfg.files or hub else f"lm:bundled:{names}"
    if cached.is_file():
        with np.load(cached) as z:
            train, dev = z["train"], z["dev"]
        log.info("task lm: packed blocks from the cache %s", cached)
    else:
        hf_cache = root / "datasets"
        if hub:
            blocks = pack(dataset_stream(task_cfg, task_cfg.split, tok, hf_cache), seq)
        else:
            blocks = pack(token_stream(files, tok, task_cfg.text_field, hf_cache), seq)
        if hub and task_cfg.dev_split:
            train, dev = blocks, pack(dataset_stream(task_cfg, task_cfg.dev_split, tok, hf_cache), seq)
        elif dev_files:
            train, dev = (
                blocks,
                pack(token_stream(dev_files, tok, task_cfg.text_field, hf_cache, "task.dev_files"), seq),
            )
        else:
            n_dev = max(1, round(task_cfg.dev_fraction * len(blocks))) if len(blocks) > 1 else 0
            train, dev = blocks[: len(blocks) - n_dev], blocks[len(blocks) - n_dev :]
        if len(train) < 1 or len(dev) < 1:
            raise ConfigError(
                [
                    Problem(
                        "task.files",
                        f"{names}: {len(train)} train and {len(dev)} dev block(s) of task.max_seq_len={seq} "
                        f"tokens after packing; add text or lower task.max_seq_len",
                    )
                ]
            )
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{key}.{os.getpid()}.npz"
        np.savez(tmp, train=train, dev=dev)
        os.replace(tmp, cached)  # atomic: data-parallel ranks may pack at the same time
    log.info(
        "task lm: %s tokenized by %s (%s, %d ids): %d train and %d dev blocks of %d tokens",
        source,
        ref,
        chosen_by,
        len(tok),
        len(train),
        len(dev),
        seq,
    )
    return Packed(train), Packed(dev), source, tok


def save_tokenizer(tok: Any, out_dir: Path) -> None:
    """Put the run's tokenizer beside an exported model and give its config the tokenizer's special ids
    (an export loads with ``AutoTokenizer`` and ``AutoModelForCausalLM`` from the one directory)."""
    tok.save_pretrained(str(out_dir))
    config = out_dir / "config.json"
    if config.is_file():
        c = json.loads(config.read_text())
        ids = {
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
        }
        c.update({k: v for k, v in ids.items() if v is not None})  # (a WordPiece tokenizer has no bos/eos)
        config.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")


def streamed(
    task_cfg: TaskConfig, model_cfg: ModelConfig, dev_rows: int | None = None
) -> tuple[RowMaker, Rows, str, Any]:
    """(the train stream's row maker, the dev blocks, source, tokenizer) of a streamed ``task=lm``: the
    documents tokenized as they are read and cut into blocks of ``task.max_seq_len`` (EOS between them).
    The dev split: ``task.dev_split`` / ``task.dev_files`` (its first blocks), else the stream's first
    blocks, training starting after them."""
    ref, chosen_by = tokenizer_ref(task_cfg, model_cfg)
    tok = load_tokenizer(ref, "task.tokenizer" if chosen_by == "task.tokenizer" else "model.pretrained")
    field, eos, seq = task_cfg.text_field, tok.eos_token_id, int(task_cfg.max_seq_len)

    def encode(index: int, row: dict[str, Any]) -> tuple[list[int], list[int]] | None:
        if field not in row:
            raise ConfigError(
                [
                    Problem(
                        "task.text_field", f"row {index} has no field {field!r}; its fields: {', '.join(row)}"
                    )
                ]
            )
        text = row[field]
        if not isinstance(text, str) or not text.strip():
            return None
        ids = [*tok(text, add_special_tokens=False)["input_ids"], eos]
        return ids, ids

    def maker(key: str, split: str) -> RowMaker:
        cache = cache_root() / "datasets"
        if task_cfg.dataset:
            src = RowStream(lambda: open_dataset(task_cfg, split, cache, True))
        else:
            paths = [Path(f).expanduser() for f in as_list(getattr(task_cfg, key))] or list(BUNDLED_FILES)
            src = RowStream(lambda: open_files(paths, cache, True, f"task.{key}", task_cfg.text_field))
        return RowMaker(src, encode, seq, "blocks")

    train = maker("files", task_cfg.split)
    n_dev = dev_rows or task_cfg.max_eval_samples or STREAM_DEV_BLOCKS
    dev_maker = maker("dev_files", task_cfg.dev_split) if task_cfg.dev_split or task_cfg.dev_files else train
    dev = Rows([dev_maker.row() for _ in range(n_dev)])
    return train, dev, f"lm:stream:{describe(task_cfg) if task_cfg.dataset else 'files'}", tok


def load(spec: TaskSpec, task_cfg: TaskConfig, model_cfg: ModelConfig, train_split: bool) -> TaskData:
    if task_cfg.streaming:
        maker, dev, source, tok = streamed(task_cfg, model_cfg)

        def stream(batch_size: int, world: int, rank: int, pad_to_max: int | None) -> StreamedTrain:
            return StreamedTrain(maker, batch_size, world=world, rank=rank, pad_to_max=pad_to_max)

        log.info(
            "task lm: %s streamed, blocks of %d tokens; %d dev blocks", source, task_cfg.max_seq_len, len(dev)
        )
        return TaskData(spec, Rows([]), dev, source, tok, stream=stream)
    train, dev, source, tok = load_lm(task_cfg, model_cfg)
    return TaskData(spec, train.subset(task_cfg.max_train_samples if train_split else 0), dev, source, tok)


def validate(cfg: TaskSettings, check_files: bool) -> list[Problem]:
    """task.files / dev_files (readable text files of a known format), dev_fraction and text_field."""
    task, p = cfg.task, []
    if task.data_dir is not None:
        p.append(Problem("task.data_dir", "task=lm reads task.files (text files); leave task.data_dir unset"))
    for key in ("files", "dev_files"):
        names, problem = listed_files(task, key)
        if problem is not None:
            p.append(problem)
        for f in names:
            suffix = Path(f).suffix.lower()
            if suffix not in FORMATS:
                p.append(
                    Problem(
                        f"task.{key}",
                        f"{f}: unsupported format {suffix or '(none)'}; allowed: {', '.join(FORMATS)}",
                    )
                )
            elif check_files and not Path(f).expanduser().is_file():
                p.append(Problem(f"task.{key}", f"{f} is not a file"))
            elif check_files:  # bad data is refused before a run dir exists
                try:
                    path = Path(f).expanduser()
                    check_file(path, f"task.{key}", task.text_field if FORMATS[suffix] == "json" else None)
                except ConfigError as e:
                    p += e.problems
    if not (0.0 <= task.dev_fraction < 1.0):
        p.append(Problem("task.dev_fraction", f"got {task.dev_fraction}; must be in [0, 1)"))
    elif task.dev_fraction == 0.0 and task.dev_files is None:
        p.append(
            Problem("task.dev_fraction", "got 0 without task.dev_files; the dev split needs one of them")
        )
    if not task.text_field:
        p.append(Problem("task.text_field", "must name the field holding the text (.jsonl, .parquet)"))
    p += dataset_problems(cfg)
    if task.streaming and check_files and not p:  # the stream opens and its first documents tokenize
        try:
            streamed(task, cfg.model, dev_rows=1)
        except ConfigError as e:
            p += e.problems
    return p


KIND = TaskKind(
    "lm",
    load,
    validate,
    keys=(
        "files",
        "dev_files",
        "text_field",
        "dev_fraction",
        "dataset",
        "dataset_config",
        "split",
        "dev_split",
        "streaming",
    ),
)
