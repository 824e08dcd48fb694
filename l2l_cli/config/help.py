"""``l2l train --help``: every key with its default and a one-line description, and every group's options.

The descriptions are the schema's own comments (the trailing ``# ...`` of each field in
:mod:`l2l_cli.config.schema`), read from its source, so a key documents itself where it is defined and a
new key shows up here without a second list to maintain.
"""

from __future__ import annotations

import ast
import inspect
import io
import textwrap
import tokenize
from dataclasses import fields, is_dataclass
from typing import Any

from l2l_cli.config import schema

HELP_WIDTH = 118  # l2l train --help: group descriptions wrap here


def field_comments() -> dict[tuple[str, str], str]:
    """(dataclass name, field name) -> the field's comment in schema.py (its trailing comment, else the
    comment lines right above it)."""
    try:
        source = inspect.getsource(schema)
    except (OSError, TypeError):  # no source shipped (a zipped or compiled install): no descriptions
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[tuple[str, str], str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            end = stmt.end_lineno or stmt.lineno
            text = next((comments[n] for n in range(end, stmt.lineno - 1, -1) if n in comments), "")
            if not text:  # a comment block right above the field
                above, n = [], stmt.lineno - 1
                while n in comments and lines[n - 1].lstrip().startswith("#"):
                    above.insert(0, comments[n])
                    n -= 1
                text = " ".join(above)
            out[(node.name, stmt.target.id)] = text
    return out


def describe(root: Any = schema.L2LConfig) -> list[tuple[str, Any, str]]:
    """(dotted key, default, description) for every leaf key of the schema, in definition order."""
    notes = field_comments()
    out: list[tuple[str, Any, str]] = []

    def walk(cls: Any, prefix: str) -> None:
        instance = cls()
        for f in fields(cls):
            value = getattr(instance, f.name)
            if is_dataclass(value):
                walk(type(value), f"{prefix}{f.name}.")
            else:
                out.append((f"{prefix}{f.name}", value, notes.get((cls.__name__, f.name), "")))

    walk(root, "")
    return out


def _fmt(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


def render(groups: dict[str, list[str]], descriptions: dict[str, dict[str, str]] | None = None) -> str:
    """The help text: usage, each group's options (with the option file's first comment line), each key."""
    descriptions = descriptions or {}
    parts = [
        "usage: l2l train [group=option ...] [key=value ...] [-m]",
        "",
        "Train or fine-tune a transformer with layer-to-layer execution (L2L), or a baseline. Pick an option",
        "per group, override any key, sweep with -m (key=a,b). Bad input is refused before any work, every",
        "problem at once (exit 2).",
        "",
        "Groups (group=option):",
    ]
    for group, options in groups.items():
        parts.append(f"  {group}: {', '.join(options)}")
        for opt in options:
            text = descriptions.get(group, {}).get(opt)
            if text:  # wrapped at word boundaries, continuation lines under the text
                lead = f"      {opt:<16} "
                lines = textwrap.wrap(text, width=HELP_WIDTH - len(lead), break_on_hyphens=False) or [""]
                parts.append(lead + lines[0])
                parts += [" " * len(lead) + more for more in lines[1:]]
    parts += ["", "Keys (key=value; default, then what it does):"]
    rows = describe()
    width = min(34, max(len(k) + len(_fmt(v)) + 3 for k, v, _ in rows))
    section = ""
    for key, default, text in rows:
        head = key.split(".")[0] if "." in key else ""
        if head != section:
            section = head
            parts.append(f"  {head}:" if head else "  (top level):")
        left = f"{key}={_fmt(default)}"
        parts.append(f"    {left:<{width}} {text}".rstrip())
    parts += [
        "",
        "Examples:",
        "  l2l train",
        "  l2l train task=rte task.data_dir=../shared/data/glue/RTE mode=baseline_ag batch.size=32 "
        "batch.ubatch_size=8",
        "  l2l train task=csv task.files=train.csv task.dev_files=dev.csv task.text_fields=[review]",
        "  l2l train mode=l2l_stash_cpu precision=cmp device=sim sim.memory_gb=2 sim.link_gbps=16",
        "  l2l train -m mode=baseline_ag,l2l batch.ubatch_size=4,8",
        "  l2l train trainer.resume=latest trainer.max_steps=500     # continue a run with its own config",
        "",
        "Outputs go to a run dir under outputs/: metrics.jsonl, metrics.csv, tensorboard/, eval.jsonl, "
        "memory.json,",
        "summary.json, train.log, checkpoints/ (see README). Hydra's own help: l2l train --hydra-help",
    ]
    return "\n".join(parts) + "\n"
