"""``l2l eval`` and ``l2l predict``: a trained run, used.

    l2l eval outputs/2026-01-01/12-00-00-l2l-rte                      # final/ (else the newest checkpoint)
    l2l eval <run dir> task.data_dir=../glue/RTE task.max_eval_samples=200 --checkpoint step_40
    l2l eval <run dir> task=csv task.dev_files=other.csv --json
    l2l predict <run dir> --input new.csv --output predictions.jsonl

Both rebuild the run from its own config (``.hydra/config.yaml``), overridden by the command line's
``key=value`` (l2l_cli/inherit.py), through the same session builder as ``l2l train``: the same data
pipeline, model family, mode and precision, so ``l2l eval`` of a finished run reproduces its final metrics.
Bad input (no such run or checkpoint, an unknown key, a file without the task's columns) is one line and
exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from l2l_cli.problems import ConfigError, Problem


class UsageError(Exception):
    """Bad input to ``l2l eval`` / ``l2l predict``: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (usage: {self.format_usage().strip().removeprefix('usage: ')})")


def parser(cmd: str) -> argparse.ArgumentParser:
    p = _Parser(prog=f"l2l {cmd}", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by l2l train")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides (task=..., task.*, batch.eval_size, device, ...)",
    )
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="weights: a checkpoint (step_<k>, or its path) or a Hugging Face dir; default final/, else the "
        "newest checkpoint",
    )
    if cmd == "eval":
        p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    else:
        p.add_argument(
            "--input",
            required=True,
            metavar="FILE",
            help="examples: CSV/TSV with a header, JSON lines or a JSON array, or plain text (an input per "
            "line)",
        )
        p.add_argument("--output", metavar="FILE", help="where the JSON lines go (default: stdout)")
    return p


def weights_of(run_dir: Path, choice: str | None) -> Path:
    """The weights to load: ``--checkpoint`` (a path, or a name under checkpoints/), else final/, else the
    newest valid checkpoint."""
    from l2l_cli.checkpoint import CheckpointError, latest_valid
    from l2l_cli.models.lora import ADAPTER_CONFIG, is_adapter_dir

    if choice:
        for cand in (Path(choice).expanduser(), run_dir / "checkpoints" / choice, run_dir / choice):
            if cand.is_dir() and any(
                (cand / f).is_file() for f in ("manifest.json", "config.json", ADAPTER_CONFIG)
            ):
                return cand
        raise UsageError(
            f"--checkpoint {choice}: no checkpoint (checkpoints/step_<k>) or Hugging Face dir by that name "
            f"in {run_dir}"
        )
    if (run_dir / "final" / "model.safetensors").is_file() or is_adapter_dir(run_dir / "final"):
        return run_dir / "final"  # a model, or a LoRA run's adapter (peft=lora)
    try:
        path, _ = latest_valid(run_dir)
    except CheckpointError as e:
        raise UsageError(
            f"{run_dir} has no final/ (trainer.save_final=true) and no usable checkpoint ({e})"
        ) from e
    return path


def run_config(run_dir: Path, overrides: list[str]) -> DictConfig:
    """The run's config with ``overrides`` on top, made fit for evaluation (one process, nothing logged)."""
    from l2l_cli.compose import check_overrides, setup
    from l2l_cli.config.validate import validate
    from l2l_cli.inherit import FIXED, NoSavedConfig, fixed_problems, inherit, saved_config

    setup()
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is not a run directory")
    problems, _ = check_overrides(overrides)
    if problems:
        raise ConfigError(problems)
    try:
        saved = saved_config(run_dir)
    except NoSavedConfig as e:
        raise UsageError(str(e)) from e
    cfg = inherit(saved, overrides)
    shape = {k: v for k, v in FIXED.items() if k.startswith("model.")}
    problems = fixed_problems(saved, cfg, run_dir, shape, "evaluated")
    if problems:
        raise ConfigError(problems)
    for key, value in (
        ("trainer.resume", None),
        ("dist.nproc", 1),  # checkpoints hold the whole model whatever the run's layout: one process
        ("dist.pipeline", 1),
        ("dist.placement", "modular"),
        ("dist.schedule", "auto"),
        ("dist.layers_per_stage", 1),
        ("dist.partition_state", False),
        ("eps.tier", "host"),  # the weights are loaded into a fresh EPS; a disk one would need its own files
        ("logger", "none"),
        ("trainer.progress", "none"),
    ):
        OmegaConf.update(cfg, key, value, merge=False)
    problems = validate(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def main(cmd: str, argv: list[str]) -> int:
    """``l2l eval`` / ``l2l predict``: 0 done, 2 bad input (one line each), 1 a failure."""
    from l2l_cli.checkpoint import CheckpointError

    try:
        args = parser(cmd).parse_intermixed_args(argv)
        run_dir = Path(args.run_dir).expanduser()
        cfg = run_config(run_dir, args.overrides)
        weights = weights_of(run_dir, args.checkpoint)
        if cmd == "eval":
            return evaluate(cfg, run_dir, weights, args.json)
        return predict(cfg, weights, Path(args.input).expanduser(), args.output)
    except UsageError as e:
        print(f"l2l: {e}", file=sys.stderr)
    except ConfigError as e:
        for p in e.problems:
            print(f"l2l: config error: {p}", file=sys.stderr)
    except CheckpointError as e:
        what = "--checkpoint" if "--checkpoint" in " ".join(argv) else "weights"
        print(f"l2l: {what}: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"\nl2l: {cmd} interrupted", file=sys.stderr)
        return 130
    return 2


def _session(cfg: DictConfig, weights: Path) -> Any:
    from l2l_cli.models import PretrainedUnavailable
    from l2l_cli.session import Session

    try:
        return Session(cfg, None, train=False, weights=weights).open()
    except PretrainedUnavailable as e:
        raise ConfigError([Problem("model.pretrained", str(e))]) from e


def evaluate(cfg: DictConfig, run_dir: Path, weights: Path, as_json: bool) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from l2l_cli.progress import console

    with _session(cfg, weights) as session:
        n = len(session.data.dev)
        with Progress(
            TextColumn("eval"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=as_json or not console.is_terminal,
        ) as bar:
            task = bar.add_task("eval", total=None)
            metrics = session.evaluator(lambda done, total: bar.update(task, completed=done, total=total))
        result = {
            "run_dir": str(run_dir),
            "weights": str(weights),
            "task": cfg.task.name,
            "data_source": session.data.source,
            "examples": n,
            "metrics": metrics,
        }
    if as_json:
        print(json.dumps(result))
    else:
        print(f"{cfg.task.name} ({session.data.source}, {n} dev examples) with {weights}:")
        for name, value in metrics.items():
            print(f"  {name:<10} {value:.4f}")
    return 0


def predict(cfg: DictConfig, weights: Path, input_path: Path, output: str | None) -> int:
    """Predictions of the run's head for every example of ``input_path`` (CSV/TSV, JSON lines or array, or
    plain text: an input per line), in input order, as JSON lines: ``{"index", "prediction", "label_id",
    "probabilities", "input"}`` (classification) or ``{"index", "prediction", "input"}`` (regression);
    ``input`` echoes the text (a pair task's two) so each answer reads beside its question."""
    from l2l_cli.data.batches import eval_batches
    from l2l_cli.data.files import read_records
    from l2l_cli.data.tasks import TASKS, Example
    from l2l_cli.data.tokenize import load_tokenizer, tokenize

    if TASKS[cfg.task.name].glue_dir == "-" and TASKS[cfg.task.name].file_format is None:
        raise UsageError(
            f"task={cfg.task.name} has no text to predict from; predict needs a text task (GLUE, csv, json)"
        )
    if not input_path.is_file():
        raise UsageError(f"--input {input_path}: not a file")
    suffix = input_path.suffix.lower()
    fmt = "json" if suffix in (".json", ".jsonl") else "csv" if suffix in (".csv", ".tsv") else "text"
    try:
        if fmt == "text":  # plain text: an input per line (a pair's two texts split by a tab)
            lines = [ln for ln in input_path.read_text(encoding="utf-8").splitlines() if ln.strip()]
            records: list[dict[str, Any]] = [{} for _ in lines]
        else:
            records = [row for _, row in read_records(input_path, fmt, "--input")]
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"--input {input_path}: unreadable ({str(e).splitlines()[0]})") from e
    if not records:
        raise UsageError(f"--input {input_path}: no examples")
    with _session(cfg, weights) as session:
        spec = session.data.spec
        fields = text_fields(cfg, spec, records[0])
        if fmt == "text":
            records = [text_record(ln, n, fields, input_path) for n, ln in enumerate(lines, start=1)]
        missing = [f for f in fields if any(f not in r for r in records[:1])]
        if missing:
            raise UsageError(
                f"--input {input_path}: no field {', '.join(missing)} (task {spec.name} reads "
                f"{', '.join(fields)})"
            )
        examples = [
            Example(str(r.get(fields[0], "")), str(r.get(fields[1], "")) if len(fields) > 1 else None, 0)
            for r in records
        ]
        tok = load_tokenizer(cfg.task.tokenizer, cfg.model.pretrained)
        data = tokenize(tok, examples, cfg.task.max_seq_len, spec.is_regression)
        size = cfg.batch.eval_size or cfg.batch.size
        outputs: list[torch.Tensor | None] = [None] * len(examples)
        for idx, batch in eval_batches(data, size):
            logits = session.runner.predict(batch).float()
            for row, i in enumerate(idx):
                outputs[i] = logits[row]
    out = open(output, "w") if output else sys.stdout  # noqa: SIM115  (stdout must stay open)
    try:
        for i, logits in enumerate(outputs):
            assert logits is not None
            shown = (
                examples[i].text_a if examples[i].text_b is None else [examples[i].text_a, examples[i].text_b]
            )
            out.write(json.dumps({**prediction(i, logits, spec.label_names), "input": shown}) + "\n")
    finally:
        if output:
            out.close()
    if output:
        print(f"l2l: wrote {len(outputs)} predictions to {output}", file=sys.stderr)
    return 0


def text_fields(cfg: DictConfig, spec: Any, first: dict[str, Any]) -> list[str]:
    """The input's text columns: task.text_fields for csv/json tasks; for GLUE, the hub's column names,
    or the GLUE TSV header's when the file has those (a GLUE dev.tsv works as input as it is)."""
    if spec.file_format is not None:
        from l2l_cli.data.sources import as_list

        return as_list(cfg.task.text_fields)
    hub, tsv = list(spec.hub[:-1]), [c for c in spec.tsv[:-1] if isinstance(c, str)]
    if tsv and all(c in first for c in tsv) and not all(c in first for c in hub):
        return tsv
    return hub


def text_record(line: str, number: int, fields: list[str], path: Path) -> dict[str, str]:
    """One line of a plain-text ``--input`` as the task's text fields (a pair task: two texts, tab-split)."""
    parts = line.split("\t") if len(fields) > 1 else [line]
    if len(parts) != len(fields):
        raise UsageError(
            f"--input {path} line {number}: {len(parts)} tab-separated text(s); the task reads "
            f"{len(fields)} ({', '.join(fields)})"
        )
    return dict(zip(fields, parts, strict=True))


def prediction(index: int, logits: torch.Tensor, label_names: tuple[str, ...] | None) -> dict[str, Any]:
    if label_names is None:
        return {"index": index, "prediction": float(logits.reshape(-1)[0])}
    probs = torch.softmax(logits, dim=-1).numpy()
    k = int(np.argmax(probs))
    return {
        "index": index,
        "prediction": label_names[k],
        "label_id": k,
        "probabilities": {name: round(float(p), 6) for name, p in zip(label_names, probs)},
    }
