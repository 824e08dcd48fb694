"""A fuzz pass over config overrides: wrong types, out-of-range values, unknown keys and odd strings never
end in a traceback; every case exits 2 with a message naming the key."""

from __future__ import annotations

import random
from dataclasses import fields, is_dataclass

import pytest

from l2l_cli.cli import train
from l2l_cli.config import L2LConfig
from tests.util import l2l

ODD = [
    "abc",
    "",
    "1.5.3",
    "[1,2]",
    "{a: 1}",
    "ünïcödé ✓",
    "$(rm -rf /)",
    "'quoted'",
    "x" * 5000,
    "-",
    "true false",
    "\\n",
]
NON_FINITE = ["nan", "inf", "-inf", "1e400"]  # invalid for every numeric key (ints: wrong type)
OUT_OF_RANGE = [
    "model.num_layers=0", "model.num_layers=10000000", "model.hidden_size=-8", "model.num_heads=0",
    "model.dropout=1.0", "batch.size=0", "batch.ubatch_size=-2", "optim.lr=0", "optim.lr=-1e-3", "optim.beta2=1.0",
    "task.max_seq_len=2", "sim.memory_gb=0", "sim.link_gbps=-1", "trainer.max_steps=-5", "trainer.log_every=0",
    "dist.nproc=0", "dist.nproc=100000", "precision.init_scale=-1", "plan.max_transfer_overhead=1.5",
]  # fmt: skip


def schema_keys(node: object = L2LConfig, prefix: str = "") -> list[tuple[str, type]]:
    out = []
    for f in fields(node):  # type: ignore[arg-type]
        typ = (
            f.type
            if not isinstance(f.type, str)
            else eval(f.type, vars(__import__("l2l_cli.config.schema").config.schema))
        )
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            out += schema_keys(type(default), f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", typ))
    return out


KEYS = schema_keys()
NUMBERS = [k for k, t in KEYS if t in (int, float)]
STRINGS = [k for k, t in KEYS if t is str]


def cases() -> list[tuple[list[str], str]]:
    rng = random.Random(1234)
    out: list[tuple[list[str], str]] = []
    for key in NUMBERS:  # wrong types and out-of-range values, for every numeric key
        for v in rng.sample(ODD, 3) + rng.sample(NON_FINITE, 2):
            out.append(([f"{key}={v}"], key))
    for override in OUT_OF_RANGE:
        out.append(([override], override.split("=")[0]))
    for key in STRINGS:  # values outside the allowed set
        if key in ("model.name", "task.tokenizer", "hardware.name"):
            continue
        out.append(([f"{key}={rng.choice(ODD[1:])}"], key))
    for key in (
        "foo",
        "model.foo",
        "batch.ubatch",
        "trainer.max_step",
        "model.num_layers.x",
        "optim.adamw.lr",
    ):
        out.append(([f"{key}=1"], key))
        out.append(([f"+{key}=1"], key))
    for group in ("model", "mode", "precision", "task", "optim", "recipe"):
        for v in ("nope", "../../etc/passwd", "", "ＲＴＥ"):
            out.append(([f"{group}={v}"], group))
    out += [(["=5"], "=5"), (["model==x"], "model"), (["batch.size=${oc.env:HOME}"], "batch.size")]
    rng.shuffle(out)
    return out


CASES = cases()


def test_fuzz_covers_the_schema() -> None:
    assert len(NUMBERS) >= 40 and len(STRINGS) >= 12 and len(CASES) > 300


def test_fuzz_every_bad_override_exits_2_naming_the_key(capsys) -> None:
    failures = []
    for overrides, key in CASES:
        try:
            code = train(overrides)
        except BaseException as e:
            failures.append(f"{overrides}: raised {type(e).__name__}: {e}")
            continue
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        if (
            code != 2
            or not lines
            or not all(ln.startswith("l2l: config error: ") for ln in lines)
            or key not in err
        ):
            failures.append(f"{overrides}: exit {code}, stderr {err[:300]!r}")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("args", [["batch.size=abc", "+x.y=1"], ["model.hidden_size=nan"], ["task=../../x"]])
def test_fuzz_through_the_real_cli(args: list[str]) -> None:
    r = l2l("train", *args)
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr
    assert r.stderr.startswith("l2l: config error: ")
