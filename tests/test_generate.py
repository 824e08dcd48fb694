"""``l2l generate``: a decoder trained two steps (GPT-2 with l2l, Llama with l2l_p), sampled from with
``transformers``' ``generate`` and layer by layer through the relay (KV caches in RAM, and in files with the
disk tier): the same greedy tokens as ``transformers`` on the exported model, the same seeded samples in
both engines, and bad input refused in one line.

The models are initialized with ``model.init_std=0.2`` so that greedy decoding does not finish_updates on one
repeated token after two steps (a test of equal tokens must see varied ones).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from l2l_cli import generate, prompts
from l2l_cli.train import run_job
from tests.util import tiny_cfg

LM = [
    "task=lm",
    "task.max_seq_len=16",
    "batch.size=8",
    "batch.ubatch_size=2",
    "model.vocab_size=2048",
    "model.num_layers=2",
    "model.init_std=0.2",
    "trainer.max_steps=2",
    "trainer.save_every=2",
    "trainer.save_final=true",
    "task.max_eval_samples=8",
]
RUNS = {"gpt2": ["model=gpt2-tiny", "mode=l2l"], "llama": ["model=llama-tiny", "mode=l2l_p"]}
PROMPTS = ["Once upon a time there was a", "The cat", "Hello"]  # three lengths: the layered batch is padded


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("generate")
    out = {}
    for kind, extra in RUNS.items():
        assert run_job(tiny_cfg(*LM, *extra), root / kind) == "ok"
        out[kind] = root / kind
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return out


def gen(capsys: pytest.CaptureFixture, *argv: str) -> list[dict]:
    """``l2l generate ... --json`` in-process: one dict per prompt."""
    capsys.readouterr()  # (what came before)
    assert generate.main([*argv, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def tokens(rows: list[dict]) -> list[list[int]]:
    return [r["tokens"] for r in rows]


def hf_greedy(model_dir: Path, prompt: str, n: int) -> list[int]:
    """transformers' own greedy decoding of the exported run, independently of l2l."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    x = torch.tensor([tok(prompt)["input_ids"]])
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    return out[0, x.shape[1] :].tolist()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_greedy_layered_equals_transformers(runs: dict[str, Path], kind: str, capsys) -> None:
    """Three prompts of different lengths: transformers' generate (one at a time), the layered engine (all
    together, left-padded) and transformers called directly give the same greedy tokens."""
    run = runs[kind]
    inp = str(run.parent / "prompts.txt")
    hf = gen(capsys, str(run), "--input", inp, "--max-new-tokens", "10")
    layered = gen(capsys, str(run), "--input", inp, "--max-new-tokens", "10", "--layered")
    assert [r["engine"] for r in hf] == ["transformers"] * 3
    assert [r["engine"] for r in layered] == ["layered (host tier)"] * 3
    assert tokens(layered) == tokens(hf)
    assert tokens(hf)[0] == hf_greedy(run / "final", PROMPTS[0], 10)
    assert all(r["new_tokens"] == 10 for r in hf) or any(r["stop"] == "eos" for r in hf)
    assert len({t for r in tokens(hf) for t in r}) > 6  # varied tokens, not one repeated


def test_disk_tier_generates_the_tokens_of_ram_with_the_caches_in_files(
    runs: dict[str, Path], capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint (its EPS state loaded as it is) on the disk tier, which makes generation layered and
    puts every block's key/value cache in a memory-mapped file: the tokens of the RAM tier."""
    seen: dict[str, int] = {}

    class Recorded(generate.DiskKV):
        def save(self, i: int, cache) -> None:
            super().save(i, cache)
            seen.update({p.name: p.stat().st_size for p in self.files()})

    monkeypatch.setattr(generate, "DiskKV", Recorded)
    run = runs["llama"]
    inp = str(run.parent / "prompts.txt")
    ram = gen(
        capsys, str(run), "--input", inp, "--max-new-tokens", "8", "--layered", "--checkpoint", "step_2"
    )
    disk = gen(
        capsys, str(run), "eps.tier=disk", "--input", inp, "--max-new-tokens", "8", "--checkpoint", "latest"
    )
    assert [r["engine"] for r in disk] == ["layered (disk tier)"] * 3
    assert tokens(disk) == tokens(ram)
    # blocks 1..2: keys and values of 3 prompts x kv heads x (the longest prompt + 8 positions) x head_dim
    c = json.loads((run / "final" / "config.json").read_text())
    width = max(len(p) for p in prompts.encode(_tok(run), [prompts.Prompt(t) for t in PROMPTS], False, ""))
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    assert seen == {
        f"kv_{i}.bin": 2 * 3 * c["num_key_value_heads"] * (width + 8) * head_dim * 4 for i in (1, 2)
    }
    assert not (run / "eps").exists()  # the run's own folder is never used


def _tok(run: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(run / "final")


def test_sampling_is_seeded_and_the_same_in_both_engines(runs: dict[str, Path], capsys) -> None:
    run = str(runs["gpt2"])
    inp = str(runs["gpt2"].parent / "prompts.txt")
    flags = ["--input", inp, "--max-new-tokens", "8", "--temperature", "0.8", "--top-p", "0.9"]
    a = tokens(gen(capsys, run, *flags, "--seed", "5"))
    assert (
        tokens(gen(capsys, run, *flags, "--seed", "5", "--layered")) == a
    )  # reproduced, in the other engine
    assert tokens(gen(capsys, run, *flags, "--seed", "6")) != a


def test_chat_renders_the_tokenizers_template(runs: dict[str, Path], capsys, tmp_path: Path) -> None:
    """--chat wraps the prompt as a user turn in the tokenizer's template (with the assistant's turn
    opened); a tokenizer without a template is refused in one line."""
    from transformers import AutoTokenizer

    run = runs["gpt2"]
    assert generate.main([str(run), "--prompt", "hi", "--chat"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--chat" in err[0] and "no chat template" in err[0]
    chat = tmp_path / "chat"
    shutil.copytree(run / "final", chat)
    tok = AutoTokenizer.from_pretrained(chat)
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tok.save_pretrained(chat)
    out = gen(
        capsys, str(run), "--checkpoint", str(chat), "--prompt", "hi there", "--chat", "--max-new-tokens", "6"
    )
    ids = tok("<user>hi there\n<assistant>", add_special_tokens=False)["input_ids"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(chat).eval()
    ref = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=tok.eos_token_id,
    )
    assert out[0]["tokens"] == ref[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--prompt", "x", "--temperature", "-1"], "--temperature"),
        (["--prompt", "x", "--top-p", "0"], "--top-p"),
        (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
        ([], "one of the arguments --prompt --input is required"),
        (["--prompt", "x", "--input", "y"], "not allowed with argument"),
        (["--prompt", "x", "--checkpoint", "step_9"], "--checkpoint step_9"),
        (["--input", "BAD_JSONL"], "example 1 has no 'prompt'"),
        (["--prompt", "x", "model.nope=1"], "model.nope"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(runs: dict[str, Path], capsys, argv: list, needle: str) -> None:
    bad = runs["gpt2"].parent / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "no prompt key"}\n')
    argv = [str(bad) if a == "BAD_JSONL" else a for a in argv]
    assert generate.main([str(runs["gpt2"]), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_an_encoder_run_is_refused(tmp_path: Path, capsys) -> None:
    """A BERT run (encoder-only) cannot generate: one line, exit 2 (through the command line's dispatch)."""
    from omegaconf import OmegaConf

    from l2l_cli.cli import main

    run = tmp_path / "bert"  # a run's config is all it takes (the refusal comes before any weights are read)
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(tiny_cfg()))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["generate", str(run), "--prompt", "hello"])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "bert" in lines[0] and "decoder" in lines[0], lines


@pytest.mark.slow
def test_qwen2_with_a_sliding_window_generates_layer_by_layer_as_transformers(tmp_path: Path, capsys) -> None:
    """A tiny Qwen2 (Q/K/V biases; a 4-token sliding window on its upper layer, shorter than the text)
    fine-tuned one step with l2l: the layered engine's greedy tokens are transformers'."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from l2l_cli.data.lm import BUNDLED_TOKENIZER

    cfg = Qwen2Config(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=2048,
        max_position_embeddings=64,
        sliding_window=4,
        use_sliding_window=True,
        max_window_layers=1,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "qwen2")
    AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER).save_pretrained(tmp_path / "qwen2")
    run = tmp_path / "run"
    overrides = [
        o for o in LM if not o.startswith(("model.vocab_size", "model.num_layers", "model.init_std"))
    ]
    assert (
        run_job(
            tiny_cfg(
                *overrides,
                f"model.pretrained={tmp_path / 'qwen2'}",
                "trainer.max_steps=1",
                "trainer.save_every=1",
            ),
            run,
        )
        == "ok"
    )
    capsys.readouterr()  # (the run's summary table)
    (tmp_path / "p.txt").write_text("\n".join(PROMPTS) + "\n")
    argv = [str(run), "--input", str(tmp_path / "p.txt"), "--max-new-tokens", "12"]
    hf, layered = gen(capsys, *argv), gen(capsys, *argv, "--layered")
    assert tokens(layered) == tokens(hf)
    assert tokens(hf)[0] == hf_greedy(run / "final", PROMPTS[0], 12)


def test_the_engine_follows_the_host_budget_and_the_runs_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' generate while twice the FP32 weights fit in 80% of free RAM; else, and for a run
    whose EPS is on disk, layer by layer on the disk tier (its caches in files); --layered on the run's."""
    import l2l_cli.plan.measure as measure
    from l2l_cli.models import make_spec

    spec = make_spec(tiny_cfg(*LM, *RUNS["gpt2"]).model, 0)
    need = 2 * 4 * spec.total_params / generate.HOST_SHARE
    monkeypatch.setattr(measure, "available_memory", lambda: need)
    assert generate.choose_engine("host", spec, False).name == "transformers"
    assert generate.choose_engine("host", spec, True) == generate.Engine(True, "host", False, "--layered")
    assert generate.choose_engine("disk", spec, False).name == "layered (disk tier)"
    monkeypatch.setattr(measure, "available_memory", lambda: need - 1)
    assert generate.choose_engine("host", spec, False) == generate.Engine(
        True, "disk", True, "the model does not fit in host RAM"
    )


def test_a_finished_long_prompt_stops_advancing_its_positions(
    runs: dict[str, Path], capsys, tmp_path: Path
) -> None:
    """GPT-2 learns 512 positions: a prompt of 510 tokens may take 2 new ones, a short prompt beside it 6.
    Once the long row is done its positions stay put (it would index ``wpe`` at 512), and the layered
    engine gives transformers' tokens for both."""
    from transformers import AutoTokenizer

    run = runs["gpt2"]
    tok = AutoTokenizer.from_pretrained(run / "final")
    n = 510
    words = 1
    while len(tok(" ".join(["cat"] * words))["input_ids"]) < n:
        words += 1
    long = " ".join(["cat"] * words)
    assert len(tok(long)["input_ids"]) == n
    (tmp_path / "p.txt").write_text(f"{long}\nHello\n")
    args = [str(run), "--input", str(tmp_path / "p.txt"), "--max-new-tokens", "6"]
    layered = gen(capsys, *args, "--layered")
    hf = gen(capsys, *args)
    assert [r["new_tokens"] for r in layered] == [2, 6] or any(r["stop"] == "eos" for r in layered)
    assert tokens(layered) == tokens(hf)
