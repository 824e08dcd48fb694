"""``l2l``: the command line. ``l2l train`` is a Hydra app; ``l2l report`` and ``l2l plan`` read runs and
configs. Bad input ends with one line per problem and exit code 2, never a traceback."""

from __future__ import annotations

import os
import sys
from pathlib import Path

USAGE = """\
usage: l2l <command> [args]

commands:
  train   train or fine-tune (Hydra app: l2l train [group=option] [key=value] [-m for sweeps]; --help lists all)
  report  tables and plots from run directories (l2l report outputs/...)
  plan    analytic memory and time estimates for a config (l2l plan [overrides] [--json])

exit codes: 0 ok, 1 a run failed, 2 bad input, 3 a run ran out of device memory
"""

# flags Hydra handles itself (they run no job)
_HYDRA_INFO = {
    "--help",
    "-h",
    "--hydra-help",
    "--version",
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


def train(argv: list[str]) -> int:
    from l2l_cli.compose import preflight, setup

    setup()
    if not any(a in _HYDRA_INFO or a.startswith("--cfg") for a in argv):
        multirun = "-m" in argv or "--multirun" in argv
        unknown_flags = [a for a in argv if a.startswith("-") and a not in ("-m", "--multirun")]
        if unknown_flags:
            return _fail(
                f"unknown option {unknown_flags[0]}; allowed: -m/--multirun, --help, --cfg job, --info"
            )
        overrides = [a for a in argv if not a.startswith("-")]
        warnings: list[str] = []
        problems = preflight(overrides, multirun, warnings)
        if problems:
            return _fail([f"config error: {p}" for p in problems])
        for w in warnings:
            print(f"l2l: warning: {w}", file=sys.stderr)
        try:
            argv = _resolve_resume(argv, multirun)
        except Exception as e:  # CheckpointError: no checkpoint to resume
            return _fail(f"config error: trainer.resume: {e}")
    rank = int(os.environ.get("RANK", "0"))
    if rank > 0 and "WORLD_SIZE" in os.environ:  # under torchrun: only rank 0 owns the run dir
        import tempfile

        argv = [
            *argv,
            "hydra.output_subdir=null",
            f"hydra.run.dir={tempfile.gettempdir()}/l2l-rank{rank}-{os.getpid()}",
        ]
    _STATUSES.clear()
    _run_hydra(["l2l-train", *argv])
    if not _STATUSES:
        return 0  # --help, --cfg and friends
    if len(_STATUSES) == 1:
        from l2l_cli.train import exit_code

        return exit_code(_STATUSES[0])
    return 0 if all(s in ("ok", "oom") for s in _STATUSES) else 1


def _resolve_resume(argv: list[str], multirun: bool) -> list[str]:
    """``trainer.resume=<run dir>|latest`` continues that run in its own directory: the run dir is
    resolved once here (``latest``: the run under outputs/ with the newest checkpoint) and becomes
    Hydra's run dir, so metrics.jsonl and the checkpoints carry on where they stopped."""
    from l2l_cli.checkpoint import find_latest_run

    out = list(argv)
    for k, arg in enumerate(argv):
        if not arg.startswith("trainer.resume="):
            continue
        value = arg.split("=", 1)[1]
        if value in ("", "null", "None"):
            return out
        run_dir = find_latest_run(Path("outputs")) if value == "latest" else Path(value)
        run_dir = run_dir.resolve()
        out[k] = f"trainer.resume={run_dir}"
        if not multirun and not any(a.startswith("hydra.run.dir=") for a in argv):
            out.append(f"hydra.run.dir={run_dir}")
    return out


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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        sys.exit(0 if argv else 2)
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        code = train(rest)
    elif cmd == "report":
        from l2l_cli.report import main as report_main

        code = report_main(rest)
    elif cmd == "plan":
        from l2l_cli.plan.cli import main as plan_main

        code = plan_main(rest)
    else:
        code = _fail(f"unknown command {cmd!r}; allowed: train, report, plan")
    sys.exit(code)


if __name__ == "__main__":
    main()
