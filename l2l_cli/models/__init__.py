"""Model families (one file each, registered on import) and the model every runner uses:
``LayeredModel`` = pre · blocks · post, built from ``transformers``' own modules."""

from l2l_cli.models import bert as _bert  # noqa: F401  (registers the BERT family)
from l2l_cli.models.base import BLOCK, POST, PRE, LayeredModel, ModelSpec
from l2l_cli.models.registry import (
    FAMILIES,
    ModelFamily,
    PretrainedUnavailable,
    UnsupportedModel,
    family_for_dir,
    family_names,
    make_spec,
    register_family,
    resolve_pretrained,
)

__all__ = [
    "BLOCK", "FAMILIES", "POST", "PRE", "LayeredModel", "ModelFamily", "ModelSpec", "PretrainedUnavailable",
    "UnsupportedModel",
    "family_for_dir", "family_names", "make_spec", "register_family", "resolve_pretrained",
]  # fmt: skip
