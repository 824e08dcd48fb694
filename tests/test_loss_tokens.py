"""The loss is one mean over the global minibatch's loss tokens (torchtitan's ``global_valid_tokens``, Hugging
Face's ``num_items_in_batch``): with answer-only chat data, whose answers differ in length, every mode, every
``batch.ubatch_size``, data parallel and the pipeline train the weights a plain ``transformers`` model
trains on the same minibatches with one token mean (``RunnerBase.loss_divisors``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig
from safetensors.torch import load_file

from l2l_cli.data.batches import TrainStream
from l2l_cli.data.rows import IGNORE
from l2l_cli.engine.optim import no_decay
from tests.test_chat import chat_cfg, chat_data, conversation, write_jsonl, write_model
from tests.util import l2l, train

STEPS = 3
# a constant learning rate and no warmup: the reference's schedule is the optimizer's own
LOSS = ["batch.size=4", "optim.schedule=constant", "optim.warmup_steps=0", "trainer.seed=0"]
# answer lengths per micro-batch of one row: 2..11 tokens, so a per-micro-batch mean weighs tokens unevenly
RTOL = 1e-6


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("loss")
    files = write_jsonl(root / "chat.jsonl", [{"messages": conversation(i)} for i in range(24)])
    return write_model("llama", root), files


def cfg_of(chat: tuple[Path, Path], *overrides: str) -> DictConfig:
    return chat_cfg(*chat, *LOSS, *overrides)


def reference(chat: tuple[Path, Path]) -> dict[str, torch.Tensor]:
    """The same minibatches through ``LlamaForCausalLM``: its own loss (one mean over the minibatch's
    answer tokens), AdamW and global-norm clipping from torch."""
    from transformers import AutoModelForCausalLM

    cfg = cfg_of(chat)
    data = chat_data(*chat, *LOSS)
    model = AutoModelForCausalLM.from_pretrained(
        chat[0], torch_dtype=torch.float32, attn_implementation="eager"
    )
    model.train()
    o = cfg.optim
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not no_decay(n)], "weight_decay": o.weight_decay},
        {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    it = TrainStream(data.train, cfg.batch.size, seed=0).batches()
    for _ in range(STEPS):
        b = next(it)
        mask = (b.attention_mask != 0).long()
        out = model(input_ids=b.input_ids, attention_mask=mask, labels=b.labels, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


@pytest.fixture(scope="module")
def ref(chat: tuple[Path, Path]) -> dict[str, torch.Tensor]:
    return reference(chat)


def assert_close_relative(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str) -> None:
    """Every tensor within ``RTOL`` of the reference, relative to its norm (fp32 sums in another order)."""
    assert got.keys() <= ref.keys(), what
    for k, t in got.items():
        err = float((t.float() - ref[k]).norm() / ref[k].norm())
        assert err <= RTOL, f"{what}: {k} differs by {err:.2e} (relative)"


def test_the_data_has_uneven_answers(chat: tuple[Path, Path]) -> None:
    """The premise: micro-batches of one row hold different numbers of loss tokens."""
    data = chat_data(*chat, *LOSS)
    b = next(TrainStream(data.train, 4, seed=0).batches())
    counts = [int((row[1:] != IGNORE).sum()) for row in b.labels]
    assert len(set(counts)) > 1, counts


FAST = {("baseline", 4), ("baseline_ag", 1), ("l2l", 2), ("l2l_p", 1)}  # the default suite's sample
MODES = [
    pytest.param(mode, ub, extra, marks=() if (mode, ub) in FAST and not extra else pytest.mark.slow)
    for mode, ub, extra in [
        ("baseline", 4, ()),
        ("baseline_ag", 1, ()),
        ("baseline_ag", 2, ()),
        ("l2l", 1, ()),
        ("l2l", 2, ()),
        ("l2l", 4, ()),
        ("l2l", 1, ("mode.stash=cpu",)),
        ("l2l_p", 1, ()),
        ("l2l_p", 2, ()),
        ("l2l_p", 4, ()),
        ("l2l_p", 1, ("mode.stash=cpu",)),
    ]
]


@pytest.mark.parametrize(("mode", "ubatch", "extra"), MODES)
def test_every_mode_and_ubatch_size_trains_the_transformers_weights(
    chat: tuple[Path, Path], ref: dict[str, torch.Tensor], mode: str, ubatch: int, extra: tuple[str, ...]
) -> None:
    got = train(
        cfg_of(chat, f"mode={mode}", f"batch.ubatch_size={ubatch}", *extra),
        steps=STEPS,
        data=chat_data(*chat, *LOSS),
    )
    assert_close_relative(got["weights"], ref, f"{mode} ubatch {ubatch} {extra}")


def _cli(chat: tuple[Path, Path], out: Path, *overrides: str) -> dict[str, torch.Tensor]:
    model, files = chat
    args = [
        f"model.pretrained={model}",
        f"task.files=[{files}]",
        "task.max_eval_samples=4",
        f"trainer.max_steps={STEPS}",
        "trainer.save_final=true",
        f"hydra.run.dir={out}",
    ]
    cfg = cfg_of(chat)  # the in-process runs' config, as command-line overrides
    base = [
        "task=chat",
        "task.max_seq_len=48",
        "model.dropout=0.0",
        "trainer.progress=none",
        "optim.lr=1e-3",
        f"model.num_layers={cfg.model.num_layers}",
        *LOSS,
    ]
    r = l2l("train", *base, *args, *overrides, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return load_file(out / "final" / "model.safetensors")


RANKS = [
    ("dp", "l2l_p", ("dist.nproc=2", "batch.size=2", "batch.ubatch_size=1")),
    pytest.param(
        "dp", "baseline_ag", ("dist.nproc=2", "batch.size=2", "batch.ubatch_size=1"), marks=pytest.mark.slow
    ),
    pytest.param(
        "dp", "l2l", ("dist.nproc=2", "batch.size=2", "batch.ubatch_size=1"), marks=pytest.mark.slow
    ),
    pytest.param(
        "pipeline",
        "baseline_ag",
        ("dist.nproc=2", "dist.pipeline=2", "batch.ubatch_size=1"),
        marks=pytest.mark.slow,  # the pipeline's loss: test_pipeline's equivalence tests by default
    ),
    pytest.param(
        "pipeline", "l2l", ("dist.nproc=2", "dist.pipeline=2", "batch.ubatch_size=1"), marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize(("how", "mode", "overrides"), RANKS)
def test_two_ranks_train_the_transformers_weights(
    chat: tuple[Path, Path],
    ref: dict[str, torch.Tensor],
    tmp_path: Path,
    how: str,
    mode: str,
    overrides: tuple[str, ...],
) -> None:
    """2-rank data parallel (each rank 2 of the 4 rows, one per micro-batch) and the 2-rank pipeline."""
    got = _cli(chat, tmp_path, f"mode={mode}", *overrides)
    assert_close_relative(got, ref, f"{how} {mode}")
