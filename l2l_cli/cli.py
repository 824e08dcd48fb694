"""``l2l``: the command line. ``l2l train`` is a Hydra app; ``l2l report`` and ``l2l plan`` read runs and
configs. Bad input ends with one line per problem and exit code 2, never a traceback."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from l2l_cli.config.overrides import CommandLine
    from l2l_cli.locks import DirLock

USAGE = """\
usage: l2l <command> [args]

commands:
  train    train or fine-tune (Hydra app: l2l train [group=option] [key=value] [-m for sweeps];
           --help lists all)
  eval     evaluate a run's final/ or a checkpoint (l2l eval <run dir> [task=...] [--checkpoint DIR] [--json])
  predict  predictions of a trained run as JSON lines (l2l predict <run dir> --input FILE [--output FILE])
  generate sample from a trained decoder (l2l generate <run dir> --prompt TEXT | --input FILE
           [--max-new-tokens N] [--temperature T --top-p P --seed S] [--chat] [--layered]
           [--checkpoint PATH|latest] [--json])
  export   a run's weights as a Hugging Face model (l2l export <run dir> [--merge] [--out DIR]
           [--checkpoint DIR] [--dtype bf16|fp16|fp32] [--max-shard-size 5GB]);
           --merge: a LoRA run's base with its adapter merged in, layer by layer into shards
  report   tables and plots from run directories (l2l report outputs/...)
  plan     analytic memory and time estimates for a config (l2l plan [overrides] [--json])

  l2l --version     the version of l2l and of the libraries it runs on

exit codes: 0 ok, 1 a run failed, 2 bad input, 3 a run ran out of device memory, 128+N stopped by signal N
"""

# flags Hydra handles itself (they run no job)
_HYDRA_INFO = {
    "--hydra-help",
    "--cfg",
    "-c",
    "--info",
    "-i",
    "--shell-completion",
    "-sc",
}
_STATUSES: list[str] = []


def _fail(lines: list[str] | str, code: int = 2) -> int:
    for line in [lines] if isinstance(lines, str) else lines:
        print(f"l2l: {line}", file=sys.stderr)
    return code


def version() -> str:
    """``l2l --version``: this package's version and the versions it runs on."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    def v(name: str) -> str:
        try:
            return dist_version(name)
        except PackageNotFoundError:
            return "not installed"

    return (
        f"l2l {v('l2l')} (python {sys.version.split()[0]}, torch {v('torch')}, transformers "
        f"{v('transformers')}, hydra-core {v('hydra-core')})"
    )


def train_help() -> str:
    from l2l_cli.compose import GROUPS, group_description, group_options
    from l2l_cli.config.help import render

    groups = {g: group_options(g) for g in GROUPS}
    return render(groups, {g: {o: group_description(g, o) for o in opts} for g, opts in groups.items()})


def train(argv: list[str]) -> int:
    from l2l_cli.compose import setup  # (Hydra's pieces: imported by l2l train only, not l2l --help)
    from l2l_cli.config.overrides import CommandLine
    from l2l_cli.config.settings import forget_valid
    from l2l_cli.locks import LockError
    from l2l_cli.preflight import preflight

    setup()
    if "--help" in argv or "-h" in argv:
        print(train_help(), end="")
        return 0
    if "--version" in argv:
        print(version())
        return 0
    sweep: dict[str, Any] = {}
    claim: DirLock | None = None
    line = CommandLine(list(argv))
    forget_valid()  # the session skips validating only what this command's preflight validated
    if not any(a in _HYDRA_INFO or a.startswith("--cfg") for a in argv):
        multirun = "-m" in argv or "--multirun" in argv
        unknown_flags = [a for a in argv if a.startswith("-") and a not in ("-m", "--multirun")]
        if unknown_flags:
            return _fail(
                f"unknown option {unknown_flags[0]}; allowed: -m/--multirun, --help, --version, "
                "--cfg job, --info"
            )
        try:
            resume = resolve_resume(line, multirun)
            torchrun_world(line)
        except ValueError as e:
            return _fail(f"config error: {e}")
        try:  # a live run's disk EPS: named by its holder first, whatever else its folder would say
            _check_eps_free(line)
        except LockError as e:
            return _fail(f"config error: {e}")
        warnings: list[str] = []
        problems = preflight(line.overrides(), multirun, warnings, resume=resume, info=sweep)
        if not problems:  # a hub checkpoint that cannot be fetched: refused before any run dir exists
            from l2l_cli.models import (
                check_hub,  # (the model registry: only for a command line that is valid)
            )

            for ref, family in sweep.get("pretrained", {}).items():
                problems += check_hub(ref, family)
        if problems:
            return _fail([f"config error: {p}" for p in problems])
        for w in warnings:
            print(f"l2l: warning: {w}", file=sys.stderr)
        if sweep.get("multirun") and sweep.get("dir") and not line.has("hydra.sweep.dir"):
            line.set("hydra.sweep.dir", str(sweep["dir"]))  # pin it: ${now:} resolved once
        try:
            claim = _claim_run_dir(line, resume, sweep)
        except LockError as e:
            return _fail(f"config error: {e}")
        if sweep.get("multirun") and sweep.get("dir"):
            print(f"l2l: sweep of {sweep['jobs']} jobs into {sweep['dir']}/", flush=True)
    rank_logs(line)
    _STATUSES.clear()
    try:
        _run_hydra(["l2l-train", *line.args])
    finally:
        if claim is not None:
            claim.release()
    if not _STATUSES:
        return 0  # --cfg and friends
    if len(_STATUSES) == 1 and not sweep.get("multirun"):
        from l2l_cli.train import exit_code  # (imports torch: only once a run has run)

        return exit_code(_STATUSES[0])
    order = ["ok", "oom", "config", "error", *sorted(set(_STATUSES) - {"ok", "oom", "config", "error"})]
    names = {"config": "bad config", "error": "failed"}
    done = ", ".join(f"{_STATUSES.count(s)} {names.get(s, s)}" for s in order if s in _STATUSES)
    print(
        f"l2l: sweep done ({done}) in {sweep.get('dir', 'the sweep dir')}/; tables and plots: "
        f"l2l report {sweep.get('dir', '<sweep dir>')}",
        flush=True,
    )
    return 0 if all(s in ("ok", "oom") for s in _STATUSES) else 1


def _under_torchrun_rank() -> int:
    """This process's rank under torchrun (0 when not under torchrun)."""
    return int(os.environ.get("RANK", "0")) if "WORLD_SIZE" in os.environ else 0


def rank_logs(line: CommandLine) -> None:
    """Under torchrun rank 0 owns the run dir; another rank writes only its log: into the run dir given to
    every node (as under ``dist.nproc``), else into a folder of its own (each node would name its own
    timestamped dir, and the others' logs stay out of rank 0's)."""
    rank = _under_torchrun_rank()
    if rank == 0:
        return
    line.set("hydra.output_subdir", None)
    given = line.text("hydra.run.dir")
    if given is not None:
        line.set("hydra.job_logging.handlers.file.filename", f"{given}/train-rank{rank}.log")
    else:
        line.set("hydra.run.dir", f"{tempfile.gettempdir()}/l2l-rank{rank}-{os.getpid()}")


def _check_eps_free(line: CommandLine) -> None:
    """Raise :class:`~l2l_cli.locks.DirectoryInUse` when the command line's ``eps.path`` is held by a
    live run (its own checks would otherwise advise a resume of a folder another run is writing)."""
    from l2l_cli.locks import check_free

    try:
        eps = line.text("eps.path")
    except Exception:  # an override that does not parse: preflight says so
        return
    if eps and eps != "None":
        check_free(Path(eps).expanduser(), "eps.path")


def _claim_run_dir(line: CommandLine, resume: Path | None, info: dict[str, Any]) -> DirLock | None:
    """A start owns the directory it writes before Hydra writes anything there (``.hydra/``, train.log):
    its run dir (a sweep: the sweep dir) is locked here and held until the run ends, so a second start
    into a live run is refused with the holder's pid, and a fresh start into a directory that already
    holds a run (finished or killed) is refused, pointing to ``trainer.resume``; either way the other
    run's files stay byte-identical. The default run dir's ``${now:}`` is resolved once and pinned.
    Ranks other than 0 under torchrun write only their own logs: they claim nothing."""
    from l2l_cli.locks import DirLock, LockError, check_free
    from l2l_cli.rundir import run_markers

    if _under_torchrun_rank() > 0:
        return None
    if info.get("multirun"):
        given = line.text("hydra.sweep.dir") or info.get("dir")
        if not given:
            return None
        path, key = Path(given), "hydra.sweep.dir"
        info["dir"] = given
        taken = []
        if path.is_dir():
            taken = ["multirun.yaml"] if (path / "multirun.yaml").exists() else []
            taken += [f"{c.name}/" for c in sorted(path.iterdir()) if c.is_dir() and run_markers(c)]
    else:
        given = line.text("hydra.run.dir")
        if given is None:
            if not info.get("run_dir"):
                return None
            given = str(info["run_dir"])
            line.set("hydra.run.dir", given)  # pin it: ${now:} resolved once
        path = Path(given)
        own = resume is not None and path.resolve() == resume.resolve()
        key = "trainer.resume" if own else "hydra.run.dir"
        taken = [] if own or not path.is_dir() else run_markers(path)
    check_free(path, key)
    if taken:
        raise LockError(
            key,
            path,
            f"{path} holds a run already ({', '.join(taken[:3])}); continue it with "
            f"trainer.resume={path}, or choose a new directory",
        )
    _CLAIMED.append((path, path.exists()))
    return DirLock(path, key).acquire()


# the run dirs this process claimed, and whether each existed before: a Ctrl-C before the run starts
# removes what the claim alone made (the lock, an empty dir), and names what Hydra had already written
_CLAIMED: list[tuple[Path, bool]] = []


def _interrupted_early(cmd: str) -> str:
    """The one line for a Ctrl-C before a command's own handling, true about what it left behind."""
    from l2l_cli.locks import LOCK_NAME
    from l2l_cli.rundir import run_markers

    for path, existed in _CLAIMED:
        left = run_markers(path) if path.is_dir() else []
        if left:
            return (
                f"l2l: {cmd} interrupted before its first step; {path} holds only its config and log "
                f"({', '.join(left)}): delete it, or choose another hydra.run.dir"
            )
        (path / LOCK_NAME).unlink(missing_ok=True)
        if not existed and path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    return f"l2l: {cmd} interrupted before it started (nothing written)"


def torchrun_world(line: CommandLine) -> None:
    """Under torchrun the world size is torchrun's (``--nnodes`` x ``--nproc-per-node``): ``dist.nproc``
    follows it (given, it must agree), so every rule that reads it sees the ranks really started."""
    if "WORLD_SIZE" not in os.environ:
        return
    world = int(os.environ["WORLD_SIZE"])
    if not line.has("dist.nproc"):
        line.set("dist.nproc", world)
        return
    given = line.text("dist.nproc")
    if given != str(world):
        raise ValueError(
            f"dist.nproc: got {given}, but torchrun started {world} ranks; allowed: {world}, "
            "or leave it out under torchrun"
        )


def latest_root(value: str, line: CommandLine | list[str]) -> Path:
    """Where ``trainer.resume=latest`` looks for runs (every folder below, at any depth): the folder after
    ``latest:`` (``trainer.resume=latest:/scratch/runs``); else, with ``hydra.run.dir=<dir>`` on the command
    line, the folder holding ``<dir>`` (runs kept beside each other outside outputs/); else ``outputs/``."""
    if value.startswith("latest:") and value[len("latest:") :]:
        return Path(value[len("latest:") :]).expanduser()
    from l2l_cli.config.overrides import CommandLine

    line = line if isinstance(line, CommandLine) else CommandLine(list(line))
    given = line.text("hydra.run.dir")
    if given and "${" not in given:
        return Path(given).expanduser().parent
    return Path("outputs")


def resolve_resume(line: CommandLine, multirun: bool) -> Path | None:
    """``trainer.resume=<run dir>|latest`` continues that run in its own directory, with its own config
    (l2l_cli/inherit.py): the run dir is resolved once here (``latest``: the run with the newest
    checkpoint under :func:`latest_root`) and becomes Hydra's run dir; Hydra writes no .hydra/ into it (the
    session records the config once the checkpoint has loaded), so a refused resume leaves the run as it
    was. Returns the run dir (None: not a resume); ``line`` then names it in both keys."""
    if not line.has("trainer.resume"):
        return None
    value = line.text("trainer.resume")
    if value is None or value in ("", "None"):
        return None
    if multirun:
        raise ValueError("resumes one run; it cannot be combined with -m (a sweep)")
    from l2l_cli.checkpoint import CheckpointError  # (imports torch: only when a run is resumed)
    from l2l_cli.inherit import find_latest_run

    try:
        latest = value == "latest" or value.startswith("latest:")
        run_dir = find_latest_run(latest_root(value, line)) if latest else Path(value)
    except CheckpointError as e:
        raise ValueError("trainer.resume: " + str(e).removeprefix("trainer.resume=latest: ")) from e
    if not run_dir.is_dir():
        raise ValueError(
            f"trainer.resume: {value} is not a run directory; allowed: a run dir, 'latest' or "
            "'latest:<folder>'"
        )
    run_dir = run_dir.resolve()
    line.set("trainer.resume", str(run_dir))
    if latest:  # the run found continues in its own directory, whatever hydra.run.dir pointed at
        line.drop("hydra.run.dir")
    if not line.has("hydra.run.dir"):
        line.set("hydra.run.dir", str(run_dir))
    line.set("hydra.output_subdir", None)
    return run_dir


def _resolve_resume(argv: list[str], multirun: bool) -> tuple[list[str], Path | None]:
    """:func:`resolve_resume` on a list of arguments: (the arguments after it, the run dir or None)."""
    from l2l_cli.config.overrides import CommandLine

    line = CommandLine(list(argv))
    resume = resolve_resume(line, multirun)
    return line.args, resume


def _run_hydra(argv: list[str]) -> None:
    import hydra
    from omegaconf import DictConfig

    from l2l_cli.paths import conf_dir

    def task(cfg: DictConfig) -> None:
        from l2l_cli.launch import run_task

        _STATUSES.append(run_task(cfg))

    app = hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(task)
    saved = sys.argv
    sys.argv = argv
    try:
        app()
    finally:
        sys.argv = saved


# libraries that speak on stderr at import: torchao (its optional CUDA kernels that a CPU build cannot load)
# and torch's pytree (deprecation notes torchao's enums trigger); stderr is for l2l's own one-line messages
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        sys.exit(0 if argv else 2)
    if argv[0] in ("--version", "-V", "version"):
        print(version())
        sys.exit(0)
    cmd, rest = argv[0], argv[1:]
    try:
        code = _dispatch(cmd, rest)
    except KeyboardInterrupt:  # Ctrl-C before a command's own handling (importing torch, composing): one line
        print("\n" + _interrupted_early(cmd), file=sys.stderr, flush=True)
        code = 130
    sys.exit(code)


def _dispatch(cmd: str, rest: list[str]) -> int:
    """Run one subcommand; its exit code."""
    if cmd == "train":
        code = train(rest)
    elif cmd in ("eval", "predict"):
        from l2l_cli import evaluate

        code = evaluate.main(cmd, rest)
    elif cmd == "generate":
        from l2l_cli import generate

        code = generate.main(rest)
    elif cmd == "export":
        from l2l_cli import export

        code = export.main(rest)
    elif cmd == "report":
        from l2l_cli.report import main as report_main

        code = report_main(rest)
    elif cmd == "plan":
        from l2l_cli.plan.cli import main as plan_main

        code = plan_main(rest)
    else:
        code = _fail(
            f"unknown command {cmd!r}; allowed: train, eval, predict, generate, export, report, plan "
            "(l2l --help)"
        )
    return code


if __name__ == "__main__":
    main()
