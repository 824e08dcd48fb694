"""The training budget a plan answers for: ``plan.tokens`` (a fine-tune: 100e6 tokens), ``plan.steps`` (steps
of the configured batch), else ``plan.train_steps`` steps of the configured batch.

Every view of one question converts the same budget: the L2L step view into its steps, the per-configuration
layered-GA view and ``--search`` into samples of the model's sequence (so that a configuration both can
express takes the same time in both). Only ``--scaling`` keeps the layered-GA paper's pretraining budget,
``plan.train_steps`` steps at the critical batch (§6), and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Budget:
    """Tokens, or steps of a global batch of ``batch`` samples; ``source`` names the key it came from."""

    tokens: float = 0.0
    steps: int = 0
    batch: int = 1
    source: str = "plan.train_steps"

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


def budget_of(cfg: Any) -> Budget:
    """The config's budget (module doc)."""
    plan = cfg.plan
    if plan.tokens:
        return Budget(tokens=float(plan.tokens), source="plan.tokens")
    if plan.steps:
        return Budget(steps=int(plan.steps), batch=global_batch(cfg), source="plan.steps")
    return Budget(steps=int(plan.train_steps), batch=global_batch(cfg), source="plan.train_steps")
