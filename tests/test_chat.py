"""Task ``chat`` (data/chat.py): conversations and instruction pairs rendered with a chat template, the
loss on the assistant's tokens only, packing that keeps attention inside each example, and streamed
datasets (``task.streaming``, data/rows.py) that resume exactly. The models are a tiny Llama and a tiny
Qwen2 written with ``save_pretrained``, with a word-level tokenizer trained here and given a ChatML
template (nothing is downloaded)."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import DictConfig

from l2l_cli.data.loading import load_task
from l2l_cli.data.rows import IGNORE, collate_rows
from l2l_cli.data.tasks import TaskData
from l2l_cli.models.decoder import causal_mask, doc_positions
from l2l_cli.problems import ConfigError
from tests.util import REPO, assert_same_weights, l2l, tiny_cfg, train

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# the same rendering, with the assistant's part marked for return_assistant_tokens_mask
CHATML_TAGGED = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = (
    "what is the colour of the sky it is blue and the grass green sun yellow night dark tell me a story "
    "once upon a time there was a cat who sat on mat end please answer briefly sure here you go thanks "
    "add two and three five four six seven eight nine ten system you are helpful assistant user hello hi"
).split()


def conversation(i: int) -> list[dict[str, str]]:
    """A deterministic conversation of 1-2 exchanges from the word list (some with a system turn)."""
    rng = np.random.default_rng(i)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS, size=n))

    msgs = [{"role": "system", "content": text(3)}] if i % 3 == 0 else []
    for _ in range(1 + i % 2):
        msgs += [{"role": "user", "content": text(int(rng.integers(3, 8)))},
                 {"role": "assistant", "content": text(int(rng.integers(2, 7)))}]  # fmt: skip
    return msgs


def write_tokenizer(path: Path, template: str | None = CHATML) -> Path:
    """A word-level tokenizer over WORDS (+ ChatML's markers), saved as a fast HF tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=SPECIAL))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])  # fmt: skip
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(path)
    return path


def write_model(kind: str, root: Path) -> Path:
    """A tiny random ``kind`` (llama | qwen2) causal LM with the chat tokenizer, as a HF directory."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    sizes = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64, vocab_size=128, max_position_embeddings=128)  # fmt: skip
    cfg = LlamaConfig(**sizes, tie_word_embeddings=False) if kind == "llama" else Qwen2Config(**sizes)
    torch.manual_seed(0)
    path = root / kind
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    write_tokenizer(path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("chat")
    write_jsonl(r / "chat.jsonl", [{"messages": conversation(i)} for i in range(48)])
    return r


@pytest.fixture(scope="module")
def models(root: Path) -> dict[str, Path]:
    return {kind: write_model(kind, root) for kind in ("llama", "qwen2")}


CHAT = ["task=chat", "task.max_seq_len=48", "batch.size=4", "batch.ubatch_size=2", "model.dropout=0.0",
        "trainer.progress=none", "optim.lr=1e-3"]  # fmt: skip


def chat_cfg(model: Path, files: Path, *overrides: str) -> DictConfig:
    return tiny_cfg(*CHAT, f"model.pretrained={model}", f"task.files=[{files}]", *overrides)


@functools.cache
def chat_data(model: Path, files: Path, *overrides: str) -> TaskData:
    cfg = chat_cfg(model, files, *overrides)
    return load_task(cfg.task, cfg.model)


# ---- the mask and the shapes -------------------------------------------------------------------------


def test_only_the_answers_carry_labels(models: dict[str, Path], root: Path) -> None:
    """The labels are the assistant's content and its end-of-turn marker, nothing of the prompt; a
    template with {% generation %} blocks gives the same mask through return_assistant_tokens_mask."""
    from transformers import AutoTokenizer

    data = chat_data(models["llama"], root / "chat.jsonl")
    tok = AutoTokenizer.from_pretrained(models["llama"])
    ids, labels, docs = data.train.rows[1]
    trained = tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE])
    answers = [m["content"] for m in conversation(1) if m["role"] == "assistant"]
    assert trained.split() == " ".join(f"{a} <|im_end|>" for a in answers).split()
    assert (labels[labels != IGNORE] == ids[labels != IGNORE]).all() and set(docs) == {1}
    tagged = write_tokenizer(root / "tagged", CHATML_TAGGED)
    other = chat_data(models["llama"], root / "chat.jsonl", f"task.tokenizer={tagged}")
    for a, b in zip(data.train.rows + data.dev.rows, other.train.rows + other.dev.rows):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_instruction_and_prompt_completion_shapes_equal_messages(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """The same conversations written in the three shapes give the same tokens and masks."""
    convs = [[{"role": "user", "content": " ".join(WORDS[i : i + 4])},
              {"role": "assistant", "content": " ".join(WORDS[i + 5 : i + 8])}] for i in range(12)]  # fmt: skip
    shapes = {
        "messages": [{"messages": c} for c in convs],
        "instruction": [
            {"instruction": c[0]["content"], "input": "", "output": c[1]["content"]} for c in convs
        ],
        "prompt_completion": [{"prompt": c[0]["content"], "completion": c[1]["content"]} for c in convs],
    }
    got = {}
    for fmt, rows in shapes.items():
        path = write_jsonl(tmp_path / f"{fmt}.jsonl", rows)
        for how in ("auto", fmt):
            d = chat_data(models["qwen2"], path, f"task.format={how}")
            got[fmt, how] = [tuple(map(tuple, r)) for r in d.train.rows + d.dev.rows]
    first = got["messages", "auto"]
    assert len(first) == 12 and all(v == first for v in got.values())


def test_packing_keeps_attention_and_positions_inside_each_example(
    models: dict[str, Path], root: Path
) -> None:
    """Packed rows hold several whole examples, numbered; the mask never lets a token see another
    example's and positions restart at each; and a packed row's loss on its first example equals that
    example's loss alone (so is unchanged when the second example changes)."""
    from l2l_cli.models import LayeredModel, make_spec

    packed = chat_data(models["llama"], root / "chat.jsonl", "task.packing=true", "task.max_seq_len=96")
    single = chat_data(models["llama"], root / "chat.jsonl", "task.max_seq_len=96")
    assert len(packed.train) < len(single.train) and max(int(r[2].max()) for r in packed.train.rows) >= 2
    batch = packed.train.collate([0], len(packed.train.rows[0][0]))
    mask, pos = causal_mask(batch.attention_mask, None), doc_positions(batch.attention_mask)
    doc = batch.attention_mask[0]
    assert mask is not None and pos is not None
    assert not (mask[0, 0] & (doc[:, None] != doc[None, :])).any()
    assert int(pos[0, int((doc == 1).sum())]) == 0  # the second example starts at position 0
    cfg = chat_cfg(models["llama"], root / "chat.jsonl", "task.packing=true")
    model = LayeredModel(make_spec(cfg.model, 0)).eval()  # random weights: the wiring is what counts
    n1 = int((doc == 1).sum())
    with torch.no_grad():
        whole = model(batch)[1][0, :n1]
        ids, labels, docs = packed.train.rows[0]
        alone = model(collate_rows([(ids[:n1], labels[:n1], docs[:n1])], n1))[1][0]
        batch.input_ids[0, n1:] = (batch.input_ids[0, n1:] + 7) % 100 + 10  # another second example
        changed = model(batch)[1][0, :n1]
    torch.testing.assert_close(whole, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole, changed, rtol=0, atol=0)
