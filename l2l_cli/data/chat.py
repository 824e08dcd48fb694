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
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from l2l_cli.config.schema import SHAREGPT_ROLES
from l2l_cli.data import sources
from l2l_cli.data.lm import cache_root, dataset_key, file_key, load_tokenizer, tokenizer_fingerprint
from l2l_cli.data.lm import tokenizer_ref as lm_tokenizer_ref
from l2l_cli.data.rows import IGNORE, Encoded, RowMaker, Rows, StreamedTrain, pack_examples
from l2l_cli.data.sources import RowStream, as_list, listed_files
from l2l_cli.data.tasks import TaskData, TaskKind, TaskSpec
from l2l_cli.data.templates import NamedTemplate, end_of_turn_text, named
from l2l_cli.problems import ConfigError, Problem

log = logging.getLogger(__name__)

FORMATS = ("auto", "messages", "instruction", "prompt_completion")
TRAIN_ON = ("assistant", "all")
ROLES = ("system", "user", "assistant", "tool")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
CACHE_VERSION = 2  # 2: an answer's span ends at its end-of-turn token
STREAM_CHECK_ROWS = 16  # a streamed dataset: rows checked before the run starts
STREAM_DEV_ROWS = 64  # a streamed dataset without a dev source: its first rows (default) are the dev split


def bad(key: str, where: str, msg: str) -> ConfigError:
    return ConfigError([Problem(key, f"{where}: {msg}")])


# ---- the three shapes, as messages -------------------------------------------------------------------


@dataclass(frozen=True)
class Fields:
    """``task.fields``: which keys hold the turns, a turn's speaker and its text, and what each speaker
    name means (ShareGPT's ``conversations`` of ``{from, value}``, ``human``/``gpt``, by default)."""

    messages: str | None = None
    role: str | None = None
    content: str | None = None
    roles: tuple[tuple[str, str], ...] = tuple(SHAREGPT_ROLES.items())

    @staticmethod
    def of(task: Any) -> Fields:
        f = getattr(task, "fields", None)
        if f is None:
            return Fields()
        return Fields(
            f.messages, f.role, f.content, tuple((str(k), str(v)) for k, v in dict(f.roles).items())
        )

    def turns_key(self, columns: list[str]) -> str | None:
        """The field holding the turns: ``task.fields.messages``, else ``messages``, else ``conversations``."""
        if self.messages:
            return self.messages
        return next((k for k in ("messages", "conversations") if k in columns), None)

    def key(self) -> dict[str, Any]:
        return {"messages": self.messages, "role": self.role, "content": self.content, "roles": self.roles}


def detect(fields: list[str], where: str, keys: Fields = Fields()) -> str:
    """The shape of rows with these fields (``task.format=auto``)."""
    if keys.messages and keys.messages not in fields:
        raise ConfigError([Problem("task.fields.messages", f"{where} has no '{keys.messages}' field (its "
                                   f"fields: {', '.join(fields)})")])  # fmt: skip
    if keys.turns_key(fields):
        return "messages"
    if "instruction" in fields and "output" in fields:
        return "instruction"
    if "prompt" in fields and "completion" in fields:
        return "prompt_completion"
    raise ConfigError([Problem("task.format", f"{where} has no 'messages' field (nor ShareGPT's "
                               "'conversations'), nor instruction/output, nor prompt/completion (its fields: "
                               f"{', '.join(fields)}); set task.format or task.fields.messages")])  # fmt: skip


def text_of(row: dict[str, Any], field: str, where: str, optional: bool = False) -> str:
    value = row.get(field)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise bad("task.format", where, f"'{field}' is {'missing' if value is None else type(value).__name__}; "
                  "expected text")  # fmt: skip
    return value


def turns(
    value: Any, field: str, where: str, keys: Fields = Fields(), line: str | None = None
) -> list[dict[str, str]]:
    """A list of {role, content} messages, checked (roles known, contents text). A turn may name its
    speaker and text by other keys (``task.fields.role``/``content``; unset: ``role``/``content``, else
    ShareGPT's ``from``/``value``), its speaker by another name (``task.fields.roles``: human -> user...);
    what those mappings miss is refused naming the key, the file and its line (``line``)."""
    if value is None:
        raise bad("task.format", where, f"no '{field}'")
    if not isinstance(value, list) or not value:
        raise bad("task.format", where, f"'{field}' must be a non-empty list of {{role, content}} messages")
    roles = dict(keys.roles)
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict):
            raise bad("task.format", where, f"{field}[{j}] is not a {{role, content}} object")
        m = {k: v for k, v in m.items() if v is not None}  # (a column file's rows share every turn's keys)
        rk = keys.role or ("role" if "role" in m or "from" not in m else "from")
        sharegpt = rk == "from" and "content" not in m
        ck = keys.content or ("value" if sharegpt or ("value" in m and "content" not in m) else "content")
        mapped = rk != "role" or ck != "content"
        here = line or where
        if mapped and rk not in m:
            raise bad("task.fields.role", here, f"{field}[{j}] has no '{rk}' key (its keys: {', '.join(m)})")
        if mapped and ck not in m:
            raise bad(
                "task.fields.content", here, f"{field}[{j}] has no '{ck}' key (its keys: {', '.join(m)})"
            )
        role, content = m.get(rk), m.get(ck)
        role = roles.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            if mapped:
                raise bad("task.fields.roles", here, f"{field}[{j}].{rk} {role!r} is not mapped to a role "
                          f"(mapped: {', '.join(f'{a}->{b}' for a, b in keys.roles)}); set "
                          f"+task.fields.roles.{role}=<{'|'.join(ROLES)}>")  # fmt: skip
            raise bad(
                "task.format", where, f"{field}[{j}].role {role!r} is unknown; allowed: {', '.join(ROLES)}"
            )
        if not isinstance(content, str):
            key, at = ("task.fields.content", here) if mapped else ("task.format", where)
            raise bad(key, at, f"{field}[{j}].{ck} is {type(content).__name__}; expected text")
        out.append({"role": role, "content": content})
    return out


def messages_of(
    row: dict[str, Any], fmt: str, where: str, keys: Fields = Fields(), line: str | None = None
) -> list[dict[str, str]]:
    """A row of any shape as the conversation it stands for (``line``: where the row is, for the
    ``task.fields`` mapping's errors)."""
    if fmt == "messages":
        field = keys.turns_key(list(row)) or "messages"
        if keys.messages and row.get(field) is None:
            raise bad(
                "task.fields.messages", line or where, f"no '{field}' field (its fields: {', '.join(row)})"
            )
        return turns(row.get(field), field, where, keys, line)
    if fmt == "instruction":
        user = text_of(row, "instruction", where)
        extra = text_of(row, "input", where, optional=True)
        if extra:
            user = f"{user}\n\n{extra}"
        return [
            {"role": "user", "content": user},
            {"role": "assistant", "content": text_of(row, "output", where)},
        ]
    prompt, completion = row.get("prompt"), row.get("completion")
    head = turns(prompt, "prompt", where) if isinstance(prompt, list) else [
        {"role": "user", "content": text_of(row, "prompt", where)}]  # fmt: skip
    tail = turns(completion, "completion", where) if isinstance(completion, list) else [
        {"role": "assistant", "content": text_of(row, "completion", where)}]  # fmt: skip
    return head + tail


# ---- rendering and the assistant mask ------------------------------------------------------------------


@dataclass
class Encoder:
    """Renders and tokenizes conversations: (ids, labels) with labels IGNORE outside what is trained."""

    tok: Any
    template: str
    train_on: str
    max_len: int
    truncated: int = 0  # examples cut at max_len
    examples: int = 0
    end_of_turn: str | None = None  # the text that closes an answer: its span ends there (not after it)
    fields: Fields = Fields()  # task.fields: the rows' keys

    @property
    def tagged(self) -> bool:
        """The template marks the assistant's tokens itself ({% generation %} blocks)."""
        return re.search(r"{%-?\s*generation\s*-?%}", self.template) is not None

    def render(self, messages: list[dict[str, str]], **kw: Any) -> str:
        return self.tok.apply_chat_template(messages, chat_template=self.template, tokenize=False, **kw)

    def encode(self, messages: list[dict[str, str]], where: str) -> Encoded:
        if not any(m["role"] == "assistant" for m in messages):
            raise bad("task.format", where, "no assistant message (nothing to train on)")
        try:
            ids, mask = self.tagged_mask(messages) if self.tagged else self.prefix_mask(messages, where)
        except ConfigError:
            raise
        except Exception as e:  # a template error (raise_exception, a missing variable)
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise bad("task.chat_template", where, f"rendering failed: {first[:200]}") from e
        self.examples += 1
        if len(ids) > self.max_len:
            self.truncated += 1
            ids, mask = ids[: self.max_len], mask[: self.max_len]
        if self.train_on == "all":
            mask = [True] * len(ids)
        if not any(mask[1:]):  # position 0 predicts nothing: a trained token needs one before it
            raise bad("task.max_seq_len", where, f"no assistant token left after truncation to {self.max_len} "
                      "tokens (an empty answer, or a prompt as long as the limit)")  # fmt: skip
        return list(ids), [t if m else IGNORE for t, m in zip(ids, mask)]

    def tagged_mask(self, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
        out = self.tok.apply_chat_template(messages, chat_template=self.template, tokenize=True,
                                           return_dict=True, return_assistant_tokens_mask=True)  # fmt: skip
        return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]

    def prefix_mask(self, messages: list[dict[str, str]], where: str) -> tuple[list[int], list[bool]]:
        text = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True) if i else ""
            upto = self.render(messages[: i + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise bad("task.chat_template", where, f"the template does not render messages[:{i + 1}] as a "
                          "prefix of the conversation, so the answers cannot be located; use a template with "
                          "{% generation %} blocks")  # fmt: skip
            end = len(upto)
            if self.end_of_turn:  # the answer is its content and the end-of-turn token, not what follows
                at = upto.rfind(self.end_of_turn, len(before))
                end = at + len(self.end_of_turn) if at >= 0 else end
            spans.append((len(before), end))
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [any(a <= s < b for a, b in spans) for s, _ in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask


TEMPLATE_SUFFIXES = (".jinja", ".jinja2", ".j2", ".txt")


def template_problem(value: Any) -> Problem | None:
    """``task.chat_template`` that names a file (a template suffix or a path separator, and no Jinja
    ``{``) which is not there: a misspelled path, never to be trained on as the template's text."""
    text = str(value or "")
    if not text or "{" in text or "\n" in text or len(text) >= 4096:
        return None
    looks_like_path = (
        text.lower().endswith(TEMPLATE_SUFFIXES) or "/" in text or os.sep in text or text[0] == "~"
    )
    path = Path(text).expanduser()
    if looks_like_path and not path.is_file():
        return Problem("task.chat_template", f"{text}: no such file (a template file ending in "
                       f"{', '.join(TEMPLATE_SUFFIXES)}, or the Jinja template itself)")  # fmt: skip
    return None


def chat_template(task: Any, tok: Any, ref: str) -> str:
    """``task.chat_template`` (a name, the template, or a file holding it), else the tokenizer's."""
    value = task.chat_template
    if value:
        known = named(value)
        if known is not None:
            return known.template
        problem = template_problem(value)
        if problem is not None:
            raise ConfigError([problem])
        path = Path(str(value)).expanduser()
        return path.read_text() if len(str(value)) < 4096 and path.is_file() else str(value)
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if not template:
        raise ConfigError([Problem("task.chat_template", f"unset, and the tokenizer {ref} has no chat template; "
                                   "set task.chat_template=chatml|llama3|<a Jinja template or a file holding one>")])  # fmt: skip
    return str(template)


def model_vocab(model: Any) -> int | None:
    """How many token ids the model's embedding has (a checkpoint's config.json, else model.vocab_size)."""
    if not model.pretrained:
        return int(model.vocab_size)
    from l2l_cli.models import PretrainedUnavailable, resolve_pretrained

    try:
        config = json.loads(
            (resolve_pretrained(model.pretrained, config_only=True) / "config.json").read_text()
        )
    except (PretrainedUnavailable, OSError, ValueError):
        return None  # model.pretrained's own check says why
    vocab = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return int(vocab) if vocab else None


def add_template_tokens(tok: Any, template: NamedTemplate, vocab: int | None, ref: str) -> None:
    """Make each special token a named template is written in one token of ``tok``: one the tokenizer
    has as a word is marked special (its id kept); one it lacks is added past its ids, which must still
    index the model's embedding (a checkpoint's spare rows, or a larger model.vocab_size), else one
    config error: a token split into pieces would teach the model neither where a turn ends nor when to
    stop."""
    have = tok.get_vocab()
    missing = [t for t in template.specials if t not in have]
    if missing and vocab is not None and len(tok) + len(missing) > vocab:
        raise ConfigError([Problem("task.chat_template", f"{template.name} is written in the special tokens "
                                   f"{', '.join(missing)}, which the tokenizer {ref} lacks, and the model's "
                                   f"{vocab} token ids leave no room to add them (the tokenizer has {len(tok)}); "
                                   "use a tokenizer that has them, a larger model.vocab_size, or a Jinja "
                                   "template in the tokenizer's own tokens")])  # fmt: skip
    added = set(getattr(tok, "added_tokens_encoder", {}))
    new = [t for t in template.specials if t not in added]
    if new:
        tok.add_tokens(new, special_tokens=True)


def template_tokenizer(task: Any, model: Any) -> tuple[Any, str, str]:
    """(the run's tokenizer with the chat template it trains with, its ref, the template): a named
    template's special tokens added where the tokenizer lacks them, so the export (final/) and
    ``l2l generate`` tokenize as training did."""
    ref, chosen_by = lm_tokenizer_ref(task, model)
    tok = load_tokenizer(ref, "task.tokenizer" if chosen_by == "task.tokenizer" else "model.pretrained")
    template = chat_template(task, tok, ref)
    known = named(task.chat_template)
    if known is not None:
        add_template_tokens(tok, known, model_vocab(model), ref)
    tok.chat_template = template  # the export (final/) carries the template it was trained with
    return tok, ref, template


def make_encoder(task: Any, model: Any) -> tuple[Encoder, str]:
    tok, ref, template = template_tokenizer(task, model)
    if not getattr(tok, "is_fast", False):
        raise ConfigError([Problem("task.tokenizer", f"{ref} is not a fast tokenizer (task=chat needs its "
                                   "character offsets to find the answers)")])  # fmt: skip
    eot = end_of_turn_text(template)
    if eot is None:  # the tokenizer's own template: the special token it closes a turn with, if any
        from l2l_cli.engine.stops import end_of_turn

        ids = sorted(end_of_turn(tok))
        eot = tok.convert_ids_to_tokens(ids[0]) if ids else None
    enc = Encoder(
        tok, template, task.train_on, int(task.max_seq_len), end_of_turn=eot, fields=Fields.of(task)
    )
    return enc, ref


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


def read_split(task: Any, enc: Encoder, key: str, split: str | None, cache: Path) -> list[Encoded] | None:
    """The examples of task.files / task.dev_files (``key``) or of the dataset's ``split``."""
    if task.dataset:
        if split is None:
            return None
        return encode_rows(sources.open_dataset(task, split, cache, False), enc, task.format,
                           f"{task.dataset}:{split}")  # fmt: skip
    paths = [Path(f).expanduser() for f in as_list(getattr(task, key))]
    if not paths:
        return None
    out: list[Encoded] = []
    for p in paths:  # one file at a time: the example index is the file's
        out += encode_rows(
            sources.open_files([p], cache, key=f"task.{key}"), enc, task.format, p.name, path=p
        )
    return out


def cache_key(task: Any, enc: Encoder) -> str:
    if task.dataset:
        data: Any = dataset_key(task)
    else:
        data = [file_key([Path(f).expanduser() for f in as_list(task.files)]),
                file_key([Path(f).expanduser() for f in as_list(task.dev_files)])]  # fmt: skip
    return hashlib.sha256(json.dumps({
        "v": CACHE_VERSION, "data": data, "tokenizer": tokenizer_fingerprint(enc.tok), "template": enc.template,
        "format": task.format, "train_on": task.train_on, "seq": enc.max_len, "packing": bool(task.packing),
        "dev_fraction": float(task.dev_fraction), "fields": enc.fields.key(),
    }, sort_keys=True, default=str).encode()).hexdigest()[:24]  # fmt: skip


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


def prepare(task: Any, model: Any) -> tuple[Rows, Rows, dict[str, int], Encoder, str]:
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
        raise ConfigError([Problem("task.files" if not task.dataset else "task.dataset",
                                   f"{len(train)} train and {len(dev)} dev examples; both splits need one")])  # fmt: skip
    seq, packing = enc.max_len, bool(task.packing)
    tr, dv = Rows(pack_examples(train, seq, packing)), Rows(pack_examples(dev, seq, packing))
    stats = {"examples": enc.examples, "truncated": enc.truncated, "train_rows": len(tr), "dev_rows": len(dv),
             "answer_tokens": int(sum((r[1] != IGNORE).sum() for r in tr.rows))}  # fmt: skip
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


def open_stream(task: Any, key: str, split: str) -> tuple[RowStream, str]:
    if task.dataset:
        return RowStream(lambda: sources.open_dataset(task, split, cache_root() / "datasets", True)), (
            f"{task.dataset}:{split}"
        )
    paths = [Path(f).expanduser() for f in as_list(getattr(task, key))]
    return RowStream(
        lambda: sources.open_files(paths, cache_root() / "datasets", True, f"task.{key}")
    ), ",".join(p.name for p in paths)


def streamed(task: Any, model: Any, limit: int | None = None) -> tuple[Any, Rows, Encoder, str]:
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


def load(spec: TaskSpec, task: Any, model: Any, train_split: bool) -> TaskData:
    if task.streaming:
        maker, dev, enc, ref = streamed(task, model)
        source = f"chat:stream:{sources.describe(task)}"

        def stream(batch_size: int, world: int, rank: int, pad_to_max: int | None) -> StreamedTrain:
            return StreamedTrain(maker, batch_size, world=world, rank=rank, pad_to_max=pad_to_max)

        log.info("task chat: %s streamed, rendered by %s; %d dev rows", source, ref, len(dev))
        return TaskData(spec, Rows([]), dev, source, enc.tok, stream=stream)
    train, dev, stats, enc, ref = prepare(task, model)
    source = f"chat:{sources.describe(task)}"
    log.info("task chat: %s rendered by %s: %d examples (%d cut at task.max_seq_len=%d), %d train and %d dev "
             "rows, %d answer tokens", source, ref, stats["examples"], stats["truncated"], enc.max_len,
             stats["train_rows"], stats["dev_rows"], stats["answer_tokens"])  # fmt: skip
    if stats["truncated"]:
        log.warning("task chat: %d of %d examples were longer than task.max_seq_len=%d tokens and were cut",
                    stats["truncated"], stats["examples"], enc.max_len)  # fmt: skip
    return TaskData(spec, train if train_split else Rows([]), dev, source, enc.tok, stats=stats)


def validate(cfg: Any, check_files: bool) -> list[Problem]:
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


def source_problems(cfg: Any, suffixes: tuple[str, ...], check_files: bool) -> list[Problem]:
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
                p.append(Problem(f"task.{key}", f"{f}: unsupported format {suffix or '(none)'}; allowed: "
                                 f"{', '.join(suffixes)}"))  # fmt: skip
            elif check_files and not Path(f).expanduser().is_file():
                p.append(Problem(f"task.{key}", f"{f} is not a file"))
    if not (0.0 <= task.dev_fraction < 1.0):
        p.append(Problem("task.dev_fraction", f"got {task.dev_fraction}; must be in [0, 1)"))
    return p + sources.dataset_problems(cfg)


KIND = TaskKind(
    "chat", load, validate,
    keys=("files", "dev_files", "dev_fraction", "format", "chat_template", "fields", "train_on", "packing", "dataset",
          "dataset_config", "split", "dev_split", "streaming"),
)  # fmt: skip
