"""What CUDA and NCCL would refuse, caught on the CPU (issue 35).

On a CPU every tensor is on one device and gloo takes anything: these tests make the difference visible.
``tests/strict_dist.py`` declares each process group's backend and refuses a host tensor on an NCCL group (and
a device tensor on gloo); ``FakeTensorMode`` makes tensors that say ``device="cuda"`` on a machine without
one, to check where optimizer state lands.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.strict_dist import DEVICE, StrictDistError, strict
from tests.util import recording_p2p, tiny_cfg

# ---- 1: the trainer's per-step collective ------------------------------------------------------------


def test_the_step_collective_and_the_memory_gather_run_on_gloo_beside_an_nccl_default_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dist.backend=auto`` on CUDA makes the default group NCCL; the loss and stop flag each step are a
    host tensor, which NCCL refuses: they go over a gloo group of their own."""
    from l2l_cli.engine.dist import from_env

    with strict(pretend_nccl=True) as shim:
        dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", world_size=1, rank=0)
        try:
            monkeypatch.setenv("WORLD_SIZE", "2")  # a rank of two, alone in its group: the calls are real
            monkeypatch.setenv("RANK", "0")
            ctx = from_env(tiny_cfg())
            assert ctx.backend == "nccl"
            _, stop = ctx.mean_and_any(3.0, 0)
            assert stop is False
            assert ctx.gather({"rank": 0})[0] == {"rank": 0}
            # the shim refuses what NCCL would: a host tensor on the default group
            with pytest.raises(StrictDistError, match=r"host tensor .* declared nccl"):
                dist.all_reduce(torch.zeros(2))
            dist.all_reduce(torch.zeros(2, device=DEVICE))  # a device tensor is fine there
        finally:
            dist.destroy_process_group()
    assert shim.counts["gloo all_reduce host"] == 1 and shim.counts["nccl all_reduce device"] == 1


# ---- 2, 3: AdamW's step on the parameters' device ----------------------------------------------------


def test_flat_adamw_state_lives_on_the_parameters_device() -> None:
    """Fused AdamW refuses a step on another device than its parameter: a pipeline stage's optimizer
    (``bind_flat``) keeps every state tensor on the stage's device."""
    from l2l_cli.engine.optim import OptimSettings, bind_flat

    o = OptimSettings.from_cfg(tiny_cfg().optim)
    with FakeTensorMode(allow_non_fake_inputs=True):
        w, g, m, v = (torch.zeros(8, device="cuda") for _ in range(4))
        runs = [
            (
                name,
                w.narrow(0, a, b - a),
                g.narrow(0, a, b - a),
                {"exp_avg": m.narrow(0, a, b - a), "exp_avg_sq": v.narrow(0, a, b - a)},
            )
            for name, a, b in (("decay", 0, 6), ("bias", 6, 8))
        ]
        opt = bind_flat(runs, o)
        devices = {(k, t.device.type) for st in opt.state.values() for k, t in st.items()}
    assert devices == {("step", "cuda"), ("exp_avg", "cuda"), ("exp_avg_sq", "cuda")}
    # on the CPU nothing changes: a float32 zero on the CPU, as before
    state = {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}
    opt = bind_flat([("decay", torch.zeros(4), torch.zeros(4), state)], o)
    step = next(iter(opt.state.values()))["step"]
    assert step.device.type == "cpu" and step.dtype == torch.float32 and float(step) == 0.0


def test_resumed_adamw_state_lives_on_the_parameters_device(tmp_path: Path) -> None:
    """A baseline checkpoint's ``step`` is a host tensor; resumed into fused AdamW on CUDA parameters it
    moves to their device (as torch's own ``load_state_dict`` does)."""
    from l2l_cli.checkpoint import verify
    from l2l_cli.modes.base import DeviceResident
    from l2l_cli.session import build
    from tests.util import tiny_data

    cfg = tiny_cfg("mode=baseline_ag")
    with build(cfg, tmp_path, data=tiny_data(cfg)) as s:
        assert s.runner is not None and s.stream is not None and s.trainer is not None
        s.runner.step(next(s.stream.batches()))
        s.trainer.save()
        shapes = {name: tuple(p.shape) for name, p in s.runner.model.hf_state_dict().items()}  # type: ignore[attr-defined]
    ckpt = tmp_path / "checkpoints" / "step_1"
    manifest = verify(ckpt)
    # parameters on a device other than the host: ``meta`` (a fake CUDA tensor cannot take a copy from the
    # host on a build without CUDA); fused, as AdamW is on CUDA (its constructor refuses meta)
    named = {name: nn.Parameter(torch.zeros(shape, device="meta")) for name, shape in shapes.items()}
    opt = torch.optim.AdamW(list(named.values()))
    opt.param_groups[0]["fused"] = True
    runner = SimpleNamespace(model=SimpleNamespace(hf_state_dict=lambda **_: named), optimizer=opt)
    DeviceResident.load_state(runner, ckpt, manifest)  # type: ignore[arg-type]
    assert len(opt.state) == len(named)
    where = {(k, t.device.type) for st in opt.state.values() for k, t in st.items()}
    assert where == {("step", "meta"), ("exp_avg", "meta"), ("exp_avg_sq", "meta")}


# ---- 4: the last pipeline stage's evaluation output ---------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_the_last_stage_declares_the_shape_its_evaluation_returns(
    monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """The evaluation schedule's last stage declares its output before running (torch up to 2.12 checks
    it): a decoder's head returns rows x sequence x vocabulary, a classifier's rows x labels."""
    from l2l_cli.models import make_spec
    from l2l_cli.parallel.pipeline import runner as pipeline_runner
    from l2l_cli.parallel.pipeline.stage import Timeline

    spec = make_spec(tiny_cfg(*(LLAMA if family == "llama" else [])).model, 2)
    declared: list[tuple[int, ...]] = []
    monkeypatch.setattr(
        pipeline_runner, "TimedStage", lambda *a, **k: declared.append(tuple(k["output_args"].shape))
    )
    monkeypatch.setattr(pipeline_runner, "ScheduleLoopedBFS", lambda *a, **k: None)
    fake = SimpleNamespace(
        spec=spec,
        plan=SimpleNamespace(num_stages=2),
        acc=SimpleNamespace(device=torch.device("cpu")),
        pp_group=None,
        dist=SimpleNamespace(backend="gloo"),
        _grads_ready=None,
        _loss=None,
    )
    fake._meta = lambda shape, dtype, grad: pipeline_runner.PipelineRunner._meta(fake, shape, dtype, grad)
    rows, seq = 3, 5
    pipeline_runner.PipelineRunner._build(fake, {1: nn.Identity()}, rows, seq, False, Timeline(), None)  # type: ignore[arg-type]
    head = spec.build_layer(spec.num_layers + 1, seed=0).eval()
    with torch.no_grad():
        logits = spec.head_logits(head, torch.randn(rows, seq, spec.hidden_size))
    assert declared == [tuple(logits.shape)]


# ---- 5: the exchange probe of hardware=measure -------------------------------------------------------


def test_the_exchange_probe_posts_its_send_and_recv_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """With two ranks each rank sends to and receives from the same peer: posted one after the other on
    NCCL (one stream per peer pair, in order), both ranks' sends wait for recvs queued behind them once a
    message outgrows NCCL's buffer. The probe posts each exchange as one ``batch_isend_irecv``."""
    from l2l_cli.parallel.pipeline import calibrate

    posted: list[tuple[str, ...]] = []
    monkeypatch.setattr(calibrate, "dist", recording_p2p(posted, request_per_op=True))
    calibrate.time_exchange(None, None, torch.device("cpu"), (1, 1), nbytes=1 << 20, repeats=3)
    assert posted == [("isend", "irecv")] * 4  # one warm-up and three timed, each exchange one batch


# ---- 6: selective recompute's saved bytes ------------------------------------------------------------


def test_selective_bytes_count_every_matmul_output_even_where_an_address_is_reused() -> None:
    """The outputs a selective checkpoint keeps are counted once each, not by address: an allocator hands
    a freed output's block to the next one (the caching allocator on CUDA does so on purpose)."""
    from l2l_cli.engine.recompute import measure_block

    w = torch.randn(64, 64) / 8
    n = 6

    def run(x: torch.Tensor) -> torch.Tensor:
        for _ in range(n):
            x = torch.relu(x @ w)  # the matmul's output freed once relu has read it (no graph)
        return x

    x = torch.randn(16, 64)
    b = measure_block(run, x, [w])
    out = 16 * 64 * 4
    assert b.full == out and b.selective == out + n * out
    assert b.none >= b.selective  # autograd keeps every matmul output and more


# ---- the product on two ranks under the strict shim: every group as on two GPUs -------------------------

STRICT = [
    "trainer.max_steps=2",
    "trainer.save_every=2",
    "task.num_train=64",
    "task.num_eval=8",
    "trainer.progress=none",
    "dist.nproc=2",
]
LLAMA = [
    "model=llama-tiny",
    "task=lm",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.intermediate_size=64",
    "model.dropout=0.0",
    "task.max_seq_len=16",
    "task.max_eval_samples=8",
    "batch.size=4",
    "batch.ubatch_size=2",
    "model.vocab_size=2048",
]
PIPE2 = ["dist.pipeline=2", "model.num_layers=4"]


def strict_train(run: Path, *overrides: str, pretend_nccl: bool = True) -> dict[int, dict[str, int]]:
    """``l2l train`` on two ranks, each the product's own rank entry point under the strict shim (the
    default group and the pipeline's declared NCCL, as ``dist.backend=auto`` picks on CUDA); fails with
    the rank's log where a collective was refused. Returns each rank's counts of checked tensors."""
    from omegaconf import OmegaConf

    from l2l_cli.compose import compose
    from l2l_cli.engine.dist import launch
    from tests.strict_dist import strict_rank_main
    from tests.util import TINY

    run.mkdir(parents=True)
    counts = run.parent / f"{run.name}-counts"
    counts.mkdir()
    cfg = compose([*TINY, *STRICT, *overrides])
    try:
        launch(
            2, strict_rank_main, (OmegaConf.to_yaml(cfg, resolve=True), str(run), pretend_nccl, str(counts))
        )
    except Exception as e:
        logs = "\n".join(f.read_text()[-2500:] for f in sorted(run.glob("train*.log")))
        pytest.fail(f"{run.name}: {e}\n{logs}")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok", summary.get("error")
    return {r: json.loads((counts / f"rank{r}.json").read_text()) for r in (0, 1)}


def _checked(counts: dict[int, dict[str, int]], backend: str, kind: str) -> int:
    return sum(n for c in counts.values() for k, n in c.items() if k.startswith(backend) and k.endswith(kind))


@pytest.mark.slow
def test_a_decoder_on_two_pipeline_stages_trains_evaluates_and_resumes_as_on_two_gpus(tmp_path: Path) -> None:
    """baseline_ag stages of a Llama decoder, ``hardware=measure`` (the exchange and action probes on the
    pipeline's NCCL group), an evaluation (the LM's rows x sequence x vocabulary logits from the last
    stage), a checkpoint, and a resume: no host tensor on an NCCL group, no device tensor on gloo, the
    probe's send and recv posted together, the last stage's output as declared."""
    first = strict_train(tmp_path / "pipe", *LLAMA, *PIPE2, "mode=baseline_ag", "hardware=measure")
    assert _checked(first, "nccl", "device") > 0 and _checked(first, "gloo", "host") > 0
    assert json.loads((tmp_path / "pipe" / "summary.json").read_text())["eval"]["loss"] > 0
    resumed = strict_train(
        tmp_path / "resumed",
        *LLAMA,
        *PIPE2,
        "mode=baseline_ag",
        "trainer.max_steps=3",
        f"trainer.resume={tmp_path / 'pipe'}",
    )
    assert _checked(resumed, "nccl", "device") > 0
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["resumed_from"]["step"] == 2


def test_l2l_data_parallel_sums_each_layer_on_the_device_group(tmp_path: Path) -> None:
    """Issue 50: 2-rank L2L-p data parallel (CMP) sums each layer's gradient on the device, over the
    default group declared NCCL, in the device's half type, before it leaves the device; gloo keeps only
    host scalars (the trainer's loss and stop flag, a few numbers a step): no layer's gradient on it."""
    counts = strict_train(tmp_path / "dp", "mode=l2l_p", "precision=cmp", "trainer.save_every=0")
    params = json.loads((tmp_path / "dp" / "summary.json").read_text())["eps"]["trained_params"]
    for c in counts.values():
        # every layer's gradient, each step, on the NCCL group: all trained parameters, twice
        assert c.get("nccl all_reduce device elements", 0) >= 2 * params
        host = sum(n for k, n in c.items() if k.startswith("gloo") and k.endswith("host elements"))
        assert host < 1000, f"gloo moved {host} host elements: a layer's gradient went over it"


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        ["mode=baseline_ag"],  # data parallel: DDP on the NCCL default group, the trainer's host collectives
        ["mode=l2l"],  # data parallel: each layer's gradient summed on the device (NCCL), scalars on gloo
        ["mode=l2l", *PIPE2],  # L2L stages: hidden states on NCCL, the loss and norms on gloo
    ],
    ids=["dp-baseline_ag", "dp-l2l", "pipeline-l2l"],
)
def test_two_ranks_train_and_resume_as_on_two_gpus(tmp_path: Path, case: list[str]) -> None:
    """Acceptance 2: 2-rank data parallel and the 2-rank pipeline with L2L stages (baseline_ag stages: the
    decoder test above), each trained to a checkpoint and resumed, every collective on a group whose
    declared backend takes its tensors."""
    first = strict_train(tmp_path / "first", *case)
    resumed = strict_train(
        tmp_path / "resumed", *case, "trainer.max_steps=3", f"trainer.resume={tmp_path / 'first'}"
    )
    for counts in (first, resumed):
        assert _checked(counts, "gloo", "host") > 0  # the trainer's loss and stop flag, at least
    if "dist.pipeline=2" in case:
        assert _checked(first, "nccl", "device") > 0
    assert json.loads((tmp_path / "resumed" / "summary.json").read_text())["resumed_from"]["step"] == 2


# ---- the GPU lane: scripts/gpu_check.sh -------------------------------------------------------------------


def test_gpu_check_without_a_gpu_exits_0_saying_so(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from tests.util import REPO

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: gpu_check.sh would run every case")
    out = tmp_path / "gpu_check.json"
    # the three command lines at once (each pays its imports; what they check is what they print)
    argvs = [[str(out)], ["--dry-run"], ["--dry-run", "--only", "70b"]]
    procs = [
        subprocess.Popen(
            ["bash", "scripts/gpu_check.sh", *argv],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHON": sys.executable},
        )
        for argv in argvs
    ]
    (none, none_err), (dry, dry_err), (only, only_err) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [0, 0, 0], (none_err, dry_err, only_err)
    assert none.strip().splitlines() == [
        f"gpu_check: no CUDA device (torch {torch.__version__}): nothing to check"
    ]
    assert json.loads(out.read_text())["cuda"] is False
    lines = dry.strip().splitlines()
    product = [ln for ln in lines if ": l2l train " in ln]
    scale = [json.loads(ln)["case"] for ln in lines if ln.startswith("{")]
    assert len(product) == len(_gpu_check().cases())  # type: ignore[attr-defined]
    assert scale == ["scale-8b-l2l_p", "scale-8b-fsdp2-offload", "scale-70b-qlora-nf4"]  # issue 51's
    assert [json.loads(ln)["case"] for ln in only.splitlines() if ln.startswith("{")] == [
        "scale-70b-qlora-nf4"
    ]
    assert ": l2l train " not in only  # no product case's name holds 70b


def _gpu_check() -> object:
    import sys

    from tests.util import REPO

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


def test_gpu_check_dry_run_lists_the_issues_cases(capsys: pytest.CaptureFixture[str]) -> None:
    """The dry run prints each case's ``l2l train`` command line (what the GPU machine runs), and the cases
    cover the issue's list: every mode, fp32/amp/cmp, the disk tier, data parallel, the 2-rank pipeline with
    baseline_ag and L2L stages under hardware=measure, a kill and resume of each kind, generate."""
    import shlex

    gpu_check = _gpu_check()
    assert gpu_check.main(["--dry-run"]) == 0  # type: ignore[attr-defined]
    lines = capsys.readouterr().out.strip().splitlines()
    cases = gpu_check.cases()  # type: ignore[attr-defined]
    assert len(lines) == len(cases) == len({c.name for c in cases})
    for case, ln in zip(cases, lines, strict=True):
        name, cmd = ln.split(": l2l train ", 1)
        assert name.startswith(case.name)
        argv = case.train_argv(Path("/tmp/run"), steps=20)
        assert argv[4 : 4 + len(case.overrides)] == shlex.split(cmd)  # the printed line is what runs
    covered = {(o.split("=")[0], o.split("=")[1]) for c in cases for o in c.overrides if "=" in o}
    assert {("mode", m) for m in ("baseline", "baseline_ag", "l2l", "l2l_p")} <= covered
    assert {("precision", p) for p in ("fp32", "amp", "cmp")} <= covered and ("eps.tier", "disk") in covered
    two = [c for c in cases if c.gpus == 2]
    assert {tuple(o for o in c.overrides if o.startswith(("mode=", "dist.pipeline"))) for c in two} >= {
        ("mode=baseline_ag",),
        ("mode=baseline_ag", "dist.pipeline=2"),
        ("mode=l2l", "dist.pipeline=2"),
    }
    assert all("hardware=measure" in c.overrides for c in two if "dist.pipeline=2" in c.overrides)
    kills = {(c.gpus, "dist.pipeline=2" in c.overrides) for c in cases if c.kill}
    assert kills == {(1, False), (2, False), (2, True)} and any(c.generate for c in cases)


@pytest.mark.slow
def test_every_gpu_check_case_is_a_valid_l2l_train_command_line() -> None:
    """Each case's command line, as it runs (steps and checkpoints included), passes ``l2l train``'s
    preflight: the GPU machine will not meet a config error."""
    from l2l_cli.preflight import preflight

    for case in _gpu_check().cases():  # type: ignore[attr-defined]
        argv = case.train_argv(Path("/tmp/run"), steps=20)
        assert preflight(argv[4:-1], False) == [], case.name


# ---- profile.sync_timers: the compute stream, never the copy streams ------------------------------------


def test_phase_timers_wait_for_the_compute_stream_not_the_copy_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found on the first GPU run: the timers' device-wide synchronize also waited for the copy streams, so
    the prefetch of layer l+1 was charged to the phase that queued it and no copy overlapped compute (the
    exposed transfer with prefetch was 0.96x the one without). They wait for this thread's stream only."""
    from l2l_cli.engine.device import CudaAccelerator
    from tests.util import built

    waited: list[str] = []

    class Stream:
        def synchronize(self) -> None:
            waited.append("compute stream")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **kw: waited.append("device"))
    acc = object.__new__(CudaAccelerator)  # no GPU here: only the method under test
    acc.device = torch.device("cuda", 0)
    acc.wait_compute()
    assert waited == ["compute stream"]
    with built(tiny_cfg("profile.sync_timers=true")) as runner:
        assert runner.timer.sync == runner.acc.wait_compute


# ---- issue 50: only what crosses the link is pinned, to its exact size -------------------------------------


def test_only_link_buffers_are_pinned_and_to_their_exact_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's host state asks for pinned memory only where the device's copies read or write it (the
    send copy and receive buffer under CMP; the master and gradient themselves in FP32), and pinning
    registers exactly the buffer's bytes (torch's pinned allocator would round 50.4 MB up to 64 MB)."""
    from l2l_cli.engine import device
    from l2l_cli.engine.accelerators import make_accelerator
    from l2l_cli.engine.flat import FlatLayout
    from l2l_cli.engine.layer_state import LayerState
    from l2l_cli.engine.optim import OptimSettings
    from tests.util import bert_spec

    calls: list[tuple[str, int, int]] = []
    fake = SimpleNamespace(
        cudaHostRegister=lambda ptr, n, flags: calls.append(("register", ptr, n)) or 0,
        cudaHostUnregister=lambda ptr: calls.append(("unregister", ptr, 0)) or 0,
    )
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    t = torch.empty(12_600_001)
    assert device.pin_exact(t) is t and calls == [("register", t.data_ptr(), t.nbytes)]
    device.unpin(t)
    assert calls[-1] == ("unregister", t.data_ptr(), 0)

    acc = make_accelerator("cpu")
    asked: list[tuple[int, torch.dtype, bool]] = []
    plain = acc.host_empty

    def record(numel: int, dtype: torch.dtype = torch.float32, link: bool = False) -> torch.Tensor:
        asked.append((numel, dtype, link))
        return plain(numel, dtype, link)

    acc.host_empty = record  # type: ignore[method-assign]
    spec = bert_spec(2, 32, 4, 64)
    layout = FlatLayout(spec.new_layer("block", "meta"))
    optim = OptimSettings("adamw", 1e-3, 0.0, 0.9, 0.999, 1e-8, 0.0, None, "constant")
    n = layout.numel
    for send, want in ((torch.float32, {torch.float32: 2}), (torch.bfloat16, {torch.bfloat16: 2})):
        asked.clear()
        st = LayerState(1, "block", layout, acc, send, optim)
        linked = [(k, d) for k, d, link in asked if link]
        assert (
            all(k == n for k, _ in linked)
            and {d: sum(1 for _, x in linked if x == d) for _, d in linked} == want
        )
        asked.clear()
        st.save_undo(acc)  # L2L-p's second state set: its master crosses the link in FP32 only
        assert [link for _, _, link in asked] == [send == torch.float32, False, False]


# ---- issue 51: the multi-GPU paths a reading found, each seen on this CPU --------------------------------


class FakeCuda:
    """``torch.cuda`` on a machine without a GPU: ``count`` devices, the current one ``current``, each with
    an RNG state; an index past the count fails as CUDA's does (``default_generators[i]``: IndexError)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int, current: int = 0):
        self.count, self.current = count, current
        self.states = [torch.full((16,), 10 + i, dtype=torch.uint8) for i in range(8)]
        self.restored: list[tuple[int, list[int]]] = []
        self.set_devices: list[tuple[str, object]] = []

        def index(device: object = None) -> int:
            i = self.current if device is None or device == "cuda" else torch.device("cuda", device).index
            i = self.current if i is None else i
            if i >= self.count:
                raise IndexError("tuple index out of range")
            return i

        def set_rng_state(state: torch.Tensor, device: object = "cuda") -> None:
            self.restored.append((index(device), state.tolist()))

        def set_device(device: object) -> None:
            import threading

            self.set_devices.append((threading.current_thread().name, device))

        cuda = torch.cuda
        for name, fn in {
            "is_available": lambda: True,
            "device_count": lambda: self.count,
            "current_device": lambda: self.current,
            "get_rng_state": lambda device="cuda": self.states[index(device)].clone(),
            "get_rng_state_all": lambda: [self.states[i].clone() for i in range(self.count)],
            "set_rng_state": set_rng_state,
            "set_device": set_device,
        }.items():
            monkeypatch.setattr(cuda, name, fn)
        monkeypatch.setattr(torch.cuda.random, "set_rng_state", set_rng_state)  # set_rng_state_all's own


def test_a_rank_saves_and_restores_its_own_devices_rng_state_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 51 (1): the checkpoint kept every visible GPU's RNG state and restored them all, so a 2-GPU
    run resumed on one GPU (or a narrower CUDA_VISIBLE_DEVICES) raised IndexError; and a rank's own
    device's state was the one it does not draw from. Each rank keeps and restores its own device's."""
    from l2l_cli import checkpoint as ckpt

    gpus = FakeCuda(monkeypatch, count=2, current=1)  # rank 1 of a 2-GPU run: cuda:1 is its device
    state = json.loads(json.dumps(ckpt.rng_state()))  # plain JSON, as state.json holds it
    assert state.get("torch_cuda_device") == gpus.states[1].tolist() and "torch_cuda" not in state
    gpus.count, gpus.current = 1, 0  # resumed on one GPU: cuda:0 is the only device now
    ckpt.set_rng_state(state)
    assert gpus.restored == [(0, gpus.states[1].tolist())]
    # a checkpoint written before (every visible device's states): this device's entry, and no IndexError
    gpus.restored.clear()
    ckpt.set_rng_state({**state, "torch_cuda_device": None, "torch_cuda": [[1] * 16, [2] * 16]})
    assert gpus.restored == [(0, [1] * 16)]


def test_each_rank_resumes_its_own_rng_states(tmp_path: Path) -> None:
    """Issue 51 (1): rank 0 wrote its own generators for every rank; the checkpoint now holds each rank's
    (gathered over the host group as every rank saves) and each rank restores its own."""
    from l2l_cli import checkpoint as ckpt
    from l2l_cli.engine.dist import DistContext
    from l2l_cli.session import build
    from tests.util import tiny_data

    class TwoRanks(DistContext):
        """Rank 0 of two, alone in this process: the other rank's RNG states come from the gather."""

        def gather(self, obj: object) -> list[object]:
            return [obj, other]

        def mean_and_any(self, value: float, flag: int) -> tuple[float, bool]:
            return value, bool(flag)

    torch.manual_seed(1234)
    other = ckpt.rng_state()  # what rank 1's generators hold
    cfg = tiny_cfg("mode=l2l", "model.dropout=0.1", "trainer.max_steps=2")
    with build(cfg, tmp_path, data=tiny_data(cfg)) as s:
        assert s.runner is not None and s.stream is not None and s.trainer is not None
        s.runner.step(next(s.stream.batches()))
        s.trainer.ctx = TwoRanks(rank=0, world=2)
        mine = ckpt.rng_state()
        path = s.trainer.save()
        assert path is not None
        state = json.loads((path / "state.json").read_text())
        assert state["rng"] == mine and state["rng_ranks"] == [mine, other]
        s.trainer.ctx = TwoRanks(rank=1, world=2)  # the same checkpoint resumed as rank 1
        torch.manual_seed(0)
        s.trainer.resume(tmp_path)
        assert torch.equal(torch.get_rng_state(), torch.tensor(other["torch_cpu"], dtype=torch.uint8))


def test_more_ranks_than_gpus_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 51 (2): two ranks on one GPU were mapped ``local_rank % device_count`` without a word (NCCL
    then fails at its first collective, "Duplicate GPU detected"); the config check names ``dist.nproc``
    and the GPU count, and a rank without a GPU of its own (torchrun's count) is refused too."""
    from l2l_cli.config.validate import validate
    from l2l_cli.engine import accelerators
    from l2l_cli.problems import ConfigError

    FakeCuda(monkeypatch, count=1)
    problems = [str(p) for p in validate(tiny_cfg("mode=l2l", "dist.nproc=2"), check_files=False)]
    assert problems == [
        "dist.nproc: 2 ranks on 1 GPU: each rank needs a GPU of its own (CUDA_VISIBLE_DEVICES counts); "
        "allowed: at most 1, or device=cpu"
    ]
    assert validate(tiny_cfg("mode=l2l", "dist.nproc=2", "device=cpu"), check_files=False) == []
    assert validate(tiny_cfg("mode=l2l", "dist.nproc=1"), check_files=False) == []
    made: list[int] = []
    monkeypatch.setattr(
        accelerators, "CudaAccelerator", lambda index, memory_gb=None: made.append(index) or SimpleNamespace()
    )
    accelerators.make_accelerator("cuda", local_rank=0)
    with pytest.raises(ConfigError, match=r"dist.nproc: local rank 1 has no GPU of its own: 1 visible"):
        accelerators.make_accelerator("cuda", local_rank=1)
    assert made == [0]


def test_the_stop_barrier_is_a_host_barrier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 51 (3): the stop path's barrier was the only NCCL operation of an L2L data-parallel run, so
    NCCL's communicator was created there, after rank 0 wrote its checkpoint, on a device NCCL guessed; it
    is a barrier of the gloo host group now."""
    from l2l_cli.engine.dist import from_env

    with strict(pretend_nccl=True) as shim:
        dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", world_size=1, rank=0)
        try:
            monkeypatch.setenv("WORLD_SIZE", "2")  # a rank of two, alone in its group: the calls are real
            monkeypatch.setenv("RANK", "0")
            ctx = from_env(tiny_cfg())
            ctx.barrier()
        finally:
            dist.destroy_process_group()
    assert shim.counts["gloo barrier"] == 1 and shim.counts["nccl barrier"] == 0


def test_nccl_is_initialised_on_the_ranks_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 51 (3): ``init_process_group`` had no ``device_id``, so NCCL's communicator waited for a first
    collective and a device guessed from it; each rank now binds its own GPU (its local rank's) at once.
    gloo (a CPU run) gets none: torch refuses a device id that is not an accelerator's."""
    from l2l_cli.engine import dist as dist_mod

    inits: list[tuple[str, dict]] = []
    monkeypatch.setattr(dist_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: inits.append((backend, kw)))
    monkeypatch.setattr(dist, "new_group", lambda *a, **kw: object())
    monkeypatch.setattr(dist, "get_backend", lambda *a: inits[-1][0])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    ctx = dist_mod.from_env(tiny_cfg())
    assert ctx.backend == "nccl" and inits[-1][1]["device_id"] == torch.device("cuda", 1)
    dist_mod.from_env(tiny_cfg("dist.backend=gloo"))
    assert inits[-1][0] == "gloo" and "device_id" not in inits[-1][1]


def test_calibration_chunks_occupy_the_device_as_real_chunks_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 51 (4): on CUDA the stand-in stages of ``hardware=measure`` busy-waited on the host while the
    timeline timed chunks with CUDA events: each chunk read ~0 s of compute and the busy-wait landed in
    ``pipe_action_us``. A stand-in chunk now spins on the device, so its events time what a real chunk's
    would. Here a fake CUDA clock advances only by work queued on the device."""
    from l2l_cli.engine import device as device_mod
    from l2l_cli.parallel.pipeline.calibrate import StandIn
    from l2l_cli.parallel.pipeline.stage import Timeline

    clock = {"s": 0.0}
    rate = 1.4e9  # the fake GPU's spin cycles per second

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.t = 0.0

        def record(self, stream: object = None) -> None:
            self.t = clock["s"]

        def synchronize(self) -> None:
            return None

        def elapsed_time(self, end: Event) -> float:
            return (end.t - self.t) * 1e3

    def sleep(cycles: int) -> None:  # the spin kernel: device time, no host time
        clock["s"] += cycles / rate

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", sleep)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(device_mod, "_SPIN_CYCLES", {}, raising=False)
    busy_s = 0.02
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():  # (autograd would want a real GPU)
        ids = torch.zeros((1, 1), dtype=torch.long, device="cuda")
        stage = StandIn(True, False, 4, busy_s)
        stage(ids, ids, mask=ids)  # the first chunk also times the spin's rate (calibration's warm-up step)
        timeline = Timeline(cuda=True)
        for _ in range(3):
            t0, ev = timeline.start()
            stage(ids, ids, mask=ids)
            timeline.add("forward", t0, ev, 0)
        times = timeline.pop(0.0, 1.0)
    assert times["chunks"] == 3
    assert times["forward"] == pytest.approx(3 * busy_s, rel=1e-6)  # the device time the chunks took
    # on a CPU the host spins, as a CPU stage computes (the host clock times it): unchanged
    host = Timeline()
    t0, _ = host.start()
    StandIn(True, False, 4, busy_s)(torch.zeros((1, 1), dtype=torch.long), torch.zeros(1), mask=None)  # type: ignore[arg-type]
    host.add("forward", t0)
    assert host.pop(t0, t0 + 1)["forward"] >= busy_s


@pytest.mark.parametrize("layers", [1, 3])
def test_l2l_stage_messages_go_in_batches_per_micro_batch(
    monkeypatch: pytest.MonkeyPatch, layers: int
) -> None:
    """Issue 51 (5): L2L stages posted every receive and send on its own (``isend``/``irecv``): on NCCL two
    ranks' unbatched ops to each other run in the order posted, and a large send waits for a receive queued
    behind the peer's own send, unless both ranks' orders happen to mirror. Each micro-batch's send now
    goes in one ``batch_isend_irecv`` with the stage's next receive (a stage of several layers, which
    sends only after its last, posts its receives one ahead), and each message is its micro-batch's."""
    from l2l_cli.parallel.pipeline import p2p

    posted: list[tuple[str, ...]] = []
    monkeypatch.setattr(p2p, "dist", recording_p2p(posted, request_per_op=False))  # NCCL's
    n, stage = 4, 1
    msgs = p2p.StageMessages(None, torch.device("cpu"), n, rank_of=lambda s: s % 2)
    # a stage of L2L's forward (l2l_stages.forward_pass): each layer runs every micro-batch; the stage's
    # input arrives for its first layer, its output leaves after its last
    recv = msgs.recv((2, 3), stage, n, backward=False)
    for k in range(layers):
        for u in range(n):
            if k == 0:
                x = msgs.arrived(recv[u], torch.float32)
                assert (x == msgs.tag(stage, u, False)).all()  # micro-batch u's own message
            if k == layers - 1:
                msgs.send(torch.zeros(2, 3), stage, u, backward=False)
    msgs.wait_sends()
    if layers == 1:  # the first receive, then each send with the next receive, the last send alone
        assert posted == [("irecv",), ("isend", "irecv"), ("isend", "irecv"), ("isend", "irecv"), ("isend",)]
    else:  # receives one ahead, then the sends
        assert posted == [("irecv",), ("irecv", "irecv"), ("irecv",), *[("isend",)] * n]


def test_the_eps_and_disk_threads_work_for_the_ranks_own_device(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Issue 51 (6): the EPS thread and the disk tier's reader and writer never set the CUDA device, and a
    new thread's is cuda:0 on every rank: a device wait, stream or pinned buffer made there would land on
    another rank's GPU. Each binds the rank's device (``bind_thread``: ``torch.cuda.set_device``) first."""
    import threading

    from l2l_cli.engine.device import Accelerator, CudaAccelerator
    from l2l_cli.engine.eps_worker import EpsWorker
    from tests.util import batches, built

    with monkeypatch.context() as m:
        gpus = FakeCuda(m, count=2, current=0)
        acc = object.__new__(CudaAccelerator)  # rank 1's (no GPU here: only what the thread calls)
        acc.device = torch.device("cuda", 1)
        worker = EpsWorker(acc)
        worker.submit(lambda: None).result()
        worker.pool.shutdown()
    assert [d for name, d in gpus.set_devices if name.startswith("l2l-eps")] == [torch.device("cuda", 1)]
    # every thread of an L2L run on the disk tier binds its device (here the CPU's: nothing to bind)
    bound: set[str] = set()
    monkeypatch.setattr(
        Accelerator, "bind_thread", lambda self: bound.add(threading.current_thread().name), raising=False
    )
    cfg = tiny_cfg("mode=l2l_p", "eps.tier=disk", f"eps.path={tmp_path / 'eps'}")
    with built(cfg) as runner:
        runner.step(next(batches(cfg)))
    assert {"l2l-disk-read", "l2l-disk-write_0", "l2l-eps_0"} <= bound


def test_device_memory_gb_caps_cudas_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    """``device.memory_gb`` (issue 51's 24 GiB budget) on CUDA: the caching allocator is capped at that share
    of the card (``set_per_process_memory_fraction``), so a larger card runs as a smaller one; the free
    memory the runner plans activations with stays under the budget."""
    from l2l_cli.engine import accelerators

    FakeCuda(monkeypatch, count=1)
    caps: list[tuple[float, object]] = []
    allocated = 10 * 2**30
    for name, fn in {
        "get_device_properties": lambda i: SimpleNamespace(total_memory=80 * 2**30),
        "set_per_process_memory_fraction": lambda share, device=None: caps.append((share, device)),
        "mem_get_info": lambda device=None: (60 * 2**30, 80 * 2**30),
        "memory_reserved": lambda device=None: 12 * 2**30,
        "memory_allocated": lambda device=None: allocated,
        "reset_peak_memory_stats": lambda device=None: None,
        "Stream": lambda device=None: object(),
        "get_device_name": lambda device=None: "NVIDIA H100 80GB HBM3",
    }.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    acc = accelerators.make_accelerator("cuda", memory_gb=24)
    assert caps == [(24 / 80, torch.device("cuda", 0))] and acc.budget_bytes == 24 * 2**30
    assert acc.free_bytes() == 14 * 2**30  # the budget less what is allocated (the card has 62 GiB free)
    assert acc.describe() == "cuda:0 (NVIDIA H100 80GB HBM3, 24 GiB of it: device.memory_gb)"
    caps.clear()
    whole = accelerators.make_accelerator("cuda")
    assert caps == [] and whole.budget_bytes is None and whole.free_bytes() == 62 * 2**30
