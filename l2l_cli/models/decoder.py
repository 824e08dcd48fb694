"""What the decoder families (GPT-2, Llama) share: a causal language model as pre · blocks · post.

pre = the token embeddings (and GPT-2's learned positions); block = ``transformers``' own decoder layer
(``GPT2Block``, ``LlamaDecoderLayer``, ...), run with the causal mask and the family's position inputs as
side inputs; post = the final norm, the LM head and the next-token loss. A tied LM head (GPT-2, Llama-3.2-1B)
is one tensor used by pre and post (``tied_params``). The trained model saves as a Hugging Face directory
that ``AutoModelForCausalLM.from_pretrained`` loads.

Imports of torch, ``transformers`` and the layer modules sit in the functions that build, run or save a
layer, so importing the family (``l2l plan``, the config's checks) imports no torch.
"""

from __future__ import annotations

import functools
import json
import math
from abc import abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from l2l_cli.data.batches import eval_batches
from l2l_cli.models.base import BLOCK, POST, PRE, ModelSpec
from l2l_cli.models.bert import layer_seed

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig

    from l2l_cli.data.tasks import TaskSpec


@dataclass(frozen=True)
class DecoderSide:
    """What every block of a micro-batch reads besides the hidden states."""

    mask: torch.Tensor | None  # None: plain causal attention (SDPA's is_causal); else bool [B|1, 1, S, S]
    window_mask: torch.Tensor | None = None  # the sliding-window layers' mask (Mistral, Qwen2)
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # rotary (cos, sin), [1|B, S, head_dim] each
    cache: Any = None  # generation: this block's key/value cache (a transformers-style ``update``), else None


class DecoderSpec(ModelSpec):
    """A causal LM of one decoder family. Subclasses are frozen dataclasses holding the sizes, and
    ``hf_json``: the checkpoint's config.json ("" for random init), kept so an export round-trips every
    field the sizes do not cover (rope scaling, token ids, ...)."""

    seq_len: int
    dropout: float
    layer_norm_eps: float
    init_std: float
    tie_word_embeddings: bool
    hf_json: str

    # base_prefix (HF names): "transformer." (GPT-2) | "model." (Llama)
    blocks_name: str  # "h" | "layers"
    norm_name: str  # the final norm: "ln_f" | "norm"
    embed_name: str  # the token embedding: "wte" | "embed_tokens"

    # ---- what a family defines ---------------------------------------------------------------------

    @abstractmethod
    def hf_config(self) -> Any:
        """The transformers config of this model (sizes and dropout from the spec, SDPA attention)."""

    @abstractmethod
    def causal_lm_class(self) -> str:
        """The ``architectures`` entry of an exported config.json (``GPT2LMHeadModel``, ...)."""

    @abstractmethod
    def new_pre(self, cfg: PretrainedConfig) -> nn.Module: ...

    @abstractmethod
    def new_block(self, cfg: PretrainedConfig) -> nn.Module: ...

    @abstractmethod
    def new_norm(self, cfg: PretrainedConfig) -> nn.Module: ...

    @abstractmethod
    def run_block(self, layer: nn.Module, index: int, x: torch.Tensor, side: DecoderSide) -> torch.Tensor: ...

    def rope(self, ub: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rotary (cos, sin) for the micro-batch's positions (families with rotary embeddings)."""
        return None

    def rope_at(
        self, positions_BS: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rotary (cos, sin) at given positions (generation: each sequence's own, past its cache)."""
        return None

    def embed_at(
        self, layer: nn.Module, input_ids_BS: torch.Tensor, positions_BS: torch.Tensor
    ) -> torch.Tensor:
        """The embeddings of tokens at given positions (generation: the new tokens after a cache)."""
        return layer(input_ids_BS)

    def sliding_window(self) -> int | None:
        """The window of the sliding-window layers (None: every layer attends to the whole prefix)."""
        return None

    def residual_init_scale(self, name: str) -> float:
        """Init std multiplier of the weight ``name`` (GPT-2 scales the residual projections)."""
        return 1.0

    # ---- sizes -------------------------------------------------------------------------------------

    @property
    def num_labels(self) -> int:  # type: ignore[override]  (the head classifies over the vocabulary)
        return self.vocab_size

    def logits_shape(self, rows: int, seq: int) -> tuple[int, ...]:
        return (rows, seq, self.vocab_size)  # a prediction at every position

    def tied_params(self) -> dict[str, str]:
        return {"lm_head.weight": f"{self.embed_name}.weight"} if self.tie_word_embeddings else {}

    # ---- building ----------------------------------------------------------------------------------

    def new_layer(self, kind: str, device: torch.device | str | None = None) -> nn.Module:
        import torch

        from l2l_cli.models.decoder_modules import LMHead

        cfg = self.hf_config()
        with torch.device(device or "cpu"):
            if kind == PRE:
                return self.new_pre(cfg)
            if kind == BLOCK:
                return self.new_block(cfg)
            return LMHead(self.norm_name, self.new_norm(cfg), self.hidden_size, self.vocab_size)

    def init_layer(self, module: nn.Module, index: int, seed: int) -> nn.Module:
        """GPT-style initialization (normal(0, init_std) matrices and embeddings, zero biases, unit norms),
        seeded per layer so every mode builds layer ``index`` alike, one layer at a time."""
        import torch
        from torch import nn

        g = torch.Generator().manual_seed(layer_seed(seed, index))
        with torch.no_grad():
            for name, m in module.named_modules():
                weight = getattr(m, "weight", None)
                if isinstance(m, nn.Linear | nn.Embedding) or type(m).__name__ == "Conv1D":
                    std = self.init_std * self.residual_init_scale(name)
                    m.weight.copy_(torch.empty(m.weight.shape).normal_(0.0, std, generator=g))
                    bias = getattr(m, "bias", None)
                    if bias is not None:
                        bias.zero_()
                    if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                        m.weight[m.padding_idx].zero_()
                elif isinstance(m, nn.LayerNorm) or (
                    isinstance(weight, nn.Parameter) and "Norm" in type(m).__name__
                ):
                    m.weight.fill_(1.0)
                    if getattr(m, "bias", None) is not None:
                        m.bias.zero_()
        return module

    # ---- running -----------------------------------------------------------------------------------

    def side_inputs(self, ub: Any, dtype: torch.dtype) -> DecoderSide:
        from l2l_cli.models.decoder_modules import causal_mask

        window = self.sliding_window()
        seq = ub.attention_mask.shape[1]  # (a pipeline stage past the first has no token ids)
        return DecoderSide(
            mask=causal_mask(ub.attention_mask, None),
            window_mask=causal_mask(ub.attention_mask, window)
            if window is not None and window < seq
            else None,
            rope=self.rope(ub, dtype),
        )

    def run_layer(
        self, layer: nn.Module, index: int, x: torch.Tensor | None, ub: Any, side: Any
    ) -> torch.Tensor:
        if index == 0:  # the embeddings read the token ids
            return self.run_pre(layer, ub)
        assert x is not None
        return self.run_block(layer, index, x, side)

    def run_pre(self, layer: nn.Module, ub: Any) -> torch.Tensor:
        """The embeddings of the micro-batch's tokens (GPT-2 adds learned positions: see its spec)."""
        return layer(ub.input_ids)

    def run_head(self, layer: nn.Module, x: torch.Tensor, ub: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return layer(x, ub.labels)

    def head_logits(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer.logits(x)

    def head_graph_bytes(self, rows: int, seq: int) -> int:
        """Every loss chunk's FP32 log-probabilities (what the cross-entropy saves), one chunk's less."""
        from l2l_cli.models.decoder_modules import LOSS_CHUNK

        return max(0, rows * max(0, seq - 1) * self.vocab_size - LOSS_CHUNK) * 4

    def keep_head_graph(self, layer: nn.Module, keep: bool) -> None:
        layer.recompute_chunks = not keep

    def loss_count(self, ub: Any) -> int:
        """The micro-batch's predicted tokens: positions whose next token has a label (``lm_loss``'s)."""
        from l2l_cli.models.decoder_modules import IGNORE

        return int((ub.labels[:, 1:] != IGNORE).sum())

    # ---- checkpoints -------------------------------------------------------------------------------

    def hf_name(self, index: int, name: str) -> str:
        """The ``*ForCausalLM`` name of layer ``index``'s parameter ``name``."""
        kind = self.kind(index)
        if kind == PRE:
            return self.base_prefix + name
        if kind == BLOCK:
            return f"{self.base_prefix}{self.blocks_name}.{index - 1}.{name}"
        return name if name.startswith("lm_head.") else self.base_prefix + name

    def save_hf(
        self, out_dir: Path, named_tensors: Iterable[tuple[str, torch.Tensor]], task: TaskSpec | None = None
    ) -> None:
        """Write ``config.json`` + ``model.safetensors`` that ``AutoModelForCausalLM`` loads; a tied head
        is saved once (as the embedding) and tied again by ``tie_word_embeddings`` on load."""
        import torch
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.hf_config()
        cfg.architectures = [self.causal_lm_class()]
        cfg.save_pretrained(out_dir)
        tensors = {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in named_tensors}
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    def identity(self) -> dict[str, Any]:
        drop = ("dropout", "init_std", "layer_norm_eps", "hf_json")
        return {k: v for k, v in asdict(self).items() if k not in drop}  # type: ignore[call-overload]

    # ---- planner and evaluation --------------------------------------------------------------------

    def param_counts(self) -> tuple[int, int, int]:
        """The family's closed form for a model built from the ``model.*`` keys (``l2l plan`` then needs
        no ``transformers``); otherwise counted on meta-device layers (exact for every variant a
        checkpoint's config.json may bring: biases, another head size, GQA, tied or not)."""
        return self.formula_counts() or _param_counts(self)

    def formula_counts(self) -> tuple[int, int, int] | None:
        """(pre, block, post) by formula, or None where only the meta count is exact (tests check the two
        agree)."""
        return None

    def head_flops(self, seq: int) -> float:
        return 2.0 * seq * self.hidden_size * self.vocab_size  # the LM head over every position

    def block_flops(self, seq: int) -> float:
        """2 FLOPs per weight per token (the block's parameters are its matmuls, up to norms and biases)
        and attention's two s×s products."""
        return 2.0 * seq * self.param_counts()[1] + 4.0 * seq * seq * self.hidden_size

    def evaluate(
        self,
        predict: Callable[[Any], torch.Tensor],
        dev: Any,
        task: TaskSpec,
        batch_size: int,
        pad_to: int | None,
    ) -> dict[str, float]:
        """Mean next-token loss over the dev tokens, and its perplexity (exp of it)."""
        from l2l_cli.models.decoder_modules import LOGITS_BUDGET, token_nll

        seq = max(1, dev.seq_len)
        rows = max(1, min(batch_size, LOGITS_BUDGET // (seq * self.vocab_size)))
        total, count = 0.0, 0
        for _, batch in eval_batches(dev, rows, pad_to):
            nll, n = token_nll(predict(batch), batch.labels)
            total, count = total + nll, count + n
        loss = total / max(1, count)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}


@functools.cache
def _param_counts(spec: DecoderSpec) -> tuple[int, int, int]:
    tied = spec.tied_params()

    def count(kind: str) -> int:
        layer = spec.new_layer(kind, "meta")
        return sum(p.numel() for n, p in layer.named_parameters() if not (kind == POST and n in tied))

    return count(PRE), count(BLOCK), count(POST)


def config_dict(hf_json: str) -> dict[str, Any]:
    return json.loads(hf_json) if hf_json else {}
