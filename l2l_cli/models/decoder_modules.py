"""The decoder families' torch part: the post layer (final norm, LM head, next-token loss), the masks and
positions of packed rows, and the families' own pre layers (GPT-2's embeddings with learned positions,
Llama's token embedding). The specs (``decoder.py``, ``gpt2.py``, ``llama.py``) import it when a run builds
or runs a layer, so that reading a family (``l2l plan``) needs no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig


IGNORE = -100  # label of a position without a next-token target (padding)
LOSS_CHUNK = 1 << 22  # training: the loss over chunks of at most this many logits (16 MiB in fp32)
# evaluation: rows per forward so that their logits are at most one loss chunk's (at least one row), so an
# evaluation does not raise the device peak far above training's
LOGITS_BUDGET = LOSS_CHUNK


class LMHead(nn.Module):
    """post: the final norm, the LM head and the next-token cross-entropy (in FP32, whatever the device
    dtype). ``norm_name`` keeps Hugging Face's parameter names (``ln_f``, ``norm``)."""

    # training's loss chunks: True recomputes each chunk's logits in backward (one chunk's logits on the
    # device, at the price of a second forward of the head); False keeps every chunk's graph until its
    # backward, the same ops on the same inputs, so the same numbers. Set by the runner that owns the
    # layer (``ModelSpec.keep_head_graph``) when its device has room for a micro-batch's logits.
    recompute_chunks = True

    def __init__(self, norm_name: str, norm: nn.Module, hidden: int, vocab: int):
        super().__init__()
        self.norm_name = norm_name
        self.add_module(norm_name, norm)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def logits(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self.lm_head(getattr(self, self.norm_name)(x_BSH))

    def forward(
        self, x_BSH: torch.Tensor, labels_BS: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(loss, logits). Training (gradients on) returns no logits: the loss is taken over chunks of
        positions whose logits are recomputed in backward, so the head's device memory is one chunk's
        (a micro-batch's logits over a 50k vocabulary would outweigh a whole transformer layer)."""
        if torch.is_grad_enabled():
            return self.chunked_loss(x_BSH, labels_BS), None
        logits = self.logits(x_BSH)
        return lm_loss(logits, labels_BS), logits

    def chunked_loss(self, x_BSH: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """``lm_loss(self.logits(x), labels)`` over chunks of positions of at most ``LOSS_CHUNK`` logits,
        each chunk's logits recomputed in backward (activation checkpointing) unless ``recompute_chunks``
        is off; in one piece when they fit (then exactly ``lm_loss``)."""
        from torch.utils.checkpoint import checkpoint

        b, s, h = x_BSH.shape
        rows = max(1, LOSS_CHUNK // self.lm_head.out_features)
        if b * (s - 1) <= rows:
            return lm_loss(self.logits(x_BSH), labels_BS)
        x = x_BSH[:, :-1].reshape(-1, h)  # the positions that predict a next token
        y = labels_BS[:, 1:].reshape(-1)
        total = x.new_zeros((), dtype=torch.float32)
        for start in range(0, x.shape[0], rows):
            end = start + rows
            if self.recompute_chunks:
                part = checkpoint(self._nll_sum, x[start:end], y[start:end], use_reentrant=False)
            else:  # the graph kept: no second forward (a checkpoint's replay computes the same values)
                part = self._nll_sum(x[start:end], y[start:end])
            total = total + part
        return total / (y != IGNORE).sum().clamp(min=1)

    def _nll_sum(self, x_NH: torch.Tensor, y_N: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(
            self.logits(x_NH).float(), y_N, ignore_index=IGNORE, reduction="sum"
        )


def lm_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting token t+1 from positions <= t (labels are the inputs, unshifted);
    0 (not NaN) for rows without a target (a micro-batch of prompts whose answers were cut away), so that
    such a micro-batch adds nothing to a minibatch's loss and gradient."""
    v = logits_BSV.shape[-1]
    target = labels_BS[:, 1:].reshape(-1)
    mean = nn.functional.cross_entropy(logits_BSV[:, :-1].float().reshape(-1, v), target, ignore_index=IGNORE)
    return torch.where((target != IGNORE).any(), mean, torch.zeros_like(mean))


def token_nll(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> tuple[float, int]:
    """(summed next-token loss, number of predicted tokens) of a batch."""
    v = logits_BSV.shape[-1]
    target = labels_BS[:, 1:].reshape(-1)
    nll = nn.functional.cross_entropy(
        logits_BSV[:, :-1].float().reshape(-1, v), target, ignore_index=IGNORE, reduction="sum"
    )
    return float(nll), int((target != IGNORE).sum())


def is_packed(attention_mask_BS: torch.Tensor) -> bool:
    """Whether rows hold several documents: a packed row's ``attention_mask`` is each token's document
    number (1, 2, ...; 0 for padding) rather than 1 for every token (``task.packing``, data/chat.py)."""
    return attention_mask_BS.numel() > 0 and int(attention_mask_BS.max()) > 1


def doc_positions(attention_mask_BS: torch.Tensor) -> torch.Tensor | None:
    """Each token's position inside its own document in packed rows ([B, S], restarting at 0 where a
    document begins), so a packed example sees the positions it would alone; None for unpacked rows."""
    if not is_packed(attention_mask_BS):
        return None
    m = attention_mask_BS
    idx = torch.arange(m.shape[1], device=m.device).expand_as(m)
    begins = torch.ones_like(m, dtype=torch.bool)
    begins[:, 1:] = m[:, 1:] != m[:, :-1]
    return idx - torch.where(begins, idx, torch.zeros_like(idx)).cummax(dim=1).values


def causal_mask(attention_mask_BS: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """None for full blocks without a window (SDPA then runs its causal kernel); else a boolean mask
    [B, 1, S, S] (True: attend) of key <= query, inside the window, and not padding (as transformers'
    ``create_causal_mask`` / ``create_sliding_window_causal_mask`` build it). Packed rows (document
    numbers in ``attention_mask``) also keep each query inside its own document, so attention never
    crosses examples; a padding query sees itself only (a row with no key would be NaN)."""
    padded = not bool(attention_mask_BS.all())
    packed = is_packed(attention_mask_BS)
    if window is None and not padded and not packed:
        return None
    s = attention_mask_BS.shape[1]
    q = torch.arange(s, device=attention_mask_BS.device)[:, None]
    k = torch.arange(s, device=attention_mask_BS.device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed = allowed & (k > q - window)
    mask = allowed[None, None]
    if packed:
        doc = attention_mask_BS
        same = (doc[:, :, None] == doc[:, None, :]) & (doc[:, None, :] != 0)
        mask = mask & (same | (q == k))[:, None]
    elif padded:
        mask = mask & attention_mask_BS.bool()[:, None, None, :]
    return mask


class GPT2Embeddings(nn.Module):
    """pre: ``wte(ids) + wpe(positions)``, then dropout, as ``GPT2Model.forward`` begins."""

    def __init__(self, cfg: PretrainedConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.embd_pdrop)

    def forward(self, input_ids_BS: torch.Tensor, positions_BS: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: each token's (packed rows: its document's; generation: past a cache); default
        0..S-1."""
        if positions_BS is None:
            positions_BS = torch.arange(input_ids_BS.shape[1], device=input_ids_BS.device)[None]
        return self.drop(self.wte(input_ids_BS) + self.wpe(positions_BS))


class TokenEmbedding(nn.Module):
    """pre: ``embed_tokens(ids)`` (Llama adds no positions here: they are rotary, inside attention)."""

    def __init__(self, cfg: PretrainedConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id)

    def forward(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids_BS)
