"""The disk tier's file sizes and names, without torch: what the config's rules need to know whether a
directory can hold a model's state (``l2l plan`` and validation import them; :mod:`.format` does the I/O)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from l2l_cli.models.base import ModelSpec

ALIGN = 4096  # O_DIRECT: buffers, offsets and lengths block-aligned
STATE = "wmv"  # the parts of a layer's state (a slot of a format-1 file holds them, in file order)
SPLIT = "hlmv"  # a format-2 slot: the master as bf16 hi and 16-bit lo planes, then the moments
COMMIT = "commit.json"


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layer_file_bytes(numel: int, split: bool = False) -> int:
    """Bytes of one layer's file: the header and two slots of weights (FP32, or two 16-bit planes) and
    moments: 24 bytes per parameter either way."""
    parts = SPLIT if split else STATE
    return ALIGN + 2 * sum(aligned(part_width(p) * numel) for p in parts)


def part_width(part: str) -> int:
    """Bytes per parameter of a file part: 2 for the master's hi and lo planes, else 4 (FP32)."""
    return 2 if part in "hl" else 4


def disk_bytes(spec: ModelSpec) -> int:
    """What the disk tier needs on disk for ``spec``: 24 bytes per parameter (two versions of w, m, v)."""
    pre, block, post = spec.param_counts()
    return layer_file_bytes(pre) + spec.num_layers * layer_file_bytes(block) + layer_file_bytes(post)
