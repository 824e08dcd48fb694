"""The stage plan: which layers each stage holds, which pipeline rank runs it, and the bubble the paper
predicts for it (layered-GA appendix C, §2.4 and §4). Pure arithmetic, shared with ``l2l plan``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Actions:
    """What one rank's schedule does in a training step besides compute: its chunks (a forward or a backward
    of one stage on one micro-batch: each a call into the schedule and autograd), the sends and receives
    it posts, and (L2L stages) the layer loads and gradient offloads of its relay."""

    chunks: int
    sends: int
    recvs: int
    loads: int = 0  # L2L stages: host->device layer loads and device->host gradient offloads

    @property
    def total(self) -> int:
        """Schedule actions, each costing ``hardware.pipe_action_us`` beyond its compute and bytes."""
        return self.chunks + self.sends + self.recvs

    @property
    def exchanges(self) -> float:
        """Messages out and in, paired: each pair one exchange (latency + bytes over the link)."""
        return (self.sends + self.recvs) / 2.0


class _StubStage:
    """What torch's schedule constructors read of a stage, enough to lay out its actions without a
    process group (``StagePlan.actions``)."""

    def __init__(self, index: int, num_stages: int, pipeline: int):
        self.stage_index, self.num_stages = index, num_stages
        self.group_size, self.group_rank = pipeline, index % pipeline
        self.is_first, self.is_last, self.has_backward = index == 0, index == num_stages - 1, True


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

    def actions(self, rank: int, num_ubatches: int, torch_schedule: str, many: bool) -> Actions:
        """Pipeline rank ``rank``'s actions in a training step, read off torch's own schedule
        (``torch_schedule``: the class name the runner builds; ``many``: whether it takes several stages):
        its compute actions, and the sends and receives its runtime posts (``pipeline_order_with_comms``;
        a single-stage schedule sends each forward on and each backward back, and receives the same)."""
        import torch.distributed.pipelining as pipelining  # ~1 s to import: only where a pipeline is planned

        S = self.num_stages
        stages = [_StubStage(s, S, self.pipeline) for s in self.stages_of(rank)]
        cls = getattr(pipelining, torch_schedule)
        sched = cls(stages if many else stages[0], num_ubatches, loss_fn=lambda out, target: out,
                    scale_grads=False)  # fmt: skip
        order = getattr(sched, "pipeline_order_with_comms", None) or sched.pipeline_order
        kinds = Counter(a.computation_type.name for a in order[rank] if a is not None)
        chunks = (
            kinds["FORWARD"] + kinds["FULL_BACKWARD"] + kinds["BACKWARD_INPUT"] + kinds["BACKWARD_WEIGHT"]
        )
        if "pipeline_order_with_comms" in vars(sched):
            return Actions(chunks, kinds["SEND_F"] + kinds["SEND_B"], kinds["RECV_F"] + kinds["RECV_B"])
        (s,) = self.stages_of(rank)  # one stage: forwards leave unless last, backwards unless first
        f, b = kinds["FORWARD"], kinds["FULL_BACKWARD"] + kinds["BACKWARD_INPUT"]
        sends = (f if s < S - 1 else 0) + (b if s > 0 else 0)
        recvs = (f if s > 0 else 0) + (b if s < S - 1 else 0)
        return Actions(chunks, sends, recvs)

    def l2l_actions(self, rank: int, num_ubatches: int) -> Actions:
        """The same for L2L stages (``l2l_stages.py``'s loops, breadth-first): every layer of the rank's
        stages runs each micro-batch forward and (recomputed) backward, a stage's input arrives per
        micro-batch and its output leaves per micro-batch, each way; the relay loads every layer twice
        (forward, backward) and offloads its gradient once."""
        n, S, chunks, sends, recvs, loads = num_ubatches, self.num_stages, 0, 0, 0, 0
        for s in self.stages_of(rank):
            layers = len(self.layers(s))
            chunks += 2 * n * layers
            loads += 3 * layers
            sends += n * ((s < S - 1) + (s > 0))
            recvs += n * ((s > 0) + (s < S - 1))
        return Actions(chunks, sends, recvs, loads)

    def bubble_with_costs(
        self, num_ubatches: int, ranks: list[tuple[float, Actions]], action_s: float, exchange_s: float,
        load_s: float = 0.0,
    ) -> float:  # fmt: skip
        """The pre-run bubble, a mean over the pipeline's ranks of 1 - compute / pipeline time. ``ranks``:
        each rank's compute seconds and its actions. A rank takes its compute times (1 + o) plus what its
        schedule costs beyond compute: each action (a chunk's call, a posted send or recv) ``action_s``
        (``hardware.pipe_action_us``, measured by running a schedule with no compute), each exchange
        ``exchange_s`` (latency and bytes over the link), and, for L2L stages, each relay load or offload
        ``load_s`` (a CPU's inline copies hide behind nothing). The slowest rank sets the pipeline's time;
        the others idle for the difference."""
        o = self.bubble_overhead(num_ubatches)
        t = max(
            c * (1.0 + o) + a.total * action_s + a.exchanges * exchange_s + a.loads * load_s for c, a in ranks
        )
        return sum(1.0 - c / t for c, _ in ranks) / len(ranks) if t > 0 else 0.0


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
