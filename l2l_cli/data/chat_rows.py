"""Task ``chat``'s rows as conversations: the three shapes (``messages``, ``instruction``,
``prompt_completion``) each become a list of {role, content} messages, checked, with ``task.fields``
naming the keys (ShareGPT's ``conversations`` of ``{from, value}`` by default). Bad rows are one
:class:`~l2l_cli.problems.ConfigError` naming the key and the example."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from l2l_cli.config.schema import SHAREGPT_ROLES, TaskConfig
from l2l_cli.problems import ConfigError, Problem

ROLES = ("system", "user", "assistant", "tool")


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
    def of(task: TaskConfig) -> Fields:
        f = getattr(task, "fields", None)
        if f is None:
            return Fields()
        return Fields(
            f.messages, f.role, f.content, tuple((str(k), str(v)) for k, v in dict(f.roles).items())
        )

    def turns_key(self, columns: list[str]) -> str | None:
        """The field holding the turns: ``task.fields.messages``, else ``messages``, else
        ``conversations``."""
        if self.messages:
            return self.messages
        return next((k for k in ("messages", "conversations") if k in columns), None)

    def key(self) -> dict[str, Any]:
        return {"messages": self.messages, "role": self.role, "content": self.content, "roles": self.roles}


def detect(fields: list[str], where: str, keys: Fields = Fields()) -> str:
    """The shape of rows with these fields (``task.format=auto``)."""
    if keys.messages and keys.messages not in fields:
        raise ConfigError(
            [
                Problem(
                    "task.fields.messages",
                    f"{where} has no '{keys.messages}' field (its fields: {', '.join(fields)})",
                )
            ]
        )
    if keys.turns_key(fields):
        return "messages"
    if "instruction" in fields and "output" in fields:
        return "instruction"
    if "prompt" in fields and "completion" in fields:
        return "prompt_completion"
    raise ConfigError(
        [
            Problem(
                "task.format",
                f"{where} has no 'messages' field (nor ShareGPT's "
                "'conversations'), nor instruction/output, nor prompt/completion (its fields: "
                f"{', '.join(fields)}); set task.format or task.fields.messages",
            )
        ]
    )


def text_of(row: dict[str, Any], field: str, where: str, optional: bool = False) -> str:
    value = row.get(field)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise bad(
            "task.format",
            where,
            f"'{field}' is {'missing' if value is None else type(value).__name__}; expected text",
        )
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
                raise bad(
                    "task.fields.roles",
                    here,
                    f"{field}[{j}].{rk} {role!r} is not mapped to a role "
                    f"(mapped: {', '.join(f'{a}->{b}' for a, b in keys.roles)}); set "
                    f"+task.fields.roles.{role}=<{'|'.join(ROLES)}>",
                )
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
    head = (
        turns(prompt, "prompt", where)
        if isinstance(prompt, list)
        else [{"role": "user", "content": text_of(row, "prompt", where)}]
    )
    tail = (
        turns(completion, "completion", where)
        if isinstance(completion, list)
        else [{"role": "assistant", "content": text_of(row, "completion", where)}]
    )
    return head + tail
