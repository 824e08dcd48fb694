"""LoRA on a frozen base that never sits whole in RAM: peak anonymous RSS (RssAnon, not page cache) of
``l2l train peft=lora`` on a Llama-7B-shaped checkpoint (random init, written once as safetensors, layer by
layer), with ``peft.base_dtype=nf4 peft.base_source=disk`` at 16 and 32 layers (flat in depth), and with
``peft.base_source=host peft.base_dtype=bf16``; s/step, tokens/s, base bytes read per step, and the disk's
sequential read rate (dd with direct I/O).

    flock /tmp/l2l-heavy.lock python benchmarks/adapters.py --dir /tmp/i38-bench            # 4096 x 32
    python benchmarks/adapters.py --dir /tmp/x --hidden 64 --intermediate 128 --layers 2 4 --vocab 4096

Run it alone on the machine: the numbers are the machine's, and other processes shift them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from procs import rss_anon
from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent


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


def train(ckpt: Path, run: Path, steps: int, seq: int, extra: list[str]) -> dict:
    """One ``l2l train`` run, its RssAnon polled every 0.2 s; returns the summary's numbers and the peak."""
    args = [
        sys.executable,
        "-m",
        "l2l_cli",
        "train",
        f"model.pretrained={ckpt}",
        "task=lm",
        "mode=l2l",
        "peft=lora",
        "peft.target_modules=[q_proj,v_proj]",
        f"task.max_seq_len={seq}",
        "batch.size=1",
        "batch.ubatch_size=1",
        f"trainer.max_steps={steps}",
        "trainer.progress=none",
        "logger=none",
        "task.max_eval_samples=1",
        f"task.tokenizer={REPO / 'l2l_cli' / 'data' / 'corpus' / 'tokenizer'}",
        f"hydra.run.dir={run}",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, rss_anon(proc.pid))
        time.sleep(0.2)
    if proc.returncode:
        raise SystemExit(
            f"l2l train failed ({proc.returncode}): {proc.stderr.read()[-2000:] if proc.stderr else ''}"
        )
    s = json.loads((run / "summary.json").read_text())
    peft = s.get("sections", s).get("peft", {}) if isinstance(s.get("sections"), dict) else s.get("peft", {})
    return {
        "peak_rss_anon_gib": peak / 2**30,
        "step_time_s": s.get("step_time_s"),
        "tokens_per_s": s.get("tokens_per_s"),
        "peft": peft,
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="checkpoints and runs go here (delete it after)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--layers", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--skip-host", action="store_true", help="skip the base_source=host bf16 run")
    ap.add_argument("--only-host", action="store_true", help="only the base_source=host bf16 run")
    ap.add_argument(
        "--recompute",
        default="full",
        help="mode.recompute (default full, the papers' algorithm: auto keeps every block's activations "
        "when the device has room, and a CPU device's room is host RAM, so RssAnon would grow with depth)",
    )
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
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
