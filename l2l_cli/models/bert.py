"""The BERT family: an encoder with a sequence-classification (or regression) head, from Hugging Face's
BERT modules, so a HF checkpoint (``bert-large-uncased``, a local directory) loads unchanged and the
fine-tuned result saves back as a ``BertForSequenceClassification`` directory.

pre = ``BertEmbeddings``; block = ``BertLayer``; post = pooler, dropout, classifier and the task loss.

Imports of torch, ``transformers`` and the layer modules sit in the functions that build, run or save a
layer, so importing the family (``l2l plan``, the config's checks) imports no torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from l2l_cli.config.schema import ModelConfig
from l2l_cli.data.batches import eval_batches
from l2l_cli.models.base import BLOCK, PRE, ModelSpec, dropout_of
from l2l_cli.models.registry import ModelFamily, register_family

if TYPE_CHECKING:
    import torch
    from torch import nn

    from l2l_cli.data.tasks import TaskSpec


@dataclass(frozen=True)
class BertSpec(ModelSpec):
    """Sizes of a BERT encoder with a classification head (num_labels 1: regression)."""

    family = "bert"
    base_prefix = "bert."
    peft_task_type = "SEQ_CLS"
    peft_head = ("classifier",)
    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    seq_len: int  # max positions
    type_vocab_size: int
    dropout: float
    layer_norm_eps: float
    init_std: float
    num_labels: int

    def hf_config(self) -> Any:
        from transformers import BertConfig

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

    # ---- building --------------------------------------------------------------------------------

    def new_layer(self, kind: str, device: torch.device | str | None = None) -> nn.Module:
        import torch
        from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer

        from l2l_cli.models.bert_modules import Head

        cfg = self.hf_config()
        with torch.device(device or "cpu"):
            if kind == PRE:
                return BertEmbeddings(cfg)
            if kind == BLOCK:
                return BertLayer(cfg)
            return Head(cfg)

    def init_layer(self, module: nn.Module, index: int, seed: int) -> nn.Module:
        """BERT's initialization (normal(0, init_std) weights, zero biases, unit LayerNorm), seeded per
        layer so that every mode builds layer ``index`` with identical weights, one layer at a time."""
        import torch
        from torch import nn

        g = torch.Generator().manual_seed(layer_seed(seed, index))
        with torch.no_grad():
            for m in module.modules():
                if isinstance(m, nn.Linear):
                    m.weight.copy_(torch.empty(m.weight.shape).normal_(0.0, self.init_std, generator=g))
                    if m.bias is not None:
                        m.bias.zero_()
                elif isinstance(m, nn.Embedding):
                    m.weight.copy_(torch.empty(m.weight.shape).normal_(0.0, self.init_std, generator=g))
                    if m.padding_idx is not None:
                        m.weight[m.padding_idx].zero_()
                elif isinstance(m, nn.LayerNorm):
                    m.weight.fill_(1.0)
                    m.bias.zero_()
        return module

    def reset_buffers(self, module: nn.Module) -> None:
        import torch

        if hasattr(module, "position_ids") and hasattr(module, "token_type_ids"):  # BertEmbeddings
            n = module.position_ids.shape[-1]
            module.position_ids.copy_(torch.arange(n, device=module.position_ids.device).expand(1, -1))
            module.token_type_ids.zero_()

    # ---- running ---------------------------------------------------------------------------------

    def side_inputs(self, ub: Any, dtype: torch.dtype) -> torch.Tensor:
        from l2l_cli.models.bert_modules import extended_mask

        return extended_mask(ub.attention_mask, dtype)

    def run_layer(
        self, layer: nn.Module, index: int, x: torch.Tensor | None, ub: Any, side: Any
    ) -> torch.Tensor:
        if index == 0:  # the embeddings read the token ids
            return layer(input_ids=ub.input_ids, token_type_ids=ub.token_type_ids)
        return layer(x, side)

    def run_head(self, layer: nn.Module, x: torch.Tensor, ub: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return layer(x, ub.labels)

    def head_logits(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer.logits(x)

    def rows_read(self, index: int, batch: Any) -> dict[str, torch.Tensor] | None:
        """BertEmbeddings gathers the batch's tokens, positions 0..S-1 and its token types; the LayerNorm
        is read whole."""
        if self.kind(index) != PRE:
            return None
        import torch

        return {
            "word_embeddings.weight": batch.input_ids,
            "position_embeddings.weight": torch.arange(batch.seq_len),
            "token_type_embeddings.weight": batch.token_type_ids,
        }

    # ---- checkpoints -----------------------------------------------------------------------------

    def hf_name(self, index: int, name: str) -> str:
        """The BertForSequenceClassification name of layer ``index``'s parameter ``name``."""
        kind = self.kind(index)
        if kind == PRE:
            return "bert.embeddings." + name
        if kind == BLOCK:
            return f"bert.encoder.layer.{index - 1}.{name}"
        return "bert." + name if name.startswith("pooler.") else name  # classifier.* as is

    def save_hf(
        self, out_dir: Path, named_tensors: Iterable[tuple[str, torch.Tensor]], task: TaskSpec | None = None
    ) -> None:
        """Write ``config.json`` + ``model.safetensors`` that ``BertForSequenceClassification`` loads."""
        import torch
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.hf_config()
        cfg.architectures = ["BertForSequenceClassification"]
        if task is not None and task.label_names:
            cfg.id2label = dict(enumerate(task.label_names))
            cfg.label2id = {v: k for k, v in cfg.id2label.items()}
        cfg.save_pretrained(out_dir)
        tensors = {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in named_tensors}
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    def identity(self) -> dict[str, Any]:
        keep = (
            "num_layers",
            "hidden_size",
            "num_heads",
            "intermediate_size",
            "vocab_size",
            "seq_len",
            "type_vocab_size",
            "num_labels",
        )
        return {k: v for k, v in asdict(self).items() if k in keep}

    # ---- planner and evaluation ------------------------------------------------------------------

    def param_counts(self) -> tuple[int, int, int]:
        h, i = self.hidden_size, self.intermediate_size
        # word, position and token-type embeddings and their LayerNorm
        pre = (self.vocab_size + self.seq_len + self.type_vocab_size) * h + 2 * h
        # Q, K, V, output (4·h² + 4·h), the MLP (2·h·I + I + h), two LayerNorms (4·h)
        block = 4 * h * h + 2 * h * i + 9 * h + i
        # pooler (h² + h) and classifier
        post = h * h + h + h * self.num_labels + self.num_labels
        return pre, block, post

    def head_flops(self, seq: int) -> float:  # the pooler reads the first token only
        return 2.0 * (self.hidden_size * self.hidden_size + self.hidden_size * self.num_labels)

    def evaluate(
        self,
        predict: Callable[[Any], torch.Tensor],
        dev: Any,
        task: TaskSpec,
        batch_size: int,
        pad_to: int | None,
    ) -> dict[str, float]:
        """The task's GLUE metrics: argmax of the logits (classification) or the score (regression)."""
        import numpy as np

        from l2l_cli.data.metrics import compute

        preds = np.zeros(len(dev), dtype=np.float64 if task.is_regression else np.int64)
        for idx, batch in eval_batches(dev, batch_size, pad_to):
            logits = predict(batch)
            preds[idx] = logits.squeeze(-1).numpy() if task.is_regression else logits.argmax(-1).numpy()
        return compute(task.metrics, preds, np.asarray(dev.labels))


def layer_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 7_919 + 17) % (2**63)


def from_config(m: ModelConfig, num_labels: int) -> BertSpec:
    """The spec from the ``model.*`` keys."""
    return BertSpec(
        m.num_layers,
        m.hidden_size,
        m.num_heads,
        m.intermediate_size,
        m.vocab_size,
        m.seq_len,
        m.type_vocab_size,
        dropout_of(m),
        m.layer_norm_eps,
        m.init_std,
        num_labels,
    )


def from_hf_dir(path: Path, m: ModelConfig, num_labels: int) -> BertSpec:
    """The spec from a checkpoint's ``config.json``: its dropout unless ``model.dropout`` is set, and a
    size the file leaves out takes the schema's default (``model.*``)."""
    c = json.loads((Path(path) / "config.json").read_text())
    return BertSpec(
        c["num_hidden_layers"],
        c["hidden_size"],
        c["num_attention_heads"],
        c["intermediate_size"],
        c.get("vocab_size", m.vocab_size),
        c.get("max_position_embeddings", m.seq_len),
        c.get("type_vocab_size", m.type_vocab_size),
        dropout_of(m, c.get("hidden_dropout_prob", 0.1)),
        c.get("layer_norm_eps", m.layer_norm_eps),
        c.get("initializer_range", m.init_std),
        num_labels,
    )


register_family(
    ModelFamily(
        name="bert",
        model_types=("bert",),
        description="BERT encoder + sequence-classification head (HF BertForSequenceClassification)",
        from_config=from_config,
        from_hf_dir=from_hf_dir,
    )
)
