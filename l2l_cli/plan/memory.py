"""Device, host and disk bytes of one step, by part, at the step's peak (l2l-v1 eqs. 1-4, the layered-GA
breakdown), for one rank and for a pipeline stage.
"""

from __future__ import annotations

from l2l_cli.engine.optim import state_of
from l2l_cli.engine.tiers.disk.layout import cache_bytes
from l2l_cli.plan.knobs import FP32_STATE, LOW_BIT, Setup, stage_plan
from l2l_cli.plan.shapes import ModelShape, device_weight_bytes


def memory(shape: ModelShape, s: Setup) -> dict[str, dict[str, float]]:
    """Device, host and disk bytes by part, at the step's peak. The parts follow the layered-GA breakdown:
    training state, activation stash (checkpoints), parameter + gradient buffers, working activations.
    With LoRA (``shape.peft``) the training state is the adapters' alone; the frozen base is a part of its
    own, where ``peft.base_source`` keeps it, at ``peft.base_dtype``'s bytes (plan/peft.py)."""
    P, N = shape.total_params, shape.num_layers
    pe = shape.peft
    P_state = pe.trainable if pe else P  # parameters with a master, a gradient and moments
    state = s.state_bytes_with(pe.small_share) if pe else s.state_bytes  # (a full model's small tensors: few)
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
        dev["training_state"] = state * P_state
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
            # k cache slots of weights and gradient (and the half send copies), one update buffer of
            # moments (layout.cache_bytes: what the tier allocates); the state and L2L-p's undo (the slot
            # an update does not overwrite) are in the layer files
            k = min(s.cache_layers, N + 2)
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
            send = 2 if s.precision == "cmp" else 4
            host["eps_cache"] = float(
                cache_bytes([int(x) for x in numels], k, send, s.bf16_master_planes, state_of(s.optim))
            )
            # the gradients waiting for the clipping verdict (or their update): eps.grad_ram_layers buffers,
            # at most the largest layers' gradients, whatever the depth; the others wait on disk (an applied
            # one kept for a redo in kept_grads.eps, sparse: at most 4 bytes per parameter)
            pool = s.pool_layers(L_state, N + 2)
            host["eps_grad_pool"] = 4.0 * sum(largest[:pool])
            disk["eps_files"] = s.disk_state_bytes * P_state
            if s.clip_global and pool < N + 2:
                disk["eps_kept_grads"] = 4.0 * P_state
        else:
            host["training_state"] = state * P_state
            if s.spec.undo_log:  # weights and moments before the early update (skip on overflow)
                host["undo_copies"] = (state - 4.0) * P_state
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


def pipeline_memory(shape: ModelShape, s: Setup) -> dict[str, dict[str, float]]:
    """Device bytes of the busiest pipeline rank: its layers' weights and gradients, their moments (shared
    over the data-parallel ranks when partitioned), and the saved activations of its layers for every
    micro-batch in flight (breadth-first and GPipe keep all until backward; 1F1B at most P)."""
    plan = stage_plan(shape, s)
    head = shape.num_layers + 1
    per = {0: shape.pre_params, head: shape.post_params}
    ranks = [[i for st in plan.stages_of(r) for i in plan.layers(st)] for r in range(s.pipeline)]
    params = max(sum(per.get(i, shape.block_params) for i in layers) for layers in ranks)
    layers = max(len(x) for x in ranks)
    if s.l2l:  # L2L stages: the relay's slots and the stash on the device, the rank's state on its EPS
        A = shape.output_bytes(s.seq, s.precision)
        slots = 2 if s.prefetch else 1
        dev = {
            "param_grad_buffers": 2.0 * slots * shape.max_layer_params * device_weight_bytes(s.precision),
            "stash": 2.0 * s.ubatch * A if s.stash == "cpu" else layers * s.batch * A,
            "working_activations": s.ubatch * shape.block_working_bytes(s.seq, s.precision, s.att_half)
            + 2 * s.batch * A,
        }
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
