"""Layout rules ruff does not enforce by itself (issue 41, item 5): ``ruff format`` owns the layout, so a
``# fmt: skip`` must say why on its line, and no line may exceed the configured line length (ruff format
splits neither strings nor comments, and the project's ruff config ignores E501).

    python scripts/fmt_check.py                      # l2l_cli/
    python scripts/fmt_check.py l2l_cli tests --exclude l2l_cli/models

A reason is a second comment after the pragma, ``# fmt: skip  # aligned table: reads by column``: ruff
honours the pragma only when it is the whole comment or followed by another ``#`` comment, so a reason in
any other form (``# fmt: skip (aligned table)``) silently turns the pragma off and is reported as such.
Exit status: 0 clean, 1 with one ``path:line: problem`` per finding.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import tokenize
import unicodedata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRAGMA = re.compile(r"#\s*fmt:\s*(skip|off)\b(?P<rest>.*)$")
REASON = re.compile(r"^\s+#\s*\S")  # the pragma, then another comment: the reason
PRAGMAS = re.compile(r"(\s*#\s*(type:|noqa|pyright:|mypy:|ruff:|isort:|nosec)[^#]*)+$")
URL = re.compile(r"\w+://\S+\s*$")


def line_length(repo: Path = REPO) -> int:
    """``[tool.ruff] line-length`` from pyproject.toml (110 where it cannot be read)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        return 110
    try:
        return int(tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["ruff"]["line-length"])
    except (OSError, KeyError, ValueError):
        return 110


def width(line: str) -> int:
    """The line's width as ruff's E501 measures it: trailing pragma comments (``# type: ignore``,
    ``# noqa``, ...) left out, wide characters counted twice; 0 for what E501 exempts (one word, or a line
    ending in a URL)."""
    line = PRAGMAS.sub("", line)
    if len(line.split()) <= 1 or URL.search(line):
        return 0
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line)


def problems(path: Path, limit: int) -> list[str]:
    """Every over-long line and every ``# fmt: skip`` / ``# fmt: off`` without a reason ruff keeps."""
    src = path.read_text()
    lines = enumerate(src.splitlines(), 1)
    found = [(n, f"{w} columns > {limit}") for n, line in lines if (w := width(line)) > limit]
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(src).readline))
    except (tokenize.TokenError, SyntaxError) as e:
        found.append((0, f"not tokenizable ({e})"))
        tokens = []
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        m = PRAGMA.match(tok.string)
        if m is None:
            continue
        rest, kind = m.group("rest"), m.group(1)
        if not rest.strip():
            found.append((tok.start[0], f"'# fmt: {kind}' without a reason (add '  # <why>' after it)"))
        elif not REASON.match(rest):
            found.append(
                (
                    tok.start[0],
                    f"'# fmt: {kind}{rest}': ruff ignores a pragma followed by anything but another "
                    f"comment; write '# fmt: {kind}  # <why>'",
                )
            )
    shown = path.resolve().relative_to(REPO) if path.resolve().is_relative_to(REPO) else path
    return [f"{shown}:{n}: {msg}" for n, msg in sorted(found)]


def check(paths: list[Path], exclude: list[Path] | None = None, limit: int | None = None) -> list[str]:
    """The findings over every ``.py`` file under ``paths``, skipping those under ``exclude``."""
    limit = line_length() if limit is None else limit
    skip = [p.resolve() for p in exclude or []]
    out: list[str] = []
    for root in paths:
        files = [root] if root.is_file() else sorted(root.rglob("*.py"))
        for f in files:
            r = f.resolve()
            if any(r == s or s in r.parents for s in skip):
                continue
            out += problems(f, limit)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", type=Path, default=[REPO / "l2l_cli"])
    ap.add_argument("--exclude", action="append", type=Path, default=[], metavar="PATH")
    args = ap.parse_args(argv)
    found = check(args.paths, args.exclude)
    print("\n".join(found) if found else "fmt_check: clean")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
