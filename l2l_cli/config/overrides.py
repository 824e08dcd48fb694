"""An ``l2l train`` command line as data: its flags and its ``key=value`` overrides, each read with Hydra's
own override parser. The CLI sets, drops and reads keys by name (the run dir it pins, a resume's run dir,
torchrun's world size) and hands the result to Hydra; a value set here is quoted so that Hydra reads back
exactly that string (spaces, quotes, ``=``, backslashes, a literal ``${``), never edited as text."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

_PLAIN = re.compile(r"[A-Za-z0-9_./-]+")  # a value Hydra reads as this very string, unquoted
_PARSER = OverridesParser.create()


def quote(value: str) -> str:
    """``value`` as a Hydra override value that reads back as exactly ``value``: bare when it is a plain
    path, else single-quoted with its quotes, the backslashes before them (and at its end) and any
    ``${`` (an interpolation, in Hydra and OmegaConf) escaped."""
    if _PLAIN.fullmatch(value) and _PARSER.parse_override(f"k={value}").value() == value:
        return value  # (not null, true, 12: those read as other types)
    out = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    out = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, out)
    out = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", out)
    return f"'{out}'"


def key_of(arg: str) -> str | None:
    """The key an override sets (``+``/``~`` kept: ``+x=1`` does not set what ``x=1`` does); None for a
    flag or an argument Hydra cannot parse (preflight names those)."""
    if arg.startswith("-"):
        return None
    try:
        ov = _PARSER.parse_override(arg)
    except Exception:
        return None
    prefix = "+" if ov.is_add() else "~" if ov.is_delete() else ""
    prefix = "++" if ov.is_force_add() else prefix
    return prefix + ov.key_or_group


@dataclass
class CommandLine:
    """The arguments of ``l2l train`` (after the command), edited by key. :attr:`args` is what Hydra gets."""

    args: list[str] = field(default_factory=list)

    def _at(self, key: str) -> list[int]:
        return [i for i, a in enumerate(self.args) if key_of(a) == key]

    def has(self, key: str) -> bool:
        return bool(self._at(key))

    def value(self, key: str) -> Any:
        """The value the command line gives ``key`` (the last one, as Hydra reads it: unquoted,
        interpolations left as written), or None when it is not given."""
        at = self._at(key)
        return _PARSER.parse_override(self.args[at[-1]]).value() if at else None

    def text(self, key: str) -> str | None:
        """:meth:`value` as the string the config will hold (None when not given): escapes read as
        OmegaConf reads them (``\\${`` is a literal ``${``); an interpolation is left as written."""
        if not self.has(key):
            return None
        text = str(self.value(key))
        if re.search(r"(?<!\\)\$\{", text):  # an interpolation (${now:...}): resolved by Hydra, later
            return text
        return str(OmegaConf.create({"v": text})["v"])

    def set(self, key: str, value: str | int | None) -> None:
        """``key=value`` (a string quoted as needed; None: ``null``; an int as itself) in place of the first
        ``key=`` (the others dropped), or appended when the command line has none."""
        text = "null" if value is None else str(value) if isinstance(value, int) else quote(value)
        arg = f"{key}={text}"
        at = self._at(key)
        if not at:
            self.args.append(arg)
            return
        self.args[at[0]] = arg
        for i in reversed(at[1:]):
            del self.args[i]

    def drop(self, key: str) -> None:
        self.args = [a for a in self.args if key_of(a) != key]

    def overrides(self) -> list[str]:
        """The ``key=value`` arguments (no flags), in order."""
        return [a for a in self.args if not a.startswith("-")]
