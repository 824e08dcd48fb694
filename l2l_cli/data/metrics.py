"""GLUE's official metrics, computed with scikit-learn and scipy (not by hand)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef


def compute(names: Sequence[str], preds: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Metric name -> value. ``preds`` are class ids (classification) or scores (regression)."""
    out: dict[str, float] = {}
    for name in names:
        if name == "accuracy":
            out[name] = float(accuracy_score(labels, preds))
        elif name == "f1":
            out[name] = float(f1_score(labels, preds))
        elif name == "mcc":
            out[name] = float(matthews_corrcoef(labels, preds))
        elif name == "pearson":
            out[name] = float(pearsonr(preds, labels)[0]) if np.std(preds) > 0 else 0.0
        elif name == "spearmanr":
            out[name] = float(spearmanr(preds, labels)[0]) if np.std(preds) > 0 else 0.0
        else:
            raise ValueError(f"unknown metric {name}")
    return out
