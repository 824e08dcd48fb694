"""``l2l export --merge`` of a Llama-7B-shaped LoRA run on a machine with less RAM than the model in FP32:
the export's peak anonymous RSS (RssAnon, not page cache), its time, and the merged directory loaded with
``AutoModelForCausalLM.from_pretrained`` against the run's own logits (issue 52, acceptance 5).

Steps, one after another: a random bf16 checkpoint written layer by layer (benchmarks/adapters.py's), a
LoRA run of ``--steps`` steps on it (q_proj/v_proj, the base in RAM as bf16, ``trainer.save_final``), the
export (``--merge --dtype bf16``, RssAnon polled every 0.2 s), the run's logits for one random row (its
final/ loaded as ``l2l eval`` loads it), then the merged model's for the same row. The two models are
never in RAM together.

    flock /tmp/l2l-heavy.lock python benchmarks/export_merge.py --dir /tmp/merge7b     # 4096 x 32, 13.5 GB
    python benchmarks/export_merge.py --dir /tmp/x --hidden 64 --intermediate 128 --heads 4 --layers 2 \
        --vocab 4096

Run it alone on the machine; delete ``--dir`` after (the checkpoint and the merged copy: ~27 GB at 7B).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

from adapters import cpu_flags, train, write_checkpoint
from procs import l2l_polled

CFG1 = ["batch.size=1", "batch.ubatch_size=1"]


def export(run: Path, out: Path) -> dict:
    """``l2l export run --merge --dtype bf16 --out out`` in its own process, its RssAnon polled."""
    t0 = time.perf_counter()
    peak = l2l_polled("export", str(run), "--merge", "--dtype", "bf16", "--out", str(out))
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return {"peak_rss_anon_gib": peak / 2**30, "seconds": time.perf_counter() - t0, "merged_gb": size / 1e9}


def _logits(which: str, run: Path, merged: Path, seq: int, vocab: int) -> Any:
    """One model's logits for the benchmark's row: ``fp32`` (the run's final/ through l2l's own model, as
    ``l2l eval`` loads it), ``amp`` (the same with the device computing in bf16) or ``merged`` (the merged
    directory through transformers, in bf16). Each in a process of its own: two 7B models never share RAM."""
    import torch

    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    if which == "merged":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    from l2l_cli.data.batches import Batch
    from l2l_cli.evaluate import run_config
    from l2l_cli.session import Session

    cfg = run_config(run, CFG1 + (["precision=amp"] if which == "amp" else []))
    batch = Batch(ids, torch.zeros_like(ids), torch.ones_like(ids), ids.clone())
    with Session(cfg, None, train=False, weights=run / "final").open() as s:
        return s.runner.predict(batch).float()


def logits(run: Path, merged: Path, seq: int, vocab: int) -> dict:
    """The merged bf16 model's logits against the run's FP32 ones, beside the noise floor: the same run with
    the device computing in bf16 (what bf16 arithmetic alone moves the logits by, at this depth)."""
    ctx = multiprocessing.get_context("spawn")
    got = {}
    for which in ("fp32", "amp", "merged"):
        with ctx.Pool(1) as pool:
            got[which] = pool.apply(_logits, (which, run, merged, seq, vocab))
    ours, amp, theirs = got["fp32"], got["amp"], got["merged"]
    top = float(ours.abs().max())
    return {
        "max_abs_logit": top,
        "merged_bf16_vs_run_fp32_rel_to_max": float((theirs - ours).abs().max()) / top,
        "run_bf16_vs_run_fp32_rel_to_max": float((amp - ours).abs().max()) / top,
        "merged_bf16_vs_run_bf16_rel_to_max": float((theirs - amp).abs().max()) / top,
        "argmax_agree_merged_vs_run_fp32": float((theirs.argmax(-1) == ours.argmax(-1)).float().mean()),
        "argmax_agree_run_bf16_vs_run_fp32": float((amp.argmax(-1) == ours.argmax(-1)).float().mean()),
    }


def merged_weights(run: Path, ckpt: Path, merged: Path, layers: list[int]) -> dict:
    """Each adapted weight of ``layers`` against bf16(W + B @ A * alpha / r) computed here in FP32 from the
    checkpoint and the adapter, and one untouched weight against the checkpoint's: the largest difference
    in bf16 ulps (0: the merge wrote exactly the rounded sum)."""
    import torch
    from safetensors import safe_open

    cfg = json.loads((run / "final" / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]

    def tensor(root: Path, name: str) -> torch.Tensor:
        index = root / "model.safetensors.index.json"
        file = json.loads(index.read_text())["weight_map"][name] if index.is_file() else "model.safetensors"
        with safe_open(str(root / file), framework="pt") as f:
            return f.get_tensor(name)

    def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
        ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
        return int((ia - ib).abs().max())

    with safe_open(str(run / "final" / "adapter_model.safetensors"), framework="pt") as f:
        adapter = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    out: dict[str, int] = {}
    for i in layers:
        for proj in cfg["target_modules"]:
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            a, b = adapter[f"{key}.lora_A.weight"].float(), adapter[f"{key}.lora_B.weight"].float()
            want = (tensor(ckpt, name).float() + (b @ a) * scale).to(torch.bfloat16)
            out[name] = ulps(tensor(merged, name), want)
        name = f"model.layers.{i}.mlp.down_proj.weight"
        out[name] = ulps(tensor(merged, name), tensor(ckpt, name))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="checkpoint, run and merged copy go here")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--reuse", action="store_true", help="keep a finished run and export in --dir (re-check)")
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ckpt = write_checkpoint(a.dir, a.layers, a.hidden, a.intermediate, a.heads, a.vocab)
    out: dict = {"checkpoint_s": time.perf_counter() - t0}
    run, merged = a.dir / "run", a.dir / "merged"
    extra = [
        "peft.base_dtype=bf16",
        "peft.base_source=host",
        "mode.recompute=full",
        "trainer.save_final=true",
        "optim.lr=0.01",  # (adapters far from zero after a few steps: the merge changes every q and v)
    ]
    if not (a.reuse and (run / "final").is_dir()):
        out["train"] = train(ckpt, run, a.steps, a.seq, extra)
        print(json.dumps({"train": {k: v for k, v in out["train"].items() if k != "peft"}}), flush=True)
    if not (a.reuse and (merged / "checksums.json").is_file()):
        out["export"] = export(run, merged)
        print(json.dumps({"export": out["export"]}), flush=True)
    out["merged_weights_max_ulps"] = merged_weights(run, ckpt, merged, [0, a.layers - 1])
    out["logits"] = logits(run, merged, a.seq, a.vocab)
    out["params"] = json.loads((run / "summary.json").read_text()).get("params")
    out["cpu_flags"] = cpu_flags()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
