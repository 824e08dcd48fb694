"""Issue 28's benchmark: ``l2l generate``'s two engines on this machine, one run.

New tokens per second of transformers' ``generate`` (on the exported model, one prompt at a time) and of the
layered engine (layer by layer through the relay, every prompt in one batch, KV caches in RAM; and with the
disk tier, the layers and the caches in files), for 1 and 8 prompts, greedy, with the ratio layered /
transformers. Times include loading the weights (what a user waits for). The greedy tokens of the engines are
checked equal as it goes.

Usage (alone on the machine; a few minutes on 2 cores):
    python benchmarks/generate.py                 # a 6-layer GPT-2-small-shaped decoder, 64 new tokens
    python benchmarks/generate.py --device cuda   # the layered engine on the GPU (transformers' too)
    python benchmarks/generate.py --tiny          # a seconds-long smoke run of the script itself
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from l2l_cli import generate, prompts
from l2l_cli.compose import compose
from l2l_cli.engine.decode import Sampling
from l2l_cli.evaluate import run_config, weights_of
from l2l_cli.train import run_job

SMALL = ["model=gpt2-small", "model.num_layers=6", "model.vocab_size=2048", "task.max_seq_len=128"]
TINY = ["model=gpt2-tiny", "model.num_layers=2", "model.vocab_size=2048", "task.max_seq_len=16"]
PROMPT = "The court ruled that the company had"


def make_run(root: Path, shape: list[str]) -> Path:
    """A decoder trained one step (its final/ is what generate loads)."""
    run = root / "run"
    cfg = compose(
        [
            "task=lm",
            *shape,
            "batch.size=2",
            "batch.ubatch_size=1",
            "trainer.max_steps=1",
            "trainer.save_every=1",
            "trainer.save_final=true",
            "task.max_eval_samples=2",
            "trainer.progress=none",
            "model.init_std=0.2",
        ]
    )
    assert run_job(cfg, run) == "ok"
    return run


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    n_new = 4 if args.tiny else args.new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        run = make_run(Path(tmp), TINY if args.tiny else SMALL)
        cfg = run_config(run, [f"device={args.device}"])
        spec = generate.decoder_spec(cfg, run)
        weights = weights_of(run, None)
        tok, _ = generate.tokenizer_for(cfg, weights)
        sampling = Sampling(max_new_tokens=n_new)
        print(
            f"{spec.num_layers} layers, hidden {spec.hidden_size}, {spec.total_params / 1e6:.1f}M params; "
            f"{n_new} new tokens per prompt, greedy, device={args.device}"
        )
        print(f"{'prompts':>7}  {'engine':<22} {'s':>8} {'new tok/s':>10} {'vs transformers':>16}")
        for n in (1, 8):
            ids = prompts.encode(tok, [prompts.Prompt(f"{PROMPT} {i}") for i in range(n)], False, "")
            limits = [min(n_new, spec.seq_len - len(p)) for p in ids]
            host, disk = (
                generate.choose_engine("host", spec, True),
                generate.choose_engine("disk", spec, True),
            )
            engines = {
                "transformers": (generate.generate_hf, ()),
                "layered (host tier)": (generate.generate_layered, (host,)),
                "layered (disk tier)": (generate.generate_layered, (disk,)),
            }
            base, ref = None, None
            for name, (fn, extra) in engines.items():
                secs, out = timed(fn, cfg, weights, tok, ids, sampling, limits, *extra)
                toks = [g.tokens for g in out]
                ref = ref or toks
                assert toks == ref, f"{name}: other tokens than transformers'"
                rate = sum(len(t) for t in toks) / secs
                base = base or rate
                print(f"{n:>7}  {name:<22} {secs:>8.2f} {rate:>10.1f} {rate / base:>15.2f}x")


if __name__ == "__main__":
    main()
