"""``peft.init_from=<adapter dir>``: a run that starts from a saved LoRA adapter (PEFT's layout,
``adapter_config.json`` + ``adapter_model.safetensors``: an l2l run's ``final/`` or anyone's
``save_pretrained``) instead of fresh adapters. The adapter's config is checked against the run's
``peft.*`` before any work: its rank, alpha, rsLoRA and target modules decide what its tensors mean (the
shapes, the scaling), so a mismatch would silently train another adapter than the one saved. No torch at
import: the config's checks read this."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from l2l_cli.models.base import ModelSpec
from l2l_cli.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config
from l2l_cli.models.lora_settings import LoraSettings
from l2l_cli.problems import Problem

KEY = "peft.init_from"
# (adapter_config.json's key, the run's peft key): what must agree
CHECKED = (("r", "peft.r"), ("lora_alpha", "peft.alpha"), ("use_rslora", "peft.use_rslora"))


def saved_config(path: Path) -> dict[str, Any]:
    """The adapter directory's ``adapter_config.json`` (ValueError: not a LoRA adapter, why)."""
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise ValueError(
            f"{path} has no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}: not an adapter (PEFT's layout)"
        )
    try:
        conf = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path / ADAPTER_CONFIG}: unreadable ({e})") from e
    if not isinstance(conf, dict) or conf.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path / ADAPTER_CONFIG}: not a LoRA adapter (peft_type {conf.get('peft_type')!r})")
    return conf


def init_problems(spec: ModelSpec, lora: LoraSettings, where: str) -> list[Problem]:
    """``peft.init_from`` against the run: an adapter directory whose rank, alpha, rsLoRA and targets are
    the run's (one line naming what differs, and the values to set)."""
    path = Path(where).expanduser()
    try:
        theirs = saved_config(path)
    except ValueError as e:
        return [Problem(KEY, str(e))]
    ours = adapter_config(spec, lora)
    # (an adapter_config.json of an older PEFT has no use_rslora: false)
    had = {key: theirs.get(key, False if key == "use_rslora" else None) for key, _ in CHECKED}
    diff = [
        f"{mine}={_shown(ours[key])} here, {_shown(had[key])} in the adapter"
        for key, mine in CHECKED
        if ours[key] != had[key]
    ]
    if _targets(ours["target_modules"]) != _targets(theirs.get("target_modules")):
        diff.append(
            f"peft.target_modules=[{','.join(_targets(ours['target_modules']))}] here, "
            f"[{','.join(_targets(theirs.get('target_modules')))}] in the adapter"
        )
    if diff:
        return [
            Problem(KEY, f"{path}: {'; '.join(diff)} ({ADAPTER_CONFIG}); set the run's keys to the adapter's")
        ]
    return []


def check(spec: ModelSpec, lora: LoraSettings, path: Path) -> None:
    """Weights given as an adapter directory (``l2l eval --checkpoint``, ``peft.init_from``) are refused
    when their rank, alpha, rsLoRA or targets are not the run's: read with another scaling, they would
    silently give other answers than the adapter's own."""
    from l2l_cli.checkpoint import CheckpointError

    for problem in init_problems(spec, lora, str(path)):
        raise CheckpointError(problem.message)


def _shown(value: Any) -> str:
    """A value as the command line writes it (``true``, not ``True``)."""
    return json.dumps(value) if isinstance(value, bool) or value is None else str(value)


def _targets(value: Any) -> list[str]:
    """Target modules by leaf name (a list, PEFT's resolved ``all-linear``; a string as it is)."""
    if isinstance(value, str):
        return [value]
    return sorted({str(v).rpartition(".")[2] for v in value or ()})
