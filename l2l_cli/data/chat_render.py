"""Task ``chat``'s rendering: a conversation through the chat template (``task.chat_template`` or the
tokenizer's), tokenized, with labels on the assistant's tokens only. A template with ``{% generation %}``
blocks marks them itself; otherwise each answer is located by rendering the conversation's prefixes."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from l2l_cli.config.schema import ModelConfig, TaskConfig
from l2l_cli.data.chat_rows import Fields, bad
from l2l_cli.data.lm import load_tokenizer
from l2l_cli.data.lm import tokenizer_ref as lm_tokenizer_ref
from l2l_cli.data.rows import IGNORE, Encoded
from l2l_cli.data.templates import NamedTemplate, end_of_turn_text, named
from l2l_cli.engine.stops import end_of_turn
from l2l_cli.models import PretrainedUnavailable, resolve_pretrained
from l2l_cli.problems import ConfigError, Problem

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
    fields: Fields = field(default_factory=Fields)  # task.fields: the rows' keys

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
            raise bad(
                "task.max_seq_len",
                where,
                f"no assistant token left after truncation to {self.max_len} "
                "tokens (an empty answer, or a prompt as long as the limit)",
            )
        return list(ids), [t if m else IGNORE for t, m in zip(ids, mask)]

    def tagged_mask(self, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
        out = self.tok.apply_chat_template(
            messages,
            chat_template=self.template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
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
                raise bad(
                    "task.chat_template",
                    where,
                    f"the template does not render messages[:{i + 1}] as a "
                    "prefix of the conversation, so the answers cannot be located; use a template with "
                    "{% generation %} blocks",
                )
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
        return Problem(
            "task.chat_template",
            f"{text}: no such file (a template file ending in "
            f"{', '.join(TEMPLATE_SUFFIXES)}, or the Jinja template itself)",
        )
    return None


def chat_template(task: TaskConfig, tok: Any, ref: str) -> str:
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
        raise ConfigError(
            [
                Problem(
                    "task.chat_template",
                    f"unset, and the tokenizer {ref} has no chat template; "
                    "set task.chat_template=chatml|llama3|<a Jinja template or a file holding one>",
                )
            ]
        )
    return str(template)


def model_vocab(model: ModelConfig) -> int | None:
    """How many token ids the model's embedding has (a checkpoint's config.json, else model.vocab_size)."""
    if not model.pretrained:
        return int(model.vocab_size)
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
        raise ConfigError(
            [
                Problem(
                    "task.chat_template",
                    f"{template.name} is written in the special tokens "
                    f"{', '.join(missing)}, which the tokenizer {ref} lacks, and the model's "
                    f"{vocab} token ids leave no room to add them (the tokenizer has {len(tok)}); "
                    "use a tokenizer that has them, a larger model.vocab_size, or a Jinja "
                    "template in the tokenizer's own tokens",
                )
            ]
        )
    added = set(getattr(tok, "added_tokens_encoder", {}))
    new = [t for t in template.specials if t not in added]
    if new:
        tok.add_tokens(new, special_tokens=True)


def template_tokenizer(task: TaskConfig, model: ModelConfig) -> tuple[Any, str, str]:
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


def make_encoder(task: TaskConfig, model: ModelConfig) -> tuple[Encoder, str]:
    tok, ref, template = template_tokenizer(task, model)
    if not getattr(tok, "is_fast", False):
        raise ConfigError(
            [
                Problem(
                    "task.tokenizer",
                    f"{ref} is not a fast tokenizer (task=chat needs its "
                    "character offsets to find the answers)",
                )
            ]
        )
    eot = end_of_turn_text(template)
    if eot is None:  # the tokenizer's own template: the special token it closes a turn with, if any
        ids = sorted(end_of_turn(tok))
        eot = tok.convert_ids_to_tokens(ids[0]) if ids else None
    enc = Encoder(
        tok, template, task.train_on, int(task.max_seq_len), end_of_turn=eot, fields=Fields.of(task)
    )
    return enc, ref
