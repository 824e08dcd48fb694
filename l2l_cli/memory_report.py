"""memory.json: what a run held, read once at its end from the accelerator's meter and the runner."""

from __future__ import annotations

import resource

from l2l_cli.engine.device import Accelerator
from l2l_cli.modes import Runner
from l2l_cli.runfiles import DeviceMemory, HostMemory, MemoryReport, Transfer


def memory_report(acc: Accelerator, runner: Runner | None) -> MemoryReport:
    """The device meter's peak and parts, the host tier's bytes (``runner.host_parts()``; none before a
    runner was built), the process's peak RSS, and the bytes over the link."""
    host_parts = runner.host_parts() if runner is not None else {}
    dev = acc.meter.report()
    budget = acc.budget_bytes  # device=sim's, or device.memory_gb's
    return MemoryReport(
        device=DeviceMemory(dev["peak_bytes"], dev["method"], dev["parts"], acc.kind, budget, acc.meter.note),
        host=HostMemory(
            sum(host_parts.values()),
            host_parts,
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        ),
        transfer=Transfer(**acc.memory_stats()),
    )
