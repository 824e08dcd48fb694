"""The Llama family: RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query attention; built from
Hugging Face's own modules of the checkpoint's ``model_type`` (``LlamaDecoderLayer``, ``LlamaRMSNorm``,
``LlamaRotaryEmbedding``; Mistral's and Qwen2's, which add a sliding window and Q/K/V biases), so their
checkpoints load unchanged and the trained model saves back as a ``*ForCausalLM`` directory.

pre = the token embedding; block = the decoder layer, given the rotary (cos, sin) and the causal (or
sliding-window) mask as side inputs; post = the final RMSNorm and the LM head (tied or not).

Imports of torch, ``transformers`` and the layer modules sit in the functions that build, run or save a
layer, so importing the family (``l2l plan``, the config's checks) imports no torch.
"""

from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from l2l_cli.config.schema import ModelConfig
from l2l_cli.data.tasks import LM
from l2l_cli.models.base import dropout_of
from l2l_cli.models.decoder import DecoderSide, DecoderSpec, config_dict
from l2l_cli.models.registry import ModelFamily, UnsupportedModel, register_family
from l2l_cli.problems import Problem, divisors

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig

# model_type -> the class-name prefix of its transformers modules (modeling_<type>.<Prefix>DecoderLayer)
PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


@dataclass(frozen=True)
class LlamaSpec(DecoderSpec):
    """Sizes of a Llama-architecture decoder (``num_kv_heads`` < ``num_heads``: grouped-query attention)."""

    family = "llama"
    base_prefix = "model."
    blocks_name = "layers"
    norm_name = "norm"
    embed_name = "embed_tokens"

    model_type: str  # llama | mistral | qwen2: whose transformers modules build the layers
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    seq_len: int  # max_position_embeddings
    dropout: float  # attention dropout (Llama has no other)
    layer_norm_eps: float  # rms_norm_eps
    init_std: float
    rope_theta: float
    tie_word_embeddings: bool
    hf_json: str

    def hf_config(self) -> Any:
        return _config(self)

    def formula_counts(self) -> tuple[int, int, int] | None:
        """From ``model.*`` (no config.json): bias-free q, k, v, o (k and v over the KV heads), the gated
        MLP's three matrices, two RMSNorms; the head's norm and the LM head unless tied."""
        if self.hf_json:
            return None
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = self.num_kv_heads * (h // self.num_heads)
        block = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
        return v * h, block, h + (0 if self.tie_word_embeddings else v * h)

    def module(self, what: str) -> Any:
        """``transformers``' class ``<Prefix><what>`` for this model_type (DecoderLayer, RMSNorm, ...)."""
        mod = importlib.import_module(f"transformers.models.{self.model_type}.modeling_{self.model_type}")
        return getattr(mod, PREFIX[self.model_type] + what)

    def causal_lm_class(self) -> str:
        return PREFIX[self.model_type] + "ForCausalLM"

    def new_pre(self, cfg: PretrainedConfig) -> nn.Module:
        from l2l_cli.models.decoder_modules import TokenEmbedding

        return TokenEmbedding(cfg)

    def new_block(self, cfg: PretrainedConfig) -> nn.Module:
        return self.module("DecoderLayer")(cfg, layer_idx=0)

    def new_norm(self, cfg: PretrainedConfig) -> nn.Module:
        return self.module("RMSNorm")(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def rope(self, ub: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the rotary embedding at positions 0..S-1 (packed rows: each document's own,
        from 0), from the family's own module."""
        import torch

        from l2l_cli.models.decoder_modules import doc_positions

        ids = ub.attention_mask  # positions 0..S-1 (a pipeline stage past the first has no token ids)
        positions = doc_positions(ids)
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device)[None]
        return self.rope_at(positions, dtype)

    def rope_at(self, positions_BS: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        device = positions_BS.device
        return _rotary(self, device)(torch.empty(0, dtype=dtype, device=device), positions_BS)

    def sliding_window(self) -> int | None:
        return _window(self)[0]

    def block_variant(self, index: int) -> Any:
        return (index - 1) in _window(self)[1]  # whether it reads the sliding window's mask

    def run_block(self, layer: nn.Module, index: int, x: torch.Tensor, side: DecoderSide) -> torch.Tensor:
        sliding = side.window_mask is not None and (index - 1) in _window(self)[1]
        mask = side.window_mask if sliding else side.mask
        return layer(x, attention_mask=mask, position_embeddings=side.rope, cache=side.cache)


@functools.cache  # built once per spec: every layer build and the relay's shells share it (read-only)
def _config(spec: LlamaSpec) -> Any:
    from transformers import AutoConfig

    fields = {
        **config_dict(spec.hf_json),
        "num_hidden_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.seq_len,
        "rms_norm_eps": spec.layer_norm_eps,
        "initializer_range": spec.init_std,
        "attention_dropout": spec.dropout,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "use_cache": False,
    }
    if not spec.hf_json:  # random init: rotary base from model.rope_theta; token ids come with the tokenizer
        fields.update(
            rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
            bos_token_id=None,
            eos_token_id=None,
        )
    fields.pop("model_type", None)
    cfg = AutoConfig.for_model(spec.model_type, **fields)
    cfg._attn_implementation = "sdpa"
    return cfg


@functools.cache
def _rotary(spec: LlamaSpec, device: torch.device) -> nn.Module:
    return spec.module("RotaryEmbedding")(spec.hf_config()).to(device)


@functools.cache
def _window(spec: LlamaSpec) -> tuple[int | None, frozenset[int]]:
    """(sliding window, the blocks that use it): Mistral's window applies to every layer, Qwen2's to the
    layers its ``layer_types`` mark ``sliding_attention``."""
    cfg = spec.hf_config()
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None, frozenset()
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return int(window), frozenset(range(spec.num_layers))
    sliding = frozenset(i for i, t in enumerate(types) if t == "sliding_attention")
    return (int(window), sliding) if sliding else (None, frozenset())


def from_config(m: ModelConfig, num_labels: int) -> LlamaSpec:
    """The spec from the ``model.*`` keys (random init)."""
    return LlamaSpec(
        "llama",
        m.num_layers,
        m.hidden_size,
        m.num_heads,
        m.num_kv_heads or m.num_heads,
        m.intermediate_size,
        m.vocab_size,
        m.seq_len,
        dropout_of(m),
        m.layer_norm_eps,
        m.init_std,
        m.rope_theta,
        bool(m.tie_word_embeddings),
        "",
    )


def from_hf_dir(path: Path, m: ModelConfig, num_labels: int) -> LlamaSpec:
    """The spec from a checkpoint's ``config.json`` (llama, mistral or qwen2): its ``attention_dropout``
    (0.0 in every released Llama) unless ``model.dropout`` is set."""
    from transformers import AutoConfig

    raw = (Path(path) / "config.json").read_text()
    fields = json.loads(raw)
    model_type = fields.pop("model_type", None) or "llama"
    if model_type not in PREFIX:
        raise UnsupportedModel(f"{path}: model_type {model_type!r} is not one the llama family builds")
    c = AutoConfig.for_model(model_type, **fields)  # the type's own defaults for what the file leaves out
    rope_theta = float((c.rope_parameters or {}).get("rope_theta", 10000.0))
    return LlamaSpec(
        model_type,
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
        c.vocab_size,
        c.max_position_embeddings,
        dropout_of(m, c.attention_dropout),
        c.rms_norm_eps,
        c.initializer_range,
        rope_theta,
        bool(c.tie_word_embeddings),
        raw,
    )


def validate(m: ModelConfig) -> list[Problem]:
    """model.num_kv_heads (grouped-query attention) must divide model.num_heads."""
    if m.num_kv_heads is not None and (m.num_kv_heads < 1 or m.num_heads % m.num_kv_heads):
        return [
            Problem(
                "model.num_kv_heads",
                f"got {m.num_kv_heads}; must divide model.num_heads={m.num_heads} ({divisors(m.num_heads)})",
            )
        ]
    return []


register_family(
    ModelFamily(
        name="llama",
        model_types=tuple(PREFIX),
        description=(
            "Llama-architecture decoder: RMSNorm, rotary, SwiGLU, GQA (HF LlamaForCausalLM; Mistral, Qwen2)"
        ),
        from_config=from_config,
        from_hf_dir=from_hf_dir,
        objective=LM,
        tied_head=lambda m: bool(m.tie_word_embeddings),
        keys=("num_kv_heads",),
        validate=validate,
    )
)
