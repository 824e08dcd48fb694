"""A benchmark's child processes as the kernel counts them: RssAnon (anonymous memory, not the page cache)
of a process and all its descendants, read from /proc without importing torch in the parent."""

from __future__ import annotations

import re
from pathlib import Path


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
