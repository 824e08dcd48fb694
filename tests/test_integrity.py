"""A run trusts nothing it reads back unverified, and bad data is one line: a torn log line, a corrupt
``final/``, a misspelled template path, a broken data file of any task kind (issue 37)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from l2l_cli import checkpoint as ckpt
from l2l_cli.config.validate import validate
from l2l_cli.problems import ConfigError, DiskFull
from l2l_cli.rundir import RunFiles
from tests.util import TINY, l2l, tiny_cfg, tiny_data

# ---- item 4: a torn metrics.jsonl line never blocks a resume ------------------------------------------


def test_a_torn_log_line_is_dropped_with_a_warning(tmp_path: Path, capsys) -> None:
    rows = [json.dumps({"step": k, "loss": 1.0 / k}) for k in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 4, "lo')  # disk full mid-append
    RunFiles(tmp_path).truncate("metrics.jsonl", 2)
    assert (tmp_path / "metrics.jsonl").read_text() == "\n".join(rows[:2]) + "\n"
    err = capsys.readouterr().err
    assert err.startswith("l2l: warning: ") and "metrics.jsonl" in err and "line 4" in err


# ---- items 5, 6, 9: final/ is atomic, checksummed, verified, and honours the umask ----------------------


def _write_model(out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    (out / "config.json").write_text("{}")
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(out / "model.safetensors"))


def test_final_is_replaced_whole_checksummed_and_verified(tmp_path: Path) -> None:
    final = ckpt.save_dir(tmp_path / "final", _write_model)
    listed = json.loads((final / ckpt.DIR_CHECKSUMS).read_text())["files"]
    assert set(listed) == {"config.json", "model.safetensors"}
    ckpt.verify_dir(final)
    before = (final / "model.safetensors").read_bytes()

    def full_disk(out: Path) -> None:  # the weights' write finds the disk full: the old final/ stands
        (out / "config.json").write_text("{}")
        raise DiskFull(out / "model.safetensors")

    with pytest.raises(DiskFull):
        ckpt.save_dir(tmp_path / "final", full_disk)
    assert (final / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["final"]  # no temporary folder left
    data = bytearray(before)
    data[len(data) // 2] ^= 0x40  # one flipped bit in a weight
    (final / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"final/model.safetensors: size or checksum differs"):
        ckpt.verify_dir(final)


def test_final_files_take_the_umask_mode(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        final = ckpt.save_dir(tmp_path / "final", _write_model)
    finally:
        os.umask(old)
    assert {p.name: p.stat().st_mode & 0o777 for p in final.iterdir()} == {
        "config.json": 0o644,
        "model.safetensors": 0o644,
        ckpt.DIR_CHECKSUMS: 0o644,
    }


def test_a_full_disk_while_writing_final_is_one_line_and_leaves_no_half_final(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = l2l(
        "train",
        *TINY,
        "trainer.max_steps=2",
        "trainer.save_every=0",
        "trainer.save_final=true",
        "task.num_train=64",
        "task.num_eval=8",
        f"hydra.run.dir={run}",
        env={"L2L_FAULT_ENOSPC": "tmp-final"},
    )
    # (torch 2.13 with torchao prints two deprecation warnings of its own on a failed run's exit path)
    lines = [ln for ln in r.stderr.strip().splitlines() if "torch/utils/_pytree.py" not in ln]
    assert r.returncode == 1 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith(f"l2l: error: disk full: no space left writing {run}/.tmp-final-")
    assert not (run / "final").exists() and not list(run.glob(".tmp-*"))


# ---- item 9: what a killed save left is removed; a run never owns its EPS twice -------------------------


def test_a_start_removes_what_a_killed_save_left(tmp_path: Path) -> None:
    from l2l_cli.session import build

    stale = [
        tmp_path / "checkpoints" / ".tmp-step_3-99999",
        tmp_path / "checkpoints" / "realtime" / ".tmp-step_3",
    ]
    for path in stale:
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"x" * 100)
    cfg = tiny_cfg("trainer.max_steps=1")
    with build(cfg, tmp_path, data=tiny_data(cfg, 32, 8)):
        assert not any(p.exists() for p in stale)


def test_an_eps_path_equal_to_the_run_dir_is_named_as_such(tmp_path: Path) -> None:
    from l2l_cli.session import build

    cfg = tiny_cfg("mode=l2l", "eps.tier=disk", f"eps.path={tmp_path}", "trainer.max_steps=1")
    with pytest.raises(ConfigError) as e:
        build(cfg, tmp_path, data=tiny_data(cfg, 32, 8))
    (problem,) = e.value.problems
    assert problem.key == "eps.path" and "this run's own directory" in problem.message
    assert "in use by another" not in problem.message


# ---- item 7: a template path that is not there ---------------------------------------------------------


@pytest.mark.parametrize("value", ["templates/chatml.jinja", "chat.j2", "nope/tmpl"])
def test_a_misspelled_chat_template_path_is_a_config_error(value: str, tmp_path: Path) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    problems = [
        str(p) for p in validate(tiny_cfg("task=chat", f"task.files=[{data}]", f"task.chat_template={value}"))
    ]
    assert any(p.startswith(f"task.chat_template: {value}: no such file") for p in problems), problems


def test_a_template_text_is_not_taken_for_a_path() -> None:
    from l2l_cli.data.chat import template_problem

    assert template_problem("{% for m in messages %}{{ m['content'] }}</s>{% endfor %}") is None


# ---- item 8: bad data, one line naming the key, the file and its line, for every task kind ----------------

LATIN = "café au lait\n".encode("latin-1")
BAD_FILES = {  # name -> (bytes, task kind overrides, what the line says)
    "broken.jsonl": (
        b'{"text": "a b", "label": 1}\n{"text": "c d", "label": 0}\n{"text": "e", oops}\n',
        ["task=json"],
        "line 3: not valid JSON",
    ),
    "latin.csv": (b"text,label\nhello,1\n" + LATIN, ["task=csv"], "line 3: not UTF-8 text"),
    "bool.jsonl": (
        b'{"text": "a", "label": true}\n{"text": "b", "label": false}\n',
        ["task=json"],
        "line 1: label is true (a boolean)",
    ),
    "list.jsonl": (
        b'{"text": "a", "label": 1}\n{"text": "b", "label": [0]}\n',
        ["task=json"],
        "line 2: label is [0] (a list)",
    ),
    "dict_text.jsonl": (
        b'{"text": {"a": 1}, "label": 1}\n',
        ["task=json"],
        "line 1: text is an object, not text",
    ),
    "empty.txt": (b"", ["task=lm", "model=gpt2-tiny"], ": empty (no text)"),
    "latin.txt": (b"plain\n" + LATIN, ["task=lm", "model=gpt2-tiny"], "line 2: not UTF-8 text"),
    "lm.jsonl": (
        b'{"text": "a b c"}\n{"text": "d e f"\n',
        ["task=lm", "model=gpt2-tiny"],
        "line 2: not valid JSON",
    ),
    "number.jsonl": (
        b'{"text": "a b c"}\n{"text": 5}\n',
        ["task=lm", "model=gpt2-tiny"],
        "line 2: text is a number",
    ),
    "chat.jsonl": (
        b'{"messages": []}\n[1, 2]\n',
        ["task=chat", "model=gpt2-tiny", "task.chat_template={tmpl}"],
        "line 2: a list, not a JSON object",
    ),
}


def write_bad(tmp_path: Path, name: str) -> tuple[Path, list[str], str]:
    data, overrides, want = BAD_FILES[name]
    path = tmp_path / name
    path.write_bytes(data)
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return path, [o.format(tmpl=tmp_path / "t.jinja") for o in overrides], want


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_bad_data_is_one_problem_naming_the_key_the_file_and_the_line(name: str, tmp_path: Path) -> None:
    path, overrides, want = write_bad(tmp_path, name)
    problems = [str(p) for p in validate(tiny_cfg(*overrides, f"task.files=[{path}]"))]
    mine = [p for p in problems if p.startswith("task.files: ")]
    assert len(mine) == 1 and mine[0].startswith(f"task.files: {path}") and want in mine[0], problems


def test_texts_cut_at_max_seq_len_are_counted(tmp_path: Path) -> None:
    from l2l_cli.data.loading import load_task

    rows = [{"text": " ".join(["word"] * (40 if i % 3 == 0 else 3)), "label": i % 2} for i in range(30)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_cfg("task=json", f"task.files=[{tmp_path / 't.jsonl'}]")
    data = load_task(cfg.task, cfg.model)
    assert data.stats == {"examples": 30, "truncated": 10}


def test_a_saved_config_that_is_not_yaml_is_one_line(tmp_path: Path, capsys) -> None:
    from l2l_cli.cli import train

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("model: {num_layers: [2\n")  # an edit gone wrong
    assert train([f"trainer.resume={tmp_path}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"l2l: config error: trainer.resume: {tmp_path}/.hydra/config.yaml: unreadable"
    ), lines
