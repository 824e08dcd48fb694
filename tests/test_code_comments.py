"""Code comments and docstrings state a contract and its reason; measurement history (dated results,
per-commit timings, "measured on ..." logs) lives in docs/benchmarks.md (issue 40, item 10's last part).
This scan keeps it from creeping back: no commit hash, no date other than an example run dir's, no
seconds-per-step result in any comment or docstring of ``l2l_cli/``."""

from __future__ import annotations

import importlib.util
import io
import re
import tokenize
from pathlib import Path
from typing import Any

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


# ---- the layout (issue 41, item 5): ruff format owns it; scripts/fmt_check.py checks what ruff does not


def _fmt_check() -> Any:
    spec = importlib.util.spec_from_file_location("fmt_check", REPO / "scripts" / "fmt_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fmt_check_finds_a_bare_skip_an_ignored_reason_and_a_long_line(tmp_path: Path) -> None:
    fc = _fmt_check()
    probe = tmp_path / "probe.py"
    probe.write_text(
        "a = [1,  2]  # fmt: skip\n"
        "b = [1,  2]  # fmt: skip (aligned table)\n"
        "c = [1,  2]  # fmt: skip  # aligned table: the columns line up\n"
        f"d = '{'x' * 120}'\n"
        "e = '# fmt: skip'\n"
    )
    found = fc.check([probe], limit=110)
    assert [f.split(":")[1] for f in found] == ["1", "2", "4"], found
    assert "without a reason" in found[0] and "ruff ignores" in found[1] and "> 110" in found[2]


def test_the_tree_has_no_bare_skip_nor_a_long_line() -> None:
    """Every ``# fmt: skip`` says why (``# fmt: skip  # <why>``: the only form ruff honours with a reason),
    and no line is over the configured length, in the package, the tests, the benchmarks and the scripts."""
    fc = _fmt_check()
    found = fc.check([REPO / d for d in ("l2l_cli", "tests", "benchmarks", "scripts")])
    assert found == [], "\n".join(found)
