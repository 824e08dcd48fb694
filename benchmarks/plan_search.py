"""How fast ``l2l plan --scaling`` searches: the Figure-4 sweep (layered-GA §7: X[x] from 1e9 to 1e16
parameters, the fastest configuration of each method over all its parallelism mixes), in configurations
costed per second. The issue's bar: the whole sweep (>= 30 sizes) in under 10 s on 2 cores.

    .venv/bin/python benchmarks/plan_search.py [--points 36]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from l2l_cli.plan import candidates as C
from l2l_cli.plan import figures as F
from l2l_cli.plan import scaling as ga


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=36)
    args = ap.parse_args()
    xs = F.sizes(args.points)
    costed = 0
    real = C.evaluate

    def counting(*a, **kw):  # count the candidates the sweep costs
        nonlocal costed
        r = real(*a, **kw)
        costed += int(r["efficiency"].size)
        return r

    C.evaluate = counting
    t0 = time.perf_counter()
    rows = F.sweep(ga.Links(), xs)
    dt = time.perf_counter() - t0
    C.evaluate = real
    found = sum(f is not None for _, _, f in rows)
    print(f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"figure-4 sweep: {len(xs)} sizes x 3 methods x their mixes ({len(C.PAIRS)} pairs), {found} rows")
    print(f"{costed:,} configurations in {dt:.2f} s: {costed / dt:,.0f} configurations/s")


if __name__ == "__main__":
    main()
