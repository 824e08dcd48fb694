"""The plan for one config: memory per tier, step time by phase, and the recommendation.

The step-time model is the papers' (l2l-v1 eqs. 5-7, l2l-v2 eq. 4) applied layer by layer to the
schedule the runners execute: the embeddings and the head are layers too, a copy hides only behind the
compute it overlaps (the relay's prefetch window, the other link direction), and the L2L-p update of
layer l+1 hides behind the recompute + backward of layer l, except the trailing one. The papers' closed
forms are reported beside it (``equations``) for the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from l2l_cli.engine.optim import OPTIMIZERS
from l2l_cli.engine.recompute_plan import MARGIN, SELECTIVE_SHARE, LayerBytes, RecomputeSettings, choose
from l2l_cli.engine.tiers import TIERS
from l2l_cli.engine.tiers.disk.layout import cache_slots
from l2l_cli.modes import MODES, ModeSpec, find_mode, run_clip, run_precision, run_stash
from l2l_cli.plan import costmodel as cm
from l2l_cli.plan.diskqueue import Disk, Use, exposed_wait
from l2l_cli.plan.hardware import Rates
from l2l_cli.plan.peft import LORA_BACKWARD_SHARE, READ_AHEAD
from l2l_cli.plan.shapes import ModelShape, act_bytes, device_weight_bytes
from l2l_cli.plan.times import LayerTimes
from l2l_cli.problems import fmt_bytes
from l2l_cli.runfiles import PHASES

LOW_BIT = ("int8", "nf4")
FP32_STATE = 16  # bytes per parameter: FP32 weights, gradients, and the two Adam/LAMB moments
DISK_STATE = 24  # the disk EPS tier: two versions (slots) of the weights and both moments per layer file


@dataclass(frozen=True)
class Setup:
    """The config's execution knobs."""

    mode: str
    stash: str | None
    prefetch: bool
    precision: str
    seq: int
    batch: int
    ubatch: int
    nproc: int = 1
    tier: str = "host"  # eps.tier: where the EPS keeps the state (the L2L modes)
    cache_layers: int = 4  # eps.host_cache_layers (tier=disk)
    pipeline: int = 1  # dist.pipeline: ranks per pipeline (layered-GA §4); nproc / pipeline pipelines
    placement: str = "modular"
    schedule: str = "breadth_first"  # resolved (dist.schedule=auto: by placement)
    layers_per_stage: int = 1
    partition_state: bool = False
    grad_ram_gb: float = 8.0  # eps.grad_ram_gb (tier=disk): gradients waiting in RAM
    grad_ram_layers: int = 2  # eps.grad_ram_layers (tier=disk): ... for at most this many layers at a time
    clip_global: bool = True  # global clipping: the disk tier keeps each applied gradient until the verdict
    bf16_master_planes: bool = False  # CMP in bf16 on the disk tier: the forward reads a 2-byte hi plane
    reserved: float = 0.0  # device bytes beyond the tensors: CUDA context, workspaces, allocator reserve
    att_half: float | None = (
        None  # bytes per attention score the device's kernel keeps (amp/cmp); None: HF math
    )
    optim: str = "adamw"  # optim.name: its state's bytes per parameter (8-bit moments: ~2 instead of 8)

    @classmethod
    def from_cfg(cls, cfg: Any) -> Setup:
        from l2l_cli.parallel.pipeline.settings import PipelineSettings

        pipe = PipelineSettings.from_cfg(cfg)
        return cls(
            cfg.mode.name, run_stash(cfg), bool(cfg.mode.prefetch), run_precision(cfg), cfg.task.max_seq_len,
            cfg.batch.size, cfg.batch.ubatch_size, cfg.dist.nproc, cfg.eps.tier, cfg.eps.host_cache_layers,
            pipe.pipeline, pipe.placement, pipe.schedule,
            pipe.layers_per_stage if pipe.placement == "modular" else 1, pipe.partition_state,
            grad_ram_gb=cfg.eps.grad_ram_gb, grad_ram_layers=cfg.eps.grad_ram_layers,
            clip_global=run_clip(cfg) == "global",
            bf16_master_planes=run_precision(cfg) == "cmp" and cfg.precision.dtype == "bf16",
            **device_terms(cfg),
            optim=cfg.optim.name,
        )  # fmt: skip

    @property
    def disk(self) -> bool:
        """The EPS keeps its state on disk, a few layers cached in RAM (eps.tier=disk)."""
        kind = TIERS.get(self.tier)
        return self.l2l and kind is not None and kind.on_disk

    @property
    def state_bytes(self) -> float:
        """Training state per parameter: FP32 weights and gradient, and the optimizer's state (16 with
        AdamW or LAMB; ~10 with adamw8bit's 8-bit moments and their per-block absmax)."""
        kind = OPTIMIZERS.get(self.optim)
        return FP32_STATE if kind is None else 8.0 + kind.state_bytes_per_param

    @property
    def disk_layout_ok(self) -> bool:
        """The disk tier's layer files hold this optimizer's state (FP32 moments; not adamw8bit's yet)."""
        kind = OPTIMIZERS.get(self.optim)
        return kind is None or kind.fp32_moments

    @property
    def data_parallel(self) -> int:
        """Ranks reading distinct samples: every rank, or one pipeline of ``pipeline`` ranks each."""
        return max(1, self.nproc // self.pipeline)

    @property
    def num_ubatches(self) -> int:
        return max(1, self.batch // self.ubatch)

    @property
    def spec(self) -> ModeSpec:
        return MODES[self.mode]

    @property
    def l2l(self) -> bool:
        """The training state lives in the EPS and layers are relayed (the L2L modes)."""
        return self.spec.host_state == "eps"

    @property
    def label(self) -> str:
        return self.spec.method(self.stash)

    def but(self, **kw: Any) -> Setup:
        return replace(self, **kw)

    def pool_layers(self, max_layer_params: int, layers: int) -> int:
        """How many layers' waiting gradients the disk tier keeps in RAM at once: ``eps.grad_ram_layers``,
        within ``eps.grad_ram_gb`` (buffers of the largest layer) and the model's layers (the tier's rule,
        :class:`~l2l_cli.engine.tiers.disk.pool.GradPool`)."""
        buf = 4.0 * max_layer_params
        return max(0, min(self.grad_ram_layers, layers, int(self.grad_ram_gb * 1e9 // buf) if buf else 0))


def device_terms(cfg: Any) -> dict[str, Any]:
    """The hardware preset's fixed device terms (``hardware.device_reserved_gb``, ``hardware.
    attention_bytes_half``) where the plan is for that GPU; none for a CPU or simulated device tier (what
    the run's own meter counts is its tensors, on a CPU's math attention) or a measured machine."""
    hw = cfg.hardware
    if cfg.device in ("cpu", "sim") or hw.measured:
        return {}
    return {"reserved": hw.device_reserved_gb * 2**30, "att_half": hw.attention_bytes_half}


# --------------------------------------------------------------------------------------------------
# Memory


def memory(shape: ModelShape, s: Setup) -> dict[str, dict[str, float]]:
    """Device, host and disk bytes by part, at the step's peak. The parts follow the layered-GA breakdown:
    training state, activation stash (checkpoints), parameter + gradient buffers, working activations.
    With LoRA (``shape.peft``) the training state is the adapters' alone; the frozen base is a part of its
    own, where ``peft.base_source`` keeps it, at ``peft.base_dtype``'s bytes (plan/peft.py)."""
    P, N = shape.total_params, shape.num_layers
    pe = shape.peft
    P_state = pe.trainable if pe else P  # parameters with a master, a gradient and moments
    L_state = pe.max_trainable if pe else shape.max_layer_params
    ub, mb = s.ubatch, s.batch
    A = shape.output_bytes(s.seq, s.precision)
    working = shape.block_working_bytes(s.seq, s.precision, s.att_half)
    saved = shape.block_saved_bytes(s.seq, s.precision, s.att_half)
    pre = shape.pre_saved_bytes(s.seq, s.precision)
    dev: dict[str, float] = {}
    host: dict[str, float] = {}
    if s.pipeline > 1:
        return _reserve(pipeline_memory(shape, s), s)
    disk: dict[str, float] = {}
    if not s.l2l:
        # l2l-v1 eq. 1: the whole training state on the device, every layer's activations for one ubatch
        dev["training_state"] = s.state_bytes * P_state
        if pe:  # the baselines keep the frozen base on the device in fp32
            dev["frozen_base"] = 4.0 * pe.frozen
        if s.precision == "amp":  # autocast's half copies of the weights, cached through the step
            dev["param_grad_buffers"] = 2.0 * (shape.blocks_params + shape.post_params)
        dev["working_activations"] = ub * (N * saved + pre + (working - saved))
    else:
        # l2l-v1 eqs. 2-4: relay slots (weights + gradient of the largest layer; a second slot to prefetch)
        slots = 2 if s.prefetch else 1
        e = device_weight_bytes(s.precision)
        dev["param_grad_buffers"] = 2.0 * slots * L_state * e
        if pe:
            # each slot's frozen base, dequantized in the compute type (no gradient); a low-bit tensor's
            # stored parts and its fp32 decode while it is dequantized
            dev["frozen_base_slots"] = slots * pe.max_slot * e
            if pe.base_dtype in LOW_BIT:
                dev["dequantize_scratch"] = 4.6 * max(x.largest for x in pe.layers())
        if s.stash == "cpu":
            dev["stash"] = 2.0 * ub * A  # the micro-batch being recomputed and the next one, prefetched
            host["stash"] = N * mb * A
        else:
            dev["stash"] = N * mb * A
        # one layer's working set for one micro-batch, plus every micro-batch's layer output / gradient
        dev["working_activations"] = ub * working + mb * A
        if s.disk:
            # k cache slots (w, m, v, g and the half send copy, layout.cache_slots); the
            # state and L2L-p's undo (the slot an update does not overwrite) are in the layer files
            k = min(s.cache_layers, N + 2)
            per_param = FP32_STATE + (2.0 if s.precision == "cmp" else 0.0)
            # the trainable layers' sizes, largest first (LoRA: the adapters of each layer)
            if pe:
                largest = [L_state] * (N + 2)
            else:
                largest = sorted(
                    [shape.pre_params, *[shape.block_params] * N, shape.post_params], reverse=True
                )
            # the tier's own rule: dedicated slots for layers larger than a block, shared block-sized ones
            numels = (
                [L_state] * (N + 2)
                if pe
                else [shape.pre_params, *[shape.block_params] * N, shape.post_params]
            )
            host["eps_cache"] = per_param * sum(n for n, _ in cache_slots([int(x) for x in numels], k))
            # the gradients waiting for the clipping verdict (or their update): eps.grad_ram_layers buffers,
            # at most the largest layers' gradients, whatever the depth; the others wait on disk (an applied
            # one kept for a redo in kept_grads.eps, sparse: at most 4 bytes per parameter)
            pool = s.pool_layers(L_state, N + 2)
            host["eps_grad_pool"] = 4.0 * sum(largest[:pool])
            disk["eps_files"] = DISK_STATE * P_state
            if s.clip_global and pool < N + 2:
                disk["eps_kept_grads"] = 4.0 * P_state
        else:
            host["training_state"] = s.state_bytes * P_state
            if s.spec.undo_log:  # weights and moments before the early update (skip on overflow)
                host["undo_copies"] = (s.state_bytes - 4.0) * P_state
            if s.precision == "cmp":
                host["send_copy"] = 2.0 * P_state  # the half copy the relay sends
        if pe and pe.on_disk:  # its layer files; in RAM only the layer loading and those read ahead
            disk["frozen_base_files"] = pe.stored
            host["frozen_base_readahead"] = pe.readahead_bytes()
        elif pe:
            host["frozen_base"] = pe.stored
    return _reserve({"device": dev, "host": host, "disk": disk}, s)


def _reserve(mem: dict[str, dict[str, float]], s: Setup) -> dict[str, dict[str, float]]:
    """The device's fixed part beyond the tensors (``Setup.reserved``), as its own line."""
    if s.reserved > 0:
        mem["device"]["runtime_reserved"] = s.reserved
    return mem


# --------------------------------------------------------------------------------------------------
# Step time


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
    rec_c = [u * lt.pre_fwd_grad] + [u * lt.block_fwd_grad] * N + [0.0]
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


def _base_reads(
    out: Phase, s: Setup, rates: Rates, pe: Any, fwd: list[float], win_b: list[float]
) -> None:  # fmt: skip
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
    the clipping verdict), so 28 bytes in all (26 under bf16 CMP). Under global clipping an applied gradient
    waits for the verdict in RAM for the first ``eps.grad_ram_layers`` layers of the backward, on disk for
    the others (4 more bytes written; the embeddings' update comes after the verdict). With every layer in
    the cache only the writes remain (the state is committed every step)."""
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
    kept = [s.clip_global and j > 0 and n - 1 - j >= pool for j in range(n)]
    uses += [
        Use(
            win_b[j],
            r * 4 * params[j],
            r * 8 * params[j],
            upd[j] if j else 0.0,
            (12 + 4 * kept[j]) * params[j],
        )
        for j in reversed(range(n))
    ]
    io = sum(rates.disk_time(u.read + u.late_read, u.write) for u in uses)
    disk = Disk(rates.disk_read, rates.disk_write, rates.disk_share())
    out.add(io, exposed_wait(uses, None if cached else s.cache_layers, disk))


def _transfer(
    out: Phase, s: Setup, rates: Rates, fwd: list[float], win_b: list[float], load: list[float],
    stash: list[float], grads: list[float] | None = None,
) -> None:  # fmt: skip
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


# --------------------------------------------------------------------------------------------------
# The plan


def evaluate(shape: ModelShape, s: Setup, rates: Rates) -> dict[str, Any]:
    """Memory, fit and time of one setup."""
    mem = memory(shape, s)
    dev, host, disk = sum(mem["device"].values()), sum(mem["host"].values()), sum(mem["disk"].values())
    phases = step_time(shape, s, rates)
    total = sum(p.exposed for p in phases.values())
    node = host * rates.ranks_on_node(s.nproc)  # the ranks on a node share its host memory
    fits = dev <= rates.device_memory and node <= rates.host_memory and disk <= rates.disk_free
    return {
        "label": s.label,
        "setup": s,
        "memory": mem,
        "device_bytes": dev,
        "host_bytes": host,
        "host_node_bytes": node,
        "disk_bytes": disk,
        "fits": fits,
        "phases": phases,
        "step_time_s": total,
        "samples_per_s": s.batch * s.data_parallel / total if total > 0 else float("inf"),
    }


def fits(shape: ModelShape, s: Setup, rates: Rates) -> bool:
    mem = memory(shape, s)
    return (
        sum(mem["device"].values()) <= rates.device_memory
        and sum(mem["host"].values()) * rates.ranks_on_node(s.nproc) <= rates.host_memory
        and sum(mem["disk"].values()) <= rates.disk_free
    )


def eps_tier(shape: ModelShape, s: Setup, rates: Rates) -> dict[str, Any] | None:
    """Which tier the EPS needs for this model (the L2L modes): ``host`` when its state fits in host RAM,
    ``disk`` when only the disk tier fits (its layer files on disk, a few layers in RAM), else ``none``;
    with each tier's host, disk and step-time numbers."""
    if not s.l2l:
        return None
    tiers = {}
    for tier in TIERS:  # the registered tiers, host first
        r = evaluate(shape, s.but(tier=tier), rates)
        tiers[tier] = {
            "host_bytes": r["host_bytes"], "disk_bytes": r["disk_bytes"], "fits": r["fits"],
            "host_fits": r["host_node_bytes"] <= rates.host_memory, "disk_fits": r["disk_bytes"] <= rates.disk_free,
            "step_time_s": r["step_time_s"], "disk_wait_s": r["phases"]["disk_wait"].exposed,
            "disk_hidden_s": r["phases"]["disk_wait"].hidden,
        }  # fmt: skip
    # a tier in RAM needs its state to fit there; one on disk needs the whole run (disk, RAM, device) to fit
    # (a tier on disk holds FP32 moments only: not a choice for adamw8bit yet)
    needed = next(
        (
            t
            for t, r in tiers.items()
            if (r["fits"] and s.disk_layout_ok if TIERS[t].on_disk else r["host_fits"])
        ),
        "none",
    )
    return {"configured": s.tier, "needed": needed, "cache_layers": s.cache_layers, **tiers}


def largest_ubatch(shape: ModelShape, s: Setup, rates: Rates) -> int | None:
    """The largest micro-batch (a divisor of batch.size) that fits the budgets, or None."""
    for ub in sorted((d for d in range(1, s.batch + 1) if s.batch % d == 0), reverse=True):
        if not s.spec.microbatches and ub != s.batch:
            break
        if fits(shape, s.but(ubatch=ub), rates):
            return ub
    return None


def largest_ubatch_any(shape: ModelShape, s: Setup, rates: Rates, cap: int = 1 << 16) -> int | None:
    """The largest micro-batch that fits with the same number of micro-batches (batch.size scaled)."""
    u = s.num_ubatches
    if not fits(shape, s.but(ubatch=1, batch=u), rates):
        return None
    lo, hi = 1, 2
    while hi <= cap and fits(shape, s.but(ubatch=hi, batch=hi * u), rates):
        lo, hi = hi, hi * 2
    if hi > cap:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(shape, s.but(ubatch=mid, batch=mid * u), rates) else (lo, mid)
    return lo


def single_layer_need(shape: ModelShape, s: Setup) -> float:
    """Device bytes L2L needs at the least: one slot for the largest layer and its gradient, and one
    sample's working set with the stash on the host."""
    relay = find_mode(host_state="eps", overlapped_update=False).name  # plain L2L (Alg. 3)
    m = memory(shape, s.but(mode=relay, stash="cpu", prefetch=False, ubatch=1, batch=1))
    return sum(m["device"].values())


def recommend(shape: ModelShape, s: Setup, rates: Rates, max_overhead: float) -> dict[str, Any]:
    """The #ubatches that bounds L2L's transfer share (l2l-v2 eq. 4) and the largest ubatch that fits."""
    ub = largest_ubatch(shape, s, rates)
    ub_any = largest_ubatch_any(shape, s, rates)
    basis = ub or s.ubatch
    lt = rates.layer_times(shape, s.seq, basis)
    C = lt.block_fwd
    pe = shape.peft
    if pe:  # a block's adapters in the compute type and its base as stored
        X = rates.copy_time(pe.block.trainable * device_weight_bytes(s.precision) + pe.block.stored)
    else:
        X = rates.copy_time(shape.block_params * device_weight_bytes(s.precision))
    u_min = cm.min_ubatches(C, X, max_overhead) if C > 0 else None
    return {
        "max_transfer_overhead": max_overhead,
        "layer_forward_s": C,
        "layer_transfer_s": X,
        "num_ubatches_min": u_min,
        "transfer_overhead_now": cm.transfer_overhead(s.num_ubatches, C, X) if C > 0 else None,
        "ubatch_basis": basis,
        "batch_size_for_overhead": u_min * basis if u_min else None,
        "max_ubatch_size": ub,
        "max_ubatch_size_any": ub_any,
        "single_layer_device_bytes": single_layer_need(shape, s),
    }


def equations(shape: ModelShape, s: Setup, rates: Rates) -> dict[str, float]:
    """The papers' closed forms for this config (N blocks only, as the papers count them)."""
    N, u, mb, ub = shape.num_layers, s.num_ubatches, s.batch, s.ubatch
    lt = rates.layer_times(shape, s.seq, ub)
    L = shape.block_params * device_weight_bytes(s.precision)
    Hb = L / rates.copy_time(L) if L else rates.h2d
    X, A = shape.block_saved_bytes(s.seq, s.precision, s.att_half), shape.output_bytes(s.seq, s.precision)
    L_state = shape.block_params * 4.0
    P = shape.total_params
    Ft, Bt = lt.block_fwd, lt.block_bwd
    return {
        "eq1_baseline_memory_bytes": cm.baseline_memory(N, L_state, mb, X, A, ubatch=ub),
        "eq2_l2l_memory_bytes": cm.l2l_memory(N, L, mb, X, A, ubatch=ub),
        "eq3_l2l_p_memory_bytes": cm.l2l_p_memory(N, L, mb, X, A, ubatch=ub),
        "eq4_l2l_p_stash_cpu_memory_bytes": cm.l2l_p_memory_stash_cpu(L, mb, X, ubatch=ub),
        "eq5_baseline_s": cm.baseline_time(N, u, Ft, Bt, rates.device_update_time(P)),
        "eq6_l2l_s": cm.l2l_time(N, u, Ft, Bt, L, Hb, rates.host_update_time(P)),
        "eq7_l2l_p_s": cm.l2l_p_time(N, u, Ft, Bt, L, Hb, rates.host_update_time(P)),
        "v2_eq4_total_s": cm.v2_total_time(N, u, Ft, L / Hb),
        "v2_eq6_samples_per_s": cm.v2_training_throughput(N, u, ub, Ft, L / Hb) if Ft > 0 else 0.0,
    }


def compare_setups(s: Setup) -> list[Setup]:
    """Every registered mode at the config's batch, once per stash option (a mode without micro-batches
    runs the batch whole; the others split it as configured); in a pipeline, the modes a stage can run."""
    out = []
    for spec in MODES.values():
        if s.pipeline > 1 and not spec.pipeline_stage:
            continue
        ub = s.ubatch if spec.microbatches else s.batch
        for stash in spec.stash or (None,):
            out.append(s.but(mode=spec.name, stash=stash, ubatch=ub))
    return out


def compare_modes(shape: ModelShape, s: Setup, rates: Rates) -> list[dict[str, Any]]:
    """Every mode at the config's batch, side by side."""
    rows = []
    for alt in compare_setups(s):
        r = evaluate(shape, alt, rates)
        rows.append(
            {
                "method": r["label"], "ubatch_size": alt.ubatch, "num_ubatches": alt.num_ubatches,
                "device_bytes": r["device_bytes"], "host_bytes": r["host_bytes"], "fits": r["fits"],
                "step_time_s": r["step_time_s"], "samples_per_s": r["samples_per_s"],
                "configured": alt == s,
            }
        )  # fmt: skip
    return rows


def peft_view(shape: ModelShape, s: Setup, rates: Rates, result: dict[str, Any]) -> dict[str, Any] | None:
    """``l2l plan``'s LoRA section (``peft=lora``): bytes per parameter where each part lives (the frozen
    base at ``peft.base_dtype`` in RAM or on disk, one dequantized layer per device slot, the adapters'
    training state), the host bytes per parameter a run reports (``summary.json``'s
    ``host_bytes_per_param`` over the model's parameters, ``peft.host_bytes_per_param`` over trainable +
    frozen), and the step's terms: which one bounds it."""
    pe = shape.peft
    if pe is None:
        return None
    P = shape.total_params
    mem = result["memory"]
    e = device_weight_bytes(s.precision)
    host_state = sum(v for k, v in mem["host"].items() if k in ("training_state", "frozen_base", "eps_cache",
                                                                "eps_grad_pool"))  # fmt: skip
    phases = result["phases"]
    compute = sum(phases[k].exposed + phases[k].hidden for k in ("forward", "recompute", "backward"))
    dequant = dequantize_time(shape, s, rates) if s.l2l else 0.0
    read = pe.bytes_read(s.prefetch) if s.l2l else 0.0
    terms = {
        "compute": compute,
        "dequantize": dequant,
        "disk_read": read / rates.disk_read,
        "link": phases["transfer"].exposed + phases["transfer"].hidden - dequant,
        "optimizer": phases["optimizer"].exposed + phases["optimizer"].hidden,
    }
    # the relay's reads, copies and the host's updates run beside the compute; the dequantize runs on
    # the compute's stream, in line with it
    lanes = {"compute + dequantize": compute + dequant, "disk read": terms["disk_read"],
             "link": terms["link"], "host optimizer": terms["optimizer"]}  # fmt: skip
    bound = max(lanes, key=lanes.get)
    return {
        **pe.summary(P),
        "optimizer": s.optim,
        "state_bytes_per_trainable_param": s.state_bytes,
        "adapter_state_bytes": s.state_bytes * pe.trainable,
        "base_ram_bytes": mem["host"].get("frozen_base", 0.0),
        "base_readahead_bytes": mem["host"].get("frozen_base_readahead", 0.0),
        "base_disk_bytes": mem["disk"].get("frozen_base_files", 0.0),
        "device_layer_bytes_per_param": float(e) if s.l2l else 4.0,
        "slot_params": pe.max_slot if s.l2l else pe.frozen,
        "device_slot_bytes": mem["device"].get("frozen_base_slots", mem["device"].get("frozen_base", 0.0)),
        "host_bytes_per_param": host_state / P,
        "peft_host_bytes_per_param": host_state / max(1, pe.trainable + pe.frozen),
        "host_bytes_per_param_all": result["host_bytes"] / P,
        "base_loads_per_step": sum(pe.loads(s.prefetch)) if s.l2l else 0,
        "base_bytes_loaded_per_step": pe.bytes_loaded(s.prefetch) if s.l2l else 0.0,
        "base_bytes_read_per_step": read,
        "step_terms_s": terms,
        "bound": bound,
        "bound_s": lanes[bound],
    }


def verdict(shape: ModelShape, s: Setup, rates: Rates, result: dict[str, Any]) -> str:
    """One line: fits, or why not and what to change."""
    if result["fits"]:
        return "fits"
    dev_budget, host_budget = rates.device_memory, rates.host_memory
    need = single_layer_need(shape, s)
    if need > dev_budget:
        fix = "precision=cmp (half-size device copies) or " if s.precision != "cmp" else ""
        return (
            f"does not fit: a single layer needs {fmt_bytes(need)} on the device (the largest layer, "
            f"{shape.max_layer_params / 1e6:.1f}M parameters, and its gradient, with one sample) > budget "
            f"{fmt_bytes(dev_budget)}, so no mode or micro-batch fits; try {fix}a device with more memory"
        )
    pe = shape.peft
    if pe is not None and result["disk_bytes"] > rates.disk_free:
        return (
            f"does not fit: the frozen base's files and the EPS need {fmt_bytes(result['disk_bytes'])} on disk > "
            f"{fmt_bytes(rates.disk_free)} free; try a lower peft.base_dtype (nf4)"
        )
    if result["disk_bytes"] > rates.disk_free:
        return (
            f"does not fit: the disk EPS needs {fmt_bytes(result['disk_bytes'])} on disk > "
            f"{fmt_bytes(rates.disk_free)} free (24 bytes per parameter: two versions of weights and moments)"
        )
    if pe is not None and s.l2l and result["host_node_bytes"] > host_budget and not pe.on_disk:
        from dataclasses import replace as _replace

        from l2l_cli.config.schema import BASE_SOURCES

        on_disk = _replace(shape, peft=_replace(pe, base_source=BASE_SOURCES[1]))
        alt = evaluate(on_disk, s, rates)
        why = (
            f"host memory needs {fmt_bytes(result['host_node_bytes'])} > {fmt_bytes(host_budget)} per node "
            f"(the frozen base in {pe.base_dtype}: {fmt_bytes(pe.stored)}, "
            f"{pe.base_bytes_per_param:.3g} B/param)"
        )
        if alt["fits"]:
            return (
                f"does not fit: {why}; peft.base_source={BASE_SOURCES[1]} fits: the base on disk "
                f"({fmt_bytes(alt['disk_bytes'])}), {fmt_bytes(alt['host_bytes'])} in RAM, "
                f"~{alt['step_time_s']:.3g} s per step"
            )
        return f"does not fit: {why}; try peft.base_source={BASE_SOURCES[1]} or a lower peft.base_dtype (nf4)"
    if result["host_node_bytes"] > host_budget:
        ranks = rates.ranks_on_node(s.nproc)
        why = (
            f"host memory needs {fmt_bytes(result['host_node_bytes'])}"
            + (f" ({ranks} ranks on a node × {fmt_bytes(result['host_bytes'])})" if ranks > 1 else "")
            + f" > {fmt_bytes(host_budget)} per node"
        )
        if s.disk:
            return f"does not fit: {why} (eps.host_cache_layers={s.cache_layers} layers cached); lower it"
        on_disk = next(t for t, kind in TIERS.items() if kind.on_disk)
        alt = evaluate(shape, s.but(tier=on_disk), rates) if s.l2l and s.disk_layout_ok else None
        if alt is not None and alt["fits"]:
            return (
                f"does not fit: {why} (the EPS keeps {s.state_bytes:.3g} bytes per parameter in RAM); "
                f"eps.tier={on_disk} fits: "
                f"{fmt_bytes(alt['disk_bytes'])} on disk, {fmt_bytes(alt['host_bytes'])} in RAM with "
                f"eps.host_cache_layers={s.cache_layers}, ~{alt['step_time_s']:.3g} s per step"
            )
        return f"does not fit: {why} (the EPS keeps {s.state_bytes:.3g} bytes per parameter)"
    parts = result["memory"]["device"]
    worst = max(parts, key=parts.get)
    hints = {
        "training_state": "mode=l2l (the training state moves to host memory)",
        "stash": "mode.stash=cpu (the stash moves to host memory)",
        "working_activations": "a smaller batch.ubatch_size",
        "param_grad_buffers": "mode.prefetch=false (one relay slot)"
        if s.precision == "cmp"
        else "precision=cmp",
    }
    return (
        f"does not fit: device needs {fmt_bytes(result['device_bytes'])} > budget {fmt_bytes(dev_budget)} "
        f"(largest part: {worst.replace('_', ' ')}, {fmt_bytes(parts[worst])}); try {hints[worst]}"
    )


# --------------------------------------------------------------------------------------------------
# Pipeline parallelism (layered-GA §4, appendix C)


def _stage_plan(shape: ModelShape, s: Setup) -> Any:
    from l2l_cli.parallel.pipeline.plan import StagePlan

    return StagePlan(shape.num_layers, s.pipeline, s.placement, s.layers_per_stage)


def _pipeline_ranks(shape: ModelShape, s: Setup, rates: Rates) -> list[dict[str, float]]:
    """Per pipeline rank: forward and backward seconds of its layers over the step's micro-batches, its
    parameters and layers (the embeddings go with the first stage, the head with the last)."""
    plan = _stage_plan(shape, s)
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


def _exchange(shape: ModelShape, s: Setup, rates: Rates) -> float:
    """One exchange between pipeline neighbours: a micro-batch's hidden state (FP32) out and one in."""
    from l2l_cli.parallel.pipeline.plan import exchange_seconds, hidden_bytes

    return exchange_seconds(
        hidden_bytes(s.ubatch, s.seq, shape.hidden), rates.p2p_latency, rates.p2p_bytes_per_s
    )


def _orders(shape: ModelShape, s: Setup) -> list[Any]:
    """Each pipeline rank's actions in a step, in order (``StagePlan.orders``): read off torch's schedule of
    the configured kind, or L2L stages' own loops."""
    from l2l_cli.parallel.pipeline.settings import SCHEDULES

    plan = _stage_plan(shape, s)
    if s.l2l:
        return plan.l2l_orders(s.num_ubatches)
    return plan.orders(s.num_ubatches, *SCHEDULES[s.schedule])


def _simulation(
    shape: ModelShape, s: Setup, rates: Rates, load_s: float = 0.0, orders: list[Any] | None = None
) -> tuple[float, list[float]]:
    """The step's pipeline, simulated in dependency order (``plan.simulate``): (step seconds, each rank's
    compute). A chunk lasts its layers' times per micro-batch (a stage's; L2L stages' per layer: forward,
    then recompute + backward in one chunk); each action ``hardware.pipe_action_us``; each message latency
    + bytes over the link, ``hardware.pipe_wake_us`` later where its sender computes; each L2L relay move
    ``load_s``. ``orders``: :func:`_orders`, where the caller has them."""
    from l2l_cli.parallel.pipeline.plan import simulate, table_cost

    plan = _stage_plan(shape, s)
    lt = rates.layer_times(shape, s.seq, s.ubatch)
    head = shape.num_layers + 1
    fwd = {0: lt.pre_fwd_grad, head: lt.post_fwd_grad}
    bwd = {0: lt.pre_bwd, head: lt.post_bwd}
    per = {i: (fwd.get(i, lt.block_fwd_grad), bwd.get(i, lt.block_bwd)) for i in range(head + 1)}
    if s.l2l:  # a body layer's backward chunk recomputes its forward first
        table = {i: (f, b + (f if i != head else 0.0)) for i, (f, b) in per.items()}
    else:
        table = {st: (sum(per[i][0] for i in plan.layers(st)), sum(per[i][1] for i in plan.layers(st)))
                 for st in range(plan.num_stages)}  # fmt: skip
    return simulate(
        orders if orders is not None else _orders(shape, s),
        table_cost(table, load_s),
        rates.pipe_action,
        _exchange(shape, s, rates),
        rates.pipe_wake,
    )


def pipeline_time(shape: ModelShape, s: Setup, rates: Rates) -> dict[str, Phase]:
    """A pipeline step on its busiest rank: that rank's forward and backward, the bubble (the simulated
    step, :func:`_simulation`, less the busiest rank's compute: appendix C's (P-1)/n_mu fill and drain, ÷ L/P
    for the modular pipeline, where actions and messages are free; what each action and message on the
    critical path adds where not: the modular placement acts and sends L/P times more), its optimizer (on
    the device, or the EPS's on the host for L2L stages), and the data-parallel reduction of its layers'
    gradients, which overlaps the backward of the rank's other stages (each stage reduces as soon as its
    last micro-batch is through)."""
    ph = {p: Phase() for p in PHASES}
    plan = _stage_plan(shape, s)
    ranks = _pipeline_ranks(shape, s, rates)
    r_busy = max(range(s.pipeline), key=lambda r: ranks[r]["forward"] + ranks[r]["backward"])
    busy = ranks[r_busy]
    f, b = busy["forward"], busy["backward"]
    ph["forward"].add(f, f)
    ph["backward"].add(b, b)
    if s.l2l:  # L2L stages recompute each layer's forward in backward
        ph["recompute"].add(f, f)
        b += f
    step, busy_s = _simulation(shape, s, rates)  # the relay's moves: the transfer phase's below
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


def pipeline_memory(shape: ModelShape, s: Setup) -> dict[str, dict[str, float]]:
    """Device bytes of the busiest pipeline rank: its layers' weights and gradients, their moments (shared
    over the data-parallel ranks when partitioned), and the saved activations of its layers for every
    micro-batch in flight (breadth-first and GPipe keep all until backward; 1F1B at most P)."""
    plan = _stage_plan(shape, s)
    head = shape.num_layers + 1
    per = {0: shape.pre_params, head: shape.post_params}
    ranks = [[i for st in plan.stages_of(r) for i in plan.layers(st)] for r in range(s.pipeline)]
    params = max(sum(per.get(i, shape.block_params) for i in layers) for layers in ranks)
    layers = max(len(x) for x in ranks)
    if s.l2l:  # L2L stages: the relay's slots and the stash on the device, the rank's state on its EPS
        A = shape.output_bytes(s.seq, s.precision)
        slots = 2 if s.prefetch else 1
        dev = {"param_grad_buffers": 2.0 * slots * shape.max_layer_params * device_weight_bytes(s.precision),
               "stash": 2.0 * s.ubatch * A if s.stash == "cpu" else layers * s.batch * A,
               "working_activations": s.ubatch * shape.block_working_bytes(s.seq, s.precision, s.att_half) + 2 * s.batch * A}  # fmt: skip
        host = {"training_state": FP32_STATE * params}
        if s.stash == "cpu":
            host["stash"] = layers * s.batch * A
        return {"device": dev, "host": host, "disk": {}}
    moments = 8.0 * params / (s.data_parallel if s.partition_state else 1)
    in_flight = (
        s.num_ubatches if s.schedule in ("breadth_first", "gpipe") else min(s.num_ubatches, s.pipeline)
    )
    saved = shape.block_saved_bytes(s.seq, s.precision, s.att_half)
    working = shape.block_working_bytes(s.seq, s.precision, s.att_half)
    dev = {
        "training_state": 8.0 * params + moments,
        "working_activations": s.ubatch * (in_flight * layers * saved + (working - saved)),
    }
    return {"device": dev, "host": {}, "disk": {}}


def pipeline_view(shape: ModelShape, s: Setup, rates: Rates) -> dict[str, Any] | None:
    """``l2l plan``'s pipeline section: the configured (N, P, placement, schedule), its predicted bubble and
    step time, and the other placements and schedules at the same batch beside it."""
    if s.pipeline <= 1:
        return None
    from l2l_cli.parallel.pipeline.plan import count
    from l2l_cli.parallel.pipeline.settings import SCHEDULES

    rows = []
    for placement in ("modular", "contiguous"):
        lps = s.layers_per_stage if placement == "modular" else 1
        for schedule, (cls, many) in SCHEDULES.items():
            alt = s.but(placement=placement, schedule=schedule, layers_per_stage=lps)
            plan = _stage_plan(shape, alt)
            if shape.num_layers % (s.pipeline * plan.block_size) or (plan.stages_per_rank > 1 and not many):
                continue  # the config check refuses it
            r = evaluate(shape, alt, rates)
            exchange = _exchange(shape, alt, rates)
            # L2L stages: a relay move per layer load or offload, inline where copies do not overlap
            move = rates.copy_time(shape.block_params * device_weight_bytes(alt.precision))
            orders = _orders(shape, alt)
            step, busy = _simulation(shape, alt, rates, 0.0 if rates.async_copy else move, orders)
            acts = count(orders[0])
            rows.append({
                "placement": placement, "schedule": schedule, "torch_schedule": cls,
                "stages_per_rank": plan.stages_per_rank, "bubble_overhead": plan.bubble_overhead(s.num_ubatches),
                "bubble_predicted": sum(1 - c / step for c in busy) / len(busy) if step > 0 else 0.0,
                "actions_per_rank": acts.total, "action_s": rates.pipe_action, "wake_s": rates.pipe_wake,
                "bubble_predicted_paper": plan.bubble_fraction(s.num_ubatches),
                "messages_per_rank": plan.messages_per_rank(s.num_ubatches), "exchange_s": exchange,
                "step_time_s": r["step_time_s"],
                "samples_per_s": r["samples_per_s"], "configured": alt == s,
            })  # fmt: skip
    mine = next(r for r in rows if r["configured"])
    return {
        "pipeline": s.pipeline, "data_parallel": s.data_parallel, "placement": s.placement, "schedule": s.schedule,
        "num_ubatches": s.num_ubatches, "layers_per_stage": s.layers_per_stage, "partition_state": s.partition_state,
        "bubble_overhead": mine["bubble_overhead"], "bubble_predicted": mine["bubble_predicted"],
        "bubble_predicted_paper": mine["bubble_predicted_paper"], "messages_per_rank": mine["messages_per_rank"],
        "exchange_s": mine["exchange_s"], "actions_per_rank": mine["actions_per_rank"], "action_s": mine["action_s"],
        "wake_s": mine["wake_s"], "step_time_s": mine["step_time_s"], "samples_per_s": mine["samples_per_s"],
        "ranks": _pipeline_ranks(shape, s, rates), "alternatives": rows,
    }  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Recompute (mode.recompute, mode.keep_layers)


def block_bytes(shape: ModelShape, s: Setup) -> LayerBytes:
    """One block's bytes per micro-batch for each recompute policy, from the shape (the runner measures
    them): the input (full), plus the matmul outputs (selective: Q/K/V, scores, context, output
    projection, both FFN matmuls), or everything the block saves (none)."""
    e, ub, h = act_bytes(s.precision), s.ubatch, shape.hidden
    a = ub * shape.output_bytes(s.seq, s.precision)
    mm = ub * s.seq * e * (6 * h + shape.intermediate + shape.heads * s.seq)
    return LayerBytes(
        full=int(a),
        selective=int(a + mm),
        none=int(ub * shape.block_saved_bytes(s.seq, s.precision, s.att_half)),
    )


def recompute_choices(
    shape: ModelShape, s: Setup, rates: Rates, policy: str, keep: Any
) -> dict[str, Any] | None:
    """Memory and time of each recompute choice (full, selective, keep_layers 0, N/4, N/2, N) and the one
    ``auto`` picks within the device budget (the runner's rule: :func:`recompute.choose`). A kept block
    skips its recompute; a selective one still runs its elementwise share (``SELECTIVE_SHARE``)."""
    if not s.l2l or s.pipeline > 1:
        return None
    base = evaluate(shape, s, rates)
    dev = base["memory"]["device"]
    N, n = shape.num_layers, s.num_ubatches
    per = block_bytes(shape, s)
    lt = rates.layer_times(shape, s.seq, s.ubatch)
    rec = n * lt.block_fwd_grad  # one block's recompute, every micro-batch
    on_device = s.stash != "cpu"
    room = (
        MARGIN * (rates.device_memory - dev.get("param_grad_buffers", 0.0))
        - (N * n if on_device else 2) * per.full
        - 2 * n * per.full
        - 2 * per.none
    )

    def row(pol: str, kept: int) -> dict[str, Any]:
        plan = choose(RecomputeSettings(pol, kept), N, per, n, room, stash_on_device=on_device)
        stash = n * per.full if on_device else 0
        extra = plan.kept * (n * per.none - stash)
        if plan.policy == "selective":
            extra += (N - plan.kept) * (n * per.selective - stash)
        saved = plan.kept * rec + (N - plan.kept) * rec * (1 - SELECTIVE_SHARE) * (plan.policy == "selective")
        step = base["step_time_s"] - saved
        device = base["device_bytes"] + extra
        return {
            "policy": plan.section()["policy"], "kept_layers": plan.kept, "device_bytes": device,
            "fits": device <= rates.device_memory, "step_time_s": step,
            "samples_per_s": s.batch * s.data_parallel / step if step > 0 else float("inf"),
        }  # fmt: skip

    rows = [row("full", 0), row("selective", 0)]
    for k in sorted({N // 4, N // 2, N} - {0}):
        rows.append(row("full", k))
    pick = choose(RecomputeSettings("auto", "auto"), N, per, n, room, stash_on_device=on_device)
    auto = row(pick.policy, pick.kept)
    configured = None
    if policy != "auto" and keep != "auto":
        configured = row(policy, int(keep or 0) if policy != "none" else N)
    return {"choices": rows, "auto": auto, "configured": configured, "room_bytes": room}
