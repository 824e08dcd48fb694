"""LoRA adapters on a frozen base (``peft=lora``), for every family: a model's spec seen with PEFT's LoRA
layers injected into each layer it builds.

:func:`with_lora` returns the family's spec as a subclass of its own class (so every ``isinstance`` check
and every family method still holds) whose layers carry ``peft``'s ``lora.Linear`` wrappers around the
targeted ``nn.Linear`` / ``Conv1D`` modules. The base weights are built exactly as without adapters (the
family's own seeded init, or a checkpoint), the adapters from a seed of their own with PEFT's default init
(``lora_A`` Kaiming-uniform, ``lora_B`` zero). Parameter names inside a layer are PEFT's
(``q_proj.base_layer.weight``, ``q_proj.lora_A.default.weight``); :meth:`LoraSpecMixin.hf_name` gives a base
tensor its checkpoint name, and :func:`peft_key` an adapter tensor its name in ``adapter_model.safetensors``.

Why ``peft``: its modules are what a PEFT user trains and loads (``PeftModel.from_pretrained``), so the
forward, the scaling and the saved layout are the ecosystem's own, not a re-implementation. This file
imports no torch at module level; the ``peft.*`` settings and their rules are in ``lora_settings.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from l2l_cli.models.base import BLOCK, POST, PRE, ModelSpec
from l2l_cli.models.lora_settings import ALL_LINEAR, LoraSettings, listed, settings_dict
from l2l_cli.problems import Problem

if TYPE_CHECKING:
    import torch
    from torch import nn

ADAPTER = "default"  # PEFT's adapter name inside the modules (dropped in the saved file's keys)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
SEQ_CLS = "SEQ_CLS"  # PEFT's task type of a sequence classifier (ModelSpec.peft_task_type)
DORA = "lora_magnitude_vector"  # DoRA's magnitude (peft.use_dora)
ADAPTER_PARTS = ("lora_A", "lora_B", DORA)  # an adapted module's trained tensors


def lora_of(spec: ModelSpec) -> LoraSettings | None:
    """The spec's LoRA settings (None: a plain model, every parameter trained)."""
    return getattr(spec, "lora", None)


# ---- which modules get adapters ---------------------------------------------------------------------


def _is_linear(m: Any) -> bool:
    from torch import nn

    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


def _excluded(kind: str, name: str, spec: ModelSpec) -> bool:
    """``all-linear`` leaves out the output layer, as PEFT does: the family's head (``peft_head``: a
    decoder's LM head, a classifier)."""
    return kind == POST and name.rpartition(".")[2] in spec.peft_head


def for_model(spec: ModelSpec, lora: LoraSettings) -> LoraSettings:
    """``lora`` as PEFT applies it to ``spec``: a sequence classifier's head joins ``modules_to_save``
    (PEFT's ``PeftModelForSequenceClassification`` adds it), so it trains and is saved with the adapter;
    a language model's settings stay as given."""
    if spec.peft_task_type != SEQ_CLS:
        return lora
    return replace(lora, modules_to_save=tuple(dict.fromkeys((*lora.modules_to_save, *spec.peft_head))))


def _matches(name: str, target: str) -> bool:
    """PEFT's rule for a list of names: the module's name is the target or ends with ``.target``."""
    return name == target or name.endswith("." + target)


def linear_names(spec: ModelSpec, kind: str) -> list[str]:
    """Names of the linear modules of a layer of ``kind`` (the family's own module, no adapters)."""
    return [n for n, m in _plain_layer(spec, kind).named_modules() if n and _is_linear(m)]


def targets(spec: ModelSpec, kind: str, lora: LoraSettings) -> list[str]:
    """The modules of a layer of ``kind`` that get an adapter."""
    names = linear_names(spec, kind)
    if lora.target_modules == ALL_LINEAR:
        return [n for n in names if not _excluded(kind, n, spec)]
    return [n for n in names if any(_matches(n, t) for t in lora.target_modules)]


def problems(spec: ModelSpec, lora: LoraSettings) -> list[Problem]:
    """A target or a module to save that the model does not have (checked on meta-device layers)."""
    p: list[Problem] = []
    kinds = (PRE, BLOCK, POST)
    linear = {k: linear_names(spec, k) for k in kinds}
    if lora.target_modules != ALL_LINEAR:
        have = sorted({n.rpartition(".")[2] for k in kinds for n in linear[k]})
        for t in lora.target_modules:
            if not any(_matches(n, t) for k in kinds for n in linear[k]):
                p.append(
                    Problem(
                        "peft.target_modules",
                        f"{t!r} is no linear module of this {spec.family} model; its linear modules: "
                        f"{', '.join(have)} (or all-linear)",
                    )
                )
        if not lora.target_modules:
            p.append(Problem("peft.target_modules", "is empty; name modules to adapt, or all-linear"))
    modules = {k: [n for n, _ in _plain_layer(spec, k).named_modules() if n] for k in kinds}
    for t in lora.modules_to_save:
        if not any(_matches(n, t) for k in kinds for n in modules[k]):
            p.append(Problem("peft.modules_to_save", f"{t!r} is no module of this {spec.family} model"))
    return p


def _plain_layer(spec: ModelSpec, kind: str) -> nn.Module:
    base = getattr(type(spec), "_base", type(spec))
    return base.new_layer(spec, kind, "meta")


# ---- the spec with adapters ---------------------------------------------------------------------------


class LoraSpecMixin:
    """What changes in a family's spec when its layers carry adapters (mixed in before the family's class:
    ``with_lora``)."""

    lora: LoraSettings
    _base: type

    def adapt(self, layer: nn.Module, kind: str) -> nn.Module:
        """Inject PEFT's LoRA layers into ``layer`` (a layer of ``kind``, the family's module) in place;
        mark the adapters and ``modules_to_save`` trainable, the base frozen."""
        import warnings

        from peft import LoraConfig, inject_adapter_in_model

        lora = self.lora
        names = targets(self, kind, lora)  # type: ignore[arg-type]
        if names:
            conf = LoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=names,
                fan_in_fan_out=self.peft_fan_in_fan_out,
                bias="none",
                use_rslora=lora.use_rslora,
                init_lora_weights=lora.peft_init,
                use_dora=lora.use_dora,
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                layer = inject_adapter_in_model(conf, layer, adapter_name=ADAPTER)
        for n, p in layer.named_parameters():
            p.requires_grad_(self.trainable(n))
        return layer

    def trainable(self, name: str) -> bool:
        """Whether a layer's parameter ``name`` trains: an adapter (and DoRA's magnitude), or a module of
        ``modules_to_save``."""
        if any(f".{part}." in name for part in ADAPTER_PARTS):
            return True
        owner = name.rpartition(".")[0]
        return any(_matches(owner, t) or f".{t}." in f".{owner}." for t in self.lora.modules_to_save)

    def trainable_names(self, kind: str) -> list[str]:
        return [n for n, _ in self.new_layer(kind, "meta").named_parameters() if self.trainable(n)]

    def new_layer(self, kind: str, device: torch.device | str | None = None) -> nn.Module:
        return self.adapt(self._base.new_layer(self, kind, device), kind)

    def build_layer(self, index: int, seed: int, device: torch.device | str | None = None) -> nn.Module:
        """The family's layer ``index`` exactly as without adapters (its own seeded init), then the
        adapters, seeded per layer from a seed of their own."""
        import math

        import torch

        from l2l_cli.models.bert import layer_seed

        base, gaussian = self._base, self.lora.init_lora_weights == "gaussian"
        kind = self.kind(index)  # type: ignore[attr-defined]
        layer = self.adapt(base.init_layer(self, base.new_layer(self, kind, device), index, seed), kind)
        g = torch.Generator().manual_seed(layer_seed(seed + 7_777_777, index))
        with torch.no_grad():
            for n, p in layer.named_parameters():
                if ".lora_A." in n and gaussian:  # PEFT's gaussian: normal_(std=1/r)
                    p.copy_(torch.randn(p.shape, generator=g) / self.lora.r)
                elif ".lora_A." in n:  # PEFT's default: kaiming_uniform_(a=sqrt(5)), as nn.Linear's
                    bound = 1.0 / math.sqrt(p.shape[1])
                    p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=g))
                elif ".lora_B." in n:
                    p.zero_()
        return layer

    def hf_name(self, index: int, name: str) -> str:
        """A base tensor's checkpoint name (PEFT's ``base_layer`` dropped); an adapter's keeps its path."""
        return self._base.hf_name(self, index, name.replace(".base_layer.", "."))

    def identity(self) -> dict[str, Any]:
        ident = dict(self._base.identity(self))
        lo = self.lora
        ident["peft"] = {
            "r": lo.r,
            "alpha": lo.alpha,
            "target_modules": list(listed(lo.target_modules)),
            "modules_to_save": list(lo.modules_to_save),
            **({"use_rslora": True} if lo.use_rslora else {}),  # (checkpoints before them: absent)
            **({"use_dora": True} if lo.use_dora else {}),
        }
        return ident

    def base_fingerprint(self) -> dict[str, Any] | None:
        return self.lora.base_fingerprint

    def save_hf(
        self, out_dir: Path, named_tensors: Iterable[tuple[str, torch.Tensor]], task: Any = None
    ) -> None:
        """final/ of a LoRA run: the adapter in PEFT's layout (``adapter_config.json``,
        ``adapter_model.safetensors``), which ``PeftModel.from_pretrained(base, dir)`` loads."""
        save_adapter(self, out_dir, named_tensors)  # type: ignore[arg-type]


_CLASSES: dict[type, type] = {}


def with_lora(spec: ModelSpec, lora: LoraSettings) -> ModelSpec:
    """``spec`` whose layers carry LoRA adapters (the family's class, with :class:`LoraSpecMixin` first)."""
    base = type(spec)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(f"Lora{base.__name__}", (LoraSpecMixin, base), {"_base": base})
    new = object.__new__(cls)
    new.__dict__.update(spec.__dict__)
    object.__setattr__(new, "lora", for_model(spec, lora))
    return new


def base_spec(spec: ModelSpec) -> ModelSpec:
    """The family's own spec under a LoRA one (the same sizes, no adapters)."""
    base = getattr(type(spec), "_base", None)
    if base is None:
        return spec
    new = object.__new__(base)
    new.__dict__.update({k: v for k, v in spec.__dict__.items() if k != "lora"})
    return new


# ---- PEFT's saved layout ------------------------------------------------------------------------------


def peft_key(hf_name: str) -> str:
    """The key of a trainable tensor (by its ``hf_name``) in PEFT's ``adapter_model.safetensors`` (the
    adapter's name dropped, as PEFT saves it; DoRA's magnitude as ``...lora_magnitude_vector``)."""
    hf_name = hf_name.replace(f".{DORA}.{ADAPTER}.weight", f".{DORA}")
    for part in ADAPTER_PARTS:
        hf_name = hf_name.replace(f".{part}.{ADAPTER}.", f".{part}.")
    return PEFT_PREFIX + hf_name


def from_peft_key(key: str) -> str:
    """The inverse of :func:`peft_key`: a saved adapter tensor's ``hf_name``."""
    name = key.removeprefix(PEFT_PREFIX)
    if name.endswith(f".{DORA}"):
        return f"{name}.{ADAPTER}.weight"
    for part in ADAPTER_PARTS:
        name = name.replace(f".{part}.", f".{part}.{ADAPTER}.")
    return name


def adapter_config(spec: ModelSpec, lora: LoraSettings) -> dict[str, Any]:
    """adapter_config.json as PEFT's ``save_pretrained`` writes it: the ``LoraConfig``, the family's task
    type, ``inference_mode`` true, and the base (``base_model_name_or_path``: the checkpoint's directory
    or hub id, and ``revision``, a hub snapshot's commit), so ``AutoPeftModelFor...from_pretrained(dir)``
    finds it with no other argument."""
    from peft import LoraConfig

    kinds, base = (PRE, BLOCK, POST), lora.base_fingerprint or {}
    if lora.target_modules == ALL_LINEAR:  # resolved: the leaf names of the modules adapted
        names = sorted({n.rpartition(".")[2] for k in kinds for n in targets(spec, k, lora)})
    else:
        names = list(lora.target_modules)
    conf = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=names,
        modules_to_save=list(lora.modules_to_save) or None,
        fan_in_fan_out=spec.peft_fan_in_fan_out,
        bias="none",
        task_type=spec.peft_task_type,
        use_rslora=lora.use_rslora,
        init_lora_weights=lora.peft_init,
        use_dora=lora.use_dora,
        base_model_name_or_path=base.get("name_or_path"),
        revision=base.get("revision"),
        inference_mode=True,
    )
    d = conf.to_dict()
    for k, v in list(d.items()):
        if isinstance(v, set):
            d[k] = sorted(v)
    return d


def save_adapter(spec: ModelSpec, out_dir: Path, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` (the trainable tensors only; base
    tensors in ``named_tensors`` are skipped), and the fingerprint of the base it needs, if it has one."""
    import torch
    from safetensors.torch import save_file

    from l2l_cli.checkpoint import FINGERPRINT_FILE

    lora = lora_of(spec)
    assert lora is not None
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        peft_key(n): t.detach().to("cpu", torch.float32).contiguous().clone()
        for n, t in named_tensors
        if _trainable_hf(spec, n)
    }
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(spec, lora), indent=2, sort_keys=True))
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    if lora.base_fingerprint is not None:
        (out_dir / FINGERPRINT_FILE).write_text(json.dumps(lora.base_fingerprint, indent=1, sort_keys=True))


def _trainable_hf(spec: ModelSpec, hf_name: str) -> bool:
    return spec.trainable(hf_name)  # type: ignore[attr-defined]  (the same suffix rules hold on full names)


def is_adapter_dir(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file() and (path / ADAPTER_WEIGHTS).is_file()


def read_adapter(path: Path) -> dict[str, torch.Tensor]:
    """An adapter directory's tensors by ``hf_name``."""
    from safetensors.torch import load_file

    return {from_peft_key(k): v for k, v in load_file(str(path / ADAPTER_WEIGHTS)).items()}


def trainable_hf_names(spec: ModelSpec) -> Iterator[str]:
    """Every trainable tensor's ``hf_name`` (what an adapter directory must hold)."""
    tied = spec.tied_params()
    for i in range(spec.num_all_layers):
        kind = spec.kind(i)
        for n in spec.trainable_names(kind):  # type: ignore[attr-defined]
            if not (kind == POST and n in tied):
                yield spec.hf_name(i, n)


def param_split(spec: ModelSpec) -> tuple[int, int]:
    """(trainable, frozen) parameters of the whole model (a tied head's tensor counted once)."""
    tied = spec.tied_params()
    counts = {}
    for kind in (PRE, BLOCK, POST):
        t = f = 0
        for n, p in spec.new_layer(kind, "meta").named_parameters():
            if kind == POST and n in tied:
                continue
            if spec.trainable(n):  # type: ignore[attr-defined]
                t += p.numel()
            else:
                f += p.numel()
        counts[kind] = (t, f)
    blocks = spec.num_layers
    return (
        counts[PRE][0] + blocks * counts[BLOCK][0] + counts[POST][0],
        counts[PRE][1] + blocks * counts[BLOCK][1] + counts[POST][1],
    )


def summary_section(spec: ModelSpec, host_parts: dict[str, int] | None) -> dict[str, Any]:
    """summary.json's ``peft`` section: the settings, the parameters trained and frozen, and (where an EPS
    holds them) the host bytes of the adapters' state and of the frozen base, per parameter of the model."""
    lora = lora_of(spec)
    assert lora is not None
    trainable, frozen = param_split(spec)
    out: dict[str, Any] = {**settings_dict(lora), "trainable_params": trainable, "frozen_params": frozen}
    if host_parts:
        base = host_parts.get("frozen_base", 0)
        state = sum(v for k, v in host_parts.items() if k not in ("frozen_base", "cpu_stash"))
        out.update(
            adapter_host_bytes=state,
            base_host_bytes=base,
            host_bytes_per_param=(state + base) / max(1, trainable + frozen),
        )
    return out


# ---- merging ----------------------------------------------------------------------------------------


def merged_tensors(
    spec: ModelSpec, layers: Iterable[tuple[int, nn.Module]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The base weights with each adapter merged in (PEFT's own ``merge``), by their checkpoint names:
    a plain model's tensors. ``layers``: (index, a CPU layer module holding base and adapters)."""
    import torch
    from peft.tuners.lora import LoraLayer

    tied = spec.tied_params()
    for i, layer in layers:
        with torch.no_grad():
            for m in layer.modules():
                if isinstance(m, LoraLayer):
                    m.merge(adapter_names=[ADAPTER])
        for n, p in layer.named_parameters():
            if any(f".{part}." in n for part in ADAPTER_PARTS) or (spec.kind(i) == POST and n in tied):
                continue
            yield spec.hf_name(i, n), p.detach().to(torch.float32)


def refresh_dora(runner: Any, spec: ModelSpec) -> None:
    """DoRA's magnitudes set from the base the run starts on (PEFT's init: each output channel's norm of
    ``W + scaling·B·A``), once it is in place: the checkpoint's weights, and a low-bit base as stored (what
    the forward reads), not the seeded fp32 layers the adapters were injected into. No-op without DoRA."""
    lora = lora_of(spec)
    if lora is None or not lora.use_dora:
        return
    import torch
    from peft.tuners.lora import LoraLayer

    out = {}
    for i, layer in runner.full_layers():
        with torch.no_grad():
            for name, m in layer.named_modules():
                if isinstance(m, LoraLayer) and ADAPTER in m.lora_magnitude_vector:
                    dora, a, b = m.lora_magnitude_vector[ADAPTER], m.lora_A[ADAPTER], m.lora_B[ADAPTER]
                    dora.update_layer(
                        base_layer=m.get_base_layer(),
                        lora_A=a.weight,
                        lora_B=b.weight,
                        scaling=m.scaling[ADAPTER],
                    )
                    out[spec.hf_name(i, f"{name}.{DORA}.{ADAPTER}.weight")] = dora.weight.clone()
    runner.load_hf(out)
