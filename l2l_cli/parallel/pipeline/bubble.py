"""summary.json's ``pipeline`` section: the layout, the bubble measured, and the bubble predicted, by the
paper (appendix C, messages free) and by the pre-run model (``plan.simulate``: each rank's schedule
actions in dependency order, on this run's measured compute, with what a message and an action cost).

Reporting only: what a message and an action cost (:class:`LinkCosts`) is settled where the runner is
built (``calibrate.link_costs``), and the ranks' times are gathered by the runner; nothing here talks to
another rank."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from l2l_cli.models.base import ModelSpec
from l2l_cli.parallel.pipeline.plan import (
    Op,
    StagePlan,
    count,
    exchange_seconds,
    layer_weights,
    split_by_weight,
    table_cost,
)
from l2l_cli.parallel.pipeline.settings import PipelineSettings


@dataclass(frozen=True)
class LinkCosts:
    """What the pre-run model charges beyond compute: one schedule action (``action_s``), a message's wait
    for its computing sender's core (``wake_s``) and an exchange between pipeline neighbours, and where
    they come from (``source``): ``measured`` on the pipeline's own group (``hardware=measure``: the
    exchange of the configured micro-batch's hidden state, ``exchange_measured_s``), or the ``hardware``
    preset's (the exchange its latency plus the bytes over its network)."""

    action_s: float
    wake_s: float
    source: str
    exchange_measured_s: float | None = None
    latency_s: float = 0.0
    bytes_per_s: float = 1.0
    exchange_from: str | None = None  # where the exchange comes from, when not ``source``
    action_from: str | None = None  # where the action comes from, when not ``source`` (``run``)
    # the terms the model cannot say for this run (term -> why): a preset's figures for another transport
    unsure: dict[str, str] = field(default_factory=dict)

    @classmethod
    def preset(cls, s: PipelineSettings, backend: str = "") -> LinkCosts:
        """The ``hardware`` preset's costs (``hardware.pipe_action_us``, ``pipe_wake_us``, its network);
        unsure where its figures describe another transport (``hardware.pipe_link``) than ``backend``."""
        unsure = {}
        if backend and backend != s.link:
            why = (
                f"hardware={s.preset}'s {{}} describes {s.link}, not this run's {backend} messages "
                "(hardware=measure times it here)"
            )
            unsure = {"action_s": why.format("pipe_action_us"), "wake_s": why.format("pipe_wake_us")}
        return cls(s.action_s, s.wake_s, "hardware", None, s.p2p_latency_s, s.p2p_bytes_per_s, unsure=unsure)

    def exchange_s(self, nbytes: float) -> float:
        """Seconds of one exchange of ``nbytes`` each way between pipeline neighbours."""
        if self.exchange_measured_s is not None:
            return self.exchange_measured_s
        return exchange_seconds(nbytes, self.latency_s, self.bytes_per_s)


def run_action(costs: LinkCosts, ranks: list[dict[str, Any]], orders: list[list[Op]]) -> LinkCosts:
    """``costs`` with the per-action cost this run measured: L2L stages on a CPU device, whose host clock is
    the device's and whose message waits block the host (gloo), so each rank's own work beyond compute,
    relay transfers and message waits (``overhead_s``) is known; over the schedule actions it ran (chunks,
    sends, receives), the ranks' sum over their sum. That is this run's loops' figure, where a preset's
    describes another transport and ``hardware=measure``'s probe times torch's schedule over stand-ins:
    it replaces theirs (``action_from: "run"``), and ``action_s`` leaves ``bubble_unsure``. The wake stays
    the preset's or the probe's: a late message shows as a wait, which is what the model predicts."""
    spent = sum(r.get("overhead_s") or 0.0 for r in ranks)
    actions = sum(count(orders[r["pipeline_rank"]]).total for r in ranks)
    if not actions or any(r.get("overhead_s") is None for r in ranks):
        return costs
    unsure = {k: v for k, v in costs.unsure.items() if k != "action_s"}
    return replace(costs, action_s=spent / actions, action_from="run", unsure=unsure)


TIMED = ("compute", "pipeline", "transfer", "forward", "message_wait")  # an L2L stage rank's, per step


class StageTimes:
    """An L2L stage rank's mean seconds per timed step: its compute (forward, recompute, backward), the
    pipeline's window, the relay's transfers, the forward, its host blocked on messages (a receive, its
    sends' completion, the window's close), and each layer's forward and recompute + backward (``layer``:
    how the rank's compute splits over its layers, heavy ends included). The rest of the window is the
    rank's own host work per schedule action (``overhead_s``: posting, the stash, the relay's bookkeeping,
    Python). Steady state: the first step (set-up, the first shape's warm-up) is left out, unless it is
    the only one."""

    def __init__(self) -> None:
        self.steps, self.totals = 0, dict.fromkeys(TIMED, 0.0)
        self.layers: dict[int, list[float]] = {}  # layer -> [forward, recompute + backward] seconds
        self._step: dict[int, list[float]] = {}  # this step's

    @contextmanager
    def layer(self, i: int, timer: Any) -> Iterator[None]:
        """Charge what ``timer``'s compute phases gain inside to layer i (forward; recompute + backward)."""
        before = dict(timer.totals)
        yield
        d = {k: timer.totals.get(k, 0.0) - before.get(k, 0.0) for k in ("forward", "recompute", "backward")}
        acc = self._step.setdefault(i, [0.0, 0.0])
        acc[0], acc[1] = acc[0] + d["forward"], acc[1] + d["recompute"] + d["backward"]

    def add(
        self, step_count: int, phases: dict[str, float], compute: float, window: float, blocked: float = 0.0
    ) -> None:
        """Step ``step_count + 1``'s ``phases`` (the runner's timer), its compute, its window and the host
        seconds it was blocked on messages in it."""
        step, self._step = self._step, {}
        if step_count > 0 or not self.steps:
            if step_count == 1:
                self.steps, self.totals, self.layers = 0, dict.fromkeys(TIMED, 0.0), {}
            self.steps += 1
            self.totals["transfer"] += phases.get("transfer", 0.0)
            self.totals["compute"] += compute
            self.totals["forward"] += phases.get("forward", 0.0)
            self.totals["pipeline"] += window
            self.totals["message_wait"] += blocked
            for i, (f, b) in step.items():
                acc = self.layers.setdefault(i, [0.0, 0.0])
                acc[0], acc[1] = acc[0] + f, acc[1] + b

    def means(self) -> dict[str, Any]:
        """``compute_s``, ``pipeline_s``, ``transfer_s``, ``forward_s``, ``message_wait_s`` and
        ``overhead_s``: the means over the timed steps; ``layer_chunks``: each layer's [forward, recompute
        + backward] seconds per step."""
        n = max(self.steps, 1)
        out: dict[str, Any] = {f"{k}_s": self.totals[k] / n for k in TIMED}
        busy = sum(out[f"{k}_s"] for k in ("compute", "transfer", "message_wait"))
        out["overhead_s"] = max(0.0, out["pipeline_s"] - busy)
        out["layer_chunks"] = {str(i): [f / n, b / n] for i, (f, b) in sorted(self.layers.items())}
        return out


def relay_cost(
    orders: list[list[Op]], ranks: list[dict[str, Any]], layer_bytes: Callable[[int], float]
) -> tuple[Callable[[int, int], float], float]:
    """L2L stages' relay moves by the layer they move: each pipeline rank's measured transfers over its
    moves in proportion to the moved layers' bytes (``layer_bytes``: a vocabulary-sized embedding moves
    many times a block's), the mean over the ranks' data-parallel copies. Returns ``cost(rank, layer)`` and
    the mean move (for the summary)."""
    per_byte: dict[int, list[float]] = {}
    moves = 0
    for r in ranks:
        p = r["pipeline_rank"]
        loads = [op[3] for op in orders[p] if op[0] == "LOAD"]
        moves += len(loads)
        total = sum(layer_bytes(i) for i in loads)
        per_byte.setdefault(p, []).append(r["transfer_s"] / total if total else 0.0)
    rate = {p: statistics.mean(v) for p, v in per_byte.items()}
    mean = sum(r["transfer_s"] for r in ranks) / moves if moves else 0.0
    return (lambda rank, i: rate.get(rank, 0.0) * layer_bytes(i)), mean


def layer_flops(spec: ModelSpec, i: int, seq: int) -> float:
    """Forward FLOPs of model layer i on one sample of ``seq`` tokens: how an L2L stage rank's measured
    compute splits over its layers (the embeddings' lookup and sums: ~seq·hidden)."""
    if i == 0:
        return 2.0 * seq * spec.hidden_size
    return spec.head_flops(seq) if i == spec.num_layers + 1 else spec.block_flops(seq)


def layer_params(spec: ModelSpec, i: int) -> int:
    """Parameters of model layer i: what a relay move of it carries (a vocabulary-sized embedding or LM
    head many times a block's)."""
    pre, block, post = spec.param_counts()
    return pre if i == 0 else post if i == spec.num_layers + 1 else block


def layer_chunk_weights(
    plan: StagePlan, ranks: list[dict[str, Any]], flops: Callable[[int], float]
) -> Callable[[int], dict[int, Any]]:
    """L2L stages: how a pipeline rank's compute splits over its layers: each layer's measured [forward,
    recompute + backward] (``layer_chunks``, the mean over the rank's data-parallel copies), so the ends'
    weight is what they cost (the embeddings' backward writes a dense vocabulary x hidden gradient: few
    FLOPs, many bytes); a layer without times by its forward FLOPs (``flops(layer)``)."""
    times: dict[int, list[list[float]]] = {}
    for r in ranks:
        for k, v in (r.get("layer_chunks") or {}).items():
            times.setdefault(int(k), []).append(v)

    def weights(p: int) -> dict[int, Any]:
        mine = [i for s in plan.stages_of(p) for i in plan.layers(s)]
        if not all(i in times for i in mine):
            return layer_weights(plan, p, flops)
        return {i: tuple(statistics.mean(v[k] for v in times[i]) for k in (0, 1)) for i in mine}

    return weights


def bubble_section(
    plan: StagePlan,
    n: int,
    ranks: list[dict[str, Any]],
    orders: list[list[Op]],
    weights: Callable[[int], dict[int, float]],
    costs: LinkCosts,
    nbytes: float,
    load_s: float | Callable[[int, int], float] = 0.0,
    move_s: float = 0.0,
) -> dict[str, Any]:
    """The predicted bubbles: the paper's (messages free), and the pre-run model's: the dependency-ordered
    simulation (``plan.simulate``) of each pipeline rank's actions (``orders``, read off the schedule),
    its chunks lasting the rank's measured forward and backward seconds split over its stages (or layers)
    by ``weights(pipeline rank)``, each action, message wake and exchange (of ``nbytes``) as ``costs``
    say, and ``load_s`` per relay move or ``load_s(rank, layer)`` (L2L stages; ``move_s``: their mean).
    ``bubble_unsure``: the terms the model cannot say for this run, and why (``hardware=measure``)."""
    by: dict[int, list[dict[str, Any]]] = {}
    for r in ranks:
        if r.get("compute_s"):
            by.setdefault(r["pipeline_rank"], []).append(r)
    table: dict[int, tuple[float, float]] = {}
    for p, rs in by.items():  # data-parallel copies of a pipeline rank: their mean
        fwd = statistics.mean(r.get("forward_s", r["compute_s"] / 3) for r in rs)
        table |= split_by_weight((fwd, statistics.mean(r["compute_s"] for r in rs) - fwd), weights(p), n)
    simulated = len(by) == plan.pipeline
    exchange_s = costs.exchange_s(nbytes)
    if simulated:
        cost = table_cost(table, load_s)
        model = plan.bubble_simulated(orders, cost, costs.action_s, exchange_s, costs.wake_s)
    else:
        model = plan.bubble_fraction(n)
    actions = [count(o) for o in orders]
    return {
        "bubble_predicted": model,
        "bubble_predicted_from": "simulated schedule" if simulated else "paper",
        "bubble_predicted_paper": plan.bubble_fraction(n),
        "bubble_overhead_predicted": plan.bubble_overhead(n),
        "messages_per_rank": plan.messages_per_rank(n),
        "message_bytes": nbytes,
        "exchange_s": exchange_s,
        "exchange_from": costs.exchange_from or costs.source,
        "actions_per_rank": [a.total for a in actions],
        "action_s": costs.action_s,
        "action_from": costs.action_from or costs.source,
        "wake_s": costs.wake_s,
        "chunks_per_rank": [a.chunks for a in actions],
        "relay_moves_per_rank": [a.loads for a in actions],
        "relay_move_s": move_s if callable(load_s) else load_s,
        "bubble_unsure": dict(costs.unsure),
    }


def pipeline_section(
    s: PipelineSettings,
    plan: StagePlan,
    n: int,
    runs: dict[str, Any],
    own: dict[str, Any],
    ranks: list[dict[str, Any]],
    bubble: dict[str, Any],
) -> dict[str, Any]:
    """The whole section: the layout (``runs``: ``torch_schedule`` and ``stage_mode``; ``n``
    micro-batches), the runner's ``own`` fields, the bubble measured (the mean over the ranks of
    1 - compute / pipeline time) and predicted (:func:`bubble_section`), and every rank's times."""
    bubbles = [r["bubble"] for r in ranks if r["bubble"] is not None]
    return {
        "pipeline": s.pipeline,
        "data_parallel": len(ranks) // s.pipeline,
        "placement": s.placement,
        "schedule": s.schedule,
        "torch_schedule": runs["torch_schedule"],
        "stage_mode": runs["stage_mode"],
        "num_stages": plan.num_stages,
        "layers_per_stage": plan.block_size,
        "stages_per_rank": plan.stages_per_rank,
        "num_ubatches": n,
        **own,
        "bubble_measured": sum(bubbles) / len(bubbles) if bubbles else None,
        **bubble,
        "ranks": ranks,
    }
