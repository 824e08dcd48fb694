"""A run's own config, inherited by the commands that continue or reuse it (``trainer.resume``, ``l2l eval``,
``l2l predict``): every key comes from the run, except the ones the command line sets.

Why not replay the run's command line: defaults, recipes and group files change between versions, and a
replay would silently train on with other settings. The saved config is what the run really used.

Which keys the command line sets: those it names (``trainer.max_steps=500``), and for a group option
(``task=mrpc``) every key that option changes and every key of its group. A resumed run may not change what
its checkpoint and data position depend on (``FIXED``): it is refused, one line per key, before anything is
written.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from l2l_cli.compose import GROUPS, compose
from l2l_cli.engine.tiers import TIERS
from l2l_cli.problems import Problem

# What a resumed run keeps: the checkpoint's model shape and optimizer, the data (task and order), and the
# global batch (checked as batch.size x dist.nproc). mode.name is checked by state layout (modes sharing
# one resume each other's checkpoints).
FIXED = {
    "model.family": "model shape",
    "model.num_layers": "model shape",
    "model.hidden_size": "model shape",
    "model.num_heads": "model shape",
    "model.intermediate_size": "model shape",
    "model.vocab_size": "model shape",
    "model.seq_len": "model shape",
    "model.type_vocab_size": "model shape",
    "optim.name": "optimizer state",
    "task.name": "task (the data position)",
    "trainer.seed": "seed (data order and dropout follow it)",
    "peft.name": "adapters (its checkpoints hold a LoRA adapter's state, no base weights; l2l export --merge "
    "writes a model a new run can start from)",
    "peft.r": "adapters' shape",
    "peft.alpha": "adapters' scaling",
    "peft.use_rslora": "adapters' scaling",
    "peft.use_dora": "adapters' shape",
    "peft.target_modules": "adapters' shape",
    "peft.modules_to_save": "adapters' shape",
    "peft.base_dtype": "frozen base's precision (its adapters were trained on that base's rounding)",
}
# What a resume may change but says so on the console, not only in train.log (key -> why it may)
ANNOUNCED = {
    "peft.base_source": "the same base, held elsewhere: the numbers do not change, and the base is encoded "
    "again unless its encoded files are where this run keeps them",
}


# What a command never takes from the run's config: where it resumed from, and a permission given once
# (a resume on another base does not let later evaluations use any base)
NOT_INHERITED = ("trainer.resume", "peft.allow_base_change")


class NoSavedConfig(Exception):
    """A directory that holds no run config (not a run dir)."""


CONFIG_SUM = "config.sha256"  # beside .hydra/config.yaml: its sha256 when l2l last wrote or adopted it


def record_config_sum(run_dir: Path) -> None:
    """Note the sha256 of ``run_dir/.hydra/config.yaml`` as the run holds it now (a fresh run: as Hydra
    wrote it; a resume: as the session rewrote it), so a later edit by hand is seen (:func:`saved_config`)."""
    path = run_dir / ".hydra" / "config.yaml"
    if path.is_file():
        from l2l_cli.checkpoint import write_bytes

        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        write_bytes(path.with_name(CONFIG_SUM), f"{digest}\n".encode())


def saved_config(run_dir: Path) -> DictConfig:
    """The config a run trained with: ``.hydra/config.yaml`` (rewritten when a resume succeeds), else its
    newest checkpoint's ``config.yaml``. The first is checked before it is trusted: against the checksum
    the run noted (:func:`record_config_sum`), and the keys a checkpoint depends on (``FIXED``) against
    the newest checkpoint's own checksummed config; an edit by hand is refused in one line naming the
    file (keys change on the command line, where a resume checks them)."""
    from l2l_cli.checkpoint import candidates

    paths = [run_dir / ".hydra" / "config.yaml"] + [p / "config.yaml" for _, p in candidates(run_dir)]
    for path in paths:
        if path.is_file():
            try:
                cfg = OmegaConf.load(path)
            except (OSError, OmegaConfBaseException, yaml.YAMLError) as e:  # a file edited into bad YAML
                raise NoSavedConfig(f"{path}: unreadable ({str(e).splitlines()[0]})") from e
            if isinstance(cfg, DictConfig):
                if path == paths[0]:
                    _check_saved(path, cfg, run_dir)
                if isinstance(cfg.get("device"), str):  # saved before device was a group: its name
                    cfg.device = {"name": cfg.device}
                return cfg
            raise NoSavedConfig(f"{path}: not a config (a mapping of keys)")
    raise NoSavedConfig(f"{run_dir} holds no run config (.hydra/config.yaml or a checkpoint's config.yaml)")


def _check_saved(path: Path, cfg: DictConfig, run_dir: Path) -> None:
    """:func:`saved_config`'s check of ``.hydra/config.yaml``."""
    from l2l_cli.checkpoint import CheckpointError, candidates, read_checked, verify_manifest

    ckpt_cfg, where = None, None
    for _, ckpt in candidates(run_dir)[:1]:
        try:
            loaded = OmegaConf.create(read_checked(ckpt, "config.yaml", verify_manifest(ckpt)).decode())
        except (CheckpointError, OSError, ValueError, OmegaConfBaseException):
            break  # a checkpoint that cannot be used is the resume's to report
        if isinstance(loaded, DictConfig):
            ckpt_cfg, where = loaded, ckpt / "config.yaml"
    keys: list[str] = []
    if ckpt_cfg is not None:
        mine, theirs = _resolved(cfg), _resolved(ckpt_cfg)
        keys = [
            k
            for k in FIXED
            if k in mine
            and k in theirs
            and mine[k] != theirs[k]
            and not any(isinstance(v, str) and "${" in v for v in (mine[k], theirs[k]))
        ]
    sum_path = path.with_name(CONFIG_SUM)
    edited = (
        sum_path.is_file() and sum_path.read_text().strip() != hashlib.sha256(path.read_bytes()).hexdigest()
    )
    if not (edited or keys):
        return
    if ckpt_cfg is not None and not keys:
        mine, theirs = _resolved(cfg), _resolved(ckpt_cfg)
        keys = [k for k in mine if k in theirs and mine[k] != theirs[k] and k != "trainer.resume"]
    detail = "; ".join(
        f"{k}: {_resolved(cfg)[k]} here, {_resolved(ckpt_cfg)[k]} in {where}" for k in keys[:3]
    )
    raise NoSavedConfig(
        f"{path} was changed by hand after the run wrote it"
        + (f" ({detail})" if detail else "")
        + "; restore it, and set keys on the command line (l2l train trainer.resume=<run> key=value)"
    )


def leaves(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value for every leaf (lists are leaves), without resolving interpolations."""
    out: dict[str, Any] = {}
    for key in cfg:
        node = cfg._get_node(key)
        full = f"{prefix}{key}"
        if isinstance(node, DictConfig):
            out.update(leaves(node, full + "."))
        elif isinstance(node, ListConfig):
            out[full] = OmegaConf.to_container(node, resolve=False)
        else:
            out[full] = node._value()
    return out


def _resolved(cfg: DictConfig) -> dict[str, Any]:
    """Leaves with interpolations resolved where they can be (a saved config's ``${...}`` refer to the run's
    own values, or to resolvers the current process may lack)."""
    out = {}
    for key, raw in leaves(cfg).items():
        try:
            out[key] = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
        except OmegaConfBaseException:
            out[key] = raw
        if isinstance(out[key], ListConfig | DictConfig):
            out[key] = OmegaConf.to_container(out[key], resolve=True)
    return out


def explicit_keys(overrides: list[str]) -> set[str]:
    """The leaf keys ``overrides`` set (see the module docstring)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys: set[str] = set()
    groups: list[str] = []
    for raw in overrides:
        ov = OverridesParser.create().parse_override(raw)
        key = ov.key_or_group
        if key.startswith("hydra"):
            continue
        if key in GROUPS:
            groups.append(raw)
            keys.add(key)  # every key of the group (prefix match below)
        else:
            keys.add(key)
    schema = leaves(compose([]))  # (the defaults: every key, each composed once)
    if groups:
        chosen = leaves(compose(groups))
        keys |= {k for k, v in chosen.items() if schema.get(k) != v}
    return {k for k in schema if k in keys or any(k.startswith(p + ".") for p in keys)}


def inherit(saved: DictConfig, overrides: list[str]) -> DictConfig:
    """``overrides`` composed as ``l2l train`` would, every key they do not set taken from ``saved``."""
    plain = [o for o in overrides if not o.split("=", 1)[0].lstrip("+~").startswith("hydra")]
    cfg = compose(plain)
    explicit = explicit_keys(plain)
    have = leaves(cfg)
    for key, value in _resolved(saved).items():
        if key in have and key not in explicit and key not in NOT_INHERITED:
            OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def fixed_problems(
    saved: DictConfig, cfg: DictConfig, run_dir: Path, keys: dict[str, str], doing: str
) -> list[Problem]:
    """``keys`` (key -> what it is part of) that ``cfg`` changes from the run's ``saved`` config."""
    old = _resolved(saved)
    out = []
    for key, what in keys.items():
        new = OmegaConf.select(cfg, key)
        if key in old and old[key] != new:
            out.append(
                Problem(
                    key,
                    f"{new} here, {old[key]} in the run being {doing} ({run_dir}): it keeps its {what}; "
                    f"start a new run to change it",
                )
            )
    return out


def resume_problems(saved: DictConfig, cfg: DictConfig, run_dir: Path) -> list[Problem]:
    """What a resume of ``run_dir`` with ``cfg`` (inherited from ``saved``) may not change, and whether it
    has a checkpoint to resume from at all."""
    from l2l_cli.checkpoint import CheckpointError, latest_valid
    from l2l_cli.modes import MODES

    problems: list[Problem] = []
    try:
        path, manifest = latest_valid(run_dir)
        step = int(manifest["step"])
        if 0 < cfg.trainer.max_steps < step:  # (equal: a finished run, nothing left to train)
            problems.append(
                Problem(
                    "trainer.max_steps",
                    f"{cfg.trainer.max_steps} is below step {step} of the checkpoint being resumed ({path}): "
                    f"a resume trains further; allowed: {step} or more",
                )
            )
    except CheckpointError as e:
        # a disk EPS commits after every step: its commit record is the run's checkpoint (the trainer
        # resumes from it when no full checkpoint is newer)
        kind = TIERS.get(str(cfg.eps.tier))
        if kind is None or not kind.committed(cfg):
            return [Problem("trainer.resume", str(e))]
    else:
        problems += base_problems(cfg, manifest.get("base"), path)
    old = _resolved(saved)
    where = f"the run being resumed ({run_dir})"
    fixed = fixed_problems(saved, cfg, run_dir, FIXED, "resumed")
    if any(p.key == "peft.name" for p in fixed):  # adapters on or off: that one line, not each peft key
        fixed = [p for p in fixed if not p.key.startswith("peft.") or p.key == "peft.name"]
    problems += fixed
    was, now = MODES.get(str(old.get("mode.name"))), MODES.get(cfg.mode.name)
    if was is not None and now is not None and was.state_layout != now.state_layout:
        problems.append(
            Problem(
                "mode",
                f"{now.name} here, {was.name} in {where}: its checkpoints hold {was.name}'s state "
                f"layout ({was.state_layout}), {now.name} needs {now.state_layout}; resume with a mode "
                f"of the same family or start a new run",
            )
        )
    old_global = _int(old.get("batch.size")) * _int(old.get("dist.nproc"), 1)
    new_global = cfg.batch.size * cfg.dist.nproc
    if old_global and old_global != new_global:
        problems.append(
            Problem(
                "batch.size",
                f"a global batch of {new_global} (batch.size x dist.nproc) here, "
                f"{old_global} in {where}: the data position would not match",
            )
        )
    return problems


def base_problems(cfg: DictConfig, recorded: dict[str, Any] | None, where: Path) -> list[Problem]:
    """A LoRA run's adapter resumed on a base whose files differ from the ones it was trained on
    (``recorded``: the checkpoint's fingerprint), before any work; ``peft.allow_base_change`` allows it."""
    if recorded is None or cfg.peft.name == "none" or cfg.peft.allow_base_change:
        return []
    from l2l_cli.checkpoint import BaseChanged, check_base
    from l2l_cli.models import PretrainedUnavailable
    from l2l_cli.models.hf import base_fingerprint

    try:
        check_base(recorded, base_fingerprint(cfg.model.pretrained) if cfg.model.pretrained else None, where)
    except BaseChanged as e:
        return [Problem("model.pretrained", str(e))]
    except (PretrainedUnavailable, OSError):
        return []  # model.pretrained's own check says why
    return []


def _int(v: Any, default: int = 0) -> int:
    return v if isinstance(v, int) else default


def changed(saved: DictConfig, cfg: DictConfig) -> dict[str, tuple[Any, Any]]:
    """key -> (the run's value, this command's) for every key that differs (for the log)."""
    old, new = _resolved(saved), _resolved(cfg)
    return {k: (old.get(k), v) for k, v in new.items() if k in old and old[k] != v and k != "trainer.resume"}


def find_latest_run(outputs: Path) -> Path:
    """``trainer.resume=latest``: the run under ``outputs`` written to most recently, by its newest
    checkpoint manifest or, for a tier that commits every step (the disk EPS: its commit record is the
    run's checkpoint), by the newest file of its state folder (``eps.path``, else the run dir's folder)."""
    from l2l_cli.checkpoint import CheckpointError, run_dir_of_checkpoint

    found: list[tuple[float, Path]] = []
    for pattern in ("**/checkpoints/step_*/manifest.json", "**/checkpoints/realtime/step_*/manifest.json"):
        found += [(m.stat().st_mtime, run_dir_of_checkpoint(m.parent)) for m in outputs.glob(pattern)]
    for kind in TIERS.values():  # a state folder in its run dir (the default place), config or not
        if kind.dir_name is None:
            continue
        for folder in outputs.glob(f"**/{kind.dir_name}"):
            probe = OmegaConf.create(
                {"eps": {"path": str(folder)}, "trainer": {"resume": str(folder.parent)}}
            )
            if folder.is_dir() and kind.committed(probe):
                found.append((max(f.stat().st_mtime for f in folder.iterdir()), folder.parent))
    for hydra in outputs.glob("**/.hydra/config.yaml"):  # an eps.path outside the run dir
        run = hydra.parent.parent
        try:
            cfg = saved_config(run)
            kind = TIERS.get(str(OmegaConf.select(cfg, "eps.tier")))
            if kind is None or kind.dir_name is None:
                continue
            cfg.trainer.resume = str(run)  # where the tier looks for the state a resume continues
            if not kind.committed(cfg):
                continue
            path = OmegaConf.select(cfg, "eps.path")
            folder = Path(str(path)).expanduser() if path else run / kind.dir_name
            found.append((max(f.stat().st_mtime for f in folder.iterdir()), run))
        except (NoSavedConfig, OmegaConfBaseException, OSError, ValueError):
            continue  # not a run of such a tier, or one being written: the manifests decide
    if not found:
        raise CheckpointError(f"trainer.resume=latest: no checkpoint under {outputs}/")
    return max(found, key=lambda x: x[0])[1]
