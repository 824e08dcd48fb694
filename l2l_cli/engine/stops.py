"""Where a generated completion ends: every end-of-sequence id the model and its tokenizer declare, the chat
template's end-of-turn token, and the user's ``--stop`` strings (as transformers' ``generate`` and the chat
servers stop). Used by ``l2l generate`` for both engines and by the export, so ``final/`` carries the ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERATION_CONFIG = "generation_config.json"
_MARK = "l2lENDMARK"


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, list) else [value])}


def config_eos(folder: Path | str | None) -> set[int]:
    """The ``eos_token_id`` (an id or a list) of a model directory's ``generation_config.json``."""
    if not folder:
        return set()
    path = Path(folder).expanduser() / GENERATION_CONFIG
    try:
        return _ids(json.loads(path.read_text()).get("eos_token_id"))
    except (OSError, ValueError, TypeError):
        return set()


def end_of_turn(tok: Any) -> set[int]:
    """The special token a chat template closes an assistant turn with (``<|im_end|>``, ``<|eot_id|>``,
    ``<end_of_turn>``...): the first special token rendered right after an assistant message's content."""
    if not getattr(tok, "chat_template", None):
        return set()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}]
    try:
        text = tok.apply_chat_template(msgs, tokenize=False)
    except Exception:  # a template that refuses this shape (say, it needs a system turn): no guess
        return set()
    tail = text.split(_MARK, 1)[-1].lstrip() if _MARK in text else ""
    specials = sorted(set(tok.all_special_tokens) | set(getattr(tok, "added_tokens_encoder", {})), key=len)
    for token in reversed(specials):  # the longest special token the tail starts with
        if token and tail.startswith(token):
            ids = tok.convert_tokens_to_ids([token])
            return {int(i) for i in ids if i is not None and i != tok.unk_token_id}
    return set()


def stop_ids(tok: Any, *folders: Path | str | None, chat: bool = False) -> set[int]:
    """The ids that end a completion: the tokenizer's eos, the model's generation config's (``folders``: the
    weights and the base checkpoint), and with ``chat`` the template's end-of-turn token."""
    ids = _ids(tok.eos_token_id)
    for folder in folders:
        ids |= config_eos(folder)
    if chat:
        ids |= end_of_turn(tok)
    return ids


def cut_at_strings(tokens: list[int], tok: Any, stops: list[str]) -> tuple[list[int], str | None, bool]:
    """``tokens`` up to the first that completes a stop string, the completion's text without it, and
    whether a string stopped it (the text is decoded once per token only when a stop string is given)."""
    if not stops:
        return tokens, None, False
    for k in range(1, len(tokens) + 1):
        text = tok.decode(tokens[:k], skip_special_tokens=True)
        hits = [text.index(s) for s in stops if s in text]
        if hits:
            return tokens[:k], text[: min(hits)], True
    return tokens, None, False


def write_generation_config(out_dir: Path, tok: Any, base: Path | str | None) -> None:
    """``generation_config.json`` beside an exported decoder: the base checkpoint's own (if it has one),
    its eos list extended with the tokenizer's eos and the chat template's end-of-turn token, so
    ``transformers``' ``generate`` on the export stops where ``l2l generate`` does."""
    src = Path(base).expanduser() / GENERATION_CONFIG if base else None
    try:
        config = json.loads(src.read_text()) if src is not None and src.is_file() else {}
    except (OSError, ValueError):
        config = {}
    eos = _ids(config.get("eos_token_id")) | stop_ids(tok, chat=True)
    if eos:
        config["eos_token_id"] = sorted(eos) if len(eos) > 1 else next(iter(eos))
    for key, value in (("bos_token_id", tok.bos_token_id), ("pad_token_id", tok.pad_token_id)):
        if value is not None:
            config.setdefault(key, int(value))
    config.setdefault("transformers_version", __import__("transformers").__version__)
    (out_dir / GENERATION_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
