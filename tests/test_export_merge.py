"""``l2l export --merge`` streamed layer by layer (issue 52, item 5): safetensors shards with transformers'
index, loadable by ``AutoModelForCausalLM.from_pretrained`` and giving the LoRA run's logits; the
checkpoint's type by default, ``--dtype`` honoured; a low-bit base merged into the checkpoint's own
weights; the tokenizer and ``generation_config.json`` beside them; a peak RSS of about a layer, not the
model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from l2l_cli import export
from l2l_cli.evaluate import run_config
from tests.test_adapters import lm_batches
from tests.test_adapters_integrity import LM, LORA, pretrained_llama, train_run
from tests.test_adapters_peft import peft_logits, run_logits

ROOT = Path(__file__).resolve().parent.parent


def as_bf16(root: Path) -> Path:
    """The checkpoint ``root`` stored in bf16, as most published checkpoints are."""
    from safetensors.torch import load_file, save_file

    f = root / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, str(f), metadata={"format": "pt"})
    return root


def dtypes(out: Path) -> set[str]:
    """The dtypes of every tensor of an exported directory (safetensors' codes: F32, BF16, F16)."""
    from safetensors import safe_open

    got = set()
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            got |= {str(h.get_slice(k).get_dtype()) for k in h.keys()}  # noqa: SIM118
    return got


def test_merged_shards_and_index_load_and_give_the_runs_logits(tmp_path: Path) -> None:
    """Shards of whole layers under ``--max-shard-size`` (each of llama-tiny's 4 layers is larger than
    100 kB, so each is a shard of its own, as transformers puts a tensor over the size alone) and
    ``model.safetensors.index.json`` (every tensor mapped, the total size transformers writes);
    ``AutoModelForCausalLM.from_pretrained`` on the directory gives the run's logits
    (an fp32 checkpoint: fp32 out); the tokenizer and ``generation_config.json`` are there."""
    from transformers import AutoModelForCausalLM

    base, run = pretrained_llama(tmp_path / "base"), tmp_path / "run"
    train_run(run, *LM, *LORA, f"model.pretrained={base}", "optim.lr=0.01")
    out = tmp_path / "merged"
    assert export.main([str(run), "--merge", "--out", str(out), "--max-shard-size", "100KB"]) == 0
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) == 4 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(p.stat().st_size for p in shards) - sum(
        8 + int.from_bytes(p.read_bytes()[:8], "little") for p in shards
    )
    assert {"tokenizer.json", "generation_config.json", "config.json", "checksums.json"} <= {
        p.name for p in out.iterdir()
    }
    assert dtypes(out) == {"F32"}
    from transformers import AutoTokenizer

    eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert AutoTokenizer.from_pretrained(out).eos_token_id in (eos if isinstance(eos, list) else [eos])
    batch = lm_batches(run_config(run, []), n=1)[0]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert len(dict(model.named_parameters())) == len(index["weight_map"])
    torch.testing.assert_close(peft_logits(model, batch), run_logits(run, batch), rtol=1e-5, atol=1e-5)


def test_dtype_defaults_to_the_checkpoints_and_dtype_is_honoured(tmp_path: Path) -> None:
    """A bf16 checkpoint's merge is bf16 unless ``--dtype`` says otherwise (config.json's ``dtype`` with
    it); the bf16 merge gives the run's logits within bf16's rounding."""
    from transformers import AutoModelForCausalLM

    base, run = as_bf16(pretrained_llama(tmp_path / "base")), tmp_path / "run"
    train_run(run, *LM, *LORA, f"model.pretrained={base}", "optim.lr=0.01")
    for flag, want, code in (
        (None, "bfloat16", "BF16"),
        ("fp16", "float16", "F16"),
        ("fp32", "float32", "F32"),
    ):
        out = tmp_path / f"merged-{flag}"
        assert (
            export.main([str(run), "--merge", "--out", str(out), *(["--dtype", flag] if flag else [])]) == 0
        )
        assert dtypes(out) == {code}
        assert json.loads((out / "config.json").read_text())["dtype"] == want
    batch = lm_batches(run_config(run, []), n=1)[0]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged-None", dtype=torch.float32).eval()
    ours = run_logits(run, batch)
    torch.testing.assert_close(peft_logits(model, batch), ours, rtol=0.0, atol=0.05 * float(ours.abs().max()))


def test_dtype_alone_and_a_bad_shard_size_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert export.main([str(tmp_path), "--dtype", "bf16"]) == 2
    assert export.main([str(tmp_path), "--merge", "--max-shard-size", "lots"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("l2l:")]
    assert len(err) == 2 and "--dtype" in err[0] and "--max-shard-size" in err[1]


def test_a_low_bit_base_merges_into_the_checkpoints_own_weights(tmp_path: Path) -> None:
    """A run on an int8 base trained its adapter on the rounded copy, but the merge is the checkpoint's
    own tensor plus ``scaling · B·A`` (computed here from the two files), not the dequantized base's."""
    from safetensors.torch import load_file

    base, run = pretrained_llama(tmp_path / "base"), tmp_path / "run"
    train_run(
        run, *LM, *LORA, "mode=l2l", "peft.base_dtype=int8", f"model.pretrained={base}", "optim.lr=0.01"
    )
    out = tmp_path / "merged"
    assert export.main([str(run), "--merge", "--out", str(out)]) == 0
    merged, orig = load_file(out / "model.safetensors"), load_file(base / "model.safetensors")
    adapter = load_file(run / "final" / "adapter_model.safetensors")
    conf = json.loads((run / "final" / "adapter_config.json").read_text())
    scaling = conf["lora_alpha"] / conf["r"]
    adapted = [
        k.removeprefix("base_model.model.").removesuffix(".lora_A.weight") for k in adapter if ".lora_A." in k
    ]
    assert len(adapted) > 4  # (peft.target_modules' default: all-linear)
    for name in adapted:
        a = adapter[f"base_model.model.{name}.lora_A.weight"]
        b = adapter[f"base_model.model.{name}.lora_B.weight"]
        want = orig[f"{name}.weight"] + scaling * (b @ a)
        torch.testing.assert_close(merged[f"{name}.weight"], want, rtol=1e-6, atol=1e-7)
    assert max(float(adapter[k].abs().max()) for k in adapter if ".lora_B." in k) > 0  # the adapter trained
    embed = "model.embed_tokens.weight"  # no adapter: the checkpoint's, bit for bit
    assert torch.equal(merged[embed], orig[embed])


RSS_SCRIPT = """
import json, sys
from l2l_cli import export

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

run, out = sys.argv[1:]
# once first: the modules it imports and the tokenizer's caches are the process's, not the merge's
assert export.main([run, "--merge", "--dtype", "fp32", "--out", out + "-warm"]) == 0
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from the current RSS
before = status("VmRSS")
code = export.main([run, "--merge", "--dtype", "fp32", "--out", out])
print(json.dumps({"code": code, "before": before, "peak": status("VmHWM")}))
"""


@pytest.mark.slow
def test_the_merge_peak_rss_is_about_a_layer_not_the_model(tmp_path: Path) -> None:
    """A 12-layer decoder (hidden 768, ~330 MB in fp32): the export's RSS grows by a small part of the
    model's bytes (a layer is 1/12 of them), where building the model whole grows it by more than the
    model."""
    from safetensors.torch import load_file

    size = [
        "model.num_layers=12",
        "model.hidden_size=768",
        "model.intermediate_size=2048",
        "model.num_heads=12",
    ]
    base, run = pretrained_llama(tmp_path / "base", *size), tmp_path / "run"
    train_run(run, *LM, *size, *LORA, f"model.pretrained={base}", "trainer.max_steps=1")
    model_bytes = sum(t.numel() * 4 for t in load_file(base / "model.safetensors").values())
    out = tmp_path / "merged"
    r = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(run), str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["code"] == 0
    ratio = (got["peak"] - got["before"]) / model_bytes
    print(
        f"merge RSS growth {(got['peak'] - got['before']) / 2**20:.0f} MiB, "
        f"model {model_bytes / 2**20:.0f} MiB"
    )
    assert ratio < 0.35, ratio
