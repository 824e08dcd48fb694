"""The disk tier (``eps.tier=disk``): one file per layer, a few layers cached in RAM, read ahead and written
behind the compute, committed after every step. Registered here; :mod:`.tier` is the place to start.

- :mod:`.format`: the on-disk format and raw aligned I/O (``LayerFile``, ``disk_bytes``, ``measure_disk``)
- :mod:`.store`: the layer files and which slot of each holds what
- :mod:`.cache`: the host cache's slots and which one to reuse; :mod:`.update_buffer`: a layer's optimizer
  state while it is updated (FP32 moments, or 8-bit AdamW's codes and absmaxes: the file's moment parts)
- :mod:`.readahead`: the plan of which layers come next; :mod:`.reader`: the thread that reads them
- :mod:`.writeback`: the writer thread: write-back, parked gradients, the commit record
- :mod:`.layer`: a layer as the EPS sees it; :mod:`.tier`: the tier, wiring the parts together
- :mod:`.rules`: its config rules
"""

from typing import Any

from l2l_cli.engine.tiers.base import TierKind, register_tier
from l2l_cli.engine.tiers.disk import rules
from l2l_cli.engine.tiers.disk.layout import COMMIT, disk_bytes, layer_file_bytes
from l2l_cli.engine.tiers.disk.rules import check_eps_path, eps_dir_guess


def _build(*args: Any) -> Any:
    """The tier, built when a run starts (its modules import torch; the registration and rules do not)."""
    from l2l_cli.engine.tiers.disk.tier import DiskTier

    return DiskTier(*args)


DISK = register_tier(
    TierKind(
        "disk",
        _build,
        dir_name=rules.DIR,
        eps_modes_only=rules.EPS_MODES_ONLY,
        check_keys=rules.check_keys,
        validate=rules.validate,
        check_space=rules.check_space,
        check_start=rules.check_start,
        committed=rules.committed,
    )
)


def __getattr__(name: str) -> Any:
    """The I/O and the tier's classes, imported on first use (they need torch; ``l2l plan`` does not).
    Each is imported from its module by name: ``from <this package> import <module>`` here would ask this
    very function for the module first, and recurse."""
    if name == "measure_disk":
        from l2l_cli.engine.tiers.disk.format import measure_disk

        return measure_disk
    if name == "probe_direct":
        from l2l_cli.engine.tiers.disk.format import probe_direct

        return probe_direct
    if name == "DiskLayer":
        from l2l_cli.engine.tiers.disk.layer import DiskLayer

        return DiskLayer
    if name == "DiskTier":
        from l2l_cli.engine.tiers.disk.tier import DiskTier

        return DiskTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "COMMIT",
    "DISK",
    "DiskLayer",
    "DiskTier",
    "check_eps_path",
    "disk_bytes",
    "eps_dir_guess",
    "layer_file_bytes",
    "measure_disk",
    "probe_direct",
]
