"""The stage plan: which layers each stage holds, which pipeline rank runs it, and the bubble the paper
predicts for it (layered-GA appendix C, §2.4 and §4). Pure arithmetic, shared with ``l2l plan``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
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

    def orders(self, num_ubatches: int, torch_schedule: str, many: bool) -> list[list[Op]]:
        """Each pipeline rank's actions in a training step, in the order its runtime runs them, read off
        torch's own schedule (``torch_schedule``: the class name the runner builds; ``many``: whether it
        takes several stages): ``pipeline_order_with_comms`` where the schedule has one (chunks, sends,
        receives: the runtime posts each recv where it stands and waits for it at the chunk that reads it).
        A single-stage schedule runs torch's own loops (:func:`_single_stage`), whose order its IR does
        not say (``Schedule1F1B.pipeline_order`` is not the order its loop runs)."""
        import torch.distributed.pipelining as pipelining  # slow to import: only where a pipeline is planned

        S, n, out = self.num_stages, num_ubatches, []
        cls = getattr(pipelining, torch_schedule)
        kinds = {
            "FORWARD": "F",
            "FULL_BACKWARD": "B",
            "BACKWARD_INPUT": "B",
            "SEND_F": "SEND_F",
            "SEND_B": "SEND_B",
            "RECV_F": "RECV_F",
            "RECV_B": "RECV_B",
        }
        for rank in range(self.pipeline):
            stages = [_StubStage(s, S, self.pipeline) for s in self.stages_of(rank)]
            sched = cls(stages if many else stages[0], n, loss_fn=lambda out, target: out, scale_grads=False)
            if "pipeline_order_with_comms" not in vars(sched):  # one stage: torch's own loops
                (s,) = self.stages_of(rank)
                out.append(_single_stage(s, S, n, one_f_one_b=isinstance(sched, pipelining.Schedule1F1B)))
                continue
            ops: list[Op] = []
            for a in sched.pipeline_order_with_comms[rank]:
                k = kinds.get(a.computation_type.name) if a is not None else None
                if k is not None:  # not (un)shard or REDUCE_GRAD: no compute, no message
                    ops.append((k, a.stage_index, a.microbatch_index, -1))
            out.append(ops)
        return out

    def l2l_orders(self, num_ubatches: int) -> list[list[Op]]:
        """The same for L2L stages, from their own loops (``l2l_stages.py``): per stage, its sends of the
        stage before drained, its n recvs posted (as a gloo run posts them; NCCL's one ahead), then layer by
        layer a relay load and every micro-batch's chunk (the head's turn: forward and backward per
        micro-batch); backward in reverse, each layer's recompute and backward as one chunk, its gradient
        offloaded after the last micro-batch."""
        n, S, head, out = num_ubatches, self.num_stages, self.num_layers + 1, []
        for rank in range(self.pipeline):
            ops: list[Op] = []
            mine = self.stages_of(rank)
            for s in mine:
                ops.append(("WAIT_SENDS", s, -1, -1))
                ops += [("RECV_F", s, u, -1) for u in range(n)] if s > 0 else []
                body = [i for i in self.layers(s) if i != head]
                for k, i in enumerate(body):
                    ops.append(("LOAD", s, -1, i))
                    for u in range(n):
                        ops.append(("F", s, u, i))
                        ops += [("SEND_F", s, u, -1)] if k == len(body) - 1 and s < S - 1 else []
            if S - 1 in mine:
                ops.append(("LOAD", S - 1, -1, head))
                for u in range(n):
                    ops += [("F", S - 1, u, head), ("B", S - 1, u, head)]
                ops.append(("LOAD", S - 1, -1, head))  # its gradient offloaded
            for s in reversed(mine):
                ops.append(("WAIT_SENDS", s, -1, -1))
                ops += [("RECV_B", s, u, -1) for u in range(n)] if s < S - 1 else []
                body = [i for i in self.layers(s) if i != head]
                for k in reversed(range(len(body))):
                    ops.append(("LOAD", s, -1, body[k]))
                    for u in range(n):
                        ops.append(("B", s, u, body[k]))
                        ops += [("SEND_B", s, u, -1)] if k == 0 and s > 0 else []
                    ops.append(("LOAD", s, -1, body[k]))  # the gradient offloaded
            out.append(ops)
        return out

    def actions(self, rank: int, num_ubatches: int, torch_schedule: str, many: bool) -> Actions:
        """Pipeline rank ``rank``'s action counts in a training step (:meth:`orders`)."""
        return count(self.orders(num_ubatches, torch_schedule, many)[rank])

    def l2l_actions(self, rank: int, num_ubatches: int) -> Actions:
        """The same for L2L stages (:meth:`l2l_orders`): every layer of the rank's stages runs each
        micro-batch forward and (recomputed) backward; the relay loads every layer twice (forward,
        backward) and offloads its gradient once."""
        return count(self.l2l_orders(num_ubatches)[rank])

    def bubble_simulated(
        self,
        orders: list[list[Op]],
        cost: Callable[[int, Op], float],
        action_s: float,
        link_s: float,
        wake_s: float = 0.0,
    ) -> float:
        """The pre-run bubble (:func:`simulate`): the mean over the pipeline's ranks of 1 - compute / step
        time, as the runner measures it."""
        t, busy = simulate(orders, cost, action_s, link_s, wake_s)
        return sum(1.0 - c / t for c in busy) / len(busy) if t > 0 else 0.0


Op = tuple[
    str, int, int, int
]  # (kind, stage, micro-batch, layer): F, B, SEND_F/B, RECV_F/B, LOAD, WAIT_SENDS


def count(ops: list[Op]) -> Actions:
    """A rank's chunks, sends, recvs and relay moves."""
    c = Counter(op[0] for op in ops)
    return Actions(c["F"] + c["B"], c["SEND_F"] + c["SEND_B"], c["RECV_F"] + c["RECV_B"], c["LOAD"])


def _message(op: Op) -> tuple[str, int, int]:
    """The message a send or recv names: (direction, receiving stage, micro-batch)."""
    kind, s, u, _ = op
    if kind == "SEND_F":
        return ("F", s + 1, u)
    if kind == "SEND_B":
        return ("B", s - 1, u)
    return (kind[-1], s, u)


def _single_stage(s: int, S: int, n: int, one_f_one_b: bool) -> list[Op]:
    """Stage s's actions under torch's single-stage loops (``ScheduleGPipe`` / ``Schedule1F1B``
    ``_step_microbatches``): a chunk's recv posted just before it (the stage posts its own, gloo), its
    send after it; GPipe waits for its forward sends before the backward; 1F1B runs min(n, S - s) forwards,
    then a backward and a forward in turn, each waiting for the send posted just before it."""
    F = lambda u: ([("RECV_F", s, u, -1)] if s > 0 else []) + [("F", s, u, -1)]  # noqa: E731
    B = lambda u: ([("RECV_B", s, u, -1)] if s < S - 1 else []) + [("B", s, u, -1)]  # noqa: E731
    sf = lambda u: [("SEND_F", s, u, -1)] if s < S - 1 else []  # noqa: E731
    sb = lambda u: [("SEND_B", s, u, -1)] if s > 0 else []  # noqa: E731
    wait: list[Op] = [("WAIT_SENDS", s, -1, -1)]
    if not one_f_one_b:
        return (
            [x for u in range(n) for x in F(u) + sf(u)]
            + wait
            + [x for u in range(n) for x in B(u) + sb(u)]
            + wait
        )
    w, ops, f, b = min(n, S - s), [], 0, 0
    for i in range(w):  # warm-up: the last forward's send goes with the first backward's recv
        ops += F(f) + wait + (sf(f) if i < w - 1 else [])
        f += 1
    deferred = sf(f - 1)
    while True:
        ops += deferred + ([("RECV_B", s, b, -1)] if s < S - 1 else []) + wait + [("B", s, b, -1)]
        b += 1
        if f == n:
            break
        ops += sb(b - 1) + ([("RECV_F", s, f, -1)] if s > 0 else []) + wait + [("F", s, f, -1)]
        deferred, f = sf(f), f + 1
    ops += sb(b - 1)
    while b < n:  # cool-down
        ops += B(b) + wait + sb(b)
        b += 1
    return ops + wait


def simulate(
    orders: list[list[Op]],
    cost: Callable[[int, Op], float],
    action_s: float,
    link_s: float,
    wake_s: float = 0.0,
) -> tuple[float, list[float]]:
    """A training step's pipeline, each rank running its actions in order (``orders``, by pipeline rank):
    every chunk, send and recv costs ``action_s`` on its own rank (the schedule's call, posting, autograd
    entry), then a chunk lasts ``cost(rank, op)``, as does a relay move (``LOAD``); a chunk that reads a
    message starts no earlier than its arrival: both ends posted (gloo pairs a send with its recv) plus
    ``link_s`` (latency + bytes over the link). Where the transport shares the sender's core (gloo on a
    CPU), a message whose recv is posted while its sender computes moves only once the OS gives that core
    to the transport: ``wake_s`` later (``hardware.pipe_wake_us``, at most until the chunk ends). A sender
    still waiting for a message of its own counts as idle. ``WAIT_SENDS`` and the step's end wait for the
    rank's sends to arrive. Returns the step time (the last rank's end: the pipeline's window closes
    together) and each rank's compute. No queues or contention beyond that; O(actions)."""
    P = len(orders)
    clock, busy, pos = [0.0] * P, [0.0] * P, [0] * P
    sent: dict[tuple[str, int, int], tuple[float, int]] = {}  # message -> (posted, sending rank)
    posted: dict[tuple[str, int, int], float] = {}
    pending: list[list[tuple[str, int, int]]] = [[] for _ in range(P)]
    chunks: list[list[tuple[float, float]]] = [[] for _ in range(P)]  # each rank's compute intervals
    idle: set[tuple[str, int, int]] = set()  # messages whose sender was found blocked: idle, not computing
    reads = [{_message(op) for op in ops if op[0].startswith("RECV")} for ops in orders]

    def arrival(key: tuple[str, int, int]) -> float | None:
        if key not in sent or key not in posted:
            return None
        t, r = max(sent[key][0], posted[key]), sent[key][1]
        if wake_s > 0 and key not in idle:
            if clock[r] < t and pos[r] < len(orders[r]):
                return None  # the sender's timeline has not reached the moment yet
            for a, b in reversed(chunks[r]):
                if a <= t < b:
                    t = min(b, t + wake_s)
                    break
                if b <= t:
                    break
        return t + link_s

    def sends_done(r: int) -> float | None:
        times = [arrival(k) for k in pending[r]]
        return None if any(t is None for t in times) else max(times, default=clock[r])  # type: ignore[type-var]

    while any(pos[r] < len(orders[r]) for r in range(P)):
        moved = False
        for r in range(P):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                kind = op[0]
                if kind in ("F", "B"):
                    key = (kind, op[1], op[2])
                    start = clock[r] + action_s
                    if key in reads[r]:
                        a = arrival(key)
                        if a is None:
                            break  # its message is not posted yet (or its sender absent): another rank first
                        start = max(start, a)
                    d = cost(r, op)
                    chunks[r].append((start, start + d))
                    clock[r], busy[r] = start + d, busy[r] + d
                elif kind.startswith("SEND"):
                    clock[r] += action_s
                    sent[_message(op)] = (clock[r], r)
                    pending[r].append(_message(op))
                elif kind.startswith("RECV"):
                    clock[r] += action_s
                    posted[_message(op)] = clock[r]
                elif kind == "LOAD":
                    clock[r] += cost(r, op)
                elif kind == "WAIT_SENDS":
                    done = sends_done(r)
                    if done is None:
                        break
                    clock[r], pending[r] = max(clock[r], done), []
                pos[r] += 1
                moved = True
        if not moved:
            stuck = {k for k in sent.keys() & posted.keys() if k not in idle}
            if not stuck:
                raise ValueError("the pipeline's orders deadlock: a chunk waits for a message never sent")
            idle |= stuck  # every rank waits: the senders of these messages are blocked, so not computing
    ends = []
    for r in range(P):
        done = sends_done(r)
        ends.append(max(clock[r], done if done is not None else clock[r]))
    return max(ends, default=0.0), busy


def recvs_ahead(orders: list[list[Op]]) -> list[list[Op]]:
    """Each rank's actions with its receives all posted where its first stands, in their order (torch's
    schedules on gloo: ``stage.RecvsAhead``)."""
    out = []
    for ops in orders:
        recvs = [op for op in ops if op[0].startswith("RECV")]
        if not recvs:
            out.append(list(ops))
            continue
        at = next(k for k, op in enumerate(ops) if op[0].startswith("RECV"))
        rest = [op for op in ops if not op[0].startswith("RECV")]
        out.append(rest[:at] + recvs + rest[at:])
    return out


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


def split_by_weight(
    total: tuple[float, float], weights: dict[int, Any], num_ubatches: int
) -> dict[int, tuple[float, float]]:
    """One rank's forward and backward seconds over a step (``total``) as per-micro-batch chunks of each
    of its stages (or layers), in proportion to ``weights``: one weight each (their layers), or a
    (forward, backward) pair each (their measured forward and backward: the embeddings' backward, which
    writes a dense vocabulary x hidden gradient, is heavier against its forward than a block's)."""
    pairs = {k: (v, v) if isinstance(v, int | float) else (v[0], v[1]) for k, v in weights.items()}
    wf = sum(v[0] for v in pairs.values()) or 1.0
    wb = sum(v[1] for v in pairs.values()) or 1.0
    n = num_ubatches
    return {k: (total[0] * f / wf / n, total[1] * b / wb / n) for k, (f, b) in pairs.items()}


def table_cost(
    table: dict[int, tuple[float, float]], load_s: float | Callable[[int, int], float] = 0.0
) -> Callable[[int, Op], float]:
    """:func:`simulate`'s costs from per-micro-batch (forward, backward) chunk seconds by stage (torch's
    schedules) or by layer (L2L stages, whose ops name their layer); ``load_s`` per relay move, or
    ``load_s(rank, layer)``: a move's seconds by the layer it moves (the embeddings' many bytes)."""

    def cost(rank: int, op: Op) -> float:
        if op[0] == "LOAD":
            return load_s(rank, op[3]) if callable(load_s) else load_s
        return table[op[3] if op[3] >= 0 else op[1]][op[0] == "B"]

    return cost


def fit_action(
    orders: list[list[Op]],
    cost: Callable[[int, Op], float],
    link_s: float,
    step_s: float,
    hi: float = 0.01,
    wake_s: float = 0.0,
) -> float:
    """The per-action seconds at which :func:`simulate` of ``orders`` takes ``step_s`` (bisection: the
    step time grows with it); 0 where the step is no longer than its chunks and messages alone."""
    if simulate(orders, cost, 0.0, link_s, wake_s)[0] >= step_s:
        return 0.0
    lo = 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if simulate(orders, cost, mid, link_s, wake_s)[0] < step_s else (lo, mid)
    return (lo + hi) / 2


def layer_weights(plan: StagePlan, rank: int, flops: Callable[[int], float]) -> dict[int, float]:
    """L2L stages' chunks are per layer: each of the rank's layers its share of the rank's forward and of
    its recompute + backward by its forward FLOPs (``flops(layer)``; the runner times the rank's phases,
    not its layers). A cheap head matters: the turn runs it for every micro-batch between fill and drain."""
    return {i: flops(i) for s in plan.stages_of(rank) for i in plan.layers(s)}
