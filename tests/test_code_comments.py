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

import pytest

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

OTHER_AREAS = [  # cleaned on their own branches in parallel; the lead drops this list after merging
    "engine/tiers",
    "engine/relay.py",
    "engine/device.py",
    "engine/frozen.py",
    "engine/frozen_disk.py",
    "models",
    "session.py",
    "parallel/pipeline",
    "config",
    "cli.py",
    "launch.py",
    "data",
]


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


def test_l2l_cli_outside_the_other_areas_has_no_bare_skip_nor_a_long_line() -> None:
    """Every ``# fmt: skip`` in l2l_cli/ says why (``# fmt: skip  # <why>``), and no line is over the
    configured length, in the modules this branch cleaned (the other areas are cleaned in parallel)."""
    fc = _fmt_check()
    found = fc.check([REPO / "l2l_cli"], exclude=[REPO / "l2l_cli" / p for p in OTHER_AREAS])
    assert found == [], "\n".join(found)


@pytest.mark.xfail(reason="issue 41: the other areas are cleaned on their own branches; global after merging")
def test_l2l_cli_has_no_bare_skip_nor_a_long_line() -> None:
    assert _fmt_check().check([REPO / "l2l_cli"]) == []
