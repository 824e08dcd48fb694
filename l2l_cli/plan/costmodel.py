"""The L2L papers' cost model, as pure functions of the papers' symbols.

l2l-v1 §3.1 (memory at the start of the backward pass, eqs. 1-4; minibatch time, eqs. 5-7) and l2l-v2
§2.2.1 (transfer overhead against the number of micro-batches, eqs. 1-6). Symbols as in the papers:

  N    transformer layers              L    bytes of one layer (what crosses the link)
  mb   minibatch (samples)             u    micro-batches per minibatch (ubatch = mb / u samples)
  X    intermediate activation bytes per sample of one layer (v1); layer transfer time (v2)
  A    output activation bytes per sample of one layer
  Ft   forward time of one layer on one micro-batch;  Bt its backward time
  Ot   optimizer time on the device;  Otc on the host (EPS);  Hb host->device bandwidth (bytes/s)
  C    (v2) forward time of one layer on one micro-batch (= Ft)

Times are seconds, sizes bytes, bandwidths bytes/s. ``estimate.py`` builds these inputs from a config.
"""

from __future__ import annotations

import math

# --------------------------------------------------------------------------------------------------
# l2l-v1 §3.1.1: memory at the beginning of the backward pass


def baseline_memory(N: int, L: float, mb: int, X: float, A: float, ubatch: int | None = None) -> float:
    """Eq. 1: ``4·N·L + N·mb·X + mb·A``: parameters, gradients and Adam's two moments (4·N·L), every
    layer's intermediate activations, and the output. The paper prints the middle term N·L·mb·X; the L
    is a typo (the term is N layers' activations for mb samples). With accumulated gradients only one
    micro-batch is live: pass ``ubatch`` and the middle term uses it."""
    return 4 * N * L + N * (ubatch or mb) * X + mb * A


def l2l_memory(N: int, L: float, mb: int, X: float, A: float, ubatch: int | None = None) -> float:
    """Eq. 2: ``2·L + mb·X + N·mb·A``: one layer and its gradient, one layer's intermediate activations
    (recomputed in backward, so only one layer's are live), and the stash of every layer's output for
    the whole minibatch. With micro-batches only one micro-batch's intermediates are live (``ubatch``)."""
    return 2 * L + (ubatch or mb) * X + N * mb * A


def l2l_p_memory(N: int, L: float, mb: int, X: float, A: float, ubatch: int | None = None) -> float:
    """Eq. 3: ``4·L + mb·X + N·mb·A``: L2L-p adds a weight and a gradient buffer for the transfers."""
    return 4 * L + (ubatch or mb) * X + N * mb * A


def l2l_p_memory_stash_cpu(L: float, mb: int, X: float, ubatch: int | None = None) -> float:
    """Eq. 4: ``4·L + mb·X``: with the stash moved to the host, constant in the depth N."""
    return 4 * L + (ubatch or mb) * X


# --------------------------------------------------------------------------------------------------
# l2l-v1 §3.1.2: minibatch time


def baseline_time(N: int, u: int, Ft: float, Bt: float, Ot: float) -> float:
    """Eq. 5: ``N·u·(Ft + Bt) + Ot`` (u = 1: the baseline; u > 1: with accumulated gradients)."""
    return N * u * (Ft + Bt) + Ot


def l2l_time(N: int, u: int, Ft: float, Bt: float, L: float, Hb: float, Otc: float) -> float:
    """Eq. 6: ``2·N·L/Hb + N·u·(2·Ft + Bt) + Otc``. Each layer crosses the link twice (forward and
    backward), every layer is recomputed once (the second Ft), and the host optimizer runs after."""
    return 2 * N * L / Hb + N * u * (2 * Ft + Bt) + Otc


def l2l_p_time(N: int, u: int, Ft: float, Bt: float, L: float, Hb: float, Otc: float) -> float:
    """Eq. 7: ``N·u·(2·Ft + Bt) + max(0, Otc − N·u·Bt) + max(0, N·(L/Hb − u·Ft))``: the host update
    hides behind the backward passes, the layer transfer behind a layer's forward over u micro-batches."""
    return N * u * (2 * Ft + Bt) + max(0.0, Otc - N * u * Bt) + max(0.0, N * (L / Hb - u * Ft))


# --------------------------------------------------------------------------------------------------
# l2l-v2 §2.2.1: transfer overhead against the number of micro-batches (X, C per layer, seconds)


def v2_total_time(N: int, u: int, C: float, X: float) -> float:
    """Eqs. 1 (u = 1) and 4: ``N·(u·C + X) + N·(3·u·C + X) = N·(4·u·C + 2·X)``: forward with one load
    per layer, then recompute + backward (3·C, the backward being 2·C) with a second load."""
    return N * (4 * u * C + 2 * X)


def v2_forward_throughput(N: int, u: int, ubatch: int, C: float, X: float) -> float:
    """Eqs. 2 (u = 1) and 5: samples/s of the forward pass, ``u·ub / (N·(u·C + X))``."""
    return u * ubatch / (N * (u * C + X))


def v2_training_throughput(N: int, u: int, ubatch: int, C: float, X: float) -> float:
    """Eqs. 3 (u = 1) and 6: samples/s of training, ``u·ub / (N·(4·u·C + 2·X))``. The paper prints the
    denominator without N (a per-layer rate); the factor follows from its own eq. 4."""
    return u * ubatch / v2_total_time(N, u, C, X)


def transfer_overhead(u: int, C: float, X: float) -> float:
    """The share of an L2L step spent moving layers (eq. 4): ``2·X / (4·u·C + 2·X)``, which is also
    the throughput lost to transfers, ``1 − T_training(X) / T_training(0)`` by eq. 6."""
    return 2 * X / (4 * u * C + 2 * X)


def min_ubatches(C: float, X: float, max_overhead: float) -> int:
    """The fewest micro-batches u with ``transfer_overhead(u, C, X) <= max_overhead``: from eq. 4,
    ``u >= X·(1 − t) / (2·C·t)``. (v2: with X = C, u = 10 puts the overhead below 10%; 5 already do.)"""
    if not 0.0 < max_overhead < 1.0:
        raise ValueError(f"max_overhead must be in (0, 1), got {max_overhead}")
    if X <= 0:
        return 1
    if C <= 0:
        raise ValueError("C (forward time of a layer on a micro-batch) must be > 0")
    need = X * (1 - max_overhead) / (2 * C * max_overhead)
    return max(1, math.ceil(need - 1e-9))
