"""Issue 17's peer comparison: the same BERT config, seed and batches trained by plain PyTorch gradient
accumulation (with and without per-layer activation checkpointing), DeepSpeed ZeRO-3 with parameters and
optimizer offloaded to the CPU, FSDP2 with ``CPUOffloadPolicy``, then l2l and l2l_p, one after another,
each in its own process (so its peak RSS is its own). Prints samples/s, the device-tier peak (where it
can be measured: CUDA's allocator; on a CPU only l2l's own meter sees a device tier), peak RSS, and each
as a ratio to l2l.

    pip install .[peers]                                     # DeepSpeed (optional: skipped when missing)
    python benchmarks/compare_peers.py                       # 8 BERT-Large layers, batch 16, ubatch 4,
                                                             # seq 128
    python benchmarks/compare_peers.py --tiny --steps 2      # a smoke run
    python benchmarks/compare_peers.py --peers l2l,fsdp2-offload --layers 4

The offloading peers and l2l recompute each layer in backward; ``pytorch-ga`` keeps every activation (the
fastest and largest), ``pytorch-ga-ckpt`` is l2l's fair yardstick (the same recompute, all on the device).
The first step is a warm-up (DeepSpeed JIT-compiles its CPU Adam the first time: ~45 s, cached after).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

PEERS = ["pytorch-ga", "pytorch-ga-ckpt", "deepspeed-zero3-offload", "fsdp2-offload", "l2l", "l2l_p"]
BERT_LARGE = ["model=bert-large", "task.max_seq_len=128", "task.pad_to_max=true", "trainer.progress=none"]
TINY = ["model=bert-tiny", "task.max_seq_len=32", "task.pad_to_max=true", "trainer.progress=none"]


# ---- one peer, in this process ---------------------------------------------------------------------------


class Bert(nn.Module):
    """The l2l model (same layers, same seeded init) as one plain module: batch tensors in, loss out;
    ``ckpt``: each block's activations are recomputed in backward (torch.utils.checkpoint)."""

    def __init__(self, spec: Any, seed: int, ckpt: bool):
        from l2l_cli.models import LayeredModel

        super().__init__()
        self.model, self.ckpt = LayeredModel(spec, seed=seed), ckpt

    def forward(self, input_ids, token_type_ids, attention_mask, labels):  # type: ignore[no-untyped-def]
        from torch.utils.checkpoint import checkpoint

        from l2l_cli.data.batches import Batch

        spec, m = self.model.spec, self.model
        b = Batch(input_ids, token_type_ids, attention_mask, labels)
        x = spec.run_layer(m.pre, 0, None, b, None)
        side = spec.side_inputs(b, x.dtype)
        for i, block in enumerate(m.blocks, start=1):
            if self.ckpt:
                x = checkpoint(spec.run_layer, block, i, x, b, side, use_reentrant=False)
            else:
                x = spec.run_layer(block, i, x, b, side)
        return spec.run_head(m.post, x, b)[0]


def _dist_env() -> None:
    """A one-process group (DeepSpeed and FSDP2 need one) on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )


def run_peer(
    name: str, overrides: list[str], steps: int, device: str, mark: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """One peer's ``steps`` steps; ``mark``: called right before and after each step (its values come back
    as ``marks``, one (before, after) pair per step: e.g. recompute.py's CPU load per step)."""
    from l2l_cli.compose import compose
    from l2l_cli.data.batches import TrainStream
    from l2l_cli.data.synthetic import synthetic
    from l2l_cli.models import make_spec

    cfg = compose([*overrides, f"trainer.max_steps={steps}"])
    data = synthetic(cfg.batch.size * (steps + 1), cfg.task.max_seq_len, cfg.model.vocab_size, seed=1)
    batches = TrainStream(
        data, cfg.batch.size, seed=cfg.trainer.seed, pad_to_max=cfg.task.max_seq_len
    ).batches()
    n_ub = cfg.batch.size // cfg.batch.ubatch_size
    if name in ("l2l", "l2l_p"):
        return _run_l2l(name, cfg, data, batches, steps, device, mark)
    dev = torch.device(device)
    torch.manual_seed(cfg.trainer.seed)
    model = Bert(make_spec(cfg.model, 2), cfg.trainer.seed, ckpt=name != "pytorch-ga").to(dev).train()
    o = cfg.optim
    if name == "deepspeed-zero3-offload":
        import deepspeed

        _dist_env()
        deepspeed.init_distributed(dist_backend="nccl" if dev.type == "cuda" else "gloo")
        ds_cfg = {
            "train_micro_batch_size_per_gpu": cfg.batch.ubatch_size,
            "gradient_accumulation_steps": n_ub,
            "gradient_clipping": o.max_grad_norm,
            "optimizer": {
                "type": "AdamW",
                "params": {
                    "lr": o.lr,
                    "betas": [o.beta1, o.beta2],
                    "eps": o.eps,
                    "weight_decay": o.weight_decay,
                },
            },
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "cpu"},
                "offload_optimizer": {"device": "cpu"},
            },
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)

        def step(mb: Any) -> float:
            loss = 0.0
            for ub in mb.split(n_ub):
                u = ub.to(dev)
                lu = engine(u.input_ids, u.token_type_ids, u.attention_mask, u.labels)
                engine.backward(lu)
                engine.step()  # DeepSpeed counts micro-batches: it updates at the accumulation boundary
                loss += float(lu) / n_ub
            return loss

    else:
        if name == "fsdp2-offload":
            import torch.distributed as dist
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

            _dist_env()
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
            policy = CPUOffloadPolicy(pin_memory=dev.type == "cuda")  # pinning needs an accelerator
            for block in model.model.blocks:
                fully_shard(block, offload_policy=policy)
            fully_shard(model, offload_policy=policy)
        fused = (
            name != "fsdp2-offload"
        )  # torch's fused AdamW; FSDP2's CPU-offloaded DTensors take the default
        opt = torch.optim.AdamW(
            model.parameters(),
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=fused or None,
        )

        def step(mb: Any) -> float:
            loss = 0.0
            for ub in mb.split(n_ub):
                u = ub.to(dev)
                lu = model(u.input_ids, u.token_type_ids, u.attention_mask, u.labels)
                (lu / n_ub).backward()
                loss += float(lu) / n_ub
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss

    times, losses, marks = [], [], []
    for _ in range(steps):
        mb = next(batches)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        m0 = mark() if mark else None
        t0 = time.perf_counter()
        losses.append(step(mb))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        marks.append((m0, mark() if mark else None))
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    return _result(cfg.batch.size, times, losses, peak, marks if mark else None)


def _run_l2l(
    name: str, cfg: Any, data: Any, batches: Any, steps: int, device: str, mark: Callable[[], Any] | None
) -> dict[str, Any]:
    from l2l_cli.data.tasks import TASKS, TaskData
    from l2l_cli.session import build

    cfg.mode.name, cfg.device.name = name, device
    times, losses, marks = [], [], []
    with build(cfg, data=TaskData(TASKS["synthetic"], data, data, "synthetic")) as s:
        runner = s.runner
        assert runner is not None
        for _ in range(steps):
            mb = next(batches)
            m0 = mark() if mark else None
            t0 = time.perf_counter()
            losses.append(runner.step(mb).loss)
            times.append(time.perf_counter() - t0)
            marks.append((m0, mark() if mark else None))
        peak = runner.acc.meter.peak_bytes or None
    return _result(cfg.batch.size, times, losses, peak, marks if mark else None)


def _result(
    batch: int, times: list[float], losses: list[float], peak: int | None, marks: list[Any] | None = None
) -> dict[str, Any]:
    steady = times[1:] or times
    return {
        "samples_per_s": batch * len(steady) / sum(steady),
        "device_peak_bytes": peak,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "losses": losses,
        "step_times_s": times,
        **({"marks": marks} if marks is not None else {}),
    }


# ---- the table -----------------------------------------------------------------------------------------


def missing(name: str) -> str | None:
    """Why a peer cannot run here (None: it can)."""
    import importlib.util

    if name == "deepspeed-zero3-offload" and importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed (pip install .[peers])"
    if name == "fsdp2-offload":
        try:
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: F401
        except ImportError:
            return f"torch {torch.__version__} has no FSDP2 (torch.distributed.fsdp.fully_shard)"
    return None


def fmt_bytes(n: int | None) -> str:
    return "-" if not n else f"{n / 2**30:.2f} GiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of: {', '.join(PEERS)}")
    ap.add_argument("--steps", type=int, default=4, help="steps per peer (the first is a warm-up)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ubatch", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="bert-tiny widths: a smoke run")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--peer", help=argparse.SUPPRESS)  # internal: run one peer, write --out
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    overrides = [
        *(TINY if args.tiny else BERT_LARGE),
        f"model.num_layers={args.layers}",
        f"batch.size={args.batch}",
        f"batch.ubatch_size={args.ubatch}",
        "model.dropout=0.0",  # no dropout: every peer computes the same losses
        "optim.schedule=constant",  # the peers' optimizers run at a constant rate
        "optim.warmup_steps=0",
    ]
    if args.peer:
        Path(args.out).write_text(json.dumps(run_peer(args.peer, overrides, args.steps, args.device)))
        return 0
    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        print(
            f"compare_peers: unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)}", file=sys.stderr
        )
        return 2
    print(
        f"{args.layers} layers, batch {args.batch}, ubatch {args.ubatch}, fp32, device {args.device}, "
        f"{args.steps} steps each (the first a warm-up), {torch.get_num_threads()} threads",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    for name in peers:
        why = missing(name)
        if why:
            print(f"compare_peers: skipping {name}: {why}", flush=True)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            cmd = [
                sys.executable,
                __file__,
                "--peer",
                name,
                "--out",
                str(out),
                "--steps",
                str(args.steps),
                "--layers",
                str(args.layers),
                "--batch",
                str(args.batch),
                "--ubatch",
                str(args.ubatch),
                "--device",
                args.device,
                *(["--tiny"] if args.tiny else []),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0 or not out.is_file():
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                print(f"compare_peers: {name} failed (exit {proc.returncode}): {tail[0]}", flush=True)
                continue
            results[name] = json.loads(out.read_text())
            r = results[name]
            print(
                f"  {name}: {r['samples_per_s']:.3f} samples/s, losses {[round(x, 4) for x in r['losses']]}",
                flush=True,
            )
    ref = results.get("l2l")
    print(
        f"\n{'peer':26s} {'samples/s':>10s} {'x l2l':>6s} {'device peak':>12s} {'x l2l':>6s} "
        f"{'peak RSS':>10s} {'x l2l':>6s}"
    )
    for name, r in results.items():

        def ratio(key: str, r: dict[str, Any] = r) -> str:
            a, b = r.get(key), (ref or {}).get(key)
            return f"{a / b:6.2f}" if a and b else f"{'-':>6s}"

        print(
            f"{name:26s} {r['samples_per_s']:10.3f} {ratio('samples_per_s')} "
            f"{fmt_bytes(r['device_peak_bytes']):>12s} "
            f"{ratio('device_peak_bytes')} {fmt_bytes(r['peak_rss_bytes']):>10s} {ratio('peak_rss_bytes')}"
        )
    if args.device == "cpu":
        print(
            "(on a CPU the device tier is the host: only l2l's own meter reports one; peak RSS is each "
            "process')"
        )
    if ref:  # the same weights, batches and no dropout: the same first loss, whoever trains it
        first = ref["losses"][0]
        off = [n for n, r in results.items() if abs(r["losses"][0] - first) > 1e-3 * abs(first)]
        print(
            "first-step losses agree with l2l's" if not off else f"first-step losses differ: {', '.join(off)}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
