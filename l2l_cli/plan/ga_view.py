"""The layered-GA view of one config (``l2l plan``'s section beside l2l's own model): the paper's
transformer for the tool's model, and the paper's three methods analysed at the config's batch, ranks and
budget."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from l2l_cli.plan.scaling import METHODS, Links, Parallel, Transformer, analyze, batch_flops


def transformer_of(shape: Any, d_s: int) -> Transformer:
    """The paper's transformer for a model of the tool: its depth, width, heads and sequence, with n_I
    set so that p_l = (4 + 2·n_I)·d_m² + (9 + n_I)·d_m is the block's exact parameter count (n_I = 4 for
    BERT and GPT-2; a SwiGLU block's three MLP matrices count as 1.5·d_I/d_m)."""
    d = shape.hidden
    n_i = (shape.block_params - 4 * d * d - 9 * d) / (2 * d * d + d)
    return Transformer(shape.num_layers, d, shape.heads, int(d_s), n_i)


def for_config(cfg: Any, shape: Any, links: Links, given: Collection[str] = ()) -> dict[str, Any]:
    """The layered-GA analysis of the config: d_s = model.seq_len (the model's context, as the paper's
    X[x] and BERT rows use), b = batch.size × n_b (plan.data_parallel, or the config's data-parallel ranks),
    n_l = plan.pipeline_parallel or dist.pipeline, b_mu = batch.ubatch_size, trained on the
    config's budget (``plan/budget.py``; ``given``: the command line's keys) in samples of d_s, as
    ``--search`` trains it."""
    from l2l_cli.plan.budget import budget_of

    m = transformer_of(shape, int(cfg.model.seq_len))
    # the config's own ranks (dist.nproc over dist.pipeline) where plan.* does not say more
    pipe = max(1, int(cfg.dist.pipeline))
    nb = max(cfg.plan.data_parallel, int(cfg.dist.nproc) // pipe)
    nl, na = max(cfg.plan.pipeline_parallel, pipe), cfg.plan.tensor_parallel
    b, bmu = cfg.batch.size * nb, cfg.batch.ubatch_size
    budget = budget_of(cfg, given)
    samples = budget.samples(m.d_s)
    rows = []
    for method in METHODS:
        c = Parallel(method, b, bmu, cfg.batch.size // bmu, nb, nl, na)
        rows.append(analyze(m, c, links, samples=samples))
    return {
        "budget": budget.label,
        "rate_tflops": links.rate / 1e12,
        "mfu": links.mfu,
        "d_s": m.d_s,
        "params": m.p,
        "params_per_layer": m.p_l,
        "critical_batch_size": m.critical_batch_size,
        "batch": b,
        "batch_vs_critical": b / m.critical_batch_size,
        "flops_per_batch": batch_flops(b, m.d_s, m.p),
        "methods": rows,
    }
