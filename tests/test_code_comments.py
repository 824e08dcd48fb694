"""Code comments and docstrings state a contract and its reason; measurement history (dated results,
per-commit timings, "measured on ..." logs) lives in docs/benchmarks.md (issue 40, item 10's last part).
This scan keeps it from creeping back: no commit hash, no date other than an example run dir's, no
seconds-per-step result in any comment or docstring of ``l2l_cli/``."""

from __future__ import annotations

import io
import re
import tokenize

from tests.util import REPO

HISTORY = [
    (re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"), "a commit hash"),
    (re.compile(r"\b20\d\d-\d\d-\d\d\b(?![_/-]\d\d-\d\d)(?!/\d\d-\d\d-\d\d)"), "a date"),
    (re.compile(r"\d\s*s/step\b|\bs/step\s*\d"), "a seconds-per-step result"),
    (re.compile(r"\bmeasured (on|at|in) (commit|\d)", re.I), "a dated measurement"),
]
EXAMPLE_RUN_DIR = re.compile(r"outputs/(\S+/)?20\d\d-\d\d-\d\d")  # a run dir in an example command


def texts(path: object) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal standing alone (a docstring) in a module."""
    out = []
    src = path.read_text()  # type: ignore[attr-defined]
    prev = None
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT or (
            tok.type == tokenize.STRING and (prev is None or prev.type in (tokenize.INDENT, tokenize.NEWLINE))
        ):
            out.append((tok.start[0], tok.string))
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            prev = tok
    return out


def test_code_comments_carry_no_measurement_history() -> None:
    found = []
    for path in sorted((REPO / "l2l_cli").rglob("*.py")):
        for line, text in texts(path):
            for n, part in enumerate(text.splitlines()):
                if EXAMPLE_RUN_DIR.search(part):
                    continue
                for pattern, what in HISTORY:
                    if pattern.search(part):
                        found.append(f"{path.relative_to(REPO)}:{line + n}: {what}: {part.strip()[:100]}")
    assert not found, "history belongs in docs/benchmarks.md:\n" + "\n".join(found)
