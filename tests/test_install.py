"""What installing l2l asks of a user's environment (pyproject.toml), and what setup.sh keeps."""

from __future__ import annotations

import tomllib
from packaging.requirements import Requirement

from tests.util import REPO


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {r.name: r for r in map(Requirement, project["dependencies"])}


def test_a_newer_torch_can_install_l2l() -> None:
    """No upper bound on torch: a user with a newer release must not be locked out (the tests run on the
    CPU wheel 2.13.0 that scripts/setup.sh installs first)."""
    torch = _requirements()["torch"].specifier
    assert torch.contains("2.13.0") and torch.contains("2.20.0") and torch.contains("3.0.0")
    assert not any(s.operator in ("<", "<=", "==", "~=") for s in torch)


def test_setup_installs_the_cpu_wheel_before_the_package() -> None:
    """setup.sh pins torch==2.13.0 (a CPU wheel on CPU machines) before ``pip install -e .``, so the
    open range never pulls a multi-GB CUDA build there."""
    lines = (REPO / "scripts" / "setup.sh").read_text().splitlines()
    pin = next(i for i, ln in enumerate(lines) if "torch==2.13.0" in ln)
    package = next(i for i, ln in enumerate(lines) if 'install -q -e ".[dev]"' in ln)
    assert pin < package
