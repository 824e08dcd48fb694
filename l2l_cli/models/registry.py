"""The model-family registry. A family is one file that calls :func:`register_family` with how to make
its :class:`~l2l_cli.models.base.ModelSpec` from the ``model.*`` keys or from a Hugging Face directory.

The family of a run comes from ``model.family``, or, with ``model.pretrained``, from the checkpoint's
``config.json`` ``model_type``; a type no family loads is refused in one line that lists the ones that do
(never a random-weight run of the wrong architecture).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from l2l_cli.config.schema import ModelConfig
from l2l_cli.config.settings import typed
from l2l_cli.data.tasks import CLASSIFY
from l2l_cli.models.base import ModelSpec
from l2l_cli.problems import Problem


@dataclass(frozen=True)
class ModelFamily:
    name: str  # model.family
    model_types: tuple[str, ...]  # the config.json model_type values it loads
    description: str
    from_config: Callable[[ModelConfig, int], ModelSpec]  # (model.* keys, num_labels) -> spec
    from_hf_dir: Callable[[Path, ModelConfig, int], ModelSpec]  # (HF dir, model.* keys, num_labels) -> spec
    objective: str = CLASSIFY  # the tasks it trains: CLASSIFY (GLUE, synthetic, files) | LM (task=lm)
    # model.* keys only this family reads (set for another family they are refused: the run would ignore
    # them), and its own rules on the model.* keys; both run by config/validate.py
    keys: tuple[str, ...] = ()
    validate: Callable[[ModelConfig], list[Problem]] | None = None
    # whether a model built from these model.* keys ties its LM head to its token embedding
    tied_head: Callable[[ModelConfig], bool] = lambda m: False


FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    FAMILIES[family.name] = family
    return family


def family_names() -> tuple[str, ...]:
    return tuple(FAMILIES)


def supported_model_types() -> list[str]:
    return sorted(t for f in FAMILIES.values() for t in f.model_types)


class UnsupportedModel(ValueError):
    """A checkpoint of an architecture no family loads (bad input: exit 2)."""


def model_type_of(path: Path) -> str | None:
    """``model_type`` of a Hugging Face directory's config.json (None when it has none)."""
    value = json.loads((path / "config.json").read_text()).get("model_type")
    return str(value) if value is not None else None


def family_for_dir(path: Path, ref: str, default: str = "bert") -> ModelFamily:
    """The family that loads the checkpoint in ``path`` (``ref``: what the user wrote, for the message);
    a config.json without ``model_type`` (some early BERT conversions) is taken as ``default``
    (``model.family``)."""
    model_type = model_type_of(path)
    if model_type is None and default in FAMILIES:
        return FAMILIES[default]
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    raise UnsupportedModel(
        f"{ref} is a {model_type!r} checkpoint (config.json model_type); supported: "
        f"{', '.join(supported_model_types())}"
    )


def family_of(model_cfg: ModelConfig | Any) -> ModelFamily | None:
    """The run's family: a local checkpoint's (config.json model_type), else ``model.family``'s; None when
    it cannot be known offline (a hub id) or is invalid (reported by the model's check). ``model_cfg``:
    the ``model`` node, composed or typed."""
    if model_cfg.pretrained is not None:
        path = Path(model_cfg.pretrained).expanduser()
        if not (path / "config.json").is_file():
            return None
        try:
            return family_for_dir(path, model_cfg.pretrained, model_cfg.family)
        except (UnsupportedModel, OSError, ValueError):
            return None
    return FAMILIES.get(model_cfg.family)


class PretrainedUnavailable(ValueError):
    """A hub checkpoint that cannot be fetched (offline, or no such model): bad input, exit 2."""


def resolve_pretrained(ref: str, config_only: bool = False) -> Path:
    """A local dir holding config.json and the weights for ``ref`` (a dir, or a hub id downloaded; with
    ``config_only``, only its config.json: enough to check the reference before a run starts)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    patterns = (
        ["config.json"] if config_only else ["config.json", "*.safetensors", "*.txt", "*.json", "*.model"]
    )
    try:
        return Path(snapshot_download(ref, allow_patterns=patterns))
    except Exception as e:  # offline, a typo, a private repo: say which, and what to do instead
        reason = f"{type(e).__name__}: {str(e).splitlines()[0]}" if str(e) else type(e).__name__
        raise PretrainedUnavailable(
            f"{ref} cannot be fetched from the Hugging Face hub ({reason}): check the name, or point "
            f"model.pretrained at a local Hugging Face model directory (config.json + weights)"
        ) from e


def make_spec(model_cfg: ModelConfig | Any, num_labels: int) -> ModelSpec:
    """The run's model: from the checkpoint's config.json with ``model.pretrained``, else from ``model.*``
    of the family ``model.family``. ``model_cfg``: the ``model`` node, composed or typed; the family
    gets it typed."""
    model_cfg = typed(model_cfg, ModelConfig)
    if model_cfg.pretrained:
        path = resolve_pretrained(model_cfg.pretrained)
        family = family_for_dir(path, model_cfg.pretrained, model_cfg.family)
        return family.from_hf_dir(path, model_cfg, num_labels)
    return FAMILIES[model_cfg.family].from_config(model_cfg, num_labels)


# ---- model.pretrained: checked before a run (offline), and against the hub by l2l train ----------

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def check_pretrained(ref: str, family: str = "bert") -> list[Problem]:
    """A local Hugging Face directory of a supported architecture, or something shaped like a hub id."""
    path = Path(ref).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            return [
                Problem("model.pretrained", f"{ref} has no config.json; expected a Hugging Face model dir")
            ]
        try:
            json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as e:
            return [Problem("model.pretrained", f"{ref}/config.json is not valid JSON ({e})")]
        try:
            family_for_dir(path, ref, family)
        except UnsupportedModel as e:
            return [Problem("model.pretrained", str(e))]
        weights = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
        if not any((path / n).is_file() for n in weights):
            return [
                Problem(
                    "model.pretrained", f"{ref} has no model.safetensors (or shards, or pytorch_model.bin)"
                )
            ]
        return []
    if ref.startswith((".", "/", "~")) or not _HUB_ID.match(ref):
        return [
            Problem("model.pretrained", f"{ref} is neither an existing directory nor a hub id (org/name)")
        ]
    return []  # a hub id: l2l train fetches its config.json before the run (check_hub), not validation


def check_hub(ref: str, family: str = "bert") -> list[Problem]:
    """A hub id's config.json can be fetched and is of a supported family (network: only ``l2l train``
    calls it, before making a run dir; validation stays offline)."""

    if Path(ref).expanduser().exists():
        return []
    try:
        family_for_dir(resolve_pretrained(ref, config_only=True), ref, family)
    except (PretrainedUnavailable, UnsupportedModel) as e:
        return [Problem("model.pretrained", str(e))]
    except (OSError, ValueError) as e:
        return [Problem("model.pretrained", f"{ref}: unreadable config.json ({e})")]
    return []
