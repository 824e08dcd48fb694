"""LoRA adapters on a frozen base (``peft=lora``): every mode against PEFT's own model trained by a plain
PyTorch loop, the frozen base untouched, PEFT's saved layout, the merged export, low-bit bases, the config's
refusals."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from l2l_cli.data.batches import Batch
from l2l_cli.models import LayeredModel
from l2l_cli.models.lora import adapter_config, base_spec, lora_of, peft_key
from tests.util import TINY, built, tiny_cfg
from tests.util import l2l as _l2l


def l2l(*args: str, **kw: Any) -> Any:
    """The CLI, with room for a loaded machine."""
    return _l2l(*args, **{"timeout": 900, **kw})


R8 = ["peft=lora", "peft.r=8", "peft.dropout=0.0", "optim.schedule=constant", "optim.warmup_steps=0"]
FAMILY = {
    "llama": [
        "model=llama-tiny",
        *TINY,
        "task=lm",
        "peft.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
    ],
    "gpt2": ["model=gpt2-tiny", *TINY, "task=lm", "peft.target_modules=[c_attn,c_proj,c_fc]"],
    "bert": [*TINY, "peft.target_modules=[query,key,value,dense]", "peft.modules_to_save=[classifier]"],
}


def lm_batches(cfg: Any, n: int = 3, seed: int = 5) -> list[Batch]:
    """Random token rows (every token predicts the next), or the synthetic task's rows for BERT."""
    g = torch.Generator().manual_seed(seed)
    b, s = cfg.batch.size, cfg.task.max_seq_len
    out = []
    for _ in range(n):
        if cfg.model.family == "bert":
            ids = torch.randint(5, cfg.model.vocab_size, (b, s), generator=g)
            labels = torch.randint(0, 2, (b,), generator=g)
        else:
            ids = torch.randint(0, cfg.model.vocab_size, (b, s), generator=g)
            labels = ids.clone()
        out.append(Batch(ids, torch.zeros_like(ids), torch.ones_like(ids), labels))
    return out


def hf_reference(cfg: Any, spec: Any, tmp: Path, batches: list[Batch]) -> dict[str, torch.Tensor]:
    """PEFT's model (``get_peft_model`` on the family's Hugging Face model with the same base weights),
    the adapters set to the run's initialization, trained by a plain loop: forward, loss, backward, global
    clipping, AdamW. Returns the trained adapter by PEFT key."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM, BertForSequenceClassification

    seed = cfg.trainer.seed
    base = LayeredModel(base_spec(spec), seed=seed)
    base_spec(spec).save_hf(tmp / "base", base.hf_state_dict().items())
    if spec.family == "bert":
        hf = BertForSequenceClassification.from_pretrained(tmp / "base")
    else:
        hf = AutoModelForCausalLM.from_pretrained(tmp / "base")
    conf = adapter_config(spec, lora_of(spec))
    keys = (
        "r",
        "lora_alpha",
        "lora_dropout",
        "target_modules",
        "modules_to_save",
        "fan_in_fan_out",
        "bias",
        "use_rslora",
        "use_dora",
    )
    model = get_peft_model(hf, LoraConfig(**{k: v for k, v in conf.items() if k in keys}))
    init = LayeredModel(spec, seed=seed).hf_state_dict(trainable_only=True)
    result = set_peft_model_state_dict(model, {peft_key(n): t for n, t in init.items()})
    assert not [k for k in result.unexpected_keys if "lora" in k]
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    for batch in batches:
        opt.zero_grad()
        if spec.family == "bert":
            logits = model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                token_type_ids=batch.token_type_ids,
            ).logits
            loss = torch.nn.functional.cross_entropy(logits, batch.labels)
        else:
            loss = model(input_ids=batch.input_ids, labels=batch.labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.max_grad_norm)
        opt.step()
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


@functools.cache
def reference(family: str, tmp: Path) -> dict[str, torch.Tensor]:
    cfg = tiny_cfg(*FAMILY[family], *R8)
    with built(cfg) as runner:
        spec = runner.spec
    return hf_reference(cfg, spec, tmp, lm_batches(cfg))


def base_tensors(runner: Any) -> dict[str, torch.Tensor]:
    spec = runner.spec
    out = {}
    for i, layer in runner.full_layers():
        for n, p in layer.named_parameters():
            if not spec.trainable(n):
                out[spec.hf_name(i, n)] = p.detach().clone()
    return out


def run_lora(family: str, *overrides: str, steps: int = 3) -> dict[str, Any]:
    cfg = tiny_cfg(*FAMILY[family], *R8, *overrides)
    with built(cfg) as runner:
        before = base_tensors(runner)
        losses = [runner.step(b).loss for b in lm_batches(cfg)[:steps]]
        after = base_tensors(runner)
        adapter = {peft_key(n): t.detach().float().clone() for n, t in runner.hf_tensors()}
        return {
            "losses": losses,
            "adapter": adapter,
            "before": before,
            "after": after,
            "host": runner.host_parts(),
        }


@pytest.mark.parametrize(
    "family,mode",
    [
        ("llama", "mode=l2l"),
        ("llama", "mode=l2l_p"),
        ("llama", "mode=baseline_ag"),
        ("gpt2", "mode=l2l"),
        ("bert", "mode=l2l"),
        pytest.param("gpt2", "mode=l2l_p", marks=pytest.mark.slow),
        pytest.param("gpt2", "mode=baseline_ag", marks=pytest.mark.slow),
        pytest.param("bert", "mode=l2l_p", marks=pytest.mark.slow),
        pytest.param("bert", "mode=baseline_ag", marks=pytest.mark.slow),
        pytest.param("llama", "mode=l2l_stash_cpu", marks=pytest.mark.slow),
        pytest.param("llama", "mode=baseline", marks=pytest.mark.slow),
    ],
)
def test_lora_equals_peft_reference(family: str, mode: str, tmp_path_factory) -> None:
    """3 steps of r-8 LoRA (fp32, dropout 0) equal PEFT's model trained by a plain loop from the same
    adapter initialization and data; the frozen base is byte-identical before and after."""
    ref = reference(family, tmp_path_factory.mktemp(family))
    got = run_lora(family, mode, *(["batch.ubatch_size=8"] if mode == "mode=baseline" else []))
    assert got["adapter"].keys() == ref.keys()
    moved = 0
    for k, v in ref.items():
        torch.testing.assert_close(got["adapter"][k], v, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
        moved += int(not torch.allclose(v, torch.zeros_like(v)) and "lora_B" in k)
    assert moved > 0  # the adapters did train (lora_B starts at zero)
    assert got["before"].keys() == got["after"].keys() and got["before"]
    for k, v in got["before"].items():
        assert torch.equal(v, got["after"][k]), k


def test_eps_holds_state_for_the_adapters_only() -> None:
    """The EPS's master, gradient and moments are the adapters'; the base is held once, without them."""
    got = run_lora("llama", "mode=l2l", steps=1)
    host = got["host"]
    adapter = sum(t.numel() for t in got["adapter"].values())
    assert host["master"] == 4 * adapter and host["optimizer_state"] == 8 * adapter
    base = sum(t.numel() for t in got["before"].values())
    assert host["frozen_base"] <= 4 * base


@pytest.mark.parametrize(
    "args,key",
    [
        (
            ["model=llama-tiny", "task=lm", "peft=lora", "peft.target_modules=[q_proj,qkv]"],
            "peft.target_modules",
        ),
        (
            ["peft=lora", "dist.nproc=2", "dist.pipeline=2", "batch.size=8", "batch.ubatch_size=2"],
            "peft.name",
        ),
        (["peft=lora", "peft.base_dtype=nf4"], "peft.base_dtype"),
    ],
    ids=["unknown-target", "pipeline", "nf4-without-torchao"],
)
def test_bad_peft_input_is_one_config_error(args: list[str], key: str, tmp_path: Path) -> None:
    """A target the model lacks, adapters with the pipeline, NF4 without torchao: one line naming the key,
    exit 2, no run dir. (torchao is hidden from the NF4 case by a package that fails to import.)"""
    env = None
    if key == "peft.base_dtype":
        fake = tmp_path / "fake" / "torchao"
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text("raise ImportError('torchao is not installed')\n")
        import os

        env = {"PYTHONPATH": f"{tmp_path / 'fake'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = tmp_path / "run"
    r = l2l("train", *args, f"hydra.run.dir={run}", "trainer.progress=none", env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("l2l:")]
    assert len(lines) == 1 and lines[0].startswith(f"l2l: config error: {key}:"), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert not run.exists()


def _hf_base(spec: Any, cfg: Any, tmp: Path) -> Any:
    from transformers import AutoModelForCausalLM, BertForSequenceClassification

    base = LayeredModel(base_spec(spec), seed=cfg.trainer.seed)
    base_spec(spec).save_hf(tmp / "base", base.hf_state_dict().items())
    cls = BertForSequenceClassification if spec.family == "bert" else AutoModelForCausalLM
    return cls.from_pretrained(tmp / "base").eval()


def _logits(model: Any, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()


@pytest.mark.parametrize("family,mode", [("llama", "mode=l2l"), ("gpt2", "mode=baseline_ag")])
def test_saved_adapter_and_merged_model_give_the_runs_logits(family: str, mode: str, tmp_path: Path) -> None:
    """final/'s adapter loaded by ``PeftModel.from_pretrained(base, dir)`` gives the run's logits (1e-5);
    the merged export loaded by ``AutoModelForCausalLM`` gives the same logits as base + adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from l2l_cli.models.lora import merged_tensors

    cfg = tiny_cfg(*FAMILY[family], *R8, mode, "optim.lr=0.01")
    batches = lm_batches(cfg, n=4)
    with built(cfg) as runner:
        for b in batches[:3]:
            runner.step(b)
        ours = runner.predict(batches[3])
        spec = runner.spec
        spec.save_hf(tmp_path / "final", runner.hf_tensors())
        base_spec(spec).save_hf(tmp_path / "merged", merged_tensors(spec, runner.full_layers()))
    names = {p.name for p in (tmp_path / "final").iterdir()}
    assert names == {"adapter_config.json", "adapter_model.safetensors"}
    peft_model = PeftModel.from_pretrained(_hf_base(spec, cfg, tmp_path), tmp_path / "final").eval()
    theirs = _logits(peft_model, batches[3])
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    plain = _logits(_hf_base(spec, cfg, tmp_path), batches[3])
    assert (plain - theirs).abs().max() > 1e-3  # the adapter changes the logits
    merged = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval(), batches[3])
    torch.testing.assert_close(merged, theirs, rtol=1e-5, atol=1e-5)


CLI = [
    "model=llama-tiny",
    "task=lm",
    "peft=lora",
    "batch.size=4",
    "batch.ubatch_size=2",
    "task.max_seq_len=32",
    "task.num_eval=16",
    "trainer.progress=none",
    "optim.schedule=constant",
    "logger=none",
]


@pytest.mark.slow
def test_cli_lora_run_exports_evaluates_generates_and_resumes_exactly(tmp_path: Path) -> None:
    """A LoRA run's final/ is the adapter; ``l2l export --merge`` writes a model (+ tokenizer) that gives
    the run's eval loss; ``l2l eval`` and ``l2l generate`` take the run; a run stopped at step 2 and
    resumed to 4 ends with the adapter of an uninterrupted 4-step run, bit for bit."""
    from safetensors.torch import load_file

    full, half = tmp_path / "full", tmp_path / "half"
    common = [*CLI, "mode=l2l", "trainer.save_every=2", "trainer.save_final=true"]
    r = l2l("train", *common, "trainer.max_steps=4", f"hydra.run.dir={full}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert {p.name for p in (full / "final").iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    r = l2l("train", *common, "trainer.max_steps=2", f"hydra.run.dir={half}")
    assert r.returncode == 0, r.stderr[-2000:]
    r = l2l("train", f"trainer.resume={half}", "trainer.max_steps=4")
    assert r.returncode == 0, r.stderr[-2000:]
    a = load_file(full / "final" / "adapter_model.safetensors")
    b = load_file(half / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    r = l2l("export", str(full), "--merge")
    assert r.returncode == 0, r.stderr[-2000:]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in (full / "merged").iterdir()
    }
    r = l2l("eval", str(full), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])["metrics"]["loss"]
    assert got == pytest.approx(json.loads((full / "summary.json").read_text())["eval"]["loss"], rel=1e-6)
    r = l2l("eval", str(full), "--json", f"--checkpoint={full / 'merged'}", "peft=none")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["metrics"]["loss"] == pytest.approx(got, rel=1e-5)
    outs = []
    for extra in ([], ["--layered"]):
        r = l2l("generate", str(full), "--prompt", "The", "--max-new-tokens", "4", "--json", *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(json.loads(r.stdout.strip().splitlines()[-1])["tokens"])
    assert outs[0] == outs[1] and len(outs[0]) >= 1


@pytest.mark.parametrize("dtype", ["bf16", "int8", "nf4"])
def test_low_bit_base_trains_close_to_fp32_and_is_stored_small(dtype: str) -> None:
    """A bf16 / int8 / NF4 base: the relay dequantizes it on the device; its host bytes are those of the
    low-bit copy (NF4 about 4.1 bits per linear weight), and 3 steps stay close to the fp32 base's."""
    ref = run_lora("llama", "mode=l2l", "model.hidden_size=64", "model.intermediate_size=128")
    got = run_lora(
        "llama", "mode=l2l", "model.hidden_size=64", "model.intermediate_size=128", f"peft.base_dtype={dtype}"
    )
    fp32 = ref["host"]["frozen_base"]
    ratio = got["host"]["frozen_base"] / fp32
    assert ratio < {"bf16": 0.51, "int8": 0.5, "nf4": 0.5}[dtype], ratio
    tol = {"bf16": 1e-3, "int8": 1e-2, "nf4": 5e-2}[dtype]
    assert got["losses"] == pytest.approx(ref["losses"], rel=tol)
    for k, v in got["before"].items():  # the dequantized base stays what it was
        assert torch.equal(v, got["after"][k]), k


def test_base_on_disk_equals_base_in_ram_and_holds_none_of_it(tmp_path: Path) -> None:
    """``peft.base_source=disk``: each frozen layer read from its file as the relay needs it (read ahead);
    the run's numbers are the host base's, bit for bit, and the base takes no host RAM between reads."""
    host = run_lora("llama", "mode=l2l", "peft.base_dtype=nf4")
    disk = run_lora("llama", "mode=l2l", "peft.base_dtype=nf4", "peft.base_source=disk")
    assert disk["losses"] == host["losses"]
    assert all(torch.equal(disk["adapter"][k], v) for k, v in host["adapter"].items())
    assert disk["host"].get("frozen_base", 0) == 0 < host["host"]["frozen_base"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["l2l", "baseline_ag"])
def test_two_ranks_train_the_adapter_of_one_process_with_the_global_batch(mode: str, tmp_path: Path) -> None:
    """2-rank data parallel: the per-layer reduction covers the adapters only, and the adapter equals one
    process's with the global batch (whose equality with PEFT's reference is tested above)."""
    from safetensors.torch import load_file

    common = [*CLI, f"mode={mode}", "trainer.max_steps=3", "trainer.save_final=true", "peft.r=8"]
    one, two = tmp_path / "one", tmp_path / "two"
    r = l2l("train", *common, "batch.size=8", f"hydra.run.dir={one}")
    assert r.returncode == 0, r.stderr[-2000:]
    r = l2l("train", *common, "batch.size=4", "dist.nproc=2", f"hydra.run.dir={two}")
    assert r.returncode == 0, r.stderr[-2000:]
    a = load_file(one / "final" / "adapter_model.safetensors")
    b = load_file(two / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["nf4", "int8"])
def test_low_bit_base_of_a_real_checkpoint_evaluates_within_2_percent_of_bf16(
    dtype: str, glue, minilm
) -> None:
    """The real MiniLM on MRPC, LoRA on query/value and the classifier trained whole, 6 steps: the eval loss
    with an NF4 (or int8) base is within 2% of the bf16 base's."""
    from l2l_cli.data.batches import TrainStream, eval_batches
    from l2l_cli.data.loading import load_task

    def eval_loss(base_dtype: str) -> float:
        cfg = tiny_cfg(
            "task=mrpc",
            f"task.data_dir={glue / 'MRPC'}",
            f"model.pretrained={minilm}",
            "peft=lora",
            f"peft.base_dtype={base_dtype}",
            "peft.target_modules=[query,value]",
            "peft.modules_to_save=[classifier]",
            "mode=l2l",
            "batch.size=16",
            "batch.ubatch_size=8",
            "task.max_seq_len=64",
            "task.max_train_samples=128",
            "task.max_eval_samples=64",
            "optim.lr=1e-3",
        )
        data = load_task(cfg.task, cfg.model)
        with built(cfg, total_steps=6, data=data) as runner:
            it = TrainStream(data.train, 16, seed=0).batches()
            for _ in range(6):
                runner.step(next(it))
            total, n = 0.0, 0
            for _, b in eval_batches(data.dev, 32, None):
                logits = runner.predict(b)
                total += float(torch.nn.functional.cross_entropy(logits, b.labels, reduction="sum"))
                n += len(b)
        return total / n

    assert eval_loss(dtype) == pytest.approx(eval_loss("bf16"), rel=0.02)


def test_nf4_is_torchaos_bit_for_bit_on_ties_zeros_and_codes() -> None:
    """l2l's NF4 (one threshold search per element, a byte table to decode) gives torchao's
    ``NF4Tensor.from_tensor`` parts and ``get_original_weight`` exactly: on values at the midpoints between
    codes, on the codes themselves, on an all-zero block and on tiny scales."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    from l2l_cli.engine.frozen import NF4_CODES, _nf4_decode, _nf4_encode

    g = torch.Generator().manual_seed(0)
    codes = torch.tensor(NF4_CODES)
    mids = (codes[:-1] + codes[1:]) / 2
    for scale in (1.0, 0.02, 1e-30):
        flat = torch.randn(64 * 256 * 3, generator=g) * scale
        flat[:64] = 0
        flat[200:264] = codes.repeat(4) * 3
        flat[1000:1015], flat[1015] = mids, 1.0
        flat[1024:1039], flat[1039] = -mids, -1.0
        flat[2048:2063], flat[2063] = torch.nextafter(mids, codes[1:]), 1.0
        q = NF4Tensor.from_tensor(flat, 64, 256)
        ref = {
            "data": q.quantized_data,
            "scalers": q.quantized_scalers,
            "factor": q.quantization_factor,
            "mean": q.scaler_mean.reshape(1),
            "nf4": q.nf4,
        }
        got = _nf4_encode(flat)
        for k, v in ref.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        w = _nf4_decode(got, torch.device("cpu"))
        assert torch.equal(w.view(torch.int32), q.get_original_weight().view(torch.int32))


@pytest.mark.parametrize("source", ["host", "disk"])
def test_a_checkpoints_base_is_encoded_once_and_equals_the_built_then_loaded_one(
    source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``model.pretrained`` the frozen base is stored from the checkpoint's tensors only (one encode
    per tensor, not the seeded init's first); a tensor the checkpoint lacks is the seeded init's. Both give
    the base the eager build-then-load gives, bit for bit."""
    import dataclasses

    from l2l_cli.engine import frozen
    from l2l_cli.engine.flat import FlatLayout
    from l2l_cli.models.base import BLOCK, POST, PRE

    cfg = tiny_cfg(*FAMILY["llama"], *R8, "peft.base_dtype=nf4", f"peft.base_source={source}")
    with built(cfg) as runner:
        spec = runner.spec
    seed = cfg.trainer.seed
    ckpt = LayeredModel(base_spec(spec), seed=seed + 1).hf_state_dict()
    dropped = "model.layers.1.mlp.up_proj.weight"
    del ckpt[dropped]
    layouts = {
        k: FlatLayout(spec.new_layer(k, "meta"), skip=spec.trainable_names(k)) for k in (PRE, BLOCK, POST)
    }
    encodes = []
    real = frozen.encode
    monkeypatch.setattr(frozen, "encode", lambda *a: encodes.append(1) or real(*a))

    def base(lora: Any) -> tuple[list[dict[str, torch.Tensor]], int]:
        encodes.clear()
        b = frozen.FrozenBase(spec, layouts, lora, None, seed)
        for i in range(spec.num_all_layers):
            b.put(i, spec.build_layer(i, seed))
        assert b.load_hf(ckpt) == [dropped]
        out = [dict(b.tensors(i)) for i in range(spec.num_all_layers)]
        b.close()
        return out, len(encodes)

    lora = lora_of(spec)
    eager, n_eager = base(lora)
    once, n_once = base(dataclasses.replace(lora, base_from_checkpoint=True))
    assert n_once == len(ckpt) + 1 < n_eager  # each frozen tensor once (+ the dropped one from the init)
    for a, b in zip(eager, once, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # files for every layer's state: minutes on a loaded 2-core machine
def test_lora_with_the_disk_tier_equals_the_host_tier() -> None:
    """``eps.tier=disk``: the adapters' master and moments in files, the same numbers bit for bit."""
    host = run_lora("llama", "mode=l2l")
    disk = run_lora("llama", "mode=l2l", "eps.tier=disk")
    assert disk["losses"] == host["losses"]
    assert all(torch.equal(disk["adapter"][k], v) for k, v in host["adapter"].items())


@pytest.mark.parametrize("precision", ["cmp", pytest.param("amp", marks=pytest.mark.slow)])
def test_lora_in_low_precision_follows_fp32(precision: str) -> None:
    """CMP / AMP: the frozen base and activations in 16 bits, the adapters' master and moments in fp32.
    The losses stay within bf16/fp16 rounding of the fp32 run's (1e-4). Adam's first steps move each
    element by about ``lr`` whatever its gradient's size, so an element whose gradient is near zero can
    move either way under rounding: the adapter is compared as a whole (cosine > 0.9 with fp32's), not
    element by element."""
    ref = run_lora("llama", "mode=l2l")
    got = run_lora("llama", "mode=l2l", f"precision={precision}")
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4)
    a = torch.cat([v.flatten() for k, v in sorted(ref["adapter"].items()) if ".lora_B." in k])
    b = torch.cat([got["adapter"][k].flatten() for k, v in sorted(ref["adapter"].items()) if ".lora_B." in k])
    cos = float(a @ b / (a.norm() * b.norm()))
    assert cos > 0.9, cos
    for k, v in got["before"].items():  # the base stays what it was
        assert torch.equal(v, got["after"][k]), k


def _depth_run(layers: int, recompute: str) -> tuple[dict[str, int], dict[str, int], int]:
    """(the device meter's peak parts, the host parts, a block's trained elements) of 2 steps of an NF4
    base on disk, ``layers`` deep."""
    from l2l_cli.models.base import BLOCK

    cfg = tiny_cfg(
        *FAMILY["llama"],
        *R8,
        "mode=l2l",
        "peft.base_dtype=nf4",
        "peft.base_source=disk",
        f"model.num_layers={layers}",
        f"mode.recompute={recompute}",
    )
    with built(cfg) as runner:
        for b in lm_batches(cfg, n=2):
            runner.step(b)
        block = runner.spec.new_layer(BLOCK, "meta").named_parameters()
        trained = sum(p.numel() for n, p in block if runner.spec.trainable(n))
        return dict(runner.acc.meter.peak_parts), runner.host_parts(), trained


def test_an_nf4_base_on_disk_keeps_memory_flat_in_depth() -> None:
    """4 vs 8 blocks, the papers' full recompute: the device's layer slots, activations and workspace are
    the same bytes, the host holds none of the base, and what grows is what L2L keeps per layer by design:
    the stash (each block's input) and the adapters' own state (master, gradient, moments), by exactly their
    per-layer bytes."""
    dev4, host4, trained = _depth_run(4, "full")
    dev8, host8, _ = _depth_run(8, "full")
    assert host4.get("frozen_base", 0) == host8.get("frozen_base", 0) == 0
    for part in ("layer_slots", "activations", "workspace"):
        assert dev8[part] == dev4[part], (part, dev4, dev8)
    assert dev8["stash"] == 2 * dev4["stash"]  # one input per block: 4 -> 8
    for part, b in (("master", 4), ("grads", 4), ("optimizer_state", 8)):  # fp32; AdamW's two moments
        assert host8[part] - host4[part] == 4 * b * trained > 0, part


@pytest.mark.slow
def test_kept_graphs_are_what_grows_with_depth() -> None:
    """With every block's graph kept (``mode.recompute=none``: what ``auto`` picks when the device has
    room, and a CPU device's room is host RAM) the activations grow with depth: the growth the 7B-shaped
    benchmark saw under ``auto`` (docs/adapters.md)."""
    kept4, _, _ = _depth_run(4, "none")
    kept8, _, _ = _depth_run(8, "none")
    assert kept8["activations"] > 1.5 * kept4["activations"]


@pytest.mark.parametrize("source", ["host", "disk"])
def test_a_base_held_in_ram_is_page_locked_once_at_its_first_load(
    source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A low-bit base held in RAM is handed to ``Accelerator.link`` (page-locked on CUDA) once per tensor, at
    its layer's first load: copied from pageable memory, an H200's 70B QLoRA step waited on the compute
    thread for each layer's base. A base on disk is read into new buffers each time: not locked. And on
    CUDA a small tensor, or one the OS refuses to lock, stays as it is."""
    from l2l_cli.engine import device as device_mod
    from l2l_cli.engine.device import Accelerator, CudaAccelerator

    linked: list[int] = []
    monkeypatch.setattr(Accelerator, "link", lambda self, t: linked.append(t.data_ptr()) or t)
    cfg = tiny_cfg(*FAMILY["llama"], *R8, "peft.base_dtype=nf4", f"peft.base_source={source}")
    with built(cfg) as runner:
        for b in lm_batches(cfg)[:2]:
            runner.step(b)
        held = [
            t.data_ptr() for layer in runner.eps.base.layers for f in layer.values() for t in f.parts.values()
        ]
    if source == "disk":
        assert linked == []
    else:
        assert held and sorted(linked) == sorted(held)  # every stored tensor, each once

    acc = CudaAccelerator.__new__(CudaAccelerator)  # (its fields only: no CUDA here)
    acc.pinned = []
    locked: list[int] = []
    monkeypatch.setattr(device_mod, "pin_exact", lambda t: locked.append(t.nbytes) or t)
    small, large = torch.empty(1000), torch.empty(1 << 16)
    assert acc.link(small) is small and acc.link(large) is large and locked == [large.nbytes]
    assert acc.pinned == [large]

    def refused(t: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("cudaHostRegister of 262144 bytes failed (error 2)")

    monkeypatch.setattr(device_mod, "pin_exact", refused)
    assert acc.link(torch.empty(1 << 16)).nbytes == 1 << 18 and len(acc.pinned) == 1
