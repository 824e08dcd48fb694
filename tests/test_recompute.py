"""Budgeted and selective recompute (``mode.recompute``, ``mode.keep_layers``): every choice trains the same
weights as baseline_ag and, bit for bit, as L2L's full recompute (FP32 and CMP, dropout 0.1: the masks
replay); kept blocks are not recomputed and selective ones replay only the elementwise ops; ``auto`` on the
simulated device stays within its budget; the rules, summary.json and the progress header."""

from __future__ import annotations

import collections
import functools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from l2l_cli.compose import compose
from l2l_cli.config.validate import validate
from l2l_cli.session import build
from l2l_cli.train import run_job
from tests.util import assert_same_weights, batches, built, l2l, tiny_cfg, tiny_data, train

DROPOUT = ["model.dropout=0.1", "batch.ubatch_size=2"]  # 4 micro-batches, dropout masks to replay


@functools.cache
def reference(mode: str, *extra: str) -> dict[str, Any]:
    return train(tiny_cfg(f"mode={mode}", *DROPOUT, *extra), steps=2)


def assert_bitwise(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert got["losses"] == ref["losses"]
    assert got["weights"].keys() == ref["weights"].keys()
    for k in ref["weights"]:
        assert torch.equal(got["weights"][k], ref["weights"][k]), k


POLICIES = {
    # l2l_p, a kept block and selective ones, the stash on the host: the default suite's one case
    "l2l_p-selective-keep1-stash-cpu": (
        "l2l_p",
        ["mode.recompute=selective", "mode.keep_layers=1", "mode.stash=cpu"],
    ),
    "l2l-selective": ("l2l", ["mode.recompute=selective"]),
    "l2l-none": ("l2l", ["mode.recompute=none"]),
    "l2l_p-none-stash-cpu": ("l2l_p", ["mode.recompute=none", "mode.stash=cpu"]),
    "l2l_p-selective-keep2": ("l2l_p", ["mode.recompute=selective", "mode.keep_layers=2"]),
    "l2l-keep2-prefetch-off": ("l2l", ["mode.keep_layers=2", "mode.prefetch=false"]),  # one relay slot
}


@pytest.mark.parametrize(
    "case",
    [
        "l2l_p-selective-keep1-stash-cpu",
        *(
            pytest.param(c, marks=pytest.mark.slow)
            for c in POLICIES
            if c != "l2l_p-selective-keep1-stash-cpu"
        ),
    ],
)
def test_each_policy_equals_full_recompute_bit_for_bit_and_baseline_ag(case: str) -> None:
    """A kept graph and a selective replay run the forward's own ops on the same inputs and dropout
    masks: the weights are L2L's (full recompute, stash on the device) bit for bit, so l2l_p's under
    each policy equal l2l's, and both equal baseline_ag's."""
    mode, extra = POLICIES[case]
    got = train(tiny_cfg(f"mode={mode}", *DROPOUT, *extra), steps=2)
    assert_bitwise(got, reference("l2l"))
    ag = reference("baseline_ag")
    assert got["losses"] == pytest.approx(ag["losses"], rel=1e-5)
    assert_same_weights(got["weights"], ag["weights"])


@pytest.mark.slow
def test_cmp_policies_equal_full_recompute_bit_for_bit() -> None:
    """CMP (half device copies, FP32 master): autocast's casts are in the kept graphs and the replay."""
    cmp = ["precision=cmp", "mode.recompute=selective", "mode.keep_layers=1"]
    got = train(tiny_cfg("mode=l2l", *DROPOUT, *cmp), steps=2)
    assert_bitwise(got, reference("l2l", "precision=cmp"))


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.n[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _ops(policy: str) -> collections.Counter[str]:
    cfg = tiny_cfg("mode=l2l", *DROPOUT, "batch.size=4", f"mode.recompute={policy}")
    with built(cfg) as runner:
        ops = _Ops()
        with ops:
            runner.step(next(batches(cfg)))
    return ops.n


def test_kept_blocks_are_not_recomputed_and_selective_replays_only_the_elementwise_ops() -> None:
    full, sel, none = _ops("full"), _ops("selective"), _ops("none")
    blocks, ubatches = 3, 2
    # none: every block's forward runs once; full: once more (the recompute)
    assert full["_safe_softmax"] - none["_safe_softmax"] == blocks * ubatches
    assert full["addmm"] > none["addmm"] and full["bmm"] > none["bmm"]
    # selective: the matmuls come from the forward's saved outputs, softmax, GELU, dropout are replayed
    for op in ("addmm", "bmm", "mm"):
        assert sel[op] == none[op], op
    for op in ("_safe_softmax", "gelu", "bernoulli_", "native_layer_norm"):
        assert sel[op] == full[op], op


def test_with_every_layer_kept_nothing_is_recomputed_not_even_the_embeddings() -> None:
    """Issue 53: ``mode.recompute=none`` (auto with room: every block kept) keeps the embeddings' graph
    too, so no phase of the step is recompute: the lookups run once per micro-batch (full: twice), the
    timer charges nothing to ``recompute``, and the weights are full recompute's bit for bit."""
    full, none = _ops("full"), _ops("none")
    ubatches, lookups = 2, 3  # word, position and token-type embeddings
    assert none["embedding"] == lookups * ubatches and full["embedding"] == 2 * none["embedding"]
    assert none["embedding_dense_backward"] == full["embedding_dense_backward"] > 0
    got = train(tiny_cfg("mode=l2l", *DROPOUT, "mode.recompute=none"), steps=2)
    assert all("recompute" not in r.phases for r in got["reports"]), [r.phases for r in got["reports"]]
    assert_bitwise(got, reference("l2l"))


def _sim(gb: float, *extra: str) -> tuple[Any, int, str]:
    """(the plan, the device peak of a step, the progress header) on the simulated device with ``gb`` GiB."""
    cfg = tiny_cfg("mode=l2l", *DROPOUT, "device=sim", f"sim.memory_gb={gb}", "trainer.max_steps=10", *extra)
    with build(cfg, data=tiny_data(cfg)) as s:
        s.runner.step(next(batches(cfg)))  # type: ignore[union-attr]
        return s.runner.recompute, s.acc.meter.peak_bytes, s.trainer.settings.title  # type: ignore[union-attr]


def test_auto_on_the_simulated_device_keeps_what_fits_and_stays_under_the_budget() -> None:
    """The budgets come from measured peaks: full recompute's, and every block kept's. Just above the
    first (room for the relay and the stash, not for a kept block) auto recomputes in full and does not
    run out of memory; between the two it keeps activations and its measured peak stays under the budget."""
    _, full, title = _sim(1.0, "mode.recompute=full")
    assert "recompute" not in title  # full, nothing kept: the header as before
    plan, kept, _ = _sim(1.0, "mode.recompute=auto")  # room for everything: every block kept
    assert (plan.policy, plan.kept) == ("full", 3) and kept > full
    section = plan.section()  # summary.json's recompute section (test_summary_... writes it, -m slow)
    assert section["policy"] == "none" and section["kept_layers"] == 3 and section["saved_bytes"] > 0
    tight = 1.05 * full / 2**30
    plan, peak, _ = _sim(tight, "mode.recompute=auto")
    assert (plan.policy, plan.kept) == ("full", 0) and peak <= tight * 2**30
    roomy = (full + 0.8 * (kept - full)) / 2**30
    plan, peak, title = _sim(roomy, "mode.recompute=auto")
    assert plan.kept > 0 or plan.policy == "selective"
    assert full < peak <= roomy * 2**30
    assert title.endswith(plan.describe()) and plan.describe().startswith("recompute ")


def test_rules_of_the_recompute_keys() -> None:
    def problems(*overrides: str) -> list[str]:
        return [f"{p.key}: {p.message}" for p in validate(compose(list(overrides)), check_files=False)]

    assert any(
        p.startswith("mode.recompute: applies to the L2L modes")
        for p in problems("mode=baseline_ag", "mode.recompute=none")
    )
    assert any(
        p.startswith("mode.keep_layers: applies") for p in problems("mode=baseline", "mode.keep_layers=1")
    )
    assert any("mode.recompute: got 'some'" in p for p in problems("mode=l2l", "mode.recompute=some"))
    assert any(
        "0..3 (model.num_layers)" in p
        for p in problems("mode=l2l", "model.num_layers=3", "mode.keep_layers=4")
    )
    assert any(
        "leave keep_layers unset" in p
        for p in problems("mode=l2l_p", "mode.recompute=none", "mode.keep_layers=1")
    )
    assert any("activation_budget_gb" in p for p in problems("mode=l2l", "mode.activation_budget_gb=-1"))
    assert problems("mode=l2l", "mode.recompute=auto", "mode.keep_layers=auto") == []


@pytest.mark.slow
def test_a_bad_recompute_key_exits_2_with_one_line_and_no_run_dir(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = l2l("train", "mode=baseline_ag", "mode.recompute=selective", f"hydra.run.dir={run}")
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("l2l: config error:")]
    assert len(lines) == 1 and "mode.recompute" in lines[0]
    assert not run.exists()


@pytest.mark.slow
def test_summary_and_progress_header_record_the_choice(tmp_path: Path) -> None:
    over = [
        "mode=l2l",
        "mode.recompute=auto",
        "mode.activation_budget_gb=1",
        "trainer.max_steps=1",
        "task.num_train=64",
        "task.num_eval=16",
    ]
    cfg = tiny_cfg(*over)
    assert run_job(cfg, tmp_path) == "ok"
    section = json.loads((tmp_path / "summary.json").read_text())["recompute"]
    assert section["kept_layers"] == 3 and section["policy"] == "none" and section["saved_bytes"] > 0


def test_auto_with_room_reports_no_recompute_time(tmp_path: Path) -> None:
    """Issue 53, acceptance 3: ``l2l train mode=l2l mode.recompute=auto`` with room to spare keeps every
    layer (summary.json: policy ``none``, every block kept) and charges the step no recompute: the phase is
    absent from ``time_breakdown_s`` (0; it was the embeddings' recompute, ~1% of a 4-block BERT-base
    step)."""
    from tests.util import TINY

    over = [a for a in TINY if not a.startswith("mode.recompute")]
    run = tmp_path / "run"
    args = ["mode=l2l", "mode.recompute=auto", "trainer.max_steps=4", "task.num_train=64", "task.num_eval=16"]
    r = l2l("train", *over, *args, f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["recompute"]["policy"] == "none" and summary["recompute"]["kept_layers"] == 3
    assert summary["time_breakdown_s"].get("recompute", 0.0) == 0.0, summary["time_breakdown_s"]
    assert summary["time_breakdown_s"]["backward"] > 0


# ---- the rest of the stack: disk tier, resume, a decoder, two ranks (slow) -----------------------------


@pytest.mark.slow
def test_disk_tier_with_kept_layers_equals_the_host_tier_bit_for_bit() -> None:
    """The relay reloads a kept block into the slot its graph references from the disk tier's cache too."""
    got = train(tiny_cfg("mode=l2l_p", *DROPOUT, "eps.tier=disk", "mode.keep_layers=2"), steps=2)
    assert_bitwise(got, reference("l2l"))
    assert all(r.extra["disk_write_bytes"] > 0 for r in got["reports"])  # the disk tier did run


@pytest.mark.slow
def test_resume_with_selective_recompute_is_exact(tmp_path: Path) -> None:
    from tests.test_checkpoint import RUN, _assert_equal_dirs

    over = ["mode=l2l_p", *RUN, "mode.recompute=selective", "mode.keep_layers=1"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert run_job(tiny_cfg(*over), full) == "ok"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_6")
    assert run_job(tiny_cfg(*over, f"trainer.resume={cut}"), cut) == "ok"
    _assert_equal_dirs(full / "checkpoints" / "step_6", cut / "checkpoints" / "step_6")


@pytest.mark.slow
def test_decoder_policies_equal_full_recompute_and_baseline_ag(tmp_path: Path) -> None:
    """GPT-2 (causal attention, a tied head) with dropout 0.1."""
    from tests.test_decoder import cfg_for, lm_data, write_checkpoint

    path = write_checkpoint("gpt2", tmp_path)
    data = lm_data(path)
    ref = train(cfg_for(path, "mode=l2l"), data=data)
    got = train(cfg_for(path, "mode=l2l", "mode.recompute=selective", "mode.keep_layers=1"), data=data)
    assert_bitwise(got, ref)
    ag = train(cfg_for(path, "mode=baseline_ag"), data=data)
    assert_same_weights(got["weights"], ag["weights"])


@pytest.mark.slow
def test_two_ranks_with_kept_and_selective_blocks_equal_one_process(tmp_path: Path) -> None:
    from tests.test_dist import DP, _final

    def run(out: Path, *args: str) -> dict[str, torch.Tensor]:
        r = l2l(
            "train",
            "mode=l2l",
            *DP,
            "mode.recompute=selective",
            "mode.keep_layers=1",
            *args,
            f"hydra.run.dir={out}",
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return _final(out)

    one = run(tmp_path / "one", "batch.size=8", "batch.ubatch_size=2")
    two = run(tmp_path / "two", "dist.nproc=2", "batch.size=4", "batch.ubatch_size=2")
    assert_same_weights(one, two, rtol=1e-4)


def test_plan_predicts_each_choice_and_auto_picks_within_the_budget() -> None:
    """``l2l plan``: a budget just above full recompute's device total leaves auto at full; a roomy one
    keeps every layer; every choice's prediction says whether it fits, auto's always does; the plan's step
    and device total are auto's choice's."""
    from l2l_cli.plan.planner import make_plan

    def plan(gb: float) -> dict[str, Any]:
        over = [
            "mode=l2l",
            "mode.recompute=auto",
            "model=bert-large",
            "model.num_layers=8",
            "batch.size=16",
            "batch.ubatch_size=4",
            "task.max_seq_len=128",
            "device=sim",
            f"sim.memory_gb={gb}",
        ]
        return make_plan(compose(over))

    tight = plan(0.62)
    full = tight["memory_bytes"]["device"]["total"]
    assert full <= 0.62 * 2**30 and tight["recompute"]["auto"]["policy"] == "full"
    assert tight["recompute"]["auto"]["kept_layers"] == 0
    roomy = plan(8.0)["recompute"]
    assert (roomy["auto"]["policy"], roomy["auto"]["kept_layers"]) == ("none", 8)
    kept = next(r for r in roomy["choices"] if r["policy"] == "none")
    assert kept["device_bytes"] > full and kept["step_time_s"] < roomy["choices"][0]["step_time_s"]
    middle = plan(1.4)["recompute"]
    assert 0 < middle["auto"]["kept_layers"] < 8 and middle["auto"]["device_bytes"] <= 1.4 * 2**30
    # the plan's own step and device total are those of the choice the run makes (auto's), not full's:
    # a kept block has no recompute, and the graphs it keeps are a device part of their own
    big = plan(8.0)
    assert big["step_time_s"]["recompute"] < 0.2 * tight["step_time_s"]["recompute"], big["step_time_s"]
    assert big["step_time_s"]["total"] == pytest.approx(roomy["auto"]["step_time_s"], rel=0.05)
    assert big["memory_bytes"]["device"]["total"] == pytest.approx(roomy["auto"]["device_bytes"])
    assert big["memory_bytes"]["device"]["parts"]["kept_activations"] > 0


def test_with_every_layer_kept_a_language_models_loss_chunks_run_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 52: with every block kept (``mode.recompute=none``, or auto with room) the LM head keeps its
    graph too, where the room holds a micro-batch's logits: each loss chunk's logits are computed once,
    not again in backward (a second forward of the head, a tenth of a small model's step on a CPU), and
    the weights are those of full recompute (every chunk recomputed) bit for bit."""
    from l2l_cli.data.loading import load_task
    from l2l_cli.models import decoder_modules

    monkeypatch.setattr(decoder_modules, "LOSS_CHUNK", 8 * 2048)  # 8 positions a chunk: 2 per micro-batch
    calls = {"n": 0}
    logits = decoder_modules.LMHead.logits

    def counted(self: Any, x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return logits(self, x)

    monkeypatch.setattr(decoder_modules.LMHead, "logits", counted)
    lm = ["model=llama-tiny", "model.vocab_size=2048", "task=lm", "task.max_seq_len=9", "batch.size=4"]
    runs: dict[str, Any] = {}
    for policy in ("none", "full"):
        cfg = tiny_cfg("mode=l2l", *lm, f"mode.recompute={policy}")
        data = load_task(cfg.task, cfg.model)
        calls["n"] = 0
        runs[policy] = train(cfg, steps=2, data=data)
        runs[policy]["head_forwards"] = calls["n"]
    chunks = 2 * 2 * 2  # per step: 2 micro-batches of 2 rows x 8 positions, 8 positions a chunk
    assert runs["none"]["head_forwards"] == chunks and runs["full"]["head_forwards"] == 2 * chunks
    assert_bitwise(runs["none"], runs["full"])
