"""The BERT family's torch part: the post layer's module and the attention mask, imported by the spec
(``bert.py``) when a run builds or runs a layer, so that reading the family (``l2l plan``) needs no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Head(nn.Module):
    """post: BERT pooler, dropout, classifier, and the task loss (cross-entropy, or MSE for regression)."""

    def __init__(self, cfg: PretrainedConfig):
        from transformers.models.bert.modeling_bert import BertPooler

        super().__init__()
        self.pooler = BertPooler(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)
        self.num_labels = cfg.num_labels

    def logits(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(self.pooler(x_BSH)))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = logits.float()  # the loss in FP32 even when the device runs in half precision
        if self.num_labels == 1:
            return nn.functional.mse_loss(logits.squeeze(-1), labels.float())
        return nn.functional.cross_entropy(logits, labels)

    def forward(self, x_BSH: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(x_BSH)
        return self.loss(logits, labels), logits


def extended_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, S] 1/0 padding mask -> additive [B, 1, 1, S] mask for BertLayer (0 keep, dtype-min drop)."""
    return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
