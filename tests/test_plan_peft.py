"""``l2l plan`` with LoRA (issue 38 item 6): bytes per parameter for each peft / optimizer choice (the
frozen base at ``peft.base_dtype`` in RAM or on disk, the adapters' state), verdicts that follow them, the
base's reads per step and the term that bounds the step; the counts are the run's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from l2l_cli.compose import compose
from l2l_cli.plan.cli import main
from l2l_cli.plan.peft import (
    NF4_BLOCK,
    NF4_SCALER_BLOCK,
    READ_AHEAD,
    nf4_bytes_per_param,
    peft_shape,
    stored_bytes,
)
from l2l_cli.plan.planner import make_plan, model_shape
from l2l_cli.plan.render import fmt_s

GiB = 2**30
ACCEPT = [
    "model=llama-70b",
    "task=lm",
    "peft=lora",
    "peft.base_dtype=nf4",
    "peft.base_source=disk",
    "hardware.device_memory_gb=24",
    "hardware.host_memory_gb=64",
]
TINY_LM = [
    "model=llama-tiny",
    "task=lm",
    "mode=l2l",
    "batch.size=2",
    "batch.ubatch_size=1",
    "task.max_seq_len=32",
]


def plan(*args: str) -> dict:
    return make_plan(compose(list(args)))


def test_70b_nf4_from_disk_fits_a_24gb_gpu_and_64gb_of_ram(capsys) -> None:
    """The issue's question: a 70B base in NF4 read from disk, LoRA adapters, on a 24 GB GPU with 64 GB of
    RAM: it fits, the plan says how long a step takes and which term bounds it, and shows where each byte
    per parameter lives."""
    p = plan(*ACCEPT)
    pe = p["peft"]
    assert p["fits"] and p["verdict"] == "fits"
    mem = p["memory_bytes"]
    assert mem["device"]["total"] <= 24 * GiB and mem["host"]["total"] <= 64 * GiB
    # the base is on disk (~0.53 B/param: NF4's 4.13 bits and the bf16 embeddings and head), not in RAM
    assert 0.51 < pe["base_bytes_per_param"] < 0.55
    assert mem["disk"]["parts"]["frozen_base_files"] == pe["base_bytes"] > 30 * GiB
    assert "frozen_base" not in mem["host"]["parts"]
    # RAM: the adapters' 16 B per trained parameter and the layers read ahead; never the whole base
    assert pe["adapter_state_bytes"] == 16 * pe["trainable_params"]
    assert mem["host"]["total"] < 4 * GiB
    # every layer's base read twice a step (forward, then the backward's recompute + backward), at the disk
    # rate: the step takes at least the reads, and the bound is named
    assert pe["base_bytes_read_per_step"] > 1.9 * pe["base_bytes"]
    assert p["step_time_s"]["total"] >= pe["step_terms_s"]["disk_read"] > 0
    assert pe["bound"] in ("compute + dequantize", "disk read", "link", "host optimizer")
    assert main(ACCEPT) == 0
    out = capsys.readouterr().out
    assert "✓ fits" in out and "LoRA r=8, base nf4 on disk, adamw" in out and "bound by:" in out
    assert f"step {fmt_s(p['step_time_s']['total'])}, bound by {pe['bound']}" in out
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in out.splitlines()
        if line.startswith("│") and line.count("│") == 7
    }
    assert rows["frozen base, nf4"][1:3] == [f"{pe['base_bytes_per_param']:.3g}", "disk"]
    assert rows["read ahead (3 layers at most)"][1:3] == ["0", "RAM"]
    assert rows["adapters' state (adamw)"][1:3] == ["16", "RAM"]


def test_7b_full_fine_tune_needs_100_gib_of_host_and_lora_nf4_on_disk_a_few() -> None:
    """llama-7b: full fine-tuning keeps 16 B per parameter on the host (~100 GiB), adamw8bit ~10; LoRA on an
    NF4 base read from disk needs a few GiB (adapters and read-ahead), an NF4 base in RAM ~3.5 GiB more."""
    full = plan("model=llama-7b", "task=lm")
    assert full["memory_bytes"]["host"]["total"] >= 100 * GiB and full["peft"] is None
    eight = plan("model=llama-7b", "task=lm", "optim=adamw8bit")
    assert eight["memory_bytes"]["host"]["total"] / full["params"]["total"] == pytest.approx(10, abs=0.3)
    disk = plan("model=llama-7b", "task=lm", "peft=lora", "peft.base_dtype=nf4", "peft.base_source=disk")
    host = plan("model=llama-7b", "task=lm", "peft=lora", "peft.base_dtype=nf4")
    assert disk["memory_bytes"]["host"]["total"] < 4 * GiB
    assert disk["peft"]["host_bytes_per_param"] < 0.1  # the adapters' state only, over 6.7B parameters
    assert host["memory_bytes"]["host"]["parts"]["frozen_base"] == disk["peft"]["base_bytes"]
    assert host["peft"]["host_bytes_per_param"] < 0.7  # issue 38's acceptance: <= 0.7 for NF4 + LoRA
    bf16 = plan("model=llama-7b", "task=lm", "peft=lora", "peft.base_dtype=bf16")
    assert bf16["peft"]["base_bytes_per_param"] == pytest.approx(2.0)
    int8 = plan("model=llama-7b", "task=lm", "peft=lora", "peft.base_dtype=int8")
    assert 1.0 < int8["peft"]["base_bytes_per_param"] < 1.1  # 1 + a per-row scale; bf16 embeddings, head


def test_verdicts_follow_the_peft_bytes() -> None:
    """A bf16 base in 16 GiB of RAM does not fit; the verdict says the disk source fits, and that plan
    fits. A disk too small for the base's files is named as such."""
    small = ["model=llama-7b", "task=lm", "peft=lora", "peft.base_dtype=bf16", "hardware.host_memory_gb=8"]
    p = plan(*small)
    assert not p["fits"] and "peft.base_source=disk fits" in p["verdict"] and "bf16" in p["verdict"]
    assert plan(*small, "peft.base_source=disk")["fits"]
    tight = plan(*small, "peft.base_source=disk", "hardware.disk_free_gb=5")
    assert not tight["fits"] and "frozen base's files" in tight["verdict"]


def test_a_slow_disk_bounds_the_step_and_is_waited_for() -> None:
    """The base's reads per step at the disk rate: on a slow disk they bound the step (the compute waits),
    on a fast one the compute does; a base in RAM reads nothing."""
    args = ["model=llama-7b", "task=lm", "peft=lora", "peft.base_dtype=nf4", "peft.base_source=disk"]
    slow = plan(*args, "hardware.disk_read_gbps=0.2")
    fast = plan(*args, "hardware.disk_read_gbps=50")
    assert slow["peft"]["bound"] == "disk read" and fast["peft"]["bound"] != "disk read"
    reads = slow["peft"]["base_bytes_read_per_step"]
    assert slow["step_time_s"]["total"] >= reads / 0.2e9
    assert slow["step_time_s"]["disk_wait"] > 0.5 * reads / 0.2e9 > fast["step_time_s"]["disk_wait"]
    assert plan(*args[:-1])["peft"]["base_bytes_read_per_step"] == 0


@pytest.mark.parametrize(
    "args",
    [
        ["model=llama-tiny", "task=lm", "peft.target_modules=[q_proj,v_proj,down_proj]", "peft.r=4"],
        ["model=gpt2-tiny", "task=lm", "peft.target_modules=[c_attn,c_proj,c_fc]"],
        [
            "model=bert-tiny",
            "peft.target_modules=[query,key,value,dense]",
            "peft.modules_to_save=[classifier]",
        ],
        ["model=bert-tiny", "peft.target_modules=[query,value]"],  # the classifier trains (PEFT's SEQ_CLS)
        ["model=llama-tiny", "task=lm", "peft.target_modules=[q_proj,v_proj]", "peft.use_dora=true"],
    ],
)
def test_the_adapter_count_is_what_lora_injects(args: list[str]) -> None:
    """The plan's trained and frozen parameters equal PEFT's injection as the run makes it (a real layer
    built by ``build_layer``, its ``requires_grad`` parameters)."""
    from l2l_cli.models.lora import LoraSettings, param_split, with_lora

    cfg = compose([*args, "peft=lora"])
    shape, _ = model_shape(cfg)
    pe = shape.peft
    spec = with_lora(shape.spec, LoraSettings.from_cfg(cfg.peft))
    assert (pe.trainable, pe.frozen) == param_split(spec)
    for i, split in ((0, pe.pre), (1, pe.block), (spec.num_layers + 1, pe.post)):
        layer = spec.build_layer(i, 0)
        trained = sum(p.numel() for p in layer.parameters() if p.requires_grad)
        assert trained == split.trainable
    assert pe.block.trainable > 0


def test_stored_bytes_are_what_the_frozen_base_stores() -> None:
    """NF4 (torchao's layout: blocks of 64, int8 block scales double-quantized per 256, padding), int8 (a
    scale per row) and the plain types: the planner's bytes equal ``engine/frozen.py``'s tensors'."""
    import torch

    from l2l_cli.engine import frozen

    assert (NF4_BLOCK, NF4_SCALER_BLOCK) == (frozen.NF4_BLOCK, frozen.NF4_SCALER_BLOCK)
    assert nf4_bytes_per_param() == pytest.approx(4.127 / 8, abs=1e-3)
    g = torch.Generator().manual_seed(0)
    for shape in ((64, 128), (352, 128), (100, 30), (16384 * 2,)):
        t = torch.randn(shape, generator=g)
        for dtype in ("fp32", "bf16", "fp16", "int8", "nf4"):
            for quantize in (True, False):
                assert frozen.encode(t, dtype, quantize).nbytes == stored_bytes(shape, dtype, quantize)


def test_read_ahead_is_the_disk_readers() -> None:
    """The RAM a base on disk keeps is the disk reader's read-ahead (engine/frozen_disk.py) plus the layer
    in use."""
    import inspect

    from l2l_cli.engine.frozen_disk import DiskSource

    assert inspect.signature(DiskSource).parameters["ahead"].default == READ_AHEAD
    cfg = compose([*TINY_LM, "peft=lora", "peft.base_dtype=nf4", "peft.base_source=disk"])
    shape, _ = model_shape(cfg)
    p = make_plan(cfg)
    assert (
        p["memory_bytes"]["host"]["parts"]["frozen_base_readahead"]
        == (READ_AHEAD + 1) * shape.peft.max_stored
    )


def test_host_bytes_per_param_match_a_tiny_run(tmp_path: Path) -> None:
    """A tiny Llama LoRA run (``l2l train``'s job: NF4 base in RAM, adamw8bit) reports the host bytes the plan
    predicts: the run's ``host_bytes_per_param`` (per model parameter), ``peft.host_bytes_per_param`` (per
    trainable + frozen), the base's bytes in RAM and the bytes loaded toward the device per step. Tolerance
    1e-6 relative: both sides count the bytes of the same tensors (nothing measured), so only float rounding
    may differ."""
    args = [*TINY_LM, "peft=lora", "peft.base_dtype=nf4", "optim=adamw8bit"]
    p = make_plan(compose(args))["peft"]
    from l2l_cli.train import run_job  # what `l2l train` runs, in this process (its imports paid once)

    run = tmp_path / "run"
    cfg = compose(
        [
            *args,
            "trainer.max_steps=1",
            "task.max_eval_samples=2",
            "trainer.progress=none",
            "profile.memory=false",
        ]
    )
    assert run_job(cfg, run) == "ok"
    s = json.loads((run / "summary.json").read_text())
    assert s["host_bytes_per_param"] == pytest.approx(p["host_bytes_per_param"], rel=1e-6)
    assert s["peft"]["host_bytes_per_param"] == pytest.approx(p["peft_host_bytes_per_param"], rel=1e-6)
    assert s["peft"]["base_host_bytes"] == p["base_ram_bytes"] == p["base_bytes"]
    assert s["peft"]["adapter_host_bytes"] == pytest.approx(p["adapter_state_bytes"], rel=1e-6)
    assert s["peft"]["base_bytes_loaded_per_step"] == p["base_bytes_loaded_per_step"]
    assert (s["peft"]["trainable_params"], s["peft"]["frozen_params"]) == (
        p["trainable_params"],
        p["frozen_params"],
    )


@pytest.mark.parametrize(
    "args,key",
    [
        (
            ["peft=lora", "dist.nproc=2", "dist.pipeline=2", "batch.size=8", "batch.ubatch_size=2"],
            "peft.name",
        ),
        (["peft=lora", "mode=baseline", "peft.base_source=disk"], "peft.base_source"),
        (["model=llama-tiny", "task=lm", "peft=lora", "peft.target_modules=[qkv]"], "peft.target_modules"),
        (["--search", "model=llama-7b", "task=lm", "peft=lora"], "peft.name"),
    ],
)
def test_a_bad_peft_combination_is_one_config_error(args: list[str], key: str, capsys) -> None:
    """What ``l2l train`` refuses, ``l2l plan`` refuses the same way: one line, exit 2."""
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"l2l: config error: {key}:"), err


def test_peft_shape_needs_no_adapter_when_none() -> None:
    """Without peft the plan has no LoRA section and counts every parameter's state (unchanged)."""
    cfg = compose(["model=llama-tiny", "task=lm"])
    shape, _ = model_shape(cfg)
    assert shape.peft is None
    lora_cfg = compose(["model=llama-tiny", "task=lm", "peft=lora"])
    pe = peft_shape(shape.spec, lora_cfg.peft)
    assert pe.trainable + pe.frozen > shape.total_params  # adapters add parameters; the base is all of them
    assert pe.frozen == shape.total_params
