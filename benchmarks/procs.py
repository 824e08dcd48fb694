"""A benchmark's child processes as the kernel counts them: RssAnon (anonymous memory, not the page cache)
of a process and all its descendants, read from /proc without importing torch in the parent."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def rss_anon(pid: int) -> int:
    """RssAnon of a process and its children, bytes (0 for one that has exited)."""
    total = 0
    for p in [pid, *children(pid)]:
        try:
            m = re.search(r"RssAnon:\s+(\d+) kB", Path(f"/proc/{p}/status").read_text())
        except OSError:
            continue
        total += int(m.group(1)) * 1024 if m else 0
    return total


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (children first, then theirs)."""
    try:
        kids = [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return kids + [k for c in kids for k in children(c)]


def l2l_polled(*args: str) -> int:
    """``python -m l2l_cli *args`` with this checkout first on the path, its RssAnon (children included)
    polled every 0.2 s; the peak, bytes. A failure ends the benchmark with the command's stderr tail."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "l2l_cli", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, rss_anon(proc.pid))
        time.sleep(0.2)
    if proc.returncode:
        tail = proc.stderr.read()[-2000:] if proc.stderr else ""
        raise SystemExit(f"l2l {args[0]} failed ({proc.returncode}): {tail}")
    return peak
