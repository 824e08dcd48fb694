"""Soak (slow): 300 steps of bert-tiny in l2l, l2l_p and on the disk tier; after the first 100 steps the
process's RSS grows by at most 2% and its open files and threads stay constant (benchmarks/soak.py runs
the same for 2,000 steps)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.util import REPO


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", REPO / "benchmarks" / "soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("config", ["l2l", "l2l_p", "disk"])
def test_no_leak_over_300_steps(tmp_path, config: str) -> None:
    soak = _soak_module()
    result = soak.soak(config, steps=300, every=100, out=tmp_path)
    assert len(result["samples"]) >= 2, result  # sampled at steps 100 and 200 at least
    assert result["fds_constant"] and result["threads_constant"], result["samples"]
    assert result["rss_growth"] <= soak.RSS_GROWTH, result["samples"]
