"""Which blocks keep their graph and which recompute (``mode.recompute``, ``mode.keep_layers``): the
policies, the settings and :func:`choose`, without torch, so that the config's rules and ``l2l plan`` read
them without it. Measuring a block and running it selectively is :mod:`l2l_cli.engine.recompute`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

POLICIES = ("full", "selective", "none", "auto")  # mode.recompute
GRAPH_POLICIES = ("selective", "none")  # a block whose forward keeps an autograd graph until its backward
DEFAULT_CPU_SHARE = 0.5  # mode.activation_budget_gb unset on a CPU device: this share of the available RAM
MARGIN = 0.9  # auto plans within this share of the free room (allocator slack, the head's working set)
SELECTIVE_SHARE = 0.2  # the planner's guess: the share of a block's recompute selective still runs


@dataclass(frozen=True)
class RecomputeSettings:
    """``mode.recompute`` / ``mode.keep_layers`` / ``mode.activation_budget_gb`` as the runner reads them."""

    policy: str = "full"  # full | selective | none | auto
    keep_layers: int | str | None = None  # an int, "auto", or None (0; auto with policy auto)
    budget_bytes: float | None = None  # CPU device: the activation budget (None: a share of the free RAM)
    seq_len: int = 0  # the longest micro-batch (task.max_seq_len): what the memory model measures

    @property
    def trivial(self) -> bool:
        """Today's L2L, nothing to measure: every block recomputed in full."""
        return self.policy == "full" and not self.keep_layers


@dataclass(frozen=True)
class LayerBytes:
    """Device bytes one block holds from forward to backward for one micro-batch, per policy."""

    full: int  # its input (the stash)
    selective: int  # the input and the policy's saved matmul outputs
    none: int  # everything autograd saves (the input included)
    # what the embeddings' graph saves: kept only with every block (nothing is recomputed then)
    pre: int = 0


@dataclass(frozen=True)
class RecomputePlan:
    """What the runner does: the last ``kept`` blocks keep their graph, the others run ``policy``."""

    policy: str  # full | selective: the blocks not kept
    kept: int
    depth: int
    saved_bytes: int = 0  # predicted bytes the kept and selective blocks hold for backward, per step
    room_bytes: float | None = None  # the device room auto planned in (None: nothing was auto)
    # nothing recomputed and room left for it: the head keeps its training graph too (a language model's
    # loss chunks are not run twice; ModelSpec.keep_head_graph)
    head_kept: bool = False

    @property
    def every_layer_kept(self) -> bool:
        """Every block keeps its graph, and so do the embeddings below them: nothing is recomputed."""
        return self.kept == self.depth > 0

    def graph(self, block: int) -> str | None:
        """What layer ``block`` does: a block (1..depth) "none" (kept), "selective", or None (stash +
        recompute); the embeddings (0) "none" when every block is kept, else None (recomputed from the
        token ids, as their backward comes last and no block below needs their graph earlier)."""
        if block == 0 and self.every_layer_kept:
            return "none"
        if block < 1 or block > self.depth:
            return None
        if block > self.depth - self.kept:
            return "none"
        return "selective" if self.policy == "selective" else None

    def section(self) -> dict[str, Any]:
        """summary.json's ``recompute`` section."""
        return {
            "policy": "none" if self.every_layer_kept else self.policy,
            "kept_layers": self.kept,
            "saved_bytes": self.saved_bytes,
            "room_bytes": self.room_bytes,
            "head_kept": self.head_kept,
        }

    def describe(self) -> str:
        """One line for the progress header."""
        if self.every_layer_kept:
            return "recompute none (every layer kept)"
        kept = f", last {self.kept} of {self.depth} layers kept" if self.kept else ""
        return f"recompute {self.policy}{kept}"


def choose(
    settings: RecomputeSettings,
    depth: int,
    per_ubatch: LayerBytes,
    num_ubatches: int,
    room: float | None,
    *,
    stash_on_device: bool,
) -> RecomputePlan:
    """The plan: ``room`` is the device bytes left once ``full``'s needs are met (None: unknown, auto
    keeps nothing). A kept or selective block costs its saved bytes for every micro-batch, less the
    input the device stash would have held anyway; with every block kept, the embeddings' graph too
    (``per_ubatch.pre``). ``auto`` prefers (1) every block kept, (2) selective
    with as many kept as fit, (3) full with as many kept as fit; a fixed ``keep_layers`` is honoured."""
    n = num_ubatches
    stash = n * per_ubatch.full if stash_on_device else 0
    cost = {"none": n * per_ubatch.none - stash, "selective": n * per_ubatch.selective - stash, "full": 0}
    held = {"none": n * per_ubatch.none, "selective": n * per_ubatch.selective, "full": 0}
    spare = float("-inf") if room is None else room

    def pre(k: int) -> int:  # the embeddings' graph, kept with every block
        return n * per_ubatch.pre if k == depth else 0

    def fits(policy: str, k: int) -> bool:
        return k * cost["none"] + (depth - k) * cost[policy] + pre(k) <= spare

    def most(policy: str) -> int:
        return max((k for k in range(depth + 1) if fits(policy, k)), default=0)

    policy, keep = settings.policy, settings.keep_layers
    if policy == "none":
        policy, kept = "full", depth
    elif policy == "auto":
        if isinstance(keep, int):
            kept = min(keep, depth)
            policy = "selective" if fits("selective", kept) and kept < depth else "full"
        elif fits("full", depth):
            policy, kept = "full", depth
        elif fits("selective", 0):
            policy, kept = "selective", most("selective")
        else:
            policy, kept = "full", most("full")
    else:
        kept = most(policy) if keep == "auto" else min(int(keep or 0), depth)
    saved = kept * held["none"] + (depth - kept) * held[policy] + pre(kept)
    return RecomputePlan(
        policy, kept, depth, int(saved), room if settings.policy == "auto" or keep == "auto" else None
    )


def default_cpu_budget() -> float:
    """A CPU device's activation budget when ``mode.activation_budget_gb`` is unset: a share of the RAM
    available now (the EPS's state is already allocated, so what is left is the activations' to share)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return DEFAULT_CPU_SHARE * info.get("MemAvailable", info.get("MemFree", 0))
    except OSError:
        return 0.0
