"""Issue 41 item 4: typed settings from the validated config on, validation once per ``l2l train``, and the
run's command line built by key (Hydra's own parser and a quoting that reads back exactly), not by string
surgery."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from l2l_cli.cli import _resolve_resume, train
from l2l_cli.compose import compose, setup
from l2l_cli.config import ModelConfig, TaskConfig
from l2l_cli.config import validate as validate_mod
from tests.util import TINY

# values a path may hold that a command line must carry unchanged: spaces, quotes, ``=``, backslashes
# (one before a quote, one at the end), an interpolation's ``${``, and what Hydra reads as other types
TRICKY = ["a b", "it's", "k=v", "tail\\", "back\\'q", "${now:%H}", 'say "hi"', "null", "12", "ünï, [x]"]


@pytest.fixture(scope="module", autouse=True)
def _hydra() -> None:
    setup()


def count_checks(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times each config group's check runs from now on (filled as they run)."""
    runs: dict[str, int] = {}

    def counted(group, fn):
        def wrapper(cfg, check_files):
            runs[group] = runs.get(group, 0) + 1
            return fn(cfg, check_files)

        return wrapper

    monkeypatch.setattr(validate_mod, "CHECKS", [(g, counted(g, fn)) for g, fn in validate_mod.CHECKS])
    return runs


def test_train_validates_the_config_once(tmp_path, monkeypatch) -> None:
    """The CLI's preflight validates the config; the session that runs those same values does not run
    every group's check a second time (on 57486fb each ran twice: cli.py, then session.py)."""
    runs = count_checks(monkeypatch)
    run_dir = tmp_path / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = train([*TINY, "trainer.max_steps=1", "trainer.progress=none", f"hydra.run.dir={run_dir}"])
    assert code == 0, err.getvalue()
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "ok"
    assert runs and set(runs.values()) == {1}, runs


def test_eval_validates_the_config_once(tmp_path, monkeypatch, capsys) -> None:
    """``l2l eval`` (``predict`` and ``generate`` share its entry) validates its config at the entry; the
    session it builds runs on typed settings and does not validate it again (on 416327d each group's check
    ran twice: the entry's ``run_config``, then the session's own check)."""
    from l2l_cli import evaluate

    run_dir = tmp_path / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = train(
            [
                *TINY,
                "trainer.max_steps=1",
                "trainer.progress=none",
                "trainer.save_final=true",
                "task.num_train=32",
                "task.num_eval=16",
                f"hydra.run.dir={run_dir}",
            ]
        )
    assert code == 0, err.getvalue()
    runs = count_checks(monkeypatch)
    capsys.readouterr()
    assert evaluate.main("eval", [str(run_dir), "--json"]) == 0, capsys.readouterr().err
    assert "accuracy" in json.loads(capsys.readouterr().out)["metrics"]
    assert runs and set(runs.values()) == {1}, runs


def test_a_changed_config_is_validated_again() -> None:
    """Only the values the preflight validated skip the second check: a config it did not see (or one it
    saw with problems) is checked in full."""
    from l2l_cli.config.settings import is_marked, mark_validated, validated_before

    cfg = compose([*TINY, "batch.size=4", "batch.ubatch_size=4"])
    assert validate_mod.validate(cfg) == [] and validated_before(cfg)
    other = compose([*TINY, "batch.size=4", "batch.ubatch_size=2", "mode=baseline"])
    assert not validated_before(other) and not is_marked(other)
    problems = validate_mod.validate(other)
    assert problems and not validated_before(other)
    mark_validated(other)  # a mark is an explicit promise: validate trusts it
    assert validate_mod.validate(other) == []


def test_data_and_models_receive_typed_settings(monkeypatch) -> None:
    """``load_task`` and ``make_spec`` take the config's nodes as composed and hand the task kinds and
    the model families dataclasses of the schema (on 57486fb: the OmegaConf nodes themselves)."""
    from l2l_cli.data import loading
    from l2l_cli.models import FAMILIES, make_spec

    seen: dict[str, object] = {}
    kind = loading.KINDS["synthetic"]

    def load(spec, task, model, train_split):
        seen["task"], seen["model"] = task, model
        return kind.load(spec, task, model, train_split)

    def check(cfg, check_files):
        seen["settings"] = cfg
        return kind.validate(cfg, check_files)

    monkeypatch.setitem(loading.KINDS, "synthetic", type(kind)(kind.name, load, check, kind.keys))
    bert = FAMILIES["bert"]

    def from_config(m, num_labels):
        seen["family"] = m
        return bert.from_config(m, num_labels)

    monkeypatch.setitem(FAMILIES, "bert", type(bert)(**{**bert.__dict__, "from_config": from_config}))
    cfg = compose([*TINY, "task.num_train=8", "task.num_eval=4"])
    loading.load_task(cfg.task, cfg.model)
    make_spec(cfg.model, 2)
    assert validate_mod.validate(cfg, check_files=False) == []
    assert isinstance(seen["task"], TaskConfig) and isinstance(seen["model"], ModelConfig)
    assert isinstance(seen["family"], ModelConfig) and seen["family"].num_layers == 3
    settings = seen["settings"]
    assert isinstance(settings.task, TaskConfig) and isinstance(settings.model, ModelConfig)  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", TRICKY)
def test_quoted_values_read_back_exactly(name: str) -> None:
    """A value the CLI sets on the command line is what the composed config holds (on 57486fb a ``${``
    was interpolated, a trailing backslash or one before a quote broke the override)."""
    from l2l_cli.config.overrides import CommandLine, quote

    assert compose([f"trainer.resume={quote(name)}"]).trainer.resume == name
    line = CommandLine(["mode=l2l", "trainer.resume=x", "trainer.resume=y"])
    line.set("trainer.resume", name)
    assert line.args[0] == "mode=l2l" and len(line.args) == 2 and line.text("trainer.resume") == name


@pytest.mark.parametrize("name", ["run dir", "k=v, [x]", "ünï ${x}"])
def test_resume_command_line_carries_any_run_dir(tmp_path, name: str) -> None:
    """``trainer.resume='<dir>'`` (quoted on the command line, as a shell user writes a path with spaces)
    becomes the run's ``trainer.resume`` and Hydra's run dir, both read back as that directory (on
    57486fb the quotes were kept as part of the path: "is not a run directory")."""
    run = tmp_path / name
    run.mkdir()
    written = str(run).replace("${", "\\${")  # a literal ${ on a Hydra command line
    argv, found = _resolve_resume(["mode=l2l", f"trainer.resume='{written}'"], multirun=False)
    assert found == run.resolve()
    cfg = compose([a for a in argv if not a.startswith("hydra.")], hydra=True)
    assert cfg.trainer.resume == str(run.resolve())
    hydra = compose([a for a in argv if a.startswith("hydra.")], hydra=True).hydra
    assert hydra.run.dir == str(run.resolve()) and hydra.output_subdir is None


def test_torchrun_world_is_set_by_key(monkeypatch) -> None:
    """Under torchrun ``dist.nproc`` follows ``WORLD_SIZE``: set when absent, accepted when it agrees
    (however it is written), refused in one line when it does not."""
    from l2l_cli.cli import torchrun_world
    from l2l_cli.config.overrides import CommandLine

    monkeypatch.setenv("WORLD_SIZE", "2")
    line = CommandLine(["mode=l2l"])
    torchrun_world(line)
    assert line.args == ["mode=l2l", "dist.nproc=2"]
    same = CommandLine(["dist.nproc='2'"])
    torchrun_world(same)
    assert same.args == ["dist.nproc='2'"]
    with pytest.raises(ValueError, match=r"dist\.nproc: got 3, but torchrun started 2 ranks"):
        torchrun_world(CommandLine(["dist.nproc=3"]))


def test_rank_logs_go_into_the_given_run_dir(monkeypatch, tmp_path) -> None:
    """A torchrun rank other than 0 logs into the run dir every node was given, whatever its spelling."""
    from l2l_cli.cli import rank_logs
    from l2l_cli.config.overrides import CommandLine, quote

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    run = str(tmp_path / "it's a run")
    line = CommandLine([f"hydra.run.dir={quote(run)}"])
    rank_logs(line)
    hydra = compose(line.args, hydra=True).hydra
    assert hydra.job_logging.handlers.file.filename == f"{run}/train-rank1.log"
    assert hydra.output_subdir is None and hydra.run.dir == run


def test_typed_settings_from_yaml_and_from_the_schema() -> None:
    """A config read back from YAML (a rank's copy) converts like a composed one; Hydra's node is left out."""
    from omegaconf import OmegaConf

    from l2l_cli.config.settings import settings, typed

    cfg = compose([*TINY, "task=chat", "task.files=[a.jsonl]"], hydra=True)
    typed_cfg = settings(cfg)
    assert typed_cfg.task.files == ["a.jsonl"] and isinstance(typed_cfg.optim.lr, float)  # ${...} resolved
    again = OmegaConf.create(OmegaConf.to_yaml(compose([*TINY]), resolve=True))
    assert typed(again.model, ModelConfig) == settings(compose([*TINY])).model
    assert isinstance(typed(again.task, TaskConfig), TaskConfig)


def test_no_function_level_imports_of_cheap_modules() -> None:
    """The modules of this area import at the top what costs nothing to import (the lazy ones left
    keep torch, transformers and datasets out of ``l2l plan`` and the CLI's start, each with its reason)."""
    import ast

    root = Path(__file__).resolve().parents[1] / "l2l_cli"
    cheap = {"l2l_cli.models", "l2l_cli.compose", "l2l_cli.inherit", "l2l_cli.config.overrides"}
    found = []
    for path in [root / "launch.py", root / "data" / "lm.py", root / "data" / "chat_render.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.ImportFrom) and inner.module in cheap:
                        found.append(f"{path.name}:{inner.lineno} {inner.module}")
    assert found == []
