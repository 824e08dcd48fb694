"""What the config's model costs, counted from its shape: parameters, FLOPs and activation bytes.

Parameter counts follow the modules ``models/bert.py`` builds (HF BertEmbeddings, BertLayer, pooler +
classifier), so they match the run's ``params`` exactly. FLOPs count the matmuls (2 per multiply-add);
elementwise work is left out, as the papers do. Activation bytes per token were measured once with the
project's StorageMeter on HF BertLayer (CPU, math attention) and are kept here as coefficients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Optimizer work in the L2L v1 paper's units (§3.1.2: "Optimization requires 100 GFLOP" for BERT-Large's
# ~335M parameters, i.e. ~300 FLOP-equivalents per parameter for an Adam-family update and its clipping).
OPT_FLOP_PER_PARAM = 300.0

# Saved activations of one BertLayer forward, bytes per token (StorageMeter, see module doc):
#   e·(10·h + 2·I) + c·heads·seq  (e = activation bytes; c = 12 in fp32, 15 in half: the softmax stays
#   fp32 there), and the backward's transient gradients add ~30% on top at the peak.
_ATT_BYTES = {4: 12, 3: 15, 2: 15}
BACKWARD_TRANSIENT = 0.3


def act_bytes(precision: str) -> int:
    """Bytes of a working activation: fp32 4; cmp 2 (pure half); amp ~3 (half matmul outputs, fp32
    LayerNorm / softmax / residuals under autocast)."""
    return {"fp32": 4, "amp": 3, "cmp": 2}[precision]


def out_bytes(precision: str) -> int:
    """Bytes per element of a layer's output (what is stashed): LayerNorm ends a block, and under
    autocast it returns fp32, so only cmp stashes half."""
    return 2 if precision == "cmp" else 4


def device_weight_bytes(precision: str) -> int:
    """Bytes per parameter of the device copy of a layer (cmp relays a half copy, L2L v2 §2.3)."""
    return 2 if precision == "cmp" else 4


@dataclass(frozen=True)
class ModelShape:
    """A BERT encoder with a classification head: the sizes that set its costs."""

    num_layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int = 30522
    max_positions: int = 512
    type_vocab: int = 2
    num_labels: int = 2

    @classmethod
    def from_spec(cls, spec: Any) -> ModelShape:
        return cls(
            spec.num_layers, spec.hidden_size, spec.num_heads, spec.intermediate_size, spec.vocab_size,
            spec.seq_len, spec.type_vocab_size, spec.num_labels,
        )  # fmt: skip

    # ---- parameters -------------------------------------------------------------------------------

    @property
    def block_params(self) -> int:
        """Q, K, V, output (4·h² + 4·h), the MLP (2·h·I + I + h), two LayerNorms (4·h): 12h² + 13h at I = 4h."""
        h, i = self.hidden, self.intermediate
        return 4 * h * h + 2 * h * i + 9 * h + i

    @property
    def pre_params(self) -> int:
        """Word, position and token-type embeddings and their LayerNorm."""
        return (self.vocab + self.max_positions + self.type_vocab) * self.hidden + 2 * self.hidden

    @property
    def post_params(self) -> int:
        """Pooler (h² + h) and classifier."""
        h = self.hidden
        return h * h + h + h * self.num_labels + self.num_labels

    @property
    def blocks_params(self) -> int:
        return self.num_layers * self.block_params

    @property
    def total_params(self) -> int:
        return self.pre_params + self.blocks_params + self.post_params

    @property
    def max_layer_params(self) -> int:
        """The largest layer: what one relay slot must hold (the embeddings, for BERT's vocabulary)."""
        return max(self.pre_params, self.block_params, self.post_params)

    # ---- compute (per sample, forward) -----------------------------------------------------------

    def block_flops(self, seq: int) -> float:
        """Forward FLOPs of one block for one sample: the weight matmuls (2 per parameter per token) and
        attention's two s×s products (QKᵀ and the weighted sum of V: 4·s²·h)."""
        h, i = self.hidden, self.intermediate
        return 2.0 * seq * (4 * h * h + 2 * h * i) + 4.0 * seq * seq * h

    def post_flops(self) -> float:
        return 2.0 * (self.hidden * self.hidden + self.hidden * self.num_labels)

    # ---- activations (per sample) ----------------------------------------------------------------

    def block_saved_bytes(self, seq: int, precision: str) -> float:
        """Activations one block's forward keeps for its backward, per sample (the papers' X)."""
        e = act_bytes(precision)
        return seq * (e * (10 * self.hidden + 2 * self.intermediate) + _ATT_BYTES[e] * self.heads * seq)

    def block_working_bytes(self, seq: int, precision: str) -> float:
        """Peak working set of one block's recompute + backward, per sample."""
        return (1 + BACKWARD_TRANSIENT) * self.block_saved_bytes(seq, precision)

    def pre_saved_bytes(self, seq: int, precision: str) -> float:
        """Embeddings: the sum of three lookups, its LayerNorm and dropout (~3 activations per token)."""
        return 3.0 * seq * self.hidden * act_bytes(precision)

    def output_bytes(self, seq: int, precision: str) -> float:
        """One layer's output for one sample (the papers' A): what the stash keeps per layer."""
        return float(seq * self.hidden * out_bytes(precision))
