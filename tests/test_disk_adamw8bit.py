"""8-bit AdamW on the disk tier (format 3: each layer file's moment parts hold the optimizer's own state
buffers, codes, absmaxes and the small tensors' FP32 moments): the same training as the host tier bit for
bit, every state buffer included, in L2L and L2L-p (its rollbacks redone from the file's other slot), FP32
and CMP; resumed from its commit; its checkpoints the host tier's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load, load_file

from l2l_cli.compose import compose
from l2l_cli.engine.optim import ADAM_8BIT, ADAM_FP32
from l2l_cli.engine.tiers.disk.layout import disk_bytes, moment_layout
from l2l_cli.train import run_job
from tests.util import TINY, batches, bert_spec, built, tiny_cfg, weights

# width 64: the blocks' 64 x 64 and 64 x 128 matrices keep 8-bit moments (>= MIN_8BIT), their biases and
# norms FP32 ones; the embeddings' too
WIDE = ("model.hidden_size=64", "model.intermediate_size=128", "optim=adamw8bit")
CMP = ("precision=cmp", "precision.dtype=bf16")


def _run(*over: str, steps: int = 3) -> dict[str, Any]:
    """Losses, weights and each layer's EPS checkpoint file (weights, every state buffer, step) after
    ``steps`` steps."""
    cfg = tiny_cfg(*WIDE, *over)
    with built(cfg, 10) as runner:
        it = batches(cfg)
        reports = [runner.step(next(it)) for _ in range(steps)]
        # (the runner's: its trailing update of the last layers is finished first)
        files = {name: load(data) for name, data in runner.state_files()}
        spec = getattr(runner, "speculation", None)
        return {
            "losses": [r.loss for r in reports],
            "weights": weights(runner),
            "state": files,
            "rollbacks": spec.rollbacks if spec is not None else 0,
            "summary": runner.eps.tier.summary() if hasattr(runner.eps.tier, "summary") else None,
        }


def _assert_same_state(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert got["losses"] == ref["losses"]
    for k in ref["weights"]:
        assert torch.equal(got["weights"][k], ref["weights"][k]), k
    assert got["state"].keys() == ref["state"].keys()
    for name, tensors in ref["state"].items():
        assert got["state"][name].keys() == tensors.keys(), name
        for key, t in tensors.items():
            g = got["state"][name][key]
            assert g.dtype == t.dtype and torch.equal(g, t), (name, key)


@pytest.mark.parametrize(
    "mode,extra",
    [
        ("l2l", ()),
        # global clipping at a norm the first step crosses (0.469) only at its last layers: speculative
        # updates rolled back to the file's other slot and redone from the kept gradient (in RAM, and
        # beyond a pool of none on disk)
        ("l2l_p", ("optim.max_grad_norm=0.46", "eps.grad_ram_layers=0")),
        pytest.param("l2l", CMP, marks=pytest.mark.slow),
        ("l2l_p", (*CMP, "optim.max_grad_norm=0.46")),
    ],
    ids=["l2l", "l2l_p-rollback", "l2l-cmp", "l2l_p-cmp-rollback"],
)
def test_8bit_adamw_on_the_disk_tier_equals_the_host_tier_bit_for_bit(mode: str, extra: tuple) -> None:
    ref = _run(f"mode={mode}", *extra)
    got = _run(f"mode={mode}", *extra, "eps.tier=disk", "eps.host_cache_layers=2")
    _assert_same_state(got, ref)
    codes = [t for f in ref["state"].values() for k, t in f.items() if k in ("m", "v")]
    assert any(t.dtype == torch.uint8 and t.numel() for t in codes)  # 8-bit codes are compared, not only FP32
    if "optim.max_grad_norm=0.46" in extra:
        assert got["rollbacks"] >= 1 and ref["rollbacks"] >= 1
    # per step: weights read and written (4 B/param each way and more), 8-bit moments about 1 B each way
    s = got["summary"]
    assert s is not None and s["file_bytes"] > 0


def test_the_layer_files_hold_8bit_moments_in_format_3(tmp_path: Path) -> None:
    """The file's header names format 3 and where each state buffer is; a file is about half the FP32 one
    (w twice, 4 B/param each, and ~1.02 B/param per moment instead of 4), and ``disk_bytes`` counts it."""
    root = tmp_path / "eps"
    _run("mode=l2l", "eps.tier=disk", f"eps.path={root}", steps=1)
    head = (root / "layer_00001.eps").read_bytes()[:4096]
    meta = json.loads(head.split(b"\n")[1])
    assert meta["format"] == 3 and meta["parts"] == ["w", "m", "v"]
    assert [x[0] for x in meta["state"]["m"]] == ["m", "m_absmax", "m_fp32"]
    spec = bert_spec(3, 64, 2, 128, vocab_size=512)
    fp32, q8 = disk_bytes(spec, ADAM_FP32), disk_bytes(spec, ADAM_8BIT)
    assert q8 < 0.6 * fp32
    pieces = moment_layout([10000, 100], ADAM_8BIT)["v"]
    assert [(s, k) for s, _, _, k in pieces] == [("v", 10000), ("v_absmax", 40), ("v_fp32", 100)]


def test_a_disk_8bit_run_resumes_from_its_commit_and_checkpoints_as_the_host_tier(tmp_path: Path) -> None:
    """A disk-tier 8-bit AdamW run of 2 steps writes a full checkpoint, then resumes from its commit to 4:
    its checkpoints (every state buffer, uint8 codes as uint8) and final weights are the host tier's."""
    base = [
        *TINY,
        *WIDE,
        "mode=l2l",
        "task.num_train=256",
        "task.num_eval=16",
        "trainer.save_final=true",
        "trainer.save_every=2",
        "optim.schedule=constant",
        "optim.warmup_ratio=0",
    ]
    assert run_job(compose([*base, "trainer.max_steps=4"]), tmp_path / "host") == "ok"
    run = tmp_path / "disk"
    assert run_job(compose([*base, "trainer.max_steps=2", "eps.tier=disk"]), run) == "ok"
    assert (
        run_job(compose([*base, "trainer.max_steps=4", "eps.tier=disk", f"trainer.resume={run}"]), run)
        == "ok"
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"]["step"] == 2
    assert json.loads((run / "eps" / "commit.json").read_text())["format"] == 3
    for step in (2, 4):
        for f in sorted((tmp_path / "host" / "checkpoints" / f"step_{step}").glob("layer_*.safetensors")):
            ref, got = load_file(f), load_file(run / "checkpoints" / f"step_{step}" / f.name)
            assert got.keys() == ref.keys()
            for k in ref:
                assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), (step, f.name, k)
    got, ref = (
        load_file(run / "final" / "model.safetensors"),
        load_file(tmp_path / "host" / "final" / "model.safetensors"),
    )
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


def test_plan_counts_the_disk_tiers_bytes_with_the_optimizers_state() -> None:
    """``l2l plan`` on the disk tier: 8-bit AdamW's files take 2 x (4 + 2.03) bytes per parameter instead
    of 24, its update buffer a quarter of the FP32 one's moments, and on a disk that binds the step its I/O
    (4 + 4 + 2.03 read, 4 + 2.03 written per parameter, against 28) gives the shorter step."""
    from l2l_cli.plan.planner import make_plan

    base = ["model=bert-base", "mode=l2l_p", "hardware=a100-80g", "eps.tier=disk"]
    slow = ["hardware.disk_read_gbps=0.05", "hardware.disk_write_gbps=0.05"]
    fp32 = make_plan(compose([*base, "optim=adamw", *slow]))
    q8 = make_plan(compose([*base, "optim=adamw8bit", *slow]))
    params = q8["params"]["total"]
    assert fp32["memory_bytes"]["disk"]["parts"]["eps_files"] == 24 * params
    assert q8["memory_bytes"]["disk"]["parts"]["eps_files"] == pytest.approx(2 * (4 + 2 + 8 / 256) * params)
    assert (
        q8["memory_bytes"]["host"]["parts"]["eps_cache"] < fp32["memory_bytes"]["host"]["parts"]["eps_cache"]
    )
    wait8, wait32 = q8["step_time_s"]["disk_wait"], fp32["step_time_s"]["disk_wait"]
    assert wait8 < 0.75 * wait32 and q8["step_time_s"]["total"] < fp32["step_time_s"]["total"]
    assert q8["eps_tier"]["disk"]["disk_bytes"] < 0.6 * fp32["eps_tier"]["disk"]["disk_bytes"]


def test_a_directory_of_8bit_moments_is_refused_by_a_run_with_fp32_ones(tmp_path: Path, capsys: Any) -> None:
    """Format 3 names its moments: a resume with another optimizer is one line saying which to use, and the
    files are left as they were."""
    base = [*TINY, "mode=l2l", "task.num_train=64", "task.num_eval=16", "eps.tier=disk"]
    run = tmp_path / "run"
    assert run_job(compose([*base, "optim=adamw8bit", "trainer.max_steps=1"]), run) == "ok"
    before = (run / "eps" / "commit.json").read_bytes()
    again = compose([*base, "optim=adamw", "trainer.max_steps=2", f"trainer.resume={run}"])
    assert run_job(again, run) == "config"
    err = capsys.readouterr().err
    assert "8-bit AdamW moments (format 3)" in err and "optim.name it was written with" in err
    assert (run / "eps" / "commit.json").read_bytes() == before
