"""``l2l export <run dir> [--merge]``: a run's weights as a Hugging Face model directory (and its tokenizer).

A full fine-tune's final/ already is one; a LoRA run's final/ is the adapter in PEFT's layout, which
needs its base. ``--merge`` writes the base with the adapter merged in (PEFT's own ``merge`` per adapted
module), loadable by ``AutoModelForCausalLM.from_pretrained`` (or the encoder's class) with no ``peft``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from l2l_cli.evaluate import UsageError, _Parser, run_config, weights_of
from l2l_cli.problems import ConfigError


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


def main(argv: list[str]) -> int:
    """``l2l export``: 0 done, 2 bad input (one line each)."""
    from l2l_cli.checkpoint import CheckpointError
    from l2l_cli.models.lora import lora_of

    p = _Parser(prog="l2l export", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by l2l train")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (device, ...)")
    p.add_argument("--merge", action="store_true", help="a LoRA run: merge the adapter into its base")
    p.add_argument("--out", metavar="DIR", help="where the model goes (default: <run dir>/merged or /export)")
    p.add_argument("--checkpoint", metavar="DIR", help="weights: a checkpoint or final/ (default: final/)")
    try:
        args = p.parse_intermixed_args(argv)
        run_dir = Path(args.run_dir).expanduser()
        cfg = run_config(run_dir, args.overrides)
        weights = weights_of(run_dir, args.checkpoint)
        out = Path(args.out).expanduser() if args.out else run_dir / ("merged" if args.merge else "export")
        from l2l_cli.evaluate import _session

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
