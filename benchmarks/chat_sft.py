"""Issue 28's benchmark: what task=chat's packing and task.streaming cost or save, as ratios.

1. packing: answer tokens/s of ``task.packing=true`` over ``false`` (one example per row, padded per
   batch) on the same conversations, mode l2l, a Llama-shaped decoder (hidden 512, 8 layers). Packing
   fills rows, so it should train on more answer tokens per second when examples are short;
2. streaming: tokens/s of ``task=lm`` streamed from a local parquet folder (``task.dataset``, tokenized and
   packed on the fly) over the same text read whole (in-memory blocks): the stream's overhead (~1 expected).

Usage (alone on the machine; a few minutes on 2 cores):
    python benchmarks/chat_sft.py           # both parts
    python benchmarks/chat_sft.py --tiny    # a smoke run of the script itself (seconds; numbers meaningless)
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

from l2l_cli.compose import compose
from l2l_cli.session import build

REPO = Path(__file__).resolve().parent.parent


def make_chat(out: Path, hidden: int, layers: int, n: int) -> None:
    spec = importlib.util.spec_from_file_location("make_tiny_chat", REPO / "examples" / "make_tiny_chat.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(out, hidden=hidden, layers=layers, n=n)


def measure(overrides: list[str], steps: int, warmup: int = 1) -> dict[str, float]:
    """Median tokens/s and answer tokens/s over ``steps - warmup`` steps (data time excluded)."""
    cfg = compose([*overrides, f"trainer.max_steps={steps + 1}", "trainer.progress=none"])
    rates: list[tuple[float, float]] = []
    with build(cfg) as s:
        assert s.runner is not None and s.stream is not None
        it = s.stream.batches()
        for i in range(steps):
            batch = next(it)
            t0 = time.perf_counter()
            report = s.runner.step(batch)
            dt = max(report.step_time_s, time.perf_counter() - t0)
            if i >= warmup:
                answer = int((batch.labels[:, 1:] != -100).sum())
                rates.append((int((batch.attention_mask != 0).sum()) / dt, answer / dt))
    return {
        "tokens_per_s": statistics.median(r[0] for r in rates),
        "answer_tokens_per_s": statistics.median(r[1] for r in rates),
    }


def packing(root: Path, tiny: bool) -> None:
    hidden, layers, steps = (32, 2, 3) if tiny else (512, 8, 8)
    make_chat(root, hidden, layers, 512 if tiny else 2048)
    common = [
        "task=chat",
        f"model.pretrained={root / 'model'}",
        f"task.files={root / 'chat.jsonl'}",
        "mode=l2l",
        "task.max_seq_len=256",
        "batch.size=8",
        "batch.ubatch_size=4",
    ]
    padded = measure(common, steps)
    packed = measure([*common, "task.packing=true"], steps)
    print(
        f"packing: answer tokens/s padded {padded['answer_tokens_per_s']:.0f}, packed "
        f"{packed['answer_tokens_per_s']:.0f}; ratio packed/padded "
        f"{packed['answer_tokens_per_s'] / padded['answer_tokens_per_s']:.2f}"
    )


def streaming(root: Path, tiny: bool) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from l2l_cli.data.lm import BUNDLED_FILES

    folder = root / "lm"
    folder.mkdir(exist_ok=True)
    docs = [d for d in BUNDLED_FILES[0].read_text().split("\n\n") if d.strip()]
    pq.write_table(pa.table({"text": docs}), folder / "train.parquet")
    steps = 3 if tiny else 8
    sizes = ["model.num_layers=2", "model.hidden_size=32"] if tiny else ["model.num_layers=8"]
    common = [
        "task=lm",
        "model=gpt2-tiny",
        *sizes,
        "task.max_seq_len=128",
        "batch.size=8",
        "batch.ubatch_size=4",
        "mode=l2l",
        f"task.dataset={folder}",
    ]
    whole = measure(common, steps)
    stream = measure([*common, "task.streaming=true", "task.max_eval_samples=4"], steps)
    print(
        f"streaming: tokens/s in memory {whole['tokens_per_s']:.0f}, streamed {stream['tokens_per_s']:.0f}; "
        f"ratio streamed/in-memory {stream['tokens_per_s'] / whole['tokens_per_s']:.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("all", "packing", "streaming"), default="all")
    ap.add_argument("--tiny", action="store_true", help="a smoke run of the script (numbers meaningless)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("all", "packing"):
            packing(Path(tmp), args.tiny)
        if args.part in ("all", "streaming"):
            streaming(Path(tmp), args.tiny)


if __name__ == "__main__":
    main()
