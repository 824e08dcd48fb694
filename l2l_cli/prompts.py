"""``l2l generate``'s prompts: ``--prompt``, or an ``--input`` file (text lines, JSON lines or a JSON array;
with ``--chat`` a conversation's turns), encoded by the run's tokenizer (its chat template with ``--chat``).
Bad input raises :class:`UsageError` (one line, exit 2)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from l2l_cli.evaluate import UsageError


@dataclass
class Prompt:
    text: str  # as given (a conversation: its last user turn)
    messages: list[dict[str, str]] | None = None  # --chat: the turns the template renders


def read_prompts(args: argparse.Namespace) -> list[Prompt]:
    """``--prompt``, or ``--input``: one prompt per line of a text file, or JSON lines / a JSON array of
    objects with ``prompt`` (or ``messages`` with ``--chat``)."""
    if args.prompt is not None:
        if not args.prompt:
            raise UsageError("--prompt: empty; give some text")
        return [Prompt(args.prompt)]
    path = Path(args.input).expanduser()
    if not path.is_file():
        raise UsageError(f"--input {path}: not a file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--input {path}: unreadable ({e})") from e
    if path.suffix.lower() not in (".jsonl", ".json"):
        prompts = [Prompt(line) for line in text.splitlines() if line.strip()]
    else:
        try:
            stripped = text.strip()
            records = (
                json.loads(stripped)
                if stripped.startswith("[")
                else [json.loads(line) for line in text.splitlines() if line.strip()]
            )
        except ValueError as e:
            raise UsageError(f"--input {path}: not JSON lines ({str(e).splitlines()[0]})") from e
        prompts = [_record_prompt(r, i, path, args.chat) for i, r in enumerate(records)]
    if not prompts:
        raise UsageError(f"--input {path}: no prompts")
    return prompts


def _record_prompt(r: Any, i: int, path: Path, chat: bool) -> Prompt:
    if isinstance(r, dict) and chat and isinstance(r.get("messages"), list):
        msgs = r["messages"]
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in msgs):
            raise UsageError(f"--input {path}: example {i}: messages must be {{role, content}} objects")
        last = next((m["content"] for m in reversed(msgs) if m.get("role") == "user"), "")
        return Prompt(last, [{"role": str(m["role"]), "content": m["content"]} for m in msgs])
    if not isinstance(r, dict) or not isinstance(r.get("prompt"), str) or not r["prompt"]:
        want = "'prompt' (text) or 'messages'" if chat else "'prompt' (text)"
        raise UsageError(f"--input {path}: example {i} has no {want}")
    return Prompt(r["prompt"])


def encode(tok: Any, prompts: list[Prompt], chat: bool, where: str) -> list[list[int]]:
    """Token ids of each prompt (``--chat``: rendered by the tokenizer's chat template, with the
    assistant's turn opened)."""
    if chat and not getattr(tok, "chat_template", None):
        raise UsageError(
            f"--chat: the tokenizer ({where}) has no chat template; drop --chat, or train from "
            "a checkpoint whose tokenizer has one"
        )
    out = []
    for i, p in enumerate(prompts):
        if chat:
            msgs = p.messages or [{"role": "user", "content": p.text}]
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(p.text)["input_ids"]
        if not ids:
            raise UsageError(f"prompt {i}: no tokens")
        out.append(list(ids))
    return out
