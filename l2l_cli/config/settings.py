"""Typed settings: a composed config (an OmegaConf ``DictConfig``) as the schema's dataclasses, so the parts
that read it (``data/``, ``models/``) get a :class:`~l2l_cli.config.schema.TaskConfig`, a
:class:`~l2l_cli.config.schema.ModelConfig` or the whole :class:`~l2l_cli.config.schema.L2LConfig`, with
interpolations resolved and every field of its declared type, never an untyped node.

A config the CLI has validated carries a mark (:func:`mark_validated`), so the session that runs it does not
validate it a second time (:func:`l2l_cli.config.validate.validate` returns at once for a marked config)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf, open_dict

from l2l_cli.config.schema import L2LConfig

T = TypeVar("T")
Config = DictConfig | L2LConfig  # a composed config, or the schema's dataclasses

_FLAG = "l2l_validated"  # an OmegaConf flag on the config node: validated by this process already
_VALID: set[str] = set()  # digests of the configs validated in full by this process


def typed(node: Any, cls: type[T]) -> T:
    """``node`` (a config node of ``cls``'s schema, or already a ``cls``) as a ``cls`` instance: resolved,
    and type-checked by OmegaConf. A node composed from the schema converts directly; one read back from
    YAML (a rank's copy, a saved run's) is merged into the schema first."""
    if isinstance(node, cls):
        return node
    if not isinstance(node, DictConfig):
        raise TypeError(f"expected a config node of {cls.__name__}, got {type(node).__name__}")
    if OmegaConf.get_type(node) is not cls:
        node = OmegaConf.merge(OmegaConf.structured(cls), node)
    if "hydra" in node:  # Hydra's own node, when composed with it: not part of the schema
        node = node.copy()
        with open_dict(node):
            node.pop("hydra")
    out = OmegaConf.to_object(node)
    assert isinstance(out, cls)
    return out


def settings(cfg: Config) -> L2LConfig:
    """The whole config as typed settings (see :func:`typed`)."""
    return typed(cfg, L2LConfig)


def digest(cfg: Config) -> str:
    """A config's identity: its resolved values without Hydra's node (what validation reads), as sorted
    JSON (a few ms; YAML of a config made from them took ten times as long, once per validation)."""
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    plain = {k: _plain(node[k]) for k in node if k != "hydra"}  # each group resolved on its own: Hydra's
    text = json.dumps(plain, sort_keys=True, default=repr)  # node may not resolve here; enums as repr
    return hashlib.sha256(text.encode()).hexdigest()


def remember_valid(cfg: Config) -> None:
    """Record that a config with ``cfg``'s values passed validation in full (its files and space too)."""
    _VALID.add(digest(cfg))


def forget_valid() -> None:
    """Forget every config validated so far (a new command validates its own: a file may have changed)."""
    _VALID.clear()


def validated_before(cfg: Config) -> bool:
    """Whether this process validated a config with ``cfg``'s values in full (the CLI's preflight)."""
    return bool(_VALID) and digest(cfg) in _VALID


def mark_validated(cfg: DictConfig) -> None:
    """Mark ``cfg`` as validated: :func:`~l2l_cli.config.validate.validate` returns no problems for it
    without checking again (the CLI marks the config it runs when its preflight validated the same values)."""
    cfg._set_flag(_FLAG, True)


def is_marked(cfg: Config) -> bool:
    return isinstance(cfg, DictConfig) and bool(cfg._get_flag(_FLAG))


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
