"""``l2l export <run dir> [--merge [--dtype bf16|fp16|fp32]]``: a run's weights as a Hugging Face model
directory (and its tokenizer).

A full fine-tune's final/ already is one; a LoRA run's final/ is the adapter in PEFT's layout, which
needs its base. ``--merge`` writes the base with the adapter merged in (PEFT's own ``merge`` per adapted
module), loadable by ``AutoModelForCausalLM.from_pretrained`` (or the encoder's class) with no ``peft``:
layer by layer into safetensors shards (``models/merge.py``), in the checkpoint's type unless ``--dtype``
says another, with the tokenizer and (a decoder) ``generation_config.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from l2l_cli.checkpoint import CheckpointError
from l2l_cli.evaluate import UsageError, _Parser, _session, run_config, weights_of
from l2l_cli.models.merge import DTYPES, parse_size
from l2l_cli.problems import ConfigError, Problem


def write_model(session: Any, out: Path) -> None:
    """The session's model as a Hugging Face directory: a LoRA model's base with its adapter merged in,
    any other model's trained weights as they are."""
    from l2l_cli.models.lora import base_spec, lora_of, merged_tensors

    spec, runner = session.model, session.runner
    task = session.data.spec if session.data is not None else None
    if lora_of(spec) is None:
        spec.save_hf(out, runner.hf_tensors(), task)
        return
    base_spec(spec).save_hf(out, merged_tensors(spec, runner.full_layers()), task)


def _trained(cfg: Any, spec: Any, weights: Path) -> dict[str, Any]:
    """The run's trained tensors by ``hf_name``: an adapter directory read and checked as ``l2l eval``
    reads it (its rank and scaling, its base's fingerprint); a checkpoint's (``checkpoints/step_<k>``, in
    the runner's state layout) through a session, which holds the model while it reads them."""
    from l2l_cli import checkpoint as ckpt
    from l2l_cli.models import lora_init
    from l2l_cli.models.lora import lora_of, read_adapter, trainable_hf_names

    lora = lora_of(spec)
    assert lora is not None
    if (weights / "manifest.json").is_file():
        with _session(cfg, weights) as s:
            return {n: t.detach().clone() for n, t in s.runner.hf_tensors() if s.model.trainable(n)}
    ckpt.verify_dir(weights)
    lora_init.check(spec, lora, weights)
    try:
        if not lora.allow_base_change:
            ckpt.check_base(ckpt.recorded(weights), lora.base_fingerprint, weights)
    except ckpt.BaseChanged as e:
        raise ConfigError([Problem("model.pretrained", str(e))]) from e
    tensors = read_adapter(weights)
    lacking = [n for n in trainable_hf_names(spec) if n not in tensors]
    if lacking:
        more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
        raise CheckpointError(
            f"{weights} lacks {', '.join(lacking[:3])}{more}: not the adapter of this model"
        )
    return tensors


def merge_streamed(cfg: Any, weights: Path, out: Path, dtype: str | None, max_shard_bytes: int) -> str:
    """A LoRA run's merged model written layer by layer (``models/merge.py``) into ``out`` (atomic,
    checksummed, as final/): the base read from ``model.pretrained``'s own files (never a low-bit copy),
    or the run's seeded init without one. Returns the dtype written (torch's name)."""
    import torch

    from l2l_cli import checkpoint as ckpt
    from l2l_cli.data.loading import load_task
    from l2l_cli.data.tasks import LM
    from l2l_cli.engine.stops import write_generation_config
    from l2l_cli.loop import base_dir
    from l2l_cli.models import PretrainedUnavailable, UnsupportedModel, make_spec
    from l2l_cli.models.hf import base_fingerprint
    from l2l_cli.models.lora import LoraSettings, base_spec, with_lora
    from l2l_cli.models.merge import DTYPES, checkpoint_files, merged_layers, write_shards
    from l2l_cli.models.registry import resolve_pretrained

    ref = cfg.model.pretrained
    try:
        data = load_task(cfg.task, cfg.model, train_split=False)
        plain = make_spec(cfg.model, data.spec.num_labels)
        spec = with_lora(
            plain, LoraSettings.from_cfg(cfg.peft, bool(ref), base_fingerprint(ref) if ref else None)
        )
        root = resolve_pretrained(ref) if ref else None
    except (UnsupportedModel, PretrainedUnavailable) as e:
        raise ConfigError([Problem("model.pretrained", str(e))]) from e
    trained = _trained(cfg, spec, weights)
    base: Any = None
    if root is not None:
        base = checkpoint_files(root)
        if base is None:  # a legacy pytorch_model.bin: mapped, read tensor by tensor
            base = torch.load(root / "pytorch_model.bin", map_location="cpu", weights_only=True, mmap=True)
    kept = base.main_dtype() if hasattr(base, "main_dtype") else None
    name = DTYPES[dtype] if dtype else (kept or "float32")

    def write(tmp: Path) -> None:
        base_spec(spec).save_hf(tmp, iter(()), data.spec)  # config.json (the family's), an empty weights file
        (tmp / "model.safetensors").unlink()
        config = json.loads((tmp / "config.json").read_text())
        config["dtype"] = name
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        layers = merged_layers(spec, base, trained, int(cfg.trainer.seed))
        write_shards(spec, layers, tmp, getattr(torch, name), max_shard_bytes)
        if data.tokenizer is not None:  # the export loads with AutoTokenizer from the one directory
            from l2l_cli.data.lm import save_tokenizer

            save_tokenizer(data.tokenizer, tmp)
            if data.spec.objective == LM:  # where generation stops: the base's list, end of turn
                write_generation_config(tmp, data.tokenizer, base_dir(data))

    ckpt.save_dir(out, write)
    return name


def main(argv: list[str]) -> int:
    """``l2l export``: 0 done, 2 bad input (one line each)."""
    from l2l_cli.models.lora import lora_of

    p = _Parser(prog="l2l export", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by l2l train")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (device, ...)")
    p.add_argument("--merge", action="store_true", help="a LoRA run: merge the adapter into its base")
    p.add_argument("--out", metavar="DIR", help="where the model goes (default: <run dir>/merged or /export)")
    p.add_argument("--checkpoint", metavar="DIR", help="weights: a checkpoint or final/ (default: final/)")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="with --merge: the merged weights' type (default: the checkpoint's; fp32 without "
        "model.pretrained)",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="with --merge: the largest shard (bytes, or 500MB, 5GB, 2GiB; default 5GB, as transformers)",
    )
    try:
        args = p.parse_intermixed_args(argv)
        run_dir = Path(args.run_dir).expanduser()
        try:
            max_shard = parse_size(args.max_shard_size)
            assert max_shard > 0
        except (ValueError, AssertionError):
            raise UsageError(
                f"--max-shard-size {args.max_shard_size}: a positive size (bytes, or 500MB, 5GB, 2GiB)"
            ) from None
        if args.dtype and not args.merge:
            raise UsageError("--dtype: only with --merge (a full fine-tune's export keeps its weights' type)")
        cfg = run_config(run_dir, args.overrides)
        weights = weights_of(run_dir, args.checkpoint)
        out = Path(args.out).expanduser() if args.out else run_dir / ("merged" if args.merge else "export")
        if args.merge and cfg.peft.name != "none":
            name = merge_streamed(cfg, weights, out, args.dtype, max_shard)
            print(f"l2l: merged {weights} into its base, {name}, in {out}", file=sys.stderr)
            return 0
        with _session(cfg, weights) as session:
            if lora_of(session.model) is not None and not args.merge:
                raise UsageError(
                    f"{run_dir} trained a LoRA adapter (its final/ is the adapter): "
                    "add --merge for a model with the adapter merged in"
                )
            write_model(session, out)
            tok = session.data.tokenizer if session.data is not None else None
        if tok is not None:
            from l2l_cli.data.lm import save_tokenizer

            save_tokenizer(tok, out)
        print(f"l2l: exported {weights} to {out}", file=sys.stderr)
        return 0
    except UsageError as e:
        print(f"l2l: {e}", file=sys.stderr)
    except ConfigError as e:
        for prob in e.problems:
            print(f"l2l: config error: {prob}", file=sys.stderr)
    except CheckpointError as e:
        print(f"l2l: --checkpoint: {e}", file=sys.stderr)
    return 2
