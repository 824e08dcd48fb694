"""LAMB, the optimizer L2L v2 trains BERT-Large with (``optim.name=lamb``): its own module so that the
optimizer registry (:mod:`l2l_cli.engine.optim`) stays importable without torch (``l2l plan``)."""

from __future__ import annotations

import math
from typing import Any

import torch


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019), as L2L v2 trains BERT-Large: Adam moments with bias correction, decoupled
    weight decay inside the update, and a layer-wise trust ratio ||w|| / ||update|| applied per parameter
    tensor. Multi-tensor (foreach) kernels; no Python loop over the elements of a layer."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            for p in params:
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
            states = [self.state[p] for p in params]
            m = [s["exp_avg"] for s in states]
            v = [s["exp_avg_sq"] for s in states]
            for s in states:
                s["step"] += 1
            t = float(states[0]["step"])
            b1, b2 = group["betas"]
            torch._foreach_lerp_(m, grads, 1 - b1)
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
            # update = m_hat / (sqrt(v_hat) + eps) + wd * w
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, math.sqrt(1 - b2**t))
            torch._foreach_add_(denom, group["eps"])
            update = torch._foreach_div(m, denom)
            torch._foreach_mul_(update, 1.0 / (1 - b1**t))
            if group["weight_decay"]:
                torch._foreach_add_(update, params, alpha=group["weight_decay"])
            w_norm = torch.stack(torch._foreach_norm(params))
            u_norm = torch.stack(torch._foreach_norm(update))
            trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
            torch._foreach_mul_(update, list((trust * -group["lr"]).unbind()))
            torch._foreach_add_(params, update)
