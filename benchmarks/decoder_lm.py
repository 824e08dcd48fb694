"""Issue 15's benchmark: decoder language models on this machine, one run.

1. tokens/s of l2l against baseline_ag on a 12-layer GPT-2-medium-shaped decoder (hidden 1024, 16 heads,
   intermediate 4096, the 50257-token tied head) at sequence 512, FP32 and half precision (CMP for L2L,
   AMP for the baseline), with the device-tier peak of each;
2. the largest Llama-shaped decoder one l2l step (CMP, stash on the host) trains here: a ladder of shapes
   from Llama-3.2-1B's to Llama-2-7B's width, each tried only if its EPS state (FP32 master, gradient, two
   moments, the bf16 send copy: 18 bytes per parameter) fits in the host memory available right now.

Usage (alone on the machine; ~15 min on 2 cores):
    python benchmarks/decoder_lm.py                  # both parts
    python benchmarks/decoder_lm.py --part tokens    # or --part largest
    python benchmarks/decoder_lm.py --tiny           # minutes-free smoke run of the script itself
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from l2l_cli.compose import compose
from l2l_cli.data.batches import TrainStream
from l2l_cli.data.lm import Packed
from l2l_cli.data.tasks import TASKS, TaskData
from l2l_cli.models import make_spec
from l2l_cli.session import build

GPT2_MEDIUM_12 = ["model=gpt2-medium", "model.num_layers=12", "task.max_seq_len=512"]
TOKENS_CONFIGS = {
    "baseline_ag fp32": ["mode=baseline_ag"],
    "l2l fp32": ["mode=l2l"],
    "baseline_ag amp(bf16)": ["mode=baseline_ag", "precision=amp"],
    "l2l cmp(bf16)": ["mode=l2l", "precision=cmp"],
}
# (name, overrides): Llama shapes in increasing size; the 7B width at growing depth
LADDER = [
    ("llama-1b (16 x 2048)", ["model=llama-1b"]),
    ("llama-7b width, 4 layers", ["model=llama-7b", "model.num_layers=4"]),
    ("llama-7b width, 8 layers", ["model=llama-7b", "model.num_layers=8"]),
    ("llama-7b width, 16 layers", ["model=llama-7b", "model.num_layers=16"]),
    ("llama-7b (32 x 4096)", ["model=llama-7b"]),
]
TINY = ["model.hidden_size=64", "model.num_heads=4", "model.intermediate_size=256", "model.vocab_size=2048"]
TINY_KV = ["model.num_kv_heads=2"]  # the Llama shapes: grouped-query attention at 4 heads
EPS_BYTES_PER_PARAM = 18  # w, g, m, v in fp32 + the bf16 send copy (CMP)


def random_blocks(n: int, seq: int, vocab: int) -> TaskData:
    """Random token blocks: throughput does not depend on the text (and nothing needs a tokenizer)."""
    rng = np.random.default_rng(0)
    blocks = Packed(rng.integers(0, vocab, size=(n, seq), dtype=np.int32))
    return TaskData(TASKS["lm"], blocks, blocks.subset(2), "random")


def run(overrides: list[str], steps: int) -> dict[str, Any]:
    """``steps`` steps of ``task=lm`` (the first a warm-up unless it is the only one): median tokens/s,
    step time and the device-tier peak."""
    cfg = compose(["task=lm", "trainer.progress=none", *overrides, "trainer.max_steps=100"])
    data = random_blocks(cfg.batch.size * (steps + 1), cfg.task.max_seq_len, cfg.model.vocab_size)
    stream = TrainStream(data.train, cfg.batch.size, seed=0)
    t0 = time.perf_counter()
    with build(cfg, data=data) as s:
        runner = s.runner
        assert runner is not None and s.model is not None
        build_s = time.perf_counter() - t0
        it = stream.batches()
        reports = [runner.step(next(it)) for _ in range(steps)]
        peak, params = runner.acc.meter.peak_bytes, s.model.total_params
        host = sum(runner.host_parts().values())
    timed = reports[1:] or reports
    tokens = cfg.batch.size * cfg.task.max_seq_len
    return {
        "tokens_per_s": statistics.median(tokens / r.step_time_s for r in timed),
        "step_time_s": statistics.median(r.step_time_s for r in timed),
        "peak": peak,
        "host": host,
        "params": params,
        "build_s": build_s,
        "loss": reports[-1].loss,
    }


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def part_tokens(args: argparse.Namespace) -> None:
    print(
        f"1. tokens/s, 12-layer GPT-2-medium-shaped decoder, seq {args.seq}, batch {args.batch} "
        f"= {args.batch // args.ubatch} x ubatch {args.ubatch}"
    )
    base = [
        *GPT2_MEDIUM_12,
        f"task.max_seq_len={args.seq}",
        f"batch.size={args.batch}",
        f"batch.ubatch_size={args.ubatch}",
    ]
    base += TINY if args.tiny else []
    res = {}
    print(f"   {'config':24s} {'tokens/s':>9s} {'step s':>8s} {'device peak':>12s} {'params':>8s}")
    for name, ov in TOKENS_CONFIGS.items():
        r = res[name] = run([*base, *ov], args.steps)
        print(
            f"   {name:24s} {r['tokens_per_s']:9.1f} {r['step_time_s']:8.2f} {gib(r['peak']):>12s} "
            f"{r['params'] / 1e6:7.0f}M",
            flush=True,
        )
    t = {k: v["tokens_per_s"] for k, v in res.items()}
    print(
        f"   l2l / baseline_ag, fp32: {t['l2l fp32'] / t['baseline_ag fp32']:.2f}x tokens/s; "
        f"cmp l2l / amp baseline_ag: {t['l2l cmp(bf16)'] / t['baseline_ag amp(bf16)']:.2f}x; device peak "
        f"l2l / baseline_ag (fp32): {res['l2l fp32']['peak'] / res['baseline_ag fp32']['peak']:.2f}x"
    )


def part_largest(args: argparse.Namespace) -> None:
    print(
        "2. the largest Llama-shaped decoder one l2l step trains here (cmp, stash on the host, seq "
        f"{args.llama_seq}, "
        "batch 1)"
    )
    best = None
    for name, ov in LADDER:
        overrides = [
            *ov,
            "task=lm",
            "mode=l2l_stash_cpu",
            "precision=cmp",
            "batch.size=1",
            "batch.ubatch_size=1",
            f"task.max_seq_len={args.llama_seq}",
            *(TINY + TINY_KV if args.tiny else []),
        ]
        cfg = compose(overrides)
        params = make_spec(cfg.model, 0).total_params
        need, have = params * EPS_BYTES_PER_PARAM, mem_available()
        if need > 0.85 * have:
            print(
                f"   {name:28s} {params / 1e9:6.2f}B params: needs ~{gib(need)} of host memory, "
                f"{gib(have)} available: not tried"
            )
            continue
        r = run(overrides, steps=1)
        print(
            f"   {name:28s} {r['params'] / 1e9:6.2f}B params: one step in {r['step_time_s']:.1f} s (built in "
            f"{r['build_s']:.0f} s), loss {r['loss']:.2f}, device peak {gib(r['peak'])}, host state "
            f"{gib(r['host'])}",
            flush=True,
        )
        best = (name, r["params"])
    if best:
        print(f"   largest trained: {best[0]} ({best[1] / 1e9:.2f}B parameters)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["tokens", "largest", "both"], default="both")
    ap.add_argument("--steps", type=int, default=3, help="steps per config in part 1 (the first a warm-up)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ubatch", type=int, default=2)
    ap.add_argument("--llama-seq", type=int, default=512)
    ap.add_argument(
        "--tiny", action="store_true", help="shrink every width (checks the script, not the machine)"
    )
    args = ap.parse_args()
    if args.tiny:
        args.seq, args.llama_seq, args.steps = 64, 64, 2
    if args.part in ("tokens", "both"):
        part_tokens(args)
    if args.part in ("largest", "both"):
        part_largest(args)


if __name__ == "__main__":
    main()
