"""Chat templates by name and ShareGPT-style rows (issue 40 item 8): ``task.chat_template=chatml|llama3``
renders in the template's own special tokens (added to a tokenizer that lacks them, or one config error
line when the model has no room), each answer's labels end with its end-of-turn token, which the exported
tokenizer stops generation at; ``task.fields`` maps ``conversations`` of ``{from, value}`` (auto-detected)
or any keys onto messages, and a mapping that misses names the key, the file and its line."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch

from l2l_cli.data.loading import load_task
from l2l_cli.data.rows import IGNORE
from tests.test_chat import CHAT, conversation, write_jsonl, write_tokenizer
from tests.util import tiny_cfg


def write_llama(path: Path, vocab: int, template: str | None = None) -> Path:
    """A tiny random Llama with ``vocab`` token ids and the word-level test tokenizer (no chat template)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        num_hidden_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        vocab_size=vocab,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    write_tokenizer(path, template)
    return path


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("templates")
    write_jsonl(r / "chat.jsonl", [{"messages": conversation(i)} for i in range(12)])
    write_llama(r / "roomy", 128)
    return r


@functools.cache
def data(model: Path, files: Path, *overrides: str):
    cfg = tiny_cfg(*CHAT, f"model.pretrained={model}", f"task.files=[{files}]", *overrides)
    return load_task(cfg.task, cfg.model)


def rows(d) -> list[tuple]:
    return [tuple(map(tuple, r)) for r in d.train.rows + d.dev.rows]


@pytest.mark.parametrize(
    ("name", "eot", "head"),
    [("chatml", "<|im_end|>", "<|im_start|>"), ("llama3", "<|eot_id|>", "<|start_header_id|>")],
)
def test_a_named_template_trains_each_answer_up_to_its_end_of_turn_token(
    box: Path, name: str, eot: str, head: str
) -> None:
    from l2l_cli.engine.stops import end_of_turn, write_generation_config

    d = data(box / "roomy", box / "chat.jsonl", f"task.chat_template={name}")
    tok = d.tokenizer
    eot_id, head_id = tok.convert_tokens_to_ids(eot), tok.convert_tokens_to_ids(head)
    assert eot_id != tok.unk_token_id and eot_id < 128 and len(tok) <= 128  # one token, in the embedding
    ids, labels, _ = d.train.rows[1]
    assert head_id in ids.tolist()
    trained = tok.convert_ids_to_tokens([t for t, lab in zip(ids, labels) if lab != IGNORE])
    answers = [m["content"].split() for m in conversation(1) if m["role"] == "assistant"]
    assert trained == [w for a in answers for w in [*a, eot]]  # the content, its end of turn, nothing else
    assert end_of_turn(tok) == {eot_id}  # generation stops at it (l2l generate --chat, and the export's)
    write_generation_config(box, tok, None)
    eos = json.loads((box / "generation_config.json").read_text())["eos_token_id"]
    assert eot_id in (eos if isinstance(eos, list) else [eos])


def test_a_named_template_the_model_has_no_room_for_is_one_config_error(box: Path) -> None:
    from transformers import AutoTokenizer

    from l2l_cli.config.validate import validate

    size = len(AutoTokenizer.from_pretrained(box / "roomy"))
    full = write_llama(box / "full", size)
    cfg = tiny_cfg(
        *CHAT, f"model.pretrained={full}", f"task.files=[{box / 'chat.jsonl'}]", "task.chat_template=llama3"
    )
    problems = [str(p) for p in validate(cfg)]
    assert len(problems) == 1, problems
    assert re.match(
        r"task.chat_template: llama3 is written in the special tokens <\|start_header_id\|>, "
        rf"<\|end_header_id\|>, <\|eot_id\|>, which the tokenizer .* the model's {size} token ids "
        "leave no room",
        problems[0],
    )


def test_sharegpt_rows_are_detected_and_any_keys_map_onto_messages(box: Path, tmp_path: Path) -> None:
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    convs = [conversation(i) for i in range(12)]
    share = write_jsonl(
        tmp_path / "share.jsonl",
        [{"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in c]} for c in convs],
    )
    custom = write_jsonl(
        tmp_path / "custom.jsonl",
        [
            {
                "dialog": [
                    {
                        "who": {"system": "sys", "user": "me", "assistant": "bot"}[m["role"]],
                        "text": m["content"],
                    }
                    for m in c
                ]
            }
            for c in convs
        ],
    )
    want = rows(data(box / "roomy", box / "chat.jsonl", "task.chat_template=chatml"))
    assert rows(data(box / "roomy", share, "task.chat_template=chatml")) == want
    mapped = data(
        box / "roomy",
        custom,
        "task.chat_template=chatml",
        "task.fields.messages=dialog",
        "task.fields.role=who",
        "task.fields.content=text",
        "+task.fields.roles.sys=system",
        "+task.fields.roles.me=user",
        "+task.fields.roles.bot=assistant",
    )
    assert rows(mapped) == want


def test_a_mapping_that_misses_names_the_key_the_file_and_its_line(box: Path, tmp_path: Path) -> None:
    from l2l_cli.config.validate import validate

    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    no_value = {"conversations": [{"from": "human", "text": "hi"}, {"from": "gpt", "value": "hello"}]}
    bot = {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "hello"}]}
    cases = {
        "messages": (
            [good, good, {"turns": good["conversations"]}],
            ["task.fields.messages=conversations"],
            r"task.fields.messages: messages.jsonl line 4: no 'conversations' field",
        ),
        "content": (
            [good, no_value],
            [],
            r"task.fields.content: content.jsonl line 3: conversations\[0\] "
            r"has no 'value' key \(its keys: from, text\)",
        ),
        "roles": (
            [good, good, bot],
            [],
            r"task.fields.roles: roles.jsonl line 4: conversations\[1\].from "
            r"'bot' is not mapped to a role .* set \+task.fields.roles.bot=<system\|user\|assistant\|tool>",
        ),
        "column": (
            [good] * 3,
            ["task.fields.messages=dialog"],
            r"task.fields.messages: column.jsonl line 2 has no 'dialog' field \(its fields: conversations\)",
        ),
    }
    for name, (lines, extra, want) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n" + "".join(json.dumps(r) + "\n" for r in lines))  # a blank first line
        cfg = tiny_cfg(
            *CHAT,
            f"model.pretrained={box / 'roomy'}",
            f"task.files=[{path}]",
            "task.chat_template=chatml",
            *extra,
        )
        problems = [str(p) for p in validate(cfg)]
        assert len(problems) == 1 and re.match(want, problems[0]), (name, problems)
    bad_role = tiny_cfg(
        *CHAT,
        f"model.pretrained={box / 'roomy'}",
        f"task.files=[{box / 'chat.jsonl'}]",
        "+task.fields.roles.bot=robot",
    )
    assert [str(p) for p in validate(bad_role, check_files=False)] == [
        "task.fields.roles.bot: got 'robot'; allowed: system, user, assistant, tool"
    ]


def test_generate_from_a_step_checkpoint_uses_the_named_template(box: Path, tmp_path: Path) -> None:
    """Without final/ (a step checkpoint has no tokenizer beside it), ``l2l generate --chat`` renders with
    the run's task.chat_template and its added tokens, so it stops at the template's end of turn."""
    from l2l_cli.data.templates import LLAMA3
    from l2l_cli.engine.stops import end_of_turn
    from l2l_cli.generate import tokenizer_for

    cfg = tiny_cfg(
        *CHAT,
        f"model.pretrained={box / 'roomy'}",
        f"task.files=[{box / 'chat.jsonl'}]",
        "task.chat_template=llama3",
    )
    tok, _ = tokenizer_for(cfg, tmp_path)
    assert tok.chat_template == LLAMA3.template
    assert end_of_turn(tok) == {tok.convert_tokens_to_ids("<|eot_id|>")} != {tok.unk_token_id}
