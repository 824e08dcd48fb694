"""Issue 51: the scale l2l exists for, on one GPU under a 24 GiB device budget, against the peer a user would
pick: an 8B full fine-tune (Llama-3-8B's shape, ``l2l_p`` CMP), the same shape on FSDP2 with torch's own
``CPUOffloadPolicy``, and a 70B QLoRA (Llama-2-70B's shape, LoRA on an NF4 base). One JSON line per case
(tokens/s, MFU, device peak, host RssAnon peak, ``l2l plan``'s prediction beside the measurement and its
error), then a table.

    python benchmarks/one_gpu_scale.py                  # every case on this GPU
    python benchmarks/one_gpu_scale.py --only 70b       # the cases whose name contains 70b
    python benchmarks/one_gpu_scale.py --dry-run        # the full-size cases: the planner's predictions and
                                                        # the host RAM each needs (no GPU, nothing trained)
    python benchmarks/one_gpu_scale.py --tiny           # a CPU: scaled-down shapes through the same code

How it measures. Each case runs in a process of its own (its RssAnon polled every 0.2 s; its device peak is
CUDA's allocator's, or the CPU meter's), ``--steps`` optimizer steps, the first a warm-up; the step time is
the median of the rest. The device budget is ``device.memory_gb`` (l2l: CUDA's allocator capped with
``torch.cuda.set_per_process_memory_fraction``, so a larger card runs as a 24 GiB one; FSDP2: the same cap).
The weights are random, generated directly in the form they are held (the family's seeded init replaced by
copies from a random pool, an NF4 base's codes and scales drawn at random instead of encoded): what a step
costs does not depend on the values, and a GPU run's limited time is not spent initialising 70B parameters or
encoding them.

Depth. A case runs fewer layers than the model has when the host's RAM or a GPU run's limited time requires
it, at two depths in the same run: the step time is linear in depth (every block is the same work), so the two
give the per-layer cost and the full depth's step by extrapolation; the line says so (``depths``,
``extrapolated``). MFU is model FLOPs over the GPU's dense bf16 peak: 6·N per token for a full fine-tune (N:
the parameters that multiply, the input embedding excluded), 4·N_base + 6·N_adapters for LoRA (no weight
gradient of the frozen base); recomputation is not counted. On a CPU (``--tiny``) the "peak" is this machine's
measured bf16 matmul rate (no datasheet peak applies), named as such in ``peak_source``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from procs import rss_anon

REPO = Path(__file__).resolve().parent.parent
GiB = 2**30

# dense bf16 peaks (datasheets, without sparsity), TFLOP/s, by a substring of torch's device name
PEAKS = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "GH200": 989.0, "A100": 312.0, "L40S": 362.0,
         "RTX 4090": 165.0, "A10G": 70.0, "L4": 121.0}  # fmt: skip  # a table, read by key
PRESETS = {"H100": "h100-80g", "H200": "h100-80g", "GH200": "h100-80g", "A100": "a100-80g"}


@dataclass(frozen=True)
class Shape:
    """A Llama shape: the config keys of ``model=llama-7b`` it overrides."""

    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    layers: int  # the model's full depth
    rope_theta: float

    def overrides(self, layers: int) -> list[str]:
        return [
            "model=llama-7b",
            f"model.name={self.name}",
            f"model.num_layers={layers}",
            f"model.hidden_size={self.hidden}",
            f"model.intermediate_size={self.intermediate}",
            f"model.num_heads={self.heads}",
            f"model.num_kv_heads={self.kv_heads}",
            f"model.vocab_size={self.vocab}",
            f"model.rope_theta={self.rope_theta}",
            "model.dropout=0.0",
        ]

    def block_params(self) -> int:
        kv = self.hidden // self.heads * self.kv_heads
        return 2 * self.hidden * self.hidden + 2 * self.hidden * kv + 3 * self.hidden * self.intermediate

    def matmul_params(self, layers: int) -> int:
        """Parameters that multiply per token: the blocks' and the LM head (not the embedding lookup)."""
        return layers * self.block_params() + self.vocab * self.hidden


LLAMA3_8B = Shape("llama-3-8b-shape", 4096, 14336, 32, 8, 128256, 32, 500000.0)
LLAMA2_70B = Shape("llama-2-70b-shape", 8192, 28672, 64, 8, 32000, 80, 10000.0)
# --tiny: the same families of shape at a CPU's size (GQA kept, the bundled 2048-token vocabulary)
TINY_8B = Shape("llama-3-8b-shape-tiny", 64, 224, 4, 2, 2048, 8, 500000.0)
TINY_70B = Shape("llama-2-70b-shape-tiny", 96, 336, 6, 2, 2048, 10, 10000.0)


@dataclass(frozen=True)
class Case:
    """One measurement: ``runner`` l2l (``l2l train``'s session, in-process) or fsdp2 (torch's own)."""

    name: str
    runner: str
    shape: Shape
    extra: tuple[str, ...]  # config overrides beyond the shape (l2l's mode, precision, optimizer, peft)
    seq: int
    batch: int
    ubatch: int
    depths: tuple[int, ...]  # layers run (two: the per-layer cost; the full depth alone: no extrapolation)
    budget_gb: float  # device.memory_gb
    lora: bool = False

    def overrides(self, layers: int) -> list[str]:
        return [
            *self.shape.overrides(layers),
            "task=lm",
            f"task.max_seq_len={self.seq}",
            f"batch.size={self.batch}",
            f"batch.ubatch_size={self.ubatch}",
            f"device.memory_gb={self.budget_gb}",
            "trainer.progress=none",
            "logger=none",
            "optim.warmup_steps=0",
            *self.extra,
        ]

    def flops_per_token(self, layers: int) -> float:
        """Model FLOPs per token: 6·N (full fine-tune), 4·N_base + 6·N_adapters (LoRA)."""
        n = self.shape.matmul_params(layers)
        if not self.lora:
            return 6.0 * n
        r = int(next(o.split("=")[1] for o in self.extra if o.startswith("peft.r=")))
        s = self.shape
        kv = s.hidden // s.heads * s.kv_heads
        # all-linear adapters: r x (in + out) per projection of every block
        per_block = r * (4 * s.hidden + 2 * (s.hidden + kv) + 3 * (s.hidden + s.intermediate))
        return 4.0 * n + 6.0 * layers * per_block


# the stash in host memory: the device holds a layer's slots and activations, flat in depth, so the device
# peak at the depths run is the full depth's (a device stash of 32 layers x 32 x 2048 tokens is 16 GiB)
L2L_P = ("mode=l2l_p", "mode.stash=cpu", "precision=cmp", "precision.dtype=bf16", "optim=adamw8bit")
QLORA = (
    "mode=l2l",
    "mode.stash=cpu",  # (a device stash of 80 layers x 8 x 2048 tokens: 20 GiB)
    "precision=cmp",
    "precision.dtype=bf16",
    "peft=lora",
    "peft.r=16",
    "peft.target_modules=all-linear",
    "peft.base_dtype=nf4",
)


def cases(tiny: bool) -> list[Case]:
    """The issue's three cases (``tiny``: at a CPU's size, through the same code)."""
    if tiny:
        s8, s70, seq, budget = TINY_8B, TINY_70B, 64, 0.25
        return [
            Case("scale-8b-l2l_p", "l2l", s8, L2L_P, seq, 8, 2, (2, 4), budget),
            Case("scale-8b-fsdp2-offload", "fsdp2", s8, (), seq, 8, 4, (2, 4), budget),
            Case("scale-70b-qlora-nf4", "l2l", s70, QLORA, seq, 4, 1, (2, 4), budget, lora=True),
        ]
    return [
        # batch 32 of micro-batch 2: the planner's choice at 24 GiB (the host update hidden behind more work).
        # Depths: on an H200 one 8B step took 9 s at 8 layers and one 70B step 8.6 s at 20, and building
        # them is most of a depth's minute or two; 4 and 8 (10 and 20) fit every case in a 10-minute command
        Case("scale-8b-l2l_p", "l2l", LLAMA3_8B, L2L_P, 2048, 32, 2, (4, 8), 24.0),
        Case("scale-8b-fsdp2-offload", "fsdp2", LLAMA3_8B, (), 2048, 32, 4, (4, 8), 24.0),
        Case("scale-70b-qlora-nf4", "l2l", LLAMA2_70B, QLORA, 2048, 8, 1, (10, 20), 24.0, lora=True),
    ]


# ---- the host's RAM ----------------------------------------------------------------------------------


def mem_available() -> int:
    """/proc/meminfo's MemAvailable, bytes (0 where there is none)."""
    text = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").is_file() else ""
    m = re.search(r"MemAvailable:\s+(\d+) kB", text)
    return int(m.group(1)) * 1024 if m else 0


def fsdp2_host_bytes(case: Case, layers: int) -> float:
    """FSDP2 with CPU offload holds on the host the fp32 parameters, their fp32 gradients and AdamW's two
    moments: 16 bytes per parameter (the planner does not model it)."""
    s = case.shape
    return 16.0 * (layers * s.block_params() + 2 * s.vocab * s.hidden + (2 * layers + 1) * s.hidden)


# ---- l2l plan's prediction ------------------------------------------------------------------------------


def plan(case: Case, layers: int, hardware: str) -> dict[str, Any]:
    """``l2l plan --json``'s prediction of the case at ``layers``: its step, tokens/s and memory. A preset is
    planned here; ``hardware=measure`` times this machine in a process of its own (the measurement never
    shares the measured case's GPU, and this process never touches CUDA)."""
    if case.runner != "l2l":
        return {"note": "l2l plan models l2l's modes and the baselines, not FSDP2"}
    args = [*case.overrides(layers), f"hardware={hardware}"]
    if hardware != "measure":
        from l2l_cli.compose import compose
        from l2l_cli.plan.planner import make_plan

        p = make_plan(compose(args))
    else:
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = [sys.executable, "-m", "l2l_cli", "plan", *args, "--json"]
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            return {"error": (r.stderr.strip().splitlines() or ["no output"])[-1][:200]}
        p = json.loads(r.stdout)
    step = p["step_time_s"]["total"]
    return {
        "hardware": hardware,
        "fits": p["fits"],
        "step_s": step,
        "tokens_per_s": case.batch * case.seq / step,
        "device_bytes": p["memory_bytes"]["device"]["total"],
        "host_bytes": p["memory_bytes"]["host"]["total"],
    }


def host_need(case: Case, layers: int, predicted: dict[str, Any]) -> float | None:
    """The host RAM the case needs at ``layers``: the planner's host total (l2l), FSDP2's 16 B/param."""
    if case.runner == "fsdp2":
        return fsdp2_host_bytes(case, layers)
    return predicted.get("host_bytes")


# ---- one depth of one case, in a process of its own -----------------------------------------------------


def fast_weights(lora: bool) -> None:
    """Random weights straight into the form the run holds them: every decoder layer's tensors copied from a
    random pool instead of its seeded init, and an NF4 base's codes and block scales drawn at random instead
    of encoded (its linear weights then never need fp32 values: left unwritten). In this process only."""
    import torch

    from l2l_cli.engine import frozen
    from l2l_cli.models import decoder
    from l2l_cli.models.base import BLOCK

    g = torch.Generator().manual_seed(0)
    pool = torch.randn(1 << 22, generator=g)
    pool_u8 = torch.randint(0, 256, (1 << 22,), dtype=torch.uint8, generator=g)
    pool_i8 = torch.randint(-100, 101, (1 << 20,), dtype=torch.int8, generator=g)

    def tile(out: torch.Tensor, src: torch.Tensor, key: int) -> torch.Tensor:
        flat, n, i, off = out.view(-1), out.numel(), 0, (key * 7919) % src.numel()
        while i < n:
            m = min(src.numel() - off, n - i)
            flat[i : i + m].copy_(src[off : off + m])
            i, off = i + m, 0
        return out

    def init_layer(self: Any, module: Any, index: int, seed: int) -> Any:
        base_block = lora and self.kind(index) == BLOCK
        with torch.no_grad():
            for k, (name, p) in enumerate(module.named_parameters()):
                if ".lora_" in name:  # (the LoRA wrapper initialises its adapters itself)
                    continue
                if p.dim() >= 2:
                    if not base_block:  # an NF4 base's linear weights are drawn as codes below
                        tile(p, pool, index * 1009 + k).mul_(self.init_std)
                elif "norm" in name:
                    p.fill_(1.0)
                else:
                    p.zero_()
        return module

    def random_nf4(numel: int, key: int) -> dict[str, torch.Tensor]:
        unit = frozen.NF4_BLOCK * frozen.NF4_SCALER_BLOCK
        padded = -(-numel // unit) * unit
        blocks = padded // frozen.NF4_BLOCK
        return {
            "data": tile(torch.empty(padded // 2, dtype=torch.uint8), pool_u8, key),
            "scalers": tile(torch.empty(blocks, dtype=torch.int8), pool_i8, key),
            # scale = scaler / factor + mean: 0.025 .. 0.075 per block of 64, weights of std ~0.02
            "factor": torch.full((blocks // frozen.NF4_SCALER_BLOCK,), 4000.0),
            "mean": torch.tensor([0.05]),
            "nf4": torch.tensor(frozen.NF4_CODES),
        }

    new_layer = decoder.DecoderSpec.new_layer

    def new_layer_fast(self: Any, kind: str, device: Any = None) -> Any:
        """Built on the meta device, then given memory: no constructor's init (the pool's instead)."""
        if device is not None and torch.device(device).type == "meta":
            return new_layer(self, kind, device)
        module = new_layer(self, kind, "meta").to_empty(device=device or "cpu")
        self.reset_buffers(module)
        return module

    encode = frozen.encode
    count = iter(range(1 << 30))

    def encode_fast(t: torch.Tensor, base_dtype: str, quantize: bool, out_axis: int = 0) -> Any:
        if base_dtype == "nf4" and quantize:
            return frozen.Frozen("nf4", tuple(t.shape), random_nf4(t.numel(), next(count)))
        return encode(t, base_dtype, quantize, out_axis)

    decoder.DecoderSpec.init_layer = init_layer  # type: ignore[method-assign]
    decoder.DecoderSpec.new_layer = new_layer_fast  # type: ignore[method-assign]
    frozen.encode = encode_fast


def run_l2l(case: Case, layers: int, steps: int) -> dict[str, Any]:
    """``l2l train``'s session for the case (the product's build: validation, data, accelerator under
    ``device.memory_gb``, runner), ``steps`` steps; each step's time, the device peak and budget."""
    import torch

    from l2l_cli.compose import compose
    from l2l_cli.session import build

    fast_weights(case.lora)
    cfg = compose([*case.overrides(layers), f"trainer.max_steps={steps}"])
    t0 = time.perf_counter()
    with build(cfg) as s:
        runner, stream = s.runner, s.stream
        assert runner is not None and stream is not None
        built = time.perf_counter() - t0
        batches = stream.batches()
        times, losses = [], []
        for _ in range(steps):
            mb = next(batches)
            try:
                r = runner.step(mb)
            except Exception as e:
                if runner.acc.is_oom(e):
                    return {"error": f"out of device memory: {str(e).splitlines()[0][:160]}"}
                raise
            times.append(r.step_time_s)
            losses.append(r.loss)
        return {
            "step_times_s": times,
            "losses": losses,
            "build_s": built,
            "device": runner.acc.describe(),
            "device_peak_bytes": runner.acc.meter.peak_bytes,
            "device_budget_bytes": runner.acc.budget_bytes,
            "tokens_per_step": case.batch * case.seq,
            "torch": torch.__version__,
        }


def run_fsdp2(case: Case, layers: int, steps: int) -> dict[str, Any]:
    """The same shape, data and batch on FSDP2 (``fully_shard`` per block and at the root, torch's
    ``CPUOffloadPolicy``: parameters, gradients and AdamW's moments in host memory, the step on the CPU),
    bf16 compute (``MixedPrecisionPolicy``), every block recomputed in backward, as l2l's are; one rank."""
    import socket

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from torch.utils.checkpoint import checkpoint

    from l2l_cli.compose import compose
    from l2l_cli.config.settings import settings
    from l2l_cli.data.batches import TrainStream
    from l2l_cli.data.loading import load_task
    from l2l_cli.models import LayeredModel, make_spec

    fast_weights(False)
    cfg = settings(compose([*case.overrides(layers), f"trainer.max_steps={steps}"]))
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    budget = int(case.budget_gb * GiB)
    if cuda:
        torch.cuda.set_device(dev)
        share = budget / torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, share), dev)
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if cuda else "gloo")
    data = load_task(cfg.task, cfg.model, train_split=True)
    spec = make_spec(cfg.model, data.spec.num_labels)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = LayeredModel(spec, seed=cfg.trainer.seed)

        def forward(self, b: Any) -> torch.Tensor:
            m = self.m
            x = spec.run_layer(m.pre, 0, None, b, None)
            side = spec.side_inputs(b, x.dtype)
            for i, block in enumerate(m.blocks, start=1):
                x = checkpoint(spec.run_layer, block, i, x, b, side, use_reentrant=False)
            return spec.run_head(m.post, x, b)[0]

    t0 = time.perf_counter()
    model = Model().train()
    policy = {
        "offload_policy": CPUOffloadPolicy(pin_memory=cuda),
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }
    for block in model.m.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    built = time.perf_counter() - t0
    stream = TrainStream(data.train, case.batch, seed=cfg.trainer.seed, pad_to_max=case.seq).batches()
    n_ub = case.batch // case.ubatch
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    times, losses = [], []
    for _ in range(steps):
        mb = next(stream)
        t = time.perf_counter()
        loss = 0.0
        try:
            for ub in mb.split(n_ub):
                lu = model(ub.to(dev))
                (lu / n_ub).backward()
                loss += float(lu) / n_ub
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
            opt.step()
            opt.zero_grad()
        except torch.OutOfMemoryError as e:
            return {"error": f"out of device memory: {str(e).splitlines()[0][:160]}"}
        if cuda:
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t)
        losses.append(loss)
    dist.destroy_process_group()
    return {
        "step_times_s": times,
        "losses": losses,
        "build_s": built,
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "device_peak_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
        "device_budget_bytes": budget if cuda else None,
        "tokens_per_step": case.batch * case.seq,
        "torch": torch.__version__,
    }


def child(spec: dict[str, Any]) -> int:
    """``--child``: one depth of one case, its result to ``spec['out']``."""
    case = case_of(spec["case"])
    run = run_l2l if case.runner == "l2l" else run_fsdp2
    out = run(case, spec["layers"], spec["steps"])
    Path(spec["out"]).write_text(json.dumps(out))
    return 0


def case_of(d: dict[str, Any]) -> Case:
    return Case(
        **{**d, "shape": Shape(**d["shape"]), "extra": tuple(d["extra"]), "depths": tuple(d["depths"])}
    )


def measure(case: Case, layers: int, steps: int) -> dict[str, Any]:
    """One depth of ``case`` in a child process, its RssAnon peak polled every 0.2 s."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with tempfile.TemporaryDirectory(prefix="one-gpu-scale-") as tmp:
        out = Path(tmp) / "result.json"
        spec = {"case": asdict(case), "layers": layers, "steps": steps, "out": str(out)}
        cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
        err_path = Path(tmp) / "stderr.txt"  # a file, not a pipe: a chatty child never blocks on it
        with err_path.open("w") as err_file:
            p = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=err_file)
            peak, t0 = 0, time.perf_counter()
            while p.poll() is None:
                peak = max(peak, rss_anon(p.pid))
                time.sleep(0.2)
        if p.returncode != 0 or not out.is_file():
            lines = [ln for ln in err_path.read_text().strip().splitlines() if ln.strip()]
            tail = lines[-1:] or ["no output"]
            return {"error": f"exit {p.returncode}: {tail[0][:200]}", "host_rss_anon_peak_bytes": peak}
        r = json.loads(out.read_text())
    r["host_rss_anon_peak_bytes"] = peak
    r["wall_s"] = round(time.perf_counter() - t0, 1)
    if "step_times_s" in r:
        steady = r["step_times_s"][1:] or r["step_times_s"]
        r["step_s"] = statistics.median(steady)
    return r


# what a case's line keeps of each depth it ran (also printed as each depth ends)
DEPTH_FIELDS = (
    "step_s", "step_times_s", "losses", "device_peak_bytes", "host_rss_anon_peak_bytes", "build_s", "wall_s",
    "error",
)  # fmt: skip  # a list of names, read as one


# ---- the numbers of a case ------------------------------------------------------------------------------


@dataclass
class Machine:
    device: str
    gpus: int
    peak_tflops: float | None
    peak_source: str
    hardware: str  # the l2l plan preset (or measure) its predictions use


def probe(hardware: str | None) -> Machine:
    """The GPU (in a child: this process never touches CUDA), its dense bf16 peak, the planner's preset."""
    code = (
        "import json, torch\n"
        "c = torch.cuda.is_available()\n"
        "n = torch.cuda.device_count() if c else 0\n"
        "print(json.dumps([torch.cuda.get_device_name(0) if c else 'cpu', n]))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    name, gpus = json.loads(r.stdout.strip().splitlines()[-1])
    if not gpus:
        tflops = cpu_bf16_tflops()
        return Machine(
            "cpu",
            0,
            tflops,
            "this CPU's measured bf16 matmul rate (no datasheet peak)",
            hardware or "measure",
        )
    key = next((k for k in PEAKS if k in name), None)
    preset = next((v for k, v in PRESETS.items() if k in name), "measure")
    return Machine(
        name,
        gpus,
        PEAKS[key] if key else None,
        f"dense bf16 datasheet peak ({key})" if key else "unknown GPU: pass --peak-tflops",
        hardware or preset,
    )


def cpu_bf16_tflops() -> float:
    """The best of a few 1024x1024 bf16 matmuls on this CPU, TFLOP/s (a --tiny run's stand-in for a peak)."""
    code = (
        "import time, torch\n"
        "a = torch.randn(1024, 1024, dtype=torch.bfloat16); best = 1e9\n"
        "for _ in range(8):\n"
        "    t = time.perf_counter(); a @ a; best = min(best, time.perf_counter() - t)\n"
        "print(2 * 1024**3 / best / 1e12)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(r.stdout.strip().splitlines()[-1])


def summarize(
    case: Case, runs: dict[int, dict[str, Any]], plans: dict[int, dict[str, Any]], m: Machine
) -> dict:
    """One case's line: per depth what ran, and the case at full depth (extrapolated from two depths)."""
    full = case.shape.layers
    ok = {d: r for d, r in runs.items() if "step_s" in r}
    line: dict[str, Any] = {
        "case": case.name,
        "runner": case.runner,
        "shape": asdict(case.shape),
        "config": case.overrides(full),
        "seq": case.seq,
        "batch": case.batch,
        "ubatch": case.ubatch,
        "device": m.device,
        "depths": {d: {k: r.get(k) for k in DEPTH_FIELDS} | {"plan": plans.get(d)} for d, r in runs.items()},
        "full_layers": full,
    }
    if not ok:
        line["error"] = next((r.get("error") for r in runs.values() if r.get("error")), "nothing ran")
        return line
    depths = sorted(ok)
    tokens = case.batch * case.seq
    if full in ok:
        step, extrapolated, per_layer = ok[full]["step_s"], False, None
    elif len(depths) >= 2:
        a, b = depths[0], depths[-1]
        per_layer = (ok[b]["step_s"] - ok[a]["step_s"]) / (b - a)
        step, extrapolated = ok[b]["step_s"] + (full - b) * per_layer, True
    else:  # one depth below full: its own numbers, no extrapolation
        step, extrapolated, per_layer = ok[depths[-1]]["step_s"], False, None
        full = depths[-1]
    fpt = case.flops_per_token(full)
    tps = tokens / step
    last = ok[depths[-1]]
    line.update(
        tokens_per_s=tps,
        step_s=step,
        extrapolated=extrapolated,
        per_layer_s=per_layer,
        layers_reported=full,
        flops_per_token=fpt,
        mfu=fpt * tps / (m.peak_tflops * 1e12) if m.peak_tflops else None,
        peak_tflops=m.peak_tflops,
        peak_source=m.peak_source,
        device_peak_bytes=max((r.get("device_peak_bytes") or 0) for r in ok.values()) or None,
        device_budget_bytes=last.get("device_budget_bytes"),
        host_rss_anon_peak_bytes=max(r["host_rss_anon_peak_bytes"] for r in ok.values()),
        device_name=last.get("device"),
    )
    if extrapolated:
        a, b = depths[0], depths[-1]
        line["note"] = (
            f"ran {a} and {b} of {case.shape.layers} layers: {ok[a]['step_s'] / a:.3g} and "
            f"{ok[b]['step_s'] / b:.3g} s per layer of step; {per_layer:.3g} s per added layer, extrapolated "
            f"to {case.shape.layers}"
        )
    predicted = plans.get(case.shape.layers if extrapolated else full) or {}
    if "tokens_per_s" in predicted:
        line["plan"] = predicted
        line["plan_error"] = predicted["tokens_per_s"] / tps - 1  # the prediction over the measurement, -1
    elif predicted:
        line["plan"] = predicted
    return line


def row(line: dict[str, Any]) -> str:
    def gib(x: Any) -> str:
        return f"{x / GiB:.1f}" if x else "-"

    if "tokens_per_s" not in line:
        return f"{line['case']:24s} {'FAILED':>10s}  {line.get('error', '')}"
    mfu = f"{100 * line['mfu']:.1f}%" if line.get("mfu") is not None else "-"
    p = line.get("plan") or {}
    pred = f"{p['tokens_per_s']:.0f} ({100 * line['plan_error']:+.0f}%)" if "tokens_per_s" in p else "-"
    depth = f"{line['layers_reported']}{'*' if line['extrapolated'] else ''}"
    return (
        f"{line['case']:24s} {line['tokens_per_s']:10.1f} {mfu:>7s} {gib(line['device_peak_bytes']):>9s} "
        f"{gib(line['host_rss_anon_peak_bytes']):>9s} {depth:>6s}  {pred}"
    )


HEADER = (
    f"{'case':24s} {'tokens/s':>10s} {'MFU':>7s} {'dev GiB':>9s} {'RSS GiB':>9s} {'layers':>6s}  "
    "l2l plan (error)"
)


def dry_run(selected: list[Case], hardware: str) -> list[dict[str, Any]]:
    """The full-size cases: what each runs (the l2l cases: ``l2l train``'s overrides), the planner's
    prediction at the depths it runs and at full depth, and the host RAM each needs; nothing trained, no
    GPU needed."""
    import shlex

    out = []
    for case in selected:
        full = case.shape.layers
        depths = sorted({*case.depths, full})
        plans = {d: plan(case, d, hardware) for d in depths}
        line = {
            "case": case.name,
            "runner": case.runner,
            "command": f"l2l train {shlex.join(case.overrides(full))}"
            if case.runner == "l2l"
            else "torch's FSDP2 + CPUOffloadPolicy (this script) on the same shape, data and batch",
            "depths_run": list(case.depths),
            "full_layers": full,
            "plans": plans,
            "host_need_bytes": {d: host_need(case, d, plans[d]) for d in depths},
            "flops_per_token": case.flops_per_token(full),
        }
        out.append(line)
        print(json.dumps(line), flush=True)
    print(
        f"\n{'case':24s} {'layers':>6s} {'plan tokens/s':>14s} {'plan dev GiB':>13s} {'host GiB needed':>16s}"
    )
    for line in out:
        for d, need in line["host_need_bytes"].items():
            p = line["plans"][d]
            tps = f"{p['tokens_per_s']:.0f}" if "tokens_per_s" in p else "-"
            dev = f"{p['device_bytes'] / GiB:.1f}" if "device_bytes" in p else "-"
            full = " (full)" if d == line["full_layers"] else ""
            print(f"{line['case']:24s} {d:6d} {tps:>14s} {dev:>13s} {(need or 0) / GiB:16.1f}{full}")
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="one_gpu_scale.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="scaled-down shapes (a CPU), the same code")
    ap.add_argument("--dry-run", action="store_true", help="the full-size cases' predictions; run nothing")
    ap.add_argument("--only", action="append", default=[], help="the cases whose name contains this")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per depth, the first a warm-up (3)")
    ap.add_argument("--layers", help="depths to run, e.g. 8,16 (default: each case's own: 4,8; 10,20)")
    ap.add_argument("--hardware", help="l2l plan's hardware preset (default: the GPU's, else measure)")
    ap.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, TFLOP/s (default: by name)")
    ap.add_argument("--json", help="write every case's line to this file too (JSON lines)")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: one depth of one case
    a = ap.parse_args(argv)
    if a.child:
        return child(json.loads(a.child))
    selected = [c for c in cases(a.tiny) if not a.only or any(o in c.name for o in a.only)]
    if not selected:
        print(f"one_gpu_scale: no case matches --only {' '.join(a.only)}", file=sys.stderr)
        return 2
    if a.layers:
        selected = [replace(c, depths=tuple(int(x) for x in a.layers.split(","))) for c in selected]
    if a.dry_run:
        lines = dry_run(selected, a.hardware or "h100-80g")
        if a.json:
            Path(a.json).write_text("".join(json.dumps(ln) + "\n" for ln in lines))
        return 0
    m = probe(a.hardware)
    if a.peak_tflops:
        m = replace(m, peak_tflops=a.peak_tflops, peak_source="--peak-tflops")
    avail = mem_available()
    print(
        f"one_gpu_scale: {m.device} ({m.gpus} GPU), peak {m.peak_tflops} TFLOP/s ({m.peak_source}); "
        f"l2l plan hardware={m.hardware}; {avail / GiB:.0f} GiB of RAM available",
        flush=True,
    )
    lines = []
    for case in selected:
        runs: dict[int, dict[str, Any]] = {}
        plans: dict[int, dict[str, Any]] = {}
        for d in sorted({*case.depths, case.shape.layers}):
            plans[d] = plan(case, d, m.hardware)
        for d in case.depths:
            need = host_need(case, d, plans[d])
            if need and avail and need > 0.9 * avail:
                runs[d] = {
                    "error": f"needs {need / GiB:.0f} GiB of host RAM, {avail / GiB:.0f} GiB available"
                }
                continue
            runs[d] = measure(case, d, a.steps)
            # each depth as it ends (a run cut short by a time limit keeps what it measured)
            print(
                json.dumps({"case": case.name, "layers": d, **{k: runs[d].get(k) for k in DEPTH_FIELDS}}),
                flush=True,
            )
        line = summarize(case, runs, plans, m)
        lines.append(line)
        print(json.dumps(line), flush=True)
    print(f"\n{HEADER}")
    for line in lines:
        print(row(line))
    print("(* extrapolated from two depths; l2l plan: its tokens/s and (prediction / measurement - 1))")
    if a.json:
        Path(a.json).write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    return 1 if any("tokens_per_s" not in ln for ln in lines) else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main(sys.argv[1:]))
