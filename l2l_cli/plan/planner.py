"""``make_plan(cfg)``: everything ``l2l plan`` prints, as one JSON-ready dict."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

from l2l_cli.plan import PlanError, scaling, views
from l2l_cli.plan import estimate as est
from l2l_cli.plan.budget import budget_of, paper_terms
from l2l_cli.plan.ga_view import for_config
from l2l_cli.plan.hardware import Rates, resolve
from l2l_cli.plan.knobs import Setup
from l2l_cli.plan.shapes import ModelShape
from l2l_cli.plan.steptime import Phase


def model_shape(cfg: Any) -> tuple[ModelShape, list[str]]:
    """The model's shape as ``l2l train`` would build it (its family's spec: a local pretrained dir's
    config.json wins), with its LoRA numbers under ``peft=lora``. Nothing is downloaded: a hub id plans
    with the ``model.*`` sizes."""
    shape, notes = _plain_shape(cfg)
    if cfg.peft.name == "none":
        return shape, notes
    from dataclasses import replace

    from l2l_cli.plan.peft import peft_shape

    return replace(shape, peft=peft_shape(shape.spec, cfg.peft)), notes


def _plain_shape(cfg: Any) -> tuple[ModelShape, list[str]]:
    from l2l_cli.data.tasks import TASKS
    from l2l_cli.models import FAMILIES, UnsupportedModel, family_for_dir

    notes = []
    num_labels = TASKS[cfg.task.name].num_labels
    m = cfg.model
    ref = m.pretrained
    path = Path(ref).expanduser() if ref else None
    if path is not None and (path / "config.json").is_file():
        try:
            return ModelShape.from_spec(
                family_for_dir(path, ref, m.family).from_hf_dir(path, m, num_labels)
            ), notes
        except UnsupportedModel as e:
            raise PlanError(f"model.pretrained: {e}") from e
    if ref:
        notes.append(f"model.pretrained={ref} is not a local directory: sizes from model.* (no download)")
    return ModelShape.from_spec(FAMILIES[m.family].from_config(m, num_labels)), notes


def head_parts(shape: ModelShape) -> str:
    """What the post layer holds: an encoder's pooler and classifier, a decoder's final norm and LM head."""
    from l2l_cli.data.tasks import LM
    from l2l_cli.models import FAMILIES

    return "final norm, LM head" if FAMILIES[shape.spec.family].objective == LM else "pooler, classifier"


def links_of(rates: Rates, cfg: Any, given: Collection[str] = ()) -> scaling.Links:
    """The layered-GA view's machine: the rates', at the paper's efficiency for a model a paper analyses
    (``budget.paper_terms``), as ``--search`` takes it."""
    hw = cfg.hardware
    paper_rate, _ = paper_terms(cfg, given)
    return scaling.Links(
        peak_flops=rates.peak_flops,
        mfu=rates.mfu if paper_rate is None or rates.measured is not None else paper_rate,
        network_gbps=hw.network_gbps,
        tensor_gbps=hw.tensor_link_gbps,
        offload_gbps=hw.offload_gbps,
        device_memory_gib=rates.device_memory / scaling.GiB,
    )


def _phases(phases: dict[str, Phase]) -> tuple[dict[str, float], dict[str, float]]:
    exposed = {k: p.exposed for k, p in phases.items()}
    hidden = {k: p.hidden for k, p in phases.items()}
    return exposed, hidden


def make_plan(cfg: Any, rates: Rates | None = None, given: Collection[str] = ()) -> dict[str, Any]:
    """The plan for a composed (and validated) config. ``rates`` overrides the hardware (tests, reuse);
    ``given``: the keys the command line sets (a paper's budget and efficiency yield to them)."""
    shape, notes = model_shape(cfg)
    rates = rates or resolve(cfg, shape)
    s = Setup.from_cfg(cfg)
    r = est.evaluate(shape, s, rates)
    recompute = views.recompute_choices(shape, s, rates, cfg.mode.recompute, cfg.mode.keep_layers, r)
    if recompute is not None:  # the step as the run will take it: mode.recompute as it resolves here
        pick = recompute["configured"] or recompute["auto"]
        if pick["kept_layers"] or pick["policy"] == "selective":
            extra = pick["device_bytes"] - r["device_bytes"]  # what the kept graphs hold beyond the stash
            s = replace(
                s, recompute_kept=pick["kept_layers"], recompute_selective=pick["policy"] == "selective"
            )
            r = est.evaluate(shape, s, rates)
            r["memory"]["device"]["kept_activations"] = extra
            r["device_bytes"] += extra
            r["fits"] = r["fits"] and bool(pick["fits"])
    exposed, hidden = _phases(r["phases"])
    ga = for_config(cfg, shape, links_of(rates, cfg, given), given)
    if cfg.model.x is not None:
        ga["critical_batch_size"] = scaling.x_critical_batch_size(int(cfg.model.x))  # Table B.1's form
        ga["batch_vs_critical"] = ga["batch"] / ga["critical_batch_size"]
    mem = r["memory"]
    budget = budget_of(cfg, given)
    steps = budget.steps_of(s.batch * s.data_parallel, s.seq)
    return {
        "config": {
            "model": cfg.model.name,
            "method": s.label,
            "mode": s.mode,
            "stash": s.stash,
            "prefetch": s.prefetch,
            "precision": s.precision,
            "optimizer": cfg.optim.name,
            "peft": cfg.peft.name,
            "num_layers": shape.num_layers,
            "hidden_size": shape.hidden,
            "seq_len": s.seq,
            "batch_size": s.batch,
            "ubatch_size": s.ubatch,
            "num_ubatches": s.num_ubatches,
            "nproc": s.nproc,
            "eps_tier": s.tier if s.l2l else None,
            "eps_host_cache_layers": s.cache_layers if s.disk else None,
            "pipeline": s.pipeline,
            "device": cfg.device.name,
        },
        "hardware": rates.summary(),
        "params": {
            "total": shape.total_params,
            "embeddings": shape.pre_params,
            "blocks": shape.blocks_params,
            "per_block": shape.block_params,
            "head": shape.post_params,
            "head_parts": head_parts(shape),
        },
        "memory_bytes": {
            "device": {"total": r["device_bytes"], "parts": mem["device"], "budget": rates.device_memory},
            "host": {
                "total": r["host_bytes"],
                "parts": mem["host"],
                "budget": rates.host_memory,
                "node_total": r["host_node_bytes"],
                "ranks_on_node": rates.ranks_on_node(s.nproc),
            },
            "disk": {"total": r["disk_bytes"], "parts": mem["disk"], "budget": rates.disk_free},
        },
        "eps_tier": est.eps_tier(shape, s, rates),
        "fits": r["fits"],
        "verdict": views.verdict(shape, s, rates, r),
        "step_time_s": {"total": r["step_time_s"], **exposed},
        "hidden_s": hidden,
        "samples_per_s": r["samples_per_s"],
        "budget": {**budget.summary(s.seq), "steps": steps, "time_s": steps * r["step_time_s"]},
        "recommendation": est.recommend(shape, s, rates, cfg.plan.max_transfer_overhead),
        "modes": est.compare_modes(shape, s, rates),
        "equations": est.equations(shape, s, rates),
        "critical_batch_size": ga["critical_batch_size"],
        "layered_ga": ga,
        "pipeline": views.pipeline_view(shape, s, rates),
        "peft": views.peft_view(shape, s, rates, r),
        "recompute": recompute,
        "notes": notes + list(rates.notes),
    }
