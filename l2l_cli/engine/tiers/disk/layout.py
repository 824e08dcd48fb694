"""The disk tier's file sizes and names, without torch: what the config's rules need to know whether a
directory can hold a model's state (``l2l plan`` and validation import them; :mod:`.format` does the I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from l2l_cli.engine.optim import ADAM_FP32, ITEMSIZE, StateBuffer

if TYPE_CHECKING:
    from l2l_cli.models.base import ModelSpec

ALIGN = 4096  # O_DIRECT: buffers, offsets and lengths block-aligned
STATE = "wmv"  # the parts of a layer's state (a slot of a format-1 file holds them, in file order)
SPLIT = "hlmv"  # a format-2 slot: the master as bf16 hi and 16-bit lo planes, then the moments
COMMIT = "commit.json"
MOMENTS = "mv"  # the parts of a layer's state only its update reads: in an update buffer, not its cache slot
UPDATE_BUFFERS = 1  # update buffers (each one layer's m and v): the updates run one at a time, on one thread
SUB_ALIGN = 64  # each state buffer within a moment part starts on a cache line


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _sub(n: int) -> int:
    return -(-n // SUB_ALIGN) * SUB_ALIGN


# One buffer of a moment part: (short name, dtype, byte offset in the part, entries)
Piece = tuple[str, str, int, int]


def moment_layout(runs: Sequence[int], state: Sequence[StateBuffer] = ADAM_FP32) -> dict[str, list[Piece]]:
    """Where the optimizer's state of a layer sits in its two moment parts ``m`` and ``v`` (the file's and
    the update buffer's), for optimizer runs of ``runs`` elements: each :class:`StateBuffer` in the part of
    its moment (``StateBuffer.moment``), in the kind's order, each one the sum of its runs' entries and
    starting on a cache line. AdamW / LAMB: one FP32 buffer per part (``[m]``, ``[v]``: the bytes of formats
    1 and 2); 8-bit AdamW: ``[codes | absmax | small tensors' FP32]`` per moment (format 3)."""
    out: dict[str, list[Piece]] = {p: [] for p in MOMENTS}
    at = dict.fromkeys(MOMENTS, 0)
    for b in state:
        p = b.moment
        k = sum(b.numel(n) for n in runs)
        out[p].append((b.short, b.dtype, at[p], k))
        at[p] += _sub(k * b.itemsize)
    return out


def moment_bytes(pieces: dict[str, list[Piece]]) -> dict[str, int]:
    """Each moment part's bytes (block-aligned) for a :func:`moment_layout`."""
    return {
        p: aligned(max((off + k * ITEMSIZE[dt] for _, dt, off, k in xs), default=0))
        for p, xs in pieces.items()
    }


def estimated_moment_bytes(numel: int, state: Sequence[StateBuffer] = ADAM_FP32) -> dict[str, int]:
    """Each moment part's bytes for a layer of ``numel`` parameters counted as one tensor (what the planner
    and the free-space rule know without the layer's tensors): exact for FP32 moments; for 8-bit AdamW it
    leaves out the FP32 moments of the tensors under ``MIN_8BIT`` elements (biases, norms: ~0.1% of a
    model's parameters, 3 bytes each more)."""
    return moment_bytes(moment_layout([numel], state))


def layer_file_bytes(numel: int, split: bool = False, moments: dict[str, int] | None = None) -> int:
    """Bytes of one layer's file: the header and two slots of weights (FP32, or two 16-bit planes) and
    moments (``moments``: each moment part's bytes; default FP32, 24 bytes per parameter either way)."""
    parts = SPLIT if split else STATE
    mom = moments or {}
    return ALIGN + 2 * sum(mom.get(p, aligned(part_width(p) * numel)) for p in parts)


def part_width(part: str) -> int:
    """Bytes per parameter of a file part: 2 for the master's hi and lo planes, else 4 (FP32)."""
    return 2 if part in "hl" else 4


def layer_numels(spec: ModelSpec) -> list[int]:
    """Each layer's parameters, in order (embeddings, blocks, head): what its file and cache slot hold."""
    pre, block, post = spec.param_counts()
    return [pre, *[block] * spec.num_layers, post]


def pool_capacity(numels: list[int], grad_ram_layers: int, grad_ram_bytes: int) -> int:
    """How many layers' waiting gradients the tier keeps in RAM at once: ``eps.grad_ram_layers``, within
    ``eps.grad_ram_gb`` (counted in the largest layer's gradients) and the model's layers."""
    largest = aligned(4 * max(1, max(numels, default=1)))
    return max(0, min(grad_ram_layers, len(numels), grad_ram_bytes // largest))


def kept_grads_bytes(spec: ModelSpec, grad_ram_layers: int, grad_ram_bytes: int, clip_global: bool) -> int:
    """The most ``kept_grads.eps`` takes on disk: the gradients of speculative updates that wait for the
    global clipping verdict beyond the RAM pool (4 bytes per parameter of the layers that can be written
    there: all but the pool's, at worst the smallest; the file is sparse, this is its most); 0 without
    global clipping, or when the pool holds every layer's."""
    numels = layer_numels(spec)
    pool = pool_capacity(numels, grad_ram_layers, grad_ram_bytes)
    if not clip_global or pool >= len(numels):
        return 0
    return sum(sorted(aligned(4 * n) for n in numels)[pool:])


def disk_bytes(spec: ModelSpec, state: Sequence[StateBuffer] = ADAM_FP32) -> int:
    """What the disk tier needs on disk for ``spec``: two versions of the weights and the optimizer's
    ``state`` (24 bytes per parameter with FP32 moments; ~12.06 with 8-bit AdamW's,
    :func:`estimated_moment_bytes`)."""

    def one(n: int) -> int:
        return layer_file_bytes(n, moments=estimated_moment_bytes(n, state))

    pre, block, post = spec.param_counts()
    return one(pre) + spec.num_layers * one(block) + one(post)


SHARED_MIN = 2  # shared slots at least: one per thread that pins (the relay's, the EPS's), see cache_slots


def cache_slots(numels: list[int], k: int) -> list[tuple[int, int | None]]:
    """The host cache's slots for layers of ``numels`` elements and ``k`` = ``eps.host_cache_layers``: a
    list of (elements, owner), owner the one layer a *dedicated* slot holds, or None for a *shared* slot
    (any layer that fits). The rule cannot deadlock, and it takes no more bytes than ``k`` slots of the
    largest layer:

    - a *block* is the most common layer size (the transformer block; of sizes equally common, the
      largest). Each layer larger than a block (embeddings, an untied head) gets a dedicated slot of its
      own size; the others share ``max(k, SHARED_MIN)`` slots of a block's size (no more than there are
      such layers): as many as uniform slots would give the blocks, so the blocks' reads stay as they were
      (a layer stays cached from its backward to its update) and the large layers are never evicted.
    - Why no pin waits forever: a pin waits for a slot only while every slot it may take is pinned. A
      large layer's pin takes its own slot, which no other layer pins, so it waits only for that slot's
      read, device copies and write-back, which finish on their own. A shared slot is pinned by (a) the
      relay, one layer at a time, except the tied head, which holds the post layer while it pins the pre
      layer: a large layer (its own slot) or, if the pre layer is no larger than a block, a second shared
      slot; (b) the EPS thread, one layer at a time (an update in the backward pins the layer whose
      gradient pin it holds: no second slot); (c) gradient pins handed from the relay to the EPS's jobs,
      which release them without pinning another layer. So no holder of a shared slot waits for another
      shared slot except the relay's tied pin, at most one at a time; with ``SHARED_MIN`` = 2 shared slots
      a free one is always reached once (b) and (c) release theirs. Slots sized per layer without owners
      broke this: a block in the embeddings' slot starved the tied head's pin of the embeddings.
    - When the dedicated and shared slots would take more bytes than ``k`` slots of the largest layer
      (a large layer not much larger than a block), ``k`` uniform slots of the largest layer are used
      instead (any layer may take any slot: the same argument with one class of slot)."""
    n = len(numels)
    k = max(0, min(k, n))
    if not numels or k == 0:
        return []
    largest = max(numels)
    uniform: list[tuple[int, int | None]] = [(largest, None)] * k
    counts: dict[int, int] = {}
    for x in numels:
        counts[x] = counts.get(x, 0) + 1
    block = max(counts, key=lambda x: (counts[x], x))
    large = [(x, i) for i, x in enumerate(numels) if x > block]
    if not large:
        return uniform
    shared = min(max(k, SHARED_MIN), n - len(large))
    sized: list[tuple[int, int | None]] = [*((x, i) for x, i in large), *[(block, None)] * shared]
    if sum(aligned(4 * x) for x, _ in sized) >= sum(aligned(4 * x) for x, _ in uniform):
        return uniform
    return sized


def slot_bytes(numel: int, send_bytes: int = 4, split: bool = False) -> int:
    """Bytes of one cache slot for layers of at most ``numel`` elements: what the forward and backward read
    and write, the FP32 master and the gradient ([w | g], page-aligned), and under CMP (``send_bytes`` 2)
    the half send copy and the half gradient the device returns, under bf16 CMP (``split``) the master's
    lo plane. The moments are no part of it (:func:`update_buffer_bytes`)."""
    half = send_bytes * numel if send_bytes != 4 else 0
    return 2 * aligned(4 * numel) + 2 * half + (2 * numel if split else 0)


def update_buffer_bytes(numel: int, state: Sequence[StateBuffer] = ADAM_FP32) -> int:
    """Bytes of one update buffer for layers of at most ``numel`` elements: their moments [m | v] (FP32;
    or the optimizer's ``state``, :func:`estimated_moment_bytes`)."""
    return sum(estimated_moment_bytes(numel, state).values())


def cache_bytes(
    numels: list[int],
    k: int,
    send_bytes: int = 4,
    split: bool = False,
    state: Sequence[StateBuffer] = ADAM_FP32,
) -> int:
    """The host cache's bytes for layers of ``numels`` elements and ``k`` = ``eps.host_cache_layers``: the
    slots of :func:`cache_slots` (weights and gradient, :func:`slot_bytes`) and ``UPDATE_BUFFERS`` buffers
    of the largest slot's moments. The tier allocates exactly this with FP32 moments (with 8-bit AdamW's,
    within :func:`estimated_moment_bytes`); ``l2l plan`` predicts it with it."""
    slots = cache_slots(numels, k)
    if not slots:
        return 0
    largest = max(n for n, _ in slots)
    own = sum(slot_bytes(n, send_bytes, split) for n, _ in slots)
    return own + UPDATE_BUFFERS * update_buffer_bytes(largest, state)
