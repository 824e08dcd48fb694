"""LayeredModel = pre · blocks[0..N-1] · post, built from Hugging Face BERT modules.

This module knows nothing about L2L: it says what a layer is (``build_layer``), how layers map to HF
checkpoint names, and how to run the whole model (for the baselines and the reference tests). Where the
layers live and when they run is decided by ``engine/`` and ``runners/``.

Layer indices are global: 0 = pre (embeddings), 1..N = transformer blocks, N+1 = post (pooler, classifier,
loss). Every runner builds layer i the same way from the same seed, so all modes start from the same weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer, BertPooler

PRE, BLOCK, POST = "pre", "block", "post"


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a BERT encoder with a sequence-classification (or regression) head."""

    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int = 30522
    seq_len: int = 512
    type_vocab_size: int = 2
    dropout: float = 0.1
    layer_norm_eps: float = 1e-12
    init_std: float = 0.02
    num_labels: int = 2

    @classmethod
    def from_config(cls, m: Any, num_labels: int) -> ModelSpec:
        return cls(
            m.num_layers, m.hidden_size, m.num_heads, m.intermediate_size, m.vocab_size, m.seq_len,
            m.type_vocab_size, m.dropout, m.layer_norm_eps, m.init_std, num_labels,
        )  # fmt: skip

    @classmethod
    def from_hf_dir(cls, path: str | Path, *, dropout: float, num_labels: int) -> ModelSpec:
        c = json.loads((Path(path) / "config.json").read_text())
        return cls(
            c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["intermediate_size"],
            c.get("vocab_size", 30522), c.get("max_position_embeddings", 512), c.get("type_vocab_size", 2),
            dropout, c.get("layer_norm_eps", 1e-12), c.get("initializer_range", 0.02), num_labels,
        )  # fmt: skip

    @property
    def num_all_layers(self) -> int:
        return self.num_layers + 2

    def kind(self, index: int) -> str:
        return PRE if index == 0 else POST if index == self.num_layers + 1 else BLOCK

    def hf_config(self) -> BertConfig:
        cfg = BertConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            intermediate_size=self.intermediate_size,
            hidden_dropout_prob=self.dropout,
            attention_probs_dropout_prob=self.dropout,
            max_position_embeddings=self.seq_len,
            type_vocab_size=self.type_vocab_size,
            layer_norm_eps=self.layer_norm_eps,
            initializer_range=self.init_std,
            num_labels=self.num_labels,
            problem_type="regression" if self.num_labels == 1 else "single_label_classification",
        )
        cfg._attn_implementation = "sdpa"
        return cfg


class Head(nn.Module):
    """post: BERT pooler, dropout, classifier, and the task loss (cross-entropy, or MSE for regression)."""

    def __init__(self, cfg: BertConfig):
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


def new_layer(spec: ModelSpec, kind: str, device: torch.device | str | None = None) -> nn.Module:
    """An uninitialized layer module of the given kind (parameters allocated on ``device``)."""
    cfg = spec.hf_config()
    with torch.device(device or "cpu"):
        if kind == PRE:
            return BertEmbeddings(cfg)
        if kind == BLOCK:
            return BertLayer(cfg)
        return Head(cfg)


def layer_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 7_919 + 17) % (2**63)


@torch.no_grad()
def init_layer(module: nn.Module, spec: ModelSpec, seed: int, index: int) -> nn.Module:
    """BERT's initialization (normal(0, init_std) weights, zero biases, unit LayerNorm), seeded per layer
    so that every mode builds layer ``index`` with identical weights, one layer at a time."""
    g = torch.Generator().manual_seed(layer_seed(seed, index))
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.weight.copy_(torch.empty(m.weight.shape).normal_(0.0, spec.init_std, generator=g))
            if m.bias is not None:
                m.bias.zero_()
        elif isinstance(m, nn.Embedding):
            m.weight.copy_(torch.empty(m.weight.shape).normal_(0.0, spec.init_std, generator=g))
            if m.padding_idx is not None:
                m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            m.weight.fill_(1.0)
            m.bias.zero_()
    return module


def build_layer(
    spec: ModelSpec, index: int, seed: int, device: torch.device | str | None = None
) -> nn.Module:
    return init_layer(new_layer(spec, spec.kind(index), device), spec, seed, index)


def reset_buffers(module: nn.Module) -> None:
    """Re-create the non-persistent index buffers of an embeddings module (after ``to_empty``)."""
    if isinstance(module, BertEmbeddings):
        n = module.position_ids.shape[-1]
        module.position_ids.copy_(torch.arange(n, device=module.position_ids.device).expand(1, -1))
        module.token_type_ids.zero_()


def hf_prefix(spec: ModelSpec, index: int) -> str:
    """The Hugging Face (BertForSequenceClassification) name prefix of layer ``index``'s parameters."""
    kind = spec.kind(index)
    if kind == PRE:
        return "bert.embeddings."
    if kind == BLOCK:
        return f"bert.encoder.layer.{index - 1}."
    return ""  # post: Head's names are pooler.* -> bert.pooler.*, classifier.* as is


def hf_name(spec: ModelSpec, index: int, name: str) -> str:
    if spec.kind(index) == POST and name.startswith("pooler."):
        return "bert." + name
    return hf_prefix(spec, index) + name


def extended_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, S] 1/0 padding mask -> additive [B, 1, 1, S] mask for BertLayer (0 keep, dtype-min drop)."""
    return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


class LayeredModel(nn.Module):
    """The whole model, resident in one place: how the baselines (Alg. 1 and 2) hold it."""

    def __init__(self, spec: ModelSpec, seed: int = 0, device: torch.device | str | None = None):
        super().__init__()
        self.spec = spec
        self.pre = build_layer(spec, 0, seed, device)
        self.blocks = nn.ModuleList(build_layer(spec, i, seed, device) for i in range(1, spec.num_layers + 1))
        self.post = build_layer(spec, spec.num_layers + 1, seed, device)

    def layers(self) -> Iterator[tuple[int, nn.Module]]:
        """(global index, module) for pre, blocks, post."""
        yield 0, self.pre
        yield from enumerate(self.blocks, start=1)
        yield self.spec.num_layers + 1, self.post

    def forward(self, batch: Any, seed_fn: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, logits) of a (micro-)batch. ``seed_fn(layer)`` reseeds dropout before each layer, so a
        layer-by-layer runner can reproduce the exact dropout masks."""
        if seed_fn:
            seed_fn(0)
        x = self.pre(input_ids=batch.input_ids, token_type_ids=batch.token_type_ids)
        mask = extended_mask(batch.attention_mask, x.dtype)
        for i, block in enumerate(self.blocks, start=1):
            if seed_fn:
                seed_fn(i)
            x = block(x, mask)
        if seed_fn:
            seed_fn(self.spec.num_layers + 1)
        return self.post(x, batch.labels)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {
            hf_name(self.spec, i, n): p for i, layer in self.layers() for n, p in layer.named_parameters()
        }

    @torch.no_grad()
    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Copy matching HF tensors in (with or without the ``bert.`` prefix); returns names left at init."""
        missing = []
        for i, layer in self.layers():
            for n, p in layer.named_parameters():
                t = lookup_hf(tensors, hf_name(self.spec, i, n))
                if t is None:
                    missing.append(hf_name(self.spec, i, n))
                else:
                    p.copy_(t)
        return missing


def lookup_hf(tensors: Any, name: str) -> torch.Tensor | None:
    """A tensor by HF name from a dict or safetensors handle; accepts BertModel files (no ``bert.``)."""
    keys = tensors.keys()
    for cand in (name, name.removeprefix("bert.")):
        if cand in keys:
            return tensors[cand] if isinstance(tensors, dict) else tensors.get_tensor(cand)
    return None


def resolve_pretrained(ref: str) -> Path:
    """A local dir holding config.json and model.safetensors for ``ref`` (a dir, or a hub id downloaded)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(ref, allow_patterns=["config.json", "*.safetensors", "*.txt", "*.json"]))


def save_hf(
    out_dir: Path, spec: ModelSpec, named_tensors: Iterator[tuple[str, torch.Tensor]], task: Any | None = None
) -> None:
    """Write ``config.json`` + ``model.safetensors`` that ``BertForSequenceClassification`` loads."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = spec.hf_config()
    cfg.architectures = ["BertForSequenceClassification"]
    if task is not None and task.label_names:
        cfg.id2label = dict(enumerate(task.label_names))
        cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    cfg.save_pretrained(out_dir)
    tensors = {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in named_tensors}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
