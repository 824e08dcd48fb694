"""Where the shipped config trees live, for editable and installed (wheel) layouts alike."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _find(name: str, marker: str) -> Path:
    # A wheel carries conf/ and recipes/ inside the package (pyproject force-include); an editable
    # install or a source checkout has them at the repository root, next to the package.
    for cand in (_PKG / name, _PKG.parent / name):
        if (cand / marker).exists():
            return cand
    raise FileNotFoundError(f"l2l: cannot find the {name}/ folder next to {_PKG}")


def conf_dir() -> Path:
    """The Hydra config tree (conf/config.yaml and its groups)."""
    return _find("conf", "config.yaml")


def recipes_dir() -> Path:
    """The recipes folder: one override file per paper table or study."""
    return _find("recipes", ".")
