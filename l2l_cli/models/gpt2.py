"""The GPT-2 family: learned positions, pre-LayerNorm blocks, a tied LM head (GPT-2 and the papers'
Turing-NLG-like decoder), from Hugging Face's GPT-2 modules, so a ``gpt2`` checkpoint loads unchanged and
the trained model saves back as a ``GPT2LMHeadModel`` directory.

pre = token + position embeddings and dropout (``GPT2Model``'s first lines); block = ``GPT2Block``;
post = ``ln_f`` and the LM head (its weight the token embedding's when tied).

Imports of torch, ``transformers`` and the layer modules sit in the functions that build, run or save a
layer, so importing the family (``l2l plan``, the config's checks) imports no torch.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from l2l_cli.config.schema import ModelConfig
from l2l_cli.data.tasks import LM
from l2l_cli.models.base import dropout_of
from l2l_cli.models.decoder import DecoderSide, DecoderSpec, config_dict
from l2l_cli.models.registry import ModelFamily, UnsupportedModel, register_family

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class GPT2Spec(DecoderSpec):
    """Sizes of a GPT-2-style decoder (``intermediate_size``: GPT-2's ``n_inner``, 4·hidden in GPT-2)."""

    family = "gpt2"
    base_prefix = "transformer."
    peft_fan_in_fan_out = True  # its Conv1D weights are (in, out)
    blocks_name = "h"
    norm_name = "ln_f"
    embed_name = "wte"

    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    seq_len: int  # learned positions (n_positions)
    dropout: float  # resid, embd and attn dropout
    layer_norm_eps: float
    init_std: float
    tie_word_embeddings: bool
    hf_json: str

    def hf_config(self) -> Any:
        return _config(self)

    def formula_counts(self) -> tuple[int, int, int] | None:
        """From ``model.*`` (no config.json): token and position embeddings; the block's fused QKV and
        output projections, MLP and two LayerNorms (all with biases); ``ln_f`` and the LM head unless tied."""
        if self.hf_json:
            return None
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        block = 4 * h * h + 2 * h * i + 9 * h + i
        return (v + self.seq_len) * h, block, 2 * h + (0 if self.tie_word_embeddings else v * h)

    def causal_lm_class(self) -> str:
        return "GPT2LMHeadModel"

    def new_pre(self, cfg: PretrainedConfig) -> nn.Module:
        from l2l_cli.models.decoder_modules import GPT2Embeddings

        return GPT2Embeddings(cfg)

    def new_block(self, cfg: PretrainedConfig) -> nn.Module:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return GPT2Block(cfg, layer_idx=0)

    def new_norm(self, cfg: PretrainedConfig) -> nn.Module:
        from torch import nn

        return nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)

    def run_pre(self, layer: nn.Module, ub: Any) -> torch.Tensor:
        """Token + learned position embeddings; packed rows take each document's positions from 0."""
        from l2l_cli.models.decoder_modules import doc_positions

        return layer(ub.input_ids, doc_positions(ub.attention_mask))

    def run_block(self, layer: nn.Module, index: int, x: torch.Tensor, side: DecoderSide) -> torch.Tensor:
        return layer(x, attention_mask=side.mask, cache=side.cache)

    def embed_at(
        self, layer: nn.Module, input_ids_BS: torch.Tensor, positions_BS: torch.Tensor
    ) -> torch.Tensor:
        return layer(input_ids_BS, positions_BS)

    def residual_init_scale(self, name: str) -> float:
        """GPT-2's scheme: the projections into the residual stream at init_std / sqrt(2 · layers)."""
        return (2 * self.num_layers) ** -0.5 if name.endswith("c_proj") else 1.0


@functools.cache  # built once per spec: every layer build and the relay's shells share it (read-only)
def _config(spec: GPT2Spec) -> Any:
    from transformers import GPT2Config

    d = spec.dropout
    # random init: the token ids come with the tokenizer (set on export), not GPT-2's 50256
    ids = {} if spec.hf_json else {"bos_token_id": None, "eos_token_id": None}
    cfg = GPT2Config.from_dict(
        {
            **config_dict(spec.hf_json),
            "n_layer": spec.num_layers,
            "n_embd": spec.hidden_size,
            "n_head": spec.num_heads,
            "n_inner": spec.intermediate_size,
            "vocab_size": spec.vocab_size,
            "n_positions": spec.seq_len,
            "layer_norm_epsilon": spec.layer_norm_eps,
            "initializer_range": spec.init_std,
            "resid_pdrop": d,
            "embd_pdrop": d,
            "attn_pdrop": d,
            "tie_word_embeddings": spec.tie_word_embeddings,
            "use_cache": False,
            **ids,
        }
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def from_config(m: ModelConfig, num_labels: int) -> GPT2Spec:
    """The spec from the ``model.*`` keys (random init)."""
    return GPT2Spec(
        m.num_layers,
        m.hidden_size,
        m.num_heads,
        m.intermediate_size,
        m.vocab_size,
        m.seq_len,
        dropout_of(m),
        m.layer_norm_eps,
        m.init_std,
        bool(m.tie_word_embeddings),
        "",
    )


def from_hf_dir(path: Path, m: ModelConfig, num_labels: int) -> GPT2Spec:
    """The spec from a checkpoint's ``config.json``: its dropout (``resid_pdrop``) unless ``model.dropout``
    is set."""
    raw = (Path(path) / "config.json").read_text()
    c = json.loads(raw)
    for key, why in (
        ("add_cross_attention", "cross-attention blocks"),
        ("scale_attn_by_inverse_layer_idx", "per-layer attention scaling"),
    ):
        if c.get(key):
            raise UnsupportedModel(f"{path}: {key}=true ({why}) is not supported by the gpt2 family")
    h = c["n_embd"]
    return GPT2Spec(
        c["n_layer"],
        h,
        c["n_head"],
        c.get("n_inner") or 4 * h,
        c["vocab_size"],
        c.get("n_positions", 1024),
        dropout_of(m, c.get("resid_pdrop", 0.1)),
        c.get("layer_norm_epsilon", 1e-5),
        c.get("initializer_range", 0.02),
        bool(c.get("tie_word_embeddings", True)),
        raw,
    )


register_family(
    ModelFamily(
        name="gpt2",
        model_types=("gpt2",),
        description="GPT-2 decoder: learned positions, pre-LayerNorm, tied LM head (HF GPT2LMHeadModel)",
        from_config=from_config,
        from_hf_dir=from_hf_dir,
        objective=LM,
        tied_head=lambda m: bool(m.tie_word_embeddings),
    )
)
