"""What every model family gives the engine: a :class:`ModelSpec` (the sizes, and how each layer is built,
run, named in a Hugging Face checkpoint and saved); ``layered.py`` holds :class:`LayeredModel` = pre ·
blocks · post over it. This file imports no torch (``l2l plan`` reads the sizes, counts and FLOPs): a
family imports it, and its modules, where a run builds or runs a layer.

Layer indices are global: 0 = pre (embeddings), 1..N = transformer blocks, N+1 = post (head and loss).
Every runner builds layer i the same way from the same seed, so all modes start from the same weights.
Nothing here knows about L2L: where layers live and when they run is decided by ``engine/`` and ``modes/``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch
    from torch import nn

    from l2l_cli.data.tasks import TaskSpec

PRE, BLOCK, POST = "pre", "block", "post"


class ModelSpec(ABC):
    """A model as the runners see it. Subclasses (one per family) are frozen dataclasses of sizes that
    define ``num_layers``, ``hidden_size``, ``num_heads``, ``intermediate_size``, ``vocab_size`` and
    ``num_labels``."""

    family: ClassVar[str]
    base_prefix: ClassVar[str] = ""  # HF names of the base model's tensors inside the task model ("bert.")
    # what PEFT needs of the family (models/lora.py reads these, never the family's name): its task type
    # (SEQ_CLS: the head joins modules_to_save, as PEFT's sequence-classification model adds it), the
    # modules of its output head (all-linear leaves them out), and whether its linear weights are stored
    # (in, out) as GPT-2's Conv1D (PEFT's fan_in_fan_out)
    peft_task_type: ClassVar[str] = "CAUSAL_LM"
    peft_head: ClassVar[tuple[str, ...]] = ("lm_head",)
    peft_fan_in_fan_out: ClassVar[bool] = False
    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    num_labels: int

    @property
    def num_all_layers(self) -> int:
        return self.num_layers + 2

    def kind(self, index: int) -> str:
        return PRE if index == 0 else POST if index == self.num_layers + 1 else BLOCK

    # ---- building --------------------------------------------------------------------------------

    @abstractmethod
    def new_layer(self, kind: str, device: torch.device | str | None = None) -> nn.Module:
        """An uninitialized layer module of ``kind`` (parameters allocated on ``device``)."""

    @abstractmethod
    def init_layer(self, module: nn.Module, index: int, seed: int) -> nn.Module:
        """The family's initialization of layer ``index``, seeded per layer (every mode builds it alike)."""

    def build_layer(self, index: int, seed: int, device: torch.device | str | None = None) -> nn.Module:
        return self.init_layer(self.new_layer(self.kind(index), device), index, seed)

    def reset_buffers(self, module: nn.Module) -> None:  # noqa: B027  (most families have none)
        """Re-create non-persistent buffers (position ids, say) of a module built on the meta device."""

    def materialize(self, shell: nn.Module, device: torch.device | str) -> nn.Module:
        """A layer built on the meta device (a shell whose parameters are views of flat buffers bound
        elsewhere: the relay's device slots, a pipeline stage's buffers), made runnable: its buffers become
        real tensors on ``device`` and the family re-creates their values (``reset_buffers``)."""
        import torch

        for owner in shell.modules():  # index buffers (position ids) become real tensors
            for name, buf in list(owner._buffers.items()):
                if buf is not None and buf.device.type == "meta":
                    owner._buffers[name] = torch.empty_like(buf, device=device)
        self.reset_buffers(shell)
        return shell

    def tied_params(self) -> dict[str, str]:
        """Post-layer parameters that *are* pre-layer ones, {post name: pre name} (a tied LM head:
        ``{"lm_head.weight": "wte.weight"}``). One tensor, two uses: the baselines share the parameter
        between the two modules; the EPS keeps one master in the pre layer and adds the post layer's
        gradient of it to the pre layer's before the update (engine/tied.py)."""
        return {}

    # ---- running ---------------------------------------------------------------------------------

    def block_variant(self, index: int) -> Any:
        """What block ``index``'s code reads of its index beyond its weights (a sliding-window layer's mask):
        blocks of one variant run the same code, so a CUDA graph of one serves the others
        (engine/graphs.py)."""
        return None

    @abstractmethod
    def side_inputs(self, ub: Any, dtype: torch.dtype) -> Any:
        """What every block of a micro-batch reads besides the hidden states (BERT: the attention mask)."""

    @abstractmethod
    def run_layer(
        self, layer: nn.Module, index: int, x: torch.Tensor | None, ub: Any, side: Any
    ) -> torch.Tensor:
        """Forward of the pre layer (``x`` is None: it reads the batch) or of a block."""

    @abstractmethod
    def run_head(
        self, layer: nn.Module, x: torch.Tensor, ub: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The post layer: (loss, logits) of a micro-batch. With gradients on, a family may return no
        logits (a language model's head takes its loss in chunks rather than keep them all)."""

    @abstractmethod
    def head_logits(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The post layer's outputs without a loss (evaluation, prediction)."""

    def logits_shape(self, rows: int, seq: int) -> tuple[int, ...]:
        """The shape of ``head_logits`` for ``rows`` sequences of ``seq`` tokens (a pipeline's last stage
        declares it before running): one row of labels per sequence here."""
        return (rows, self.num_labels)

    def head_graph_bytes(self, rows: int, seq: int) -> int:
        """Device bytes the post layer's training graph holds for a micro-batch of ``rows`` x ``seq``
        tokens beyond what it holds anyway when ``keep_head_graph`` keeps it (0: nothing to keep)."""
        return 0

    def keep_head_graph(self, layer: nn.Module, keep: bool) -> None:  # noqa: B027  (most have no choice)
        """Whether the post layer ``layer`` keeps its training graph whole rather than recompute parts of
        it in backward (a language model's loss chunks); the same numbers either way."""

    def loss_count(self, ub: Any) -> int:
        """How many terms ``run_head``'s loss is the mean of on micro-batch ``ub`` (here: one per example;
        a language model: its tokens with a target). The runners weight each micro-batch's mean loss by
        its count over the global minibatch's, so the loss is one mean however the batch is cut."""
        return len(ub.labels)

    def rows_read(self, index: int, batch: Any) -> dict[str, torch.Tensor] | None:
        """The rows of layer ``index``'s parameters that a forward and backward on ``batch`` read, for the
        parameters read only in part (embedding tables: ``{name: row indices}``; the others are read whole);
        None when the layer reads all of its parameters. L2L-p updates the rows the next batch reads first
        and the rest behind its forward pass. Only the weights are meant: an embedding's backward does not
        read its table."""
        return None

    # ---- checkpoints -----------------------------------------------------------------------------

    @abstractmethod
    def hf_name(self, index: int, name: str) -> str:
        """The Hugging Face checkpoint name of layer ``index``'s parameter ``name``."""

    def lookup_hf(self, tensors: Any, name: str) -> torch.Tensor | None:
        """A tensor by HF name from a dict or a safetensors handle (None when absent). Base-model files
        (``BertModel``, OpenAI's GPT-2) name their tensors without the task model's ``base_prefix``."""
        keys = tensors.keys()  # (a safetensors handle has keys(), not __contains__)
        for cand in (name, name.removeprefix(self.base_prefix)) if self.base_prefix else (name,):
            if cand in keys:
                return tensors[cand] if isinstance(tensors, dict) else tensors.get_tensor(cand)
        return None

    @abstractmethod
    def save_hf(
        self, out_dir: Path, named_tensors: Iterable[tuple[str, torch.Tensor]], task: TaskSpec | None = None
    ) -> None:
        """Write a Hugging Face model directory of the trained weights."""

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """The sizes a checkpoint must match to load into this model."""

    def base_fingerprint(self) -> dict[str, Any] | None:
        """The fingerprint of a frozen base the trained tensors need beside them (a LoRA model's:
        models/lora.py); None: every weight is in the model's own checkpoint."""
        return None

    # ---- planner and evaluation ------------------------------------------------------------------

    @abstractmethod
    def param_counts(self) -> tuple[int, int, int]:
        """Parameters of (pre, one block, post), by formula: the planner's count and the run's ``params``."""

    @abstractmethod
    def head_flops(self, seq: int) -> float:
        """Forward FLOPs of the post layer for one sample of ``seq`` tokens (its matmuls, 2 per
        multiply-add)."""

    def block_flops(self, seq: int) -> float:
        """Forward FLOPs of one block for one sample: the weight matmuls (2 per parameter per token) and
        attention's two s×s products (QKᵀ and the weighted sum of V: 4·s²·h). This is the encoder block's
        count (4·h² attention + 2·h·I MLP weights); families with other block shapes override it."""
        h, i = self.hidden_size, self.intermediate_size
        return 2.0 * seq * (4 * h * h + 2 * h * i) + 4.0 * seq * seq * h

    @property
    def total_params(self) -> int:
        pre, block, post = self.param_counts()
        return pre + self.num_layers * block + post

    @abstractmethod
    def evaluate(
        self,
        predict: Callable[[Any], torch.Tensor],
        dev: Any,
        task: TaskSpec,
        batch_size: int,
        pad_to: int | None,
    ) -> dict[str, float]:
        """The task's metrics of the head's predictions on the dev split."""


SCRATCH_DROPOUT = 0.1  # model.dropout unset, no checkpoint: BERT's and GPT-2's own rate


def dropout_of(m: Any, checkpoint: float | None = None) -> float:
    """``model.dropout`` where set, else the checkpoint's own rate (``checkpoint``; a model from
    ``model.pretrained`` fine-tunes as transformers would train it), else 0.1."""
    if m.dropout is not None:
        return float(m.dropout)
    return SCRATCH_DROPOUT if checkpoint is None else float(checkpoint)
