"""Validation of the composed config: every group's check (:mod:`l2l_cli.config.checks`, then
:mod:`l2l_cli.config.placement`, registered in that order), after the values every group shares (finite
numbers, sizes that are not typos); every problem at once, each one line naming the key and what is
allowed."""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, OmegaConf

from l2l_cli.config.checks import CHECKS, Config
from l2l_cli.config.placement import eps_space  # (its import registers its groups after checks.py's)
from l2l_cli.config.settings import is_marked, remember_valid
from l2l_cli.engine.tiers import TIERS
from l2l_cli.problems import ConfigError, Problem

# Sizes beyond these are typos, not models: refuse them before a run tries to allocate them.
LIMITS = {
    "model.num_layers": 100_000,
    "model.hidden_size": 65_536,
    "model.num_heads": 4_096,
    "model.intermediate_size": 1_048_576,
    "model.vocab_size": 10_000_000,
    "model.seq_len": 1_048_576,
    "model.type_vocab_size": 1_024,
    "task.max_seq_len": 1_048_576,
    "batch.size": 1_048_576,
    "batch.ubatch_size": 1_048_576,
    "dist.nproc": 4_096,
    "trainer.epochs": 1_000_000,
}


def _select(cfg: Config, key: str) -> Any:
    if isinstance(cfg, DictConfig):
        return OmegaConf.select(cfg, key)
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _limits(cfg: Config) -> list[Problem]:
    p = []
    for key, hi in LIMITS.items():
        value = _select(cfg, key)
        if isinstance(value, int) and value > hi:
            p.append(Problem(key, f"got {value}; must be <= {hi}"))
    return p


def _finite(cfg: Any, prefix: str = "") -> list[Problem]:
    """Every float in the config is a real number (nan and inf pass most range checks silently)."""
    p = []
    items = cfg.items() if isinstance(cfg, DictConfig) else vars(cfg).items()
    for k, v in items:
        if k == "hydra" and not prefix:  # Hydra's own node, when composed with it
            continue
        if isinstance(v, DictConfig) or hasattr(v, "__dataclass_fields__"):
            p.extend(_finite(v, f"{prefix}{k}."))
        elif isinstance(v, float) and not math.isfinite(v):
            p.append(Problem(f"{prefix}{k}", f"got {v}; must be a finite number"))
    return p


def validate(cfg: Config, *, check_files: bool = True, check_space: bool = True) -> list[Problem]:
    """Cross-field rules of the composed config. Returns every problem found (empty when valid).
    ``check_space``: with ``check_files``, whether the EPS tier's directory on this machine can hold the
    model's state (``l2l plan`` asks about another machine: its ``hardware.disk_free_gb`` answers that).

    A config marked validated (:func:`~l2l_cli.config.settings.mark_validated`: the CLI's preflight checked
    these exact values, files included, in this process) is not checked again: no problems. A config that
    passes in full is remembered (:func:`~l2l_cli.config.settings.validated_before`)."""
    if is_marked(cfg):
        return []
    problems = _finite(cfg) + _limits(cfg)
    eps_ok = True
    for group, fn in CHECKS:
        found = fn(cfg, check_files)
        eps_ok = eps_ok and not (group == "eps" and found)
        problems.extend(found)
    tier = TIERS.get(cfg.eps.tier)
    if check_files and check_space and eps_ok and tier is not None:
        problems.extend(eps_space(cfg, tier))
    # a checkpoint that cannot be had is one fact, though the model, the tokenizer and the data all read it
    first = next((p for p in problems if p.key == "model.pretrained"), None)
    problems = [p for p in problems if p.key != "model.pretrained" or p is first]
    if not problems and check_files and check_space:
        remember_valid(cfg)
    return problems


def require_valid(cfg: Config) -> None:
    """Raise :class:`~l2l_cli.problems.ConfigError` with every problem of ``cfg`` (exit 2, one line each):
    what a command runs at its entry, before it builds a session (a config marked validated passes at
    once)."""
    problems = validate(cfg)
    if problems:
        raise ConfigError(problems)
