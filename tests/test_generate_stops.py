"""Where generation stops (issue 40 item 4): every eos id the model declares, the chat template's end of turn,
``--stop`` strings; and a chat run's ``final/`` that ``transformers`` alone reproduces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from l2l_cli.engine.stops import config_eos, cut_at_strings, end_of_turn, stop_ids
from tests.util import REPO, l2l, python


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    box = tmp_path_factory.mktemp("stops")
    made = python(REPO / "examples/make_tiny_chat.py", str(box))
    assert made.returncode == 0, made.stderr[-2000:]
    r = l2l(
        "train",
        "task=chat",
        f"model.pretrained={box / 'model'}",
        f"task.files={box / 'chat.jsonl'}",
        "task.max_seq_len=64",
        "batch.size=8",
        "batch.ubatch_size=4",
        "optim.lr=3e-3",
        "trainer.max_steps=3",
        "trainer.save_final=true",
        f"hydra.run.dir={box / 'run'}",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return box


def test_the_chat_template_end_of_turn_and_the_config_eos_list_stop(chat_run: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_run / "model"))
    tok.eos_token = "<s>"  # a tokenizer whose eos is not the template's end of turn (as Llama 3's base)
    im_end, s = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<s>")
    assert end_of_turn(tok) == {im_end}
    assert stop_ids(tok) == {s} and stop_ids(tok, chat=True) == {s, im_end}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert config_eos(tmp_path) == {7, 9} and stop_ids(tok, tmp_path) == {s, 7, 9}


def test_stop_strings_cut_the_completion_before_the_text(chat_run: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_run / "model"))
    ids = tok("the sky is blue today", add_special_tokens=False)["input_ids"]
    tokens, text, stopped = cut_at_strings(ids, tok, ["blue"])
    assert stopped and text.strip() == "the sky is" and tokens == ids[:4]
    assert cut_at_strings(ids, tok, ["green"]) == (ids, None, False)


def test_a_chat_final_dir_generates_alone_as_l2l_generate_does(chat_run: Path) -> None:
    """Acceptance 2: AutoModelForCausalLM + AutoTokenizer on final/ (its generation_config.json included)
    give the tokens ``l2l generate --chat`` gives, greedy, with no other argument."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = chat_run / "run" / "final"
    config = json.loads((final / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(final))
    eos = config["eos_token_id"]
    assert tok.convert_tokens_to_ids("<|im_end|>") in (eos if isinstance(eos, list) else [eos])
    prompt = "what colour is the sky ?"
    r = l2l(
        "generate", str(chat_run / "run"), "--chat", "--prompt", prompt, "--json", "--max-new-tokens", "8"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    ours = json.loads(r.stdout.splitlines()[-1])
    assert ours["stop"] in {"eos", "length"} and "stopped by" in r.stderr
    model = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    x = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        seq = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False)
    assert seq[0, x.shape[1] :].tolist() == ours["tokens"]
    r = l2l(
        "generate",
        str(chat_run / "run"),
        "--chat",
        "--prompt",
        prompt,
        "--json",
        "--max-new-tokens",
        "8",
        "--stop",
        tok.decode(ours["tokens"][1:2]).strip() or "x",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    cut = json.loads(r.stdout.splitlines()[-1])
    if len(ours["tokens"]) > 1 and tok.decode(ours["tokens"][1:2]).strip():
        assert cut["stop"] == "stop" and len(cut["tokens"]) <= 2
