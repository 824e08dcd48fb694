"""``python -m l2l_cli ARGS`` for the tests, forked from one interpreter that has already imported torch,
transformers and the package: each command is still a process of its own (its own pid, cwd, environment,
stdout and stderr, exit code), started as ``python -m l2l_cli`` starts (``runpy``, ``__main__``), and
ended as an interpreter ends (non-daemon threads joined, ``atexit`` handlers run, streams flushed), but
without paying the imports again (seconds per command on two cores).

    python -m tests.cliserver        (started by ``tests.util.l2l``; one request at a time)

Requests arrive as JSON lines on stdin ({"argv", "cwd", "env", "out", "err"}, and "script" for ``python
SCRIPT ARGS``: a repository example or benchmark, which imports what the CLI does); for each the server
replies with a line {"pid": N} once the command has started, then {"returncode": N} (negative: killed by
that signal) once it has ended. Like ``tests/forkrun.py``, the server only imports: no torch op runs before a
fork (composing the default config is not one). Commands whose environment changes what a module reads at
import (``env=`` in ``tests.util.l2l``) run in a fresh interpreter instead.
"""

from __future__ import annotations

import json
import os
import sys

# what `l2l train|eval|predict|generate|export|report|plan` import on their way (the server pays them once)
PRELOAD = [
    "l2l_cli.cli",
    "l2l_cli.compose",
    "l2l_cli.preflight",
    "l2l_cli.launch",
    "l2l_cli.train",
    "l2l_cli.checkpoint",
    "l2l_cli.session",
    "l2l_cli.data.metrics",
    "l2l_cli.evaluate",
    "l2l_cli.generate",
    "l2l_cli.export",
    "l2l_cli.report",
    "l2l_cli.plan.cli",
    "l2l_cli.engine.tiers.disk.format",
    "transformers.models.bert.modeling_bert",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "torch.utils.tensorboard",
]


# variables the package reads at import into a module's attribute (the write faults of l2l_cli.problems and
# the disk EPS's crash points), which the child sets again from the command's environment: a command given
# only these is forked from the server too (``tests.util.SERVER_ENV``)
FAULTS = {
    "L2L_FAULT_ENOSPC": ("l2l_cli.problems", "_FAULT"),
    "L2L_FAULT_EIO": ("l2l_cli.problems", "_FAULT_EIO"),
    "L2L_EPS_CRASH": ("l2l_cli.engine.tiers.disk.format", "_CRASH"),
}


def _read_faults() -> None:
    """What the package read at import from the variables of :data:`FAULTS`, read again from the command's
    environment (as its modules would have read it, imported in a fresh interpreter)."""
    import importlib

    for var, (module, attr) in FAULTS.items():
        setattr(importlib.import_module(module), attr, os.environ.get(var, ""))


def _child(req: dict, ctl: tuple[int, int]) -> None:
    """Become ``python -m l2l_cli *argv`` in ``cwd`` with ``env``; never returns."""
    import atexit
    import io
    import runpy
    import threading
    import traceback

    code: object = 1
    try:
        for fd in ctl:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req["out"]), (2, req["err"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
        )
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        _read_faults()
        script = req.get("script")
        sys.argv = [script or "-m", *req["argv"]]
        sys.path[0] = os.path.dirname(script) if script else req["cwd"]  # as `python SCRIPT` / `python -m`
        try:
            if script:
                runpy.run_path(script, run_name="__main__")
            else:
                runpy.run_module("l2l_cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code
        except BaseException:
            traceback.print_exc()
            code = 1
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter does at exit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        traceback.print_exc()
        code = 1
    os._exit(int(code) & 0xFF)  # type: ignore[call-overload]


def main() -> None:
    import importlib
    import logging

    from l2l_cli.cli import QUIET_LOGGERS

    for name in QUIET_LOGGERS:  # as `l2l` does before its imports
        logging.getLogger(name).setLevel(logging.ERROR)
    for name in PRELOAD:
        importlib.import_module(name)
    from l2l_cli.compose import compose

    compose([])  # the schema, the recipes and the default config, registered and composed once
    ctl_in, ctl_out = os.dup(0), os.dup(1)  # the control channel; fds 0-2 are left to the children
    requests = os.fdopen(ctl_in, "r")
    replies = os.fdopen(ctl_out, "w", buffering=1)
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in requests:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req, (ctl_in, ctl_out))
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        replies.write(json.dumps({"returncode": rc}) + "\n")


if __name__ == "__main__":
    main()
