"""``l2l generate``: sample from a trained decoder.

    l2l generate outputs/2026-01-01/12-00-00-l2l-lm --prompt "Once upon a time" --max-new-tokens 40
    l2l generate <run dir> --input prompts.txt --temperature 0.8 --top-p 0.95 --seed 1 --json
    l2l generate <run dir> --checkpoint step_200 --prompt "What is L2L?" --chat --layered

The weights are the run's final/ (else its newest checkpoint, or ``--checkpoint``), the tokenizer the one
saved beside them (else the run's). Two engines, one sampling (engine/decode.py): a model that fits in host
RAM runs ``transformers``' own ``generate`` on the exported model, one prompt at a time; a larger one (or
``--layered``, or a run whose EPS lives on disk) generates layer by layer through the relay, as it trained,
all prompts together, with each layer's key/value cache off the device (in RAM; in files with the disk tier).
Greedy (the default, ``--temperature 0``) gives the same tokens in both. Bad input is one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from l2l_cli.engine.decode import DiskKV, Generated, HostKV, Sampling
from l2l_cli.engine.device import cuda_available
from l2l_cli.engine.stops import cut_at_strings, stop_ids
from l2l_cli.evaluate import UsageError, run_config, weights_of
from l2l_cli.problems import ConfigError, Problem
from l2l_cli.prompts import Prompt, encode, read_prompts

HOST_SHARE = 0.8  # the in-RAM engine's model (fp32, loaded twice at its peak) must fit this share of free RAM


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (usage: {' '.join(self.format_usage().split()[1:])})")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="l2l generate", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of a decoder written by l2l train")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (device=cuda, ...)")
    p.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="step_<k>, a checkpoint or HF dir, or 'latest' "
        "(the newest checkpoint); default final/, else the newest checkpoint",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="one prompt")
    src.add_argument(
        "--input",
        metavar="FILE",
        help="prompts: one per line, or JSON lines with 'prompt' "
        "(with --chat also 'messages': a list of {role, content})",
    )
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="new tokens per prompt (32)")
    p.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0: greedy (default); > 0 samples"
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="nucleus sampling: keep the top tokens whose probabilities sum to P (0 < P <= 1; 1: all)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="S", help="prompt i samples from seed S+i (0)")
    p.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user turn in the tokenizer's chat template"
    )
    p.add_argument(
        "--layered",
        action="store_true",
        help="generate layer by layer through the relay even if the model fits in RAM",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end a completion where this text appears (repeatable; the text is not kept)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per prompt instead of text")
    return p


def sampling_of(args: argparse.Namespace) -> Sampling:
    """The flags as a :class:`Sampling`; a value out of range is one line naming the flag."""
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens: got {args.max_new_tokens}; allowed: an integer >= 1")
    if not args.temperature >= 0.0:
        raise UsageError(f"--temperature: got {args.temperature}; allowed: 0 (greedy) or a number > 0")
    if not 0.0 < args.top_p <= 1.0:
        raise UsageError(f"--top-p: got {args.top_p}; allowed: 0 < P <= 1")
    return Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)


def main(argv: list[str]) -> int:
    """``l2l generate``: 0 done, 2 bad input (one line each)."""
    from l2l_cli.checkpoint import CheckpointError

    try:
        args = parser().parse_intermixed_args(argv)
        sampling = sampling_of(args)
        prompts = read_prompts(args)
        run_dir = Path(args.run_dir).expanduser()
        cfg = run_config(run_dir, args.overrides)
        spec = decoder_spec(cfg, run_dir)
        weights = weights_of(run_dir, _checkpoint_choice(run_dir, args.checkpoint))
        tok, where = tokenizer_for(cfg, weights)
        ids = encode(tok, prompts, args.chat, where)
        limits = [min(sampling.max_new_tokens, spec.seq_len - len(p)) for p in ids]
        for i, (p, n) in enumerate(zip(ids, limits)):
            if n < 1:
                raise UsageError(
                    f"prompt {i}: {len(p)} tokens; the model takes at most {spec.seq_len} "
                    "positions (model.seq_len), so no room is left to generate"
                )
            if n < sampling.max_new_tokens:
                print(
                    f"l2l: warning: prompt {i}: at most {n} new tokens (model.seq_len={spec.seq_len})",
                    file=sys.stderr,
                )
        engine = choose_engine(run_tier(run_dir, args.overrides), spec, args.layered)
        eos = stop_ids(tok, weights, cfg.model.pretrained, chat=args.chat)  # every id that ends a turn
        if engine.layered:
            results = generate_layered(cfg, weights, tok, ids, sampling, limits, engine, eos)
        else:
            results = generate_hf(cfg, weights, tok, ids, sampling, limits, eos)
    except UsageError as e:
        print(f"l2l: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        for p in e.problems:
            print(f"l2l: config error: {p}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"l2l: --checkpoint: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nl2l: generate interrupted", file=sys.stderr)
        return 130
    write(prompts, results, tok, engine.name, args.json, args.stop)
    return 0


def _checkpoint_choice(run_dir: Path, choice: str | None) -> str | None:
    """``--checkpoint latest``: the newest valid checkpoint (not final/)."""
    if choice != "latest":
        return choice
    from l2l_cli.checkpoint import CheckpointError, latest_valid

    try:
        return str(latest_valid(run_dir)[0])
    except CheckpointError as e:
        raise UsageError(f"--checkpoint latest: {e}") from e


def decoder_spec(cfg: DictConfig, run_dir: Path) -> Any:
    """The run's model spec; a run of a model that does not generate (an encoder) is refused."""
    from l2l_cli.data.tasks import TASKS
    from l2l_cli.models import PretrainedUnavailable, UnsupportedModel, make_spec
    from l2l_cli.models.decoder import DecoderSpec

    try:
        spec = make_spec(cfg.model, TASKS[cfg.task.name].num_labels)
    except (UnsupportedModel, PretrainedUnavailable) as e:
        raise ConfigError([Problem("model.pretrained", str(e))]) from e
    if not isinstance(spec, DecoderSpec):
        raise UsageError(
            f"{run_dir} trained a {spec.family} model (an encoder): generate needs a decoder "
            "(a causal language model: gpt2, llama)"
        )
    return spec


def tokenizer_for(cfg: DictConfig, weights: Path) -> tuple[Any, str]:
    """The tokenizer saved beside the weights (final/), else the run's (task.tokenizer, the pretrained
    checkpoint's, or the bundled one; with the run's task.chat_template and the tokens it added)."""
    from l2l_cli.data.lm import has_tokenizer, load_tokenizer, tokenizer_ref

    if has_tokenizer(weights):
        return load_tokenizer(str(weights), "--checkpoint"), str(weights)
    if cfg.task.get("chat_template"):  # a step checkpoint: the template the run trained with
        from l2l_cli.data.chat_render import template_tokenizer

        tok, ref, _ = template_tokenizer(cfg.task, cfg.model)
        return tok, ref
    ref, key = tokenizer_ref(cfg.task, cfg.model)
    return load_tokenizer(ref, key), ref


@dataclass(frozen=True)
class Engine:
    layered: bool
    tier: str  # the layered engine's EPS tier (a registered name, read from the config)
    on_disk: bool  # its tier keeps files: the key/value caches go to files too
    why: str

    @property
    def name(self) -> str:
        return f"layered ({self.tier} tier)" if self.layered else "transformers"


def run_tier(run_dir: Path, overrides: list[str]) -> str:
    """The EPS tier the run trained on (``eps.tier=`` on this command line wins); ``run_config`` resets it
    to RAM for evaluation."""
    from l2l_cli.config.schema import EpsConfig
    from l2l_cli.inherit import saved_config

    given = [o.split("=", 1)[1] for o in overrides if o.startswith("eps.tier=")]
    return (
        given[-1]
        if given
        else str(OmegaConf.select(saved_config(run_dir), "eps.tier", default=EpsConfig().tier))
    )


def choose_engine(run_tier: str, spec: Any, layered: bool) -> Engine:
    """transformers' ``generate`` when the model fits in host RAM; layer by layer when asked, when the
    run's EPS lives on disk, or when it does not fit (then on a tier that keeps the layers on disk)."""
    from l2l_cli.engine.tiers import TIERS
    from l2l_cli.plan.measure import available_memory

    kind = TIERS[run_tier]
    fits = 2 * 4 * spec.total_params <= HOST_SHARE * available_memory()
    if kind.on_disk:
        return Engine(True, run_tier, True, "the run's EPS is on disk")
    if not fits:
        disk = next(name for name, t in TIERS.items() if t.on_disk)
        return Engine(True, disk, True, "the model does not fit in host RAM")
    if layered:
        return Engine(True, run_tier, False, "--layered")
    return Engine(False, run_tier, False, "fits in host RAM")


def generate_hf(
    cfg: DictConfig,
    weights: Path,
    tok: Any,
    ids: list[list[int]],
    sampling: Sampling,
    limits: list[int],
    eos: set[int],
) -> list[Generated]:
    """``transformers``' ``generate`` on the exported model (a checkpoint is exported first), one prompt at
    a time, prompt i seeded ``seed + i``."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # (stderr is for l2l's own lines)
    with tempfile.TemporaryDirectory(prefix="l2l-generate-") as tmp:
        model_dir = weights if (weights / "config.json").is_file() else export(cfg, weights, tok, Path(tmp))
        device = "cuda" if cfg.device.name in ("auto", "cuda") and cuda_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    pad = pad_id(tok)
    out = []
    for i, (p, n) in enumerate(zip(ids, limits)):
        gen = GenerationConfig(
            max_new_tokens=n,
            eos_token_id=sorted(eos) or None,
            pad_token_id=pad,
            use_cache=True,
            **sampling.hf_kwargs(),
        )
        torch.manual_seed(sampling.seed + i)
        x = torch.tensor([p], device=device)
        with torch.no_grad():
            seq = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gen)
        new = seq[0, len(p) :].tolist()
        out.append(Generated(new, "eos" if new and new[-1] in eos else "length"))
    return out


def export(cfg: DictConfig, weights: Path, tok: Any, out: Path) -> Path:
    """A checkpoint's weights as a Hugging Face directory (through a session of the run's own mode)."""
    from l2l_cli.data.lm import save_tokenizer
    from l2l_cli.export import write_model

    with _session(cfg, weights, tok) as session:
        write_model(session, out / "hf")  # a LoRA run's: the base with its adapter merged in
    save_tokenizer(tok, out / "hf")
    return out / "hf"


def generate_layered(
    cfg: DictConfig,
    weights: Path,
    tok: Any,
    ids: list[list[int]],
    sampling: Sampling,
    limits: list[int],
    engine: Engine,
    eos: set[int],
) -> list[Generated]:
    """Layer by layer through an EPS (a mode whose runner decodes: the run's own if it can, so its
    checkpoints load as they are) on ``engine.tier``; a disk tier's layers and the caches in a temporary
    folder, never the run's own eps/."""
    from l2l_cli.modes import MODES

    cfg = cfg.copy()
    decoding = [name for name, m in MODES.items() if m.decodes]
    own = str(cfg.mode.name) in decoding
    with tempfile.TemporaryDirectory(prefix="l2l-generate-") as tmp:
        if not own and (weights / "manifest.json").is_file():  # another state layout: through HF names
            weights = export(cfg, weights, tok, Path(tmp))
        for key, value in (
            ("mode.name", cfg.mode.name if own else decoding[0]),
            ("mode.stash", None),
            ("precision.name", "fp32"),  # generation runs in FP32 (as transformers' generate here)
            ("eps.tier", engine.tier),
            ("eps.path", str(Path(tmp) / "eps") if engine.on_disk else None),
            ("batch.size", 1),
            ("batch.ubatch_size", 1),
        ):
            OmegaConf.update(cfg, key, value, merge=False)
        with _session(cfg, weights, tok) as session:
            capacity = max(len(p) for p in ids) + max(limits)
            kv = DiskKV(capacity, Path(tmp) / "kv") if engine.on_disk else HostKV(capacity)
            return session.runner.decoder().generate(ids, sampling, eos, pad_id(tok), limits, kv)


def _session(cfg: DictConfig, weights: Path, tok: Any) -> Any:
    """A session that only holds the weights (no data read: the tokenizer is all generation needs)."""
    from l2l_cli.data.tasks import TASKS, TaskData
    from l2l_cli.models import PretrainedUnavailable
    from l2l_cli.session import Session

    data = TaskData(TASKS[cfg.task.name], [], [], "generate", tok)
    try:
        return Session(cfg, None, data=data, train=False, weights=weights).open()
    except PretrainedUnavailable as e:
        raise ConfigError([Problem("model.pretrained", str(e))]) from e


def pad_id(tok: Any) -> int:
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return int(pad) if pad is not None else 0


def write(
    prompts: list[Prompt],
    results: list[Generated],
    tok: Any,
    engine: str,
    as_json: bool,
    stops: list[str] | None = None,
) -> None:
    """Each prompt's completion: as text (several prompts: each under a ``== prompt i ==`` line), or one
    JSON object per prompt (``index``, ``prompt``, ``completion``, ``tokens``, ``new_tokens``, ``stop``:
    ``eos`` (an end-of-sequence or end-of-turn id) | ``stop`` (a ``--stop`` text) | ``length``, ``engine``);
    a completion ends at the first ``--stop`` text, which is not kept."""
    reasons: dict[str, int] = {}
    for i, (p, r) in enumerate(zip(prompts, results)):
        tokens, cut, stopped = cut_at_strings(r.tokens, tok, stops or [])
        r = Generated(tokens, "stop" if stopped else r.stop)
        text = cut if cut is not None else tok.decode(r.tokens, skip_special_tokens=True)
        reasons[r.stop] = reasons.get(r.stop, 0) + 1
        if as_json:
            print(
                json.dumps(
                    {
                        "index": i,
                        "prompt": p.text,
                        "completion": text,
                        "tokens": r.tokens,
                        "new_tokens": len(r.tokens),
                        "stop": r.stop,
                        "engine": engine,
                    }
                )
            )
        else:
            if len(prompts) > 1:
                print(f"== prompt {i} ==")
            print(text)
    why = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
    print(f"l2l: {len(results)} completion(s) by {engine} (stopped by {why})", file=sys.stderr)
