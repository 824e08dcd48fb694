"""The built-in modes' specs: what validation, the planner and ``l2l report`` read of each algorithm (its
precisions, clipping, stash and recompute options, its own rules), registered without torch. Each runner
is imported from its algorithm's file (``baseline.py`` Alg. 1, ``baseline_ag.py`` Alg. 2, ``l2l.py``
Alg. 3, ``l2l_p.py`` Alg. 4) when a run builds it, so ``l2l plan`` never imports torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from l2l_cli.engine.recompute_plan import POLICIES
from l2l_cli.modes.registry import ModeSpec, register_mode
from l2l_cli.problems import Problem, one_of

if TYPE_CHECKING:
    from l2l_cli.modes.base import Runner, RunnerArgs

L2L_PRECISIONS = {"fp32": "fp32", "amp": "amp", "cmp": "cmp", "mixed": "cmp"}


def recompute_rules(cfg: Any) -> list[Problem]:
    """``mode.recompute`` / ``keep_layers`` / ``activation_budget_gb``: the L2L runners read them."""
    p: list[Problem] = []
    m = cfg.mode
    one_of(p, "mode.recompute", m.recompute, POLICIES)
    keep = m.keep_layers
    depth = cfg.model.get("num_layers")
    if keep is not None and keep != "auto":
        if isinstance(keep, bool) or not isinstance(keep, int):
            p.append(Problem("mode.keep_layers", f"got {keep!r}; allowed: an integer 0..depth, or auto"))
        elif keep < 0 or (isinstance(depth, int) and keep > depth):
            bound = f"0..{depth} (model.num_layers)" if isinstance(depth, int) else "0 or more"
            p.append(Problem("mode.keep_layers", f"got {keep}; allowed: {bound}, or auto"))
        elif m.recompute == "none":
            p.append(Problem("mode.keep_layers", "recompute=none keeps every layer; leave keep_layers unset"))
    budget = m.activation_budget_gb
    if budget is not None and not (isinstance(budget, int | float) and budget > 0):
        p.append(Problem("mode.activation_budget_gb", f"got {budget!r}; allowed: a positive number of GiB"))
    return p


def _baseline_runner(args: RunnerArgs) -> Runner:
    from l2l_cli.modes.baseline import BaselineRunner

    return BaselineRunner(args)


BASELINE = register_mode(
    ModeSpec(
        name="baseline",
        label="baseline",
        runner=_baseline_runner,
        description="Alg. 1: the whole minibatch through the whole model on the device, then the update",
        precision_note="cmp keeps the FP32 master in the eager param-server, which only the L2L modes have",
        microbatches=False,
    )
)


def _baseline_ag_runner(args: RunnerArgs) -> Runner:
    from l2l_cli.modes.baseline_ag import BaselineAGRunner

    return BaselineAGRunner(args)


BASELINE_AG = register_mode(
    ModeSpec(
        name="baseline_ag",
        label="baseline-ag",
        runner=_baseline_ag_runner,
        description="Alg. 2: each micro-batch through the whole model on the device, gradients accumulated",
        precision_note="cmp keeps the FP32 master in the eager param-server, which only the L2L modes have",
        # Alg. 2 per stage: the pipeline's micro-batches accumulate each stage's gradient
        pipeline_stage=True,
    )
)


def _l2l_runner(args: RunnerArgs) -> Runner:
    from l2l_cli.modes.l2l import L2LRunner

    return L2LRunner(args, L2L)


L2L = register_mode(
    ModeSpec(
        name="l2l",
        label="l2l",
        runner=_l2l_runner,
        decodes=True,
        description="Alg. 3: layers relayed from the eager param-server, every micro-batch through layer l "
        "first",
        precisions=L2L_PRECISIONS,
        stash=("device", "cpu"),
        recompute=True,
        validate=recompute_rules,
        host_state="eps",
        distribute="eps",
        state_layout="eps-flat-v1",  # shared by l2l and l2l_p: either resumes the other's checkpoints
        pipeline_stage=True,  # dist.pipeline > 1: each rank's EPS holds its stages (parallel/pipeline/l2l.py)
    )
)


def _l2l_p_runner(args: RunnerArgs) -> Runner:
    from l2l_cli.modes.l2l_p import L2LPRunner

    return L2LPRunner(args, L2L_P)


L2L_P = register_mode(
    ModeSpec(
        name="l2l_p",
        label="l2l-p",
        runner=_l2l_p_runner,
        decodes=True,
        description="Alg. 4: L2L with the host update of layer l+1 overlapped with the backward of layer l",
        precisions=L2L_PRECISIONS,
        default_clip="global",  # exact: speculative updates, rolled back and redone when clipping applies
        clips=("global", "layer", "none"),
        stash=("device", "cpu"),
        recompute=True,
        validate=recompute_rules,
        host_state="eps",
        undo_log=True,
        overlapped_update=True,
        distribute="eps",
        state_layout="eps-flat-v1",
        # dist.pipeline > 1: the verdict on the pipeline's norms (pipeline/l2l_stages.py)
        pipeline_stage=True,
    )
)
