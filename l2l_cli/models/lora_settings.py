"""``peft.*`` as LoRA takes them (``peft=lora``): the settings the model, the EPS and the frozen base read,
and the keys' own rules for the config's checker. No torch at import: the config's checks read these."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from l2l_cli.problems import Problem

ALL_LINEAR = "all-linear"
LOW_BIT = ("int8", "nf4")
# peft.init_lora_weights: PEFT's default (lora_A Kaiming-uniform, lora_B zero), or lora_A ~ N(0, 1/r)
INITS = ("true", "gaussian")


def init_name(value: Any) -> str:
    """``peft.init_lora_weights`` as given (YAML's ``true`` is a bool) by its name in :data:`INITS`."""
    return "true" if value is True else str(value).lower()


@dataclass(frozen=True)
class LoraSettings:
    """``peft.*`` as the model and the EPS take them."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ALL_LINEAR  # module names, or "all-linear"
    modules_to_save: tuple[str, ...] = ()
    base_dtype: str = "fp32"
    base_source: str = "host"
    # the run loads a checkpoint (model.pretrained) over the built base: the frozen base is stored from
    # the checkpoint's tensors, not first from the seeded init it replaces (engine/frozen.py)
    base_from_checkpoint: bool = False
    # the fingerprint of that checkpoint (checkpoint/fingerprint.py): recorded with the adapter, checked
    # when it is read back; None: a base built from the seed
    base_fingerprint: dict[str, Any] | None = None
    allow_base_change: bool = False  # peft.allow_base_change: read the adapter back on another base
    use_rslora: bool = False  # rank-stabilized LoRA: the update scaled by alpha / sqrt(r)
    init_lora_weights: str = INITS[0]  # true (PEFT's default) | gaussian
    use_dora: bool = False  # DoRA: a trained magnitude per output channel beside the adapters

    @classmethod
    def from_cfg(
        cls, p: Any, base_from_checkpoint: bool = False, base_fingerprint: dict[str, Any] | None = None
    ) -> LoraSettings:
        return cls(
            r=int(p.r),
            alpha=float(p.alpha),
            dropout=float(p.dropout),
            target_modules=names_of(p.target_modules),
            modules_to_save=names_of(p.modules_to_save) or (),  # type: ignore[arg-type]
            base_dtype=str(p.base_dtype),
            base_source=str(p.base_source),
            base_from_checkpoint=base_from_checkpoint,
            base_fingerprint=base_fingerprint,
            allow_base_change=bool(p.allow_base_change),
            use_rslora=bool(p.use_rslora),
            init_lora_weights=init_name(p.init_lora_weights),
            use_dora=bool(p.use_dora),
        )

    @property
    def peft_init(self) -> bool | str:
        """``init_lora_weights`` as PEFT's ``LoraConfig`` takes it."""
        return True if self.init_lora_weights == INITS[0] else self.init_lora_weights

    @property
    def low_bit(self) -> bool:
        return self.base_dtype in LOW_BIT

    @property
    def base_on_disk(self) -> bool:
        return on_disk(self.base_source)


def on_disk(source: str) -> bool:
    """``peft.base_source`` reads the frozen base from files (its second value, ``disk``)."""
    from l2l_cli.config.schema import BASE_SOURCES

    return source == BASE_SOURCES[1]


def names_of(value: Any) -> tuple[str, ...] | str:
    """``peft.target_modules`` / ``modules_to_save`` as given: a list, a comma-separated string, or
    ``all-linear``; empty / unset -> ()."""
    if value is None:
        return ()
    if isinstance(value, str):
        if value.strip() == ALL_LINEAR:
            return ALL_LINEAR
        return tuple(s.strip() for s in value.split(",") if s.strip())
    return tuple(str(v).strip() for v in value)


def listed(v: tuple[str, ...] | str) -> tuple[str, ...]:
    """``target_modules`` as a tuple (``all-linear`` as its one name)."""
    return (v,) if isinstance(v, str) else v


def settings_dict(lora: LoraSettings) -> dict[str, Any]:
    """The settings as summary.json's ``peft`` section shows them."""
    d = asdict(lora)
    d.pop("base_from_checkpoint")
    d.pop("allow_base_change")
    d["init_lora_weights"] = lora.peft_init
    d["target_modules"] = list(listed(lora.target_modules))
    d["modules_to_save"] = list(lora.modules_to_save)
    return d


def key_problems(p: Any) -> list[Problem]:
    """``peft.*`` values (the config's checker adds the rules that involve the mode and the model)."""
    from l2l_cli.config.schema import BASE_DTYPES, BASE_SOURCES, PEFT_METHODS
    from l2l_cli.problems import one_of

    out: list[Problem] = []
    one_of(out, "peft.name", p.name, PEFT_METHODS)
    one_of(out, "peft.base_dtype", p.base_dtype, BASE_DTYPES)
    one_of(out, "peft.base_source", p.base_source, BASE_SOURCES)
    if p.name == "none":
        return out
    if not isinstance(p.r, int) or p.r < 1:
        out.append(Problem("peft.r", f"got {p.r}; must be an integer >= 1"))
    if not p.alpha > 0:
        out.append(Problem("peft.alpha", f"got {p.alpha}; must be > 0"))
    if not (0.0 <= p.dropout < 1.0):
        out.append(Problem("peft.dropout", f"got {p.dropout}; must be in [0, 1)"))
    if init_name(p.init_lora_weights) not in INITS:
        out.append(
            Problem(
                "peft.init_lora_weights",
                f"got {p.init_lora_weights!r}; allowed: true (PEFT's default: lora_A Kaiming-uniform, "
                "lora_B zero), gaussian (lora_A ~ N(0, 1/r), lora_B zero)",
            )
        )
    if p.base_dtype == "nf4":
        why = nf4_unavailable()
        if why:
            out.append(
                Problem("peft.base_dtype", f"nf4 needs torchao's NF4 tensor (pip install torchao): {why}")
            )
    return out


def base_folder_problems(path: str) -> list[Problem]:
    """``eps.path`` as the folder of a frozen base on disk (``<eps.path>/frozen_base``): it must be a
    directory this process can create and write, else one line naming the key (before any work)."""
    import os
    from pathlib import Path

    root = Path(path).expanduser()
    what = "the frozen base's layer files (peft.base_source=disk) go in its frozen_base/"
    base = root / "frozen_base"
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        return [Problem("eps.path", f"{root} cannot be created: {base} is not a directory; {what}")]
    st = os.statvfs(base)
    if st.f_flag & os.ST_RDONLY or not os.access(base, os.W_OK | os.X_OK):
        return [Problem("eps.path", f"{root} is not writable (read-only file system or permissions); {what}")]
    return []


def nf4_unavailable() -> str | None:
    """Why torchao's NF4 cannot be used here (None: it can)."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4  # noqa: F401
    except Exception as e:  # an absent or broken install: the run cannot quantize
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return None
