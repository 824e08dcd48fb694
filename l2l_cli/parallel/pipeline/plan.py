"""The stage plan: which layers each stage holds, which pipeline rank runs it, and the bubble the paper
predicts for it (layered-GA appendix C, §2.4 and §4). Pure arithmetic, shared with ``l2l plan``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StagePlan:
    """Which layers each stage holds and which pipeline rank runs it. Layer indices are the models':
    0 = embeddings, 1..N = transformer blocks, N+1 = head."""

    num_layers: int  # N transformer blocks
    pipeline: int  # P
    placement: str
    layers_per_stage: int

    @property
    def block_size(self) -> int:
        """Transformer layers per stage (contiguous: the rank's L/P)."""
        return self.layers_per_stage if self.placement == "modular" else self.num_layers // self.pipeline

    @property
    def num_stages(self) -> int:
        return self.num_layers // self.block_size

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pipeline

    def layers(self, s: int) -> list[int]:
        b = self.block_size
        out = list(range(s * b + 1, (s + 1) * b + 1))
        if s == 0:
            out.insert(0, 0)  # the embeddings go with the first block
        if s == self.num_stages - 1:
            out.append(self.num_layers + 1)  # the head with the last
        return out

    def rank_of(self, s: int) -> int:
        """Modular: stage s on rank s mod P; contiguous has one stage per rank (s)."""
        return s % self.pipeline

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank_of(s) == rank]

    def bubble_overhead(self, num_ubatches: int) -> float:
        """Appendix C / §2.4: the bubble lengthens a step by (P-1)/n_mu of its compute; §4: the modular
        pipeline divides that by d_l/n_l, the stages each rank holds (interleaved 1F1B alike)."""
        return (self.pipeline - 1) / (num_ubatches * self.stages_per_rank)

    def bubble_fraction(self, num_ubatches: int) -> float:
        """The paper's predicted share of a step's pipeline time a rank spends not computing: o / (1 + o),
        messages free (they overlap compute)."""
        o = self.bubble_overhead(num_ubatches)
        return o / (1.0 + o)

    def messages_per_rank(self, num_ubatches: int) -> float:
        """Exchanges per rank and training step: every micro-batch's hidden state crosses the S-1 stage
        boundaries forward and its gradient back, 2(S-1)·n_mu messages spread over the P ranks, each rank
        sending as many as it receives. The modular placement sends L/P times more than the contiguous."""
        return 2 * (self.num_stages - 1) * num_ubatches / self.pipeline

    def bubble_with_messages(
        self, num_ubatches: int, compute_s: float, exchange_s: float, schedule_s: float | None = None
    ) -> float:
        """The bubble counting what the messages cost: a step's pipeline time is the rank's compute
        times (1 + o) plus its exchanges (one message out, one in: ``exchange_s``), which nothing hides
        where ranks copy messages on their own cores (gloo on CPU) and NCCL hides only in part.
        ``schedule_s``, where measured (``hardware=measure``): what the schedule itself costs a step
        beyond compute x (1 + o), timed by running it with stand-in compute (its messages, the waits they
        cause and its per-action work: posting sends and recvs, bookkeeping), in place of the count."""
        t = compute_s * (1.0 + self.bubble_overhead(num_ubatches))
        if schedule_s is None:
            t += self.messages_per_rank(num_ubatches) * exchange_s
        else:
            t += schedule_s
        return (t - compute_s) / t if t > 0 else 0.0


def exchange_seconds(nbytes: float, latency_s: float, bytes_per_s: float) -> float:
    """One exchange between pipeline neighbours: a message of ``nbytes`` out and one in (``bytes_per_s``:
    input + output, as ``hardware.network_gbps``), after the link's latency."""
    return latency_s + 2.0 * nbytes / bytes_per_s


def hidden_bytes(rows: int, seq: int, hidden: int) -> float:
    """One micro-batch's hidden state (or its gradient) between stages: FP32 on the wire."""
    return 4.0 * rows * seq * hidden


def plan_of(cfg: Any, num_layers: int) -> StagePlan:
    d = cfg.dist
    return StagePlan(num_layers, d.pipeline, d.placement, d.layers_per_stage)
