"""Chat templates by name (``task.chat_template=chatml|llama3``), as axolotl names them: the Jinja text,
the special tokens it is written in, and the token that ends a turn. That token closes each answer's loss
span (``data/chat.py``) and stops generation (``engine/stops.py`` finds it in the exported template).
No torch and nothing of the package: the config's checks read the names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NamedTemplate:
    name: str
    template: str  # Jinja, as transformers' apply_chat_template renders it
    specials: tuple[str, ...]  # each must be one token of the tokenizer
    end_of_turn: str  # what closes an assistant turn (trained on; generation stops at it)


CHATML = NamedTemplate(
    "chatml",
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}",
    ("<|im_start|>", "<|im_end|>"),
    "<|im_end|>",
)
LLAMA3 = NamedTemplate(
    "llama3",
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = (bos_token or '') + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "<|eot_id|>",
)
NAMED = {t.name: t for t in (CHATML, LLAMA3)}


def named(value: object) -> NamedTemplate | None:
    """The named template ``task.chat_template`` names (case-insensitive), else None (Jinja or a file)."""
    return NAMED.get(str(value).strip().lower()) if isinstance(value, str) else None


def end_of_turn_text(template: str | None) -> str | None:
    """The end-of-turn token of a named template's text (what a saved tokenizer carries), else None."""
    return next((t.end_of_turn for t in NAMED.values() if t.template == template), None)
