"""LoRA on a frozen base that never sits whole in RAM: peak anonymous RSS (RssAnon, not page cache) of
``l2l train peft=lora`` on a Llama-7B-shaped checkpoint (random init, written once as safetensors, layer by
layer), with ``peft.base_dtype=nf4 peft.base_source=disk`` at 16 and 32 layers (flat in depth), and with
``peft.base_source=host peft.base_dtype=bf16``; s/step, tokens/s, base bytes read per step, and the disk's
sequential read rate (dd with direct I/O).

``--vs-peft``: LoRA's speed against a plain PEFT loop, in one run: a 56 M-parameter Llama checkpoint (8 layers
x hidden 512, intermediate 1376, 8 heads, vocab 30522) trained for 30 steps of batch 8 x seq 128 (one
micro-batch: ``batch.ubatch_size`` = ``batch.size``, as the PEFT loop takes the whole batch at once), LoRA
r 8 on q_proj/v_proj, FP32, on the bundled corpus' token blocks: first by ``peft.get_peft_model`` and a
plain PyTorch loop (fused AdamW with l2l's default settings, global clipping) in this process, then by
``l2l train`` with ``mode=l2l`` and ``mode=baseline_ag`` (defaults otherwise: ``model.dropout`` unset is the
checkpoint's attention dropout, 0.0, which PEFT's model runs with too), one after another. Every
tokens/s is summary.json's: real tokens over the summed step times of every step but the first. Prints a
table and a JSON line with each tokens/s and its ratio to PEFT's, and the CPU's flags.

    flock /tmp/l2l-heavy.lock python benchmarks/adapters.py --dir /tmp/i38-bench            # 4096 x 32
    python benchmarks/adapters.py --dir /tmp/x --hidden 64 --intermediate 128 --layers 2 4 --vocab 4096
    flock /tmp/l2l-heavy.lock python benchmarks/adapters.py --vs-peft --dir /tmp/vs-peft      # 8 x 512

Run it alone on the machine: the numbers are the machine's, and other processes shift them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from procs import REPO, l2l_polled
from safetensors import safe_open


def write_checkpoint(root: Path, layers: int, hidden: int, inter: int, heads: int, vocab: int) -> Path:
    """A LlamaForCausalLM directory of random weights, one shard per layer listed by
    model.safetensors.index.json. Each shard's values come from a generator seeded by its own name, and is
    written once under ``root/shards-*`` and hard-linked into every depth's directory (a 32-layer
    checkpoint's first 16 layers are the 16-layer one's); one layer's tensors are in RAM at a time."""
    import torch
    from safetensors.torch import save_file

    out = root / f"llama-{layers}x{hidden}x{inter}v{vocab}"
    if (out / "model.safetensors.index.json").is_file():
        return out
    pool = root / f"shards-{hidden}x{inter}x{heads}v{vocab}"
    pool.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(cfg))
    weight_map: dict[str, str] = {}

    def shard(name: str, make: Callable[[Callable[..., torch.Tensor]], dict[str, torch.Tensor]]) -> None:
        src = pool / name
        if not src.is_file():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))

            def rand(*shape: int) -> torch.Tensor:
                return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

            save_file(make(rand), str(src.with_suffix(".tmp")))
            src.with_suffix(".tmp").replace(src)
        (out / name).unlink(missing_ok=True)
        os.link(src, out / name)
        with safe_open(str(src), framework="pt") as f:
            weight_map.update(dict.fromkeys(f.keys(), name))

    def ones() -> torch.Tensor:
        return torch.ones(hidden, dtype=torch.bfloat16)

    def block(i: int) -> Callable[[Callable[..., torch.Tensor]], dict[str, torch.Tensor]]:
        p = f"model.layers.{i}."
        attn = {
            f"{p}self_attn.{k}.weight": (hidden, hidden) for k in ("q_proj", "k_proj", "v_proj", "o_proj")
        }
        mlp = {f"{p}mlp.{k}.weight": (inter, hidden) for k in ("gate_proj", "up_proj")}
        shapes = {**attn, **mlp, f"{p}mlp.down_proj.weight": (hidden, inter)}
        norms = {f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"}
        return lambda rand: {**{k: rand(*s) for k, s in shapes.items()}, **{k: ones() for k in norms}}

    shard("embed.safetensors", lambda rand: {"model.embed_tokens.weight": rand(vocab, hidden)})
    for i in range(layers):
        shard(f"layer_{i:03d}.safetensors", block(i))
    shard(
        "head.safetensors", lambda rand: {"model.norm.weight": ones(), "lm_head.weight": rand(vocab, hidden)}
    )
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def lora_overrides(ckpt: Path, steps: int, seq: int, batch: int, mode: str = "l2l") -> list[str]:
    """The ``l2l train`` overrides of a LoRA run on ``ckpt`` (r 8 on q_proj/v_proj, task=lm on the bundled
    corpus and its tokenizer, one micro-batch of ``batch`` rows)."""
    return [
        f"model.pretrained={ckpt}",
        "task=lm",
        f"mode={mode}",
        "peft=lora",
        "peft.target_modules=[q_proj,v_proj]",
        f"task.max_seq_len={seq}",
        f"batch.size={batch}",
        f"batch.ubatch_size={batch}",
        f"trainer.max_steps={steps}",
        "trainer.progress=none",
        "logger=none",
        "task.max_eval_samples=1",
        f"task.tokenizer={REPO / 'l2l_cli' / 'data' / 'corpus' / 'tokenizer'}",
    ]


def train(
    ckpt: Path, run: Path, steps: int, seq: int, extra: list[str], batch: int = 1, mode: str = "l2l"
) -> dict:
    """One ``l2l train`` run, its RssAnon polled every 0.2 s; returns the summary's numbers and the peak."""
    peak = l2l_polled("train", *lora_overrides(ckpt, steps, seq, batch, mode), f"hydra.run.dir={run}", *extra)
    s = json.loads((run / "summary.json").read_text())
    peft = s.get("sections", s).get("peft", {}) if isinstance(s.get("sections"), dict) else s.get("peft", {})
    return {
        "peak_rss_anon_gib": peak / 2**30,
        "step_time_s": s.get("step_time_s"),
        "tokens_per_s": s.get("tokens_per_s"),
        "peft": peft,
    }


def peft_loop(ckpt: Path, steps: int, seq: int, batch: int) -> dict:
    """A plain PEFT loop, in this process, on what ``l2l train`` would train with ``lora_overrides``: the
    same config composed (the LoRA settings, ``optim.*``, the seed), the same packed token blocks of the
    bundled corpus in the same order (l2l's own ``load_lm`` and ``TrainStream``), the checkpoint loaded by
    ``AutoModelForCausalLM`` in FP32 and wrapped by ``peft.get_peft_model``, torch's fused AdamW, global
    gradient clipping as l2l's default. tokens/s as summary.json computes it: every step but the first
    (the loop's ``step > 1``), real tokens over the sum of the step times, a step's time covering forward,
    backward, clipping, the update and reading the loss (a step's batch is made before its clock starts)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from l2l_cli.compose import compose
    from l2l_cli.data.batches import TrainStream
    from l2l_cli.data.lm import load_lm

    cfg = compose(lora_overrides(ckpt, steps, seq, batch))
    train, _, _, _ = load_lm(cfg.task, cfg.model)
    pad_to_max = cfg.task.max_seq_len if cfg.task.pad_to_max else None
    batches = TrainStream(train, batch, seed=cfg.trainer.seed, pad_to_max=pad_to_max).batches()
    torch.manual_seed(cfg.trainer.seed)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    lora = LoraConfig(
        r=cfg.peft.r,
        lora_alpha=cfg.peft.alpha,
        lora_dropout=cfg.peft.dropout,
        target_modules=list(cfg.peft.target_modules),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    opt = torch.optim.AdamW(
        params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, fused=True
    )
    time_s, tokens, losses = 0.0, 0, []
    for step in range(1, steps + 1):
        b = next(batches)
        t0 = time.perf_counter()
        out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
        dt = time.perf_counter() - t0
        if step > 1 or steps == 1:
            time_s += dt
            tokens += int((b.attention_mask != 0).sum())
    n = steps - 1 if steps > 1 else 1
    return {
        "tokens_per_s": tokens / time_s,
        "step_time_s": time_s / n,
        "final_loss": losses[-1],
        "trainable_params": sum(p.numel() for p in params),
    }


def vs_peft(a: argparse.Namespace) -> dict:
    """``--vs-peft``: the PEFT loop, then ``l2l train`` with mode=l2l and mode=baseline_ag, one after
    another on the same checkpoint, batch, sequence and targets; each one's tokens/s and its ratio to PEFT."""
    ckpt = write_checkpoint(a.dir, a.layers[0], a.hidden, a.intermediate, a.heads, a.vocab)
    rows: dict[str, dict] = {"peft": peft_loop(ckpt, a.steps, a.seq, a.batch)}
    print(json.dumps({"peft": rows["peft"]}), flush=True)
    for mode in a.modes:
        run = a.dir / f"run-vs-peft-{mode}"
        shutil.rmtree(run, ignore_errors=True)  # a new run each time (l2l refuses to write over one)
        r = train(ckpt, run, a.steps, a.seq, [*SAME_MODEL, *a.extra], batch=a.batch, mode=mode)
        s = json.loads((run / "summary.json").read_text())
        rows[mode] = {
            "tokens_per_s": r["tokens_per_s"],
            "step_time_s": r["step_time_s"],
            "final_loss": s.get("final_loss"),
            "peak_rss_anon_gib": r["peak_rss_anon_gib"],
            "time_breakdown_s": s.get("time_breakdown_s"),
        }
        print(json.dumps({mode: rows[mode]}), flush=True)
    ref = rows["peft"]["tokens_per_s"]
    for r in rows.values():
        r["vs_peft"] = r["tokens_per_s"] / ref if r["tokens_per_s"] else None
    shape = f"{a.layers[0]} x {a.hidden} (intermediate {a.intermediate}, {a.heads} heads, vocab {a.vocab})"
    print(f"\nLlama {shape}, LoRA r 8 on q_proj/v_proj, batch {a.batch} x seq {a.seq}, {a.steps} steps")
    print(f"{'run':<14}{'tokens/s':>10}{'s/step':>9}{'vs PEFT':>9}")
    for name, r in rows.items():
        print(f"{name:<14}{r['tokens_per_s']:>10.0f}{r['step_time_s']:>9.3f}{r['vs_peft']:>8.2f}x")
    return {
        "vs_peft": {k: {"tokens_per_s": r["tokens_per_s"], "vs_peft": r["vs_peft"]} for k, r in rows.items()},
        "runs": rows,
        "shape": {
            "layers": a.layers[0],
            "hidden": a.hidden,
            "intermediate": a.intermediate,
            "heads": a.heads,
            "vocab": a.vocab,
            "batch": a.batch,
            "seq": a.seq,
            "steps": a.steps,
        },
        "cpu_flags": cpu_flags(),
    }


def disk_rate(root: Path, gib: float = 1.0) -> float:
    """Sequential read GB/s of ``root``'s disk: dd with O_DIRECT of a file written once."""
    f = root / "dd.bin"
    count = int(gib * 1024)
    subprocess.run(
        ["dd", "if=/dev/urandom", f"of={f}", "bs=1M", f"count={count}", "oflag=direct"],
        check=True,
        capture_output=True,
    )
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", f"if={f}", "of=/dev/null", "bs=4M", "iflag=direct"], check=True, capture_output=True
    )
    dt = time.perf_counter() - t0
    f.unlink()
    return count * 2**20 / dt / 1e9


# --vs-peft: l2l trains the model the PEFT loop does, in FP32 (the checkpoint's attention dropout, 0.0, is
# model.dropout's default for a pretrained Llama)
SAME_MODEL = ["precision=fp32"]
# --vs-peft's checkpoint: a 56 M-parameter Llama (8 x 512, vocab 30522), 30 steps of batch 8 x seq 128
VS_PEFT = {"hidden": 512, "intermediate": 1376, "heads": 8, "vocab": 30522, "layers": [8], "steps": 30}
RSS = {"hidden": 4096, "intermediate": 11008, "heads": 32, "vocab": 32000, "layers": [16, 32], "steps": 3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="checkpoints and runs go here (delete it after)")
    ap.add_argument(
        "--vs-peft",
        action="store_true",
        help="tokens/s of a plain PEFT loop, then of l2l train (--modes), on one small Llama checkpoint",
    )
    ap.add_argument("--hidden", type=int, help="default 4096 (--vs-peft: 512)")
    ap.add_argument("--intermediate", type=int, help="default 11008 (--vs-peft: 1376)")
    ap.add_argument("--heads", type=int, help="default 32 (--vs-peft: 8)")
    ap.add_argument("--vocab", type=int, help="default 32000 (--vs-peft: 30522)")
    ap.add_argument("--layers", type=int, nargs="+", help="default 16 32 (--vs-peft: 8, the first only)")
    ap.add_argument("--steps", type=int, help="default 3 (--vs-peft: 30; the first is a warm-up)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="--vs-peft: rows per step, one micro-batch")
    ap.add_argument("--modes", nargs="+", default=["l2l", "baseline_ag"], help="--vs-peft: l2l's modes")
    ap.add_argument("--extra", nargs="*", default=[], help="--vs-peft: more l2l train overrides")
    ap.add_argument("--skip-host", action="store_true", help="skip the base_source=host bf16 run")
    ap.add_argument("--only-host", action="store_true", help="only the base_source=host bf16 run")
    ap.add_argument(
        "--recompute",
        default="full",
        help="mode.recompute (default full, the papers' algorithm: auto keeps every block's activations "
        "when the device has room, and a CPU device's room is host RAM, so RssAnon would grow with depth)",
    )
    a = ap.parse_args()
    for k, v in (VS_PEFT if a.vs_peft else RSS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.dir.mkdir(parents=True, exist_ok=True)
    if a.vs_peft:
        print(json.dumps(vs_peft(a)))
        return
    results: dict = {"disk_read_gbps": disk_rate(a.dir)}
    for n in [] if a.only_host else a.layers:
        ckpt = write_checkpoint(a.dir, n, a.hidden, a.intermediate, a.heads, a.vocab)
        results[f"nf4_disk_{n}"] = train(
            ckpt,
            a.dir / f"run-nf4-disk-{n}",
            a.steps,
            a.seq,
            ["peft.base_dtype=nf4", "peft.base_source=disk", f"mode.recompute={a.recompute}"],
        )
        print(json.dumps({f"nf4_disk_{n}": results[f"nf4_disk_{n}"]}), flush=True)
    if not a.skip_host:
        n = max(a.layers)
        ckpt = write_checkpoint(a.dir, n, a.hidden, a.intermediate, a.heads, a.vocab)
        results[f"bf16_host_{n}"] = train(
            ckpt,
            a.dir / f"run-bf16-host-{n}",
            a.steps,
            a.seq,
            ["peft.base_dtype=bf16", "peft.base_source=host", f"mode.recompute={a.recompute}"],
        )
    results["cpu_flags"] = cpu_flags()
    print(json.dumps(results, indent=2))


def cpu_flags() -> list[str]:
    """The CPU's vector flags that set its matmul and dequantize speed (/proc/cpuinfo)."""
    want = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "fma", "f16c")
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    return [f for f in want if f in flags]


if __name__ == "__main__":
    main()
