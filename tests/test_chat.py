"""Task ``chat`` (data/chat.py): conversations and instruction pairs rendered with a chat template, the
loss on the assistant's tokens only, packing that keeps attention inside each example, and streamed
datasets (``task.streaming``, data/rows.py) that resume exactly. The models are a tiny Llama and a tiny
Qwen2 written with ``save_pretrained``, with a word-level tokenizer trained here and given a ChatML
template (nothing is downloaded)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import DictConfig

from l2l_cli.data.loading import load_task
from l2l_cli.data.rows import IGNORE, collate_rows
from l2l_cli.data.tasks import TaskData
from l2l_cli.models.decoder_modules import causal_mask, doc_positions
from tests.util import assert_same_weights, l2l, tiny_cfg, train

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
WORDS = [
    "what",
    "is",
    "the",
    "colour",
    "of",
    "the",
    "sky",
    "it",
    "is",
    "blue",
    "and",
    "the",
    "grass",
    "green",
    "sun",
    "yellow",
    "night",
    "dark",
    "tell",
    "me",
    "a",
    "story",
    "once",
    "upon",
    "a",
    "time",
    "there",
    "was",
    "a",
    "cat",
    "who",
    "sat",
    "on",
    "mat",
    "end",
    "please",
    "answer",
    "briefly",
    "sure",
    "here",
    "you",
    "go",
    "thanks",
    "add",
    "two",
    "and",
    "three",
    "five",
    "four",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "system",
    "you",
    "are",
    "helpful",
    "assistant",
    "user",
    "hello",
    "hi",
]


def conversation(i: int) -> list[dict[str, str]]:
    """A deterministic conversation of 1-2 exchanges from the word list (some with a system turn)."""
    rng = np.random.default_rng(i)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS, size=n))

    msgs = [{"role": "system", "content": text(3)}] if i % 3 == 0 else []
    for _ in range(1 + i % 2):
        msgs += [
            {"role": "user", "content": text(int(rng.integers(3, 8)))},
            {"role": "assistant", "content": text(int(rng.integers(2, 7)))},
        ]
    return msgs


def write_tokenizer(path: Path, template: str | None = CHATML) -> Path:
    """A word-level tokenizer over WORDS (+ ChatML's markers), saved as a fast HF tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=SPECIAL))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(path)
    return path


def write_model(kind: str, root: Path) -> Path:
    """A tiny random ``kind`` (llama | qwen2) causal LM with the chat tokenizer, as a HF directory."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    sizes = dict(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=128,
        max_position_embeddings=128,
    )
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


CHAT = [
    "task=chat",
    "task.max_seq_len=48",
    "batch.size=4",
    "batch.ubatch_size=2",
    "model.dropout=0.0",
    "trainer.progress=none",
    "optim.lr=1e-3",
]


def chat_cfg(model: Path, files: Path, *overrides: str) -> DictConfig:
    return tiny_cfg(*CHAT, f"model.pretrained={model}", f"task.files=[{files}]", *overrides)


@functools.cache
def chat_data(model: Path, files: Path, *overrides: str) -> TaskData:
    cfg = chat_cfg(model, files, *overrides)
    return load_task(cfg.task, cfg.model)


# ---- the mask and the shapes -------------------------------------------------------------------------


def test_only_the_answers_carry_labels(models: dict[str, Path], root: Path) -> None:
    """The labels are the assistant's content and its end-of-turn marker, nothing of the prompt; a
    template with {% generation %} blocks gives the same mask through return_assistant_tokens_mask, and
    task.chat_template (a file) the same rows as the tokenizer's own template."""
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
    (root / "chatml.jinja").write_text(CHATML)  # task.chat_template: a file, over a template-less tokenizer
    plain = write_tokenizer(root / "plain", None)
    given = chat_data(
        models["llama"],
        root / "chat.jsonl",
        f"task.tokenizer={plain}",
        f"task.chat_template={root / 'chatml.jinja'}",
    )
    for o in (other, given):
        assert len(o.train) == len(data.train)
        for a, b in zip(data.train.rows + data.dev.rows, o.train.rows + o.dev.rows):
            assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_instruction_and_prompt_completion_shapes_equal_messages(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """The same conversations written in the three shapes give the same tokens and masks."""
    convs = [
        [
            {"role": "user", "content": " ".join(WORDS[i : i + 4])},
            {"role": "assistant", "content": " ".join(WORDS[i + 5 : i + 8])},
        ]
        for i in range(12)
    ]
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


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_packing_keeps_attention_and_positions_inside_each_example(
    models: dict[str, Path], root: Path, family: str
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
    if family == "gpt2":  # learned positions: the pre layer restarts them per example
        cfg = tiny_cfg("task=lm", "model=gpt2-tiny", "model.vocab_size=128", "model.seq_len=128")
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


def test_a_dataset_folder_reads_as_its_files(models: dict[str, Path], root: Path, tmp_path: Path) -> None:
    """task.dataset=<a local folder> goes through datasets.load_dataset (the hub's code path) and gives
    what task.files gives for the same rows (task=chat and task=lm)."""
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_text((root / "chat.jsonl").read_text())
    cfg = tiny_cfg(*CHAT, f"model.pretrained={models['llama']}", f"task.dataset={folder}")
    hub, files = load_task(cfg.task, cfg.model), chat_data(models["llama"], root / "chat.jsonl")
    assert hub.source.endswith(f"{folder}:train")
    assert [tuple(map(tuple, r)) for r in hub.train.rows] == [tuple(map(tuple, r)) for r in files.train.rows]
    text = tmp_path / "text"
    text.mkdir()
    rows = [{"text": " ".join(m["content"] for m in conversation(i))} for i in range(64)]
    write_jsonl(text / "docs.jsonl", rows)
    lm = ["task=lm", "model=gpt2-tiny", "model.vocab_size=2048", "task.max_seq_len=16"]
    a = tiny_cfg(*lm, f"task.dataset={text}")
    b = tiny_cfg(*lm, f"task.files=[{text / 'docs.jsonl'}]")
    da, db = load_task(a.task, a.model), load_task(b.task, b.model)
    assert len(da.train) > 4 and np.array_equal(da.train.blocks, db.train.blocks)


def test_an_edited_local_dataset_is_rendered_again(
    models: dict[str, Path], root: Path, tmp_path: Path
) -> None:
    """task.dataset=<a local folder>: the rendered rows are cached by the folder's files (size, mtime), so
    an edited file is read again rather than its stale rendering reused (task=chat and task=lm)."""
    import os

    folder = tmp_path / "ds"
    folder.mkdir()
    data = folder / "train.jsonl"
    write_jsonl(data, [{"messages": conversation(i)} for i in range(24)])
    cfg = tiny_cfg(*CHAT, f"model.pretrained={models['llama']}", f"task.dataset={folder}")
    first = load_task(cfg.task, cfg.model)
    write_jsonl(data, [{"messages": conversation(i)} for i in range(100, 124)])
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))  # (a coarse clock)
    second = load_task(cfg.task, cfg.model)
    files = tmp_path / "edited.jsonl"
    files.write_text(data.read_text())
    want = load_task(*(lambda c: (c.task, c.model))(chat_cfg(models["llama"], files)))
    rows = lambda d: [tuple(map(tuple, r)) for r in d.train.rows]  # noqa: E731
    assert rows(second) == rows(want) and rows(second) != rows(first)
    text = tmp_path / "text"
    text.mkdir()
    docs = text / "docs.jsonl"
    write_jsonl(docs, [{"text": " ".join(m["content"] for m in conversation(i))} for i in range(64)])
    lm = tiny_cfg(
        "task=lm", "model=gpt2-tiny", "model.vocab_size=2048", "task.max_seq_len=16", f"task.dataset={text}"
    )
    before = load_task(lm.task, lm.model).train.blocks
    write_jsonl(docs, [{"text": " ".join(m["content"] for m in conversation(i))} for i in range(200, 264)])
    os.utime(docs, ns=(docs.stat().st_atime_ns, docs.stat().st_mtime_ns + 10**9))
    assert not np.array_equal(load_task(lm.task, lm.model).train.blocks, before)


# ---- training: L2L equals the baseline, masked tokens carry nothing ---------------------------------


MODES = [("llama", "l2l_p", True)] + [
    pytest.param(kind, mode, packing, marks=pytest.mark.slow)
    for kind in ("llama", "qwen2")
    for mode in ("l2l", "l2l_p")
    for packing in (False, True)
    if (kind, mode, packing) != ("llama", "l2l_p", True)
]


@pytest.mark.parametrize(("kind", "mode", "packing"), MODES)
def test_chat_fine_tuning_matches_baseline_ag(
    models: dict[str, Path], root: Path, kind: str, mode: str, packing: bool
) -> None:
    """3 steps of task=chat from the checkpoint: L2L's weights are baseline_ag's (padded and packed rows)."""
    extra = ("task.packing=true", "task.max_seq_len=96") if packing else ()
    data = chat_data(models[kind], root / "chat.jsonl", *extra)
    got = train(chat_cfg(models[kind], root / "chat.jsonl", f"mode={mode}", *extra), data=data)
    ref = train(chat_cfg(models[kind], root / "chat.jsonl", "mode=baseline_ag", *extra), data=data)
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert_same_weights(got["weights"], ref["weights"])


def test_tokens_without_a_label_carry_no_gradient(models: dict[str, Path], tmp_path: Path) -> None:
    """Each conversation ends with a user turn that no answer sees: other words there (as many tokens)
    leave the trained weights bit-identical."""

    def rows(salt: int) -> list[dict]:
        out = []
        for i in range(16):
            words = [WORDS[(i * 7 + j * 3 + salt) % len(WORDS)] for j in range(4)]
            out.append({"messages": [*conversation(i), {"role": "user", "content": " ".join(words)}]})
        return out

    a, b = write_jsonl(tmp_path / "a.jsonl", rows(0)), write_jsonl(tmp_path / "b.jsonl", rows(5))
    path = models["llama"]
    wa = train(chat_cfg(path, a, "mode=l2l"), steps=2, data=chat_data(path, a))["weights"]
    wb = train(chat_cfg(path, b, "mode=l2l"), steps=2, data=chat_data(path, b))["weights"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    da, db = chat_data(path, a), chat_data(path, b)  # the inputs differ, in the same shapes
    assert [len(r[0]) for r in da.train.rows] == [len(r[0]) for r in db.train.rows]
    assert any(not np.array_equal(x[0], y[0]) for x, y in zip(da.train.rows, db.train.rows))
    assert all(np.array_equal(x[1], y[1]) for x, y in zip(da.train.rows, db.train.rows))


# ---- bad input --------------------------------------------------------------------------------------


def test_bad_data_is_one_line_naming_the_key_and_the_example(models: dict[str, Path], tmp_path: Path) -> None:
    """No messages, an unknown role, an answer cut away, a tokenizer without a template: refused before
    the run starts (exit 2, one line, no run dir)."""
    from l2l_cli.config.validate import validate

    good = conversation(1)
    cases = {
        "no_messages": (
            [{"messages": good}, {"turns": good}],
            [],
            r"task.format: no_messages.jsonl example 1: no 'messages'",
        ),
        "role": (
            [{"messages": good}, {"messages": [{"role": "bot", "content": "hi"}, *good]}],
            [],
            r"task.format: role.jsonl example 1: messages\[0\].role 'bot' is unknown; allowed: system, user",
        ),
        "cut": (
            [{"messages": good}, {"messages": [{"role": "user", "content": " ".join(WORDS)}, good[1]]}],
            ["task.max_seq_len=24"],
            r"task.max_seq_len: cut.jsonl example 1: no assistant token left after truncation",
        ),
        "no_template": (
            [{"messages": good}] * 4,
            [f"task.tokenizer={write_tokenizer(tmp_path / 'plain', None)}"],
            r"task.chat_template: unset, and the tokenizer .*plain has no chat template",
        ),
    }
    for name, (rows, extra, want) in cases.items():
        path = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        problems = [str(p) for p in validate(chat_cfg(models["llama"], path, *extra))]
        assert len(problems) == 1 and __import__("re").match(want, problems[0]), (name, problems)


@pytest.mark.slow
def test_bad_data_through_the_cli_leaves_no_run_dir(models: dict[str, Path], tmp_path: Path) -> None:
    """The command line runs the same check before Hydra makes the run dir: exit 2, one line."""
    good = conversation(1)
    write_jsonl(
        tmp_path / "role.jsonl", [{"messages": good}, {"messages": [{"role": "bot", "content": "hi"}, *good]}]
    )
    run = tmp_path / "run"
    r = l2l(
        "train",
        *CHAT,
        f"model.pretrained={models['llama']}",
        f"task.files=[{tmp_path / 'role.jsonl'}]",
        f"hydra.run.dir={run}",
    )
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "task.format" in ln]
    assert r.returncode == 2 and len(lines) == 1 and "example 1" in lines[0], r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr and not run.exists()


# ---- streaming ---------------------------------------------------------------------------------------


STREAM = [
    "trainer.max_steps=4",
    "trainer.save_every=2",
    "trainer.keep_checkpoints=5",
    "optim.warmup_steps=1",
    "task.streaming=true",
    "task.max_eval_samples=4",
    "logger=csv",
]


def _weights(step_dir: Path) -> dict:
    from safetensors.torch import load_file

    return {
        f"{f.name}:{k}": v for f in sorted(step_dir.glob("*.safetensors")) for k, v in load_file(f).items()
    }


def resume_matches(cfg_of: object, tmp_path: Path) -> None:
    """A run of 4 steps, and the same run cut after its step-2 checkpoint and resumed: bitwise equal."""
    import shutil

    from l2l_cli.train import run_job

    full, cut = tmp_path / "full", tmp_path / "cut"
    assert run_job(cfg_of(), full) == "ok"  # type: ignore[operator]
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_4")
    state = json.loads((cut / "checkpoints" / "step_2" / "state.json").read_text())
    assert state["data"]["source"]["rows"] > 0  # the stream's position is in the checkpoint
    assert run_job(cfg_of(f"trainer.resume={cut}"), cut) == "ok"  # type: ignore[operator]
    a, b = _weights(full / "checkpoints" / "step_4"), _weights(cut / "checkpoints" / "step_4")
    assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a)


def test_streamed_chat_dataset_resumes_exactly(models: dict[str, Path], root: Path, tmp_path: Path) -> None:
    """task.dataset=<a local folder of JSON lines> read as a stream (the hub's code path), packed rows:
    the checkpoint records the stream's position and a resumed run equals the uninterrupted one."""
    folder = tmp_path / "ds"
    folder.mkdir()
    lines = (root / "chat.jsonl").read_text().splitlines(keepends=True)
    (folder / "part-0.jsonl").write_text("".join(lines[:20]))
    (folder / "part-1.jsonl").write_text("".join(lines[20:]))

    def cfg_of(*more: str) -> DictConfig:
        return tiny_cfg(
            *CHAT,
            f"model.pretrained={models['llama']}",
            f"task.dataset={folder}",
            "task.packing=true",
            "task.max_seq_len=96",
            "mode=l2l_p",
            *STREAM,
            *more,
        )

    resume_matches(cfg_of, tmp_path)


@pytest.mark.slow
def test_streamed_lm_dataset_resumes_exactly(tmp_path: Path) -> None:
    """task=lm with task.dataset=<a local parquet folder>, streamed: blocks cut across documents carry
    their tail into the checkpoint; a resumed run equals the uninterrupted one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "ds"
    folder.mkdir()
    docs = [" ".join(conversation(i)[-1]["content"] for _ in range(3)) for i in range(80)]
    pq.write_table(pa.table({"text": docs}), folder / "train.parquet")

    def cfg_of(*more: str) -> DictConfig:
        return tiny_cfg(
            "task=lm",
            "model=gpt2-tiny",
            "model.num_layers=2",
            "model.vocab_size=2048",
            "task.max_seq_len=16",
            "batch.size=4",
            "batch.ubatch_size=2",
            "mode=l2l",
            f"task.dataset={folder}",
            *STREAM,
            *more,
        )

    resume_matches(cfg_of, tmp_path)


@pytest.mark.slow
def test_streamed_run_killed_and_resumed_equals_an_uninterrupted_one(
    models: dict[str, Path], root: Path, tmp_path: Path
) -> None:
    """``l2l train`` on a streamed local dataset, SIGKILLed after a checkpoint, then ``trainer.resume``:
    its last checkpoint equals an uninterrupted run's, bitwise."""
    import signal
    import subprocess
    import sys
    import time

    from tests.util import REPO

    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_text((root / "chat.jsonl").read_text())
    args = [
        *CHAT,
        f"model.pretrained={models['qwen2']}",
        f"task.dataset={folder}",
        "task.streaming=true",
        "trainer.max_steps=12",
        "trainer.save_every=2",
        "trainer.keep_checkpoints=2",
        "task.max_eval_samples=2",
        "optim.warmup_steps=1",
        "mode=l2l",
    ]
    full, cut = tmp_path / "full", tmp_path / "cut"
    r = l2l("train", *args, f"hydra.run.dir={full}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    proc = subprocess.Popen(
        [sys.executable, "-m", "l2l_cli", "train", *args, f"hydra.run.dir={cut}"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (cut / "checkpoints" / "step_4").is_dir():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (cut / "checkpoints" / "step_12").exists(), "the run ended before it was killed"
    r = l2l("train", f"trainer.resume={cut}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["resumed_from"]["step"] >= 4
    a, b = _weights(full / "checkpoints" / "step_12"), _weights(cut / "checkpoints" / "step_12")
    assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a)
