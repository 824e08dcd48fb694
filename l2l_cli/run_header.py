"""What a run is, in words: train.log's header and the progress bar's title, from the summary's config
block (``runfiles.RunConfig``) and the run's config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from l2l_cli.runfiles import Summary


def model_name(model: Any, family: str) -> str:
    """What train.log calls the model: a named size (``bert-tiny``), or a checkpoint by its own name (its
    config.json's ``_name_or_path`` when that is a hub id, else the folder's or hub id's), never the group
    default a pretrained run does not use."""
    if not model.pretrained:
        return str(model.name)
    ref = str(model.pretrained)
    try:
        own = json.loads((Path(ref).expanduser() / "config.json").read_text()).get("_name_or_path") or ""
    except (OSError, ValueError, AttributeError):
        own = ""
    hub_id = own and not own.startswith((".", "/", "~")) and own.count("/") <= 1
    return f"{own if hub_id else Path(ref).name or ref} ({family}, pretrained)"


def run_header(
    summary: Summary, cfg: Any, run_dir: Path | None, world: int, dev_examples: int, steps: int
) -> str:
    """What this run is, for train.log: mode, model (and the checkpoint it starts from), task, data."""
    c = summary.config
    lines = [
        f"run {run_dir} on {summary.device}, {world} process(es)",
        f"  mode      {c.method} ({c.precision}, clip {c.clip})",
        f"  model     {model_name(cfg.model, c.family)}: {c.num_layers} layers, hidden {c.hidden_size}, "
        f"{(summary.params or 0) / 1e6:.2f}M params",
        f"  task      {c.task} from {c.data_source}: {c.train_samples} training examples, "
        f"{dev_examples} dev, max {c.seq_len} tokens",
        f"  batch     {c.batch_size} = {c.num_ubatches} x ubatch {c.ubatch_size}; {steps} steps, "
        f"{cfg.optim.name} lr {cfg.optim.lr:g}",
    ]
    if cfg.model.pretrained:
        lines.insert(3, f"  from      {cfg.model.pretrained} (pretrained)")
    if summary.resumed_from:
        lines.append(f"  resumed   from {summary.resumed_from['checkpoint']}")
    return "\n".join(lines)


def run_title(summary: Summary, cfg: Any, recompute: str | None = None) -> str:
    """The progress header: method, model (or the pretrained checkpoint it starts from), task, and what
    an L2L runner recomputes (``recompute``, its ``recompute_info``)."""
    c = summary.config
    name = f"pretrained {cfg.model.pretrained}" if cfg.model.pretrained else cfg.model.name
    title = f"{c.method} · {name} ({(summary.params or 0) / 1e6:.1f}M params) · {c.task}"
    return f"{title} · {recompute}" if recompute else title
