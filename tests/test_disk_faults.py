"""The disk tier under failed writes (issue 36): a write, park or commit record refused (ENOSPC or EIO,
injected with ``L2L_FAULT_ENOSPC`` / ``L2L_FAULT_EIO=<path part>[@n]``) stops the run with one line, and the
state a resume finds is the last one whose every write succeeded: resumed, the run ends bit-identical to an
uninterrupted one, with no checkpoint of its own (``trainer.save_every=0``, the default)."""

from __future__ import annotations

import functools
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from l2l_cli import problems
from l2l_cli.compose import compose
from l2l_cli.engine.tiers.disk import format as disk_format
from l2l_cli.engine.tiers.disk import writeback
from l2l_cli.engine.tiers.disk.format import ALIGN, MAGIC, DiskIo, LayerFile, record_digest
from l2l_cli.engine.tiers.disk.store import LayerStore
from l2l_cli.engine.tiers.disk.tier import DiskTier
from l2l_cli.train import run_job
from tests.util import REPO, TINY, tiny_cfg, train

STEPS = 4
# 5 layers, 3 of them in RAM, no RAM for gradients and clipping certain: every step writes layer files
# (updates), parks gradients on disk and writes the commit record
COMMON = [
    *TINY,
    "mode=l2l",
    "eps.tier=disk",
    f"trainer.max_steps={STEPS}",
    "trainer.save_final=true",
    "task.num_train=256",
    "task.num_eval=16",
    "eps.host_cache_layers=3",
    "eps.grad_ram_gb=0",
    "optim.max_grad_norm=1e-9",
]


def _run(run: Path, *extra: str) -> str:
    return run_job(compose([*COMMON, *extra]), run)


# what each write of the tier is, by the function that makes it (every one goes through problems.writing)
WRITERS = {"create": "create", "_write": "layer", "_park": "park", "_keep": "kept", "_write_record": "commit"}


def _traced(run: Path, *extra: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """A run, with the path and the kind (WRITERS) of every write the tier made, in order."""
    paths: list[str] = []
    kinds: list[str] = []
    real = problems.writing

    def counted(path: Any) -> Any:
        paths.append(str(path))
        kinds.append(WRITERS[sys._getframe(1).f_code.co_name])
        return real(path)

    mods = (writeback, disk_format)
    for m in mods:
        m.writing = counted  # type: ignore[attr-defined]
    try:
        status = _run(run, *extra)
    finally:
        for m in mods:
            m.writing = real  # type: ignore[attr-defined]
    return status, tuple(paths), tuple(kinds)


@functools.cache
def _reference_run(
    root: str, *extra: str
) -> tuple[dict[str, torch.Tensor], tuple[str, ...], tuple[str, ...]]:
    """The uninterrupted run's final weights, and the path and kind of every write the tier made, in order."""
    run = Path(root) / ("ref" + "-".join(("", *extra)).replace("=", ""))
    status, paths, kinds = _traced(run, *extra)
    assert status == "ok"
    return load_file(run / "final" / "model.safetensors"), paths, kinds


def _reference(root: str) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    ref, paths, _ = _reference_run(root)
    return ref, paths


@pytest.fixture(scope="module")
def ref_root(tmp_path_factory: Any) -> Path:
    return tmp_path_factory.mktemp("disk-faults-ref")


def _run_with_fault(
    monkeypatch: Any, capsys: Any, run: Path, kind: str, fault: str, *extra: str
) -> tuple[str, list[str]]:
    """A run with the ``kind`` fault (ENOSPC | EIO) at ``fault``: its status and stderr lines."""
    monkeypatch.setattr(problems, "_FAULT" if kind == "ENOSPC" else "_FAULT_EIO", fault)
    monkeypatch.setattr(problems, "_fault_seen", [0])
    capsys.readouterr()
    status = _run(run, *extra)
    monkeypatch.undo()
    return status, capsys.readouterr().err.strip().splitlines()


def _faulted(monkeypatch: Any, capsys: Any, run: Path, kind: str, fault: str, *extra: str) -> list[str]:
    """A run with the ``kind`` fault (ENOSPC | EIO) at ``fault`` that must fail; its stderr lines."""
    status, lines = _run_with_fault(monkeypatch, capsys, run, kind, fault, *extra)
    assert status == "error", (status, lines)
    return lines


def _resumed_equals_the_reference(run: Path, ref: dict[str, torch.Tensor], capsys: Any) -> None:
    status = _run(run, f"trainer.resume={run}")
    err = capsys.readouterr().err
    assert status == "ok", err[-2000:]
    got = load_file(run / "final" / "model.safetensors")
    assert got.keys() == ref.keys()
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == []


def test_a_failed_commit_record_is_never_adopted_as_if_it_had_succeeded(
    tmp_path: Path, ref_root: Path, monkeypatch: Any, capsys: Any
) -> None:
    """Item 1: the 4th commit record (step 3) finds the disk full; with no checkpoint to fall back on
    (save_every=0), step 4 must not overwrite the slots the record of step 2 names, and the run stops naming
    commit.json. Resumed from the record of step 2, it ends bit-identical to the uninterrupted run."""
    ref, _ = _reference(str(ref_root))
    run = tmp_path / "run"
    lines = _faulted(monkeypatch, capsys, run, "ENOSPC", f"{run}/eps/commit.json@4")
    assert len(lines) == 1 and lines[0].startswith(
        f"l2l: error: disk full: no space left writing {run}/eps/"
    ), lines
    assert "commit.json" in lines[0]
    _resumed_equals_the_reference(run, ref, capsys)


def _steps(seq: tuple[str, ...]) -> list[list[int]]:
    """The 1-based positions in ``seq`` of each step's writes (step 0: building the state), each ending
    with its commit record."""
    out: list[list[int]] = [[]]
    for n, path in enumerate(seq, 1):
        out[-1].append(n)
        if path.endswith("commit.json"):
            out.append([])
    return out[:-1]


def _nth_write_of(seq: tuple[str, ...], step: int, name: str, last: bool = True) -> int:
    """Which write of file ``name`` (1-based, among that file's) is its last (else first) one in ``step``."""
    positions = _steps(seq)[step]
    mine = [n for n in range(1, len(seq) + 1) if seq[n - 1].endswith(name)]
    hits = [k for k, n in enumerate(mine, 1) if n in positions]
    return hits[-1] if last else hits[0]


@pytest.mark.parametrize("layer", ["layer_00000.eps", "layer_00003.eps"])
def test_a_failed_layer_write_is_raised_and_never_named_by_a_commit_record(
    tmp_path: Path, ref_root: Path, monkeypatch: Any, capsys: Any, layer: str
) -> None:
    """Items 2 and 3: a layer's update in step 2 finds the disk full. The record of step 2 must not name the
    slot that was never written (the record job checks the writes queued before it), and the error reaches
    the training step even where it is met by a read-ahead evicting the slot (the embeddings, layer 0: in
    RAM at the next forward, evicted by the read-ahead behind it): the run stops naming the file, and
    resumes bit-identical."""
    ref, seq = _reference(str(ref_root))
    run = tmp_path / "run"
    nth = _nth_write_of(seq, 2, layer)
    lines = _faulted(monkeypatch, capsys, run, "ENOSPC", f"{run}/eps/{layer}@{nth}")
    assert len(lines) == 1 and lines[0].startswith(
        f"l2l: error: disk full: no space left writing {run}/eps/"
    ), lines
    _resumed_equals_the_reference(run, ref, capsys)


@pytest.mark.slow  # (writes slowed to 0.3 s each, so the race is met: ~30 s)
def test_a_read_into_a_slot_waits_for_its_write_back(monkeypatch: Any) -> None:
    """Item 4: an L2L-p rollback under bf16 CMP (global clipping crosses its limit at the last layers, after
    speculative updates): the layer's current version becomes the pre-update slot again while the update's
    write-back may still read the cache slot's buffers (the lo plane, v's tie marks), and the redo reads the
    pre-update state into them. With the writes slowed down, no read into a slot starts before that slot's
    write-back is done, and the weights equal the host tier's."""
    over = ("mode=l2l_p", "optim.max_grad_norm=0.24", "precision=cmp", "precision.dtype=bf16")
    ref = train(tiny_cfg(*over))
    real_write, real_read, real_restore = DiskIo.write, LayerStore.read_state, DiskTier.restore
    early: list[int] = []
    restored: list[int] = []

    def slow_write(self: DiskIo, fd: int, mv: memoryview, offset: int) -> None:
        time.sleep(0.3)
        real_write(self, fd, mv, offset)

    def checked_read(self: LayerStore, fd: int, s: Any, i: int, *args: Any) -> None:
        if s.writing is not None and not s.writing.done():
            early.append(i)
        mom = s.mom  # the update buffer the moments go to: its last write-back (another layer's) is done
        if (
            set(args[1]) & set("mv")
            and mom is not None
            and mom.writing is not None
            and not mom.writing.done()
        ):
            early.append(i)
        real_read(self, fd, s, i, *args)

    def counted_restore(self: DiskTier, st: Any) -> None:
        restored.append(st.index)
        real_restore(self, st)

    monkeypatch.setattr(DiskIo, "write", slow_write)
    monkeypatch.setattr(LayerStore, "read_state", checked_read)
    monkeypatch.setattr(DiskTier, "restore", counted_restore)
    got = train(tiny_cfg(*over, "eps.tier=disk"))
    assert restored  # the scenario: a rollback to the disk slot
    assert early == []
    assert got["losses"] == ref["losses"]
    assert [k for k in ref["weights"] if not torch.equal(got["weights"][k], ref["weights"][k])] == []


@pytest.mark.parametrize("kind", ["EIO", pytest.param("ENOSPC", marks=pytest.mark.slow)])
def test_a_layer_file_that_cannot_be_created_is_one_line_and_nothing_is_committed(
    tmp_path: Path, monkeypatch: Any, capsys: Any, kind: str
) -> None:
    """Creating a layer file (its blocks reserved, its header written) goes through the same fault
    injection as every other write of the tier: the run stops in one line naming the file, before any
    commit record, and a resume says there is nothing to continue."""
    run = tmp_path / "run"
    lines = _faulted(monkeypatch, capsys, run, kind, f"{run}/eps/layer_00002.eps@1")
    assert len(lines) == 1 and f"{run}/eps/layer_00002.eps" in lines[0], lines
    assert not (run / "eps" / "commit.json").exists()
    assert _run(run, f"trainer.resume={run}") != "ok"
    assert "no usable checkpoint" in capsys.readouterr().err


# ---- issue 37 item 3: checksums on the layer files' slots and the commit record -----------------------

SHORT = [*TINY, "mode=l2l", "eps.tier=disk", "task.num_train=256", "task.num_eval=16"]


def _refused_resume(run: Path, capsys: Any) -> str:
    """Resume ``run`` one step further; it must be refused: the one line it printed."""
    capsys.readouterr()
    status = run_job(compose([*SHORT, "trainer.max_steps=3", f"trainer.resume={run}"]), run)
    lines = capsys.readouterr().err.strip().splitlines()
    assert status != "ok" and len(lines) == 1, (status, lines)
    return lines[0]


@pytest.fixture
def short_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    assert run_job(compose([*SHORT, "trainer.max_steps=2"]), run) == "ok"
    return run


@pytest.mark.parametrize("part", ["weights", "moments"])
def test_a_flipped_bit_in_a_layer_file_is_refused_naming_the_file(
    short_run: Path, capsys: Any, part: str
) -> None:
    """One flipped exponent bit in the committed slot of layer 2's file (its weights, read by the forward, or
    its second moment, read by the backward's update): the resume stops in one line naming the file."""
    record = json.loads((short_run / "eps" / "commit.json").read_text())
    path = short_run / "eps" / "layer_00002.eps"
    head = json.loads(path.read_bytes()[len(MAGIC) : ALIGN].split(b"\n")[0])
    f = LayerFile(path.parent, 2, head["kind"], head["numel"], head["format"] == 2)
    at = f.offset(record["layers"][2]["slot"], f.parts[0] if part == "weights" else "v") + 3
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    line = _refused_resume(short_run, capsys)
    assert str(path) in line and "checksum" in line, line


@pytest.mark.parametrize("fix_checksum", [False, True])
def test_a_slot_changed_in_the_commit_record_is_refused(
    short_run: Path, capsys: Any, fix_checksum: bool
) -> None:
    """Layer 1's slot changed in commit.json (0 <-> 1): refused naming commit.json (its own checksum); with
    that checksum recomputed too, the slot's data does not match the checksums the record names for it."""
    path = short_run / "eps" / "commit.json"
    record = json.loads(path.read_text())
    record["layers"][1]["slot"] = 1 - record["layers"][1]["slot"]
    if fix_checksum:
        record["checksum"] = record_digest(record)
    path.write_text(json.dumps(record))
    line = _refused_resume(short_run, capsys)
    assert ("layer_00001.eps" if fix_checksum else "commit.json") in line and "checksum" in line, line


# ---- acceptance 3: a fault at every write point of a step in turn ------------------------------------

SWEEP_STEP = 3


def _sweep_cases() -> list[Any]:
    """(kind, k): the k-th write of step SWEEP_STEP (layer files, parks, the record; counted from 0), with
    ENOSPC and EIO; the default suite runs one (an I/O error at the step's first write), -m slow the rest."""
    cases = []
    for kind in ("EIO", "ENOSPC"):
        for k in range(12):
            sample = kind == "EIO" and k == 0
            cases.append(pytest.param(kind, k, marks=() if sample else pytest.mark.slow, id=f"{kind}-{k}"))
    return cases


@pytest.mark.parametrize(("kind", "k"), _sweep_cases())
def test_a_fault_at_any_write_of_a_step_resumes_bit_identical(
    tmp_path: Path, ref_root: Path, monkeypatch: Any, capsys: Any, kind: str, k: int
) -> None:
    """A write of step 3 refused (the k-th in the writer's order): the run stops in one line naming the
    file; resumed, it ends bit-identical to the uninterrupted run (never a silent difference)."""
    ref, seq = _reference(str(ref_root))
    step = _steps(seq)[SWEEP_STEP]
    if k >= len(step):
        pytest.skip(f"step {SWEEP_STEP} makes {len(step)} writes")
    run = tmp_path / "run"
    n = step[k]
    lines = _faulted(monkeypatch, capsys, run, kind, f"{run}/eps/@{n}")
    name = Path(seq[n - 1]).name
    assert len(lines) == 1 and f"{run}/eps/" in lines[0] and "Traceback" not in lines[0], lines
    assert lines[0].startswith("l2l: error: " + ("disk full" if kind == "ENOSPC" else "write failed")), lines
    assert name in lines[0] or "layer_" in lines[0], (name, lines)
    _resumed_equals_the_reference(run, ref, capsys)


# ---- kill trials with faults injected at random -------------------------------------------------------

# the trials' two setups: COMMON (every step parks gradients on disk: clipping certain, no RAM for them) and
# speculative updates whose gradients are kept on disk for a redo (kept_grads.eps; the first step rolls back)
KEPT = ("optim.max_grad_norm=0.24", "eps.grad_ram_layers=0")


def _trial(seed: int, run: Path, ref_root: Path) -> dict[str, Any]:
    """Seed ``seed``'s trial: its setup, the fault of its killed run (ENOSPC or EIO at a random write of the
    tier: a layer file's creation, an update, a park, a kept gradient, the commit record), its kill (at the
    k-th write, park or commit of a random kind, or from outside a random time after a random step), and the
    fault of its first resume (none, or another at random)."""
    rng = random.Random(seed)
    extra = KEPT if rng.random() < 0.5 else ()
    _, paths, kinds = _reference_run(str(ref_root), *extra)
    built = kinds.index("commit") + 1  # the writes up to the first commit record (building the state)

    def point(positions: list[int]) -> int:
        """One of ``positions`` (1-based writes), 4 times in 5 one after the state was built."""
        later = [n for n in positions if n > built]
        return rng.choice(later if later and rng.random() < 0.8 else positions)

    crash = {"layer": "write", "park": "park", "kept": "park", "commit": "commit"}
    if rng.random() < 0.5:
        event = rng.choice(sorted({crash[k] for k in kinds if k in crash}))
        mine = [n for n, k in enumerate(kinds, 1) if crash.get(k) == event]
        kill: dict[str, Any] = {"crash": f"{event}:{mine.index(point(mine)) + 1}"}
    else:
        kill = {
            "kill_after_steps": rng.randint(1, STEPS - 1),
            "kill_delay_s": round(rng.uniform(0.0, 0.3), 3),
        }

    def fault() -> str:
        n = point(list(range(1, len(paths) + 1)))
        return f"{rng.choice(['ENOSPC', 'EIO'])}:{run}/eps/@{n}"

    first = fault()
    second = fault() if rng.random() < 0.5 else ""
    return {"run": str(run), "extra": extra, "kill": kill, "fault": first, "resume_fault": second}


def _killed_runs(root: Path, ref_root: Path, seeds: list[int]) -> dict[int, dict[str, Any]]:
    """Each seed's first run, faulted and killed, in processes forked from one helper (tests.forkrun)."""
    trials = {seed: _trial(seed, root / f"trial{seed}", ref_root) for seed in seeds}
    jobs = [
        {
            "overrides": [*COMMON, *t["extra"]],
            "run_dir": str(root / f"trial{seed}"),
            "fault": t["fault"],
            **t["kill"],
        }
        for seed, t in trials.items()
    ]
    (root / "jobs.json").write_text(json.dumps(jobs))
    subprocess.run(
        [sys.executable, "-m", "tests.forkrun", str(root / "jobs.json"), str(root / "results.json")],
        cwd=REPO,
        check=True,
        timeout=900,
    )
    for t, result in zip(trials.values(), json.loads((root / "results.json").read_text())):
        t["result"] = result
    return trials


FAST_SEEDS = [2]  # the default suite's sample (its setup: COMMON, the sweep's reference)
SLOW_SEEDS = [s for s in range(1, 17) if s not in FAST_SEEDS]


@pytest.fixture(scope="module")
def fast_trials(tmp_path_factory: Any, ref_root: Path) -> dict[int, dict[str, Any]]:
    return _killed_runs(tmp_path_factory.mktemp("fault-kills"), ref_root, FAST_SEEDS)


@pytest.fixture(scope="module")
def slow_trials(tmp_path_factory: Any, ref_root: Path) -> dict[int, dict[str, Any]]:
    return _killed_runs(tmp_path_factory.mktemp("fault-kills-slow"), ref_root, SLOW_SEEDS)


def _resumes_to_the_reference(
    trial: dict[str, Any], run: Path, ref_root: Path, monkeypatch: Any, capsys: Any
) -> None:
    """The killed run resumed (with the trial's second fault, if any; then again without): bit-identical to
    the uninterrupted run, or refused in one line naming what was lost. Never a silent difference."""
    result = trial["result"]
    log = (run / "child.log").read_text()[-3000:] if (run / "child.log").exists() else ""
    # killed (before its fault, or torn at the crash point), or stopped by its fault with one line
    assert result["signal"] == 9 or result["exit"] == 1, (trial, result, log)
    if result["exit"] == 1:
        lines = [x for x in log.splitlines() if x.startswith("l2l: error:")]
        assert len(lines) == 1 and f"{run}/eps/" in lines[0] and "Traceback" not in log, (trial, log)
    extra = [*trial["extra"], f"trainer.resume={run}"]
    if not (run / "eps" / "commit.json").exists():  # ended while building the state: nothing committed,
        capsys.readouterr()  # nothing lost; the resume says there is nothing to continue
        status = _run(run, *extra)
        err = capsys.readouterr().err.strip().splitlines()
        assert status == "config" and len(err) == 1 and "no usable checkpoint" in err[0], (status, err)
        return
    if trial["resume_fault"]:
        kind, _, where = trial["resume_fault"].partition(":")
        status, lines = _run_with_fault(monkeypatch, capsys, run, kind, where, *extra)
        assert status in ("ok", "error"), (status, lines)
        if status == "error":
            assert len(lines) == 1 and f"{run}/eps/" in lines[0], lines
    capsys.readouterr()
    status = _run(run, *extra)
    err = capsys.readouterr().err.strip().splitlines()
    if status != "ok":  # refused: one line, naming the file whose state was lost
        assert len(err) == 1 and f"{run}/eps/" in err[0] and "Traceback" not in err[0], err
        return
    ref, _, _ = _reference_run(str(ref_root), *trial["extra"])
    got = load_file(run / "final" / "model.safetensors")
    assert got.keys() == ref.keys()
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == [], trial


@pytest.mark.parametrize("seed", FAST_SEEDS)
def test_a_random_fault_and_a_random_kill_resume_bit_identical(
    fast_trials: Any, seed: int, ref_root: Path, monkeypatch: Any, capsys: Any
) -> None:
    """Seeded kill trials with a fault injected at random: a write of the tier refused (ENOSPC or EIO), a
    SIGKILL at a random write, park or commit or from outside at a random time (whichever comes first ends
    the run), a resume perhaps faulted again, and a last resume: the uninterrupted run's weights bit for
    bit, or a refusal in one line naming what was lost."""
    trial = fast_trials[seed]
    _resumes_to_the_reference(trial, Path(trial["run"]), ref_root, monkeypatch, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_random_faults_and_random_kills_resume_bit_identical(
    slow_trials: Any, seed: int, ref_root: Path, monkeypatch: Any, capsys: Any
) -> None:
    trial = slow_trials[seed]
    _resumes_to_the_reference(trial, Path(trial["run"]), ref_root, monkeypatch, capsys)


REPLAY = (*KEPT, "eps.clip_redo=replay")  # a step that clips, with no gradient kept: it runs twice


def test_a_fault_in_a_replayed_step_resumes_bit_identical(
    tmp_path: Path, ref_root: Path, monkeypatch: Any, capsys: Any
) -> None:
    """``eps.clip_redo=replay``: a step that clips has its updates undone and runs again (its layers written
    twice before its commit record; steps 2 and 3 here). The uninterrupted run equals the one that keeps the
    gradients for the redo bit for bit; a write of the second pass refused stops the run in one line, and
    resumed it ends bit-identical too."""
    ref, seq, kinds = _reference_run(str(ref_root), *REPLAY)
    kept, _, _ = _reference_run(str(ref_root), *KEPT)
    assert [k for k in kept if not torch.equal(ref[k], kept[k])] == []
    writes = [[n for n in step if kinds[n - 1] == "layer"] for step in _steps(seq)[1:]]
    twice = [w for w in writes if len(w) > len({seq[n - 1] for n in w})]
    assert twice, "no step wrote its layers twice (none was replayed)"
    layers = twice[0]
    run = tmp_path / "run"
    lines = _faulted(monkeypatch, capsys, run, "EIO", f"{run}/eps/@{layers[-1]}", *REPLAY)
    assert len(lines) == 1 and lines[0].startswith("l2l: error: write failed"), lines
    status = _run(run, *REPLAY, f"trainer.resume={run}")
    err = capsys.readouterr().err
    assert status == "ok", err[-2000:]
    got = load_file(run / "final" / "model.safetensors")
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == []
