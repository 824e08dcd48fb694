"""Model families (one file each, registered on import) and the model every runner uses:
``LayeredModel`` = pre · blocks · post, built from ``transformers``' own modules. Importing the families
imports no torch (``l2l plan``, the config's checks): a family's modules load when a run builds a layer,
and ``LayeredModel`` (``layered.py``) on first use."""

from typing import Any

from l2l_cli.models import bert as _bert  # noqa: F401  (registers the BERT family)
from l2l_cli.models import gpt2 as _gpt2  # noqa: F401  (the GPT-2 decoder family)
from l2l_cli.models import llama as _llama  # noqa: F401  (the Llama decoder family: llama, mistral, qwen2)
from l2l_cli.models.base import BLOCK, POST, PRE, ModelSpec
from l2l_cli.models.registry import (
    FAMILIES,
    ModelFamily,
    PretrainedUnavailable,
    UnsupportedModel,
    check_hub,
    check_pretrained,
    family_for_dir,
    family_names,
    family_of,
    make_spec,
    register_family,
    resolve_pretrained,
)

__all__ = [
    "BLOCK",
    "FAMILIES",
    "POST",
    "PRE",
    "LayeredModel",
    "ModelFamily",
    "ModelSpec",
    "PretrainedUnavailable",
    "UnsupportedModel",
    "check_hub",
    "check_pretrained",
    "family_for_dir",
    "family_names",
    "family_of",
    "make_spec",
    "register_family",
    "resolve_pretrained",
]


def __getattr__(name: str) -> Any:
    """``LayeredModel`` imported on first use (it needs torch; the specs and the registry do not)."""
    if name == "LayeredModel":
        from l2l_cli.models.layered import LayeredModel

        return LayeredModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
