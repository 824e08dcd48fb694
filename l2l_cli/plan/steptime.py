"""Seconds per optimizer step by phase: the papers' step-time model (l2l-v1 eqs. 5-7, l2l-v2 eq. 4) applied
layer by layer to the schedule the runners execute.

The embeddings and the head are layers too, a copy hides only behind the compute it overlaps (the relay's
prefetch window, the other link direction), and the L2L-p update of layer l+1 hides behind the recompute +
backward of layer l, except the trailing one. A pipeline's step is simulated from its schedule's actions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from l2l_cli.engine.recompute_plan import SELECTIVE_SHARE
from l2l_cli.plan.diskqueue import Disk, Use, exposed_wait
from l2l_cli.plan.hardware import Rates
from l2l_cli.plan.knobs import Setup, stage_plan
from l2l_cli.plan.peft import LORA_BACKWARD_SHARE, READ_AHEAD
from l2l_cli.plan.shapes import ModelShape, device_weight_bytes
from l2l_cli.plan.times import LayerTimes
from l2l_cli.runfiles import PHASES


@dataclass
class Phase:
    exposed: float = 0.0
    hidden: float = 0.0

    def add(self, total: float, exposed: float) -> None:
        """``total`` seconds of work of which ``exposed`` lengthen the step (more than ``total`` when
        the work also slows what it overlaps: L2L-p's update on cores shared with compute)."""
        exposed = max(exposed, 0.0)
        self.exposed += exposed
        self.hidden += max(total - exposed, 0.0)


def step_time(shape: ModelShape, s: Setup, rates: Rates) -> dict[str, Phase]:
    """Seconds per optimizer step by phase: ``exposed`` is on the critical path, ``hidden`` overlapped."""
    if s.pipeline > 1:
        return pipeline_time(shape, s, rates)
    ph = {p: Phase() for p in PHASES}
    N, u = shape.num_layers, s.num_ubatches
    lt = rates.layer_times(shape, s.seq, s.ubatch)
    pe = shape.peft
    P = pe.trainable if pe else shape.total_params  # the parameters updated (and reduced)
    # forward: pre, blocks, post (the head's forward runs with autograd, at the turn in L2L)
    if not s.l2l:
        if pe:
            lt = lora_times(lt)
        # l2l-v1 eq. 5: N·u·(Ft + Bt) + Ot
        fwd = u * (lt.pre_fwd_grad + N * lt.block_fwd_grad + lt.post_fwd_grad)
        bwd = u * (lt.pre_bwd + N * lt.block_bwd + lt.post_bwd)
        ph["forward"].add(fwd, fwd)
        ph["backward"].add(bwd, bwd)
        t = rates.device_update_time(P)
        ph["optimizer"].add(t, t)
        _reduce(ph, s, rates, P, hide=bwd / u)
        return ph

    # l2l-v1 eqs. 6 / 7, per layer: forward, then recompute + backward, relayed from the EPS
    if pe:
        lt = lora_times(lt)
    fwd_c = [u * lt.pre_fwd] + [u * lt.block_fwd] * N + [u * lt.post_fwd_grad]
    # the recompute the run does: none for a block that keeps its graph (the last ``recompute_kept``), the
    # elementwise share for a selective one (mode.recompute, resolved by make_plan); the embeddings are
    # recomputed unless every block is kept (RecomputePlan.graph: then they keep theirs too)
    kept = min(N, s.recompute_kept)
    rec_block = u * lt.block_fwd_grad * (SELECTIVE_SHARE if s.recompute_selective else 1.0)
    rec_pre = 0.0 if kept == N else u * lt.pre_fwd_grad
    rec_c = [rec_pre] + [rec_block] * (N - kept) + [0.0] * kept + [0.0]
    bwd_c = [u * lt.pre_bwd] + [u * lt.block_bwd] * N + [u * lt.post_bwd]
    for name, c in (("forward", fwd_c), ("recompute", rec_c), ("backward", bwd_c)):
        ph[name].add(sum(c), sum(c))
    win_b = [r + b for r, b in zip(rec_c, bwd_c)]
    e = device_weight_bytes(s.precision)
    params = [shape.pre_params] + [shape.block_params] * N + [shape.post_params]
    if pe:  # the EPS's state is the adapters'; the base goes as stored (low-bit), no gradient comes back
        params = [x.trainable for x in pe.layers()]
        load = [rates.copy_time(x.trainable * e + x.stored + x.tied_stored) for x in pe.layers()]
        grads = [rates.copy_time(x.trainable * e) for x in pe.layers()]
    else:
        load = [rates.copy_time(p * e) for p in params]
        grads = load
    stash = [0.0] + [rates.copy_time(s.batch * shape.output_bytes(s.seq, s.precision))] * N + [0.0]
    if s.stash != "cpu":
        stash = [0.0] * len(params)
    _transfer(ph["transfer"], s, rates, fwd_c, win_b, load, stash, grads)
    if pe:  # dequantized on the device, on the compute's stream: on the step's path
        t = dequantize_time(shape, s, rates)
        ph["transfer"].add(t, t)

    t_upd = [rates.host_update_time(p) for p in params]
    upd_on = [0.0] * len(params)  # the updates' exposed seconds, by the backward window they land in
    if s.spec.overlapped_update or s.disk:  # (the disk tier updates each layer in its backward: L2L too)
        # l2l-v1 eq. 7: the update of layer l+1 runs on the host during layer l's recompute + backward;
        # the last layer's (the embeddings') update trails the step. When the host shares the device's
        # cores, what an overlapped update costs was measured (its exposed part may exceed its own time).
        cost = rates.measured.overlap_cost if rates.measured is not None else None
        for j in range(len(params) - 1, 0, -1):
            if rates.host_shares_device:
                upd_on[j - 1] = (1.0 if cost is None else cost) * t_upd[j]
            else:
                upd_on[j - 1] = max(t_upd[j] - win_b[j - 1], 0.0)
            ph["optimizer"].add(t_upd[j], upd_on[j - 1])
        ph["optimizer"].add(t_upd[0], t_upd[0])
        upd_on[0] += t_upd[0]
    else:
        ph["optimizer"].add(sum(t_upd), sum(t_upd))
    _reduce(ph, s, rates, sum(params), hide=0.0 if rates.host_shares_device else sum(win_b))
    # the disk's clock is the step's: each layer's turn lasts its compute, the exposed updates that land
    # in it and its share of the exposed copies (half in each pass, by its bytes)
    copies = [ph["transfer"].exposed * p / (2 * max(1, sum(params))) for p in params]
    fwd_t = [c + x for c, x in zip(fwd_c, copies)]
    bwd_t = [c + u + x for c, u, x in zip(win_b, upd_on, copies)]
    if s.disk:
        _disk(ph["disk_wait"], s, rates, params, fwd_t, bwd_t, t_upd)
    if pe and pe.on_disk:
        _base_reads(ph["disk_wait"], s, rates, pe, fwd_t, bwd_t)
    return ph


def lora_times(lt: LayerTimes) -> LayerTimes:
    """Layer times with a frozen base: a frozen matmul's backward computes its input's gradient only, not
    its weight's (``LORA_BACKWARD_SHARE`` of a full backward); the adapters' own matmuls are rank r."""
    k = LORA_BACKWARD_SHARE
    return replace(lt, pre_bwd=k * lt.pre_bwd, block_bwd=k * lt.block_bwd, post_bwd=k * lt.post_bwd)


def dequantize_time(shape: ModelShape, s: Setup, rates: Rates) -> float:
    """Seconds per step the device spends decoding the stored base into its slots (every load), at the
    device memory's bandwidth (``hardware.device_memory_gbps``; measured: the copy rate timed here): bound by
    the bytes it reads and writes."""
    pe = shape.peft
    if pe is None:
        return 0.0
    # a measured machine: the copy rate it measured (a CPU device tier dequantizes in its RAM)
    bw = rates.measured.memcpy_bytes_per_s if rates.measured is not None else rates.device_bandwidth
    return pe.dequant_bytes(device_weight_bytes(s.precision)) / bw


def _base_reads(out: Phase, s: Setup, rates: Rates, pe: Any, fwd: list[float], win_b: list[float]) -> None:
    """A frozen base on disk (``peft.base_source=disk``): the relay reads each layer's file at every load
    (:meth:`PeftShape.loads`: the forward, then the backward's recompute + backward from one load), with
    ``READ_AHEAD`` layers read ahead on a thread of its own in the direction the pass goes
    (engine/frozen_disk.py). A load is made while the layer before computes (the relay's prefetch), so
    its file must be in by then; the read of layer m starts when layer m-2 is loaded. Simulated as the
    disk tier's queues (:func:`exposed_wait`): what the compute waits for is exposed."""
    n = len(fwd)
    loads = pe.loads(s.prefetch)
    layers = pe.layers()
    tied = pe.pre.stored if pe.post.tied_stored else 0
    size = [x.stored + (tied if j == n - 1 else 0) for j, x in enumerate(layers)]
    order = [(fwd[j], size[j]) for j in range(n)]
    order += [(win_b[j], size[j] if loads[j] > 1 else 0.0) for j in reversed(range(n))]
    if s.prefetch:  # use m's compute waits for the read of use m+1 (loaded while m computes)
        order = [(c, order[(m + 1) % len(order)][1]) for m, (c, _) in enumerate(order)]
    uses = [Use(c, r) for c, r in order]
    io = sum(r for _, r in order) / rates.disk_read
    disk = Disk(rates.disk_read, rates.disk_write, rates.disk_share())
    out.add(io, exposed_wait(uses, READ_AHEAD + 1, disk))


def _disk(
    out: Phase,
    s: Setup,
    rates: Rates,
    params: list[int],
    fwd: list[float],
    win_b: list[float],
    upd: list[float],
) -> None:
    """The disk EPS tier's I/O, read ahead and written back behind the compute as the tier does it: the
    exposed part is what :func:`~l2l_cli.plan.diskqueue.exposed_wait` finds the compute waiting for, with
    reads up to ``eps.host_cache_layers - 1`` layers ahead and write-backs behind as far as the slots allow.
    Per parameter: the forward reads the weights (4 bytes; 2 under bf16 CMP, the master's bf16 hi plane);
    the backward reads the weights, then the moments for the update, and writes the new state (12 + 12): L2L
    and L2L-p alike update each layer right after its backward on this tier (the gradient waits in RAM for
    the clipping verdict), so 28 bytes in all (26 under bf16 CMP). The moments are the optimizer's state as
    the files hold it (``Setup.moment_bytes``): 8 bytes FP32, ~2.03 with adamw8bit (16.06 in all). Under
    global clipping with ``eps.clip_redo=keep`` an applied gradient waits for the verdict in RAM for the first
    ``eps.grad_ram_layers`` layers of the backward, on disk for the others (4 more bytes written; the
    embeddings' update comes after the verdict); ``auto`` and ``replay`` keep none in a step that does not
    clip. With every layer in the cache only the writes remain (the state is committed every step)."""
    n = len(params)
    cached = s.cache_layers >= n  # nothing is ever evicted: no reads after the first step
    r = 0.0 if cached else 1.0
    fr = 2 if s.bf16_master_planes else 4
    uses = [Use(fwd[j], r * fr * params[j]) for j in range(n)]  # the forward, from the embeddings up
    # the backward, from the head down: each layer's weights, its moments, its update, its write. The last
    # update (the embeddings') is waited for at the step's end (the commit needs it): it is on the step's
    # clock already (``win_b[0]``), not beside it
    pool = s.pool_layers(max(params), n)
    # the backward's order is the head first: the pool takes its first layers' gradients
    keeps = s.clip_global and s.clip_redo == "keep"
    kept = [keeps and j > 0 and n - 1 - j >= pool for j in range(n)]
    mom = s.moment_bytes
    uses += [
        Use(
            win_b[j],
            r * 4 * params[j],
            r * mom * params[j],
            upd[j] if j else 0.0,
            (4 + mom + 4 * kept[j]) * params[j],
        )
        for j in reversed(range(n))
    ]
    io = sum(rates.disk_time(u.read + u.late_read, u.write) for u in uses)
    disk = Disk(rates.disk_read, rates.disk_write, rates.disk_share())
    out.add(io, exposed_wait(uses, None if cached else s.cache_layers, disk))


def _transfer(
    out: Phase,
    s: Setup,
    rates: Rates,
    fwd: list[float],
    win_b: list[float],
    load: list[float],
    stash: list[float],
    grads: list[float] | None = None,
) -> None:
    """Layer loads (h2d), gradients (d2h) and the CPU stash (d2h in forward, h2d in backward).

    Inline copies (a CPU device tier) are all exposed. With copy engines, a copy hides behind the compute
    it overlaps: with prefetch, layer l+1 loads while layer l computes (eq. 7's max(0, L/Hb − u·Ft));
    without, each load is waited for (eq. 6). Gradients (``grads``; default: a layer's load) and the stash
    use the other direction.
    """
    n = len(load)
    grads = load if grads is None else grads
    if not rates.async_copy:
        # forward loads every layer; backward all but the head (and the last block, still in the other
        # slot with prefetch); every gradient goes back; the stash goes out and comes back
        loads = sum(load) + sum(load[:-1]) - (load[-2] if s.prefetch else 0.0)
        total = loads + sum(grads) + 2 * sum(stash)
        out.add(total, total)
        return
    # forward: layer 0 is waited for; then layer i computes while layer i+1 loads (prefetch) and layer
    # i's input goes out to the host stash (the other direction)
    out.add(load[0], load[0])
    for i in range(n):
        nxt = load[i + 1] if i + 1 < n else 0.0
        if s.prefetch:
            out.add(nxt + stash[i], max(nxt - fwd[i], stash[i] - fwd[i], 0.0))
        else:
            out.add(nxt, nxt)
            out.add(stash[i], stash[i] - fwd[i])
    # backward, from the head down (the head is still on the device after the turn)
    for i in range(n - 1, -1, -1):
        grad_above = grads[i + 1] if i + 1 < n else 0.0  # the layer above's gradient leaving for the EPS
        if s.prefetch:
            # layer i's recompute + backward hides the load of layer i-1 (the last block is still in the
            # other slot after the turn), its own stash coming back, and the gradient above going out
            nxt = load[i - 1] if i >= 1 and i - 1 != n - 2 else 0.0
            out.add(nxt + stash[i] + grad_above, max(nxt + stash[i] - win_b[i], grad_above - win_b[i], 0.0))
        else:
            # one slot: layer i is loaded and waited for, while the gradient above drains
            if i < n - 1:
                out.add(load[i] + grad_above, load[i] + max(grad_above - load[i], 0.0))
            out.add(stash[i], stash[i] - win_b[i])
    out.add(grads[0], grads[0])  # the embeddings' gradient: the update waits for it


def _reduce(ph: dict[str, Phase], s: Setup, rates: Rates, params: int, hide: float) -> None:
    """Data parallelism (dist.nproc): a ring all-reduce of FP32 gradients, 2·(n−1)/n of them per device,
    overlapped with the last micro-batch's backward (baselines) or the layers' backward (the EPS reduces
    eagerly, layer by layer)."""
    if s.nproc <= 1:
        return
    t = 2 * (s.nproc - 1) / s.nproc * 4.0 * params / rates.network
    ph["reduce"].add(t, t - hide)


def pipeline_ranks(shape: ModelShape, s: Setup, rates: Rates) -> list[dict[str, float]]:
    """Per pipeline rank: forward and backward seconds of its layers over the step's micro-batches, its
    parameters and layers (the embeddings go with the first stage, the head with the last)."""
    plan = stage_plan(shape, s)
    lt = rates.layer_times(shape, s.seq, s.ubatch)
    u, head = s.num_ubatches, shape.num_layers + 1
    cost = {
        0: (lt.pre_fwd_grad, lt.pre_bwd, shape.pre_params),
        head: (lt.post_fwd_grad, lt.post_bwd, shape.post_params),
    }
    block = (lt.block_fwd_grad, lt.block_bwd, shape.block_params)
    out = []
    for r in range(s.pipeline):
        layers = [i for st in plan.stages_of(r) for i in plan.layers(st)]
        f, b, p = (sum(cost.get(i, block)[k] for i in layers) for k in range(3))
        out.append({"forward": u * f, "backward": u * b, "params": p, "layers": len(layers)})
    return out


def exchange_time(shape: ModelShape, s: Setup, rates: Rates) -> float:
    """One exchange between pipeline neighbours: a micro-batch's hidden state (FP32) out and one in."""
    from l2l_cli.parallel.pipeline.plan import exchange_seconds, hidden_bytes

    return exchange_seconds(
        hidden_bytes(s.ubatch, s.seq, shape.hidden), rates.p2p_latency, rates.p2p_bytes_per_s
    )


def schedule_orders(shape: ModelShape, s: Setup) -> list[Any]:
    """Each pipeline rank's actions in a step, in order (``StagePlan.orders``): read off torch's schedule of
    the configured kind, or L2L stages' own loops."""
    from l2l_cli.parallel.pipeline.settings import SCHEDULES

    plan = stage_plan(shape, s)
    if s.l2l:
        return plan.l2l_orders(s.num_ubatches)
    return plan.orders(s.num_ubatches, *SCHEDULES[s.schedule])


def simulate_step(
    shape: ModelShape, s: Setup, rates: Rates, load_s: float = 0.0, orders: list[Any] | None = None
) -> tuple[float, list[float]]:
    """The step's pipeline, simulated in dependency order (``plan.simulate``): (step seconds, each rank's
    compute). A chunk lasts its layers' times per micro-batch (a stage's; L2L stages' per layer: forward,
    then recompute + backward in one chunk); each action ``hardware.pipe_action_us``; each message latency
    + bytes over the link, ``hardware.pipe_wake_us`` later where its sender computes; each L2L relay move
    ``load_s``. ``orders``: :func:`schedule_orders`, where the caller has them."""
    from l2l_cli.parallel.pipeline.plan import simulate, table_cost

    plan = stage_plan(shape, s)
    lt = rates.layer_times(shape, s.seq, s.ubatch)
    head = shape.num_layers + 1
    fwd = {0: lt.pre_fwd_grad, head: lt.post_fwd_grad}
    bwd = {0: lt.pre_bwd, head: lt.post_bwd}
    per = {i: (fwd.get(i, lt.block_fwd_grad), bwd.get(i, lt.block_bwd)) for i in range(head + 1)}
    if s.l2l:  # a body layer's backward chunk recomputes its forward first
        table = {i: (f, b + (f if i != head else 0.0)) for i, (f, b) in per.items()}
    else:
        table = {
            st: (sum(per[i][0] for i in plan.layers(st)), sum(per[i][1] for i in plan.layers(st)))
            for st in range(plan.num_stages)
        }
    return simulate(
        orders if orders is not None else schedule_orders(shape, s),
        table_cost(table, load_s),
        rates.pipe_action,
        exchange_time(shape, s, rates),
        rates.pipe_wake,
    )


def pipeline_time(shape: ModelShape, s: Setup, rates: Rates) -> dict[str, Phase]:
    """A pipeline step on its busiest rank: that rank's forward and backward, the bubble (the simulated
    step, :func:`simulate_step`, less the busiest rank's compute: appendix C's (P-1)/n_mu fill and drain,
    ÷ L/P for the modular pipeline, where actions and messages are free; what each action and message on the
    critical path adds where not: the modular placement acts and sends L/P times more), its optimizer (on
    the device, or the EPS's on the host for L2L stages), and the data-parallel reduction of its layers'
    gradients, which overlaps the backward of the rank's other stages (each stage reduces as soon as its
    last micro-batch is through)."""
    ph = {p: Phase() for p in PHASES}
    plan = stage_plan(shape, s)
    ranks = pipeline_ranks(shape, s, rates)
    r_busy = max(range(s.pipeline), key=lambda r: ranks[r]["forward"] + ranks[r]["backward"])
    busy = ranks[r_busy]
    f, b = busy["forward"], busy["backward"]
    ph["forward"].add(f, f)
    ph["backward"].add(b, b)
    if s.l2l:  # L2L stages recompute each layer's forward in backward
        ph["recompute"].add(f, f)
        b += f
    step, busy_s = simulate_step(shape, s, rates)  # the relay's moves: the transfer phase's below
    bubble = max(0.0, step - max(busy_s))
    ph["bubble"].add(bubble, bubble)
    D = s.data_parallel
    if s.l2l:
        t = rates.host_update_time(busy["params"])
    else:
        t = rates.device_update_time(busy["params"] / (D if s.partition_state else 1))
    ph["optimizer"].add(t, t)
    if s.l2l:  # each layer relayed twice (forward, backward), behind the previous layer's compute
        copy = 2 * rates.copy_time(busy["params"] * device_weight_bytes(s.precision))
        ph["transfer"].add(copy, max(0.0, copy - (f + b)) if rates.async_copy else copy)
    if D > 1:
        red = 2 * (D - 1) / D * 4.0 * busy["params"] / rates.network
        v = plan.stages_per_rank
        ph["reduce"].add(red, red - b * (v - 1) / v)
    return ph
