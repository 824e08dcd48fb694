"""What the config's model costs, counted from its shape: parameters, FLOPs and activation bytes.

Parameter counts are the model family's formula (``ModelSpec.param_counts``), so they match the run's
``params`` exactly. FLOPs count the matmuls (2 per multiply-add);
elementwise work is left out, as the papers do. Activation bytes per token were measured once with the
project's StorageMeter on HF BertLayer (CPU, math attention) and are kept here as coefficients.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from l2l_cli.models.base import ModelSpec
from l2l_cli.plan.peft import PeftShape

# The EPS (host) update in the L2L v1 paper's units (§3.1.2: "Optimization requires 100 GFLOP" for
# BERT-Large's ~335M parameters, i.e. ~300 FLOP-equivalents per parameter at its 300 GFLOP/s EPS: 1 ns per
# parameter, what a CPU streaming AdamW's 28 bytes per parameter at ~28 GB/s takes).
OPT_FLOP_PER_PARAM = 300.0
# The on-device update, from what a fused AdamW kernel does per FP32 parameter: ~12 FLOPs (two moment
# updates, a square root, a division, the decoupled decay) while it reads the weight, the gradient and both
# moments (16 bytes) and writes the weight and the moments (12): bound by the device memory's bandwidth.
ADAMW_FLOP_PER_PARAM = 12.0
ADAMW_BYTES_PER_PARAM = 28.0
# The embeddings' backward, per micro-batch: few FLOPs, but a dense gradient of the whole table (a
# vocabulary x hidden one) written (4 bytes per parameter) and added to the accumulated one (read 8, write
# 4): bound by the device memory's bandwidth; what makes the first stage of a pipe heavy (issue 53).
EMBED_GRAD_BYTES_PER_PARAM = 16.0

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
    """The sizes that set a model's costs, with its parameter counts from its family's formula
    (``ModelSpec.param_counts``), so they match the run's ``params`` exactly."""

    spec: ModelSpec = field(
        compare=False, repr=False
    )  # the family's spec (builds layers for hardware=measure)
    # peft=lora: the adapters' and the frozen base's numbers (plan/peft.py); None: every parameter trains
    peft: PeftShape | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> ModelShape:
        return cls(spec)

    @classmethod
    def bert(cls, num_layers: int, hidden: int, heads: int, intermediate: int, **sizes: Any) -> ModelShape:
        """A BERT encoder of these widths, the other sizes from the schema's defaults (``model.*``)."""
        from l2l_cli.config import ModelConfig
        from l2l_cli.models import FAMILIES

        m = replace(
            ModelConfig(),
            num_layers=num_layers,
            hidden_size=hidden,
            num_heads=heads,
            intermediate_size=intermediate,
            **sizes,
        )
        return cls(FAMILIES["bert"].from_config(m, 2))

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def hidden(self) -> int:
        return self.spec.hidden_size

    @property
    def heads(self) -> int:
        return self.spec.num_heads

    @property
    def intermediate(self) -> int:
        return self.spec.intermediate_size

    @property
    def num_labels(self) -> int:
        return self.spec.num_labels

    # ---- parameters -------------------------------------------------------------------------------

    @property
    def pre_params(self) -> int:
        return self.spec.param_counts()[0]

    @property
    def block_params(self) -> int:
        return self.spec.param_counts()[1]

    @property
    def post_params(self) -> int:
        return self.spec.param_counts()[2]

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
        """Forward FLOPs of one block for one sample (the family's count, ``ModelSpec.block_flops``)."""
        return self.spec.block_flops(seq)

    def post_flops(self, seq: int) -> float:
        return self.spec.head_flops(seq)

    # ---- activations (per sample) ----------------------------------------------------------------

    def block_saved_bytes(self, seq: int, precision: str, att_half: float | None = None) -> float:
        """Activations one block's forward keeps for its backward, per sample (the papers' X). ``att_half``:
        bytes kept per attention score under amp/cmp by the device's attention kernel (``hardware.
        attention_bytes_half``; unset: HF's math attention, measured)."""
        e = act_bytes(precision)
        att = _ATT_BYTES[e] if att_half is None or precision == "fp32" else att_half
        return seq * (e * (10 * self.hidden + 2 * self.intermediate) + att * self.heads * seq)

    def block_working_bytes(self, seq: int, precision: str, att_half: float | None = None) -> float:
        """Peak working set of one block's recompute + backward, per sample."""
        return (1 + BACKWARD_TRANSIENT) * self.block_saved_bytes(seq, precision, att_half)

    def pre_saved_bytes(self, seq: int, precision: str) -> float:
        """Embeddings: the sum of three lookups, its LayerNorm and dropout (~3 activations per token)."""
        return 3.0 * seq * self.hidden * act_bytes(precision)

    def output_bytes(self, seq: int, precision: str) -> float:
        """One layer's output for one sample (the papers' A): what the stash keeps per layer."""
        return float(seq * self.hidden * out_bytes(precision))
