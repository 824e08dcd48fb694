"""The training budget a plan answers for: ``plan.tokens`` (a fine-tune: 100e6 tokens), ``plan.steps`` (steps
of the configured batch), else ``plan.train_steps`` steps of the configured batch; for a model a paper
analyses (``models/papers.py``: X[x]), where the command line gives none of ``plan.tokens``, ``plan.steps``
and ``batch.size``, the paper's: ``plan.train_steps`` steps at the critical batch (layered-GA §6).

Every view of one question converts the same budget: the L2L step view into its steps, the per-configuration
layered-GA view and ``--search`` into samples of the model's sequence (so that a configuration both can
express takes the same time in both). ``--scaling`` always keeps the layered-GA paper's pretraining budget,
``plan.train_steps`` steps at the critical batch (§6), and says so.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from l2l_cli.models.papers import paper_question
from l2l_cli.plan.scaling import x_critical_batch_size


@dataclass(frozen=True)
class Budget:
    """Tokens, or steps of a global batch of ``batch`` samples; ``source`` names the key it came from.
    ``critical``: the batch is the model's critical batch (the paper's budget), not one configured."""

    tokens: float = 0.0
    steps: int = 0
    batch: float = 1
    source: str = "plan.train_steps"
    critical: bool = False

    def samples(self, seq: int) -> float:
        """Samples of ``seq`` tokens the budget trains on."""
        return self.tokens / seq if self.tokens else float(self.steps * self.batch)

    def steps_of(self, batch: int, seq: int) -> float:
        """Optimizer steps of ``batch`` samples of ``seq`` tokens the budget takes."""
        return self.samples(seq) / batch

    @property
    def label(self) -> str:
        if self.tokens:
            n = next(
                (
                    (self.tokens / k, u)
                    for u, k in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3))
                    if self.tokens >= k
                ),
                (self.tokens, ""),
            )
            return f"{n[0]:.3g}{n[1]} tokens ({self.source})"
        if self.critical:
            return f"{self.steps:,} steps at the critical batch {self.batch:.4g} ({self.source})"
        return f"{self.steps:,} steps of batch {self.batch} ({self.source})"

    def summary(self, seq: int) -> dict[str, Any]:
        return {
            "source": self.source,
            "tokens": self.tokens or self.samples(seq) * seq,
            "samples": self.samples(seq),
            "label": self.label,
        }


def global_batch(cfg: Any) -> int:
    """The configured batch across data-parallel ranks: batch.size × the data-parallel degree (``dist.nproc``
    over its pipelines, or ``plan.data_parallel`` for the layered-GA view, whichever is larger)."""
    dp = max(1, int(cfg.dist.nproc) // max(1, int(cfg.dist.pipeline)), int(cfg.plan.data_parallel))
    return int(cfg.batch.size) * dp


def command_keys(overrides: Collection[str]) -> frozenset[str]:
    """The keys a command line sets (``batch.size=64`` -> ``batch.size``; a group choice names its group)."""
    return frozenset(o.lstrip("+~").split("=", 1)[0] for o in overrides)


def budget_of(cfg: Any, given: Collection[str] = ()) -> Budget:
    """The config's budget (module doc); ``given``: the keys the command line sets (``command_keys``)."""
    plan = cfg.plan
    if plan.tokens:
        return Budget(tokens=float(plan.tokens), source="plan.tokens")
    if plan.steps:
        return Budget(steps=int(plan.steps), batch=global_batch(cfg), source="plan.steps")
    paper = paper_question(cfg.model)
    if paper is not None and not set(paper.budget_keys) & set(given):
        b_c = x_critical_batch_size(int(cfg.model.x))
        return Budget(steps=int(plan.train_steps), batch=b_c, source=paper.source, critical=True)
    return Budget(steps=int(plan.train_steps), batch=global_batch(cfg), source="plan.train_steps")


def paper_terms(cfg: Any, given: Collection[str]) -> tuple[float | None, bool]:
    """What the paper the model declares (``models/papers.py``) sets that the command line does not: its
    efficiency (None: the preset's hardware.mfu) and whether offload has no host-memory bound."""
    paper, keys = paper_question(cfg.model), set(given)
    if paper is None:
        return None, False
    rate = None if set(paper.rate_keys) & keys else paper.mfu
    return rate, not paper.host_memory_bound and not set(paper.host_keys) & keys
